"""Model configs: dataclasses → Triton's `ModelConfig` protobuf → config.pbtxt, and repository validation.

Parsing goes through tritonclient's `model_config_pb2`, the same schema tritonserver uses, so a typo fails here
with the field named, not at server start. `validate_repository` also checks ensembles end to end.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tritonkit.errors import ConfigError

# -- building configs ----------------------------------------------------------------------------------------

@dataclass
class Tensor:
    name: str
    dtype: str  # Triton type without prefix: "FP32", "INT64", "STRING" ...
    dims: list[int]
    allow_ragged_batch: bool = False
    optional: bool = False
    label_filename: str = ""

    def to_proto(self, cls):
        t = cls(name=self.name, data_type=mc.DataType.Value(f"TYPE_{self.dtype}"), dims=self.dims)
        if self.allow_ragged_batch:
            t.allow_ragged_batch = True
        if self.optional:
            t.optional = True
        if self.label_filename:
            t.label_filename = self.label_filename
        return t


@dataclass
class DynamicBatching:
    preferred_batch_size: list[int] = field(default_factory=list)
    max_queue_delay_microseconds: int = 0


@dataclass
class EnsembleStep:
    model_name: str
    input_map: dict[str, str]  # step-model input -> ensemble tensor
    output_map: dict[str, str]  # step-model output -> ensemble tensor
    model_version: int = -1


@dataclass
class ModelSpec:
    """One model's config; `to_pbtxt()` goes through the protobuf schema, so it is valid by construction."""

    name: str
    backend: str = ""
    platform: str = ""
    max_batch_size: int = 0
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    instance_count: int = 1
    instance_kind: str = "KIND_CPU"
    dynamic_batching: DynamicBatching | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    ensemble_steps: list[EnsembleStep] = field(default_factory=list)
    default_model_filename: str = ""
    # Comment lines written above the config (e.g. "generated from ...; do not edit").
    header: list[str] = field(default_factory=list)

    def to_proto(self) -> mc.ModelConfig:
        cfg = mc.ModelConfig(name=self.name, max_batch_size=self.max_batch_size)
        if self.backend:
            cfg.backend = self.backend
        if self.platform:
            cfg.platform = self.platform
        if self.default_model_filename:
            cfg.default_model_filename = self.default_model_filename
        cfg.input.extend(t.to_proto(mc.ModelInput) for t in self.inputs)
        cfg.output.extend(t.to_proto(mc.ModelOutput) for t in self.outputs)
        if self.ensemble_steps:
            for step in self.ensemble_steps:
                cfg.ensemble_scheduling.step.add(
                    model_name=step.model_name,
                    model_version=step.model_version,
                    input_map=step.input_map,
                    output_map=step.output_map,
                )
        else:
            cfg.instance_group.add(
                count=self.instance_count, kind=mc.ModelInstanceGroup.Kind.Value(self.instance_kind)
            )
        if self.dynamic_batching is not None:
            db = self.dynamic_batching
            cfg.dynamic_batching.preferred_batch_size.extend(db.preferred_batch_size)
            cfg.dynamic_batching.max_queue_delay_microseconds = db.max_queue_delay_microseconds
        for key, value in self.parameters.items():
            cfg.parameters[key].string_value = str(value)
        check_config(cfg)
        return cfg

    def to_pbtxt(self) -> str:
        return "".join(f"# {line}\n" for line in self.header) + to_pbtxt(self.to_proto())

    def write(self, repository: Path) -> Path:
        path = Path(repository) / self.name / "config.pbtxt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_pbtxt())
        if self.ensemble_steps:  # Triton loads an ensemble only with a (empty) version directory
            (path.parent / "1").mkdir(exist_ok=True)
        return path


def to_pbtxt(cfg: mc.ModelConfig) -> str:
    return text_format.MessageToString(cfg)


# -- parsing and checking ------------------------------------------------------------------------------------

_NO_FIELD = re.compile(r'has no field named "(\w+)"')
_POSITION = re.compile(r"^(\d+):(\d+)")


def _field_of_parse_error(text: str, message: str) -> str:
    """The field a text_format error is about: the unknown name, else the `field:` nearest the error position."""
    match = _NO_FIELD.search(message)
    if match:
        return match.group(1)
    pos = _POSITION.match(message)
    if pos:
        line_no, col = int(pos.group(1)), int(pos.group(2))
        lines = text.splitlines()
        if 0 < line_no <= len(lines):
            names = re.findall(r"(\w+)\s*:", lines[line_no - 1][: col + 1])
            if names:
                return names[-1]
    return "?"


