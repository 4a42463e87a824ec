"""openvino-tokenizers (the tokenizer as OpenVINO graph ops) against our `tokenizers` stub path, in one process.

    pip install openvino-tokenizers==2026.4.1.0   # matches the pinned openvino; not a project dependency
    python perf/bench_tokenizers.py [--model text_embedding] [--repeats 7]

Measured on the benchmark texts, calls of 1, 8 and 32 texts in arrival order, one thread (a served instance's):
- tokenize: HF `tokenizers` (encode_batch + pad, what the fused stub runs) vs the converted OpenVINO tokenizer
  (truncation at the spec's max_length); their ids must be equal first;
- for scale, text in, embedding out: `tokenizers` + the served INT8 encoder as the fused stub runs it (its packed
  graph on its chosen variant). Tokenizing is the whole gain folding the tokenizer into the graph could bring.
  (openvino_tokenizers.connect_models to our encoder did not run: the CPU plugin refuses the joined graph's
  ReadValue node.)
Prints CPU ms per text (process CPU time ÷ texts), median of interleaved repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from tritonkit import data, kinds, paths
from tritonkit.kinds.text import OUTPUT
from tritonkit.perf.analyzer import cpu_ms_per_item
from tritonkit.repository import runtime_choice


def main() -> None:
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="text_embedding")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    kind = kinds.get(args.model)
    texts = data.split("benchmark")
    hf = AutoTokenizer.from_pretrained(str(kind.model_dir()))
    ov_tok = convert_tokenizer(hf, max_length=kind.MAX_LENGTH, truncation=True)
    core = ov.Core()
    one_thread = {"INFERENCE_NUM_THREADS": "1", "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": "NO"}
    tok = core.compile_model(ov_tok, "CPU", one_thread)

    # Same ids first, or the timing compares different work.
    ours = kind.encode(texts[:256])
    theirs = tok(texts[:256])
    assert np.array_equal(ours["input_ids"], theirs["input_ids"]), "token ids differ"
    assert np.array_equal(ours["attention_mask"], theirs["attention_mask"]), "masks differ"

    variant = runtime_choice.variant_for(kind, kind.INT8_MODEL)
    path = paths.model_file(kind.INT8_MODEL)
    served = runtime_choice.served_file(path)
    stub = runtime_choice.open_variant(variant, served, 1)
    multiple = runtime_choice.width_multiple(kind, kind.INT8_MODEL)
    feed = (lambda b: kind.packed_feeds(b, width_multiple=multiple)) if served.name.endswith(".packed.onnx") \
        else kind.encode
    cases = {
        "tokenize: tokenizers + pad": kind.encode,
        "tokenize: openvino-tokenizers": lambda b: tok(b),
        f"text to embedding: tokenizers + {served.name} on {variant} (the fused stub)":
            lambda b: stub.run([OUTPUT], feed(b)),
    }
    rng = np.random.default_rng(0)
    print(f"{args.model}, CPU ms per text, one thread, median of {args.repeats} interleaved repeats")
    print("| case | " + " | ".join(f"calls of {b}" for b in (1, 8, 32)) + " |\n|---|---:|---:|---:|")
    results: dict[str, dict[int, list[float]]] = {c: {b: [] for b in (1, 8, 32)} for c in cases}
    calls = {b: [[texts[int(j)] for j in rng.choice(len(texts), b, replace=False)] for _ in range(16)]
             for b in (1, 8, 32)}
    for _ in range(args.repeats):
        for b in (1, 8, 32):
            for case, fn in cases.items():
                results[case][b].append(cpu_ms_per_item(fn, calls[b], seconds=0.5))
    for case, by_batch in results.items():
        print(f"| {case} | " + " | ".join(f"{statistics.median(v):.3f}" for v in by_batch.values()) + " |")


if __name__ == "__main__":
    main()
