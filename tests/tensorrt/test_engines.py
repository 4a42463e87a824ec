"""TensorRT engine machinery: everything that needs no GPU runs here; `gpu` tests skip with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from tests.support.tiny_models import linear_model, ragged_model
from tritonkit import kinds, paths
from tritonkit.repository.config import (
    DynamicBatching,
    EnsembleStep,
    ModelSpec,
    Tensor,
    load_config,
    validate_repository,
)
from tritonkit.repository.native_check import embedded_models
from tritonkit.tensorrt import engines
from tritonkit.tensorrt.engines import EngineError, Environment, Gpu, Profile, Step

H100 = Gpu(0, "NVIDIA H100", (9, 0))


def test_skip_reason_names_what_is_missing():
    assert "import tensorrt" in Environment(None, (H100,)).skip_reason
    assert "no CUDA GPU" in Environment("10.5.0", ()).skip_reason
    both = Environment(None, ()).skip_reason
    assert "tensorrt" in both and "GPU" in both
    assert "older than 10" in Environment("8.6.1", (H100,)).skip_reason
    assert Environment("10.5.0", (H100,)).skip_reason is None
    assert Environment("11.0.1", (H100,)).skip_reason is None


def _this_machine() -> tuple[str | None, int]:
    """(TensorRT version, GPU count) found without tritonkit.tensorrt.engines: the installed distribution's metadata and
    nvidia-smi (or the device nodes where there is none), so a broken detect() cannot vouch for itself."""
    import importlib.metadata
    import shutil

    names = ("tensorrt", "tensorrt-cu11", "tensorrt-cu12", "tensorrt-cu13")
    trt = next((d.version for d in importlib.metadata.distributions() if (d.metadata["Name"] or "").lower() in names),
               None)
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        gpus = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    else:
        gpus = len([d for d in Path("/dev").glob("nvidia[0-9]*")])
    return trt, gpus


def test_detect_is_consistent_with_this_machine():
    trt, gpus = _this_machine()
    env = engines.detect()
    assert len(env.gpus) == gpus, (env.gpus, gpus)
    assert (env.trt_version is None) == (trt is None), (env.trt_version, trt)
    if trt is not None:
        assert env.trt_version.split(".")[:2] == trt.split(".")[:2]
    # The `gpu` tests skip exactly when detect() gives a reason (conftest): it must not give one here if both exist.
    runnable = trt is not None and gpus > 0 and int(trt.split(".")[0]) >= 10
    assert (env.skip_reason is None) == runnable, env.skip_reason


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
    recipe = engines.recipe_for(version, precision)
    assert (recipe.onnx_source, recipe.strongly_typed, recipe.builder_flags) == (source, strongly_typed, flags)


def test_version_dispatch_rejects_old_tensorrt_and_unknown_precision():
    with pytest.raises(EngineError, match="not supported"):
        engines.recipe_for("8.6.1", "int8")
    with pytest.raises(EngineError, match="unknown precision"):
        engines.recipe_for("10.5.0", "int4")


def _check_profile(profile: Profile):
    for lo, opt, hi in profile.shapes.values():
        assert len(lo) == len(opt) == len(hi)
        assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), profile


def test_text_profiles_by_batch_and_sequence_length():
    dims = {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
    profiles = engines.profiles_for(dims, max_batch_size=64, axis_max={"sequence": 256})
    assert [p.name for p in profiles] == ["low_latency", "throughput_short", "throughput_long"]
    for p in profiles:
        _check_profile(p)
        assert p.shapes["input_ids"] == p.shapes["attention_mask"]
        lo, _, hi = p.shapes["input_ids"]
        assert lo == (1, 1) and hi == (64, 256)  # every profile accepts every request
    opts = {p.name: p.shapes["input_ids"][1] for p in profiles}
    assert opts == {"low_latency": (1, 64), "throughput_short": (64, 64), "throughput_long": (16, 256)}


def test_image_profiles_by_batch_only():
    profiles = engines.profiles_for({"pixel_values": ["batch", 3, 224, 224]}, 32, {})
    assert [p.name for p in profiles] == ["low_latency", "throughput"]
    assert profiles[0].shapes["pixel_values"] == ((1, 3, 224, 224), (1, 3, 224, 224), (32, 3, 224, 224))
    assert profiles[1].shapes["pixel_values"][1] == (32, 3, 224, 224)


def test_profile_needs_a_maximum_for_every_dynamic_axis():
    with pytest.raises(EngineError, match="'sequence' has no maximum"):
        engines.profiles_for({"ids": ["batch", "sequence"]}, 8, {})


def test_onnx_dims_and_axis_maxima_from_real_feeds(tmp_path):
    path = ragged_model(tmp_path / "m.onnx")
    dims = engines.onnx_input_dims(path)
    assert dims == {"TOKENS": ["batch", "seq"]}
    feeds = [{"TOKENS": np.zeros((2, n), np.float32)} for n in (3, 40, 7)]
    assert engines.axis_maxima(feeds, dims) == {"seq": 40}


def test_plan_file_naming():
    assert engines.plan_filename(H100) == "model_sm90.plan"
    assert engines.plan_filename((8, 6)) == "model_sm86.plan"
    assert engines.trt_model_name("text_encoder", "int8") == "text_encoder_trt_int8"
    assert engines.trt_model_name("text_encoder_fp32", "fp16") == "text_encoder_trt_fp16"


def _repo(tmp_path: Path) -> Path:
    batching = DynamicBatching(preferred_batch_size=[8], max_queue_delay_microseconds=1000)
    ModelSpec(
        name="enc", backend="onnxruntime", max_batch_size=16,
        inputs=[Tensor("TOKENS", "FP32", [-1], allow_ragged_batch=True)],
        outputs=[Tensor("TOTAL", "FP32", [1]), Tensor("SEEN_LEN", "FP32", [1])],
        instance_count=2, dynamic_batching=batching, parameters={"intra_op_thread_count": "1"},
    ).write(tmp_path)
    ragged_model(tmp_path / "enc" / "1" / "model.onnx")
    ModelSpec(
        name="pipe", platform="ensemble", max_batch_size=16,
        inputs=[Tensor("IN", "FP32", [-1])], outputs=[Tensor("OUT", "FP32", [1])],
        ensemble_steps=[EnsembleStep("enc", {"TOKENS": "IN"}, {"TOTAL": "OUT"})],
    ).write(tmp_path)
    return tmp_path


def test_trt_config_generation(tmp_path):
    repo = _repo(tmp_path)
    cfg = engines.trt_model_config(repo / "enc", "int8", {"9.0": "model_sm90.plan", "8.9": "model_sm89.plan"}, 1)
    assert cfg.name == "enc_trt_int8" and cfg.platform == "tensorrt_plan" and not cfg.backend
    assert dict(cfg.cc_model_filenames) == {"9.0": "model_sm90.plan", "8.9": "model_sm89.plan"}
    assert [(g.kind, list(g.profile)) for g in cfg.instance_group] == [(mc.ModelInstanceGroup.KIND_GPU, ["1"])]
    assert not cfg.parameters and not cfg.input[0].allow_ragged_batch
    assert list(cfg.dynamic_batching.preferred_batch_size) == [8]  # batching tuned for the model is kept
    engines.write_config(cfg, repo)
    built = [Step("enc_trt_int8", "enc", "int8", "built")]
    written = engines.write_ensembles(repo, built)
    assert [p.parent.name for p in written] == ["pipe_trt_int8"]
    configs = validate_repository(repo)  # the generated ensemble connects end to end
    assert [s.model_name for s in configs["pipe_trt_int8"].ensemble_scheduling.step] == ["enc_trt_int8"]
    assert load_config(repo / "enc_trt_int8" / "config.pbtxt").platform == "tensorrt_plan"
    assert embedded_models(repo) == (["enc", "pipe"], ["enc_trt_int8", "pipe_trt_int8"])


@pytest.mark.slow  # over 30 s: its open HTTP client holds the 30 s drain on stop
def test_embedded_server_serves_onnx_beside_tensorrt_variants(tmp_path, start_server):
    """A repository holding TensorRT variants still starts on the embedded server, serving the ORT models."""
    import tritonclient.http as httpclient

    repo = _repo(tmp_path)
    engines.write_config(engines.trt_model_config(repo / "enc", "int8", {"9.0": "model_sm90.plan"}), repo)
    engines.write_ensembles(repo, [Step("enc_trt_int8", "enc", "int8", "built")])
    server = start_server(repo)
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_model_ready("pipe") and not client.is_model_ready("pipe_trt_int8")
    x = np.arange(5, dtype=np.float32)[None]
    inp = httpclient.InferInput("IN", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    assert client.infer("pipe", [inp]).as_numpy("OUT")[0, 0] == pytest.approx(10.0)
    server.stop()


def test_fp16_cast_keeps_fp32_io_and_close_outputs(tmp_path):
    src = linear_model(tmp_path / "fp32.onnx")
    dst = engines.fp16_cast(src, tmp_path / "fp16.onnx")
    import onnx

    assert onnx.load(str(dst)).graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    feeds = [{"X": np.random.default_rng(i).random((4, 4), dtype=np.float32)} for i in range(3)]
    ref, got = engines.run_polygraphy([engines.ort_runner(src, "fp32"), engines.ort_runner(dst, "fp16")], feeds)
    diffs = engines.compare_outputs(ref, got, {"Y": (1e-2, 1e-2)})
    engines.check_diffs(diffs, "fp16 cast")
    assert 0 < diffs[0].max_abs < 1e-2  # FP16 really happened, and it stayed close


def test_check_diffs_lists_the_worst_outputs():
    ref = [{"Y": np.array([1.0, 2.0])}, {"Y": np.array([3.0, 4.0])}]
    got = [{"Y": np.array([1.0, 2.5])}, {"Y": np.array([3.0, 4.0001])}]
    diffs = engines.compare_outputs(ref, got, {"Y": (1e-3, 1e-3)})
    with pytest.raises(EngineError) as info:
        engines.check_diffs(diffs, "plan vs onnxruntime")
    assert "1 of 2" in str(info.value) and "Y sample 0: max|diff| 0.5" in str(info.value)


def test_build_engines_without_tensorrt_skips_with_reason(tmp_path):
    env = Environment(None, ())
    for target in kinds.names():
        steps = engines.build_model_engines(kinds.get(target), env, repository=tmp_path)
        assert [s.status for s in steps] == ["skipped", "skipped"]
        assert all("import tensorrt" in s.detail and "no CUDA GPU" in s.detail for s in steps)


def test_no_int8_plan_from_a_tensorrt_form_that_did_not_pass(tmp_path, monkeypatch):
    """A failed or fallen-back TensorRT-form INT8 report means its Q/DQ graph is the FP32 model or nearly float:
    building an "int8" plan from it would name a plan INT8 that is not."""
    from tritonkit.int8 import recipe

    spec = kinds.get("image_classification")
    monkeypatch.setattr(recipe, "REPORTS", tmp_path)
    assert engines.int8_plan_refusal(spec) is None  # no report: nothing to refuse on
    report = recipe.report_path(spec, "tensorrt")
    report.write_text(json.dumps({"passed": True, "status": "passed"}))
    assert engines.int8_plan_refusal(spec) is None
    report.write_text(json.dumps({"passed": False, "status": "failed",
                                  "missed": ["int8_mac_share 0.041 < 0.667: the FP16 plan would be faster"]}))
    why = engines.int8_plan_refusal(spec)
    assert why and "int8_mac_share 0.041" in why and "FP16 plan serves" in why and "--search" in why


def test_build_engines_command_succeeds_and_prints_the_skip(tmp_path):
    trt, gpus = _this_machine()
    if trt is not None and gpus:
        pytest.skip("TensorRT and a GPU are present: the gpu tests cover the real build")
    result = subprocess.run([sys.executable, "-m", "tritonkit.tensorrt.engines"], capture_output=True, text=True,
                            cwd=paths.ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[skipped]" in result.stdout
    # The reason printed must name what this machine really lacks, not whatever detect() believes.
    assert ("import tensorrt" in result.stdout) == (trt is None), result.stdout
    assert ("no CUDA GPU" in result.stdout) == (gpus == 0), result.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("target", kinds.names())
def test_real_plans_build_validate_and_configure(target):
    """On a machine with TensorRT + GPU: plans build, match ORT (polygraphy), carry metadata and configs."""
    env = engines.detect()
    spec = kinds.get(target)
    steps = engines.build_model_engines(spec, env)
    refused = engines.int8_plan_refusal(spec)  # the TensorRT-form INT8 report did not pass: FP16 only
    assert [s.status for s in steps] == ["skipped" if refused and s.precision == "int8" else "built"
                                         for s in steps], [(s.model, s.detail) for s in steps]
    steps = [s for s in steps if s.status == "built"]
    for step in steps:
        meta_files = [Path(f) for f in step.files if f.endswith(".json")]
        meta = json.loads(meta_files[0].read_text())
        assert meta["tensorrt"] == env.trt_version and meta["compute_capability"] == env.gpus[0].cc
        cfg = load_config(paths.MODEL_REPOSITORY / step.model / "config.pbtxt")
        assert engines.plan_filename(env.gpus[0]) in cfg.cc_model_filenames.values()
