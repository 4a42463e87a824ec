"""Config variants of the model repository for experiments, without touching `model_repository/`.

`make_variant(dest, models, edits)` copies the named models into `dest`: each `config.pbtxt` is parsed into
Triton's `ModelConfig` (tritonclient's `model_config_pb2`, the schema tritonserver uses), edited by a function,
checked and written back; every other entry of the model directory (version folders with `model.onnx`, which is
tens of MB, `model.py`, labels) is symlinked, so a variant costs a few kilobytes and takes milliseconds.

By default the configs are read as committed (`git show HEAD:model_repository/<m>/config.pbtxt`), so a benchmark
measures the committed configuration even while someone edits the working tree; `committed=False` reads the
working tree (used as the fallback outside a git checkout).

    from tritonkit.repository import variants as rv
    repo = rv.make_variant(tmp / "prio", rv.TEXT_PIPELINE,
                           {m: rv.priority_levels(2) for m in ("tokenizer", "text_encoder")})
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from tritonkit import paths
from tritonkit.repository.config import check_config, parse_config, to_pbtxt
from tritonkit.repository.runtime_choice import serve_on  # lives with the runtime choice; its callers use it here

Edit = Callable[[mc.ModelConfig], None]

# The text_embedding ensemble and its composing models.
TEXT_PIPELINE = ("text_embedding", "tokenizer", "text_encoder")


def read_config(model: str, source: Path = paths.MODEL_REPOSITORY, committed: bool = True) -> mc.ModelConfig:
    """A model's config as committed at HEAD (default) or as in the working tree."""
    path = Path(source) / model / "config.pbtxt"
    text = None
    if committed:
        try:
            rel = path.resolve().relative_to(paths.ROOT)
            text = subprocess.run(
                ["git", "-C", str(paths.ROOT), "show", f"HEAD:{rel.as_posix()}"],
                capture_output=True, text=True, check=True,
            ).stdout
        except (ValueError, OSError, subprocess.CalledProcessError):
            text = None  # not in this checkout, or not committed: use the file as it is
    cfg = parse_config(path.read_text() if text is None else text, model)
    if not cfg.name:
        cfg.name = model
    return cfg


def make_variant(
    dest: Path,
    models: Iterable[str],
    edits: Mapping[str, Edit] | None = None,
    source: Path = paths.MODEL_REPOSITORY,
    committed: bool = True,
) -> Path:
    """Write a repository at `dest` holding `models`, with `edits[model](cfg)` applied to their configs."""
    dest = Path(dest)
    models = list(models)
    edits = dict(edits or {})
    unknown = set(edits) - set(models)
    if unknown:
        raise ValueError(f"edits for models not in the variant: {sorted(unknown)}")
    dest.mkdir(parents=True, exist_ok=True)
    for model in models:
        src_dir = Path(source) / model
        if not src_dir.is_dir():
            raise FileNotFoundError(f"model '{model}' not found in {source}")
        cfg = read_config(model, source, committed)
        if model in edits:
            edits[model](cfg)
        check_config(cfg)
        out = dest / model
        out.mkdir(exist_ok=True)
        for entry in src_dir.iterdir():
            if entry.name == "config.pbtxt" or entry.name.startswith("."):
                continue
            link = out / entry.name
            if link.is_symlink() or link.exists():
                link.unlink()
            os.symlink(entry.resolve(), link)
        (out / "config.pbtxt").write_text(to_pbtxt(cfg))
    return dest


# -- common edits -------------------------------------------------------------------------------------------

def priority_levels(levels: int = 2, default: int | None = None) -> Edit:
    """dynamic_batching { priority_levels: N default_priority_level: D } (D defaults to the lowest, N).

    Priority 1 is the highest; a request without priority (0) gets the default level.
    """
    default = levels if default is None else default

    def edit(cfg: mc.ModelConfig) -> None:
        if not cfg.HasField("dynamic_batching"):
            raise ValueError(f"{cfg.name}: priority levels need a dynamic_batching block")
        cfg.dynamic_batching.priority_levels = levels
        cfg.dynamic_batching.default_priority_level = default

    return edit


