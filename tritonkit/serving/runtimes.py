"""The CPU runtimes a served ONNX file runs on, behind one small interface: `open_runner(runtime, path, config)`.

    runner = open_runner("openvino", Path("model.onnx"), config)   # config: the model's config as a dict
    outputs, released = runner.run(["embedding"], feeds, rows)

Both read the file as built (FP32, explicit Q/DQ INT8, the packed graphs); neither converts it on disk. Thread
settings come from the model's config `parameters` under the names the native backend of that runtime reads:
ONNX Runtime's `intra_op_thread_count`/`inter_op_thread_count` (tritonkit.serving.backend_utils.session_options) and
OpenVINO's `INFERENCE_NUM_THREADS`, `NUM_STREAMS`, `PERFORMANCE_HINT`, `COMPILATION_NUM_THREADS`, `HINT_BF16`
(validated as openvino_backend/src/openvino.cc ModelState::ParseParameterHelper does). Heavy imports are lazy, so
this module imports anywhere (tests, the build's timing) and inside a Triton stub alike.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tritonkit.errors import ConfigError
from tritonkit.serving.backend_utils import ArenaRelease, instance_count, param, session_options, usable_cpus

RUNTIMES = ("onnxruntime", "openvino")
# Threads per instance, under the name each runtime's native Triton backend reads.
THREAD_PARAMETER = {"onnxruntime": "intra_op_thread_count", "openvino": "INFERENCE_NUM_THREADS"}


@functools.cache
def openvino_core():
    """One OpenVINO Core per process: it owns the plugin and its thread pools, shared by every compiled model."""
    import openvino as ov

    return ov.Core()


def openvino_properties(config: dict, graph=None) -> dict[str, object]:
    """compile_model properties from a config's parameters, each validated as the native backend does (a bad
    value raises ConfigError naming the parameter), and those the served file (`graph`, its ModelProto) implies."""
    name = config.get("name", "?")
    threads = param(config, "INFERENCE_NUM_THREADS", str(max(1, usable_cpus() // instance_count(config))))
    props: dict[str, object] = {
        # Several stub processes share the cores; OpenVINO's pinning would put each process's threads on core 0.
        "ENABLE_CPU_PINNING": False,
        "NUM_STREAMS": "1",
        "PERFORMANCE_HINT": "LATENCY",
        # OpenVINO runs float graphs in bf16 on CPUs that have it; a file built as FP32 is served as FP32
        # unless the config opts in with HINT_BF16.
        "INFERENCE_PRECISION_HINT": "f32",
    }
    for key, value in (("INFERENCE_NUM_THREADS", threads),
                       ("COMPILATION_NUM_THREADS", param(config, "COMPILATION_NUM_THREADS")),
                       ("HINT_BF16", param(config, "HINT_BF16")),
                       ("NUM_STREAMS", param(config, "NUM_STREAMS")),
                       ("PERFORMANCE_HINT", param(config, "PERFORMANCE_HINT"))):
        if value is None:
            continue
        low = value.strip().lower()
        if key.endswith("_THREADS"):
            if not low.isdigit():
                raise ConfigError(name, f"parameters.{key}", f"expected a non-negative number, got {value!r}")
            props[key] = int(low)
        elif key == "HINT_BF16":
            if low != "yes":
                raise ConfigError(name, f"parameters.{key}", f"expected YES, got {value!r}")
            props["INFERENCE_PRECISION_HINT"] = "bf16"
        elif key == "NUM_STREAMS":
            if low not in ("auto", "numa") and not low.isdigit():
                raise ConfigError(name, f"parameters.{key}", f"expected AUTO, NUMA or a number, got {value!r}")
            props[key] = low.upper() if not low.isdigit() else low
        else:
            modes = ("latency", "throughput", "cumulative_throughput")
            if low not in modes:
                raise ConfigError(name, f"parameters.{key}", f"expected one of {[m.upper() for m in modes]}, "
                                  f"got {value!r}")
            props[key] = low.upper()
    return {**props, **_file_properties(graph)}


def _file_properties(graph) -> dict[str, object]:
    """What a served file (a ModelProto, or None) implies: where it has MatMulNBits nodes, the group OpenVINO
    quantizes their activations by at run time, set to their block (the smallest where they differ, which divides
    the others), so it computes what the search judged on onnxruntime (tritonkit.int8.granularity)."""
    blocks = [a.i for n in graph.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "block_size"] if graph is not None else []
    return {"DYNAMIC_QUANTIZATION_GROUP_SIZE": min(blocks)} if blocks else {}


class OrtRunner:
    """onnxruntime's CPU provider, with the arena handed back after bursts (backend_utils.ArenaRelease)."""

    runtime = "onnxruntime"

    def __init__(self, path: Path, config: dict):
        import onnxruntime as ort
        from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

        self.options = session_options(config)
        self.session = ort.InferenceSession(str(path), self.options, providers=["CPUExecutionProvider"])
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        # Each input's dims, None where the graph leaves them free.
        self.input_shapes = {i.name: [d if isinstance(d, int) else None for d in i.shape]
                             for i in self.session.get_inputs()}
        self.metadata = dict(self.session.get_modelmeta().custom_metadata_map)
        self.arena = ArenaRelease(config)
        # onnxruntime's INVALID_ARGUMENT is about the feeds (type, rank, dims, index bounds): the request's fault.
        self.client_errors: tuple[type[BaseException], ...] = (InvalidArgument,)

    def describe(self) -> str:
        return (f"onnxruntime threads intra_op={self.options.intra_op_num_threads} "
                f"inter_op={self.options.inter_op_num_threads} (onnxruntime {self.version()})")

    @staticmethod
    def version() -> str:
        import onnxruntime as ort

        return ort.__version__

    def run(self, outputs: list[str], feeds: dict, rows: int) -> tuple[list, bool]:
        return self.arena.run(self.session, outputs, feeds, rows)


