"""TensorRT plans from the built ONNX artefacts, their validation, and Triton configs that serve them.

Precision paths by TensorRT major version (TensorRT 11 removed implicit INT8 calibration and the INT8/FP16
builder flags):

| precision | TensorRT 10                                   | TensorRT 11                                       |
|-----------|-----------------------------------------------|---------------------------------------------------|
| int8      | Q/DQ ONNX, weakly typed, flags INT8 + FP16    | Q/DQ ONNX, strongly typed network, no flags       |
| fp16      | FP32 ONNX, flag FP16                          | FP16-cast ONNX (I/O kept FP32), strongly typed    |

Everything except `build_plan` and the TensorRT side of `validate_plan` runs without TensorRT or a GPU, so it
is unit-tested on CPU machines; where either is missing, `make build-engines` prints what it skipped and why.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tritonkit import paths
from tritonkit.errors import EngineError
from tritonkit.release import ServerTarget, check_builder, check_plan_metadata, target_server
from tritonkit.repository.config import load_config, to_pbtxt

PRECISIONS = ("int8", "fp16")
TIMING_CACHE = paths.ARTIFACTS / "trt_timing.cache"
BATCH_AXIS = "batch"


# -- environment ---------------------------------------------------------------------------------------------

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


# -- what to build -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BuildRecipe:
    precision: str
    onnx_source: str  # "fp32" (exported graph), "int8_qdq" (calibrated Q/DQ graph), "fp16_cast"
    strongly_typed: bool
    builder_flags: tuple[str, ...] = ()


def recipe_for(trt_version: str, precision: str) -> BuildRecipe:
    """Version dispatch: TensorRT 10 keeps precision flags; 11 only builds strongly typed networks."""
    major = int(trt_version.split(".")[0])
    if major < 10:
        raise EngineError(f"TensorRT {trt_version} is not supported (need 10 or 11)")
    if precision == "int8":
        if major == 10:
            return BuildRecipe("int8", "int8_qdq", strongly_typed=False, builder_flags=("INT8", "FP16"))
        return BuildRecipe("int8", "int8_qdq", strongly_typed=True)
    if precision == "fp16":
        if major == 10:
            return BuildRecipe("fp16", "fp32", strongly_typed=False, builder_flags=("FP16",))
        return BuildRecipe("fp16", "fp16_cast", strongly_typed=True)
    raise EngineError(f"unknown precision '{precision}' (choose from {', '.join(PRECISIONS)})")


@dataclass(frozen=True)
class Profile:
    """One TensorRT optimisation profile: input name → (min, opt, max) shape."""

    name: str
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def onnx_input_dims(onnx_path: Path) -> dict[str, list[int | str]]:
    """Input name → dims, a dim being an int or its dynamic axis name."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}
    return {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in model.graph.input
        if i.name not in initializers
    }


