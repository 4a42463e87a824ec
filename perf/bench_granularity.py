"""What the served INT8 file's float MatMuls (the recipe's `+N float` with constant weights) would give at a finer
activation granularity that ONNX Runtime runs in INT8, on this CPU's class (issue 60, item 1: which granularity,
on which runtime, is chosen by measurement).

    python perf/bench_granularity.py [text_embedding] [--groups 4 12] [--repeats 5]

Rewrites (tritonkit.int8.granularity's, which the served search tries; here on every such MatMul at once), each
with per-channel symmetric INT8 weights, activations quantized at run time:
- `MatMulNBits` 8-bit, blocks of 32 (onnxruntime's blockwise quantizer, accuracy_level 4: int8 compute per block);
- per token (row) u8, and per token x G groups along K: `MatMulInteger` over [G, rows, K/G], scales per row and
  group, zero points folded out through the weights' column sums (so the weights stay exact under the served
  session's `session.x64quantprecision`);
- per tensor (onnxruntime's `quantize_dynamic`).
Prints the kind's gate metrics against FP32 on the validation split and the time of the first six padded batches on
one thread, in sessions summing int8 exactly as served ones do (median of interleaved repeats). Writes nothing into
the repository.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tritonkit import envinfo, kinds
from tritonkit.int8 import evaluate, granularity
from tritonkit.perf.baselines import onnx_file

TIMED_BATCHES = 6


def rewrite(src: Path, out: Path, how) -> int:
    """`src` with its float MatMuls that `how(model, nodes)` can take rewritten; how many it took."""
    model = onnx.load(str(src))
    names = granularity.weighted_matmuls(model)
    onnx.save(how(model, names), str(out))
    return len(names) - len(granularity.weighted_matmuls(onnx.load(str(out))))


def per_tensor(src: Path, out: Path) -> int:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    names = granularity.weighted_matmuls(onnx.load(str(src)))
    quantize_dynamic(str(src), str(out), nodes_to_quantize=names, weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul"], extra_options={"MatMulConstBOnly": True})
    return len(names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="text_embedding")
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kind = kinds.get(args.model)
    int8 = onnx_file(args.model, "int8")
    files = {"FP32": onnx_file(args.model, "fp32"), "INT8 as served": int8}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        n = rewrite(int8, out / "nbits.onnx", granularity.nbits)
        files[f"{n} as MatMulNBits 8-bit, blocks of 32"] = out / "nbits.onnx"
        for g in (1, *args.groups):
            n = rewrite(int8, out / f"g{g}.onnx", lambda m, _names, g=g: granularity.token_groups(
                m, granularity.weighted_matmuls(m, multiple_of=g), g))
            files[f"{n} per token" + (f" x {g} groups" if g > 1 else "")] = out / f"g{g}.onnx"
        n = per_tensor(int8, out / "tensor.onnx")
        files[f"{n} per tensor"] = out / "tensor.onnx"
        batches = kind.eval_batches("validation")
        outputs = {name: evaluate.run_batches(evaluate.session(onnx.load(str(p)), 2, exact=True), batches)
                   for name, p in files.items()}
        sessions = {name: evaluate.session(onnx.load(str(p)), 1, exact=True) for name, p in files.items()}
        times: dict[str, list[float]] = {name: [] for name in files}
        for _ in range(args.repeats):
            for name, sess in sessions.items():
                started = time.perf_counter()
                evaluate.run_batches(sess, batches[:TIMED_BATCHES])
                times[name].append(time.perf_counter() - started)
    metrics = [t.metric for t in kind.TARGETS]
    print(f"{args.model}, validation split, INT8 class {envinfo.int8_class()}, exact int8 sums, one thread\n")
    print("| float MatMuls of the INT8 file | " + " | ".join(metrics) + " | ms | × FP32 | × INT8 as served |")
    print("|---|" + "---:|" * (len(metrics) + 3))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, got in outputs.items():
        values = kind.gate_metrics(outputs["FP32"], got)
        print(f"| {name} | " + " | ".join(f"{values[m]:.4f}" for m in metrics)
              + f" | {ms[name]:.0f} | {ms['FP32'] / ms[name]:.2f} | {ms['INT8 as served'] / ms[name]:.2f} |")
    print("\nabsolute gates: " + ", ".join(f"{t.metric} {t.op} {t.value}" for t in kind.TARGETS))


if __name__ == "__main__":
    main()
