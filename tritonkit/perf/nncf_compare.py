"""NNCF head to head with our INT8 search: same splits, same floor-judged gates, same time budget, same speed measure.

    python -m tritonkit.perf.nncf_compare text_embedding image_classification [--budget-minutes 15]

Candidates for each built model's served (CPU) form, each timed from the FP32 file to a finished INT8 model:
- ours: the committed served recipe (models/<name>.int8.json) replayed, its search time as the recipe records it;
- nncf-onnx: `nncf.quantize` on the ONNX ModelProto (Q/DQ, runs on onnxruntime and OpenVINO);
- nncf-onnx-ac: `nncf.quantize_with_accuracy_control` on the ModelProto: its validation_fn scores the kind's first
  gate metric against FP32 on the validation split, max_drop = 1 - that gate's bound judged against the bf16 floor;
- nncf-openvino, nncf-openvino-ac: the same two on the OpenVINO model read from our .onnx (OpenVINO only).
Calibration is the spec's calibration split for all; transformer specs use NNCF's transformer model type.
Each candidate's gate metrics are measured on validation and test against the FP32 graph under onnxruntime (an
OpenVINO-only model on OpenVINO f32), judged as the build judges (tritonkit.int8.gates.targets); its items/s at the
served batch sizes on every runtime that can run it, interleaved with the FP32 file
(tritonkit.repository.runtime_choice.time_variants, geometric mean over batch sizes). Prints a markdown table
(docs/int8-search.md, "NNCF head to head").
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tritonkit import envinfo, paths
from tritonkit.int8 import floor, gates
from tritonkit.int8.evaluate import run_batches, session
from tritonkit.kinds.base import TransformerKind
from tritonkit.kinds.gates import missed

VARIANTS_ONNX = ("onnxruntime", "openvino", "openvino-bf16")
VARIANTS_IR = ("openvino", "openvino-bf16")
CANDIDATES = ("nncf-onnx", "nncf-onnx-ac", "nncf-openvino", "nncf-openvino-ac")


def _first(kind) -> str:
    return kind.TARGETS[0].metric


class _Ov:
    """An onnxruntime-like `run` over an OpenVINO model compiled in f32 (the precision its gates are judged in)."""

    def __init__(self, model):
        import openvino as ov

        # NNCF's accuracy control hands validation_fn a model it compiled itself (OpenVINO's default precision).
        self.compiled = model if isinstance(model, ov.CompiledModel) else \
            ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        self.names = {p.get_any_name() for p in self.compiled.inputs}

    def outputs(self, batches) -> np.ndarray:
        out = self.compiled.outputs[0]
        return np.concatenate([self.compiled({k: v for k, v in b.items() if k in self.names})[out] for b in batches])


def _onnx_outputs(model, batches) -> np.ndarray:
    return run_batches(session(model), batches)


def _key(batch) -> str:
    """A validation item by content: NNCF hands validation_fn copies of the dataset's items."""
    import hashlib

    return hashlib.sha1(b"".join(np.ascontiguousarray(batch[k]).tobytes() for k in sorted(batch))).hexdigest()


def _validation_fn(kind, ref: dict[str, np.ndarray], run: Callable) -> Callable:
    """NNCF's validation_fn: (model, items) -> (metric over the items, per-item values), the kind's first gate
    metric against FP32's outputs of the same items."""
    metric = _first(kind)

    def validate(model, items) -> tuple[float, list[float]]:
        items = list(items)
        got = [run(model, [b]) for b in items]
        refs = [ref[_key(b)] for b in items]
        per_item = [kind.gate_metrics(r, g)[metric] for r, g in zip(refs, got, strict=True)]
        return kind.gate_metrics(np.concatenate(refs), np.concatenate(got))[metric], per_item
    return validate


