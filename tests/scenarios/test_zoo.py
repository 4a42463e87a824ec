"""The pretrained models beyond the first two pipelines (all-mpnet-base-v2, EfficientNet-Lite1 at 240 px): each
built from nothing but its spec, served by the real tritonserver, and compared with its own PyTorch reference
(sentence-transformers' `encode` on the model's directory; the loader's torch module on the same pixels).

Builds are the user's `python -m tritonkit.build <name>` (export, validation, INT8 replayed from the committed
recipe); a no-op when current. Their INT8 gates on the test split are asserted in tests/int8/test_recipe.py.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.support.text_support import BATCHING_NOISE  # how far a text moves with its batch-mates (test_text_pipeline)
from tests.support.zoo import ZOO  # built by `make test-zoo` only

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import build, data, kinds, paths
from tritonkit.export import row_metric
from tritonkit.serving import imaging

pytestmark = [pytest.mark.slow, pytest.mark.zoo]

# How far one served image output may move with its batch-mates, as test_image_pipeline.py allows (absolute, logits).
IMAGE_BATCHING_NOISE = 2e-3


@pytest.fixture(scope="module", params=ZOO)
def served(request, start_server):
    name = request.param
    built = build.build(name, progress=False)
    kind = kinds.get(name)
    server = start_server(paths.MODEL_REPOSITORY, model_control_mode="explicit", models=[name, f"{name}_fp32"])
    return kind, built, server



def _texts() -> list[str]:
    """Test-split texts of every length class: short queries, sentences, passages past 128 tokens."""
    texts = data.eval_texts("test")
    by_len = sorted(texts, key=len)
    return by_len[:8] + by_len[len(by_len) // 2 : len(by_len) // 2 + 8] + by_len[-8:]


def _embed_concurrently(url: str, model: str, texts: list[str]) -> np.ndarray:
    from tritonkit_client import Client, embed

    client = Client(url)
    with ThreadPoolExecutor(8) as pool:
        rows = list(pool.map(lambda t: embed([t], client=client, model=model).vectors, texts))
    return np.concatenate(rows)


def test_text_model_matches_sentence_transformers_and_its_offline_int8(served):
    kind, built, server = served
    if kind.spec.kind != "text-embedding":
        pytest.skip(f"{kind.NAME} is an image classifier")
    texts = _texts()
    want = kind.sentence_transformer().encode(texts, batch_size=8, convert_to_numpy=True)
    fp32 = _embed_concurrently(server.http_url, f"{kind.NAME}_fp32", texts)
    assert fp32.shape == (len(texts), kind.spec.facts.dim)
    cos = row_metric("cosine", fp32, want)
    assert cos.min() >= 0.9999, f"text {int(cos.argmin())}: cos {cos.min():.6f}"
    np.testing.assert_allclose(np.linalg.norm(fp32, axis=1), np.linalg.norm(want, axis=1), rtol=1e-3)
    int8 = _embed_concurrently(server.http_url, kind.NAME, texts)
    offline = kind.embed_onnx(kind.session(built.int8), texts, batch_size=1)
    noise = 1.0 - row_metric("cosine", int8, offline)
    assert noise.max() <= BATCHING_NOISE, f"served INT8 differs from the offline model by {noise.max():.2e}"
    assert row_metric("cosine", int8, want).min() >= kind.gate("cosine_min")


def test_image_model_matches_torch_at_its_own_size_and_its_offline_int8(served):
    import torch
    from tritonkit_client import Client, image

    from tritonkit.kinds.image import run_onnx

    kind, built, server = served
    if kind.spec.kind != "image-classification":
        pytest.skip(f"{kind.NAME} is a text encoder")
    photos = [e.data for e in kind.examples("test", ("full",))[:24]]
    x = np.stack([imaging.preprocess_one(p, kind.PREPROCESS) for p in photos])
    assert x.shape[1:] == (3, kind.spec.facts.input_size, kind.spec.facts.input_size)
    with torch.no_grad():
        logits, _ = kind.load_classifier()(torch.from_numpy(x))
    client = Client(server.http_url)
    out = image.probabilities(photos, client=client, model=f"{kind.NAME}_fp32", outputs=["LOGITS"])["LOGITS"]
    np.testing.assert_allclose(out, logits.numpy(), atol=2e-3, rtol=0)
    served_int8 = image.probabilities(photos, client=client, model=kind.NAME, outputs=["LOGITS"])["LOGITS"]
    offline = run_onnx(kind.session(built.int8), x, batch_size=1)
    np.testing.assert_allclose(served_int8, offline, atol=IMAGE_BATCHING_NOISE, rtol=0)
    # Near ties may flip with batching; what cannot: the served top-1 is in the offline top-5.
    top5 = np.argsort(-offline, axis=1)[:, :5]
    assert all(int(np.argmax(s)) in t for s, t in zip(served_int8, top5))
    labels = image.classify(photos[:2], top_k=1, client=client, model=kind.NAME)
    assert [row[0].label for row in labels] == [kind.labels()[int(np.argmax(o))] for o in served_int8[:2]]
