# Generated from models/all_mpnet_base_v2.toml by `python -m tritonkit.repository.generate`; do not edit.
from tritonkit.serving.tokenizer import TritonPythonModel  # noqa: F401
