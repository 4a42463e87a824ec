"""What this machine has for TensorRT: its TensorRT version and CUDA GPUs (through the driver API alone), and the
one device per compute capability a plan is built on."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    compute_capability: tuple[int, int]
    uuid: str = ""  # "GPU-…", as CUDA_VISIBLE_DEVICES takes it

    @property
    def cc(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"


@dataclass(frozen=True)
class Environment:
    trt_version: str | None
    gpus: tuple[Gpu, ...]

    @property
    def skip_reason(self) -> str | None:
        """Why no plan can be built here, or None when TensorRT and a CUDA GPU are both present."""
        missing = []
        if self.trt_version is None:
            missing.append("`import tensorrt` failed (TensorRT is not installed in this environment)")
        elif int(self.trt_version.split(".")[0]) < 10:
            missing.append(f"TensorRT {self.trt_version} is older than 10 (explicit-quantization builds need >= 10)")
        if not self.gpus:
            missing.append("no CUDA GPU is visible (libcuda could not be loaded or reports 0 devices)")
        return "; ".join(missing) or None


def _tensorrt_version() -> str | None:
    try:
        import tensorrt as trt
    except Exception:  # ImportError, or a broken install whose libs fail to load
        return None
    return str(trt.__version__)


def _cuda_gpus() -> tuple[Gpu, ...]:
    """GPUs through the driver API alone (no torch/CUDA toolkit needed): name and compute capability."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return ()
    if cuda.cuInit(0) != 0:
        return ()
    count = ctypes.c_int()
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return ()
    gpus = []
    for index in range(count.value):
        device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        name = ctypes.create_string_buffer(128)
        cuda.cuDeviceGet(ctypes.byref(device), index)
        cuda.cuDeviceGetName(name, 128, device)
        cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)  # ..._MINOR
        raw = ctypes.create_string_buffer(16)
        uuid = ""
        if cuda.cuDeviceGetUuid(raw, device) == 0:
            h = raw.raw.hex()
            uuid = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        gpus.append(Gpu(index, name.value.decode(), (major.value, minor.value), uuid))
    return tuple(gpus)


def detect() -> Environment:
    return Environment(_tensorrt_version(), _cuda_gpus())


def plan_devices(gpus: Sequence[Gpu], wanted: Iterable[str] | None = None) -> tuple[list[Gpu], list[str]]:
    """(one device per compute capability to build on, wanted capabilities with no device here). A plan only
    runs on the capability it was built on, so each is built on a device of that capability or not at all."""
    by_cc: dict[str, Gpu] = {}
    for gpu in gpus:
        by_cc.setdefault(gpu.cc, gpu)
    wanted = sorted(set(wanted)) if wanted else sorted(by_cc)
    return [by_cc[cc] for cc in wanted if cc in by_cc], [cc for cc in wanted if cc not in by_cc]


def device_env(gpu: Gpu, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a build process that sees only `gpu` (by UUID where known: indices depend on order)."""
    env = dict(os.environ if base is None else base)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_VISIBLE_DEVICES"] = gpu.uuid or str(gpu.index)
    return env
