"""Text pipeline build: FP32 export matches sentence-transformers, INT8 is TensorRT-style Q/DQ and meets its report."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from text_support import ensure_text_built, int8_report

from tritonkit import data
from tritonkit.export import ExportSample, ExportSpec, ExportValidationError, validate_onnx
from tritonkit.models import minilm
from tritonkit.quantize import check_qdq, quantized_ops


@pytest.fixture(scope="module")
def built():
    return ensure_text_built()


def test_splits_are_disjoint_real_text():
    calibration, evaluation = set(data.split("calibration")), set(data.split("evaluation"))
    assert len(calibration) == 1000 and len(evaluation) == 2000
    assert not calibration & evaluation
    assert not set(data.split("validation")) & (calibration | evaluation)


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


def test_int8_is_symmetric_qdq_with_zero_zero_points(built):
    model = onnx.load(str(built.int8))
    counts = check_qdq(model)  # raises on a non-INT8 or non-zero zero point
    assert counts["QuantizeLinear"] > 0
    # 35 of 36 weight MatMuls, Q/K/V merged into one node per layer: 23 MatMul nodes.
    assert quantized_ops(built.int8).get("MatMul", 0) >= 20
    zero_points = [i for i in model.graph.initializer if i.name.endswith("_zero_point")]
    assert zero_points and all(i.data_type == onnx.TensorProto.INT8 for i in zero_points)


def test_int8_report_and_fresh_measurement_agree(built):
    report = int8_report()
    metrics = report["metrics"]
    for key in ("cosine_min", "cosine_p1", "cosine_mean", "top10_overlap_mean"):
        assert key in metrics
    assert report["passed"] == (metrics["cosine_min"] >= 0.99 and metrics["cosine_mean"] >= 0.995)
    assert report["recipe"]["rationale"]
    # Re-measure on part of the evaluation split: the report's numbers must describe the installed model.
    texts = minilm.evaluation_texts()[:300]
    ref = minilm.embed_onnx(minilm.session(built.fp32), texts)
    got = minilm.embed_onnx(minilm.session(built.int8), texts)
    cos = (ref * got).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
    assert cos.min() >= metrics["cosine_min"] - 1e-4
    assert abs(cos.mean() - metrics["cosine_mean"]) < 0.005
