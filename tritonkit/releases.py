"""The NGC tritonserver releases tritonkit knows: the one table of what each container runs.

Every other place that needs a release fact reads it here: `tritonkit.engines` (the TensorRT a plan must be built
by, `target_server`), `tritonkit.ngc` (the image), `tritonkit.native_check` (the upstream branch each rule is
restated from), the Dockerfile/compose defaults (a test keeps them equal to DEFAULT) and the table in
docs/container.md (a test keeps it equal to `markdown_table()`).

Where the numbers come from (snapshots of github.com/triton-inference-server):
- Triton core, ONNX Runtime and OpenVINO: server/build.py of the release branch (TRITON_VERSION_MAP in r24.10,
  DEFAULT_TRITON_VERSION_MAP later), the same ONNX Runtime numbers as server/docs/introduction/compatibility.md.
- TensorRT: not in those repositories for the -py3 image (it comes with the upstream CUDA container). 26.06 is the
  first release on TensorRT 11 (server commit d898a0fe6, "prepare server for 26.06 (versions, TRT 11 QA
  compat)"); its exact version is not in the sources, so it is None here and TRITONKIT_TENSORRT must name it.
A None field means the sources we have do not give it; nothing here is filled in by guess.

    python -m tritonkit.releases        # the table, as docs/container.md shows it
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from tritonkit.errors import TritonkitError

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
        raise ReleaseError(field, f"NGC release '{ngc}' is not in tritonkit/releases.py "
                                  f"(known: {', '.join(sorted(RELEASES))})") from None


def selected(env: Mapping[str, str] | None = None) -> Release:
    """The release $TRITONKIT_NGC_RELEASE names (DEFAULT when unset); one outside the table has no known facts."""
    ngc = (os.environ if env is None else env).get(RELEASE_ENV) or DEFAULT
    return RELEASES.get(ngc) or Release(ngc, None, None, None, None, None, "not in the table")


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