def queue_policy(timeout_us: int, max_queue_size: int) -> Edit:
    """Bounded queue that sheds: REJECT after `timeout_us` in the queue (a request may ask for less), and refuse
    at once beyond `max_queue_size` (Triton answers gRPC UNAVAILABLE / HTTP 503)."""

    def edit(cfg: mc.ModelConfig) -> None:
        policy = cfg.dynamic_batching.default_queue_policy
        policy.timeout_action = mc.ModelQueuePolicy.REJECT
        policy.default_timeout_microseconds = timeout_us
        policy.allow_timeout_override = True
        policy.max_queue_size = max_queue_size

    return edit


def response_cache(enable: bool = True) -> Edit:
    """response_cache { enable: true } (needs the server started with `--cache-config local,size=...`)."""

    def edit(cfg: mc.ModelConfig) -> None:
        cfg.response_cache.enable = enable

    return edit


def chain(*fns: Edit) -> Edit:
    """Several edits applied in order to one config."""

    def edit(cfg: mc.ModelConfig) -> None:
        for fn in fns:
            fn(cfg)

    return edit


# -- the `overload` profile ---------------------------------------------------------------------------------------

OVERLOAD_PROFILE = "overload"
# Where each pipeline sheds: every step, since a cheap first step (the tokenizer) passes everything on and the
# queue then grows at the next one. Timeouts sit above a full batch's worst case at normal load; the queue sizes are
# a memory backstop well above what the timeout lets pile up at 4x load (perf/bench_overload.py measures both).
# Per step, (default_timeout_microseconds, max_queue_size) of the overload profile's shedding queues: each kind's
# class says (tritonkit.kinds.base.Kind.OVERLOAD).


def overload_policies() -> dict[str, tuple[int, int]]:
    """model → (timeout µs, max queue size) for every step of every spec'd pipeline."""
    from tritonkit import kinds

    out = {}
    for name in kinds.names():
        kind = kinds.get(name)
        by_step = kind.OVERLOAD
        out[kind.PREPROCESSOR] = by_step["preprocessor"]
        for model in (kind.INT8_MODEL, kind.FP32_MODEL):
            out[model] = by_step["model"]
    return out


def overload_instances() -> dict[str, int]:
    """The preprocessor instances a kind caps in the overload profile (an image pipeline: one JPEG decoder), so
    that it cannot outrun the model: work done for a request a later step sheds is wasted."""
    from tritonkit import kinds

    capped = {n: getattr(kinds.get(n), "OVERLOAD_PREPROCESSOR_INSTANCES", None) for n in kinds.names()}
    return {kinds.get(n).PREPROCESSOR: count for n, count in capped.items() if count}


def __getattr__(name: str):
    if name == "OVERLOAD_POLICIES":
        return overload_policies()
    if name == "OVERLOAD_INSTANCES":
        return overload_instances()
    raise AttributeError(name)


def _instances(count: int) -> Edit:
    def edit(cfg: mc.ModelConfig) -> None:
        for group in cfg.instance_group:
            group.count = count

    return edit


def overload_profile(repository: Path = paths.MODEL_REPOSITORY) -> dict[Path, str]:
    """configs/overload.pbtxt per shedding model: its config.pbtxt plus the queue policy and, for entry steps that
    would outrun the next one, fewer instances (generated, not edited, so that the profile never drifts from the
    default config)."""
    out = {}
    instances = overload_instances()
    for model, (timeout_us, size) in overload_policies().items():
        if not (Path(repository) / model / "config.pbtxt").exists():
            continue  # a spec whose configs are not generated yet
        cfg = read_config(model, repository, committed=False)
        queue_policy(timeout_us, size)(cfg)
        if model in instances:
            _instances(instances[model])(cfg)
        check_config(cfg)
        header = (f"# Generated by `python -m tritonkit.repository.variants` from config.pbtxt + a shedding queue "
                  f"policy{' + fewer instances' if model in instances else ''}; "
                  f"do not edit.\n# Served with `make serve PROFILE={OVERLOAD_PROFILE}` "
                  f"(tritonserver --model-config-name={OVERLOAD_PROFILE}). Why it is not the default: config.pbtxt.\n")
        out[Path(repository) / model / "configs" / f"{OVERLOAD_PROFILE}.pbtxt"] = header + to_pbtxt(cfg)
    return out


