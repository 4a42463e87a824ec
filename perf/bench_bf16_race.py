"""A committed served INT8 recipe against the FP32 file on OpenVINO bf16, the competitor the served speed gate
races on a CPU with native bf16 (tritonkit.int8.speed.fp32_competitor).

    python perf/bench_bf16_race.py MODEL [--rev REV]

Builds the served INT8 graph of MODEL's recipe for this CPU class as committed at git revision REV (default HEAD),
from its committed quantization parameters (calibrating only where they do not apply), and times it on the variant
REV's models/<name>.runtime.json serves the INT8 name on, against the FP32 file on ONNX Runtime and on OpenVINO
bf16: tritonkit.int8.speed.speedup (interleaved pairs, medians, 95 % intervals, the served batch sizes and
threads), as the speed gate does. Needs `make build MODEL=...` first (the FP32 file). Prints a table and writes
build/reports/bf16_race_<model>.json with the CPU's INT8 flags and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

from tritonkit import envinfo, kinds, paths
from tritonkit.int8.speed import BF16_COMPETITOR, speedup
from tritonkit.perf import revision
from tritonkit.serving.runtimes import DEFAULT


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rev", default="HEAD", help="the git revision whose committed recipe is raced")
    args = parser.parse_args()
    if not envinfo.has_bf16():
        print("this CPU has no native bf16: the FP32 file cannot run on OpenVINO bf16 here; nothing to race")
        return 0
    kind = kinds.get(args.model)
    fp32 = paths.model_file(kind.FP32_MODEL)
    with tempfile.TemporaryDirectory(prefix="tritonkit-bf16-race-") as tmp:
        int8 = Path(tmp) / "int8.onnx"
        try:
            r, int8_variant = revision.served_int8(kind, args.rev, int8)
        except revision.RevisionError as e:
            print(e, file=sys.stderr)
            return 2
        rows = {fp32_variant: speedup(kind, fp32, int8, kind.SPEED_BATCHES, variants=(fp32_variant, int8_variant))
                for fp32_variant in (DEFAULT, BF16_COMPETITOR)}
    out = {"model": kind.NAME, "rev": args.rev, "recipe": r.describe(), "int8_variant": int8_variant,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
           "cpu": envinfo.cpu_model(), "cpu_int8_features": envinfo.cpu_flags(), "against": rows}
    print(f"{kind.NAME} served recipe at {args.rev} ({r.describe()}), INT8 on {int8_variant}; {out['date']}, "
          f"{out['cpu']} ({', '.join(out['cpu_int8_features'])})")
    print("| FP32 on | " + " | ".join(f"batch {b}: INT8 / FP32 (95 % interval)" for b in kind.SPEED_BATCHES) + " |")
    for variant, s in rows.items():
        cells = [f"{s[f'speedup_batch{b}']:.2f}x ({s[f'speedup_lo_batch{b}']:.2f}-{s[f'speedup_hi_batch{b}']:.2f})"
                 for b in kind.SPEED_BATCHES]
        print(f"| {variant} | " + " | ".join(cells) + " |")
    report = paths.REPORTS / f"bf16_race_{kind.NAME}.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(out, indent=2) + "\n")
    print(f"-> {paths.rel(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
