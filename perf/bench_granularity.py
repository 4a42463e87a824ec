"""What the served INT8 file's float MatMuls (the recipe's `+N float` with constant weights) would give at a finer
activation granularity that ONNX Runtime runs in INT8, on this CPU's class (issue 60, item 1: which granularity,
on which runtime, is chosen by measurement).

    python perf/bench_granularity.py [text_embedding] [--groups 4 12] [--repeats 5]

Rewrites, each with per-channel symmetric INT8 weights, activations quantized at run time:
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

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tritonkit import envinfo, kinds
from tritonkit.int8 import evaluate
from tritonkit.perf.baselines import onnx_file

TIMED_BATCHES = 6


def float_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    weights = {i.name for i in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]


def nbits(src: Path, out: Path, block: int = 32) -> int:
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    model = onnx.load(str(src))
    names = [n.name for n in float_matmuls(model)]
    quantizer = MatMulNBitsQuantizer(model, nodes_to_include=names, algo_config=DefaultWeightOnlyQuantConfig(
        block_size=block, is_symmetric=True, accuracy_level=4, bits=8))
    quantizer.process()
    quantizer.model.save_model_to_file(str(out), use_external_data_format=False)
    return len(names)


def per_tensor(src: Path, out: Path) -> int:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    names = [n.name for n in float_matmuls(onnx.load(str(src)))]
    quantize_dynamic(str(src), str(out), nodes_to_quantize=names, weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul"], extra_options={"MatMulConstBOnly": True})
    return len(names)


def grouped(src: Path, out: Path, groups: int) -> int:
    """Each float MatMul as per-row x `groups` dynamic u8 activations (groups=1: per token)."""
    model = onnx.load(str(src))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    targets = {n.name for n in float_matmuls(model) if nh.to_array(inits[n.input[1]]).shape[0] % groups == 0}
    nodes, added = [], []

    def const(name: str, value) -> str:
        added.append(nh.from_array(np.asarray(value), name))
        return name

    for n in graph.node:
        if n.name not in targets:
            nodes.append(n)
            continue
        w = nh.to_array(inits[n.input[1]]).astype(np.float32)
        k, cols = w.shape[0] // groups, w.shape[1]
        w_scale = np.maximum(np.abs(w).max(0), 1e-12) / 127.0
        wq = np.clip(np.round(w / w_scale), -127, 127).astype(np.int8).reshape(groups, k, cols)
        p = n.name.replace("/", "_") + "_g"
        x = n.input[0]
        lo, hi, zero, top = p + "lo", p + "hi", const(p + "0", np.float32(0)), const(p + "255", np.float32(255))
        nodes += [
            oh.make_node("Shape", [x], [p + "shape"]),
            oh.make_node("Reshape", [x, const(p + "rows", np.array([-1, groups, k], np.int64))], [p + "x3"]),
            oh.make_node("Transpose", [p + "x3"], [p + "xg"], perm=[1, 0, 2]),  # [G, rows, k]
            oh.make_node("ReduceMin", [p + "xg"], [p + "min"], axes=[-1], keepdims=1),
            oh.make_node("ReduceMax", [p + "xg"], [p + "max"], axes=[-1], keepdims=1),
            oh.make_node("Min", [p + "min", zero], [lo]),
            oh.make_node("Max", [p + "max", zero], [hi]),
            oh.make_node("Sub", [hi, lo], [p + "range"]),
            oh.make_node("Div", [p + "range", top], [p + "s0"]),
            oh.make_node("Max", [p + "s0", const(p + "eps", np.float32(1e-12))], [p + "s"]),
            oh.make_node("Div", [lo, p + "s"], [p + "lo_s"]),
            oh.make_node("Neg", [p + "lo_s"], [p + "zp0"]),
            oh.make_node("Round", [p + "zp0"], [p + "zp"]),
            oh.make_node("Div", [p + "xg", p + "s"], [p + "xs"]),
            oh.make_node("Round", [p + "xs"], [p + "xr"]),
            oh.make_node("Add", [p + "xr", p + "zp"], [p + "xz"]),
            oh.make_node("Clip", [p + "xz", zero, top], [p + "xc"]),
            oh.make_node("Cast", [p + "xc"], [p + "q"], to=TensorProto.UINT8),
            # The session's exact-int8 rewrite expects both zero points as inputs.
            oh.make_node("MatMulInteger", [p + "q", const(p + "wq", wq), const(p + "azp", np.uint8(0)),
                                           const(p + "bzp", np.int8(0))], [p + "acc"]),
            oh.make_node("Cast", [p + "acc"], [p + "accf"], to=TensorProto.FLOAT),
            oh.make_node("Mul", [p + "zp", const(p + "colsum", wq.astype(np.float32).sum(1)[:, None, :])],
                         [p + "corr"]),
            oh.make_node("Sub", [p + "accf", p + "corr"], [p + "d"]),
            oh.make_node("Mul", [p + "d", p + "s"], [p + "ds"]),
            oh.make_node("ReduceSum", [p + "ds", const(p + "g_axis", np.array([0], np.int64))], [p + "sum"],
                         keepdims=0),
            oh.make_node("Mul", [p + "sum", const(p + "w_scale", w_scale.astype(np.float32))], [p + "y"]),
            oh.make_node("Slice", [p + "shape", const(p + "first", np.array([0], np.int64)),
                                   const(p + "last", np.array([-1], np.int64))], [p + "lead"]),  # all but K
            oh.make_node("Concat", [p + "lead", const(p + "cols", np.array([cols], np.int64))], [p + "out_shape"],
                         axis=0),
            oh.make_node("Reshape", [p + "y", p + "out_shape"], [n.output[0]]),
        ]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(added)
    onnx.save(model, str(out))
    return len(targets)


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
        n = nbits(int8, out / "nbits.onnx")
        files[f"{n} as MatMulNBits 8-bit, blocks of 32"] = out / "nbits.onnx"
        for g in (1, *args.groups):
            n = grouped(int8, out / f"g{g}.onnx", g)
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