# -- the NGC container's view --------------------------------------------------------------------------------------

NGC_REPOSITORY = paths.ROOT / "build" / "ngc_repository"
NGC_CPU_REPOSITORY = paths.ROOT / "build" / "ngc_cpu_repository"
# Parameters of our Python-based ONNX Runtime backend that mean nothing to the native one (length buckets, padding,
# packed batches) and the packed graphs only it reads.
EMBEDDED_ORT_PARAMETERS = ("ragged_max_padding", "pad_value.", "packed_")
EMBEDDED_ORT_FILES = ("*.packed.onnx",)
_GENERATED = ".generated-by-tritonkit"


def native_onnxruntime(cfg: mc.ModelConfig) -> None:
    """The padded form for Triton's native ONNX Runtime backend: there allow_ragged_batch means one flat tensor
    plus batch_input offsets, which our [batch, sequence] graphs do not take; without it requests batch together
    when their padded lengths agree."""
    for tensor in cfg.input:
        tensor.allow_ragged_batch = False
    for key in [k for k in cfg.parameters if k.startswith(EMBEDDED_ORT_PARAMETERS)]:
        del cfg.parameters[key]


def f32_on_onnxruntime(cfg: mc.ModelConfig) -> bool:
    """An openvino config that must compute in f32 (no HINT_BF16) moves to native ONNX Runtime: the native openvino
    backend has no parameter that keeps OpenVINO from its bf16 default on BF16 CPUs (ParseParameterHelper knows
    only HINT_BF16=YES), while our embedded backend pins f32. True when it moved."""
    if cfg.backend != "openvino" or cfg.parameters.get("HINT_BF16", mc.ModelParameter()).string_value.upper() == "YES":
        return False
    serve_on("onnxruntime")(cfg)
    cfg.ClearField("default_model_filename")
    return True


def native_openvino(cfg: mc.ModelConfig) -> None:
    """Native openvino form: that backend compiles a batching model at exactly max_batch_size rows and pads only
    fixed shapes, so ragged, variable-length batches are served non-batching (one request per run, own shape)."""
    from tritonkit.repository.native_check import OPENVINO_PARAMETERS

    if cfg.max_batch_size > 0:  # the batch axis moves into dims, as an ensemble allows for a non-batching step
        for tensor in (*cfg.input, *cfg.output):
            tensor.dims.insert(0, -1)
            if tensor.HasField("reshape"):
                tensor.reshape.shape.insert(0, -1)
        cfg.max_batch_size = 0
        # The batcher keeps its queue policy and sends one request per execution (core: max(1, max_batch_size)).
        del cfg.dynamic_batching.preferred_batch_size[:]
        cfg.dynamic_batching.max_queue_delay_microseconds = 0
        if not cfg.dynamic_batching.ListFields():
            cfg.ClearField("dynamic_batching")
    for tensor in cfg.input:
        tensor.allow_ragged_batch = False
    for key in [k for k in cfg.parameters if k not in OPENVINO_PARAMETERS]:  # ours (packed, padding) mean nothing
        del cfg.parameters[key]
    cfg.default_model_filename = cfg.default_model_filename or "model.onnx"  # its default is model.xml
    # Each of our instances compiles its own model with these settings; the native instances share one compiled
    # model, so its streams (ours default to 1) and threads are the totals over the instances.
    counts = [g.count for g in cfg.instance_group]
    if counts and all(counts):
        per_instance = {"NUM_STREAMS": "1"} | {k: cfg.parameters[k].string_value for k in
                                               ("NUM_STREAMS", "INFERENCE_NUM_THREADS") if k in cfg.parameters}
        for key, value in per_instance.items():
            if value.isdigit() and int(value) > 0:  # AUTO, NUMA and 0 (all cores) are already totals
                cfg.parameters[key].string_value = str(int(value) * sum(counts))


def native_form(cfg: mc.ModelConfig) -> None:
    """A config of our embedded backends in the form the NGC server's native backends take."""
    from tritonkit.repository import native_check

    if f32_on_onnxruntime(cfg) or native_check.is_onnxruntime(cfg):
        native_onnxruntime(cfg)
    elif native_check.is_openvino(cfg):
        native_openvino(cfg)


