"""The half-precision floor of a model's INT8 gates, and the gates judged against it.

A gate that the FP32 graph run at half precision already fails measures the data (near-ties, narrow embedding cones),
not quantization. So every INT8 form is judged beside its floor: the FP32 graph at the reduced precision that form
competes with, on the same split, scored by the same metrics against FP32.
- served (CPU) form: bf16, the precision CPU runtimes offer (OpenVINO's INFERENCE_PRECISION_HINT on a CPU with
  native bf16; on a CPU without it no runtime computes bf16, so there is no floor and the absolute gates stand);
- tensorrt form: fp16, the plan INT8 competes with on a GPU. Without a GPU here it is the graph converted to float16
  (weights and every activation between ops rounded to fp16, keep_io_types) run by onnxruntime's CPU provider, which
  computes ops it has no fp16 kernel for in fp32 between casts, as TensorRT's fp16 tactics accumulate in fp32.

The rule (`targets`): a gate passes when INT8 is within the kind's FLOOR_SLACK of the floor or meets the absolute
bound, whichever is looser; never below the kind's CATASTROPHE bounds, which no floor loosens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from tritonkit import envinfo, paths
from tritonkit.int8.evaluate import reference

PRECISION = {"served": "bf16", "tensorrt": "fp16"}


def targets(kind, floor: Mapping[str, float] | None) -> list:
    """`kind.TARGETS` judged against `floor` (this split's half-precision metrics; None: absolute gates), plus the
    kind's catastrophe bounds on metrics the gates do not name."""
    slack: Mapping[str, float] = getattr(kind, "FLOOR_SLACK", {})
    bounds = {t.metric: t for t in getattr(kind, "CATASTROPHE", ())}
    out = []
    for t in kind.TARGETS:
        value = t.value
        if floor is not None and t.metric in floor and t.metric in slack:
            relative = floor[t.metric] - slack[t.metric] if t.op == ">=" else floor[t.metric] + slack[t.metric]
            value = min(value, relative) if t.op == ">=" else max(value, relative)
        if t.metric in bounds:
            value = max(value, bounds[t.metric].value) if t.op == ">=" else min(value, bounds[t.metric].value)
        out.append(dataclasses.replace(t, value=round(value, 6)))
    return out + [b for m, b in bounds.items() if m not in {t.metric for t in kind.TARGETS}]



class Unavailable(Exception):
    """This machine cannot compute the precision (the reason names what is missing)."""


def _bf16_run(fp32: Path):
    import openvino as ov

    if not envinfo.has_bf16():
        raise Unavailable("no native bf16 on this CPU (avx512_bf16 / amx_bf16): no runtime computes bf16 here")
    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(fp32)), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY"})
    if str(compiled.get_property("INFERENCE_PRECISION_HINT")).lower() not in ("bf16", "<type: 'bfloat16'>"):
        raise Unavailable(f"OpenVINO {ov.__version__} would not compute bf16 here")
    names = {p.get_any_name() for p in compiled.inputs}
    output = compiled.outputs[0]

    def run(batch: Mapping[str, np.ndarray]) -> np.ndarray:
        return compiled({k: v for k, v in batch.items() if k in names})[output]
    return run


def _fp16_run(fp32: Path):
    import onnx
    import onnxruntime as ort

    from tritonkit.export import float16

    model = float16(onnx.load(str(fp32)))
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as err:  # the converter's graph is not always loadable (e.g. a Cast it retyped); say so
        raise Unavailable(f"the float16 conversion of this graph does not load: {str(err)[:200]}") from None
    names, output = {i.name for i in sess.get_inputs()}, sess.get_outputs()[0].name

    def run(batch: Mapping[str, np.ndarray]) -> np.ndarray:
        return sess.run([output], {k: v for k, v in batch.items() if k in names})[0]
    return run


RUNNERS = {"bf16": _bf16_run, "fp16": _fp16_run}


