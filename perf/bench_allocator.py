"""Allocator benchmark: does the server's malloc cost throughput? Capacity of both pipelines per allocator.

    python perf/bench_allocator.py [--repeats 3] [--seconds 8]

Modes, each a fresh tritonserver with text_embedding + image_classification, interleaved `--repeats` times (the
machine's speed drifts; interleaving spreads it over all modes):
  - glibc: no preload anywhere;
  - jemalloc-server: the default (TritonServer.allocator="jemalloc": server only, stubs behind the wrapper);
  - jemalloc-everywhere: jemalloc in LD_PRELOAD of the launcher, which the stubs then inherit too.
Per start, each pipeline's capacity is measured twice (closed loop, 16 callers, gRPC, real inputs; tritonkit.perf.load).
Reports the median per mode and pipeline and the ratio to glibc. Writes perf/results/allocator-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from statistics import median

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit.perf import load
from tritonkit.perf.analyzer import save_results

MODES = {"glibc": ("glibc", False), "jemalloc-server": ("jemalloc", False), "jemalloc-everywhere": ("glibc", True)}
PIPELINES = ("text", "image")


def measure(mode: str, seconds: float) -> dict[str, list[float]]:
    """Capacities under `mode`, from a child process (LD_PRELOAD must be set before a process starts)."""
    allocator, everywhere = MODES[mode]
    env = dict(os.environ)
    if everywhere:
        from tritonkit.runtime.server import find_allocator

        env["LD_PRELOAD"] = find_allocator("jemalloc") or ""
    cmd = [sys.executable, __file__, "--child", allocator, "--seconds", str(seconds)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def child(allocator: str, seconds: float) -> None:
    from tritonkit import data
    from tritonkit.runtime.server import TritonServer

    workloads = {"text": load.text_workload(data.split("benchmark")), "image": load.image_workload(load.real_images())}
    with TritonServer.on_free_ports(models=["text_embedding", "image_classification"], allocator=allocator) as srv:
        caps = {name: [] for name in PIPELINES}
        for _ in range(2):
            for name in PIPELINES:
                caps[name].append(load.capacity(srv.grpc_url, workloads[name], 16, seconds, warmup_s=2.0)["ok_per_s"])
    print(json.dumps(caps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.seconds)
        return 0

    from tritonkit import build

    build.build("text", progress=False)
    build.build("image", progress=False)
    runs: dict[str, dict[str, list[float]]] = {m: {p: [] for p in PIPELINES} for m in MODES}
    for r in range(args.repeats):
        for mode in MODES:
            caps = measure(mode, args.seconds)
            for p in PIPELINES:
                runs[mode][p] += caps[p]
            print(f"[{r + 1}/{args.repeats}] {mode}: " + ", ".join(f"{p} {caps[p]}" for p in PIPELINES), flush=True)
    med = {m: {p: median(v) for p, v in per.items()} for m, per in runs.items()}
    lines = ["| server malloc | text /s (× glibc) | images /s (× glibc) |", "|---|---:|---:|"]
    for m in MODES:
        cells = [f"{med[m][p]:.1f} ({med[m][p] / med['glibc'][p]:.3f})" for p in PIPELINES]
        lines.append(f"| {m} | {' | '.join(cells)} |")
    table = "\n".join(lines)
    print("\n" + table + "\n")
    save_results("allocator", {"runs": runs, "median_per_s": med, "markdown": table}, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
