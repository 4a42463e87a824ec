"""The NGC tritonserver release the container path targets: one setting for the Dockerfile, compose and Kubernetes.

24.10 is the release whose Triton core (2.51) is the one embedded in the nvidia-pytriton wheel `make serve` runs,
so both servers read the same model configuration rules. docker/Dockerfile's `NGC_RELEASE` build argument
defaults to RELEASE (a test keeps the two equal); TensorRT plans must be built by the TensorRT of the image
that serves them.
"""

from __future__ import annotations

RELEASE = "24.10"
BASE_IMAGE = f"nvcr.io/nvidia/tritonserver:{RELEASE}-py3"
# What that release ships (its release notes): the server core and the TensorRT that builds and loads plans.
TRITON_CORE = "2.51"
TENSORRT = "10.5"
# Our image, built FROM BASE_IMAGE by docker/Dockerfile; Kubernetes prefixes the registry (deploy/k8s/image/).
IMAGE_NAME = "tritonkit-tritonserver"
IMAGE = f"{IMAGE_NAME}:{RELEASE}"
