"""Named config profiles: the knobs `tritonkit.perf.tune` moves, and the configs/<profile>.pbtxt files it leaves.

A tuned profile is regenerated from today's config.pbtxt plus the knobs its tuner changed (`tuned_profiles`, called
by `python -m tritonkit.repository.generate`), so a profile follows its spec instead of freezing the config it was
tuned from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from tritonkit import paths
from tritonkit.repository import variants
from tritonkit.repository.config import check_config, to_pbtxt
from tritonkit.serving.runtimes import THREAD_PARAMETER

PROFILES = paths.ROOT / "profiles"


# knob → candidate values, in order (neighbours are the adjacent entries)
VALUES: dict[str, tuple] = {
    "queue_delay_us": (0, 250, 500, 1000, 2000, 4000, 8000, 16000),
    "preferred_batch": (0, 4, 8, 16, 32),  # 0: none (the batcher sends as large a batch as is queued)
    "max_batch": (8, 16, 32, 64, 128),
    "instances": (1, 2, 3, 4),
    "threads": (1, 2, 4),
    "bucket_padding": (0.1, 0.25, 0.4, 1.0),  # ragged_max_padding; 1.0: one run per execute()
}


def get_knob(cfg: mc.ModelConfig, knob: str):
    if knob == "queue_delay_us":
        return cfg.dynamic_batching.max_queue_delay_microseconds
    if knob == "preferred_batch":
        return max(cfg.dynamic_batching.preferred_batch_size, default=0)
    if knob == "max_batch":
        return cfg.max_batch_size
    if knob == "instances":
        return cfg.instance_group[0].count if cfg.instance_group else 1
    # .get(): indexing a protobuf map would insert the missing key into the config being read.
    if knob == "threads":
        param = cfg.parameters.get(THREAD_PARAMETER.get(cfg.backend, "intra_op_thread_count"))
        return int(param.string_value) if param and param.string_value else 0
    if knob == "bucket_padding":
        param = cfg.parameters.get("ragged_max_padding")
        return float(param.string_value) if param and param.string_value else 1.0
    raise KeyError(knob)


def set_knob(cfg: mc.ModelConfig, knob: str, value) -> None:
    if knob == "queue_delay_us":
        cfg.dynamic_batching.max_queue_delay_microseconds = value
    elif knob == "preferred_batch":
        del cfg.dynamic_batching.preferred_batch_size[:]
        if value:
            cfg.dynamic_batching.preferred_batch_size.append(min(value, cfg.max_batch_size))
    elif knob == "max_batch":
        cfg.max_batch_size = value
        pbs = [b for b in cfg.dynamic_batching.preferred_batch_size if b <= value]
        del cfg.dynamic_batching.preferred_batch_size[:]
        cfg.dynamic_batching.preferred_batch_size.extend(pbs)
    elif knob == "instances":
        if not cfg.instance_group:
            cfg.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU)
        cfg.instance_group[0].count = value
    elif knob == "threads":
        cfg.parameters[THREAD_PARAMETER.get(cfg.backend, "intra_op_thread_count")].string_value = str(value)
    elif knob == "bucket_padding":
        cfg.parameters["ragged_max_padding"].string_value = f"{value:g}"
    else:
        raise KeyError(knob)


def knobs_of(cfg: mc.ModelConfig) -> list[str]:
    knobs = []
    if cfg.HasField("dynamic_batching"):
        knobs += ["queue_delay_us", "preferred_batch"]
    knobs += ["max_batch", "instances"]
    if cfg.backend in THREAD_PARAMETER:
        knobs.append("threads")
        if any(i.allow_ragged_batch for i in cfg.input):
            knobs.append("bucket_padding")
    return knobs


Point = dict[str, dict[str, object]]  # model → knob → value


def apply(configs: dict[str, mc.ModelConfig], ensemble: str, point: Point) -> dict[str, mc.ModelConfig]:
    """Copies of the configs with the point's knobs set; the ensemble's max_batch_size follows its steps'."""
    out = {}
    for name, cfg in configs.items():
        new = mc.ModelConfig()
        new.CopyFrom(cfg)
        for knob, value in point.get(name, {}).items():
            set_knob(new, knob, value)
        out[name] = new
    out[ensemble].max_batch_size = min(out[s.model_name].max_batch_size
                                       for s in out[ensemble].ensemble_scheduling.step)
    for cfg in out.values():
        check_config(cfg)
    return out


