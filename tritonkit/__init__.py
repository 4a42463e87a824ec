"""tritonkit: PyTorch models to Triton Inference Server deployments (shared machinery)."""

__version__ = "0.1.0"
