"""What a plan is built from and how (tritonkit.tensorrt.plans): the precision recipe per TensorRT version,
profiles by use case sized from the tokenizer's length, file and model names, and the FP16-cast graph. Runs
without TensorRT or a GPU; the build itself is in test_engines' gpu tests."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

from tests.support.tiny_models import linear_model
from tritonkit import kinds
from tritonkit.errors import EngineError
from tritonkit.tensorrt import plans, validation
from tritonkit.tensorrt.environment import Gpu
from tritonkit.tensorrt.plans import Profile

H100 = Gpu(0, "NVIDIA H100", (9, 0))


@pytest.mark.parametrize(
    "version, precision, source, strongly_typed, flags",
    [
        ("10.5.0", "int8", "int8_qdq", False, ("INT8", "FP16")),
        ("10.13.2", "fp16", "fp32", False, ("FP16",)),
        ("11.0.0", "int8", "int8_qdq", True, ()),
        ("11.3.0", "fp16", "fp16_cast", True, ()),
    ],
)
def test_version_dispatch(version, precision, source, strongly_typed, flags):
    recipe = plans.recipe_for(version, precision)
    assert (recipe.onnx_source, recipe.strongly_typed, recipe.builder_flags) == (source, strongly_typed, flags)


def test_version_dispatch_rejects_old_tensorrt_and_unknown_precision():
    with pytest.raises(EngineError, match="not supported"):
        plans.recipe_for("8.6.1", "int8")
    with pytest.raises(EngineError, match="unknown precision"):
        plans.recipe_for("10.5.0", "int4")


def _check_profile(profile: Profile):
    for lo, opt, hi in profile.shapes.values():
        assert len(lo) == len(opt) == len(hi)
        assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), profile


def test_text_profiles_by_batch_and_sequence_length():
    dims = {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
    profiles = plans.profiles_for(dims, max_batch_size=64, axis_max={"sequence": 256})
    assert [p.name for p in profiles] == ["low_latency", "throughput_short", "throughput_long"]
    for p in profiles:
        _check_profile(p)
        assert p.shapes["input_ids"] == p.shapes["attention_mask"]
        lo, _, hi = p.shapes["input_ids"]
        assert lo == (1, 1) and hi == (64, 256)  # every profile accepts every request
    opts = {p.name: p.shapes["input_ids"][1] for p in profiles}
    assert opts == {"low_latency": (1, 64), "throughput_short": (64, 64), "throughput_long": (16, 256)}


def test_image_profiles_by_batch_only():
    profiles = plans.profiles_for({"pixel_values": ["batch", 3, 224, 224]}, 32, {})
    assert [p.name for p in profiles] == ["low_latency", "throughput"]
    assert profiles[0].shapes["pixel_values"] == ((1, 3, 224, 224), (1, 3, 224, 224), (32, 3, 224, 224))
    assert profiles[1].shapes["pixel_values"][1] == (32, 3, 224, 224)


def test_profile_needs_a_maximum_for_every_dynamic_axis():
    with pytest.raises(EngineError, match="'sequence' has no maximum"):
        plans.profiles_for({"ids": ["batch", "sequence"]}, 8, {})


def test_text_profiles_cover_every_length_the_tokenizer_emits():
    spec = kinds.get("text")
    limits = plans.axis_limits(spec)
    assert limits == {"sequence": spec.MAX_LENGTH}
    dims = {name: ["batch", "sequence"] for name in spec.EXPORT.inputs}
    for profile in plans.profiles_for(dims, 64, limits):
        for lo, _, hi in profile.shapes.values():
            assert lo == (1, 1) and hi == (64, spec.MAX_LENGTH), profile.name


def test_a_spec_without_a_length_limit_is_refused():
    class Spec:
        NAME = "x"

        class EXPORT:
            inputs: ClassVar = {"ids": {0: "batch", 1: "sequence"}}

    with pytest.raises(EngineError, match="no MAX_LENGTH"):
        plans.axis_limits(Spec)


def test_plan_file_naming():
    assert plans.plan_filename(H100) == "model_sm90.plan"
    assert plans.plan_filename((8, 6)) == "model_sm86.plan"
    assert plans.trt_model_name("text_encoder", "int8") == "text_encoder_trt_int8"
    assert plans.trt_model_name("text_encoder_fp32", "fp16") == "text_encoder_trt_fp16"


def test_fp16_cast_keeps_fp32_io_and_close_outputs(tmp_path):
    src = linear_model(tmp_path / "fp32.onnx")
    dst = plans.fp16_cast(src, tmp_path / "fp16.onnx")
    import onnx

    assert onnx.load(str(dst)).graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    feeds = [{"X": np.random.default_rng(i).random((4, 4), dtype=np.float32)} for i in range(3)]
    runners = [validation.ort_runner(src, "fp32"), validation.ort_runner(dst, "fp16")]
    ref, got = validation.run_polygraphy(runners, feeds)
    diffs = validation.compare_outputs(ref, got, {"Y": (1e-2, 1e-2)})
    validation.check_diffs(diffs, "fp16 cast")
    assert 0 < diffs[0].max_abs < 1e-2  # FP16 really happened, and it stayed close