def candidates(kind, fp32: Path, budget_s: float, log=print, only: Sequence[str] | None = None) -> dict[str, dict]:
    """{name: {"seconds", "path" (or "error")}}: each NNCF candidate made from `fp32` (written under a temp dir the
    caller keeps)."""
    import nncf
    import onnx
    import openvino as ov

    work = Path(tempfile.mkdtemp(prefix="tritonkit-nncf-"))
    calib = nncf.Dataset(list(kind.calibration_batches()))
    size = kind.calibration_batch_count()
    val = kind.eval_batches("validation")
    ref = {_key(b): run_batches(session(fp32), [b]) for b in val}
    val_set = nncf.Dataset(val)
    half = floor.split_floor(floor.measure(kind, fp32, floor.PRECISION["served"]), "validation")
    bound = next(t.value for t in gates.targets(kind, half) if t.metric == _first(kind))
    common = {"subset_size": size * 1000}  # every calibration batch (subset_size counts samples, not batches)
    if isinstance(kind, TransformerKind):  # every text kind, not only the embedding one that has DIM
        common["model_type"] = nncf.ModelType.TRANSFORMER
    onnx_run = lambda model, batches: _onnx_outputs(model, batches)  # noqa: E731
    ov_run = lambda model, batches: _Ov(model).outputs(batches)  # noqa: E731
    makers = {
        "nncf-onnx": lambda: nncf.quantize(onnx.load(str(fp32)), calib, **common),
        "nncf-onnx-ac": lambda: nncf.quantize_with_accuracy_control(
            onnx.load(str(fp32)), calib, val_set, _validation_fn(kind, ref, onnx_run), max_drop=1.0 - bound,
            **common),
        "nncf-openvino": lambda: nncf.quantize(ov.Core().read_model(str(fp32)), calib, **common),
        "nncf-openvino-ac": lambda: nncf.quantize_with_accuracy_control(
            ov.Core().read_model(str(fp32)), calib, val_set, _validation_fn(kind, ref, ov_run), max_drop=1.0 - bound,
            **common),
    }
    out: dict[str, dict] = {}
    for name, make in makers.items():
        if only and name not in only:
            continue
        log(f"[nncf] {kind.NAME}: {name} ...")
        t0 = time.perf_counter()
        try:
            model = make()
        except Exception as err:  # a library failure is a result of the comparison, not a crash of it
            out[name] = {"error": f"{type(err).__name__}: {str(err)[:200]}", "seconds": time.perf_counter() - t0}
            log(f"[nncf] {kind.NAME}: {name} failed: {out[name]['error']}")
            continue
        seconds = time.perf_counter() - t0
        if isinstance(model, onnx.ModelProto):
            path = work / f"{name}.onnx"
            onnx.save(model, str(path))
        else:
            path = work / f"{name}.xml"
            ov.save_model(model, str(path), compress_to_fp16=False)
        out[name] = {"seconds": round(seconds, 1), "path": str(path),
                     "over_budget": seconds > budget_s}
        log(f"[nncf] {kind.NAME}: {name} in {seconds:.0f} s")
    return out


def evaluate(kind, refs: dict[str, tuple[list, np.ndarray]], path: Path) -> dict[str, dict[str, float]]:
    """Gate metrics per split against FP32 under onnxruntime (`refs`: split -> (batches, FP32 outputs)); an IR on
    OpenVINO f32."""
    out = {}
    for split, (batches, ref) in refs.items():
        if path.suffix == ".xml":
            import openvino as ov

            got = _Ov(ov.Core().read_model(str(path))).outputs(batches)
        else:
            got = run_batches(session(path), batches)
        out[split] = {k: round(float(v), 6) for k, v in kind.gate_metrics(ref, got).items()}
    return out


def speeds(kind, files: dict[str, Path], threads: int) -> dict[str, dict[str, float]]:
    """{candidate: {variant: items/s, geometric mean over the served batch sizes}} on every runtime it runs on."""
    from tritonkit.repository import runtime_choice

    out = {}
    for name, path in files.items():
        variants = VARIANTS_IR if path.suffix == ".xml" else VARIANTS_ONNX
        variants = [v for v in variants if v != "openvino-bf16" or envinfo.has_bf16()]
        timed = runtime_choice.time_variants(kind, path, variants, kind.SPEED_BATCHES, threads, repeats=5)
        out[name] = {v: round(float(np.exp(np.mean(np.log(list(b.values()))))), 1) for v, b in timed.items()}
    return out


