"""Benchmark the ensemble overhead: text_embedding vs text_encoder direct vs the fused text_embedding_fused.

The ensemble (tokenizer → text_encoder, two Python-backend stubs on the embedded server) against the encoder called
directly with pre-tokenized inputs, and against the fused one-stub model that tokenizes and encodes itself.

    python perf/bench_ensemble.py [--concurrency 16] [--repeats 3] [--measurement-ms 3000] [--repository DIR]
                                  [--workloads direct,ensemble,fused,fused-padded]

One server holds every workload's models. perf_analyzer over gRPC sends one real text per request (the `benchmark`
split) to the ensemble and the fused model, and the same texts pre-tokenized to text_encoder; repeats are
interleaved (direct, ensemble, fused, ... again) so drift hits all alike, and the median is reported. Also
measured: `text_embedding_fused` without length buckets (`fused-padded`: one run per execute() padded to its longest
text, as text_encoder ran before `ragged_max_padding`), to tell the gain of fusing from the gain of bucketing.
Around every run the statistics API and the ORT padding counters are read (queue/compute ms and batch per model,
padding waste). Prints the table and the overheads 1 − ensemble/direct and 1 − fused/direct; writes
perf/results/ensemble-<time>.json. `--repository` benchmarks another repository (e.g. a config variant from
tritonkit.repository.variants) holding the same models.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import build, paths
from tritonkit.perf import stats
from tritonkit.perf.analyzer import (
    PerfPoint,
    median_point,
    metrics_counters,
    print_table,
    run_perf_analyzer,
    save_results,
    write_input_data,
)
from tritonkit.perf.lab import benchmark_text_rows, benchmark_token_rows
from tritonkit.repository import variants as rv
from tritonkit.repository.config import to_pbtxt
from tritonkit.runtime.server import TritonServer

RESULTS = paths.ROOT / "perf" / "results"
TARGET = 0.10  # at most 10 % throughput lost to the ensemble at concurrency 16
PADDED = "text_embedding_fused_padded"


@dataclass
class Workload:
    key: str
    model: str
    label: str
    tokens: bool  # pre-tokenized inputs (text_encoder) instead of text
    stats_models: tuple[str, ...]
    ort_model: str  # whose tritonkit_ort_* counters tell the padding waste


WORKLOADS = {
    w.key: w
    for w in (
        Workload("direct", "text_encoder", "text_encoder direct (pre-tokenized)", True, ("text_encoder",),
                 "text_encoder"),
        Workload("ensemble", "text_embedding", "text_embedding ensemble", False,
                 ("text_embedding", "tokenizer", "text_encoder"), "text_encoder"),
        Workload("fused", "text_embedding_fused", "text_embedding_fused", False, ("text_embedding_fused",),
                 "text_embedding_fused"),
        Workload("fused-padded", PADDED, "text_embedding_fused, bucketing off", False, (PADDED,), PADDED),
    )
}


def make_repository(source: Path, dest: Path) -> Path:
    """The four models from `source` (configs as in the working tree; ONNX and model.py linked, not copied), plus
    the fused model with bucketing off under its own name."""
    models = ["text_embedding", "tokenizer", "text_encoder", "text_embedding_fused"]
    rv.make_variant(dest, models, source=source, committed=False)
    cfg = rv.read_config("text_embedding_fused", dest, committed=False)
    cfg.name = PADDED
    if "ragged_max_padding" in cfg.parameters:
        del cfg.parameters["ragged_max_padding"]
    (dest / PADDED).mkdir()
    (dest / PADDED / "config.pbtxt").write_text(to_pbtxt(cfg))
    (dest / PADDED / "1").symlink_to((dest / "text_embedding_fused" / "1").resolve())
    return dest


def padding(before: dict, after: dict, model: str) -> dict[str, float]:
    d = {k[0].removeprefix("tritonkit_ort_").removesuffix("_total"): after[k] - before.get(k, 0.0)
         for k in after if k[1] == model}
    total, runs = d.get("input_elements", 0.0), d.get("session_runs", 0.0)
    return {"padding_fraction": d.get("padding_elements", 0.0) / total if total else float("nan"),
            "requests_per_run": d.get("batched_requests", 0.0) / runs if runs else float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--concurrency", type=int, default=16, help="perf_analyzer concurrency (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats, median reported (default 3)")
    parser.add_argument("--measurement-ms", type=int, default=3000, help="perf_analyzer window (default 3000)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)} (default all)")
    parser.add_argument("--repository", type=Path, default=paths.MODEL_REPOSITORY,
                        help="model repository to take the models from (default model_repository/)")
    parser.add_argument("--tag", default="", help="a note stored in the results JSON (e.g. the variant tried)")
    args = parser.parse_args(argv)
    workloads = [WORKLOADS[k] for k in args.workloads.split(",")]

    build.build("text", progress=False)  # no-op when current
    RESULTS.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[PerfPoint]] = {w.key: [] for w in workloads}
    waste: dict[str, list[dict]] = {w.key: [] for w in workloads}
    with tempfile.TemporaryDirectory(prefix="tritonkit-ensemble-") as tmp:
        text_data = write_input_data(Path(tmp) / "text.json", benchmark_text_rows())
        token_data = write_input_data(Path(tmp) / "tokens.json", benchmark_token_rows())
        repo = make_repository(args.repository, Path(tmp) / "repo")
        server = TritonServer.on_free_ports(model_repository=repo, model_control_mode="explicit",
                                            models=sorted({w.model for w in workloads}))
        print(f"starting tritonserver with {', '.join(server.models)} ...", flush=True)
        with server:
            for r in range(args.repeats):
                for w in workloads:
                    before = stats.read(server.http_url, w.stats_models), metrics_counters(server.metrics_url)
                    point = run_perf_analyzer(w.model, server.grpc_url, args.concurrency,
                                              token_data if w.tokens else text_data, protocol="grpc",
                                              measurement_ms=args.measurement_ms, label=w.label)
                    point.stats = stats.between(before[0], stats.read(server.http_url, w.stats_models))
                    waste[w.key].append(padding(before[1], metrics_counters(server.metrics_url), w.ort_model))
                    runs[w.key].append(point)
                    print(f"  {w.label} run {r + 1}/{args.repeats}: {point.throughput:.1f}/s "
                          f"p50 {point.p50_ms:.1f} ms p99 {point.p99_ms:.1f} ms", flush=True)

    points = {k: median_point(v) for k, v in runs.items()}
    print_table(list(points.values()), f"texts/s at concurrency {args.concurrency}, median of {args.repeats}")
    for key, p in points.items():
        split = "; ".join(f"{m} queue {s['queue_ms']:.1f} ms compute {s['compute_ms']:.1f} ms batch {s['batch']:.1f}"
                          for m, s in p.stats.items())
        med = lambda f, key=key: sorted(x[f] for x in waste[key])[len(waste[key]) // 2]  # noqa: E731
        print(f"{key}: {split}; padding {100 * med('padding_fraction'):.0f}% of encoder input, "
              f"{med('requests_per_run'):.1f} requests per session.run")
    overhead = {}
    if "direct" in points:
        direct = points["direct"].throughput
        for key in ("ensemble", "fused", "fused-padded"):
            if key in points:
                overhead[key] = 1 - points[key].throughput / direct
                verdict = "within" if overhead[key] <= TARGET else "over"
                print(f"overhead {key} vs direct: 1 - {points[key].throughput:.1f}/{direct:.1f} = "
                      f"{100 * overhead[key]:+.1f}% ({verdict} the {100 * TARGET:.0f}% target)")
    save_results("ensemble", {
        "tag": args.tag,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "median": {k: p.to_json() for k, p in points.items()},
        "runs": {k: [p.to_json() for p in v] for k, v in runs.items()},
        "padding": waste,
        "overhead_vs_direct": overhead,
    }, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
