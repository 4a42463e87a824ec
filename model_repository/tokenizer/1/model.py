# Generated from models/text_embedding.toml by `python -m tritonkit.repository.generate`; do not edit.
from tritonkit.serving.tokenizer import TritonPythonModel  # noqa: F401
