"""Benchmark: the OpenAI-compatible gateway vs calling Triton's `text_embedding` ensemble directly over gRPC.

    python perf/bench_gateway.py [--concurrency 8] [--texts-per-request 8] [--seconds 8] [--repeats 3]
    python perf/bench_gateway.py --rerank MODEL [--documents-per-query 20] [--no-embeddings]

Builds missing artefacts, starts tritonserver and the gateway on free loopback ports, then alternates the two
clients under the same closed-loop load (N threads, each request embedding the same real texts): the official
`openai` SDK through the gateway, and tritonkit_client over gRPC straight to Triton. With --rerank (a text-rerank
model already built into the repository, `make build MODEL=...`; its `_fp32` / `_fused` twins too), the same for
/v1/rerank (plain HTTP POSTs) against rerank() over gRPC, one query and N real documents a request, in pairs/s.
Reports the median of repeats and the gateway's throughput overhead; writes perf/results/gateway-<time>.json.
"""

from __future__ import annotations

import argparse
import json
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
                             "--triton", grpc_url, "--max-in-flight", "1024", "--health-model", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(150):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("gateway did not start")


def paired_runs(pairs: dict[str, object], requests: list, args, items_per_call: int, unit: str) -> dict:
    """Each of the (direct, gateway) callables under the same closed loop, alternated per repeat; medians and the
    gateway's throughput overhead."""
    runs: dict[str, list[PerfPoint]] = {label: [] for label in pairs}
    for r in range(args.repeats):
        for label, fn in pairs.items():
            point = time_in_process(fn, requests, args.concurrency, duration_s=args.seconds, label=label,
                                    items_per_call=items_per_call)
            print(f"  run {r + 1}/{args.repeats} {label}: {point.throughput:.1f} {unit}/s "
                  f"p50 {point.p50_ms:.1f} ms p99 {point.p99_ms:.1f} ms", flush=True)
            runs[label].append(point)
    direct, via = runs.values()
    ratios = [g.throughput / d.throughput for g, d in zip(via, direct)]
    return {"points": {label: median_point(r) for label, r in runs.items()}, "paired_ratios": ratios,
            "overhead": 1 - statistics.median(ratios)}


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def main(argv: list[str] | None = None) -> int:
    import openai
    from tritonkit_client.core import Client
    from tritonkit_client.reranking import rerank
    from tritonkit_client.text import embed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--texts-per-request", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rerank", metavar="MODEL", help="also time /v1/rerank on this built text-rerank model")
    parser.add_argument("--documents-per-query", type=int, default=20)
    parser.add_argument("--no-embeddings", action="store_true", help="time only /v1/rerank")
    args = parser.parse_args(argv)
    if args.no_embeddings and not args.rerank:
        parser.error("--no-embeddings needs --rerank MODEL")

    texts = data.split("benchmark")
    n, d = args.texts_per_request, args.documents_per_query
    models = [] if args.no_embeddings else ["text_embedding"]
    if not args.no_embeddings:
        build.build("text", progress=False)
    models += [args.rerank] if args.rerank else []
    results: dict[str, dict] = {}
    with TritonServer.on_free_ports(models=models) as server:
        gateway, port = start_gateway(server.grpc_url)
        direct = Client(server.grpc_url, protocol="grpc")
        try:
            if not args.no_embeddings:
                sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
                requests = [texts[i : i + n] for i in range(0, min(len(texts), 64 * n), n)]
                results["embeddings"] = paired_runs({
                    "direct gRPC": lambda batch: embed(batch, client=direct, batch_size=n, concurrency=1),
                    "gateway (openai SDK)": lambda batch: sdk.embeddings.create(input=batch, model="all-MiniLM-L6-v2"),
                }, requests, args, n, "texts")
                print_table(list(results["embeddings"]["points"].values()),
                            f"text_embedding, {n} texts per request, concurrency {args.concurrency}")
            if args.rerank:
                # A query is a search's few words: a benchmark text's first 12.
                queries = [(" ".join(texts[i].split()[:12]), texts[i + 1 : i + 1 + d])
                           for i in range(0, min(len(texts) - d - 1, 64 * d), d)]
                url = f"http://127.0.0.1:{port}/v1/rerank"
                results["rerank"] = paired_runs({
                    "direct gRPC": lambda q: rerank(q[0], q[1], model=args.rerank, client=direct, concurrency=1),
                    "gateway /v1/rerank": lambda q: post_json(url, {"model": args.rerank, "query": q[0],
                                                                    "documents": q[1]}),
                }, queries, args, d, "pairs")
                print_table(list(results["rerank"]["points"].values()),
                            f"{args.rerank}, 1 query x {d} documents per request, concurrency {args.concurrency}")
        finally:
            direct.close()
            gateway.terminate()
            gateway.wait(10)

    for route, result in results.items():
        print(f"{route}: gateway throughput overhead vs direct gRPC: {result['overhead']:.1%} "
              f"(median of {args.repeats} paired runs)")
    save_results("gateway", {"args": vars(args), **{route: {
        "points": {k: v.to_json() for k, v in r["points"].items()}, "paired_ratios": r["paired_ratios"],
        "overhead": r["overhead"]} for route, r in results.items()}}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
