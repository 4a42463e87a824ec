"""The NGC tritonserver releases tritonkit knows: the one table of what each container runs, the image the
container path uses, and the server (release and TensorRT) TensorRT plans are built for.

Every other place that needs a release fact reads it here: `tritonkit.tensorrt.engines` (the TensorRT a plan must
be built by, `target_server`), `tritonkit.deploy` (the image), `tritonkit.repository.native_check` (the upstream
branch each rule is restated from), the Dockerfile/compose defaults (a test keeps them equal to DEFAULT) and the
table in docs/container.md (a test keeps it equal to `markdown_table()`).

DEFAULT (overridden by $TRITONKIT_NGC_RELEASE when plans are built) is 24.10, the release whose Triton core (2.51) is
the one embedded in the nvidia-pytriton wheel `make serve` runs. docker/Dockerfile's NGC_RELEASE build argument and
compose's default carry the same value (tests keep them equal); plans must be built by the TensorRT of the image
that serves them (`make build-engines-docker`).

Where the numbers come from (snapshots of github.com/triton-inference-server):
- Triton core, ONNX Runtime and OpenVINO: server/build.py of the release branch (TRITON_VERSION_MAP in r24.10,
  DEFAULT_TRITON_VERSION_MAP later), the same ONNX Runtime numbers as server/docs/introduction/compatibility.md.
- TensorRT: not in those repositories for the -py3 image (it comes with the upstream CUDA container). 26.06 is the
  first release on TensorRT 11 (server commit d898a0fe6, "prepare server for 26.06 (versions, TRT 11 QA
  compat)"); its exact version is not in the sources, so it is None here and TRITONKIT_TENSORRT must name it.
A None field means the sources we have do not give it; nothing here is filled in by guess.

    python -m tritonkit.release        # the table, as docs/container.md shows it
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from tritonkit.errors import EngineError, TritonkitError

UPSTREAM = "https://github.com/triton-inference-server"
# The variable that picks the release (plan builds, compose, the views' checks) and the one that names the exact
# TensorRT where the table has none.
RELEASE_ENV = "TRITONKIT_NGC_RELEASE"
TENSORRT_ENV = "TRITONKIT_TENSORRT"


class ReleaseError(TritonkitError, LookupError):
    """A release setting names no release in the table, or contradicts it; `field` names the setting."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class Release:
    """One NGC tritonserver release and what its -py3 container runs (None: not found in the sources)."""

    ngc: str
    triton: str | None
    tensorrt: str | None
    tensorrt_major: int | None
    onnxruntime: str | None
    openvino: str | None
    why: str  # one line: why tritonkit lists this release

    @property
    def branch(self) -> str:
        """The upstream release branch of every Triton repository for this container (r24.10, r26.06, ...)."""
        return f"r{self.ngc}"

    @property
    def image(self) -> str:
        return image(self.ngc)

    def url(self, repository: str, path: str) -> str:
        """A file of an upstream repository on this release's branch."""
        return f"{UPSTREAM}/{repository}/blob/{self.branch}/{path}"


def image(ngc: str) -> str:
    """NVIDIA's tritonserver image of a release (the -py3 flavour: every backend, GPU build)."""
    return f"nvcr.io/nvidia/tritonserver:{ngc}-py3"


RELEASES: dict[str, Release] = {r.ngc: r for r in (
    # TensorRT 10.5.0: NVIDIA's 24.10 release notes, as this project has served it; the server r24.10 snapshot
    # holds only the Windows build's TensorRT (10.4.0.26, Dockerfile.win10.min), not the Linux image's.
    Release("24.10", "2.51.0", "10.5.0", 10, "1.19.2", "2024.4.0",
            "the container twin of the embedded 2.51 core"),
    Release("26.06", "2.70.0", None, 11, "1.24.4", "2026.2.0",
            "TensorRT 11 arrives: strongly typed networks only, no implicit INT8"),
    Release("26.07", "2.71.0", None, 11, "1.27.0", "2026.2.0",
            "ONNX Runtime 1.27 reaches the container"),
    # The snapshots end at r26.08 (Triton 2.72.0, ONNX Runtime 1.28.0, OpenVINO 2026.3.0): 2.75 is the newest
    # release seen, one minor per monthly release as in every branch before; its TensorRT, ONNX Runtime and
    # OpenVINO are not in the sources we have.
    Release("26.11", "2.75.0", None, None, None, None, "the newest release seen"),
)}
DEFAULT = "24.10"