def ngc_view(dest: Path = NGC_REPOSITORY, source: Path = paths.MODEL_REPOSITORY, gpu: bool = True,
             target=None, only: Iterable[str] | None = None, kinds: list | None = None) -> Path:
    """What the NGC container loads, generated from the embedded repository: files copied (a bind mount cannot
    follow symlinks out of it), ONNX Runtime and OpenVINO configs and their profiles in the native backends'
    forms, TensorRT models only in the GPU view and only when their plans were built by the target server's
    TensorRT. `only`: these models (ensembles with their steps, as given), not the whole repository. The view
    carries the replica record of `kinds`' models (default: every spec), which the container's supervisor applies
    for its node's CPU class (tritonkit.repository.replica)."""
    from tritonkit import release
    from tritonkit.repository import native_check, replica

    dest, source = Path(dest), Path(source)
    if dest.exists():
        if not (dest / _GENERATED).exists():
            raise FileExistsError(f"{dest} exists and was not generated here; not overwriting it")
        shutil.rmtree(dest)
    view = native_check.VIEWS["ngc-gpu" if gpu else "ngc-cpu"]
    models = native_check.loaded_models(source, view)
    if only is not None:
        models = {n: c for n, c in models.items() if n in set(only)}
    dest.mkdir(parents=True)
    (dest / _GENERATED).write_text("python -m tritonkit.repository.variants ngc\n")
    for name, cfg in sorted(models.items()):
        src_dir = source / name
        if native_check.is_tensorrt(cfg):
            target = target or release.target_server()  # only plans need the target's TensorRT
            for plan, meta in native_check.plan_metadata(src_dir, cfg).items():
                release.check_plan_metadata(meta, target, f"{name}/{plan}")
        shutil.copytree(src_dir, dest / name, ignore=shutil.ignore_patterns(".*", "__pycache__", "config.pbtxt",
                                                                              "configs", *EMBEDDED_ORT_FILES))
        config_files = [src_dir / "config.pbtxt", *sorted((src_dir / "configs").glob("*.pbtxt"))]
        for path in config_files:
            edited = parse_config(path.read_text(), name)
            edited.name = edited.name or name
            native_form(edited)
            check_config(edited)
            out = dest / name / path.relative_to(src_dir)
            out.parent.mkdir(parents=True, exist_ok=True)
            rel = path.relative_to(source.parent) if source.parent in path.parents else path
            out.write_text(f"# Generated by `python -m tritonkit.repository.variants ngc` from {rel.as_posix()} for "
                           f"the NGC tritonserver ({view.name} view); do not edit.\n" + to_pbtxt(edited))
    if kinds is None:
        from tritonkit import kinds as registry

        kinds = [registry.get(n) for n in registry.names()]
    record = replica.record(kinds, source, native=native_form)
    # Only what the view holds; a choice whose files it lacks fails the replica's start (replica.view), loudly.
    record["models"] = {m: e for m, e in record["models"].items() if (dest / m).is_dir()}
    replica.write_record(dest, record)
    return dest


def main(argv: list[str] | None = None) -> int:
    import argparse

    from tritonkit.repository import native_check

    parser = argparse.ArgumentParser(description="generated repository variants")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("overload", help=f"write <model>/configs/{OVERLOAD_PROFILE}.pbtxt (the default command)")
    ngc = sub.add_parser("ngc", help="write the NGC container's view of model_repository/")
    ngc.add_argument("--cpu", action="store_true", help=f"CPU-only view (no TensorRT) at {NGC_CPU_REPOSITORY.name}/")
    ngc.add_argument("--dest", type=Path)
    args = parser.parse_args(argv)
    if args.command == "ngc":
        dest = args.dest or (NGC_CPU_REPOSITORY if args.cpu else NGC_REPOSITORY)
        ngc_view(dest, gpu=not args.cpu)
        print(f"wrote {dest.relative_to(paths.ROOT) if paths.ROOT in dest.resolve().parents else dest}")
        return native_check.main([str(dest), "--view", "ngc-cpu" if args.cpu else "ngc-gpu", "--skip-unbuilt"])
    for path, text in overload_profile().items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(paths.ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
