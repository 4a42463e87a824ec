"""Where the served INT8 encoder's time goes inside OpenVINO: time per executed layer type, from its own counters.

    python perf/bench_ov_layers.py [--model text_embedding] [--batches 6 32] [--calls 100]

The INT8 model's packed file on its chosen OpenVINO variant (bf16 where chosen), one thread (one Triton instance),
`PERF_COUNT` on; batches of random benchmark texts packed as the openvino backend packs them. Per batch size: share
and microseconds per call of each (layer type, kernel) pair, summed over the calls after one warm-up pass. The
kernel names say the precision a layer ran in: `brgemm_avx512_I8` is an INT8 FullyConnected, `..._bf16` a float one
(a MatMul the INT8 recipe keeps in float). Runs on the dynamic-shape model, so widths the server runs on static
shapes cost a little more here.
"""

from __future__ import annotations

import argparse
import collections

import numpy as np

from tritonkit import data, envinfo, kinds
from tritonkit.repository import runtime_choice


def main() -> None:
    import openvino as ov

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="text_embedding")
    parser.add_argument("--batches", type=int, nargs="+", default=[6, 32])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    kind = kinds.get(args.model)
    variant, path, precision = runtime_choice.served_int8(kind)
    core = ov.Core()
    model = core.read_model(str(path))
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": 1,
                                                 "NUM_STREAMS": 1, "PERF_COUNT": True, "ENABLE_CPU_PINNING": False})
    request = compiled.create_infer_request()
    names = {p.get_any_name() for p in model.inputs}
    texts = data.split("benchmark")
    rng = np.random.default_rng(0)
    multiple = runtime_choice.width_multiple(kind, kind.INT8_MODEL)
    print(f"{path.name} on openvino {precision} ({variant}), 1 thread, {envinfo.cpu_model()}")
    for batch in args.batches:
        feeds = []
        for _ in range(args.calls):
            picked = [texts[int(j)] for j in rng.choice(len(texts), batch, replace=False)]
            feeds.append({k: v for k, v in kind.packed_feeds(picked, width_multiple=multiple).items() if k in names})
        for f in feeds:  # every shape once, as a warm server has
            request.infer(f)
        spent: collections.Counter = collections.Counter()
        for f in feeds:
            request.infer(f)
            for layer in request.profiling_info:
                spent[(layer.node_type, layer.exec_type)] += layer.real_time.total_seconds() * 1e6
        total = sum(spent.values())
        print(f"\nbatch {batch} ({total / args.calls:.0f} us per call)\n| layer type | kernel | share | us per call |"
              "\n|---|---|---:|---:|")
        for (node_type, exec_type), us in spent.most_common(args.top):
            print(f"| {node_type} | {exec_type} | {us / total:.1%} | {us / args.calls:.0f} |")


if __name__ == "__main__":
    main()
