# Generated from models/image_classification.toml by `python -m tritonkit.repository.generate`; do not edit.
from tritonkit.serving.fused_image import TritonPythonModel  # noqa: F401
