# Generated from models/efficientnet_lite1.toml by `python -m tritonkit.repository.generate`; do not edit.
from tritonkit.serving.image_preprocess import TritonPythonModel  # noqa: F401