def parse_config(text: str, model: str = "<config>") -> mc.ModelConfig:
    """Parse pbtxt into ModelConfig; a schema error names the field and the line."""
    cfg = mc.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as err:
        raise ConfigError(model, _field_of_parse_error(text, str(err)), f"does not parse ({err})") from None
    return cfg


def load_config(path: Path) -> mc.ModelConfig:
    path = Path(path)
    model = path.parent.name
    cfg = parse_config(path.read_text(), model)
    if cfg.name and cfg.name != model:
        raise ConfigError(model, "name", f"'{cfg.name}' differs from its directory name '{model}'")
    if not cfg.name:
        cfg.name = model
    check_config(cfg)
    return cfg


def check_config(cfg: mc.ModelConfig) -> None:
    """Semantic checks tritonserver would otherwise make at load time (or silently accept)."""
    m = cfg.name or "<config>"
    is_ensemble = cfg.platform == "ensemble"
    if not (cfg.backend or cfg.platform):
        raise ConfigError(m, "backend", "neither backend nor platform is set")
    if cfg.max_batch_size < 0:
        raise ConfigError(m, "max_batch_size", f"must be >= 0, got {cfg.max_batch_size}")
    for kind, tensors in (("input", cfg.input), ("output", cfg.output)):
        if not tensors:
            raise ConfigError(m, kind, "at least one is required")
        seen = set()
        for i, t in enumerate(tensors):
            where = f"{kind}[{i}]"
            if not t.name:
                raise ConfigError(m, f"{where}.name", "is empty")
            if t.name in seen:
                raise ConfigError(m, f"{where}.name", f"duplicate name '{t.name}'")
            seen.add(t.name)
            if t.data_type == mc.TYPE_INVALID:
                raise ConfigError(m, f"{where}.data_type", f"missing for '{t.name}'")
            if not t.dims and not t.reshape.shape:
                raise ConfigError(m, f"{where}.dims", f"missing for '{t.name}'")
            if any(d == 0 or d < -1 for d in t.dims):
                raise ConfigError(m, f"{where}.dims", f"'{t.name}' has dims {list(t.dims)}; use -1 or > 0")
    db = cfg.dynamic_batching
    if cfg.HasField("dynamic_batching"):
        # With max_batch_size 0 the batcher sends one request per execution and keeps its queue policy (core
        # dynamic_batch_scheduler.cc: max(1, max_batch_size)); any preferred size is then refused below.
        for size in db.preferred_batch_size:
            if not 0 < size <= cfg.max_batch_size:
                raise ConfigError(
                    m, "dynamic_batching.preferred_batch_size",
                    f"{size} is outside 1..max_batch_size ({cfg.max_batch_size})",
                )
    for i, group in enumerate(cfg.instance_group):
        if group.count < 0:
            raise ConfigError(m, f"instance_group[{i}].count", f"must be >= 1, got {group.count}")
    if is_ensemble and not cfg.ensemble_scheduling.step:
        raise ConfigError(m, "ensemble_scheduling.step", "an ensemble needs at least one step")
    if not is_ensemble and cfg.HasField("ensemble_scheduling"):
        raise ConfigError(m, "platform", "ensemble_scheduling given but platform is not 'ensemble'")



def is_tensorrt_config(cfg) -> bool:
    return cfg.platform == "tensorrt_plan" or cfg.backend == "tensorrt"

def find_configs(repository: Path) -> list[Path]:
    return sorted(Path(repository).glob("*/config.pbtxt"))


def load_repository(repository: Path) -> dict[str, mc.ModelConfig]:
    return {p.parent.name: load_config(p) for p in find_configs(repository)}


def _full_dims(cfg: mc.ModelConfig, tensor) -> list[int]:
    """Dims as a request sees them: batch axis (-1) first when the model batches."""
    return ([-1] if cfg.max_batch_size > 0 else []) + list(tensor.dims)


def _dims_compatible(a: Iterable[int], b: Iterable[int]) -> bool:
    a, b = list(a), list(b)
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b))


def find_profiles(repository: Path) -> list[str]:
    """Named config profiles: `<model>/configs/<profile>.pbtxt`, chosen with tritonserver --model-config-name."""
    return sorted({p.stem for p in Path(repository).glob("*/configs/*.pbtxt")})


def load_profile(repository: Path, profile: str) -> dict[str, mc.ModelConfig]:
    """The repository as the server sees it under --model-config-name=<profile>: the profile's config where a
    model has one, config.pbtxt elsewhere."""
    configs = load_repository(repository)
    for path in Path(repository).glob(f"*/configs/{profile}.pbtxt"):
        model = path.parent.parent.name
        cfg = parse_config(path.read_text(), f"{model} (profile {profile})")
        if cfg.name and cfg.name != model:
            raise ConfigError(model, "name", f"profile '{profile}' names '{cfg.name}', not its model directory")
        cfg.name = model
        check_config(cfg)
        configs[model] = cfg
    return configs