def how(precision: str) -> str:
    import onnxruntime
    import openvino

    return {"bf16": f"FP32 graph on OpenVINO {openvino.__version__}, INFERENCE_PRECISION_HINT=bf16",
            "fp16": f"FP32 graph as TensorRT's FP16 build gets it (export.float16), "
                    f"onnxruntime {onnxruntime.__version__} CPU"
            }[precision]


def record_path(kind) -> Path | None:
    """models/<name>.floors.json beside the spec: floors measured by builds, committed so that a fresh clone on the
    same packages and CPU flags reuses them (None for a spec made in memory, e.g. by tests)."""
    file = getattr(getattr(kind, "spec", None), "file", None)
    return file.with_name(f"{kind.NAME}.floors.json") if file is not None else None


def measure(kind, fp32: Path, precision: str, splits: Sequence[str] = ("validation", "test")) -> dict:
    """{"precision", "how", split: metrics...} of the FP32 graph at `precision` against FP32 (onnxruntime), or
    {"precision", "unavailable": why}. Keyed by graph bytes, precision, splits, CPU flags and package versions:
    found in the spec's committed floors file, else measured and recorded there."""
    key = hashlib.sha256(Path(fp32).read_bytes() + json.dumps(
        [precision, list(splits), envinfo.fingerprint(), getattr(kind, "NAME", "")]).encode()).hexdigest()[:20]
    record = record_path(kind)
    recorded = json.loads(record.read_text()) if record is not None and record.exists() else {}
    if key in recorded:
        return recorded[key]["floor"]
    out: dict = {"precision": precision}
    try:
        run = RUNNERS[precision](Path(fp32))
    except Unavailable as err:
        out["unavailable"] = str(err)
        return out
    out["how"] = how(precision)
    for split in splits:
        batches = kind.eval_batches(split)
        got = np.concatenate([run(b) for b in batches]).astype(np.float32)
        ref = reference(kind, fp32, split, batches)  # shared with the search's and the replay's gate checks
        out[split] = {k: round(float(v), 6) for k, v in kind.gate_metrics(ref, got).items()}
    if record is not None:
        import datetime

        recorded[key] = {"floor": out, "graph": paths.rel(Path(fp32)), "cpu": envinfo.cpu_model(),
                         "cpu_int8_class": envinfo.int8_class(), "date": datetime.date.today().isoformat()}
        record.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    return out


def split_floor(floor: Mapping | None, split: str) -> Mapping[str, float] | None:
    """One split's metrics of a `measure` result (None where the floor is unavailable)."""
    return None if not floor or "unavailable" in floor else floor.get(split)


def main(argv: Sequence[str] | None = None) -> int:
    """Print each built model's floors and the gates they set, per form and split (markdown)."""
    import argparse
    import datetime

    from tritonkit import kinds

    parser = argparse.ArgumentParser(prog="python -m tritonkit.int8.floor", description=main.__doc__)
    parser.add_argument("names", nargs="*", help="model specs (default: every built one)")
    args = parser.parse_args(argv)
    names = args.names or [n for n in kinds.names() if paths.model_file(kinds.get(n).FP32_MODEL).exists()]
    print(f"`python -m tritonkit.int8.floor {' '.join(args.names)}`".replace(" `", "`") + f", {datetime.date.today()}, "
          f"{envinfo.cpu_model()}, CPU INT8 class {envinfo.int8_class()}\n")
    print("| model | form | floor | split | metric: absolute gate / floor / gate judged against it |")
    print("|---|---|---|---|---|")
    for name in names:
        kind = kinds.get(name)
        fp32 = paths.model_file(kind.FP32_MODEL)
        for form, precision in PRECISION.items():
            half = measure(kind, fp32, precision)
            for split in ("validation", "test"):
                got = split_floor(half, split)
                bounds = {t.metric: t.value for t in targets(kind, got)}
                cells = "; ".join(f"{t.metric} {t.value} / {got[t.metric]:.4f} / {bounds[t.metric]:.4f}" if got
                                  else f"{t.metric} {t.value}" for t in kind.TARGETS)
                print(f"| {name} | {form} | {half.get('unavailable') or precision} | {split} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