def profiles_for(
    dims: Mapping[str, Sequence[int | str]], max_batch_size: int, axis_max: Mapping[str, int]
) -> list[Profile]:
    """Profiles named by use case; all share min/max so any request fits any profile, only `opt` differs.

    low_latency: batch 1, a short sequence. throughput: the largest batch. Models with another dynamic axis
    (a sequence) get throughput_short / throughput_long, tuned for short and long inputs.
    """
    other_axes = sorted({d for ds in dims.values() for d in ds if isinstance(d, str) and d != BATCH_AXIS})
    for axis in other_axes:
        if axis not in axis_max:
            raise EngineError(f"dynamic axis '{axis}' has no maximum (known: {sorted(axis_max)})")

    def dim_range(d: int | str, opt_batch: int, opt_fraction: float) -> tuple[int, int, int]:
        if d == BATCH_AXIS:
            return 1, opt_batch, max_batch_size
        if isinstance(d, str):
            return 1, max(1, round(axis_max[d] * opt_fraction)), axis_max[d]
        return d, d, d

    def shapes(opt_batch: int, opt_fraction: float) -> dict:
        out = {}
        for name, ds in dims.items():
            ranges = [dim_range(d, opt_batch, opt_fraction) for d in ds]
            out[name] = tuple(tuple(r[i] for r in ranges) for i in range(3))
        return out

    if not other_axes:
        return [Profile("low_latency", shapes(1, 1.0)), Profile("throughput", shapes(max_batch_size, 1.0))]
    return [
        Profile("low_latency", shapes(1, 0.25)),
        Profile("throughput_short", shapes(max_batch_size, 0.25)),
        Profile("throughput_long", shapes(max(1, max_batch_size // 4), 1.0)),
    ]


def plan_filename(gpu: Gpu | tuple[int, int]) -> str:
    major, minor = gpu.compute_capability if isinstance(gpu, Gpu) else gpu
    return f"model_sm{major}{minor}.plan"


def trt_model_name(onnx_model: str, precision: str) -> str:
    # text_encoder → text_encoder_trt_int8; "_fp32"-suffixed source models drop the suffix first.
    base = onnx_model.removesuffix("_fp32")
    return f"{base}_trt_{precision}"


# -- Triton configs for the plans ----------------------------------------------------------------------------

def trt_model_config(onnx_model_dir: Path, precision: str, plans: Mapping[str, str], profile: int = 0):
    """The ORT model's config turned into a `tensorrt_plan` one: same tensors, GPU instances, per-cc plans."""
    from tritonclient.grpc import model_config_pb2 as mc

    src = load_config(Path(onnx_model_dir) / "config.pbtxt")
    cfg = mc.ModelConfig()
    cfg.CopyFrom(src)
    cfg.name = trt_model_name(src.name, precision)
    cfg.ClearField("backend")
    cfg.platform = "tensorrt_plan"
    cfg.ClearField("default_model_filename")
    cfg.ClearField("parameters")  # ORT thread settings mean nothing to TensorRT
    for tensor in cfg.input:
        # TensorRT's ragged batching wants batch_input tensors our graphs lack: batch per padded shape instead.
        tensor.allow_ragged_batch = False
    cfg.ClearField("instance_group")
    cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_GPU, profile=[str(profile)])
    for cc, filename in sorted(plans.items()):
        cfg.cc_model_filenames[cc] = filename
    if plans:
        cfg.default_model_filename = sorted(plans.values())[-1]
    return cfg


def trt_ensemble_config(ensemble_dir: Path, replacements: Mapping[str, str], suffix: str):
    """An ensemble whose steps use the TensorRT models instead of the ORT ones."""
    from tritonclient.grpc import model_config_pb2 as mc

    src = load_config(Path(ensemble_dir) / "config.pbtxt")
    cfg = mc.ModelConfig()
    cfg.CopyFrom(src)
    cfg.name = f"{src.name.removesuffix('_fp32')}_{suffix}"
    for step in cfg.ensemble_scheduling.step:
        step.model_name = replacements.get(step.model_name, step.model_name)
    return cfg


def write_config(cfg, repository: Path, source_dir: Path | None = None) -> Path:
    """Write a generated config; label files it names are copied from `source_dir` (Triton reads them from the
    model's own directory)."""
    path = Path(repository) / cfg.name / "config.pbtxt"
    path.parent.mkdir(parents=True, exist_ok=True)
    for label in {t.label_filename for t in cfg.output if t.label_filename}:
        if source_dir is None or not (Path(source_dir) / label).is_file():
            raise EngineError(f"{cfg.name}: output label_filename '{label}' has no file in {source_dir}")
        shutil.copyfile(Path(source_dir) / label, path.parent / label)
    path.write_text("# Generated by `make build-engines` (tritonkit.tensorrt.engines); do not edit.\n" + to_pbtxt(cfg))
    (path.parent / "1").mkdir(exist_ok=True)  # plans live here; an ensemble needs it empty
    load_config(path)  # schema check of what we just wrote
    return path


# -- building and validating (TensorRT needed) ---------------------------------------------------------------

def fp16_cast(src: Path, dst: Path) -> Path:
    """FP16 copy of an FP32 graph with FP32 inputs/outputs, for TensorRT 11's strongly typed FP16 build."""
    import onnx
    from onnxconverter_common import float16

    model = onnx.load(str(src))
    # The converter names its I/O casts after the consuming nodes: unnamed nodes would give duplicate casts.
    for i, node in enumerate(model.graph.node):
        node.name = node.name or f"{node.op_type}_{i}"
    # Cast and Softmax stay FP32 (casts inserted around them): the converter retypes their outputs inconsistently
    # and ONNX Runtime refuses the result (text encoder: the mask Cast; image classifier: the output Softmax).
    model = float16.convert_float_to_float16(model, keep_io_types=True,
                                             op_block_list=[*float16.DEFAULT_OP_BLOCK_LIST, "Cast", "Softmax"])
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))
    return dst


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_plan(onnx_path: Path, plan_path: Path, recipe: BuildRecipe, profiles: Sequence[Profile],
               timing_cache: Path = TIMING_CACHE, workspace_gib: float = 4.0) -> Path:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if recipe.strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT could not parse {onnx_path.name}:\n{errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    for flag in recipe.builder_flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    for profile in profiles:
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profile.shapes.items():
            p.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(p)
    # A persisted timing cache makes rebuilds (other precision, other profile) take seconds, not minutes.
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.exists() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineError(f"TensorRT failed to build {plan_path.name} from {onnx_path.name}")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(serialized))
    timing_cache.parent.mkdir(parents=True, exist_ok=True)
    timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    return plan_path


