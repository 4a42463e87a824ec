"""What the in-process INT8 "ceiling" depends on: arrival order and batch size, for a spec's built text encoder.

    python perf/bench_ceiling.py [--model text_embedding] [--seconds 4] [--repeats 3]

The perf lab's ceiling (tritonkit.perf.baselines.onnx_text) sorts the whole benchmark set by token count before
batching, so padding is nearly zero. An online server sees texts in arrival order and only the requests in flight
(16 at c=16), so this times our own INT8 ONNX in ONNX Runtime, in-process (tokenize + pad + run per batch), on
the same texts both ways: sorted across the set, and in one fixed random order; at the batch sizes and thread
counts a served encoder instance runs with; and, in arrival order, packed end to end without padding through the
built packed graph (tritonkit.serving.packing), as the served encoder runs: in balanced rows ("packed") and in rows
filled to 128 tokens ("packed, full rows", before balancing). Configurations are interleaved, the median of the
repeats printed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import data, kinds
from tritonkit.perf import baselines
from tritonkit.serving import packing

FULL_ROWS = "packed, full rows"
# (intra-op threads, batch, order): the lab's ceiling first, then what a served instance can see.
CONFIGS = [(2, 32, "sorted"), (2, 32, "arrival"), (2, 16, "arrival"), (2, 8, "arrival"), (1, 8, "arrival"),
           (1, 4, "arrival"), (2, 32, "packed"), (2, 16, "packed"), (1, 16, "packed"), (1, 8, "packed"),
           (1, 4, "packed"), (1, 16, FULL_ROWS), (1, 8, FULL_ROWS), (1, 4, FULL_ROWS)]


def rate(kind, sessions, texts, lengths, threads: int, batch: int, order: str, seconds: float) -> float:
    ordered = sorted(texts, key=lengths.get) if order == "sorted" else random.Random(0).sample(texts, len(texts))
    batches = [ordered[i : i + batch] for i in range(0, len(ordered) - batch + 1, batch)]
    packed = order.startswith("packed")
    sess = sessions[threads, packed]
    feed = (lambda b: kind.packed_feeds(b, order != FULL_ROWS)) if packed else kind.encode
    for b in batches[:3]:
        sess.run([kind.OUTPUT], feed(b))
    n, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sess.run([kind.OUTPUT], feed(batches[i % len(batches)]))
        n, i = n + batch, i + 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="text_embedding")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    kind = kinds.get(args.model)
    texts = data.split("benchmark")
    tok = kind.load_tokenizer()
    lengths = {t: len(tok.encode(t).ids) for t in texts}
    path = baselines.onnx_file(args.model, "int8")
    sessions = {(t, packed): kind.session(packing.packed_path(path) if packed else path, threads=t)
                for t, _, order in CONFIGS for packed in (order.startswith("packed"),)}
    runs: dict[tuple, list[float]] = {c: [] for c in CONFIGS}
    for _ in range(args.repeats):
        for c in CONFIGS:
            runs[c].append(rate(kind, sessions, texts, lengths, *c, args.seconds))
    print(f"{args.model} INT8 in-process, {len(texts)} benchmark texts (mean {statistics.mean(lengths.values()):.1f}"
          f" tokens), median of {args.repeats} interleaved repeats of {args.seconds:g} s, {os.cpu_count()} cores")
    print("| threads | batch | order | texts/s |\n|---:|---:|---|---:|")
    for (threads, batch, order), values in runs.items():
        print(f"| {threads} | {batch} | {order} | {statistics.median(values):.0f} |")


if __name__ == "__main__":
    main()