def get(ngc: str, field: str = RELEASE_ENV) -> Release:
    """The table's entry for `ngc`; ReleaseError naming `field` when it has none."""
    try:
        return RELEASES[ngc]
    except KeyError:
        raise ReleaseError(field, f"NGC release '{ngc}' is not in tritonkit/release.py "
                                  f"(known: {', '.join(sorted(RELEASES))})") from None


def selected(env: Mapping[str, str] | None = None) -> Release:
    """The release $TRITONKIT_NGC_RELEASE names (DEFAULT when unset); one outside the table has no known facts."""
    ngc = (os.environ if env is None else env).get(RELEASE_ENV) or DEFAULT
    return RELEASES.get(ngc) or Release(ngc, None, None, None, None, None, "not in the table")


# -- the container path's image -------------------------------------------------------------------------------

BASE_IMAGE = image(DEFAULT)
# Our image, built FROM BASE_IMAGE by docker/Dockerfile; Kubernetes prefixes the registry (deploy/k8s/image/).
IMAGE_NAME = "tritonkit-tritonserver"
IMAGE = f"{IMAGE_NAME}:{DEFAULT}"


# -- the server TensorRT plans are for ------------------------------------------------------------------------

@dataclass(frozen=True)
class ServerTarget:
    """The NGC tritonserver release that loads the plans, and the TensorRT it runs: a plan deserialises only in
    the TensorRT release that built it."""

    release: str
    triton: str
    tensorrt: str

    @property
    def image(self) -> str:
        return image(self.release)


def target_server(release: str | None = None, tensorrt: str | None = None) -> ServerTarget:
    """The one setting: TRITONKIT_NGC_RELEASE (default 24.10); TRITONKIT_TENSORRT where the table has no exact
    TensorRT for the release (26.06 on) or does not list it."""
    release = release or os.environ.get(RELEASE_ENV) or DEFAULT
    tensorrt = tensorrt or os.environ.get(TENSORRT_ENV)
    known = RELEASES.get(release)
    if tensorrt is None and (known is None or known.tensorrt is None):
        why = (f"is not in {sorted(RELEASES)}" if known is None
               else "has no exact TensorRT version in tritonkit/release.py")
        raise EngineError(f"{RELEASE_ENV}={release} {why}: set {TENSORRT_ENV} to the TensorRT "
                          f"version its release notes list")
    if known is not None and known.tensorrt_major and tensorrt and int(tensorrt.split(".")[0]) != known.tensorrt_major:
        raise EngineError(f"{TENSORRT_ENV}={tensorrt}: NGC {release} runs TensorRT {known.tensorrt_major}.x")
    return ServerTarget(release, (known and known.triton) or "?", tensorrt or known.tensorrt)


def same_tensorrt(built: str | None, server: str) -> bool:
    """Plans are tied to the exact TensorRT release (major.minor.patch) that built them."""
    return built is not None and built.split(".")[:3] == server.split(".")[:3]


def check_builder(builder_version: str, target: ServerTarget) -> None:
    if not same_tensorrt(builder_version, target.tensorrt):
        raise EngineError(f"this TensorRT is {builder_version} but NGC {target.release} runs {target.tensorrt}: a "
                          f"plan built here would not load there; build inside {target.image} "
                          f"(`make build-engines-docker`) or set TRITONKIT_NGC_RELEASE")


def check_plan_metadata(meta: Mapping, target: ServerTarget, where: str) -> None:
    if not same_tensorrt(meta.get("tensorrt"), target.tensorrt):
        raise EngineError(f"{where} was built by TensorRT {meta.get('tensorrt')}; NGC {target.release} runs "
                          f"{target.tensorrt}: rebuild it (`make build-engines-docker`)")


def markdown_table() -> str:
    """The table docs/container.md shows (a test keeps the two equal)."""
    rows = ["| NGC release | Triton | TensorRT | ONNX Runtime | OpenVINO | why listed |", "|---|---|---|---|---|---|"]
    for r in RELEASES.values():
        trt = r.tensorrt or (f"{r.tensorrt_major}.x (exact: not in sources)" if r.tensorrt_major else "not in sources")
        cells = [r.ngc + (" (default)" if r.ngc == DEFAULT else ""), r.triton or "not in sources", trt,
                 r.onnxruntime or "not in sources", r.openvino or "not in sources", r.why]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
