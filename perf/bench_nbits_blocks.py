"""A committed served recipe's run-time quantized MatMuls (its `dynamic` nodes) at each MatMulNBits block, as
OpenVINO serves them: whether its CPU plugin quantizes their activations at run time, what the block costs, and
whether the gates hold in both arithmetics; then what INT8 could still buy past them.

    python perf/bench_nbits_blocks.py all_mpnet_base_v2 [--variant openvino-bf16] [--batches 6] [--repeats 7]

For each scheme of tritonkit.int8.granularity.BLOCKS, the recipe's graph with its run-time nodes in that scheme
(nothing else changed), scored on all validation against FP32: in the arithmetic the search judges (onnxruntime,
exact int8 sums) and as `--variant` serves it (the runner sets DYNAMIC_QUANTIZATION_GROUP_SIZE to the block); then
the time of the first `--batches` validation batches at the served threads, median of `--repeats` interleaved
repeats, with the runner's group and with OpenVINO's run-time quantization off (group 0: INT8 weights, float
activations). Two rows bound what is left: the run-time nodes static per tensor (the search's own arithmetic, which
their outliers broke: the speed a static range would buy), and the recipe's other float nodes static too (MiniLM's
attention products). Writes nothing into the repository.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tritonkit import envinfo, kinds, paths
from tritonkit.int8 import gates, granularity, judge
from tritonkit.int8.context import SearchContext
from tritonkit.int8.params import file_digest
from tritonkit.int8.recipe import committed_candidate, load_recipes
from tritonkit.perf.interleave import interleaved
from tritonkit.serving.runtimes import open_variant, openvino_core


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--variant", default="openvino-bf16" if envinfo.has_bf16() else "openvino")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    kind = kinds.get(args.model)
    fp32 = paths.model_file(kind.FP32_MODEL)
    entry = (load_recipes(kind, None) or {}).get("served")
    candidate = committed_candidate(kind, "served", entry, fp32, file_digest(fp32))
    if candidate is None or not candidate[0].dynamic:
        raise SystemExit(f"{kind.NAME}: no committed served recipe with run-time quantized nodes for this FP32 file")
    recipe, params = candidate
    nodes = recipe.dynamic_nodes
    search = SearchContext(kind, fp32, [recipe.form], check_speed=False, progress=False, log=lambda _m: None,
                           margin=0.0, exact=judge.exact_judgement(),
                           gates=gates.for_entry(kind, fp32, "served", entry), committed=(recipe, params),
                           min_int8_share=0.0)
    val = search.val
    metric = kind.TARGETS[0].metric
    print(f"{kind.NAME}: {recipe.describe()}, its {len(nodes)} run-time nodes per scheme; {envinfo.cpu_model()} "
          f"({envinfo.int8_class()}); OpenVINO quantizes at run time here: "
          f"{'yes' if envinfo.openvino_quantizes_at_run_time() else 'no'}; {args.variant}, {kind.SERVE_THREADS} "
          f"threads, first {args.batches} validation batches\n")
    others = [n for n in recipe.float_nodes if n not in nodes]
    variants = {scheme: (recipe.with_dynamic(scheme, nodes), block) for scheme, block in granularity.BLOCKS.items()}
    variants[f"{len(nodes)} run-time nodes static"] = (replace(recipe, float_nodes=others, dynamic={}), None)
    if others:
        variants[f"{len(others)} other float nodes static"] = (replace(recipe, float_nodes=list(nodes)), None)
    runs, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="bench-nbits-") as tmp:
        for scheme, (r, block) in variants.items():
            model = search.build(r)
            judged = val.metrics(model, exact=search.exact)
            path = Path(tmp) / f"{len(rows)}.onnx"
            onnx.save(model, str(path))
            served = open_variant(args.variant, path, kind.SERVE_THREADS)
            out = served.runner.output_names[0]
            got = np.concatenate([served.run([out], b)[0] for b in val.batches])
            as_served = kind.gate_metrics(val.ref, got)
            held = not search.gates.missed("validation", judged) and not search.gates.missed("validation", as_served)
            runs[scheme] = lambda b, s=served, o=out: s.run([o], b)
            rows.append((scheme, block, judged[metric], as_served[metric], held))
            if block is None:
                continue
            off = openvino_core().compile_model(str(path), "CPU", {**served.runner.properties,
                                                                  "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
            request, names = off.create_infer_request(), served.runner.input_names
            runs[f"{scheme}, quantization off"] = lambda b, req=request, names=names: req.infer(
                {k: v for k, v in b.items() if k in names})
        feeds = val.batches[: args.batches]
        times = interleaved({name: lambda run=run: [run(b) for b in feeds] for name, run in runs.items()},
                            args.repeats)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    first = recipe.dynamic["scheme"]
    print(f"| {len(nodes)} run-time nodes as | block = group "
          f"| {metric} judged | {metric} as served | gates | ms | × {first} | ms, run-time "
          "quantization off |\n|---|---:|---:|---:|---|---:|---:|---:|")
    for scheme, block, judged_m, served_m, held in rows:
        off = ms.get(f"{scheme}, quantization off")
        print(f"| {scheme} | {block or '–'} | {judged_m:.4f} | {served_m:.4f} | {'held' if held else 'missed'} | "
              f"{ms[scheme]:.1f} | {ms[first] / ms[scheme]:.2f} | {'–' if off is None else f'{off:.1f}'} |")


if __name__ == "__main__":
    main()
