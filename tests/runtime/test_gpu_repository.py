"""The GPU view (tritonkit.runtime.gpu_repository) and the torch_cuda backend, on the real tritonserver.

Without a CUDA device the same repository is served with KIND_CPU FP32 instances: that runs the backend's batching
(ragged padding across requests, splitting back) and the ensembles' rewiring; the KIND_GPU test then skips with
the reason. References are independent of the served code: sentence-transformers for texts, the spec's own
torch classifier for images.
"""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc
from tritonkit_client import image, text
from tritonkit_client.core import Client

from tritonkit import data, kinds
from tritonkit.repository.config import load_repository
from tritonkit.repository.variants import read_config
from tritonkit.runtime import gpu_repository
from tritonkit.serving import imaging

spec = kinds.get("image_classification")


pytestmark = pytest.mark.slow
PHOTOS = ["chelsea", "coffee", "astronaut", "rocket"]


def _texts() -> list[str]:
    # Lengths from a few tokens to past the 256-token limit, so batched requests need padding and truncation.
    sentences = data.split("validation")
    return [*sentences[:10], " ".join(sentences[10:40]), " ".join(sentences[40:45])]


def _cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else f"torch {torch.__version__} sees no CUDA device"


def test_gpu_view_swaps_the_onnxruntime_steps_for_gpu_instances(tmp_path):
    out = gpu_repository.build(tmp_path / "repo", text_weights="random", image_weights="random")
    configs = load_repository(out)
    assert set(configs) == {"text_embedding", "tokenizer", "text_encoder_cuda", "image_classification",
                            "image_preprocess", "image_classifier_cuda"}
    steps = {name: [s.model_name for s in configs[name].ensemble_scheduling.step] for name in gpu_repository.ENSEMBLES}
    assert steps == {"text_embedding": ["tokenizer", "text_encoder_cuda"],
                     "image_classification": ["image_preprocess", "image_classifier_cuda"]}
    for name, source in (("text_encoder_cuda", "text_encoder"), ("image_classifier_cuda", "image_classifier")):
        cfg, committed = configs[name], read_config(source)
        assert cfg.backend == "torch_cuda"
        assert [g.kind for g in cfg.instance_group] == [mc.ModelInstanceGroup.KIND_GPU]
        assert cfg.parameters["precision"].string_value == "fp16"
        assert cfg.parameters["weights"].string_value == "random"
        assert not set(cfg.parameters) & set(gpu_repository.ORT_ONLY)
        # Same tensors and batching as the committed step, so the ensemble and clients are unchanged.
        assert list(cfg.input) == list(committed.input) and list(cfg.output) == list(committed.output)
        assert cfg.dynamic_batching == committed.dynamic_batching
        assert cfg.max_batch_size == committed.max_batch_size
    assert configs["tokenizer"].parameters["tokenizer_file"].string_value == "tokenizer.json"
    assert (out / "tokenizer" / "tokenizer.json").stat().st_size > 100_000
    labels = (out / "image_classifier_cuda" / "labels.txt").read_text().splitlines()
    assert len(labels) == spec.NUM_CLASSES and labels[967] == "espresso"
    assert not list(out.glob("*_cuda/1/model.*"))


@pytest.mark.parametrize(("options", "field"), [
    ({"kind": "cpu", "precision": "fp16"}, "precision"),
    ({"kind": "tpu"}, "kind"),
    ({"text_weights": "int8"}, "text_weights"),
    ({"instances": 0}, "instances"),
])
def test_bad_options_are_refused_naming_the_field(tmp_path, options, field):
    with pytest.raises(gpu_repository.GpuRepositoryError) as err:
        gpu_repository.build(tmp_path / "repo", **options)
    assert err.value.field == field


def _check_served(server, cosine_min: float, logits_atol: float) -> None:
    texts = _texts()
    with Client(server.grpc_url, protocol="grpc") as client:
        # One text per request, 8 in flight: the dynamic batcher merges requests of different lengths.
        served = text.embed(texts, client=client, batch_size=1, concurrency=8)
        jpegs = [spec.photo_bytes(n) for n in PHOTOS]
        probs = image.probabilities(jpegs, client=client, model="image_classification")
        top = image.classify(jpegs[:2], top_k=1, client=client)
    from tests.support.text_support import st_model

    ref = st_model().encode(texts, convert_to_numpy=True, normalize_embeddings=True)
    cosine = np.sum(served.vectors * ref, axis=1)
    assert cosine.min() >= cosine_min, cosine
    assert served.truncated.tolist() == [False] * 10 + [True, False]

    import torch

    with torch.no_grad():
        logits, _ = spec.load_classifier()(torch.from_numpy(np.stack([imaging.preprocess_one(j) for j in jpegs])))
    np.testing.assert_allclose(probs["LOGITS"], logits.numpy(), atol=logits_atol, rtol=0)
    assert top[1][0].label == "espresso"
    encoder = _stats(server)["text_encoder_cuda"]
    # Requests were merged, so the padding path ran.
    assert encoder.executions < encoder.inferences


def _stats(server) -> dict:
    from tritonkit.perf import stats

    return stats.read(server.http_url, ["text_encoder_cuda", "image_classifier_cuda"])


def test_cpu_instances_serve_both_pipelines_like_the_references(tmp_path, start_server):
    out = gpu_repository.build(tmp_path / "repo", kind="cpu", precision="fp32", instances=1)
    server = start_server(out)
    _check_served(server, cosine_min=0.9999, logits_atol=2e-3)


def test_gpu_instances_serve_both_pipelines_like_the_references(tmp_path, start_server):
    reason = _cuda_reason()
    if reason:
        print(f"skipping the KIND_GPU run: {reason}")
        pytest.skip(reason)
    out = gpu_repository.build(tmp_path / "repo", precision="fp16")
    server = start_server(out)
    # FP16 weights and activations: cosine and logits as far as half precision carries them.
    _check_served(server, cosine_min=0.999, logits_atol=0.15)
