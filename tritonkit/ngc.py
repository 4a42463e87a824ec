"""The NGC tritonserver image the container path uses, named from the one release table in tritonkit.releases.

releases.DEFAULT (overridden by $TRITONKIT_NGC_RELEASE when plans are built) is 24.10, the release whose Triton
core (2.51) is the one embedded in the nvidia-pytriton wheel `make serve` runs. docker/Dockerfile's NGC_RELEASE
build argument and compose's default carry the same value (tests keep them equal); plans must be built by the
TensorRT of the image that serves them (`make build-engines-docker`).
"""

from __future__ import annotations

from tritonkit import releases

RELEASE = releases.DEFAULT
TRITON_CORE, TENSORRT = releases.get(RELEASE).triton, releases.get(RELEASE).tensorrt
BASE_IMAGE = releases.image(RELEASE)
# Our image, built FROM BASE_IMAGE by docker/Dockerfile; Kubernetes prefixes the registry (deploy/k8s/image/).
IMAGE_NAME = "tritonkit-tritonserver"
IMAGE = f"{IMAGE_NAME}:{RELEASE}"
# The variable that picks another release, for plan builds (scripts/build-engines-docker) and compose alike.
RELEASE_ENV = releases.RELEASE_ENV
