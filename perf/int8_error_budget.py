"""Where a model's INT8 error comes from: weights alone vs the full Q/DQ graph, on the validation split.

Weight-only rows round the FP32 model's Conv/Gemm/MatMul weights through symmetric per-channel int8 (as the
quantizer does) and run the result in float, so activations are exact. If weights alone already miss a gate, no
activation knob (calibration method, placement, keeping a few nodes float) can meet it.

    python perf/int8_error_budget.py image_classification
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def _weight_only(fp32: Path, which, out: Path, bits: int = 8) -> Path:
    import onnx
    from onnx import helper, numpy_helper

    from tritonkit.int8.tensors import fake_quant_weight

    model = onnx.load(str(fp32))
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm", "MatMul") or len(node.input) < 2 or node.input[1] not in inits:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if not which(node, attrs):
            continue
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float64)
        # The quantizer's per-channel axis: output channels (Conv, Gemm with transB) or the last axis (MatMul).
        axis_last = node.op_type == "MatMul" or (node.op_type == "Gemm" and not attrs.get("transB", 0))
        wq = fake_quant_weight(w.T, True, bits).T if axis_last else fake_quant_weight(w, True, bits)
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(wq.astype(np.float32), node.input[1]))
    onnx.save(model, str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    from tritonkit import envinfo, kinds
    from tritonkit.int8.search import Recipe, Search
    from tritonkit.int8.transforms import correct_biases

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--out", type=Path, help="JSON file for the rows (default: build/reports/<model>_int8_"
                                                  "error_budget.json)")
    args = parser.parse_args(argv)
    spec = kinds.get(args.model)
    from tritonkit.build import build_fp32

    fp32, _ = build_fp32(spec, progress=False)
    search = Search(spec, fp32, ["uint8"], check_speed=False, progress=False, log=lambda *_: None)
    val = search.val
    rows = []
    workdir = tempfile.TemporaryDirectory(prefix="tritonkit-budget-")
    tmp = Path(workdir.name)

    def depthwise(node, attrs):
        return node.op_type == "Conv" and attrs.get("group", 1) > 1

    def row(name, model):
        t0 = time.perf_counter()
        metrics = val.metrics(model)
        rows.append({"variant": name, **{k: round(float(v), 4) for k, v in metrics.items()},
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{name:<48} " + " ".join(f"{t.metric}={metrics[t.metric]:.4f}" for t in spec.TARGETS), flush=True)

    row("FP32 (self-check)", fp32)
    row("weights int8, every weighted op", _weight_only(fp32, lambda n, a: True, tmp / "w_all.onnx"))
    # The precision floor: the same rounding with more bits, to show how far from the gates int8 weights start.
    for bits in (10, 12):
        row(f"weights int{bits} (not servable), every weighted op",
            _weight_only(fp32, lambda n, a: True, tmp / f"w_{bits}.onnx", bits))
    from tritonkit.int8.rounding import round_weights
    from tritonkit.int8.transforms import preprocess

    # GPTQ rounding (the search's weight_rounding="gptq") on the graph the quantizer sees (BatchNorm folded).
    rounded = round_weights(preprocess(fp32, tmp / "pre.onnx"), tmp / "w_gptq.onnx", set(spec.WEIGHT_OPS),
                            spec.calibration_batches)
    row("weights int8, GPTQ rounding, every weighted op", rounded.path)
    if "Conv" in spec.WEIGHT_OPS:
        row("weights int8, depthwise convs only", _weight_only(fp32, depthwise, tmp / "w_dw.onnx"))
        row("weights int8, all but depthwise convs",
            _weight_only(fp32, lambda n, a: not depthwise(n, a), tmp / "w_rest.onnx"))
        # The same bias correction the search offers, so this row isolates what rounding leaves after it.
        corrected = correct_biases(fp32, tmp / "corrected.onnx", {"Conv"}, spec.calibration_batches,
                                   per_channel=True)
        row("weights int8 + bias correction", _weight_only(corrected, lambda n, a: True, tmp / "w_bc.onnx"))
    for form, placement in (("uint8", "all"), ("int8", "inputs")):
        base = Recipe(form=form, placement=placement)
        row(f"full Q/DQ {base.describe()}", search.build(base))
        if "Conv" in spec.WEIGHT_OPS:
            for r in (replace(base, bias_correction=True), replace(base, weight_rounding="gptq")):
                row(f"full Q/DQ {r.describe()}", search.build(r))
    workdir.cleanup()
    out = args.out or Path("build/reports") / f"{spec.NAME}_int8_error_budget.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": spec.NAME, "split": "validation", "created": time.strftime("%Y-%m-%d"),
                               "machine": platform.machine(), "env": envinfo.fingerprint(),
                               "gates": {t.metric: t.value for t in spec.TARGETS}, "rows": rows}, indent=2) + "\n")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