@dataclass
class OutputDiff:
    output: str
    sample: int
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    profile: str = ""

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.atol or self.max_rel <= self.rtol


def compare_outputs(reference: Sequence[Mapping[str, np.ndarray]], candidate: Sequence[Mapping[str, np.ndarray]],
                    tolerances: Mapping[str, tuple[float, float]]) -> list[OutputDiff]:
    """Per sample and output: max abs/rel difference against (atol, rtol); worst first."""
    diffs = []
    for i, (ref, got) in enumerate(zip(reference, candidate)):
        for name, (atol, rtol) in tolerances.items():
            a, b = np.asarray(ref[name], np.float64), np.asarray(got[name], np.float64)
            if a.shape != b.shape:
                raise EngineError(f"output '{name}' sample {i}: shape {b.shape} != reference {a.shape}")
            abs_diff = np.abs(a - b)
            rel = abs_diff / np.maximum(np.abs(a), 1e-6)
            diffs.append(OutputDiff(name, i, float(abs_diff.max()), float(rel.max()), atol, rtol))
    return sorted(diffs, key=lambda d: (d.ok, -d.max_abs / max(d.atol, 1e-12)))


def check_diffs(diffs: Sequence[OutputDiff], what: str, show: int = 8) -> None:
    failures = [d for d in diffs if not d.ok]
    if failures:
        lines = "\n  ".join(
            f"{d.output} sample {d.sample}{' profile ' + d.profile if d.profile else ''}: "
            f"max|diff| {d.max_abs:.3g} (atol {d.atol}), max rel {d.max_rel:.3g} "
            f"(rtol {d.rtol})" for d in failures[:show]
        )
        raise EngineError(f"{what}: {len(failures)} of {len(diffs)} output checks out of tolerance; worst:\n  {lines}")


def run_polygraphy(runner_factories: Sequence, feeds: Iterable[Mapping[str, np.ndarray]]) -> list[list[dict]]:
    """Run every Polygraphy runner on the same feeds; returns per runner a list of output dicts."""
    from polygraphy.comparator import Comparator

    feeds = list(feeds)
    results = Comparator.run(list(runner_factories), data_loader=feeds)
    return [[dict(out) for out in outputs] for _, outputs in results]


def ort_runner(onnx_path: Path, name: str | None = None):
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    return OnnxrtRunner(SessionFromOnnx(str(onnx_path), providers=["CPUExecutionProvider"]), name=name)


def fits(profile: Profile, feed: Mapping[str, np.ndarray]) -> bool:
    return all(all(lo <= n <= hi for lo, n, hi in zip(lo_s, feed[name].shape, hi_s))
               for name, (lo_s, _, hi_s) in profile.shapes.items() if name in feed)


