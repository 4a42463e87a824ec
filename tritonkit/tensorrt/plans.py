"""What a TensorRT plan is built from and how: the precision recipe per TensorRT version, the optimisation
profiles, the file names, the FP16-cast graph, and the build itself.

Precision paths by TensorRT major version (TensorRT 11 removed implicit INT8 calibration and the INT8/FP16
builder flags):

| precision | TensorRT 10                                   | TensorRT 11                                       |
|-----------|-----------------------------------------------|---------------------------------------------------|
| int8      | Q/DQ ONNX, weakly typed, flags INT8 + FP16    | Q/DQ ONNX, strongly typed network, no flags       |
| fp16      | FP32 ONNX, flag FP16                          | FP16-cast ONNX (I/O kept FP32), strongly typed    |

`build_plan` alone needs TensorRT and a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tritonkit import paths
from tritonkit.errors import EngineError
from tritonkit.tensorrt.environment import Gpu

PRECISIONS = ("int8", "fp16")
TIMING_CACHE = paths.ARTIFACTS / "trt_timing.cache"
BATCH_AXIS = "batch"


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


def axis_limits(kind) -> dict[str, int]:
    """Each non-batch dynamic axis → the longest size the serving side emits (a text model's MAX_LENGTH): profiles
    are sized from what the tokenizer produces, never from the validation feeds at hand."""
    axes = {a for axes in kind.EXPORT.inputs.values() for a in axes.values() if a != BATCH_AXIS}
    if axes and not hasattr(kind, "MAX_LENGTH"):
        raise EngineError(f"spec '{kind.NAME}' has dynamic axes {sorted(axes)} but no MAX_LENGTH to size them")
    return {a: int(kind.MAX_LENGTH) for a in axes}


def fp16_cast(src: Path, dst: Path) -> Path:
    """FP16 copy of an FP32 graph with FP32 inputs/outputs, for TensorRT 11's strongly typed FP16 build."""
    import onnx

    from tritonkit.export import float16

    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(float16(onnx.load(str(src))), str(dst))
    return dst


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
