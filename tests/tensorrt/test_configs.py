"""Triton configs for the plans (tritonkit.tensorrt.configs): a `tensorrt_plan` twin of a model and of its
ensemble that the repository validates end to end, that the embedded server starts beside, and that carries its
label file."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from tests.support.tiny_models import ragged_model
from tritonkit.errors import EngineError
from tritonkit.repository.config import (
    DynamicBatching,
    EnsembleStep,
    ModelSpec,
    Tensor,
    load_config,
    validate_repository,
)
from tritonkit.repository.native_check import embedded_models
from tritonkit.tensorrt import configs, engines
from tritonkit.tensorrt.engines import Step


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
    cfg = configs.trt_model_config(repo / "enc", "int8", {"9.0": "model_sm90.plan", "8.9": "model_sm89.plan"}, 1)
    assert cfg.name == "enc_trt_int8" and cfg.platform == "tensorrt_plan" and not cfg.backend
    assert dict(cfg.cc_model_filenames) == {"9.0": "model_sm90.plan", "8.9": "model_sm89.plan"}
    assert [(g.kind, list(g.profile)) for g in cfg.instance_group] == [(mc.ModelInstanceGroup.KIND_GPU, ["1"])]
    assert not cfg.parameters and not cfg.input[0].allow_ragged_batch
    assert list(cfg.dynamic_batching.preferred_batch_size) == [8]  # batching tuned for the model is kept
    configs.write_config(cfg, repo)
    built = [Step("enc_trt_int8", "enc", "int8", "built")]
    written = engines.write_ensembles(repo, built)
    assert [p.parent.name for p in written] == ["pipe_trt_int8"]
    validated = validate_repository(repo)  # the generated ensemble connects end to end
    assert [s.model_name for s in validated["pipe_trt_int8"].ensemble_scheduling.step] == ["enc_trt_int8"]
    assert load_config(repo / "enc_trt_int8" / "config.pbtxt").platform == "tensorrt_plan"
    assert embedded_models(repo) == (["enc", "pipe"], ["enc_trt_int8", "pipe_trt_int8"])


@pytest.mark.slow  # over 30 s: its open HTTP client holds the 30 s drain on stop
def test_embedded_server_serves_onnx_beside_tensorrt_variants(tmp_path, start_server):
    """A repository holding TensorRT variants still starts on the embedded server, serving the ORT models."""
    import tritonclient.http as httpclient

    repo = _repo(tmp_path)
    configs.write_config(configs.trt_model_config(repo / "enc", "int8", {"9.0": "model_sm90.plan"}), repo)
    engines.write_ensembles(repo, [Step("enc_trt_int8", "enc", "int8", "built")])
    server = start_server(repo)
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_model_ready("pipe") and not client.is_model_ready("pipe_trt_int8")
    x = np.arange(5, dtype=np.float32)[None]
    inp = httpclient.InferInput("IN", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    assert client.infer("pipe", [inp]).as_numpy("OUT")[0, 0] == pytest.approx(10.0)
    server.stop()


def test_trt_config_carries_its_label_file(tmp_path):
    src = tmp_path / "src"
    ModelSpec(name="cls", backend="onnxruntime", max_batch_size=8,
              inputs=[Tensor("x", "FP32", [3])], outputs=[Tensor("p", "FP32", [2], label_filename="labels.txt")],
              dynamic_batching=DynamicBatching()).write(src)
    cfg = configs.trt_model_config(src / "cls", "int8", {"9.0": "model_sm90.plan"})
    with pytest.raises(EngineError, match=re.escape("label_filename 'labels.txt' has no file")):
        configs.write_config(cfg, tmp_path / "out", source_dir=src / "cls")
    (src / "cls" / "labels.txt").write_text("a\nb\n")
    path = configs.write_config(cfg, tmp_path / "out", source_dir=src / "cls")
    assert (path.parent / "labels.txt").read_text() == "a\nb\n"