def validate_plan(plan_path: Path, reference_onnx: Path, feeds: Sequence[Mapping[str, np.ndarray]],
                  tolerances: Mapping[str, tuple[float, float]], profiles: Sequence[Profile]) -> list[OutputDiff]:
    """Polygraphy: every profile of the plan, each on every feed that fits it, against ONNX Runtime on the same
    inputs; raises EngineError with the worst diffs."""
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    engine = EngineFromBytes(plan_path.read_bytes())
    (reference,) = run_polygraphy([ort_runner(reference_onnx, "onnxruntime")], feeds)
    diffs = []
    for index, profile in enumerate(profiles):
        chosen = [i for i, f in enumerate(feeds) if fits(profile, f)]
        (got,) = run_polygraphy([TrtRunner(engine, name=f"trt_{profile.name}", optimization_profile=index)],
                                [feeds[i] for i in chosen])
        for d in compare_outputs([reference[i] for i in chosen], got, tolerances):
            d.profile, d.sample = profile.name, chosen[d.sample]
            diffs.append(d)
    diffs.sort(key=lambda d: (d.ok, -d.max_abs / max(d.atol, 1e-12)))
    check_diffs(diffs, f"{plan_path.name} vs onnxruntime")
    return diffs


# -- what a plan is validated on, and how closely -------------------------------------------------------------

# A plan may differ from ONNX Runtime FP32 by this many times what ONNX Runtime's own INT8/FP16 form of the same
# graph differs on the same inputs: TensorRT fuses and picks kernels of its own, so its rounding is not ORT's.
TOLERANCE_FACTOR = 2.0
# Below this the derived bound would be FP32 noise: an FP16 or INT8 plan cannot be held to it.
TOLERANCE_FLOOR = 1e-4


def axis_limits(kind) -> dict[str, int]:
    """Each non-batch dynamic axis → the longest size the serving side emits (a text model's MAX_LENGTH): profiles
    are sized from what the tokenizer produces, never from the validation feeds at hand."""
    axes = {a for axes in kind.EXPORT.inputs.values() for a in axes.values() if a != BATCH_AXIS}
    if axes and not hasattr(kind, "MAX_LENGTH"):
        raise EngineError(f"spec '{kind.NAME}' has dynamic axes {sorted(axes)} but no MAX_LENGTH to size them")
    return {a: int(kind.MAX_LENGTH) for a in axes}


def validation_feeds(kind) -> list[dict[str, np.ndarray]]:
    """Every point of the spec's validation grid (real inputs), the longest lengths included."""
    return [dict(kind.EXPORT.sample_inputs(point).feeds) for point in kind.EXPORT.validation_grid]


def axis_maxima(feeds: Sequence[Mapping[str, np.ndarray]], dims: Mapping[str, Sequence[int | str]]) -> dict:
    """The largest size each named non-batch axis takes over the validation feeds."""
    out: dict[str, int] = {}
    for feed in feeds:
        for name, ds in dims.items():
            for axis, d in enumerate(ds):
                if isinstance(d, str) and d != BATCH_AXIS and name in feed:
                    out[d] = max(out.get(d, 1), int(feed[name].shape[axis]))
    return out


