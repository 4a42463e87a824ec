"""Benchmark: the served text_embedding ensemble (perf_analyzer) vs in-process sentence-transformers FP32.

    python perf/bench_text.py [--concurrency 1,8,16,32] [--repeats 3] [--fp32] [--protocol grpc]

Builds missing artefacts, starts tritonserver on free loopback ports, runs perf_analyzer through the ensemble at
each concurrency with real text (the `benchmark` split, one text per request, median of repeats), reads the
encoder's padding counters, stops the server, then times sentence-transformers FP32 in this process on the same
texts under the same closed-loop load (N threads, one text per call; and the best case, N texts per call).
Prints throughput, p50/p99 and ratios; writes perf/results/text-<time>.json and a Markdown table.
Target: served INT8 >= 3x in-process sentence-transformers FP32 at concurrency 16, p99 <= 50 ms.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import build, data, paths
from tritonkit.perf.analyzer import (
    PerfPoint,
    metrics_counters,
    print_table,
    save_results,
    sweep,
    text_rows,
    time_in_process,
    write_input_data,
)
from tritonkit.runtime.server import TritonServer

RESULTS = paths.ROOT / "perf" / "results"


def padding_waste(before: dict, after: dict, model: str) -> dict[str, float]:
    delta = {k[0]: after[k] - before.get(k, 0.0) for k in after if k[1] == model}
    total = delta.get("tritonkit_ort_input_elements_total", 0.0)
    padding = delta.get("tritonkit_ort_padding_elements_total", 0.0)
    runs = delta.get("tritonkit_ort_session_runs_total", 0.0)
    requests = delta.get("tritonkit_ort_batched_requests_total", 0.0)
    return {
        "padding_fraction": padding / total if total else float("nan"),
        "requests_per_run": requests / runs if runs else float("nan"),
        "session_runs": runs,
    }


def baseline(texts: list[str], concurrencies: list[int], seconds: float) -> tuple[list[PerfPoint], list[PerfPoint]]:
    import torch

    from tritonkit import kinds

    minilm = kinds.get("text_embedding")

    torch.set_num_threads(os.cpu_count() or 1)
    model = minilm.sentence_transformer()
    per_text, batched = [], []
    for c in concurrencies:
        per_text.append(time_in_process(lambda t: model.encode([t]), texts, c, duration_s=seconds,
                                        label="sentence-transformers FP32 (1 text/call)"))
        groups = [texts[i : i + c] for i in range(0, len(texts) - c, c)]
        batched.append(time_in_process(lambda g: model.encode(g, batch_size=len(g)), groups, 1,
                                       duration_s=seconds, items_per_call=c,
                                       label=f"sentence-transformers FP32 ({c} texts/call)"))
        batched[-1].concurrency = c
        print(f"  baseline c={c}: {per_text[-1].throughput:.1f}/s p99 {per_text[-1].p99_ms:.1f} ms; "
              f"batched {batched[-1].throughput:.1f}/s", flush=True)
    return per_text, batched


def markdown(rows: list[tuple[str, PerfPoint]], base: dict[int, PerfPoint], best: dict[int, PerfPoint]) -> str:
    lines = [
        "| what | concurrency | texts/s | p50 ms | p99 ms | × ST 1 text/call | × ST N texts/call |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in rows:
        b, bb = base.get(p.concurrency), best.get(p.concurrency)
        ratio = f"{p.throughput / b.throughput:.2f}" if b and "sentence" not in name else ""
        ratio_best = f"{p.throughput / bb.throughput:.2f}" if bb and "sentence" not in name else ""
        lines.append(f"| {name} | {p.concurrency} | {p.throughput:.1f} | {p.p50_ms:.1f} | {p.p99_ms:.1f} | "
                     f"{ratio} | {ratio_best} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,16,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measurement-ms", type=int, default=4000)
    parser.add_argument("--protocol", choices=["http", "grpc"], default="grpc")
    parser.add_argument("--fp32", action="store_true", help="also benchmark the FP32 ensemble")
    parser.add_argument("--baseline-seconds", type=float, default=8.0)
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    build.build("text")
    texts = data.split("benchmark")
    RESULTS.mkdir(parents=True, exist_ok=True)
    input_data = write_input_data(RESULTS / "text_input_data.json", text_rows(texts))
    models = ["text_embedding"] + (["text_embedding_fp32"] if args.fp32 else [])
    served: list[tuple[str, PerfPoint]] = []
    waste = {}
    server = TritonServer.on_free_ports(model_control_mode="explicit", models=models)
    print(f"starting tritonserver with {models} ...", flush=True)
    with server:
        url = server.grpc_url if args.protocol == "grpc" else server.http_url
        for model in models:
            before = metrics_counters(server.metrics_url)
            label = f"served {model} ({'INT8' if model == 'text_embedding' else 'FP32'})"
            points = sweep(model, url, concurrencies, input_data, repeats=args.repeats, label=label,
                           protocol=args.protocol, measurement_ms=args.measurement_ms)
            encoder = "text_encoder" if model == "text_embedding" else "text_encoder_fp32"
            waste[model] = padding_waste(before, metrics_counters(server.metrics_url), encoder)
            served += [(label, p) for p in points]
    per_text, batched = ([], []) if args.skip_baseline else baseline(texts, concurrencies, args.baseline_seconds)
    base = {p.concurrency: p for p in per_text}
    best = {p.concurrency: p for p in batched}

    rows = served + [(p.label, p) for p in per_text + batched]
    print_table([p for _, p in rows], "text embedding throughput (texts/s) and latency", baseline=base or None)
    for model, w in waste.items():
        print(f"{model}: encoder padding waste {100 * w['padding_fraction']:.1f}% of input elements, "
              f"{w['requests_per_run']:.1f} requests per session.run")
    table = markdown(rows, base, best)
    print("\n" + table + "\n")
    c16 = next((p for name, p in served if p.concurrency == 16 and "INT8" in name), None)
    if c16 and 16 in base:
        ratio = c16.throughput / base[16].throughput
        print(f"target @16: INT8 served {c16.throughput:.1f}/s = {ratio:.2f}x sentence-transformers "
              f"(1 text/call; {c16.throughput / best[16].throughput:.2f}x its 16-texts/call best case); "
              f"p99 {c16.p99_ms:.1f} ms — {'MET' if ratio >= 3 and c16.p99_ms <= 50 else 'NOT met'} (>=3x, <=50 ms)")
    save_results("text", {
        "served": [p.to_json() for _, p in served],
        "baseline_per_text": [p.to_json() for p in per_text],
        "baseline_batched": [p.to_json() for p in batched],
        "padding": waste,
        "markdown": table,
    }, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
