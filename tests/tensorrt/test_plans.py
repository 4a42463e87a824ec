"""Plans tied to the server that loads them: target release, builder version, profiles from the tokenizer's
length, validation feeds at every profile's maximum, tolerances from ONNX Runtime's own low-precision error, one
build per compute capability. Runs without TensorRT or a GPU; the build itself is in test_engines' gpu tests."""

from __future__ import annotations

import re
from typing import ClassVar

import numpy as np
import pytest

from tests.support.tiny_models import linear_model
from tritonkit import kinds, paths, release
from tritonkit.repository.config import DynamicBatching, ModelSpec, Tensor
from tritonkit.tensorrt import engines
from tritonkit.tensorrt.engines import EngineError, Environment, Gpu, Profile

H100 = Gpu(0, "NVIDIA H100", (9, 0), "GPU-11111111-2222-3333-4444-555555555555")
TARGET = release.ServerTarget("24.10", "2.51.0", "10.5.0")


def test_target_server_is_one_setting(monkeypatch):
    monkeypatch.delenv("TRITONKIT_NGC_RELEASE", raising=False)
    monkeypatch.delenv("TRITONKIT_TENSORRT", raising=False)
    assert release.target_server() == TARGET
    assert TARGET.image == "nvcr.io/nvidia/tritonserver:24.10-py3"
    monkeypatch.setenv("TRITONKIT_NGC_RELEASE", "99.01")
    with pytest.raises(EngineError, match="set TRITONKIT_TENSORRT"):
        release.target_server()
    monkeypatch.setenv("TRITONKIT_TENSORRT", "11.0.0")
    assert release.target_server().tensorrt == "11.0.0"


def test_builder_must_be_the_servers_tensorrt():
    release.check_builder("10.5.0.18", TARGET)  # build number beyond major.minor.patch does not matter
    for other in ("10.8.0", "10.5.1", "11.0.0"):
        with pytest.raises(EngineError, match=re.escape("build inside nvcr.io/nvidia/tritonserver:24.10-py3")):
            release.check_builder(other, TARGET)
    with pytest.raises(EngineError, match=re.escape("built by TensorRT 11.0.0")):
        release.check_plan_metadata({"tensorrt": "11.0.0"}, TARGET, "x.plan")


def test_build_refuses_a_foreign_tensorrt_before_building():
    if not (paths.MODEL_REPOSITORY / "text_encoder" / "1" / "model.onnx").exists():
        pytest.skip("`make build` has not produced text_encoder/1/model.onnx yet")
    steps = engines.build_model_engines(kinds.get("text"), Environment("10.8.0", (H100,)), target=TARGET)
    assert [s.status for s in steps] == ["failed", "failed"]
    assert all("NGC 24.10 runs 10.5.0" in s.detail for s in steps)


def test_text_profiles_cover_every_length_the_tokenizer_emits():
    spec = kinds.get("text")
    limits = engines.axis_limits(spec)
    assert limits == {"sequence": spec.MAX_LENGTH}
    dims = {name: ["batch", "sequence"] for name in spec.EXPORT.inputs}
    for profile in engines.profiles_for(dims, 64, limits):
        for lo, _, hi in profile.shapes.values():
            assert lo == (1, 1) and hi == (64, spec.MAX_LENGTH), profile.name


def test_a_spec_without_a_length_limit_is_refused():
    class Spec:
        NAME = "x"

        class EXPORT:
            inputs: ClassVar = {"ids": {0: "batch", 1: "sequence"}}

    with pytest.raises(EngineError, match="no MAX_LENGTH"):
        engines.axis_limits(Spec)


def test_validation_reaches_every_profile_maximum_with_real_text():
    spec = kinds.get("text")
    feeds = engines.validation_feeds(spec)
    dims = {name: ["batch", "sequence"] for name in spec.EXPORT.inputs}
    profiles = engines.profiles_for(dims, 64, engines.axis_limits(spec))
    extremes = engines.extreme_feeds(feeds, profiles)
    assert [f["input_ids"].shape for f in extremes] == [(64, spec.MAX_LENGTH)]
    longest = next(f for f in feeds if f["input_ids"].shape[1] == spec.MAX_LENGTH)
    assert np.array_equal(extremes[0]["input_ids"][: len(longest["input_ids"])], longest["input_ids"])
    for index, profile in enumerate(profiles):  # every profile gets the longest feed, and the short ones
        fitting = [f for f in feeds + extremes if engines.fits(profile, f)]
        assert max(f["input_ids"].shape for f in fitting) == (64, spec.MAX_LENGTH), index


