"""`make build-engines` (tritonkit.tensorrt.engines): skips with the reason where TensorRT or a GPU is missing,
refuses a foreign TensorRT before building, builds no INT8 plan from a TensorRT form that did not pass; the real
build, validation and configs in the `gpu` tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tensorrt_support import this_machine
from tritonkit import kinds, paths, release
from tritonkit.repository.config import load_config
from tritonkit.tensorrt import engines, plans
from tritonkit.tensorrt.environment import Environment, Gpu, detect

H100 = Gpu(0, "NVIDIA H100", (9, 0), "GPU-11111111-2222-3333-4444-555555555555")
TARGET = release.ServerTarget("24.10", "2.51.0", "10.5.0")


def test_build_engines_without_tensorrt_skips_with_reason(tmp_path):
    env = Environment(None, ())
    for target in kinds.names():
        steps = engines.build_model_engines(kinds.get(target), env, repository=tmp_path)
        assert [s.status for s in steps] == ["skipped", "skipped"]
        assert all("import tensorrt" in s.detail and "no CUDA GPU" in s.detail for s in steps)


def test_build_refuses_a_foreign_tensorrt_before_building():
    if not (paths.MODEL_REPOSITORY / "text_encoder" / "1" / "model.onnx").exists():
        pytest.skip("`make build` has not produced text_encoder/1/model.onnx yet")
    steps = engines.build_model_engines(kinds.get("text"), Environment("10.8.0", (H100,)), target=TARGET)
    assert [s.status for s in steps] == ["failed", "failed"]
    assert all("NGC 24.10 runs 10.5.0" in s.detail for s in steps)


def test_no_int8_plan_from_a_tensorrt_form_that_did_not_pass(tmp_path, monkeypatch):
    """A failed or fallen-back TensorRT-form INT8 report means its Q/DQ graph is the FP32 model or nearly float:
    building an "int8" plan from it would name a plan INT8 that is not."""
    from tritonkit.int8 import report

    spec = kinds.get("image_classification")
    monkeypatch.setattr(report, "REPORTS", tmp_path)
    assert engines.int8_plan_refusal(spec) is None  # no report: nothing to refuse on
    report = report.report_path(spec, "tensorrt")
    report.write_text(json.dumps({"passed": True, "status": "passed"}))
    assert engines.int8_plan_refusal(spec) is None
    report.write_text(json.dumps({"passed": False, "status": "failed",
                                  "missed": ["int8_mac_share 0.041 < 0.667: the FP16 plan would be faster"]}))
    why = engines.int8_plan_refusal(spec)
    assert why and "int8_mac_share 0.041" in why and "FP16 plan serves" in why and "--search" in why


def test_build_engines_command_succeeds_and_prints_the_skip(tmp_path):
    trt, gpus = this_machine()
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
    env = detect()
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
        assert plans.plan_filename(env.gpus[0]) in cfg.cc_model_filenames.values()
