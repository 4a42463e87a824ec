"""A plan checked against ONNX Runtime (tritonkit.tensorrt.validation): feeds at every profile's maximum from real
inputs, tolerances from ONNX Runtime's own low-precision error, and failures that list the worst outputs."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.tiny_models import linear_model, ragged_model
from tritonkit import kinds
from tritonkit.errors import EngineError
from tritonkit.tensorrt import plans, validation
from tritonkit.tensorrt.plans import Profile


def test_onnx_dims_and_axis_maxima_from_real_feeds(tmp_path):
    path = ragged_model(tmp_path / "m.onnx")
    dims = plans.onnx_input_dims(path)
    assert dims == {"TOKENS": ["batch", "seq"]}
    feeds = [{"TOKENS": np.zeros((2, n), np.float32)} for n in (3, 40, 7)]
    assert validation.axis_maxima(feeds, dims) == {"seq": 40}


def test_check_diffs_lists_the_worst_outputs():
    ref = [{"Y": np.array([1.0, 2.0])}, {"Y": np.array([3.0, 4.0])}]
    got = [{"Y": np.array([1.0, 2.5])}, {"Y": np.array([3.0, 4.0001])}]
    diffs = validation.compare_outputs(ref, got, {"Y": (1e-3, 1e-3)})
    with pytest.raises(EngineError) as info:
        validation.check_diffs(diffs, "plan vs onnxruntime")
    assert "1 of 2" in str(info.value) and "Y sample 0: max|diff| 0.5" in str(info.value)


def test_validation_reaches_every_profile_maximum_with_real_text():
    spec = kinds.get("text")
    feeds = validation.validation_feeds(spec)
    dims = {name: ["batch", "sequence"] for name in spec.EXPORT.inputs}
    profiles = plans.profiles_for(dims, 64, plans.axis_limits(spec))
    extremes = validation.extreme_feeds(feeds, profiles)
    assert [f["input_ids"].shape for f in extremes] == [(64, spec.MAX_LENGTH)]
    longest = next(f for f in feeds if f["input_ids"].shape[1] == spec.MAX_LENGTH)
    assert np.array_equal(extremes[0]["input_ids"][: len(longest["input_ids"])], longest["input_ids"])
    for index, profile in enumerate(profiles):  # every profile gets the longest feed, and the short ones
        fitting = [f for f in feeds + extremes if validation.fits(profile, f)]
        assert max(f["input_ids"].shape for f in fitting) == (64, spec.MAX_LENGTH), index


def test_extreme_feeds_tile_rows_up_to_the_maximum_batch_and_refuse_short_grids():
    profile = Profile("throughput", {"x": ((1, 3), (32, 3), (64, 3))})
    feed = {"x": np.arange(17 * 3, dtype=np.float32).reshape(17, 3)}
    (tiled,) = validation.extreme_feeds([feed], [profile])
    assert tiled["x"].shape == (64, 3) and np.array_equal(tiled["x"][17:34], feed["x"])
    short = Profile("throughput_long", {"ids": ((1, 1), (16, 256), (64, 256))})
    with pytest.raises(EngineError, match="no validation feed reaches profile 'throughput_long'"):
        validation.extreme_feeds([{"ids": np.zeros((64, 32), np.int64)}], [short])


def test_tolerances_come_from_onnxruntime_low_precision_error(tmp_path):
    fp32 = linear_model(tmp_path / "fp32.onnx")
    fp16 = plans.fp16_cast(fp32, tmp_path / "fp16.onnx")
    feeds = [{"X": np.random.default_rng(i).random((4, 4), dtype=np.float32) * 10} for i in range(4)]
    (atol, _), = validation.derive_tolerances(fp32, fp16, feeds, ["Y"]).values()
    ref, low = validation.run_polygraphy([validation.ort_runner(fp32), validation.ort_runner(fp16)], feeds)
    observed = max(float(np.abs(r["Y"] - g["Y"]).max()) for r, g in zip(ref, low))
    assert observed > validation.TOLERANCE_FLOOR  # FP16 really rounded here
    assert atol == pytest.approx(validation.TOLERANCE_FACTOR * observed)
    # A candidate as close as ORT's FP16 form passes; one three times further off fails.
    validation.check_diffs(validation.compare_outputs(ref, low, {"Y": (atol, 0.0)}), "as close as fp16")
    worse = [{"Y": r["Y"] + 3 * (g["Y"] - r["Y"]) + np.sign(g["Y"] - r["Y"]) * atol} for r, g in zip(ref, low)]
    with pytest.raises(EngineError, match="out of tolerance"):
        validation.check_diffs(validation.compare_outputs(ref, worse, {"Y": (atol, 0.0)}), "worse")