def test_extreme_feeds_tile_rows_up_to_the_maximum_batch_and_refuse_short_grids():
    profile = Profile("throughput", {"x": ((1, 3), (32, 3), (64, 3))})
    feed = {"x": np.arange(17 * 3, dtype=np.float32).reshape(17, 3)}
    (tiled,) = engines.extreme_feeds([feed], [profile])
    assert tiled["x"].shape == (64, 3) and np.array_equal(tiled["x"][17:34], feed["x"])
    short = Profile("throughput_long", {"ids": ((1, 1), (16, 256), (64, 256))})
    with pytest.raises(EngineError, match="no validation feed reaches profile 'throughput_long'"):
        engines.extreme_feeds([{"ids": np.zeros((64, 32), np.int64)}], [short])


def test_tolerances_come_from_onnxruntime_low_precision_error(tmp_path):
    fp32 = linear_model(tmp_path / "fp32.onnx")
    fp16 = engines.fp16_cast(fp32, tmp_path / "fp16.onnx")
    feeds = [{"X": np.random.default_rng(i).random((4, 4), dtype=np.float32) * 10} for i in range(4)]
    (atol, _), = engines.derive_tolerances(fp32, fp16, feeds, ["Y"]).values()
    ref, low = engines.run_polygraphy([engines.ort_runner(fp32), engines.ort_runner(fp16)], feeds)
    observed = max(float(np.abs(r["Y"] - g["Y"]).max()) for r, g in zip(ref, low))
    assert observed > engines.TOLERANCE_FLOOR  # FP16 really rounded here
    assert atol == pytest.approx(engines.TOLERANCE_FACTOR * observed)
    # A candidate as close as ORT's FP16 form passes; one three times further off fails.
    engines.check_diffs(engines.compare_outputs(ref, low, {"Y": (atol, 0.0)}), "as close as fp16")
    worse = [{"Y": r["Y"] + 3 * (g["Y"] - r["Y"]) + np.sign(g["Y"] - r["Y"]) * atol} for r, g in zip(ref, low)]
    with pytest.raises(EngineError, match="out of tolerance"):
        engines.check_diffs(engines.compare_outputs(ref, worse, {"Y": (atol, 0.0)}), "worse")


def test_one_build_per_compute_capability_on_a_device_of_it():
    l4, a10 = Gpu(1, "NVIDIA L4", (8, 9)), Gpu(2, "NVIDIA A10", (8, 6), "GPU-aaaaaaaa-0000-0000-0000-000000000000")
    second_h100 = Gpu(3, "NVIDIA H100", (9, 0))
    devices, missing = engines.plan_devices([H100, l4, second_h100, a10])
    assert devices == [a10, l4, H100] and missing == []
    devices, missing = engines.plan_devices([H100], wanted=["9.0", "8.6", "12.0"])
    assert devices == [H100] and missing == ["12.0", "8.6"]
    env = engines.device_env(a10, {"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == a10.uuid and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert engines.device_env(l4, {})["CUDA_VISIBLE_DEVICES"] == "1"


def test_trt_config_carries_its_label_file(tmp_path):
    src = tmp_path / "src"
    ModelSpec(name="cls", backend="onnxruntime", max_batch_size=8,
              inputs=[Tensor("x", "FP32", [3])], outputs=[Tensor("p", "FP32", [2], label_filename="labels.txt")],
              dynamic_batching=DynamicBatching()).write(src)
    cfg = engines.trt_model_config(src / "cls", "int8", {"9.0": "model_sm90.plan"})
    with pytest.raises(EngineError, match=re.escape("label_filename 'labels.txt' has no file")):
        engines.write_config(cfg, tmp_path / "out", source_dir=src / "cls")
    (src / "cls" / "labels.txt").write_text("a\nb\n")
    path = engines.write_config(cfg, tmp_path / "out", source_dir=src / "cls")
    assert (path.parent / "labels.txt").read_text() == "a\nb\n"
