"""Benchmark: the OpenAI-compatible gateway vs calling Triton's `text_embedding` ensemble directly over gRPC.

    python perf/bench_gateway.py [--concurrency 8] [--texts-per-request 8] [--seconds 8] [--repeats 3]

Builds missing artefacts, starts tritonserver and the gateway on free loopback ports, then alternates the two
clients under the same closed-loop load (N threads, each request embedding the same real texts): the official
`openai` SDK through the gateway, and tritonkit_client over gRPC straight to Triton. Reports the median of repeats
and the gateway's throughput overhead; writes perf/results/gateway-<time>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import build, data
from tritonkit.perf.analyzer import PerfPoint, median_point, print_table, save_results, time_in_process
from tritonkit.runtime.server import TritonServer, free_port


def start_gateway(grpc_url: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tritonkit_client.gateway", "--port", str(port),
                             "--triton", grpc_url, "--max-in-flight", "1024"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(150):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("gateway did not start")


def main(argv: list[str] | None = None) -> int:
    import openai
    from tritonkit_client.core import Client
    from tritonkit_client.text import embed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--texts-per-request", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    build.build("text", progress=False)
    texts = data.split("benchmark")
    n = args.texts_per_request
    requests = [texts[i : i + n] for i in range(0, min(len(texts), 64 * n), n)]
    with TritonServer.on_free_ports(models=["text_embedding"]) as server:
        gateway, port = start_gateway(server.grpc_url)
        try:
            sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            direct = Client(server.grpc_url, protocol="grpc")

            def via_gateway(batch):
                sdk.embeddings.create(input=batch, model="all-MiniLM-L6-v2")

            def via_grpc(batch):
                embed(batch, client=direct, batch_size=n, concurrency=1)

            runs: dict[str, list[PerfPoint]] = {"direct gRPC": [], "gateway (openai SDK)": []}
            for r in range(args.repeats):
                for label, fn in (("direct gRPC", via_grpc), ("gateway (openai SDK)", via_gateway)):
                    point = time_in_process(fn, requests, args.concurrency, duration_s=args.seconds, label=label,
                                            items_per_call=n)
                    print(f"  run {r + 1}/{args.repeats} {label}: {point.throughput:.1f} texts/s "
                          f"p50 {point.p50_ms:.1f} ms p99 {point.p99_ms:.1f} ms", flush=True)
                    runs[label].append(point)
            direct.close()
        finally:
            gateway.terminate()
            gateway.wait(10)

    points = {label: median_point(r) for label, r in runs.items()}
    ratios = [g.throughput / d.throughput for g, d in zip(runs["gateway (openai SDK)"], runs["direct gRPC"])]
    overhead = 1 - statistics.median(ratios)
    print_table(list(points.values()), f"text_embedding, {n} texts per request, concurrency {args.concurrency}")
    print(f"gateway throughput overhead vs direct gRPC: {overhead:.1%} (median of {args.repeats} paired runs)")
    save_results("gateway", {"args": vars(args), "points": {k: v.to_json() for k, v in points.items()},
                             "paired_ratios": ratios, "overhead": overhead}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
