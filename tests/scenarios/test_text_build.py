"""Text pipeline build: FP32 export matches sentence-transformers; INT8 forms are well formed (the gates themselves
are measured in tests/int8/test_recipe.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tests.support.text_support import ensure_text_built
from tritonkit import data, kinds
from tritonkit.export import ExportSample, ExportSpec, ExportValidationError, validate_onnx
from tritonkit.int8.checks import check_qdq, quantized_ops

minilm = kinds.get("text_embedding")


@pytest.fixture(scope="module")
def built():
    return ensure_text_built()


def test_splits_are_disjoint_real_text():
    calibration, evaluation = set(data.split("calibration")), set(data.split("evaluation"))
    assert len(calibration) == 1000 and len(evaluation) == 2000
    assert not calibration & evaluation
    assert not set(data.split("validation")) & (calibration | evaluation)


@pytest.mark.slow
def test_fp32_export_matches_sentence_transformers_on_a_grid(built):
    # A fresh grid (other sentences than the build used): batch 1/5/17 × lengths 16/256.
    grid, start = [], 600
    for seq in (16, 256):
        for batch in (1, 5, 17):
            grid.append({"batch": batch, "seq": seq, "start": start})
            start += batch
    spec = ExportSpec(**{**minilm.EXPORT.__dict__, "validation_grid": grid})
    result = validate_onnx(spec, built.fp32, progress=False)
    assert result.failures == 0 and result.summary["min"] >= 0.9999
    assert result.samples == sum(p["batch"] for p in grid)


@pytest.mark.slow
def test_validation_raises_typed_error_listing_worst_cases(built):
    # A reference that is wrong for two rows must produce ExportValidationError naming exactly those rows.
    def reference(sample: ExportSample) -> np.ndarray:
        out = minilm._reference(sample)
        out[[1, 3]] = np.roll(out[[1, 3]], 7, axis=1)
        return out

    spec = ExportSpec(**{**minilm.EXPORT.__dict__, "validation_grid": [{"batch": 6, "seq": 32, "start": 0}],
                         "reference": reference})
    with pytest.raises(ExportValidationError) as info:
        validate_onnx(spec, built.fp32, progress=False)
    assert sorted(c.row for c in info.value.failures) == [1, 3]
    assert "2 of 6 samples miss cosine >= 0.9999" in str(info.value)


@pytest.mark.slow
def test_int8_forms_are_what_their_recipes_say(built):
    """TensorRT form: symmetric INT8, zero points 0, per-channel weights. Served form: the searched recipe's.
    A form whose search found nothing is the FP32 graph byte for byte (never a failed INT8 model)."""

    from tests.support.int8_support import assert_fp32_fallback, fell_back
    from tritonkit.int8 import recipe, search

    recipes = recipe.load_recipes(minilm)
    served = recipes["served"].recipe
    if fell_back(minilm, "tensorrt"):
        assert_fp32_fallback(built.trt_int8, built.fp32)
    else:
        trt = onnx.load(str(built.trt_int8))
        counts = check_qdq(trt, "int8", per_channel=True)  # raises on a non-INT8 or non-zero zero point
        assert counts["QuantizeLinear"] > 0
        zero_points = [i for i in trt.graph.initializer if i.name.endswith("_zero_point")]
        assert zero_points and all(i.data_type == onnx.TensorProto.INT8 for i in zero_points)
    if fell_back(minilm):
        assert_fp32_fallback(built.int8, built.fp32)
        return
    model = onnx.load(str(built.int8))
    check_qdq(model, served["form"], per_channel=True)
    assert quantized_ops(built.int8).get("MatMul", 0) > 0
    # The units the search kept in float read float tensors; every other MatMul reads dequantized ones.
    dq = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    matmuls = {n.name: any(i in dq for i in n.input) for n in model.graph.node if n.op_type == "MatMul"}
    dynamic = set((served.get("dynamic") or {}).get("nodes", ()))  # rewritten to quantize at run time
    kept = set(served["float_nodes"]) - dynamic
    assert kept <= set(matmuls), kept - set(matmuls)
    assert not dynamic & set(matmuls), dynamic & set(matmuls)
    if dynamic:
        from tritonkit.int8.granularity import BLOCKS

        op = "MatMulNBits" if served["dynamic"]["scheme"] in BLOCKS else "MatMulInteger"
        assert sum(n.op_type == op for n in model.graph.node) >= len(dynamic)
    assert not any(matmuls[n] for n in kept) and all(q for n, q in matmuls.items() if n not in kept)
    assert search.Recipe.from_json(served).to_quant(minilm.WEIGHT_OPS).activation_type == served["form"]
