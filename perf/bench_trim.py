"""The search's trim (tritonkit.int8.fallback.trim) on a model's committed served candidate: which of its
float nodes go back in INT8 with every gate still holding (exact judgement, as the search judges), and the trimmed
file raced against its parent and FP32 (tritonkit.int8.speed.race) on the runtime variants that serve them here,
both then scored on all validation as the INT8 variant runs them (OpenVINO bf16 can miss what exact int32 held).

    python perf/bench_trim.py efficientnet_lite1 [--cpu-class vnni] [--margin 0.1] [--variants openvino-bf16 ...]

The candidate is this CPU class's served recipe, or its accurate candidate where the speed gate kept FP32 (another
class's where this one has none), built from its committed quantization parameters (no calibration). `--margin`:
the search's margin on each gate (0 judges at the gates themselves, where this machine's FP32 file leaves the
candidate too little room). Writes nothing into the repository.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tritonkit import envinfo, kinds, paths
from tritonkit.int8 import fallback, gates, judge
from tritonkit.int8.context import MARGIN, SearchContext
from tritonkit.int8.params import file_digest
from tritonkit.int8.recipe import committed_candidate, load_recipes
from tritonkit.int8.speed import race

SHOWN = ("top1_agreement", "top5_agreement", "top1_agreement_margin0.05", "cosine_min", "cosine_mean",
         "top10_overlap")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--cpu-class", default=None, help="whose committed entry (default: this CPU's, or its donor's)")
    ap.add_argument("--margin", type=float, default=MARGIN,
                    help="the margin on each gate a trim judges by (default: the search's)")
    ap.add_argument("--variants", nargs=2, default=None, metavar=("FP32", "INT8"),
                    help="runtime variants to race on (default: those serving the FP32 and INT8 models here)")
    args = ap.parse_args()

    from tritonkit.repository.runtime_choice import served_variants

    kind = kinds.get(args.model)
    fp32 = paths.model_file(kind.FP32_MODEL)
    entry = (load_recipes(kind, args.cpu_class) or {}).get("served")
    candidate = committed_candidate(kind, "served", entry, fp32, file_digest(fp32))  # the donor's parameters too
    if candidate is None:
        raise SystemExit(f"{kind.NAME}: no committed served candidate with parameters for this FP32 file")
    recipe, params = candidate
    print(f"{kind.NAME}: {recipe.describe()} ({entry.status}, class {entry.borrowed_from or 'own'}), "
          f"this CPU {envinfo.int8_class()}, margin {args.margin}")
    search = SearchContext(kind, fp32, [recipe.form], check_speed=False, progress=False, log=print,
                           margin=args.margin, exact=judge.exact_judgement(),
                           gates=gates.for_entry(kind, fp32, "served", entry), committed=(recipe, params),
                           min_int8_share=0.0)
    held = search.measure("confirm", "the committed candidate on all validation", recipe)
    if not held.passed:
        raise SystemExit("the committed candidate misses a gate here at this margin: nothing to trim from "
                         "(try --margin 0)")
    trimmed = fallback.trim(search, recipe)
    rows = [st for st in search.steps if st.stage in ("trim", "confirm")]
    print("\n| step | held | " + " | ".join(k for k in SHOWN if k in held.metrics) + " |")
    print("|---|---|" + "---|" * sum(k in held.metrics for k in SHOWN))
    for st in rows:
        print(f"| {st.change} | {'yes' if st.passed else 'no'} | "
              + " | ".join(f"{st.metrics[k]:.4f}" for k in SHOWN if k in held.metrics) + " |")
    if trimmed is None:
        print("\nnothing came back to INT8")
        return
    back = [n for n in recipe.float_nodes if n not in trimmed.float_nodes]
    confirmed = next(st for st in reversed(rows) if st.recipe == trimmed.describe())
    print(f"\ntrimmed: {trimmed.describe()} ({len(back)} of {len(recipe.float_nodes)} back in INT8); on all "
          f"validation it holds the gates with the search's {MARGIN} margin: "
          + ("yes" if search.gates.holds("validation", confirmed.metrics, MARGIN) else "no"))
    print(json.dumps({"float_nodes": trimmed.float_nodes}))
    fp32_variant, int8_variant = args.variants or served_variants(kind)
    with tempfile.TemporaryDirectory(prefix="bench-trim-") as tmp:
        files = {}
        for name, r in (("parent", recipe), ("trimmed", trimmed)):
            files[name] = Path(tmp) / f"{name}.onnx"
            onnx.save(search.build(r), str(files[name]))
        raced = race(kind, (fp32_variant, fp32), (int8_variant, files["parent"]),
                     {"trimmed": (int8_variant, files["trimmed"])}, kind.SPEED_BATCHES)
        # What the trim judged in exact int32 arithmetic, run as the INT8 variant serves it (bf16 moves top-1).
        served = {name: search.val.served_problems(path, int8_variant,
                                                   lambda m: search.gates.missed("validation", m, MARGIN),
                                                   kind.SERVE_THREADS)
                  for name, path in files.items()}
    print(f"\nINT8 on {int8_variant}, FP32 on {fp32_variant}, interleaved in one run (median, 95 % interval):")
    print("| batch | parent ÷ FP32 | trimmed ÷ FP32 | trimmed over parent |")
    print("|---|---|---|---|")
    def ratio(speed: dict, key: str, b: int) -> str:
        return f"{speed[f'{key}_batch{b}']:.2f}× [{speed[f'{key}_lo_batch{b}']:.2f}, {speed[f'{key}_hi_batch{b}']:.2f}]"

    for b in kind.SPEED_BATCHES:
        p, t = raced["parent"], raced["trimmed"]
        print(f"| {b} | {ratio(p, 'speedup', b)} | {ratio(t, 'speedup', b)} | {ratio(t, 'over_parent', b)} |")
    print(f"\nOn all validation run as {int8_variant} (gates with the search's {MARGIN} margin):")
    print("| file | " + " | ".join(k for k in SHOWN if k in held.metrics) + " | holds |")
    print("|---|" + "---|" * (sum(k in held.metrics for k in SHOWN) + 1))
    for name, (metrics, missed) in served.items():
        print(f"| {name} | " + " | ".join(f"{metrics[k]:.4f}" for k in SHOWN if k in held.metrics)
              + f" | {'yes' if not missed else 'no'} |")


if __name__ == "__main__":
    main()
