"""Benchmark: interactive latency under bulk load, with and without scheduler priority levels (text_embedding).

    python perf/bench_priority.py [--repeats 3] [--seconds 15] [--bulk-concurrency 16] [--bulk-texts 16]
                                  [--interactive-rate 5]

Starts two servers on free loopback ports over temporary copies of the text pipeline (`tritonkit.repository.variants`;
`model_repository/` is not touched): A with the configs as committed, B with `priority_levels: 2
default_priority_level: 2` in the dynamic_batching of the composing models (tokenizer, text_encoder). Against
each, a Python load generator (tritonclient.grpc) runs two traffic classes at once:
  bulk         N closed-loop threads, each sending K real texts per request (the `benchmark` split) through the
               ensemble with no priority (= the lowest level on B), enough to keep the encoder's queue deep;
  interactive  one short real text per request, open loop at a fixed rate, priority 1 (the highest level).
The interactive requests take one of two paths: through the `text_embedding` ensemble, or straight to the
composing models (client calls tokenizer, then text_encoder, both with priority 1). The ensemble path shows
whether the client's priority reaches the composing models' schedulers; the direct path shows what priority does
when it does. A reference row runs the interactive traffic alone. Scenarios are interleaved, median of repeats.
Prints interactive p50/p99, bulk texts/s; writes perf/results/priority-<time>.json and a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import build, data
from tritonkit.perf.analyzer import save_results
from tritonkit.perf.load import percentile
from tritonkit.repository import variants as rv
from tritonkit.runtime.server import TritonServer

MODEL = "text_embedding"
# (label, server variant, interactive path, bulk load on?)
SCENARIOS = [
    ("A committed, interactive alone", "A", "ensemble", False),
    ("A committed", "A", "ensemble", True),
    ("B priority_levels", "B", "ensemble", True),
    ("A committed", "A", "direct", True),
    ("B priority_levels", "B", "direct", True),
]


def _text_input(texts: list[str]):
    import tritonclient.grpc as grpcclient

    inp = grpcclient.InferInput("text", [len(texts), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    return inp


def _interactive_call(client, text: str, path: str, priority: int) -> None:
    """One interactive text: through the ensemble, or tokenizer → text_encoder called by the client."""
    import tritonclient.grpc as grpcclient

    if path == "ensemble":
        client.infer(MODEL, [_text_input([text])], priority=priority,
                     outputs=[grpcclient.InferRequestedOutput("embedding")])
        return
    tok = client.infer("tokenizer", [_text_input([text])], priority=priority)
    feeds = []
    for name in ("input_ids", "attention_mask"):
        array = tok.as_numpy(name)
        feed = grpcclient.InferInput(name, list(array.shape), "INT64")
        feed.set_data_from_numpy(array)
        feeds.append(feed)
    client.infer("text_encoder", feeds, priority=priority)


def run_scenario(url: str, path: str, bulk: bool, args, bulk_texts: list[str], short_texts: list[str],
                 seed: int) -> dict:
    """Bulk closed loop (optional) + interactive open loop for args.seconds; latencies of interactive requests."""
    import tritonclient.grpc as grpcclient

    stop = threading.Event()
    window = {"start": float("inf"), "end": float("inf")}
    bulk_done: list[tuple[float, int, float]] = []  # (completion time, texts, latency)
    errors: list[str] = []
    lock = threading.Lock()

    def bulk_worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        client = grpcclient.InferenceServerClient(url)
        out = [grpcclient.InferRequestedOutput("embedding")]
        while not stop.is_set():
            texts = rng.sample(bulk_texts, args.bulk_texts)
            t0 = time.perf_counter()
            try:
                client.infer(MODEL, [_text_input(texts)], outputs=out, priority=args.bulk_priority)
            except Exception as err:  # keep loading; count it
                with lock:
                    errors.append(f"bulk: {err}")
                continue
            with lock:
                bulk_done.append((time.perf_counter(), len(texts), time.perf_counter() - t0))
        client.close()

    workers = [threading.Thread(target=bulk_worker, args=(i,), daemon=True)
               for i in range(args.bulk_concurrency if bulk else 0)]
    for w in workers:
        w.start()
    time.sleep(args.warmup_seconds if bulk else 0.5)

    rng = random.Random(seed)
    clients = [grpcclient.InferenceServerClient(url) for _ in range(args.interactive_threads)]
    free = list(clients)
    latencies: list[float] = []

    def interactive(text: str, scheduled: float) -> None:
        with lock:
            client = free.pop()
        try:
            _interactive_call(client, text, path, priority=1)
            with lock:
                latencies.append(time.perf_counter() - scheduled)
        except Exception as err:
            with lock:
                errors.append(f"interactive: {err}")
        finally:
            with lock:
                free.append(client)

    window["start"] = time.perf_counter()
    window["end"] = window["start"] + args.seconds
    with ThreadPoolExecutor(max_workers=args.interactive_threads) as pool:
        next_at = window["start"]
        while next_at < window["end"]:
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(interactive, rng.choice(short_texts), next_at)  # latency counted from the scheduled time
            next_at += rng.expovariate(args.interactive_rate)  # Poisson arrivals
    # the pool waits for interactive requests still in flight (bulk keeps loading meanwhile)
    stop.set()
    for w in workers:
        w.join()
    for c in clients:
        c.close()
    lat_ms = sorted(x * 1e3 for x in latencies)
    in_window = [(n, lat) for t, n, lat in bulk_done if window["start"] <= t < window["end"]]
    bulk_ms = sorted(lat * 1e3 for _, lat in in_window)
    bulk_p50, interactive_p50 = percentile(bulk_ms, 50), percentile(lat_ms, 50)
    return {
        "interactive_requests": len(lat_ms),
        "interactive_p50_ms": interactive_p50,
        "interactive_p90_ms": percentile(lat_ms, 90),
        "interactive_p99_ms": percentile(lat_ms, 99),
        "interactive_max_ms": lat_ms[-1] if lat_ms else float("nan"),
        "bulk_texts_per_s": sum(n for n, _ in in_window) / args.seconds,
        "bulk_p50_ms": bulk_p50,
        # Machine-speed-free view: interactive p50 in units of a bulk request's p50 (same queue, FIFO: ~1).
        "interactive_over_bulk_p50": interactive_p50 / bulk_p50 if bulk_ms else float("nan"),
        "errors": errors[:5],
        "error_count": len(errors),
    }


def median_of(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["repeats"] = len(runs)
    out["error_count"] = sum(r["error_count"] for r in runs)
    return out


def markdown(rows: list[tuple[str, str, bool, dict]]) -> str:
    lines = [
        "| server config | interactive path | bulk load | interactive p50 ms | interactive p99 ms | bulk texts/s "
        "| bulk request p50 ms | interactive p50 / bulk p50 |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, path, bulk, m in rows:
        path_txt = "ensemble" if path == "ensemble" else "direct (tokenizer → text_encoder)"
        bulk_txt = "yes" if bulk else "none"
        bulk_cols = (f"{m['bulk_texts_per_s']:.0f} | {m['bulk_p50_ms']:.0f} | {m['interactive_over_bulk_p50']:.2f}"
                     if bulk else " | | ")
        lines.append(f"| {label} | {path_txt} | {bulk_txt} | {m['interactive_p50_ms']:.0f} | "
                     f"{m['interactive_p99_ms']:.0f} | {bulk_cols} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0, help="measurement window per scenario")
    parser.add_argument("--warmup-seconds", type=float, default=4.0, help="bulk load before measuring")
    parser.add_argument("--bulk-concurrency", type=int, default=16)
    parser.add_argument("--bulk-texts", type=int, default=16, help="texts per bulk request")
    parser.add_argument("--bulk-priority", type=int, default=0, help="0 = the model's default level")
    parser.add_argument("--interactive-rate", type=float, default=5.0, help="interactive requests/s (Poisson)")
    parser.add_argument("--interactive-threads", type=int, default=64, help="max interactive requests in flight")
    parser.add_argument("--short-chars", type=int, default=80, help="interactive texts are at most this long")
    parser.add_argument("--no-direct", action="store_true", help="skip the direct-path scenarios")
    args = parser.parse_args(argv)

    build.build("text")
    texts = data.split("benchmark")
    short = [t for t in texts if len(t) <= args.short_chars]
    scenarios = [s for s in SCENARIOS if not (args.no_direct and s[2] == "direct")]
    tmp = Path(tempfile.mkdtemp(prefix="tritonkit-priority-"))
    repos = {
        "A": rv.make_variant(tmp / "A", rv.TEXT_PIPELINE),
        "B": rv.make_variant(tmp / "B", rv.TEXT_PIPELINE,
                             {m: rv.priority_levels(2) for m in ("tokenizer", "text_encoder")}),
    }
    servers = {k: TritonServer.on_free_ports(model_repository=repo, models=list(rv.TEXT_PIPELINE))
               for k, repo in repos.items()}
    runs: dict[int, list[dict]] = {i: [] for i in range(len(scenarios))}
    try:
        for name, server in servers.items():
            print(f"starting tritonserver {name} over {server.model_repository} ...", flush=True)
            server.start()
        for r in range(args.repeats):
            for i, (label, variant, path, bulk) in enumerate(scenarios):
                m = run_scenario(servers[variant].grpc_url, path, bulk, args, texts, short, seed=r * 100 + i)
                runs[i].append(m)
                print(f"  [{r + 1}/{args.repeats}] {label}, {path}, bulk {'on' if bulk else 'off'}: interactive "
                      f"p50 {m['interactive_p50_ms']:.0f} ms p99 {m['interactive_p99_ms']:.0f} ms "
                      f"(n={m['interactive_requests']}), bulk {m['bulk_texts_per_s']:.0f} texts/s, "
                      f"bulk p50 {m['bulk_p50_ms']:.0f} ms"
                      + (f", {m['error_count']} errors: {m['errors'][0]}" if m["error_count"] else ""), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    rows = [(label, path, bulk, median_of(runs[i])) for i, (label, _, path, bulk) in enumerate(scenarios)]
    table = markdown(rows)
    print("\n" + table + "\n")
    save_results("priority", {
        "args": vars(args),
        "variant_B_edit": "tokenizer, text_encoder: dynamic_batching { priority_levels: 2 default_priority_level: 2 }",
        "scenarios": [
            {"label": label, "variant": variant, "path": path, "bulk": bulk, "median": median_of(runs[i]),
             "runs": runs[i]}
            for i, (label, variant, path, bulk) in enumerate(scenarios)
        ],
        "markdown": table,
    }, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
