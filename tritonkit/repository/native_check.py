"""Native-load check: the rules by which Triton's own backends refuse (or misserve) a model, run on a repository
view before any server sees it.

The embedded server and the NGC container read the same config schema but not the same backends: there,
`backend: "onnxruntime"` and `backend: "openvino"` are Triton's native ONNX Runtime and OpenVINO backends, TensorRT
plans load, and KIND_GPU needs a GPU. Every rule below names the upstream source it restates; its URL points at
that repository's branch of the release being checked (tritonkit.release; r24.10, the twin of the embedded 2.51
core, by default), so a rule can be re-read against each release. What needs a GPU or TensorRT to know (a plan's
profiles, its TensorRT version) is read from the metadata `tritonkit.tensorrt.engines` writes beside each plan.

    python -m tritonkit.repository.native_check build/ngc_repository --view ngc-gpu
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from tritonkit import release
from tritonkit.release import Release, same_tensorrt, target_server
from tritonkit.repository.config import ConfigError, check_ensemble, load_repository
from tritonkit.repository.config import is_tensorrt_config as is_tensorrt

UPSTREAM = release.UPSTREAM
# The branch rule URLs name when no release is given: the default release's.
RELEASE_BRANCH = release.get(release.DEFAULT).branch


@dataclass(frozen=True)
class Rule:
    id: str
    source: str  # upstream repository/path (function) that enforces it
    summary: str

    @property
    def url(self) -> str:
        return self.url_for(release.get(release.DEFAULT))

    def url_for(self, ngc: Release) -> str:
        """The restated source on the branch of release `ngc` (the server whose rules are checked)."""
        repo, _, path = self.source.partition("/")
        return ngc.url(repo, path.split(" ")[0])


RULES: dict[str, Rule] = {r.id: r for r in (
    Rule("ort.model_file", "onnxruntime_backend/src/onnxruntime.cc (ModelState::LoadModel)",
         "the version directory holds default_model_filename, else model.onnx"),
    Rule("ort.io_names", "onnxruntime_backend/src/onnxruntime.cc (ModelInstanceState::ValidateInputs/Outputs)",
         "every configured input and output is a tensor of the ONNX graph"),
    Rule("ort.io_dtype", "onnxruntime_backend/src/onnxruntime.cc (ModelInstanceState::ValidateInputs/Outputs)",
         "configured data types equal the graph's"),
    Rule("ort.io_dims", "onnxruntime_backend/src/onnxruntime.cc (CompareDimsSupported via ValidateInputs)",
         "configured dims (batch axis prepended when max_batch_size > 0) agree with the graph's"),
    Rule("ort.ragged_input", "onnxruntime_backend/src/onnxruntime.cc (ModelInstanceState::ValidateInputs)",
         "an allow_ragged_batch input is one flat tensor: the graph input must have shape [-1]"),
    Rule("trt.kind_gpu", "tensorrt_backend/src/instance_state.cc (ModelInstanceState constructor)",
         "TensorRT instances are KIND_GPU"),
    Rule("trt.plan_files", "tensorrt_backend/src/model_state.cc (ModelState::AutoCompleteConfig)",
         "the plan for each compute capability (cc_model_filenames, else default_model_filename) exists, with "
         "the metadata tritonkit.tensorrt.engines writes beside it"),
    Rule("trt.plan_version", "tensorrt_backend/src/loader.cc (LoadPlan: deserializeCudaEngine)",
         "a plan deserialises only in the TensorRT version that built it: the server's"),
    Rule("trt.profile_index", "tensorrt_backend/src/model_state.cc (ModelState::GetProfileIndices)",
         "instance_group.profile entries are integers in [0, number of profiles of the plan)"),
    Rule("trt.max_batch", "tensorrt_backend/src/model_state.cc (ModelState::AutoCompleteMaxBatch)",
         "each served profile's maximum batch is at least max_batch_size"),
    Rule("trt.ragged_input", "tensorrt_backend/src/instance_state.cc (InitializeExecuteInputBinding)",
         "an allow_ragged_batch input needs a one-dimensional engine input"),
    Rule("trt.sequence_cover", "tensorrt_backend/src/instance_state.cc (GetMostOptimizedProfile)",
         "every served profile spans lengths 1..max_length of the tokenizer feeding the model (a request outside "
         "every profile's min/max is refused)"),
    Rule("core.label_file", "core/src/model.cc (Model::Init → LabelProvider::AddLabels)",
         "a label_filename exists in the model directory"),
    Rule("core.kind_gpu", "core/src/model_config_utils.cc (ValidateInstanceGroup)",
         "KIND_GPU instance groups only where the server has GPUs"),
    Rule("core.batch_input", "core/src/model_config_utils.cc (ValidateBatchIO)",
         "each batch_input has one source input that is a configured input, and INT32 or FP32 data"),
    Rule("core.ensemble", "core/src/ensemble_scheduler/ensemble_utils.cc (ValidateEnsembleConfig)",
         "ensemble steps exist, are wired to produced tensors of the same type and shape, and batch at least as "
         "much as the ensemble"),
    Rule("python.model_file", "python_backend/src/pb_stub.cc (Stub::Initialize: stat of model.py)",
         "a Python-backend model has <version>/model.py"),
    Rule("ov.model_file", "openvino_backend/src/openvino.cc (ModelState::ReadModel)",
         "the version directory holds default_model_filename, else model.xml (an IR .xml with its .bin beside it)"),
    Rule("ov.input_count", "openvino_backend/src/openvino.cc (ModelState::ValidateInputs)",
         "the config lists exactly as many inputs as the graph has"),
    Rule("ov.io_names", "openvino_backend/src/openvino.cc (ModelState::ValidateInputs/ValidateOutputs)",
         "every configured input and output is a tensor of the graph"),
    Rule("ov.io_dtype", "openvino_backend/src/openvino_utils.cc (ModelConfigDataTypeToOpenVINOElement)",
         "data types are BOOL, UINT8..UINT64, INT8..INT64, FP16 or FP32 (no STRING, BF16, FP64); one other than "
         "the graph's is converted, not refused"),
    Rule("ov.io_dims", "openvino_backend/src/openvino_utils.cc (CompareDimsSupported)",
         "configured dims (batch axis first when max_batch_size > 0) have the graph's rank; an input's fixed dims "
         "equal the graph's, and an output's -1 stands only where the graph's axis is dynamic"),
    Rule("ov.kind_cpu", "openvino_backend/src/openvino.cc (ModelInstanceState constructor)",
         "instances are KIND_CPU (KIND_AUTO only where the server has no GPUs, as core then makes it KIND_CPU)"),
    Rule("ov.parameters", "openvino_backend/src/openvino.cc (ModelState::ParseParameters, ParseParameterHelper, "
         "ParseBoolParameter)",
         "tuning parameters hold values the backend accepts; its YES/NO switches are on only for YES, so any "
         "other spelling silently leaves them off; TARGET_DEVICE is CPU, the one device of NGC's image"),
    Rule("ov.fixed_batch", "openvino_backend/src/openvino.cc (ModelInstanceState::ProcessRequests)",
         "with max_batch_size > 1 the model is compiled at that batch (ValidateInputs: set_batch) and an "
         "execution with fewer rows is refused unless ENABLE_BATCH_PADDING is YES"),
    Rule("ov.padding_shape", "openvino_backend/src/openvino.cc (ModelInstanceState::SetInputTensors)",
         "ENABLE_BATCH_PADDING copies requests into the compiled request's own input tensors, which hold no data "
         "for a dynamic axis: every input's non-batch axes are fixed"),
    Rule("ov.ragged_input", "openvino_backend/src/openvino.cc (ModelInstanceState::SetInputTensors)",
         "no allow_ragged_batch input and no batch_input: a batch takes its first request's shape for every input "
         "and the backend builds no batch_input tensors"),
)}


@dataclass(frozen=True)
class View:
    """What a server makes of a repository: which ONNX Runtime and OpenVINO backends `backend: "onnxruntime"` and
    `backend: "openvino"` mean (ours, Python-based, or Triton's native ones), whether it has GPUs, whether it
    loads TensorRT plans."""

    name: str
    native_onnxruntime: bool
    gpu: bool
    tensorrt: bool
    native_openvino: bool = False


VIEWS = {v.name: v for v in (
    View("embedded", native_onnxruntime=False, gpu=False, tensorrt=False),
    View("ngc-gpu", native_onnxruntime=True, gpu=True, tensorrt=True, native_openvino=True),
    View("ngc-cpu", native_onnxruntime=True, gpu=False, tensorrt=False, native_openvino=True),
)}


@dataclass(frozen=True)
class Violation:
    rule: str
    model: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.model}: {self.field}: {self.message} [{self.rule}: {RULES[self.rule].source}]"


# -- helpers -------------------------------------------------------------------------------------------------

_ONNX_TYPES = {  # ONNX TensorProto elem_type → Triton DataType
    1: mc.TYPE_FP32, 2: mc.TYPE_UINT8, 3: mc.TYPE_INT8, 5: mc.TYPE_INT16, 6: mc.TYPE_INT32, 7: mc.TYPE_INT64,
    8: mc.TYPE_STRING, 9: mc.TYPE_BOOL, 10: mc.TYPE_FP16, 11: mc.TYPE_FP64, 16: mc.TYPE_BF16,
}




def is_onnxruntime(cfg: mc.ModelConfig) -> bool:
    return cfg.platform == "onnxruntime_onnx" or cfg.backend == "onnxruntime"


def is_openvino(cfg: mc.ModelConfig) -> bool:
    return cfg.backend == "openvino"


def _version_dirs(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def _onnx_io(path: Path) -> dict[str, dict[str, tuple[int, list[int]]]]:
    """{"input"|"output": name → (Triton data type, dims with -1 for dynamic axes)}."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}

    def io(values) -> dict[str, tuple[int, list[int]]]:
        out = {}
        for v in values:
            if v.name in initializers:
                continue
            t = v.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
            out[v.name] = (_ONNX_TYPES.get(t.elem_type, mc.TYPE_INVALID), dims)
        return out

    return {"input": io(model.graph.input), "output": io(model.graph.output)}


def _dims_agree(graph: list[int], config: list[int]) -> bool:
    return len(graph) == len(config) and all(g == c or g == -1 or c == -1 for g, c in zip(graph, config))


def plan_metadata(model_dir: Path, cfg: mc.ModelConfig) -> dict[str, dict]:
    """Plan file name → the metadata tritonkit.tensorrt.engines wrote beside it (absent plans are left out)."""
    out = {}
    for version in _version_dirs(model_dir):
        names = set(cfg.cc_model_filenames.values()) | {cfg.default_model_filename or "model.plan"}
        for name in sorted(names):
            meta = (version / name).with_suffix(".json")
            if (version / name).exists() and meta.exists():
                out[name] = json.loads(meta.read_text())
    return out


def tokenizer_lengths(configs: dict[str, mc.ModelConfig]) -> dict[tuple[str, str], int]:
    """(model, input) → the max_length parameter of the model that feeds that input in some ensemble."""
    out: dict[tuple[str, str], int] = {}
    for ens in configs.values():
        produced_by: dict[str, str] = {}
        for step in ens.ensemble_scheduling.step:
            for model_input, tensor in step.input_map.items():
                producer = configs.get(produced_by.get(tensor, ""))
                if producer is not None and "max_length" in producer.parameters:
                    length = int(producer.parameters["max_length"].string_value)
                    key = (step.model_name, model_input)
                    out[key] = max(out.get(key, 0), length)
            for tensor in step.output_map.values():
                produced_by[tensor] = step.model_name
    return out


# -- the rules -----------------------------------------------------------------------------------------------

Check = Callable[[str, mc.ModelConfig, Path, "Context"], Iterator[Violation]]


@dataclass
class Context:
    view: View
    configs: dict[str, mc.ModelConfig]
    tensorrt_version: str | None  # the target server's TensorRT (None: not checked)
    lengths: dict[tuple[str, str], int]


def _check_onnxruntime(name: str, cfg: mc.ModelConfig, model_dir: Path, ctx: Context) -> Iterator[Violation]:
    for version in _version_dirs(model_dir):
        path = version / (cfg.default_model_filename or "model.onnx")
        if not path.exists():
            yield Violation("ort.model_file", name, "default_model_filename", f"{path.name} missing in {version.name}/")
            continue
        graph = _onnx_io(path)
        batch = [-1] if cfg.max_batch_size > 0 else []
        for kind, tensors in (("input", cfg.input), ("output", cfg.output)):
            for i, t in enumerate(tensors):
                where = f"{kind}[{i}]"
                if t.name not in graph[kind]:
                    yield Violation("ort.io_names", name, f"{where}.name",
                                    f"'{t.name}' is not a graph {kind} (graph has {sorted(graph[kind])})")
                    continue
                dtype, dims = graph[kind][t.name]
                if dtype != t.data_type:
                    yield Violation("ort.io_dtype", name, f"{where}.data_type",
                                    f"'{t.name}' is {mc.DataType.Name(dtype)} in the graph, "
                                    f"config says {mc.DataType.Name(t.data_type)}")
                ragged = kind == "input" and t.allow_ragged_batch
                if ragged and ctx.view.native_onnxruntime:
                    if dims != [-1]:
                        yield Violation("ort.ragged_input", name, f"{where}.allow_ragged_batch",
                                        f"'{t.name}' has graph shape {dims}; the native backend passes a ragged "
                                        f"input as one flat tensor, so the graph input must be [-1]")
                elif not _dims_agree(dims, batch + list(t.reshape.shape or t.dims)):
                    yield Violation("ort.io_dims", name, f"{where}.dims",
                                    f"'{t.name}' is {dims} in the graph, config gives {batch + list(t.dims)}")


# -- Triton's native openvino backend -------------------------------------------------------------------------

# Every parameter it reads (ModelState::ParseParameters and its per-device overload); any other key is ignored.
OPENVINO_PARAMETERS = ("PERFORMANCE_HINT", "INFERENCE_NUM_THREADS", "COMPILATION_NUM_THREADS", "NUM_STREAMS",
                       "HINT_BF16", "CPU_EXTENSION_PATH", "SKIP_OV_DYNAMIC_BATCHSIZE", "ENABLE_BATCH_PADDING",
                       "RESHAPE_IO_LAYERS", "TARGET_DEVICE")
_OPENVINO_SWITCHES = ("SKIP_OV_DYNAMIC_BATCHSIZE", "ENABLE_BATCH_PADDING", "RESHAPE_IO_LAYERS")
_OPENVINO_TYPES = {mc.TYPE_BOOL, mc.TYPE_UINT8, mc.TYPE_UINT16, mc.TYPE_UINT32, mc.TYPE_UINT64, mc.TYPE_INT8,
                   mc.TYPE_INT16, mc.TYPE_INT32, mc.TYPE_INT64, mc.TYPE_FP16, mc.TYPE_FP32}


def openvino_switch(cfg: mc.ModelConfig, key: str) -> bool:
    """A YES/NO parameter as the backend reads it: on only for YES in any case."""
    return key in cfg.parameters and cfg.parameters[key].string_value.lower() == "yes"


def _openvino_parameter_problem(key: str, value: str) -> str | None:
    """Why the backend refuses (or silently ignores) `value` for `key`; None when it takes it. Empty is unset."""
    low = value.lower()
    if not low or key not in OPENVINO_PARAMETERS:
        return None
    if key in ("INFERENCE_NUM_THREADS", "COMPILATION_NUM_THREADS") and not re.fullmatch(r"[0-9]+", low):
        return f"'{value}' is not a non-negative integer; the model is refused"
    if key == "HINT_BF16" and low != "yes":
        return f"'{value}': only YES is accepted; the model is refused"
    if key == "NUM_STREAMS" and low not in ("auto", "numa") and not re.fullmatch(r"[0-9]+", low):
        return f"'{value}' is not AUTO, NUMA or a number; the model is refused"
    if key == "PERFORMANCE_HINT" and low not in ("latency", "throughput", "cumulative_throughput"):
        return f"'{value}' is not LATENCY, THROUGHPUT or CUMULATIVE_THROUGHPUT; the model is refused"
    if key in _OPENVINO_SWITCHES and low not in ("yes", "no"):
        return f"'{value}' leaves it off: the backend turns it on only for YES"
    if key == "TARGET_DEVICE" and low != "cpu":
        return f"'{value}': NGC's image carries the CPU plugin only"
    return None


def _openvino_dims_problem(graph: list[int], config: list[int], max_batch: int, exact: bool,
                           reshaped: bool) -> str | None:
    """CompareDimsSupported: rank with the batch axis first; fixed input dims equal; outputs match exactly."""
    full = ([max_batch] if max_batch > 0 else []) + config
    if len(graph) != len(full):
        return (f"the graph has rank {len(graph)} {graph}, the config {len(full)} {full}"
                + (" (batch axis first, as max_batch_size > 0)" if max_batch > 0 else ""))
    if reshaped:  # RESHAPE_IO_LAYERS: the config's dims replace the graph's
        return None
    for axis, (g, c) in enumerate(zip(graph, full)):
        if max_batch > 0 and axis == 0:
            continue  # set_batch rewrites the batch axis
        if c == -1 and not exact:
            continue
        if g != -1 and g != c:
            return f"axis {axis} is {g} in the graph, the config says {c}"
    return None


def _check_openvino(name: str, cfg: mc.ModelConfig, model_dir: Path, ctx: Context) -> Iterator[Violation]:
    if not ctx.view.native_openvino:
        return  # the embedded view serves it with our Python-based backend, which pads and packs
    for key, value in sorted(cfg.parameters.items()):
        problem = _openvino_parameter_problem(key, value.string_value)
        if problem:
            yield Violation("ov.parameters", name, f"parameters.{key}", problem)
    for i, group in enumerate(cfg.instance_group):
        auto_cpu = group.kind == mc.ModelInstanceGroup.KIND_AUTO and not ctx.view.gpu
        if group.kind != mc.ModelInstanceGroup.KIND_CPU and not auto_cpu:
            yield Violation("ov.kind_cpu", name, f"instance_group[{i}].kind",
                            f"{mc.ModelInstanceGroup.Kind.Name(group.kind)} in the {ctx.view.name} view; the openvino "
                            f"backend runs KIND_CPU instances only")
    for i, t in enumerate(cfg.input):
        if t.allow_ragged_batch:
            yield Violation("ov.ragged_input", name, f"input[{i}].allow_ragged_batch",
                            f"'{t.name}': the backend shapes a batch like its first request, so a request of "
                            f"another length fails")
    for i, _ in enumerate(cfg.batch_input):
        yield Violation("ov.ragged_input", name, f"batch_input[{i}]", "the openvino backend builds no batch inputs")
    padding = openvino_switch(cfg, "ENABLE_BATCH_PADDING")
    reshaped = openvino_switch(cfg, "RESHAPE_IO_LAYERS")
    if cfg.max_batch_size > 1 and not padding:
        yield Violation("ov.fixed_batch", name, "max_batch_size",
                        f"{cfg.max_batch_size}: compiled at batch {cfg.max_batch_size}, every execution with fewer "
                        f"rows fails; set ENABLE_BATCH_PADDING=YES or serve it non-batching (max_batch_size 0)")
    for version in _version_dirs(model_dir):
        path = version / (cfg.default_model_filename or "model.xml")
        if not path.exists():
            hint = ("; the backend's default is model.xml, so name model.onnx in default_model_filename"
                    if not cfg.default_model_filename and (version / "model.onnx").exists() else "")
            yield Violation("ov.model_file", name, "default_model_filename",
                            f"{path.name} missing in {version.name}/{hint}")
            continue
        if path.suffix == ".xml" and not path.with_suffix(".bin").exists():
            yield Violation("ov.model_file", name, "default_model_filename",
                            f"{path.with_suffix('.bin').name} missing beside {version.name}/{path.name}")
        if path.suffix != ".onnx":
            continue  # the graph rules below read ONNX files; an IR would need OpenVINO itself
        graph = _onnx_io(path)
        if len(cfg.input) != len(graph["input"]):
            yield Violation("ov.input_count", name, "input",
                            f"{len(cfg.input)} configured, the graph has {len(graph['input'])} "
                            f"({sorted(graph['input'])})")
        for kind, tensors in (("input", cfg.input), ("output", cfg.output)):
            for i, t in enumerate(tensors):
                where = f"{kind}[{i}]"
                if t.data_type not in _OPENVINO_TYPES:
                    yield Violation("ov.io_dtype", name, f"{where}.data_type",
                                    f"'{t.name}' is {mc.DataType.Name(t.data_type)}; the openvino backend takes "
                                    f"BOOL, UINT8..UINT64, INT8..INT64, FP16 and FP32 only")
                if t.name not in graph[kind]:
                    yield Violation("ov.io_names", name, f"{where}.name",
                                    f"'{t.name}' is not a graph {kind} (graph has {sorted(graph[kind])})")
                    continue
                dims = graph[kind][t.name][1]
                config = list(t.reshape.shape if t.HasField("reshape") else t.dims)
                problem = _openvino_dims_problem(dims, config, cfg.max_batch_size, exact=kind == "output",
                                                 reshaped=kind == "input" and reshaped)
                if problem:
                    yield Violation("ov.io_dims", name, f"{where}.dims", f"'{t.name}': {problem}")
                served = config if reshaped else dims[1:]
                if kind == "input" and padding and cfg.max_batch_size > 1 and not problem and -1 in served:
                    yield Violation("ov.padding_shape", name, f"{where}.dims",
                                    f"'{t.name}' has a dynamic axis {served}; a padded batch has nowhere to put it")


def _check_tensorrt(name: str, cfg: mc.ModelConfig, model_dir: Path, ctx: Context) -> Iterator[Violation]:
    for i, group in enumerate(cfg.instance_group):
        if group.kind != mc.ModelInstanceGroup.KIND_GPU:
            yield Violation("trt.kind_gpu", name, f"instance_group[{i}].kind",
                            f"{mc.ModelInstanceGroup.Kind.Name(group.kind)}; TensorRT runs on GPUs only")
    wanted = set(cfg.cc_model_filenames.values()) | ({cfg.default_model_filename} - {""})
    versions = _version_dirs(model_dir)
    for version in versions:
        for plan in sorted(wanted or {"model.plan"}):
            for path in (version / plan, (version / plan).with_suffix(".json")):
                if not path.exists():
                    yield Violation("trt.plan_files", name, "cc_model_filenames", f"{version.name}/{path.name} missing")
    for plan, meta in plan_metadata(model_dir, cfg).items():
        built = meta.get("tensorrt")
        if ctx.tensorrt_version and not same_tensorrt(built, ctx.tensorrt_version):
            yield Violation("trt.plan_version", name, "cc_model_filenames",
                            f"{plan} was built by TensorRT {built}; the server runs {ctx.tensorrt_version}")
        profiles = meta.get("profiles", [])
        served = []
        for g, group in enumerate(cfg.instance_group):
            for p in list(group.profile) or ["0"]:
                if not p.lstrip("-").isdigit() or not 0 <= int(p) < len(profiles):
                    yield Violation("trt.profile_index", name, f"instance_group[{g}].profile",
                                    f"'{p}' is not an index in [0, {len(profiles)}) of {plan}")
                else:
                    served.append(profiles[int(p)])
        for profile in served:
            shapes = profile["shapes"]
            for t in cfg.input:
                if t.name not in shapes:
                    continue
                lo, _, hi = (list(s) for s in shapes[t.name])
                if cfg.max_batch_size > 0 and hi[0] < cfg.max_batch_size:
                    yield Violation("trt.max_batch", name, "max_batch_size",
                                    f"{cfg.max_batch_size} but profile '{profile['name']}' of {plan} stops at "
                                    f"batch {hi[0]} for '{t.name}'")
                if t.allow_ragged_batch and len(hi) != 1:
                    yield Violation("trt.ragged_input", name, f"input '{t.name}'.allow_ragged_batch",
                                    f"engine input has rank {len(hi)}; ragged batching needs a flat [-1] input")
                length = ctx.lengths.get((name, t.name))
                if length and len(hi) >= 2 and (lo[-1] > 1 or hi[-1] < length):
                    yield Violation("trt.sequence_cover", name, f"input '{t.name}'",
                                    f"profile '{profile['name']}' of {plan} covers lengths {lo[-1]}..{hi[-1]}, the "
                                    f"tokenizer feeding it emits 1..{length}")


def _check_python(name: str, cfg: mc.ModelConfig, model_dir: Path, ctx: Context) -> Iterator[Violation]:
    for version in _version_dirs(model_dir):
        if not (version / (cfg.default_model_filename or "model.py")).exists():
            yield Violation("python.model_file", name, "default_model_filename", f"{version.name}/model.py missing")


def _check_core(name: str, cfg: mc.ModelConfig, model_dir: Path, ctx: Context) -> Iterator[Violation]:
    for i, t in enumerate(cfg.output):
        if t.label_filename and not (model_dir / t.label_filename).is_file():
            yield Violation("core.label_file", name, f"output[{i}].label_filename",
                            f"'{t.label_filename}' is not in {model_dir.name}/")
    if not ctx.view.gpu:
        for i, group in enumerate(cfg.instance_group):
            if group.kind == mc.ModelInstanceGroup.KIND_GPU:
                yield Violation("core.kind_gpu", name, f"instance_group[{i}].kind",
                                f"KIND_GPU in the {ctx.view.name} view, which has no GPUs")
    inputs = {t.name for t in cfg.input}
    for i, b in enumerate(cfg.batch_input):
        where = f"batch_input[{i}]"
        if len(b.source_input) != 1:
            yield Violation("core.batch_input", name, f"{where}.source_input",
                            f"kind {mc.BatchInput.Kind.Name(b.kind)} expects 1 source input, got {len(b.source_input)}")
        if b.data_type not in (mc.TYPE_INT32, mc.TYPE_FP32):
            yield Violation("core.batch_input", name, f"{where}.data_type",
                            f"{mc.DataType.Name(b.data_type)}; batch inputs are TYPE_INT32 or TYPE_FP32")
        for src in b.source_input:
            if src not in inputs:
                yield Violation("core.batch_input", name, f"{where}.source_input", f"unknown input '{src}'")
    if cfg.platform == "ensemble":
        try:
            check_ensemble(cfg, ctx.configs)
        except ConfigError as err:
            yield Violation("core.ensemble", name, err.field, str(err).split(": ", 2)[-1])


def embedded_models(repository: Path) -> tuple[list[str], list[str]]:
    """(served, skipped): the embedded server has no TensorRT backend, so `tensorrt_plan` models made by
    `make build-engines`, and ensembles that use them, are left to the NGC container."""
    configs = load_repository(repository)
    skipped = {n for n, c in configs.items() if c.platform == "tensorrt_plan" or c.backend == "tensorrt"}
    changed = True
    while changed:  # ensembles of ensembles
        changed = False
        for name, cfg in configs.items():
            if name not in skipped and any(st.model_name in skipped for st in cfg.ensemble_scheduling.step):
                skipped.add(name)
                changed = True
    return sorted(set(configs) - skipped), sorted(skipped)


def loaded_models(repository: Path, view: View) -> dict[str, mc.ModelConfig]:
    """The models a view's server loads: without TensorRT, plans and the ensembles using them are left out (as the
    embedded launcher does; an NGC CPU view is generated without them)."""
    configs = load_repository(repository)
    if view.tensorrt:
        return configs
    served, _ = embedded_models(repository)
    return {n: configs[n] for n in served}


def check_repository(repository: Path, view: View | str, tensorrt_version: str | None = None) -> list[Violation]:
    """Every rule on every model the view's server would load; an empty list means nothing known refuses it."""
    view = VIEWS[view] if isinstance(view, str) else view
    repository = Path(repository)
    configs = loaded_models(repository, view)
    ctx = Context(view, configs, tensorrt_version, tokenizer_lengths(configs))
    violations: list[Violation] = []
    for name, cfg in sorted(configs.items()):
        model_dir = repository / name
        checks: list[Check] = [_check_core]
        if is_onnxruntime(cfg):
            checks.append(_check_onnxruntime)
        elif is_openvino(cfg):
            checks.append(_check_openvino)
        elif is_tensorrt(cfg):
            checks.append(_check_tensorrt)
        elif cfg.backend == "python":
            checks.append(_check_python)
        for check in checks:
            violations.extend(check(name, cfg, model_dir, ctx))
    return violations


def unbuilt_models(repository: Path | None = None) -> dict[str, list[str]]:
    """Spec name → its models in the repository, for the specs whose FP32 file `make build` has not written here
    yet (their configs are committed; their files are not). A model's spec is the one its generated config's first
    line names."""
    from tritonkit import kinds, paths

    repository = Path(repository or paths.MODEL_REPOSITORY)
    by_spec: dict[str, list[str]] = {}
    for config in sorted(repository.glob("*/config.pbtxt")):
        found = re.match(r"# Generated from (\S+\.toml) ", config.read_text().partition("\n")[0])
        if found:
            by_spec.setdefault(Path(found[1]).stem, []).append(config.parent.name)
    specs = set(kinds.names())
    return {name: models for name, models in by_spec.items() if name in specs
            and not (repository / kinds.get(name).FP32_MODEL / "1" / "model.onnx").exists()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Triton's native load rules on a repository view")
    parser.add_argument("repository", type=Path)
    parser.add_argument("--view", choices=sorted(VIEWS), required=True)
    parser.add_argument("--skip-unbuilt", action="store_true",
                        help="leave out (and name) the models of specs not built here: a view of model_repository")
    args = parser.parse_args(argv)
    view = VIEWS[args.view]
    chosen = release.selected()
    tensorrt = target_server(chosen.ngc).tensorrt if view.tensorrt else None  # a CPU view needs no TensorRT
    violations = check_repository(args.repository, view, tensorrt)
    if args.skip_unbuilt:
        for spec, models in sorted(unbuilt_models().items()):
            print(f"not built: {spec} ({', '.join(models)}); `make build MODEL={spec}` builds it")
            violations = [v for v in violations if v.model not in set(models)]
    for v in violations:
        print(f"refused: {v}\n  {RULES[v.rule].url_for(chosen)}")
    print(f"{args.repository} ({args.view} view, NGC {chosen.ngc}, rules as on the {chosen.branch} branches"
          f"{f', TensorRT {tensorrt}' if tensorrt else ''}): {len(violations)} violation(s) of {len(RULES)} rules")
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
