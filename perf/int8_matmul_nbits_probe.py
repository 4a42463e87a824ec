"""Could the MatMuls an INT8 recipe keeps in float run as onnxruntime's blockwise weight-only MatMulNBits instead?

    python perf/int8_matmul_nbits_probe.py text_embedding [--bits 8 4] [--block 32] [--repeats 5]

Takes the served INT8 model as built (its recipe's float MatMuls with constant weights), rewrites exactly those
with onnxruntime's MatMulNBitsQuantizer (symmetric, `--block` weights per scale, accuracy_level 4: activations
quantized per block at run time, int8 compute), and prints, for FP32, the INT8 model as served and each rewrite:
the spec's gate metrics against FP32 on the validation split, and the time of the validation split's first six
padded batches on one ORT thread (median of interleaved repeats). Nothing is written into the repository.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from tritonkit import kinds
from tritonkit.perf.baselines import onnx_file

TIMED_BATCHES = 6


def rewrite(int8_path: Path, bits: int, block: int, out: Path) -> int:
    """The INT8 model with its float constant-weight MatMuls as MatMulNBits; returns how many were rewritten."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    model = onnx.load(str(int8_path))
    weights = {i.name for i in model.graph.initializer}
    floats = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    quantizer = MatMulNBitsQuantizer(model, nodes_to_include=floats, algo_config=DefaultWeightOnlyQuantConfig(
        block_size=block, is_symmetric=True, accuracy_level=4, bits=bits))
    quantizer.process()
    quantizer.model.save_model_to_file(str(out), use_external_data_format=False)
    return sum(n.op_type == "MatMulNBits" for n in onnx.load(str(out)).graph.node)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="text_embedding")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import onnxruntime as ort

    kind = kinds.get(args.model)
    batches = kind.eval_batches("validation")
    with tempfile.TemporaryDirectory() as tmp:
        files = {"FP32": onnx_file(args.model, "fp32"), "INT8 as served": onnx_file(args.model, "int8")}
        for bits in args.bits:
            out = Path(tmp) / f"nbits{bits}.onnx"
            count = rewrite(files["INT8 as served"], bits, args.block, out)
            files[f"INT8, {count} float MatMuls as MatMulNBits {bits}-bit"] = out
        outputs = {name: np.concatenate([kind.session(path, threads=2).run(None, b)[0] for b in batches])
                   for name, path in files.items()}
        sessions = {name: kind.session(path, threads=1) for name, path in files.items()}
        times: dict[str, list[float]] = {name: [] for name in files}
        for _ in range(args.repeats):
            for name, session in sessions.items():
                start = time.perf_counter()
                for b in batches[:TIMED_BATCHES]:
                    session.run(None, b)
                times[name].append(time.perf_counter() - start)
    print(f"{args.model}, validation split ({len(outputs['FP32'])} texts), block {args.block}; {platform.machine()}, "
          f"onnxruntime {ort.__version__}\n")
    metrics = [t.metric for t in kind.TARGETS]
    print("| model | " + " | ".join(metrics) + " | ms, 1 thread | × FP32 |\n|---|" + "---:|" * (len(metrics) + 2))
    fp32_ms = statistics.median(times["FP32"])
    for name, got in outputs.items():
        values = kind.gate_metrics(outputs["FP32"], got)
        ms = statistics.median(times[name])
        print(f"| {name} | " + " | ".join(f"{values[m]:.4f}" for m in metrics) + f" | {ms * 1e3:.0f} | "
              f"{fp32_ms / ms:.2f} |")
    print("gates: " + ", ".join(f"{t.metric} {t.op} {t.value}" for t in kind.TARGETS))


if __name__ == "__main__":
    main()
