"""`make build-engines`: TensorRT plans from the built ONNX artefacts, one build process per compute capability,
each plan validated and written with its metadata, then the Triton configs that serve them.

Everything except `plans.build_plan` and the TensorRT side of `validation.validate_plan` runs without TensorRT or
a GPU, so it is unit-tested on CPU machines; where either is missing, `make build-engines` prints what it skipped
and why.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tritonkit import paths
from tritonkit.errors import EngineError
from tritonkit.release import ServerTarget, check_builder, check_plan_metadata, target_server
from tritonkit.repository.config import load_config
from tritonkit.tensorrt.configs import trt_ensemble_config, trt_model_config, write_config
from tritonkit.tensorrt.environment import Environment, detect, device_env, plan_devices
from tritonkit.tensorrt.plans import (
    PRECISIONS,
    axis_limits,
    build_plan,
    fp16_cast,
    onnx_input_dims,
    plan_filename,
    profiles_for,
    recipe_for,
    trt_model_name,
)
from tritonkit.tensorrt.validation import derive_tolerances, extreme_feeds, validate_plan, validation_feeds


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    from tritonkit.int8.report import report_path

    report = report_path(kind, "tensorrt")
    if not report.exists():
        return None
    data = json.loads(report.read_text())
    if data.get("passed"):
        return None
    why = "; ".join(data.get("missed") or []) or data.get("reason") or data.get("status", "")
    return (f"no INT8 plan: the TensorRT-form INT8 graph did not pass ({why}; {paths.rel(report)}); the FP16 plan "
            f"serves. Re-search with `{recipe.search_command(kind)}`")


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
