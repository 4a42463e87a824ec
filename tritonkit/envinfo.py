"""What shapes an INT8 model besides its recipe: the package versions that build the graph and the CPU's INT8
features (onnxruntime picks different x86 kernels with and without VNNI). Recorded in every INT8 report and
compared before a model is served."""

from __future__ import annotations

import os
import platform
from functools import cache
from importlib import metadata
from pathlib import Path

from tritonkit.errors import CpuClassError

# Packages whose version changes the exported or quantized graph, or the kernels that run it.
GRAPH_PACKAGES = ("torch", "onnx", "onnxscript", "onnxruntime", "transformers", "tokenizers", "pillow", "numpy")
# /proc/cpuinfo flags that select onnxruntime's x86 INT8 kernels.
INT8_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8", "amx_tile")
# /proc/cpuinfo flags of native bf16 arithmetic (OpenVINO computes bf16 only with one of them).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def versions() -> dict[str, str]:
    out = {}
    for name in GRAPH_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo"), wanted: tuple[str, ...] = INT8_FLAGS) -> list[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f for f in wanted if f in flags]


# The classes of onnxruntime's x86 u8s8 GEMM: VNNI sums int8 products exactly in int32; without it (AVX-512BW,
# AVX2) pairs of products are summed in saturating int16 first, which changes both accuracy and speed.
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
CLASSES = ("vnni", "avx512", "avx2", "generic")
# The one way to make this machine act as a CPU of another class (tests of a mismatched replica; pinning a replica).
CLASS_ENV = "TRITONKIT_CPU_CLASS"
# Set to "1": this machine acts as a CPU of its class without native bf16 (tests of such a replica; pinning one).
NO_BF16_ENV = "TRITONKIT_NO_BF16"


def int8_class(features: list[str] | None = None) -> str:
    """The INT8 kernel class of this CPU (or of `features`): "vnni", "avx512", "avx2" or "generic". A served INT8
    recipe is searched, committed and replayed per class. $TRITONKIT_CPU_CLASS, when set, names this CPU's class."""
    if features is None and os.environ.get(CLASS_ENV):
        faked = os.environ[CLASS_ENV]
        if faked not in CLASSES:
            raise CpuClassError(f"${CLASS_ENV}={faked!r} is not one of {', '.join(CLASSES)}")
        return faked
    flags = set(cpu_flags() if features is None else features)
    if flags & set(VNNI_FLAGS):
        return "vnni"
    return "avx512" if "avx512bw" in flags else "avx2" if "avx2" in flags else "generic"


def int8_sums_exact(features: list[str] | None = None) -> bool:
    """Whether onnxruntime's u8s8 kernels sum int8 products exactly on this CPU (VNNI); elsewhere a served session
    asks for the exact path (tritonkit.serving.backend_utils.EXACT_INT8_ENTRY)."""
    return int8_class(features) == "vnni"


def openvino_quantizes_at_run_time(features: list[str] | None = None) -> bool:
    """Whether OpenVINO's CPU plugin can quantize a compressed-weight layer's activations at run time here: it
    needs AVX2-VNNI or AVX-512 VNNI (dnnl_fullyconnected's useDynamicQuantizationImpl); read from the CPU itself,
    never from a faked class."""
    return bool(set(cpu_flags() if features is None else features) & {"avx512_vnni", "avx_vnni"})


def has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (no runtime offers bf16 without it). bf16 exists only on AVX-512
    CPUs, so a class faked as "avx2" or "generic" has none, nor one with $TRITONKIT_NO_BF16=1."""
    if os.environ.get(NO_BF16_ENV) == "1":
        return False
    return bool(cpu_flags(wanted=BF16_FLAGS)) and int8_class() in ("vnni", "avx512")


@cache
def fingerprint() -> dict:
    return {"packages": versions(), "cpu_int8_features": cpu_flags(), "machine": platform.machine(),
            "python": platform.python_version()}


def differences(recorded: dict, current: dict | None = None) -> list[str]:
    """Human-readable differences between a report's environment and this one (empty: same)."""
    current = current or fingerprint()
    diffs = []
    for name, version in current["packages"].items():
        was = recorded.get("packages", {}).get(name)
        if was != version:
            diffs.append(f"{name} {was} -> {version}")
    if sorted(recorded.get("cpu_int8_features", [])) != sorted(current["cpu_int8_features"]):
        diffs.append(f"CPU INT8 features {recorded.get('cpu_int8_features')} -> {current['cpu_int8_features']}")
    return diffs


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name and core count as the kernel reports them (a machine's label in every measurement)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    cores = sum(1 for line in text.splitlines() if line.startswith("processor"))
    return f"{name}, {cores} cores, {int8_class()}"