class OpenVinoRunner:
    """OpenVINO's CPU plugin reading the .onnx directly; one infer request per runner, reused across calls.

    Output arrays are copied out of the request's tensors, which the next call overwrites."""

    runtime = "openvino"

    def __init__(self, path: Path, config: dict):
        import onnx

        core = openvino_core()
        self.path = Path(path)
        graph = onnx.load(str(path), load_external_data=False) if self.path.suffix == ".onnx" else None
        self.properties = openvino_properties(config, graph)
        self.compiled = core.compile_model(str(path), "CPU", self.properties)
        self.request = self.compiled.create_infer_request()
        self.static: dict[tuple, object] = {}  # feed shapes -> an infer request of a model compiled for them
        self.input_names = {name for port in self.compiled.inputs for name in port.get_names()}
        self.output_names = [port.get_any_name() for port in self.compiled.outputs]
        self.input_shapes = {name: [d.get_length() if d.is_static else None for d in port.get_partial_shape()]
                             for port in self.compiled.inputs for name in port.get_names()}
        # OpenVINO drops ONNX metadata_props; the packed pooling and fallback marks live there (an IR has none).
        self.metadata = {p.key: p.value for p in graph.metadata_props} if graph is not None else {}
        self.client_errors = ()
        # Only onnxruntime keeps an arena to release; the counter stays 0 here.
        self.arena = None

    def describe(self) -> str:
        threads = self.compiled.get_property("INFERENCE_NUM_THREADS")
        streams = self.compiled.get_property("NUM_STREAMS")
        precision = self.compiled.get_property("INFERENCE_PRECISION_HINT")
        return (f"openvino {self.version()} INFERENCE_NUM_THREADS={threads} NUM_STREAMS={streams} "
                f"precision={precision}" + (f", {len(self.static)} static shapes" if self.static else ""))

    @staticmethod
    def version() -> str:
        import openvino as ov

        return ov.get_version().split("-")[0]

    def compile_static(self, static) -> None:
        """Compile the packed graph once more per shape of `static` (packing.StaticShapes), every dim fixed, and run
        it once; packed feeds that `static.fit` run there, the rest on the dynamic model. Each shape costs a copy
        of the weights as compiled."""
        import openvino as ov

        model = openvino_core().read_model(str(self.path))
        for feeds in static.examples():
            fixed = model.clone()
            fixed.reshape({name: ov.PartialShape(list(array.shape)) for name, array in feeds.items()})
            request = openvino_core().compile_model(fixed, "CPU", self.properties).create_infer_request()
            request.infer(feeds)
            self.static[_shapes(feeds)] = request
        self.static_shapes = static

    def run(self, outputs: list[str], feeds: dict, rows: int) -> tuple[list, bool]:
        request, keep = self.request, None  # keep: the output rows of a static run's grown pool that are real
        if self.static:
            fitted, texts = self.static_shapes.fit(feeds)
            match = self.static.get(_shapes(fitted)) if texts is not None else None
            if match is not None:
                request, feeds, keep = match, fitted, texts
        request.infer(feeds, share_inputs=True)
        return [request.get_tensor(name).data[:keep].copy() for name in outputs], False


def _shapes(feeds: dict) -> tuple:
    return tuple(sorted((name, array.shape) for name, array in feeds.items()))


