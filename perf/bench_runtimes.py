"""What one call of the served encoder costs on each CPU runtime, with the shapes a server sees.

    python perf/bench_runtimes.py [--model text_embedding] [--batches 1 2 4 8] [--calls 300]

The INT8 encoder's packed file (what backends/* run), one thread, as onnxruntime, openvino (f32) and
openvino-bf16 (tritonkit.repository.runtime_choice.VARIANTS). For each batch size, `calls` packed batches of random
benchmark texts are run twice: "varied" (every call a new text mix, so a new input shape, as in a server) and "same"
(the first batch repeated, one shape), and "bucketed" (the varied batches packed as the openvino backend packs them:
row width a multiple of 16, power-of-two text counts), and for OpenVINO "static" (those bucketed batches with the
variant's static shapes compiled, as its backend does: tritonkit.serving.packing.StaticShapes). CPU ms per call
from process_time. OpenVINO prepares its kernels per input shape, so the gap between the first two columns is what
a server pays that a fixed-batch benchmark never sees, and the last two what buckets and static shapes win back.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tritonkit import data, envinfo, kinds, paths
from tritonkit.repository import runtime_choice
from tritonkit.serving import runtimes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="text_embedding")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    kind = kinds.get(args.model)
    path = runtime_choice.served_file(paths.MODEL_REPOSITORY / kind.INT8_MODEL / "1" / "model.onnx")
    texts = data.split("benchmark")
    rng = np.random.default_rng(0)
    print(f"{path.name}, 1 thread, {envinfo.cpu_model()}, {runtimes.versions()}")
    print("| variant | batch | varied shapes | one shape | varied, bucketed | bucketed, static shapes |\n"
          "|---|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        mixes = [[texts[j] for j in rng.choice(len(texts), batch, replace=False)] for _ in range(args.calls)]
        varied = [kind.packed_feeds(m) for m in mixes]
        bucketed = [kind.packed_feeds(m, width_multiple=16) for m in mixes]
        for variant in runtime_choice.VARIANTS:
            session = runtime_choice.open_variant(variant, path, 1)
            static = runtime_choice.open_variant(variant, path, 1, kind.spec.serving.max_batch_size) \
                if runtime_choice.VARIANTS[variant][0] == "openvino" else None
            cells = []
            for run, feeds in ((session, varied), (session, [varied[0]] * args.calls), (session, bucketed),
                               (static, bucketed)):
                if run is None:
                    cells.append("–")
                    continue
                for f in feeds[:3]:
                    run.run(["embedding"], f)
                t0 = time.process_time()
                for f in feeds:
                    run.run(["embedding"], f)
                cells.append(f"{(time.process_time() - t0) / len(feeds) * 1e3:.2f}")
            print(f"| {variant} | {batch} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
