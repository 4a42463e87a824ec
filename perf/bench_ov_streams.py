"""OpenVINO's own streams and async infer requests against what Triton does with two instances, in one process.

    python perf/bench_ov_streams.py [--model text_embedding] [--batches 8 32] [--repeats 5]

The INT8 encoder's packed file on its chosen OpenVINO variant (bf16 where chosen), batches of random benchmark
texts packed as the openvino backend packs them, all cores busy:
- streams: one compiled model, NUM_STREAMS = cores, one thread per stream, an AsyncInferQueue of `cores` requests;
- instances: `cores` compiled models of one thread each, each called from its own Python thread (two Triton
  instances of one thread: what the generated configs serve);
- one model, cores threads: one compiled model, one stream of `cores` threads, called sequentially (one instance).
Texts/s over the same batches, interleaved, median of the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

from tritonkit import data, envinfo, kinds
from tritonkit.repository import runtime_choice
from tritonkit.serving.backend_utils import usable_cpus


def main() -> None:
    import openvino as ov

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="text_embedding")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--calls", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kind = kinds.get(args.model)
    _, path, precision = runtime_choice.served_int8(kind)
    cores = usable_cpus()
    core = ov.Core()
    model = core.read_model(str(path))
    base = {"INFERENCE_PRECISION_HINT": precision, "ENABLE_CPU_PINNING": False}

    def compiled(streams: int, threads: int):
        return core.compile_model(model, "CPU", {**base, "NUM_STREAMS": streams, "INFERENCE_NUM_THREADS": threads})

    streams = compiled(cores, cores)
    singles = [compiled(1, 1) for _ in range(cores)]
    wide = compiled(1, cores)
    texts = data.split("benchmark")
    rng = np.random.default_rng(0)
    print(f"{path.name} on openvino {precision}, {cores} cores, {envinfo.cpu_model()}; texts/s, median of "
          f"{args.repeats} interleaved repeats")
    print("| batch | streams + async requests | one-thread models on threads (instances) | one model, "
          f"{cores} threads |\n|---:|---:|---:|---:|")
    for batch in args.batches:
        multiple = runtime_choice.width_multiple(kind, kind.INT8_MODEL)
        feeds = [kind.packed_feeds([texts[int(j)] for j in rng.choice(len(texts), batch, replace=False)],
                                   width_multiple=multiple) for _ in range(args.calls)]
        names = {p.get_any_name() for p in model.inputs}
        feeds = [{k: v for k, v in f.items() if k in names} for f in feeds]

        def run_streams(feeds=feeds) -> None:
            queue = ov.AsyncInferQueue(streams, cores)
            for f in feeds:
                queue.start_async(f)
            queue.wait_all()

        def run_instances(feeds=feeds) -> None:
            def work(i: int) -> None:
                request = singles[i].create_infer_request()
                for f in feeds[i::cores]:
                    request.infer(f)
            workers = [threading.Thread(target=work, args=(i,)) for i in range(cores)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()

        def run_wide(feeds=feeds) -> None:
            request = wide.create_infer_request()
            for f in feeds:
                request.infer(f)
        cases = {"streams": run_streams, "instances": run_instances, "wide": run_wide}
        for fn in cases.values():  # every shape once first, as a warm server has
            fn()
        rates: dict[str, list[float]] = {c: [] for c in cases}
        for _ in range(args.repeats):
            for case, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                rates[case].append(batch * len(feeds) / (time.perf_counter() - t0))
        print(f"| {batch} | " + " | ".join(f"{statistics.median(rates[c]):.0f}" for c in cases) + " |")


if __name__ == "__main__":
    main()
