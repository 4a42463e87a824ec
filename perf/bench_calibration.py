"""Calibration statistics once (tritonkit.int8.calibration.collect) against onnxruntime's calibrators and NNCF's
statistics collection, on a shipped model's prepared graph and its own calibration batches.

    python perf/bench_calibration.py [--model image_classification]
    python perf/bench_calibration.py --memory [--model text_embedding] [--batches 16]

- onnxruntime 1.23: one calibrator per method (minmax, percentile, entropy), one pass each, fed as `collect` feeds
  its histograms (chunks of HISTOGRAM_CHUNK batches). Their ranges must equal ours, or this exits 1;
- ours: one pass for the three methods (minmax only where the model's batches differ in shape);
- NNCF 3.4: `nncf.quantize` of the same ONNX graph over the same batches, min/max statistics (bias correction off):
  its statistics collection plus inserting its Q/DQ, so an upper bound on the collection alone.
Each runs once (minutes each on 2 cores); the graph is the served recipe's prepared graph, built from the committed
quantization parameters (no calibration).

--memory: three passes over the FP32 graph in one process, keeping each pass's statistics (as a search keeps them
per graph); the process's resident memory after each. A pass must not keep onnxruntime's arena alive.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from tritonkit import kinds, paths
from tritonkit.int8 import calibration, recipe
from tritonkit.int8.records import Recipe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: image_classification (text_embedding with --memory)")
    parser.add_argument("--memory", action="store_true", help="resident memory after repeated passes")
    parser.add_argument("--batches", type=int, default=16, help="with --memory: batches per pass")
    args = parser.parse_args()
    if args.memory:
        return memory(kinds.get(args.model or "text_embedding"), args.batches)
    args.model = args.model or "image_classification"

    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import create_calibrator

    from tritonkit.int8.transforms import prepare

    kind = kinds.get(args.model)
    fp32 = paths.model_file(kind.FP32_MODEL)
    entry = recipe.load_recipes(kind)["served"]
    r = Recipe.from_json(entry.recipe)
    given, _why, _path = recipe.quant_params(kind, "served", entry.recipe, entry.borrowed_from, fp32)
    total = kind.calibration_batch_count()
    batches = list(kind.calibration_batches())[:total]
    methods = ["minmax"] + (["percentile", "entropy"] if len({b[next(iter(b))].shape for b in batches}) == 1 else [])
    out: dict = {"model": kind.NAME, "batches": len(batches), "methods": methods}
    with tempfile.TemporaryDirectory(prefix="tritonkit-bench-calibration-") as tmp:
        work = Path(tmp)
        prepared = prepare(fp32, r.to_quant(kind.WEIGHT_OPS), kind.calibration_batches, work, total, given)
        graph = prepared.base or prepared.path

        t0 = time.perf_counter()
        stats = calibration.collect(graph, lambda: iter(batches), work, methods, progress=False)
        out["ours_s"] = round(time.perf_counter() - t0, 1)

        out["onnxruntime_s"], same = {}, True
        for method in methods:
            t0 = time.perf_counter()
            calibrator = create_calibrator(graph, calibration.all_op_types(), str(work / f"ort-{method}.onnx"),
                                           CalibrationMethod.MinMax if method == "minmax" else
                                           getattr(CalibrationMethod, method.capitalize()),
                                           providers=["CPUExecutionProvider"])
            step = len(batches) if method == "minmax" else calibration.HISTOGRAM_CHUNK
            for i in range(0, len(batches), step):
                calibrator.collect_data(_Reader(batches[i : i + step]))
            theirs = calibrator.compute_data()
            out["onnxruntime_s"][method] = round(time.perf_counter() - t0, 1)
            ours = stats.ranges(method)
            same &= set(ours) == set(theirs) and all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for k in theirs for a, b in zip(ours[k].range_value, theirs[k].range_value))
            del calibrator
        out["same_ranges"] = bool(same)
        try:
            out["nncf_minmax_s"] = _nncf(graph, batches)
        except TypeError as err:  # NNCF 3.4's ONNX backend does not import with this onnx/numpy (an annotation)
            out["nncf_minmax_s"] = f"unavailable: {err}"
    print(json.dumps(out, indent=2))
    return 0 if same else 1


def _rss_mb() -> int:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) // 1024


def memory(kind, batches: int) -> int:
    fp32 = paths.model_file(kind.FP32_MODEL)
    kept, rows = [], []
    for i in range(3):
        with tempfile.TemporaryDirectory(prefix="tritonkit-bench-calibration-") as tmp:
            t0 = time.perf_counter()
            kept.append(calibration.collect(fp32, kind.calibration_batches, Path(tmp), ("minmax",), batches,
                                            progress=False))
        rows.append({"pass": i + 1, "rss_mb": _rss_mb(), "seconds": round(time.perf_counter() - t0, 1)})
    print(json.dumps({"model": kind.NAME, "graph": paths.rel(fp32), "batches": batches, "passes": rows}, indent=2))
    return 0


class _Reader:
    def __init__(self, items):
        self.items = iter(items)

    def get_next(self):
        return next(self.items, None)


def _nncf(graph: Path, batches: list) -> float:
    import nncf
    import onnx

    model = onnx.load(str(graph))
    names = {i.name for i in model.graph.input}
    dataset = nncf.Dataset([{k: v for k, v in b.items() if k in names} for b in batches])
    t0 = time.perf_counter()
    nncf.quantize(model, dataset, subset_size=len(batches),
                  advanced_parameters=nncf.AdvancedQuantizationParameters(disable_bias_correction=True))
    return round(time.perf_counter() - t0, 1)


if __name__ == "__main__":
    raise SystemExit(main())
