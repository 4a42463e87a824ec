"""make check-cpu-classes judges each INT8 file by the rule its arithmetic allows (tritonkit.int8.emulated): a file
with run-time quantized nodes by the kind's accuracy gates against the FP32 graph, a file with static int8 operands
by agreement with what it computes here. The class's outputs are this host's moved by a known amount (cosine
1/sqrt(1 + r^2) per row), so each verdict is checked against bounds the test sets, not ones the file reports."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tritonkit.int8 import emulated, granularity
from tritonkit.int8 import gates as int8_gates
from tritonkit.int8.evaluate import EXACT_COSINE, run_variant
from tritonkit.kinds.gates import Target

K, N = 64, 32
# How far the emulated class's rows are moved from this host's: inside the gates but off exact, and past the gates.
WITHIN, BEYOND = 0.03, 0.3


class Spec:
    """A kind over one MatMul: cosine gates the test sets (the text kind's metrics, on a 64-wide input)."""

    NAME = "matmul"
    SPEED_TARGET = Target("int8_speedup", ">=", 1.0)

    def __init__(self, cosine_min: float = 0.99, cosine_mean: float = 0.995):
        self.TARGETS = [Target("cosine_min", ">=", cosine_min), Target("cosine_mean", ">=", cosine_mean)]
        self.x = np.random.default_rng(1).standard_normal((256, K)).astype(np.float32)

    def eval_batches(self, split: str):
        return [{"x": self.x[i : i + 64]} for i in range(0, len(self.x), 64)]

    def gate_metrics(self, ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
        cos = (ref * got).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
        return {"cosine_min": float(cos.min()), "cosine_mean": float(cos.mean())}


def _save(model, path):
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(FP32, run-time quantized, static Q/DQ) graphs of the same MatMul."""
    tmp = tmp_path_factory.mktemp("emulated")
    w = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32) / 8
    io = ([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", K])],
          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", N])])

    def model(nodes, inits):
        graph = helper.make_graph(nodes, "matmul", *io, inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)

    fp32 = _save(model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                       [numpy_helper.from_array(w, "w")]), tmp / "fp32.onnx")
    nbits = _save(granularity.nbits(onnx.load(str(fp32)), ["mm"], 32), tmp / "nbits.onnx")
    w_scale = (np.abs(w).max(0) / 127).astype(np.float32)
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "w_scale", "w_zp"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["y"], name="mm")]
    inits = [numpy_helper.from_array(np.array(0.03, np.float32), "x_scale"),
             numpy_helper.from_array(np.array(0, np.int8), "x_zp"),
             numpy_helper.from_array(np.round(w / w_scale).astype(np.int8), "wq"),
             numpy_helper.from_array(w_scale, "w_scale"), numpy_helper.from_array(np.zeros(N, np.int8), "w_zp")]
    qdq = _save(model(nodes, inits), tmp / "qdq.onnx")
    return fp32, nbits, qdq


def moved(x: np.ndarray, r: float) -> np.ndarray:
    """`x` with each row moved by `r` of its norm at right angles to it: cosine 1/sqrt(1 + r^2) to `x`."""
    u = np.roll(x, 1, axis=1)
    u -= (u * x).sum(1, keepdims=True) / (x * x).sum(1, keepdims=True) * x
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    return (x + r * np.linalg.norm(x, axis=1, keepdims=True) * u).astype(np.float32)


def _check(monkeypatch, spec, path, fp32, r: float) -> dict:
    """check_model with the emulated class computing this host's served outputs moved by `r`."""
    def fake(model, batches, cpu_class):
        here = run_variant("onnxruntime", model, batches, emulated.THREADS)
        return {way: moved(here, r) for way in (*emulated.SERVED, emulated.DEFAULT_SESSION, emulated.JUDGED_SESSION)}

    monkeypatch.setattr(emulated, "emulated_outputs", fake)
    return emulated.check_model(spec, "avx2", 16, path=path, fp32=fp32, gates=int8_gates.absolute(spec, "served"))


def test_the_rule_follows_the_files_nodes(files):
    fp32, nbits, qdq = files
    assert emulated.runtime_quantized(nbits) == {"MatMulNBits": 1}
    assert emulated.runtime_quantized(qdq) == {}
    assert emulated.runtime_quantized(fp32) == {}


def test_a_run_time_quantized_file_that_differs_within_the_gates_passes(files, monkeypatch):
    fp32, nbits, _ = files
    spec = Spec()
    record = _check(monkeypatch, spec, nbits, fp32, WITHIN)
    assert record["rule"] == emulated.GATES and record["runtime_quantized"] == {"MatMulNBits": 1}
    served = record["ways"]["onnxruntime"]
    assert not served["exact"]  # the exact rule would have failed it
    assert served["cosine_min"] == pytest.approx(1 / np.sqrt(1 + WITHIN**2), abs=1e-5)
    assert served["cosine_min"] < EXACT_COSINE
    assert served["gates"]["metrics"]["cosine_min"] >= spec.TARGETS[0].value
    assert served["holds"] and served["gates"]["missed"] == []
    assert emulated.failed({"models": {"matmul": record}}) == []
    assert "| gates |" in emulated.table({"cpu_class": "avx2", "cpu_model": "EPYC-Rome", "host": "h", "date": "d",
                                          "models": {"matmul": record}})


def test_a_run_time_quantized_file_that_differs_beyond_the_gates_fails(files, monkeypatch):
    fp32, nbits, _ = files
    record = _check(monkeypatch, Spec(), nbits, fp32, BEYOND)
    served = record["ways"]["onnxruntime"]
    assert record["rule"] == emulated.GATES and not served["holds"]
    assert any(line.startswith("cosine_min") for line in served["gates"]["missed"])
    assert emulated.failed({"models": {"matmul": record}}) == ["matmul"]


def test_the_gates_are_the_kinds_own(files, monkeypatch):
    """The same difference fails once the kind's gate is tighter than it: the bound is read from the kind."""
    fp32, nbits, _ = files
    record = _check(monkeypatch, Spec(cosine_min=0.9999), nbits, fp32, WITHIN)
    assert record["here"]["cosine_min"] >= 0.9999  # the file itself holds the tighter gate here
    assert not record["ways"]["onnxruntime"]["holds"]


@pytest.mark.parametrize("r, holds", [(0.0, True), (WITHIN, False)])
def test_a_file_with_static_int8_operands_still_must_compute_what_it_computes_here(files, monkeypatch, r, holds):
    """The difference the gates allow a run-time quantized file fails a static one: its arithmetic is exact."""
    fp32, _, qdq = files
    record = _check(monkeypatch, Spec(), qdq, fp32, r)
    served = record["ways"]["onnxruntime"]
    assert record["rule"] == emulated.EXACT and "gates" not in served and "here" not in record
    assert served["holds"] is holds and served["exact"] is holds
    assert emulated.failed({"models": {"matmul": record}}) == ([] if holds else ["matmul"])


def test_a_gate_this_host_misses_on_the_rows_is_listed_not_charged_to_the_class():
    spec = Spec()
    gates = int8_gates.absolute(spec, "served")
    here = {"cosine_min": 0.98, "cosine_mean": 0.999}
    judged = emulated.judge_gates(gates, {"cosine_min": 0.97, "cosine_mean": 0.999}, here)
    assert judged["holds"] and judged["missed"] == [] and judged["missed_here_too"][0].startswith("cosine_min")
    judged = emulated.judge_gates(gates, {"cosine_min": 0.97, "cosine_mean": 0.99}, here)
    assert not judged["holds"] and judged["missed"][0].startswith("cosine_mean")


def test_a_file_quantized_only_at_run_time_is_checked_and_a_float_one_skipped(files, monkeypatch):
    from tritonkit import paths

    fp32, nbits, _ = files
    served = {}
    monkeypatch.setattr(paths, "model_file", lambda model, version=1: served[model])
    spec = Spec()
    spec.INT8_MODEL = "matmul_int8"
    served["matmul_int8"] = nbits  # no Q/DQ node at all: every int8 operand of its one MatMul is made at run time
    assert emulated.int8_file(spec) == nbits
    served["matmul_int8"] = fp32  # an FP32 fallback under the INT8 name
    assert emulated.int8_file(spec) is None
    assert "skipped" in emulated.check_model(spec, "avx2", 16)
