"""Build model artefacts: export + validate (FP32 ONNX) → calibrated INT8 Q/DQ → accuracy report.

    python -m tritonkit.build {text,image,all} [--force] [--skip-int8] [--sweep]

Artefacts go to model_repository/<model>/1/model.onnx (gitignored); reports to build/reports/<name>_*.json.
A spec with a SERVE_RECIPE serves that INT8 form (e.g. onnxruntime's uint8-activation CPU form) and keeps its
RECIPE, the TensorRT-form Q/DQ, at build/artifacts/<INT8_MODEL>.trt_qdq.onnx (report <name>_int8_trt.json),
which tritonkit.engines compiles into TensorRT plans.
A step is skipped when its artefact exists and the fingerprint of everything it depends on (spec module,
export/quantize code, data, recipe) is unchanged; `--force` rebuilds. `--sweep` quantizes and evaluates every
candidate recipe of the spec and records the table that justifies the chosen recipe.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tritonkit import models, paths

REPORTS = paths.ROOT / "build" / "reports"


@dataclass
class BuildResult:
    name: str
    fp32: Path
    int8: Path | None
    built: list[str]
    int8_passed: bool | None = None
    # The TensorRT-form Q/DQ when the served INT8 is another form (spec.SERVE_RECIPE), else None.
    trt_int8: Path | None = None


def artefact(model: str, version: int = 1) -> Path:
    return paths.MODEL_REPOSITORY / model / str(version) / "model.onnx"


def trt_qdq_path(spec: ModuleType) -> Path:
    """The TensorRT-form Q/DQ kept beside a served INT8 of another form (read by tritonkit.engines)."""
    return paths.ARTIFACTS / f"{spec.INT8_MODEL}.trt_qdq.onnx"


def _all_candidates(spec: ModuleType) -> list:
    return [*spec.CANDIDATES, *getattr(spec, "SERVE_CANDIDATES", [])]


def _fingerprint(spec: ModuleType, stage: str, extra: str = "") -> str:
    from tritonkit import data, export, quantize

    h = hashlib.sha256()
    sources = [spec, export] + ([quantize] if stage == "int8" else [])
    for module in sources:
        h.update(Path(inspect.getfile(module)).read_bytes())
    h.update(data.SENTENCES.read_bytes())
    h.update(extra.encode())
    return h.hexdigest()[:16]


def _stamp_path(name: str, stage: str) -> Path:
    return paths.ARTIFACTS / f"{name}.{stage}.fingerprint"


def up_to_date(path: Path, name: str, stage: str, fingerprint: str) -> bool:
    stamp = _stamp_path(name, stage)
    return path.exists() and stamp.exists() and stamp.read_text().strip() == fingerprint


def _stamp(name: str, stage: str, fingerprint: str) -> None:
    stamp = _stamp_path(name, stage)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(fingerprint + "\n")


def _log(msg: str) -> None:
    print(f"[build] {msg}", flush=True)


def build_fp32(spec: ModuleType, force: bool = False, progress: bool = True) -> tuple[Path, bool]:
    from tritonkit.export import export_onnx, validate_onnx, write_json

    path = artefact(spec.FP32_MODEL)
    fingerprint = _fingerprint(spec, "fp32")
    if not force and up_to_date(path, spec.NAME, "fp32", fingerprint):
        _log(f"{spec.NAME}: FP32 {path.relative_to(paths.ROOT)} up to date")
        return path, False
    _log(f"{spec.NAME}: exporting {spec.EXPORT.name} → {path.relative_to(paths.ROOT)}")
    t0 = time.perf_counter()
    module = spec.EXPORT.loader()
    tmp = path.with_name("model.export.onnx")
    export_onnx(spec.EXPORT, tmp, module=module)
    # Validate before installing it, so a failed export never replaces a good model.
    result = validate_onnx(spec.EXPORT, tmp, module=module, progress=progress)
    tmp.replace(path)
    write_json(REPORTS / f"{spec.NAME}_export.json", {**result.to_json(), "seconds": time.perf_counter() - t0})
    _log(
        f"{spec.NAME}: validated {result.samples} samples on {result.grid_points} shapes: "
        f"{result.metric} min {result.summary['min']:.6f} (tolerance {result.tolerance})"
    )
    _stamp(spec.NAME, "fp32", fingerprint)
    return path, True


def _quantize_and_evaluate(spec: ModuleType, recipe, fp32: Path, out: Path, progress: bool) -> dict:
    from tritonkit.quantize import quantize, quantized_ops

    t0 = time.perf_counter()
    quantize(fp32, out, recipe, spec.calibration_batches, total_batches=spec.calibration_batch_count(),
             progress=progress)
    seconds = time.perf_counter() - t0
    metrics = spec.evaluate(fp32, out)
    return {"metrics": metrics, "quantized_ops": quantized_ops(out), "calibration_s": round(seconds, 1)}


def sweep(spec: ModuleType, fp32: Path, progress: bool = True) -> list[dict]:
    """Quantize + evaluate every candidate recipe; the table goes into build/reports/<name>_int8_sweep.json."""
    from tritonkit.export import write_json

    rows = []
    for recipe in _all_candidates(spec):
        _log(f"{spec.NAME}: sweep candidate '{recipe.name}'")
        out = paths.ARTIFACTS / f"{spec.NAME}-{recipe.name}.onnx"
        result = _quantize_and_evaluate(spec, recipe, fp32, out, progress)
        n_ops = sum(result["quantized_ops"].values())
        rows.append({"recipe": recipe.name, "activation_type": recipe.activation_type, **result["metrics"],
                     "quantized_ops": n_ops})
        _log(f"  {json.dumps(rows[-1])}")
        out.unlink(missing_ok=True)
    write_json(REPORTS / f"{spec.NAME}_int8_sweep.json", {"candidates": rows, "recipes": [
        r.to_json() for r in _all_candidates(spec)]})
    return rows


def _build_quantized(spec: ModuleType, fp32: Path, recipe, path: Path, stage: str, report_path: Path,
                     targets: list, force: bool, progress: bool, details: dict) -> tuple[bool, bool]:
    """Quantize `fp32` with `recipe` into `path` and write its report unless up to date → (built, passed)."""
    from tritonkit.quantize import QuantReport

    fingerprint = _fingerprint(spec, "int8", json.dumps(recipe.to_json(), sort_keys=True) + fp32.name)
    if not force and up_to_date(path, spec.NAME, stage, fingerprint):
        passed = json.loads(report_path.read_text()).get("passed") if report_path.exists() else None
        _log(f"{spec.NAME}: INT8 {path.relative_to(paths.ROOT)} up to date")
        return False, bool(passed)
    _log(f"{spec.NAME}: quantizing with recipe '{recipe.name}' → {path.relative_to(paths.ROOT)}")
    tmp = path.with_name(f"{path.name.removesuffix('.onnx')}.quant.onnx")
    result = _quantize_and_evaluate(spec, recipe, fp32, tmp, progress)
    tmp.replace(path)
    sweep_file = REPORTS / f"{spec.NAME}_int8_sweep.json"
    candidates = json.loads(sweep_file.read_text())["candidates"] if sweep_file.exists() else []
    # Each report lists the candidates of its own form (rows from before the form existed are int8).
    candidates = [c for c in candidates if c.get("activation_type", "int8") == recipe.activation_type]
    report = QuantReport(
        model=spec.EXPORT.name,
        recipe=recipe,
        metrics=result["metrics"],
        targets=list(targets),
        candidates=candidates,
        details={"quantized_ops": result["quantized_ops"], "calibration_s": result["calibration_s"], **details},
    )
    report.write(report_path)
    report.print_table()
    _log(f"{spec.NAME}: report → {report_path.relative_to(paths.ROOT)}")
    _stamp(spec.NAME, stage, fingerprint)
    return True, report.passed


def build_int8(spec: ModuleType, fp32: Path, force: bool = False, progress: bool = True) -> tuple[Path, bool, bool]:
    """The served INT8 (spec.SERVE_RECIPE if the spec has one, else spec.RECIPE) → (path, built, passed); with a
    SERVE_RECIPE also the TensorRT-form spec.RECIPE at trt_qdq_path(spec)."""
    serve = getattr(spec, "SERVE_RECIPE", None)
    notes = getattr(spec, "REPORT_NOTES", {})
    path = artefact(spec.INT8_MODEL)
    trt_path = trt_qdq_path(spec)
    built, passed = _build_quantized(
        spec, fp32, serve or spec.RECIPE, path, "int8", REPORTS / f"{spec.NAME}_int8.json", spec.TARGETS, force,
        progress, {**notes, **({"tensorrt_form": str(trt_path.relative_to(paths.ROOT))} if serve else {})})
    if serve is None:
        # A spec that dropped its serve recipe: engines must not build from a stale TensorRT-form file.
        trt_path.unlink(missing_ok=True)
        _stamp_path(spec.NAME, "int8_trt").unlink(missing_ok=True)
        return path, built, passed
    built_trt, _ = _build_quantized(
        spec, fp32, spec.RECIPE, trt_path, "int8_trt", REPORTS / f"{spec.NAME}_int8_trt.json",
        getattr(spec, "TRT_TARGETS", spec.TARGETS), force, progress,
        {**getattr(spec, "TRT_REPORT_NOTES", notes), "served_form": str(path.relative_to(paths.ROOT))})
    return path, built or built_trt, passed


def build(name: str, force: bool = False, skip_int8: bool = False, run_sweep: bool = False,
          progress: bool = True) -> BuildResult:
    spec = models.get(name)
    fp32, built_fp32 = build_fp32(spec, force=force, progress=progress)
    built = ["fp32"] if built_fp32 else []
    # Small non-ONNX build outputs a spec may have (e.g. a classifier's labels file); cheap, always rewritten.
    for asset in getattr(spec, "write_assets", lambda _repo: [])(paths.MODEL_REPOSITORY):
        _log(f"{spec.NAME}: wrote {Path(asset).relative_to(paths.ROOT)}")
    if run_sweep:
        sweep(spec, fp32, progress=progress)
    if skip_int8:
        return BuildResult(name, fp32, None, built)
    int8, built_int8, passed = build_int8(spec, fp32, force=force or built_fp32 or run_sweep, progress=progress)
    if built_int8:
        built.append("int8")
    trt_int8 = trt_qdq_path(spec) if getattr(spec, "SERVE_RECIPE", None) is not None else None
    return BuildResult(name, fp32, int8, built, passed, trt_int8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonkit.build", description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=[*models.REGISTRY, "all"])
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--skip-int8", action="store_true", help="only export + validate FP32")
    parser.add_argument("--sweep", action="store_true", help="measure every candidate INT8 recipe first")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    targets = list(models.REGISTRY) if args.target == "all" else [args.target]
    status = 0
    for target in targets:
        result = build(target, force=args.force, skip_int8=args.skip_int8, run_sweep=args.sweep,
                       progress=not args.no_progress)
        if result.int8_passed is False:
            _log(f"{target}: INT8 accuracy targets NOT met (see build/reports/{target}_int8.json)")
        _log(f"{target}: done ({', '.join(result.built) or 'nothing to do'})")
    return status


if __name__ == "__main__":
    sys.exit(main())