def extreme_feeds(feeds: Sequence[Mapping[str, np.ndarray]], profiles: Sequence[Profile]) -> list[dict]:
    """A feed at each profile's maximum shape: the real feed already at the longest non-batch sizes, its rows
    repeated up to the maximum batch. Raises when no feed reaches the longest sizes (none can be invented)."""
    out, seen = [], set()
    for profile in profiles:
        top = {name: shapes[2] for name, shapes in profile.shapes.items()}
        source = next((f for f in feeds if all(tuple(f[n].shape[1:]) == tuple(top[n][1:]) for n in top)), None)
        if source is None:
            raise EngineError(f"no validation feed reaches profile '{profile.name}' at its maximum {top}: add a "
                              f"grid point at the longest length so the plan is checked where it is served")
        key = tuple(sorted((n, tuple(s)) for n, s in top.items()))
        if key in seen:
            continue
        seen.add(key)
        batch = next(iter(top.values()))[0]
        rows = len(next(iter(source.values())))
        reps = -(-batch // rows)
        out.append({n: np.concatenate([source[n]] * reps)[:batch] for n in top})
    return out


def derive_tolerances(reference_onnx: Path, low_precision_onnx: Path, feeds: Sequence[Mapping[str, np.ndarray]],
                      outputs: Sequence[str], factor: float = TOLERANCE_FACTOR) -> dict[str, tuple[float, float]]:
    """(atol, 0) per output: `factor` times the largest absolute error of ONNX Runtime's low-precision form against
    its FP32 form on the same inputs (floored at TOLERANCE_FLOOR). No relative bound: near-zero outputs make the
    relative error unbounded (10^4 on the INT8 text encoder), and a check passes on either bound."""
    reference, low = run_polygraphy([ort_runner(reference_onnx, "fp32"), ort_runner(low_precision_onnx, "low")],
                                    feeds)
    out = {}
    for name in outputs:
        err = max(float(np.abs(np.asarray(r[name], np.float64) - np.asarray(g[name], np.float64)).max())
                  for r, g in zip(reference, low))
        out[name] = (max(factor * err, TOLERANCE_FLOOR), 0.0)
    return out


# -- the make target ----------------------------------------------------------------------------------------

@dataclass
class Step:
    model: str
    source: str  # the ONNX Runtime model the plan was built from
    precision: str
    status: str  # "built", "skipped", "failed"
    detail: str = ""
    files: list[str] = field(default_factory=list)


def trt_source_onnx(model_dir: Path, model: str) -> Path:
    """The ONNX a plan is built from: the TensorRT-form Q/DQ graph the build keeps beside a served model whose
    CPU-serving INT8 form differs (asymmetric uint8 activations, which TensorRT rejects), else the served one."""
    trt_form = paths.ARTIFACTS / f"{model}.trt_qdq.onnx"
    return trt_form if trt_form.exists() else Path(model_dir) / "1" / "model.onnx"


def int8_plan_refusal(kind) -> str | None:
    """Why no INT8 plan is built, when the TensorRT-form INT8 report did not pass (no recipe met the gates with
    enough of the compute in INT8: its Q/DQ graph is the FP32 model or nearly float); None to build it."""
    from tritonkit.int8 import recipe

    report = recipe.report_path(kind, "tensorrt")
    if not report.exists():
        return None
    data = json.loads(report.read_text())
    if data.get("passed"):
        return None
    why = "; ".join(data.get("missed") or []) or data.get("reason") or data.get("status", "")
    return (f"no INT8 plan: the TensorRT-form INT8 graph did not pass ({why}; {paths.rel(report)}); the FP16 plan "
            f"serves. Re-search with `{recipe.search_command(kind)}`")


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


def build_model_engines(kind, env: Environment, repository: Path = paths.MODEL_REPOSITORY,
                        precisions: Sequence[str] = PRECISIONS, target: ServerTarget | None = None,
                        ccs: Iterable[str] | None = None) -> list[Step]:
    target = target or target_server()
    sources = {"int8": kind.INT8_MODEL, "fp16": kind.FP32_MODEL}
    steps = []
    for precision in precisions:
        model_dir = Path(repository) / sources[precision]
        onnx_path = trt_source_onnx(model_dir, sources[precision])
        step = Step(trt_model_name(sources[precision], precision), sources[precision], precision, "skipped")
        if env.skip_reason:
            step.detail = f"TensorRT plan not built: {env.skip_reason}"
            steps.append(step)
            continue
        unfit = int8_plan_refusal(kind) if precision == "int8" else None
        if unfit:
            step.detail = unfit
            steps.append(step)
            continue
        if not onnx_path.exists():
            step.status, step.detail = "failed", f"{onnx_path} missing; run `make build` first"
            steps.append(step)
            continue
        try:
            check_builder(env.trt_version, target)
            steps.append(_build_one(kind, env, model_dir, onnx_path, precision, repository, target, ccs))
        except EngineError as err:
            step.status, step.detail = "failed", str(err)
            steps.append(step)
    return steps


def _plan_inputs(kind, model_dir: Path, onnx_path: Path, precision: str):
    """(source config, profiles, feeds, tolerances, FP32 reference ONNX, low-precision ORT form) of one plan."""
    src_cfg = load_config(Path(model_dir) / "config.pbtxt")
    fp32_onnx = Path(model_dir).parent / kind.FP32_MODEL / "1" / "model.onnx"
    dims = onnx_input_dims(onnx_path)
    profiles = profiles_for(dims, src_cfg.max_batch_size, axis_limits(kind))
    feeds = validation_feeds(kind)
    feeds += extreme_feeds(feeds, profiles)
    low = onnx_path if precision == "int8" else fp16_cast(fp32_onnx, paths.ARTIFACTS / f"{src_cfg.name}_fp16.onnx")
    tolerances = derive_tolerances(fp32_onnx, low, feeds, list(kind.EXPORT.outputs))
    return src_cfg, profiles, feeds, tolerances, fp32_onnx, low


def build_device_plan(kind, env: Environment, model_dir: Path, onnx_path: Path, precision: str,
                      repository: Path, target: ServerTarget) -> Path:
    """On the one device this process sees: build, validate every profile, write the plan and its metadata."""
    if len(env.gpus) != 1:
        raise EngineError(f"a plan is built by a process that sees one GPU; this one sees {len(env.gpus)}")
    check_builder(env.trt_version, target)
    gpu = env.gpus[0]
    recipe = recipe_for(env.trt_version, precision)
    src_cfg, profiles, feeds, tolerances, fp32_onnx, low = _plan_inputs(kind, model_dir, onnx_path, precision)
    build_input = low if recipe.onnx_source == "fp16_cast" else onnx_path
    plan = Path(repository) / trt_model_name(src_cfg.name, precision) / "1" / plan_filename(gpu)
    started = time.time()
    build_plan(build_input, plan, recipe, profiles)
    diffs = validate_plan(plan, fp32_onnx, feeds, tolerances, profiles)
    meta = {
        "model": plan.parent.parent.name, "precision": precision, "tensorrt": env.trt_version,
        "ngc_release": target.release, "gpu": gpu.name, "compute_capability": gpu.cc, "recipe": asdict(recipe),
        "profiles": [{"index": i, "name": p.name, "shapes": p.shapes} for i, p in enumerate(profiles)],
        "source_onnx": onnx_path.name, "source_onnx_sha256": sha256(onnx_path),
        "build_seconds": round(time.time() - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "validation": {"reference": fp32_onnx.name, "tolerances": tolerances, "checks": len(diffs),
                       "worst": asdict(diffs[0]) if diffs else None},
    }
    plan.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    return plan


def _build_one(kind, env: Environment, model_dir: Path, onnx_path: Path, precision: str,
               repository: Path, target: ServerTarget, ccs: Iterable[str] | None = None) -> Step:
    src_cfg = load_config(Path(model_dir) / "config.pbtxt")
    name = trt_model_name(src_cfg.name, precision)
    devices, missing = plan_devices(env.gpus, ccs)
    for gpu in devices:
        if len(env.gpus) == 1:
            build_device_plan(kind, env, model_dir, onnx_path, precision, repository, target)
            continue
        # A process builds on the device it sees; CUDA_VISIBLE_DEVICES picks one of this capability.
        result = subprocess.run(
            [sys.executable, "-m", "tritonkit.tensorrt.engines", kind.NAME, "--precision", precision, "--device-job",
             "--repository", str(repository)],
            env=device_env(gpu), capture_output=True, text=True, cwd=paths.ROOT)
        if result.returncode != 0:
            raise EngineError(f"sm {gpu.cc} build on {gpu.name} failed:\n{(result.stdout + result.stderr)[-2000:]}")
    version_dir = Path(repository) / name / "1"
    plans, files = {}, []
    for gpu in devices:
        plan = version_dir / plan_filename(gpu)
        meta = json.loads(plan.with_suffix(".json").read_text())
        check_plan_metadata(meta, target, str(plan))
        plans[gpu.cc] = plan.name
        files += [str(plan), str(plan.with_suffix(".json"))]
    profiles = profiles_for(onnx_input_dims(onnx_path), src_cfg.max_batch_size, axis_limits(kind))
    throughput = next(i for i, p in enumerate(profiles) if p.name.startswith("throughput"))
    files.append(str(write_config(trt_model_config(model_dir, precision, plans, throughput), repository,
                                  source_dir=model_dir)))
    detail = f"{len(plans)} plan(s), profiles {[p.name for p in profiles]}"
    if missing:
        detail += f"; skipped sm {', '.join(missing)}: no GPU of that compute capability here"
    return Step(name, src_cfg.name, precision, "built", detail, files)


def write_ensembles(repository: Path, built: Sequence[Step]) -> list[Path]:
    """For each ensemble that uses a model we built a plan for, a `<ensemble>_trt_<precision>` twin."""
    from tritonkit.repository.config import load_repository

    configs = load_repository(repository)
    written = []
    for precision in PRECISIONS:
        replacements = {s.source: s.model for s in built if s.status == "built" and s.precision == precision}
        for cfg in configs.values():
            steps = cfg.ensemble_scheduling.step
            if cfg.platform == "ensemble" and any(st.model_name in replacements for st in steps):
                ens = trt_ensemble_config(repository / cfg.name, replacements, f"trt_{precision}")
                written.append(write_config(ens, repository))
    return written


def _jobs(args):
    """(target, spec, precision, model dir, source ONNX) for every requested target and precision."""
    from tritonkit import kinds

    for name in args.targets:
        kind = kinds.get(name)
        for precision in args.precision or PRECISIONS:
            source = kind.INT8_MODEL if precision == "int8" else kind.FP32_MODEL
            model_dir = args.repository / source
            yield name, kind, precision, model_dir, trt_source_onnx(model_dir, source)


def main(argv: list[str] | None = None) -> int:
    from tritonkit import kinds

    parser = argparse.ArgumentParser(description="TensorRT plans (INT8 from Q/DQ ONNX, FP16) for the built models")
    parser.add_argument("targets", nargs="*", default=kinds.names(), help="registered models")
    parser.add_argument("--precision", action="append", choices=PRECISIONS, help="default: all")
    parser.add_argument("--cc", action="append", help="compute capabilities to build for (default: every GPU's); "
                        "those with no GPU here are reported skipped")
    parser.add_argument("--repository", type=Path, default=paths.MODEL_REPOSITORY)
    parser.add_argument("--device-job", action="store_true", help=argparse.SUPPRESS)  # one plan, one visible GPU
    parser.add_argument("--tolerances", action="store_true",
                        help="print the validation feeds' shapes and the derived tolerances, build nothing (no GPU)")
    args = parser.parse_args(argv)
    env = detect()
    target = target_server()
    if args.tolerances:
        for name, kind, precision, model_dir, onnx in _jobs(args):
            _, profiles, feeds, tolerances, _, low = _plan_inputs(kind, model_dir, onnx, precision)
            shapes = sorted({tuple(next(iter(f.values())).shape) for f in feeds})
            print(f"{name} {precision}: ORT form {low.name}; {len(feeds)} feeds, shapes {shapes[0]}..{shapes[-1]}; "
                  f"profiles {[(p.name, next(iter(p.shapes.values()))[2]) for p in profiles]}; "
                  f"(atol, rtol) = {{{', '.join(f'{k}: ({a:.3g}, {r:.3g})' for k, (a, r) in tolerances.items())}}}")
        return 0
    if args.device_job:
        for _, kind, precision, model_dir, onnx in _jobs(args):
            build_device_plan(kind, env, model_dir, onnx, precision, args.repository, target)
        return 0
    print(f"TensorRT: {env.trt_version or 'not installed'}; GPUs: "
          f"{', '.join(f'{g.name} (sm {g.cc})' for g in env.gpus) or 'none'}; target: NGC {target.release} "
          f"(Triton {target.triton}, TensorRT {target.tensorrt})")
    steps: list[Step] = []
    for name in args.targets:
        steps += build_model_engines(kinds.get(name), env, args.repository, args.precision or PRECISIONS,
                                     target, args.cc)
    for step in steps:
        print(f"[{step.status:7s}] {step.model:28s} {step.detail}")
    if any(s.status == "built" for s in steps):
        for path in write_ensembles(args.repository, steps):
            print(f"[config ] {path.relative_to(paths.ROOT)}")
    if env.skip_reason:
        print("TensorRT steps skipped; the ONNX artefacts above are complete and served by `make serve`.")
    return 1 if any(s.status == "failed" for s in steps) else 0


if __name__ == "__main__":
    raise SystemExit(main())