def changed_configs(base: dict[str, mc.ModelConfig], ensemble: str, point: Point) -> dict[str, mc.ModelConfig]:
    """The configs that differ from `base` at this point (only these get a configs/<profile>.pbtxt)."""
    new = apply(base, ensemble, point)
    return {name: cfg for name, cfg in new.items() if to_pbtxt(cfg) != to_pbtxt(base[name])}


def profile_files(profile: str, configs: dict[str, mc.ModelConfig], record: dict,
                  repository: Path = paths.MODEL_REPOSITORY) -> dict[Path, str]:
    """configs/<profile>.pbtxt text per changed model, headed by where its knobs come from."""
    header = (f"# Profile '{profile}': config.pbtxt with the knobs `{record['command']}` chose (tritonkit.perf.tune); "
              f"generated, do not edit.\n# Serve it with `make serve PROFILE={profile}` / tritonserver "
              f"--model-config-name={profile}. Knobs and measurements: profiles/{record['ensemble']}.{profile}.json\n")
    return {Path(repository) / name / "configs" / f"{profile}.pbtxt": header + to_pbtxt(cfg)
            for name, cfg in configs.items()}


def tuned_profiles(repository: Path = paths.MODEL_REPOSITORY) -> dict[Path, str]:
    """configs/<profile>.pbtxt of every committed tune record: today's config.pbtxt with the knobs the tuner changed
    from where it started, so a profile follows its spec (parameters added or defaults measured after it was tuned)
    instead of freezing the config it was tuned from."""
    out: dict[Path, str] = {}
    for path in sorted(PROFILES.glob("*.json")):
        record = json.loads(path.read_text())
        if not all((Path(repository) / m / "config.pbtxt").exists() for m in record["models"]):
            continue  # a spec whose configs are not generated yet
        base = {m: variants.read_config(m, repository, committed=False) for m in record["models"]}
        moved = {m: {k: v for k, v in knobs.items() if record["start"].get(m, {}).get(k) != v}
                 for m, knobs in record["winner"].items()}
        out |= profile_files(record["profile"], changed_configs(base, record["ensemble"], moved), record, repository)
    return out


def write_profile(profile: str, configs: dict[str, mc.ModelConfig], record: dict,
                  repository: Path = paths.MODEL_REPOSITORY) -> list[Path]:
    """configs/<profile>.pbtxt per changed model + profiles/<ensemble>.<profile>.json, all or nothing."""
    targets = profile_files(profile, configs, record, repository)
    targets[PROFILES / f"{record['ensemble']}.{profile}.json"] = json.dumps(record, indent=2) + "\n"
    # The previous profile of this ensemble: files of models no longer changed are removed.
    stale = {Path(repository) / m / "configs" / f"{profile}.pbtxt" for m in record["models"]} - set(targets)
    backups = {p: p.read_bytes() for p in [*targets, *stale] if p.exists()}
    written: list[Path] = []
    try:
        for path, text in targets.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
            written.append(path)
        for path in stale:
            path.unlink(missing_ok=True)
    except BaseException:  # Ctrl-C included: leave the previous profile as it was
        for path in targets:
            path.with_suffix(path.suffix + ".tmp").unlink(missing_ok=True)
        for path in written:
            if path in backups:
                path.write_bytes(backups[path])
            else:
                path.unlink(missing_ok=True)
        for path in stale:
            if path in backups:
                path.write_bytes(backups[path])
        raise
    return sorted(targets)
