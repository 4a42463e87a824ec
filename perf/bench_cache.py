"""Benchmark: Triton's response cache on the text_embedding ensemble, with a realistic share of repeated queries.

    python perf/bench_cache.py [--repeat-rate 0.3] [--unique 1400] [--concurrency 16] [--repeats 3]
                               [--variants off,ensemble] [--cache-bytes 67108864]

Every server runs with `--cache-config local,size=<bytes>`; the variants differ only in their model configs
(temporary copies made by `tritonkit.repository.variants`, `model_repository/` is not touched): `off` = as committed,
`ensemble` = `response_cache { enable: true }` on text_embedding, `encoder` (optional) = the same on
text_encoder only. Traffic is perf_analyzer over gRPC at the given concurrency with a fixed request stream of real
texts (the `benchmark` split): `--unique` texts, plus repeats of texts sent at least `--min-gap` requests earlier,
so that `--repeat-rate` of all requests are repeats. Each run starts a fresh server (empty cache), warms it up
on other texts (the `demo` split), then sends the stream exactly once (`--request-count`), so the hit rate is the
stream's, not an artefact of perf_analyzer wrapping around its data. Variants are interleaved, median of repeats.
Reports texts/s, p50/p99, the cache hit rate from the statistics API and the ratio to `off`, and checks that a
cached response is byte-identical to the uncached one. Writes perf/results/cache-<time>.json and a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import build, data
from tritonkit.perf import stats
from tritonkit.perf.analyzer import PerfPoint, run_perf_analyzer, save_results, text_rows, write_input_data
from tritonkit.repository import variants as rv
from tritonkit.runtime.server import TritonServer

MODEL = "text_embedding"
VARIANTS = {
    "off": {},
    "ensemble": {"text_embedding": rv.response_cache()},
    "encoder": {"text_encoder": rv.response_cache()},
}


def repeat_stream(texts: list[str], repeat_rate: float, min_gap: int, seed: int = 0) -> list[str]:
    """All `texts` once, in order, with repeats of earlier ones mixed in: repeats / total == repeat_rate.

    A repeat copies a text whose first request lies at least `min_gap` requests earlier (so with perf_analyzer's
    concurrency below min_gap the first answer is in the cache before the repeat arrives); which earlier text is
    uniform over those eligible.
    """
    rng = random.Random(seed)
    total = round(len(texts) / (1.0 - repeat_rate))
    n_repeats = total - len(texts)
    # Repeat slots are drawn among positions that have min_gap first-time texts before them.
    slots = set(rng.sample(range(min_gap + 1, total), n_repeats))
    stream: list[str] = []
    firsts: list[int] = []  # stream positions of first-time texts, in order
    nxt = 0
    for pos in range(total):
        eligible = [p for p in firsts if p <= pos - min_gap] if pos in slots else []
        if eligible:
            stream.append(stream[rng.choice(eligible)])
        elif nxt < len(texts):
            firsts.append(pos)
            stream.append(texts[nxt])
            nxt += 1
        else:  # no first-time texts left: the remaining slots repeat
            stream.append(stream[rng.choice(firsts)])
    return stream


def embed_once(url: str, text: str) -> dict[str, np.ndarray]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    inp = grpcclient.InferInput("text", [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    result = client.infer(MODEL, [inp])
    client.close()
    return {name: result.as_numpy(name) for name in ("embedding", "num_tokens", "truncated")}


def run_variant(variant: str, repo: Path, args, stream_file: Path, warmup_file: Path, n_requests: int,
                probe_texts: list[str]) -> dict:
    server = TritonServer.on_free_ports(model_repository=repo, models=list(rv.TEXT_PIPELINE),
                                        extra_args=[f"--cache-config=local,size={args.cache_bytes}"])
    cached_model = next(iter(VARIANTS[variant]), MODEL)
    with server:
        run_perf_analyzer(MODEL, server.grpc_url, args.concurrency, warmup_file, protocol="grpc",
                          extra=["--request-count", str(args.warmup_requests)])
        read = lambda: stats.read(server.http_url, [cached_model])[cached_model]  # noqa: E731
        before = read()
        point = run_perf_analyzer(MODEL, server.grpc_url, args.concurrency, stream_file, protocol="grpc",
                                  label=variant, extra=["--request-count", str(n_requests)])
        spent = read() - before
        hits, misses = spent.cache_hit, spent.cache_miss
        # Correctness: each probe text twice in a row; the second answer comes from the cache when enabled.
        probes = []
        for text in probe_texts:
            s0 = read()
            first = embed_once(server.grpc_url, text)
            second = embed_once(server.grpc_url, text)
            probes.append({"first": first, "second": second, "hits": (read() - s0).cache_hit})
    return {
        "point": point,
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "probes": probes,
    }


def median_point(points: list[PerfPoint]) -> dict[str, float]:
    return {k: statistics.median(getattr(p, k) for p in points) for k in ("throughput", "p50_ms", "p90_ms", "p99_ms")}


def markdown(rows: list[tuple[str, dict]], base: float) -> str:
    lines = [
        "| response cache | texts/s | p50 ms | p99 ms | cache hit rate | × off |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    names = {"off": "off (as committed)", "ensemble": "on `text_embedding` (ensemble)",
             "encoder": "on `text_encoder` only"}
    for variant, m in rows:
        lines.append(f"| {names[variant]} | {m['throughput']:.1f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | "
                     f"{100 * m['hit_rate']:.1f} % | {m['throughput'] / base:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat-rate", type=float, default=0.3, help="share of requests that repeat a query")
    parser.add_argument("--unique", type=int, default=1400, help="distinct benchmark texts in the stream")
    parser.add_argument("--min-gap", type=int, default=64, help="a repeat follows its original by >= this")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="off,ensemble", help=f"comma-separated, of {','.join(VARIANTS)}")
    parser.add_argument("--cache-bytes", type=int, default=64 * 1024 * 1024, help="--cache-config local,size=")
    parser.add_argument("--warmup-requests", type=int, default=200)
    parser.add_argument("--probes", type=int, default=5, help="texts for the cached == uncached check")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if "off" not in variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants must include 'off' and name only {list(VARIANTS)}")

    build.build("text")
    texts = data.split("benchmark")[: args.unique]
    stream = repeat_stream(texts, args.repeat_rate, args.min_gap)
    repeats_in_stream = len(stream) - len(set(stream))
    tmp = Path(tempfile.mkdtemp(prefix="tritonkit-cache-"))
    stream_file = write_input_data(tmp / "stream.json", text_rows(stream))
    demo = data.split("demo")
    warmup_file = write_input_data(tmp / "warmup.json", text_rows(demo[: args.warmup_requests]))
    probe_texts = demo[-args.probes:]
    repos = {v: rv.make_variant(tmp / v, rv.TEXT_PIPELINE, VARIANTS[v]) for v in variants}
    print(f"stream: {len(stream)} requests, {repeats_in_stream} repeats ({100 * repeats_in_stream / len(stream):.1f} %)"
          f" of {len(texts)} distinct texts; concurrency {args.concurrency}", flush=True)

    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            res = run_variant(v, repos[v], args, stream_file, warmup_file, len(stream), probe_texts)
            runs[v].append(res)
            p = res["point"]
            print(f"  [{r + 1}/{args.repeats}] cache {v}: {p.throughput:.1f} texts/s p50 {p.p50_ms:.1f} ms "
                  f"p99 {p.p99_ms:.1f} ms, hit rate {100 * res['hit_rate']:.1f} % ({res['hits']} hits)", flush=True)

    # Correctness: the cached answer (second request) equals the first, computed answer, byte for byte, and both
    # equal what the server without a cache computes for the same text alone.
    checks = {}
    for v in variants:
        if v == "off":
            continue
        probes = runs[v][0]["probes"]
        uncached = runs["off"][0]["probes"]
        checks[v] = {
            "second_request_was_cache_hit": all(p["hits"] == 1 for p in probes),
            "cached_equals_first_response": all(
                np.array_equal(p["first"][k], p["second"][k]) for p in probes for k in p["first"]),
            "max_abs_diff_vs_cache_off_server": max(
                float(np.max(np.abs(p["second"]["embedding"] - u["first"]["embedding"])))
                for p, u in zip(probes, uncached)),
        }
        print(f"  check {v}: {checks[v]}")

    rows = []
    for v in variants:
        m = median_point([res["point"] for res in runs[v]])
        m["hit_rate"] = statistics.median(res["hit_rate"] for res in runs[v])
        rows.append((v, m))
    base = dict(rows)["off"]["throughput"]
    table = markdown(rows, base)
    print("\n" + table + "\n")
    save_results("cache", {
        "args": vars(args),
        "stream": {"requests": len(stream), "repeats": repeats_in_stream, "distinct": len(set(stream))},
        "median": dict(rows),
        "runs": {v: [{"point": res["point"].to_json(), "hits": res["hits"], "misses": res["misses"],
                      "hit_rate": res["hit_rate"]} for res in runs[v]] for v in variants},
        "checks": checks,
        "markdown": table,
    }, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
