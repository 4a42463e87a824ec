"""Overload benchmark: offer ~4x the sustainable load open-loop and show that the queue policies shed it.

    python perf/bench_overload.py [--pipelines text image] [--factor 4] [--seconds 20] [--compare-unbounded]
                                  [--settle-s 20] [--allocator jemalloc|glibc]

For each pipeline (text_embedding: one real text per request; image_classification: one real JPEG photo per
request) it starts tritonserver on free loopback ports with that ensemble, measures the sustainable capacity
with a closed loop (16 callers, ok answers per second), then offers `--factor` x that rate open-loop (Poisson
arrivals, gRPC, tritonkit.perf.load) for `--seconds` and reports: offered rate, accepted throughput, rejected
count/fraction with how fast rejections come back (p50/p99), p99 of accepted requests, other errors, and the
RSS/PSS of server + Python-backend stubs before, at peak, when the backlog has drained and after `--settle-s` of
light traffic (what the server keeps; `--allocator glibc` shows what jemalloc saves). The server runs the
`overload` profile (configs/overload.pbtxt: the default configs plus shedding queue policies,
tritonkit.repository.variants);
`--compare-unbounded` repeats the run with the default configs (no policies), to show what they prevent.
Prints a Markdown table and writes perf/results/overload-<time>.json.

The profile's policies (`default_queue_policy`, values in tritonkit.repository.variants.OVERLOAD_POLICIES):
  - default_timeout_microseconds (REJECT) is what sheds: a request still queued after it is answered
    UNAVAILABLE "Request timeout expired". That bounds accepted latency at about timeout + one batch per step.
  - max_queue_size is a memory backstop, sized well above what the timeout lets pile up at 4x, so it rarely
    fires. It does reject instantly ("Exceeds maximum queue size"), but in Triton 2.51 a dynamic batcher that
    keeps hitting max_queue_size stalls (docs/performance.md), so it is not the primary shedding mechanism.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import data
from tritonkit.perf import load, stats
from tritonkit.perf.analyzer import save_results
from tritonkit.repository.variants import OVERLOAD_PROFILE
from tritonkit.runtime.server import TritonServer

PIPELINES = {
    "text": ("text_embedding", ("tokenizer", "text_encoder")),
    "image": ("image_classification", ("image_preprocess", "image_classifier")),
}


def workload(pipeline: str) -> load.Workload:
    if pipeline == "text":
        return load.text_workload(data.split("benchmark"))
    return load.image_workload(load.real_images())


def run_one(pipeline: str, policy: str, args: argparse.Namespace, tmp: Path) -> dict:
    ensemble, steps = PIPELINES[pipeline]
    w = workload(pipeline)
    # 'overload': the profile with shedding queue policies; 'none': the default configs (no policies).
    profile = OVERLOAD_PROFILE if policy == OVERLOAD_PROFILE else ""
    print(f"[{pipeline}/{policy}] starting tritonserver with {ensemble} ...", flush=True)
    with TritonServer.on_free_ports(models=[ensemble], profile=profile, allocator=args.allocator) as server:
        cap = load.capacity(server.grpc_url, w, args.capacity_concurrency, args.capacity_seconds)
        rate = args.factor * cap["ok_per_s"]
        print(f"[{pipeline}/{policy}] capacity {cap['ok_per_s']:.1f}/s (closed loop c={args.capacity_concurrency}, "
              f"p99 {cap['ok_p99_ms']:.0f} ms); offering {rate:.0f}/s for {args.seconds:.0f}s", flush=True)
        stats_before = stats.read(server.http_url, steps)
        with load.MemorySampler(server.process.pid, interval_s=1.0) as mem:
            started, cpu0 = time.perf_counter(), time.process_time()
            outcomes = load.open_loop(server.grpc_url, [(w, rate)], args.seconds, arrivals="poisson",
                                      request_timeout_s=args.client_timeout)
            drained_s = time.perf_counter() - started
            client_cpu_s = time.process_time() - cpu0
        steps_delta = stats.between(stats_before, stats.read(server.http_url, steps))
        summary = load.summarize(outcomes, args.seconds)
        healthy = server.is_ready()
        after = load.summarize(load.open_loop(server.grpc_url, [(w, 5.0)], 2.0), 2.0)
        # What the server keeps once the backlog is gone: memory after --settle-s of light traffic.
        load.open_loop(server.grpc_url, [(w, 0.1 * cap["ok_per_s"])], args.settle_s)
        settled = load.group_memory(server.process.pid)
        row = {
            "pipeline": pipeline, "model": ensemble, "policy": policy,
            "capacity_per_s": cap["ok_per_s"], "capacity_p99_ms": cap["ok_p99_ms"],
            "target_offered_per_s": rate, **summary,
            "drained_s": drained_s,
            # The load generator shares the 2 cores with the server: its CPU time is load the server does not get.
            "client_cpu_fraction_of_one_core": client_cpu_s / drained_s,
            "steps": steps_delta,
            "allocator": args.allocator, "settle_s": args.settle_s,
            "memory_before": mem.samples[0], "memory_after": mem.samples[-1], "memory_settled": settled,
            "peak_pss_mib": max(s["pss_mib"] for s in mem.samples),
            "peak_rss_mib": max(s["rss_mib"] for s in mem.samples),
            "pss_growth_by_process_mib": {
                k: round(v - mem.samples[0]["pss_by_process_mib"].get(k, 0.0), 1)
                for k, v in mem.samples[-1]["pss_by_process_mib"].items()},
            "memory_samples": mem.samples,
            "healthy_after": healthy and after["ok"] == after["requests"] and after["requests"] > 0,
        }
    print(f"[{pipeline}/{policy}] offered {row['offered_per_s']:.0f}/s, ok {row['ok_per_s']:.0f}/s, rejected "
          f"{100 * row['rejected_fraction']:.0f}% (p50 {row['rejected_p50_ms']:.0f} ms), errors {row['errors']}, "
          f"ok p99 {row['ok_p99_ms']:.0f} ms, PSS {row['memory_before']['pss_mib']:.0f} -> peak "
          f"{row['peak_pss_mib']:.0f} MiB -> settled {settled['pss_mib']:.0f} MiB "
          f"({settled['pss_by_process_mib']}), healthy after: {row['healthy_after']}; client CPU "
          f"{row['client_cpu_fraction_of_one_core']:.2f} core; per step {row['steps']}; PSS growth by process "
          f"{row['pss_growth_by_process_mib']}", flush=True)
    return row


def markdown(rows: list[dict]) -> str:
    lines = [
        "| pipeline | queue policy | capacity /s | offered /s | accepted /s | rejected | rejection p50 / p99 ms "
        "| accepted p50 / p99 ms | other errors | server+stubs PSS MiB before → peak → drained → settled "
        "| RSS sum MiB before → after | healthy after |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    f = lambda v: "–" if v != v else f"{v:.0f}"  # noqa: E731 (nan → dash)
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['policy']} | {r['capacity_per_s']:.0f} | {r['offered_per_s']:.0f} | "
            f"{r['ok_per_s']:.0f} | {r['rejected']} ({100 * r['rejected_fraction']:.0f} %) | "
            f"{f(r['rejected_p50_ms'])} / {f(r['rejected_p99_ms'])} | {f(r['ok_p50_ms'])} / {f(r['ok_p99_ms'])} | "
            f"{r['errors']} | {r['memory_before']['pss_mib']:.0f} → {r['peak_pss_mib']:.0f} → "
            f"{r['memory_after']['pss_mib']:.0f} → {r['memory_settled']['pss_mib']:.0f} | "
            f"{r['memory_before']['rss_mib']:.0f} → {r['memory_after']['rss_mib']:.0f} | "
            f"{'yes' if r['healthy_after'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", nargs="+", choices=list(PIPELINES), default=list(PIPELINES))
    parser.add_argument("--factor", type=float, default=4.0, help="offered load as a multiple of capacity")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the open-loop overload")
    parser.add_argument("--capacity-seconds", type=float, default=8.0)
    parser.add_argument("--capacity-concurrency", type=int, default=16)
    parser.add_argument("--client-timeout", type=float, default=30.0,
                        help="client deadline per request (s); only the unbounded variant gets near it")
    parser.add_argument("--settle-s", type=float, default=20.0,
                        help="light traffic (10 %% of capacity) after the drain, then memory is sampled again")
    parser.add_argument("--allocator", default="jemalloc", choices=["jemalloc", "glibc"],
                        help="malloc for the tritonserver process (TritonServer.allocator)")
    parser.add_argument("--compare-unbounded", action="store_true",
                        help="also run each pipeline with the queue policies removed")
    args = parser.parse_args(argv)

    from tritonkit import build

    for pipeline in args.pipelines:
        build.build(pipeline, progress=False)  # no-op when the artefacts are current
    policies = [OVERLOAD_PROFILE, "none"] if args.compare_unbounded else [OVERLOAD_PROFILE]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tritonkit-overload-") as tmp:
        for pipeline in args.pipelines:
            for policy in policies:
                rows.append(run_one(pipeline, policy, args, Path(tmp)))
    table = markdown(rows)
    print("\n" + table + "\n")
    save_results("overload", load.to_jsonable({
        "rows": rows,
        "markdown": table,
    }), argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
