"""What this machine has for TensorRT, found without tritonkit.tensorrt, for the tests that check its detection."""

from __future__ import annotations

import subprocess
from pathlib import Path


def this_machine() -> tuple[str | None, int]:
    """(TensorRT version, GPU count) found without tritonkit.tensorrt: the installed distribution's metadata and
    nvidia-smi (or the device nodes where there is none), so a broken detect() cannot vouch for itself."""
    import importlib.metadata
    import shutil

    names = ("tensorrt", "tensorrt-cu11", "tensorrt-cu12", "tensorrt-cu13")
    trt = next((d.version for d in importlib.metadata.distributions() if (d.metadata["Name"] or "").lower() in names),
               None)
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        gpus = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    else:
        gpus = len([d for d in Path("/dev").glob("nvidia[0-9]*")])
    return trt, gpus
