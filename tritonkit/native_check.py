"""Native-load check: the rules by which Triton's own backends refuse (or misserve) a model, run on a repository
view before any server sees it.

The embedded server and the NGC container read the same config schema but not the same backends: there,
`backend: "onnxruntime"` is the native ONNX Runtime backend, TensorRT plans load, and KIND_GPU needs a GPU. Every
rule below names the upstream source it restates (the r24.10 branches, the release paired with the embedded 2.51
core), so a rule can be re-read against a newer release. What needs a GPU or TensorRT to know (a plan's
profiles, its TensorRT version) is read from the metadata `tritonkit.engines` writes beside each plan.

    python -m tritonkit.native_check build/ngc_repository --view ngc-gpu
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from tritonkit.config import ConfigError, check_ensemble, load_repository
from tritonkit.engines import is_tensorrt_config as is_tensorrt
from tritonkit.engines import same_tensorrt, target_server
from tritonkit.server import embedded_models

UPSTREAM = "https://github.com/triton-inference-server"
RELEASE_BRANCH = "r24.10"


@dataclass(frozen=True)
class Rule:
    id: str
    source: str  # upstream repository/path (function) that enforces it
    summary: str

    @property
    def url(self) -> str:
        repo, _, path = self.source.partition("/")
        return f"{UPSTREAM}/{repo}/blob/{RELEASE_BRANCH}/{path.split(' ')[0]}"


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
         "the metadata tritonkit.engines writes beside it"),
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
)}


@dataclass(frozen=True)
class View:
    """What a server makes of a repository: which ONNX Runtime backend `backend: "onnxruntime"` means, whether
    it has GPUs, whether it loads TensorRT plans."""

    name: str
    native_onnxruntime: bool
    gpu: bool
    tensorrt: bool


VIEWS = {v.name: v for v in (
    View("embedded", native_onnxruntime=False, gpu=False, tensorrt=False),
    View("ngc-gpu", native_onnxruntime=True, gpu=True, tensorrt=True),
    View("ngc-cpu", native_onnxruntime=True, gpu=False, tensorrt=False),
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
    """Plan file name → the metadata tritonkit.engines wrote beside it (absent plans are left out)."""
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
        elif is_tensorrt(cfg):
            checks.append(_check_tensorrt)
        elif cfg.backend == "python":
            checks.append(_check_python)
        for check in checks:
            violations.extend(check(name, cfg, model_dir, ctx))
    return violations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Triton's native load rules on a repository view")
    parser.add_argument("repository", type=Path)
    parser.add_argument("--view", choices=sorted(VIEWS), required=True)
    args = parser.parse_args(argv)
    target = target_server()
    violations = check_repository(args.repository, args.view, target.tensorrt)
    for v in violations:
        print(f"refused: {v}")
    print(f"{args.repository} ({args.view} view, NGC {target.release}, TensorRT {target.tensorrt}): "
          f"{len(violations)} violation(s) of {len(RULES)} rules")
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
