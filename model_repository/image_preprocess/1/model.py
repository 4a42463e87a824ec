# Generated from models/image_classification.toml by `python -m tritonkit.repository.generate`; do not edit.
from tritonkit.serving.image_preprocess import TritonPythonModel  # noqa: F401