def static_shapes(runner, config: dict, row_tokens: int, width_multiple: int, texts: int):
    """The config's `packed_static_rows` (packing.StaticShapes), compiled into `runner`; None where unset.
    ConfigError names the parameter: a bad value, or a runtime without per-shape preparation to save."""
    from tritonkit.errors import PackingError
    from tritonkit.serving import packing

    value = param(config, "packed_static_rows", "")
    try:
        static = packing.StaticShapes.parse(value, row_tokens, width_multiple, texts)
    except PackingError as err:
        raise ConfigError(config.get("name", "?"), "parameters.packed_static_rows", str(err)) from None
    if static is None:
        return None
    if not hasattr(runner, "compile_static"):
        raise ConfigError(config.get("name", "?"), "parameters.packed_static_rows",
                          f"only the openvino runtime compiles static shapes, not {runner.runtime}")
    runner.compile_static(static)
    return static


def runner_class(runtime: str):
    try:
        return {"onnxruntime": OrtRunner, "openvino": OpenVinoRunner}[runtime]
    except KeyError:
        raise ConfigError("?", "runtime", f"{runtime!r} is not one of {RUNTIMES}") from None


def open_runner(runtime: str, path: Path, config: dict):
    """A runner for `path` on `runtime` ("onnxruntime" | "openvino"), configured by `config`'s parameters."""
    return runner_class(runtime)(Path(path), config)


DEFAULT = "onnxruntime"
# Another runtime must beat ONNX Runtime by more than timing noise to be worth a change of backend: Lite0's FP32 file
# measured 1.04x and 1.05x in two runs a minute apart (models/image_classification.runtime.json history).
MIN_GAIN = 1.10
# What a served file can run as: runtime and the config parameters that select it (tritonkit.repository.runtime_choice
# picks one per served model; the INT8 speed gate times on it). bf16 only for files judged by accuracy gates (the
# INT8 model), and only where the CPU computes bf16 natively; the FP32 twin stays FP32.
VARIANTS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "onnxruntime": ("onnxruntime", ()),
    "openvino": ("openvino", (("packed_width_multiple", "16"), ("packed_static_rows", "1"))),
    "openvino-bf16": ("openvino", (("HINT_BF16", "YES"), ("packed_width_multiple", "16"), ("packed_static_rows", "1"))),
}


class VariantSession:
    """An onnxruntime-style `run(names, feeds)` over a runner, for offline evaluation and timing as served."""

    def __init__(self, runner):
        self.runner = runner

    def run(self, names, feeds, *_):
        feeds = {k: v for k, v in feeds.items() if k in self.runner.input_names}
        return self.runner.run(list(names), feeds, len(next(iter(feeds.values()))))[0]


def variant_config(threads: int, variant: str = DEFAULT) -> dict:
    params = {"intra_op_thread_count": str(threads), "INFERENCE_NUM_THREADS": str(threads),
              "arena_release_batch": "0", **dict(VARIANTS[variant][1])}
    return {"name": "runtime-choice", "parameters": {k: {"string_value": v} for k, v in params.items()}}


def open_variant(variant: str, path: Path, threads: int, max_batch_size: int = 0) -> VariantSession:
    """`path` opened as `variant` serves it; a packed file with `max_batch_size` gets the variant's static
    shapes too (what its backend compiles), so offline runs take the kernels served runs take."""
    config = variant_config(threads, variant)
    runner = open_runner(VARIANTS[variant][0], path, config)
    if max_batch_size and Path(path).name.endswith(".packed.onnx"):
        from tritonkit.serving import packing

        static_shapes(runner, config, packing.ROW_TOKENS, int(param(config, "packed_width_multiple", "1")),
                      max_batch_size)
    return VariantSession(runner)


def versions() -> dict[str, str]:
    """Each runtime's version as installed here, for every report that records speed or accuracy."""
    out = {}
    for runtime in RUNTIMES:
        try:
            out[runtime] = runner_class(runtime).version()
        except ImportError:
            out[runtime] = "not installed"
    return out


def needs_bf16(variant: str) -> bool:
    """Whether `variant` computes in bf16, which only a CPU with native bf16 may be given."""
    return dict(VARIANTS[variant][1]).get("HINT_BF16") == "YES"


def without_bf16(variant: str) -> str:
    """What a CPU without native bf16 runs a file recorded on `variant` on: `variant` itself unless it computes in
    bf16, else ONNX Runtime, the arithmetic the INT8 accuracy gates judged (OpenVINO in f32 was never measured)."""
    return DEFAULT if needs_bf16(variant) else variant


def usable_here(variant: str) -> str:
    """`variant`, or its bf16-free twin where this CPU has no native bf16 (its class's record may be from one with)."""
    from tritonkit import envinfo

    return variant if envinfo.has_bf16() else without_bf16(variant)
