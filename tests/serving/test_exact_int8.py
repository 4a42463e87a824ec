"""A served INT8 file computes exact integer arithmetic on every x86 class: the ONNX Runtime runner the stubs use
against int64 numpy arithmetic of the same quantized values, on a graph whose weights span the full ±127 and whose
activations fill the int8 range, so that a CPU summing u8s8 products in saturating int16 (AVX2, AVX-512BW) would
move its outputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tritonkit import envinfo
from tritonkit.serving import backend_utils, runtimes

K, N = 64, 16


def _qdq_matmul(tmp_path, rng):
    """Y = DQ(Q(X)) @ DQ(W_int8): symmetric int8 activations (the served form) and per-column int8 weights."""
    w = rng.integers(-127, 128, size=(K, N)).astype(np.int8)
    w[0] = 127  # every column reaches the full range
    w_scale = rng.uniform(0.01, 0.02, size=N).astype(np.float32)
    x_scale = np.float32(0.05)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zp"], ["wd"], axis=1),
        helper.make_node("MatMul", ["xd", "wd"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(x_scale), "x_scale"),
             numpy_helper.from_array(np.array(0, np.int8), "x_zp"),
             numpy_helper.from_array(w, "w"), numpy_helper.from_array(w_scale, "w_scale"),
             numpy_helper.from_array(np.zeros(N, np.int8), "w_zp")]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    path = tmp_path / "qdq.onnx"
    onnx.save(model, path)
    return path, w, w_scale, x_scale


@pytest.mark.parametrize("cpu_class", ["vnni", "avx512", "avx2"])
def test_served_int8_matmul_equals_exact_integer_arithmetic(tmp_path, monkeypatch, cpu_class):
    rng = np.random.default_rng(0)
    path, w, w_scale, x_scale = _qdq_matmul(tmp_path, rng)
    real = envinfo.int8_class()
    # The class decides the session options (faked here); the kernels are this machine's.
    monkeypatch.setattr(envinfo, "int8_class", lambda features=None: cpu_class)
    runner = runtimes.open_runner("onnxruntime", path, {"name": "qdq", "parameters": {}})
    try:
        entry = runner.options.get_session_config_entry(backend_utils.EXACT_INT8_ENTRY)
    except Exception:  # onnxruntime raises for a key never set
        entry = None
    assert entry == (None if cpu_class == "vnni" else "1")
    if cpu_class == "vnni" and real != "vnni":  # VNNI's plain session is exact by its kernels, which this CPU lacks
        pytest.skip(f"this CPU is INT8 class {real}: a plain session sums in saturating int16 pairs here")

    # Activations at the ends of the int8 range: pairs of products reach 2 * 127 * 127 (with the u8 shift of
    # onnxruntime's kernels, 2 * 255 * 127), past int16.
    x = (rng.choice([-127, 127, 126, -126], size=(32, K)) * x_scale).astype(np.float32)
    (got,), _ = runner.run(["y"], {"x": x}, len(x))
    xq = np.clip(np.rint(x / x_scale), -128, 127).astype(np.int64)
    exact = (xq @ w.astype(np.int64)).astype(np.float64) * float(x_scale) * w_scale.astype(np.float64)
    np.testing.assert_allclose(got, exact, rtol=2e-6, atol=1e-4)


def test_on_emulated_avx2_kernels_the_served_runner_sums_exactly_where_the_default_session_saturates(tmp_path):
    """The class's own kernels (MLAS dispatches on CPUID, which the emulator answers as an AVX2 CPU), not a faked
    class on this machine's: the default session's saturating int16 pair sums show the kernels are AVX2's. The
    emulated run (tritonkit.int8.emulated.run) checks the CPUID it sees and opens the stubs' runners."""
    from tritonkit.int8 import emulated

    why = emulated.unavailable()
    if why is not None:
        pytest.skip(f"no AVX2 CPU to emulate: {why}")
    rng = np.random.default_rng(0)
    path, w, w_scale, x_scale = _qdq_matmul(tmp_path, rng)
    x = (rng.choice([-127, 127, 126, -126], size=(32, K)) * x_scale).astype(np.float32)
    got = emulated.emulated_outputs(path, [{"x": x}], "avx2")
    xq = np.clip(np.rint(x / x_scale), -128, 127).astype(np.int64)
    exact = (xq @ w.astype(np.int64)).astype(np.float64) * float(x_scale) * w_scale.astype(np.float64)
    np.testing.assert_allclose(got["onnxruntime"], exact, rtol=2e-6, atol=1e-4)
    np.testing.assert_allclose(got[emulated.JUDGED_SESSION], exact, rtol=2e-6, atol=1e-4)  # what a search judges
    # Without the exact path the same kernels saturate: far from exact (so the check above could fail).
    assert np.abs(got[emulated.DEFAULT_SESSION] - exact).max() > 1.0


def test_an_emulated_run_refuses_a_cpu_that_is_not_the_class_asked_for(tmp_path):
    """/proc/cpuinfo is the host's under the emulator; CPUID is what the kernels see, and the run checks it."""
    from tritonkit.int8 import emulated

    other = "generic" if emulated.cpuid_class() != "generic" else "avx2"
    with pytest.raises(SystemExit, match=f"not {other}"):
        emulated.run(tmp_path, other)