def compare(name: str, budget_s: float, log=print, only: Sequence[str] | None = None) -> dict:
    from tritonkit import kinds
    from tritonkit.int8 import recipe
    from tritonkit.int8.report import report_path

    kind = kinds.get(name)
    fp32 = paths.model_file(kind.FP32_MODEL)
    ours = paths.model_file(kind.INT8_MODEL)
    report = json.loads(report_path(kind).read_text()) if report_path(kind).exists() else {}
    committed = (recipe.load_recipes(kind) or {}).get("served")
    made = candidates(kind, fp32, budget_s, log, only)
    rows: dict[str, dict] = {"fp32": {"path": str(fp32)}}
    if report.get("status") == "passed":
        rows["ours"] = {"path": str(ours), "seconds": committed.search_seconds if committed else None,
                        "recipe": report.get("recipe_summary")}
    rows.update(made)
    refs = {split: (b, run_batches(session(fp32), b)) for split in ("validation", "test")
            for b in [kind.eval_batches(split)]}
    half = floor.measure(kind, fp32, floor.PRECISION["served"])
    judged = {split: gates.targets(kind, floor.split_floor(half, split)) for split in ("validation", "test")}
    for row in rows.values():
        if "path" in row and row is not rows["fp32"]:
            row["metrics"] = evaluate(kind, refs, Path(row["path"]))
            row["missed"] = [f"{s}: {m}" for s in judged for m in missed(judged[s], row["metrics"][s])]
    threads = kind.spec.serving.model_threads
    timed = speeds(kind, {k: Path(r["path"]) for k, r in rows.items() if "path" in r}, threads)
    for k, v in timed.items():
        rows[k]["items_per_s"] = v
    return {"model": name, "rows": rows, "threads": threads, "floor": half,
            "fallback": report.get("status") == recipe.FALLBACK, "reason": report.get("reason")}


def markdown(result: dict, kind) -> list[str]:
    rows, base = result["rows"], result["rows"]["fp32"].get("items_per_s", {})
    metrics = [t.metric for t in kind.TARGETS]
    lines = [f"#### {result['model']} ({result['threads']} thread(s) per instance, as served)", "",
             "| candidate | made in s | " + " | ".join(f"{m} test" for m in metrics)
             + " | gates (bf16-floor judged) | items/s ORT / OV f32 / OV bf16 | best ÷ FP32 on ORT |",
             "|---|---:|" + "---:|" * len(metrics) + "---|---|---:|"]
    for name, row in rows.items():
        if "error" in row:
            error = row["error"].replace("|", "\\|")
            lines.append(f"| {name} | {row['seconds']:.0f} | " + " | ".join("" for _ in metrics)
                         + f" | failed: {error} | | |")
            continue
        test = row.get("metrics", {}).get("test", {})
        speed = row.get("items_per_s", {})
        cells = " / ".join(f"{speed[v]:.0f}" if v in speed else "–" for v in VARIANTS_ONNX)
        best = max(speed.values()) / base["onnxruntime"] if speed and base.get("onnxruntime") else None
        verdict = "reference" if name == "fp32" else ("pass" if not row.get("missed") else
                                                      "miss: " + "; ".join(row["missed"][:2]))
        made = "" if row.get("seconds") is None else f"{row['seconds']:.0f}"
        lines.append(f"| {name}{' (' + row['recipe'] + ')' if row.get('recipe') else ''} | {made} | "
                     + " | ".join(f"{test[m]:.4f}" if m in test else "" for m in metrics)
                     + f" | {verdict} | {cells} | {f'{best:.2f}x' if best else ''} |")
    if result.get("fallback"):
        lines += ["", f"Our search found no passing INT8 for this model ({result.get('reason')}); our row is absent."]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    from tritonkit import kinds

    parser = argparse.ArgumentParser(prog="python -m tritonkit.perf.nncf_compare", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+")
    parser.add_argument("--budget-minutes", type=float, default=15.0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--only", nargs="+", choices=CANDIDATES, help="only these NNCF candidates")
    args = parser.parse_args(argv)
    import nncf

    results = []
    for name in args.names:
        results.append(compare(name, args.budget_minutes * 60, only=args.only))
    print(f"\n`python -m tritonkit.perf.nncf_compare {' '.join(args.names)}`, {datetime.date.today()}, "
          f"{envinfo.cpu_model()}, CPU INT8 class {envinfo.int8_class()}, NNCF {nncf.__version__}, "
          f"versions {json.dumps(envinfo.versions())}\n")
    for result in results:
        print("\n".join(markdown(result, kinds.get(result["model"]))) + "\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {paths.rel(args.json)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
