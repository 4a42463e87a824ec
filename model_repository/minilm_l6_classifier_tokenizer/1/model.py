# Generated from models/minilm_l6_classifier.toml by `python -m tritonkit.repository.generate`; do not edit.
from tritonkit.serving.tokenizer import TritonPythonModel  # noqa: F401
