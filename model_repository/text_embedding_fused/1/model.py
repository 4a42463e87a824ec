# Generated from models/text_embedding.toml by `python -m tritonkit.generate`; do not edit.
from tritonkit.serving.fused import TritonPythonModel  # noqa: F401
