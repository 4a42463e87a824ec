"""Python-based `openvino` backend for the embedded tritonserver: tritonkit.serving.onnx_backend on OpenVINO's CPU
plugin, reading the model's .onnx directly (parameters as the native openvino backend names them)."""

from tritonkit.serving.onnx_backend import OpenVinoModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
