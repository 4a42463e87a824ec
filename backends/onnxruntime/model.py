"""Python-based `onnxruntime` backend for the embedded tritonserver: tritonkit.serving.onnx_backend on ONNX Runtime's
CPU provider (parameters as the native onnxruntime backend names them; the module says which)."""

from tritonkit.serving.onnx_backend import OnnxRuntimeModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
