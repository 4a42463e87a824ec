"""tritonkit.perf.layers on a small real graph: each kernel the runtime's profiler reports lands in its group."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tritonkit.int8 import granularity
from tritonkit.perf import layers

K = 128  # a multiple of every MatMulNBits scheme's block


def _model() -> onnx.ModelProto:
    """x [rows, K] -> a float-weight MatMul ("float") -> a Q/DQ INT8 MatMul ("int8") -> h;
    h x h^T ("scores", an activation product) -> Softmax -> y."""
    rng = np.random.default_rng(0)
    w_float = rng.normal(size=(K, K)).astype(np.float32)
    w_int8 = rng.integers(-127, 128, size=(K, K)).astype(np.int8)
    inits = [
        numpy_helper.from_array(w_float, "w_float"),
        numpy_helper.from_array(w_int8, "w_q"),
        numpy_helper.from_array(np.full(K, 0.01, np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(K, np.int8), "w_zp"),
        numpy_helper.from_array(np.float32(0.05), "x_scale"),
        numpy_helper.from_array(np.uint8(128), "x_zp"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w_float"], ["a"], name="float"),
        helper.make_node("QuantizeLinear", ["a", "x_scale", "x_zp"], ["a_q"], name="a_quant"),
        helper.make_node("DequantizeLinear", ["a_q", "x_scale", "x_zp"], ["a_dq"], name="a_dequant"),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_dq"], axis=1, name="w_dequant"),
        helper.make_node("MatMul", ["a_dq", "w_dq"], ["h"], name="int8"),
        helper.make_node("Transpose", ["h"], ["h_t"], perm=[1, 0], name="transpose"),
        helper.make_node("MatMul", ["h", "h_t"], ["s"], name="scores"),
        helper.make_node("Softmax", ["s"], ["y"], axis=-1, name="softmax"),
    ]
    graph = helper.make_graph(nodes, "layers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", "rows"])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _feeds(rows: int = 32) -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(rows, K)).astype(np.float32)} for _ in range(2)]


def _groups(prof: layers.Profile) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for t in prof.layers:
        out.setdefault(t.group, set()).add(t.name)
    return out


def test_weighted_nodes_follow_constant_weights_through_dequantize():
    assert layers.weighted_nodes(_model()) == {"float", "int8"}
    # Attention: the activation product, its Softmax and what reads them (OpenVINO names a fused block after it).
    assert layers.attention_nodes(_model()) == {"scores", "softmax"}


def test_onnxruntime_profile_puts_each_node_in_its_group(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(_model(), str(path))
    prof = layers.profile(path, "onnxruntime", _feeds(), calls=8)
    groups = _groups(prof)
    assert "float" in groups[layers.FLOAT_LINEAR]
    assert "scores" in groups[layers.ATTENTION] and "softmax" in groups[layers.ATTENTION]
    assert groups[layers.INT8_LINEAR] & {"int8", "a_quant", "a_dequant"}  # onnxruntime fuses Q/DQ into its kernel
    assert not groups.get(layers.RUNTIME_INT8)
    assert prof.us_per_call == pytest.approx(sum(prof.by_group().values()))
    assert all(t.us > 0 for t in prof.layers)


@pytest.mark.parametrize("scheme", granularity.SCHEMES)
def test_a_run_time_scheme_counts_its_helpers_as_its_own_cost(tmp_path, scheme):
    model = granularity.apply(_model(), scheme, ["float"])
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    prof = layers.median([layers.profile(path, "onnxruntime", _feeds(), calls=4) for _ in range(2)])
    groups = _groups(prof)
    assert "float" in groups[layers.RUNTIME_INT8]
    assert not groups.get(layers.FLOAT_LINEAR)
    # Every kernel of the rewrite is under the node it rewrote: none lands in "other".
    assert not [n for n in groups.get(layers.OTHER, ()) if n.startswith("float")]
    if scheme == granularity.TOKEN_GROUPS:
        assert len(groups[layers.RUNTIME_INT8]) > 5  # the per-token ranges, the zero-point fold and the rest
    assert prof.calls == 8


def test_openvino_profile_names_float_and_attention_layers(tmp_path):
    pytest.importorskip("openvino")
    path = tmp_path / "model.onnx"
    onnx.save(_model(), str(path))
    prof = layers.profile(path, "openvino", _feeds(), calls=4)
    by_type = {t.op.split("/")[0]: t.group for t in prof.layers}
    assert by_type.get("Softmax") == layers.ATTENTION
    assert by_type.get("FullyConnected") in (layers.FLOAT_LINEAR, layers.INT8_LINEAR)
    assert layers.FLOAT_LINEAR in {t.group for t in prof.layers}  # the float-weight MatMul
    assert prof.us_per_call > 0


def test_kernel_names_say_openvino_precision():
    assert layers.ov_group("FullyConnected", "brgemm_avx512_amx_I8") == layers.INT8_LINEAR
    assert layers.ov_group("FullyConnected", "brgemm_avx512_bf16") == layers.FLOAT_LINEAR
    assert layers.ov_group("Convolution", "jit_avx2_u8") == layers.INT8_LINEAR
    assert layers.ov_group("MatMul", "brgemm_avx512_bf16") == layers.ATTENTION
    assert layers.ov_group("Eltwise", "jit_avx2_FP32") == layers.OTHER
    # A Snippets block named after an attention node is attention; a weighted layer keeps its precision's group.
    assert layers.ov_group("Subgraph", "jit_avx2_f32") == layers.OTHER
    assert layers.ov_group("Subgraph", "jit_avx2_f32", attention=True) == layers.ATTENTION
    assert layers.ov_group("FullyConnected", "jit_gemm_I8", attention=True) == layers.INT8_LINEAR
    # A MatMulNBits node: INT8 math where the kernel quantizes activations, else INT8 weights in float math.
    assert layers.ov_group("FullyConnectedCompressed", "brgemm_avx512_amx_I8") == layers.RUNTIME_INT8
    assert layers.ov_group("FullyConnectedCompressed", "brgemm_avx512_bf16", attention=True) == layers.WEIGHT_ONLY
    # On a VNNI CPU the plugin quantizes its activations at run time under a kernel named for its input precision.
    assert layers.ov_group("FullyConnectedCompressed", "brgemm_avx512_bf16", run_time_int8=True) == \
        layers.RUNTIME_INT8


def test_openvino_counts_a_matmul_nbits_node_as_int8_weights_not_other(tmp_path):
    """OpenVINO runs a MatMulNBits node as FullyConnectedCompressed: INT8 math where the plugin quantizes its
    activations at run time (a VNNI CPU), else INT8 weights in float math; either way not "other"."""
    pytest.importorskip("openvino")
    path = tmp_path / "model.onnx"
    onnx.save(granularity.apply(_model(), granularity.NBITS, ["float"]), str(path))
    prof = layers.profile(path, "openvino", _feeds(), calls=4)
    compressed = [t for t in prof.layers if t.op.startswith("FullyConnectedCompressed/")]
    assert compressed, [t.op for t in prof.layers]
    from tritonkit import envinfo

    want = layers.RUNTIME_INT8 if envinfo.openvino_quantizes_at_run_time() else layers.WEIGHT_ONLY
    assert {t.group for t in compressed} == {want}
    assert not [t for t in prof.layers if t.group == layers.FLOAT_LINEAR]  # the only float MatMul was rewritten