def validate_repository(repository: Path) -> dict[str, mc.ModelConfig]:
    """Load every config and check that each ensemble's steps exist and connect with agreeing types; the same
    for the repository as seen under each named profile."""
    configs = load_repository(repository)
    for view in [configs] + [load_profile(repository, p) for p in find_profiles(repository)]:
        for cfg in view.values():
            if cfg.platform == "ensemble":
                check_ensemble(cfg, view)
    return configs


def check_ensemble(ens: mc.ModelConfig, configs: dict[str, mc.ModelConfig]) -> None:
    m = ens.name
    # tensor name -> (data_type, full dims, where it came from)
    available = {t.name: (t.data_type, _full_dims(ens, t), "ensemble input") for t in ens.input}
    for i, step in enumerate(ens.ensemble_scheduling.step):
        where = f"ensemble_scheduling.step[{i}]"
        target = configs.get(step.model_name)
        if target is None:
            raise ConfigError(m, f"{where}.model_name", f"model '{step.model_name}' is not in the repository")
        # A non-batching step (max_batch_size 0) takes the batch axis in its dims (core ensemble_utils.cc
        # ValidateEnsembleConfig), so only a batching step must batch at least as much as the ensemble.
        if ens.max_batch_size > 0 and 0 < target.max_batch_size < ens.max_batch_size:
            raise ConfigError(
                m, f"{where}.model_name",
                f"'{step.model_name}' max_batch_size {target.max_batch_size} < ensemble's {ens.max_batch_size}",
            )
        inputs = {t.name: t for t in target.input}
        for model_input, tensor in step.input_map.items():
            if model_input not in inputs:
                raise ConfigError(
                    m, f"{where}.input_map", f"'{model_input}' is not an input of '{step.model_name}'"
                )
            if tensor not in available:
                raise ConfigError(
                    m, f"{where}.input_map", f"'{tensor}' is neither an ensemble input nor an earlier step output"
                )
            dtype, dims, origin = available[tensor]
            want = inputs[model_input]
            if dtype != want.data_type:
                raise ConfigError(
                    m, f"{where}.input_map",
                    f"'{tensor}' ({origin}) is {mc.DataType.Name(dtype)} but '{step.model_name}.{model_input}' "
                    f"expects {mc.DataType.Name(want.data_type)}",
                )
            if not _dims_compatible(dims, _full_dims(target, want)):
                raise ConfigError(
                    m, f"{where}.input_map",
                    f"'{tensor}' ({origin}) has dims {dims} but '{step.model_name}.{model_input}' expects "
                    f"{_full_dims(target, want)}",
                )
        missing = [t.name for t in target.input if not t.optional and t.name not in step.input_map]
        if missing:
            raise ConfigError(m, f"{where}.input_map", f"required inputs of '{step.model_name}' unmapped: {missing}")
        outputs = {t.name: t for t in target.output}
        for model_output, tensor in step.output_map.items():
            if model_output not in outputs:
                raise ConfigError(
                    m, f"{where}.output_map", f"'{model_output}' is not an output of '{step.model_name}'"
                )
            out = outputs[model_output]
            available[tensor] = (out.data_type, _full_dims(target, out), f"output of {step.model_name}")
    for i, out in enumerate(ens.output):
        if out.name not in available:
            raise ConfigError(m, f"output[{i}]", f"'{out.name}' is produced by no step")
        dtype, dims, origin = available[out.name]
        if dtype != out.data_type:
            raise ConfigError(
                m, f"output[{i}].data_type",
                f"'{out.name}' is {mc.DataType.Name(dtype)} ({origin}), config says {mc.DataType.Name(out.data_type)}",
            )
        if not _dims_compatible(dims, _full_dims(ens, out)):
            raise ConfigError(m, f"output[{i}].dims", f"'{out.name}' has dims {dims} ({origin})")


def main(argv: list[str] | None = None) -> int:
    import argparse

    from tritonkit import paths

    parser = argparse.ArgumentParser(description="validate every config.pbtxt of a model repository")
    parser.add_argument("repository", nargs="?", default=str(paths.MODEL_REPOSITORY))
    args = parser.parse_args(argv)
    try:
        configs = validate_repository(Path(args.repository))
    except ConfigError as err:
        print(f"invalid: {err}")
        return 1
    for name, cfg in configs.items():
        print(f"ok  {name:24s} {cfg.platform or cfg.backend}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
