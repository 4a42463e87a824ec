"""The text_embedding ensemble on a real tritonserver: equals sentence-transformers, handles bad input, stays up."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException
from tritonkit_client import AsyncClient, Client, ClientError, embed, embed_async

from tests.support.text_support import (
    BATCHING_NOISE,
    INT8_PACKING_NOISE,
    ensure_text_built,
    st_model,
    start_text_server,
)
from tritonkit import data
from tritonkit.export import row_metric
from tritonkit.perf.analyzer import metrics_counters

pytestmark = pytest.mark.slow  # serves the built MiniLM pipeline

OUTPUTS = ["embedding", "num_tokens", "truncated"]


@pytest.fixture(scope="module")
def server(start_server):
    return start_text_server(start_server)


def _texts_of_mixed_lengths(n: int = 48) -> list[str]:
    sentences = data.split("evaluation")
    texts = []
    for i in range(n):
        # 1 to 6 sentences joined: from a few tokens up to and past the 256-token limit.
        texts.append(" ".join(sentences[i * 7 : i * 7 + 1 + (i % 6) * (2 if i % 4 == 3 else 1)]))
    texts[5] = " ".join(sentences[300:330])  # far over the limit
    return texts



def _concurrent_single_requests(url: str, model: str, texts: list[str]) -> np.ndarray:
    """One request per text, 16 in flight: the server batches requests of different lengths together."""
    client = Client(url)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda t: embed([t], client=client, model=model, concurrency=1), texts))
    return np.concatenate([r.vectors for r in results])


def _good_request_works(server) -> None:
    assert embed(["still serving"], url=server.http_url).vectors.shape == (1, 384)
    with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=5) as r:
        assert r.status == 200


def test_fp32_ensemble_equals_sentence_transformers_concurrently(server):
    texts = _texts_of_mixed_lengths()
    want = st_model().encode(texts, batch_size=16)
    got = _concurrent_single_requests(server.http_url, "text_embedding_fp32", texts)
    cos = row_metric("cosine", got, want)
    assert cos.min() >= 0.9999, f"worst text {int(cos.argmin())}: cos {cos.min():.6f}"
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)




def _one_at_a_time(url: str, model: str, texts: list[str]) -> np.ndarray:
    client = Client(url)
    return np.concatenate([embed([t], client=client, model=model).vectors for t in texts])


@pytest.mark.parametrize(("model", "bound"), [("text_embedding_fp32", BATCHING_NOISE),
                                              ("text_embedding", INT8_PACKING_NOISE)])
def test_batching_noise_is_bounded(server, model, bound):
    """The same texts alone (batch of one) and inside concurrent mixed-length dynamic batches."""
    texts = _texts_of_mixed_lengths()
    alone = _one_at_a_time(server.http_url, model, texts)
    batched = _concurrent_single_requests(server.http_url, model, texts)
    noise = 1.0 - row_metric("cosine", alone, batched)
    assert noise.max() <= bound, f"text {int(noise.argmax())} moved by {noise.max():.2e} in a batch"


def test_int8_ensemble_is_the_offline_int8_model_and_meets_the_gate(server):
    from tritonkit import kinds
    from tritonkit.repository import runtime_choice

    minilm = kinds.get("text_embedding")

    texts = _texts_of_mixed_lengths()
    # The file the encoder serves (its packed form), on the runtime and precision its config names.
    served = runtime_choice.served_file(ensure_text_built().int8)
    sess = runtime_choice.served_session(minilm, minilm.INT8_MODEL, served)
    wide = runtime_choice.width_multiple(minilm, minilm.INT8_MODEL)  # the row-width bucket the backend packs to
    offline = np.concatenate([sess.run(["embedding"], minilm.packed_feeds([t], width_multiple=wide))[0][:1]
                              for t in texts])
    # One at a time a text fills its packed row alone, so the served graph must be the offline one exactly.
    alone = _one_at_a_time(server.http_url, "text_embedding", texts)
    noise = 1.0 - row_metric("cosine", alone, offline)
    assert noise.max() <= BATCHING_NOISE, f"served INT8 differs from the offline model by {noise.max():.2e}"
    # Batched with others, against sentence-transformers' FP32 itself: the INT8 gate (a constant of the spec).
    got = _concurrent_single_requests(server.http_url, "text_embedding", texts)
    cos = row_metric("cosine", got, st_model().encode(texts, batch_size=16))
    assert cos.min() >= minilm.gate("cosine_min"), f"worst text {int(cos.argmin())}: cos {cos.min():.5f}"


def test_requests_of_different_lengths_share_a_run_without_full_padding(server):
    before = metrics_counters(server.metrics_url)
    texts = _texts_of_mixed_lengths(32)
    _concurrent_single_requests(server.http_url, "text_embedding", texts)
    after = metrics_counters(server.metrics_url)
    delta = {k[0]: after[k] - before.get(k, 0.0) for k in after if k[1] == "text_encoder"}
    runs, requests = delta["tritonkit_ort_session_runs_total"], delta["tritonkit_ort_batched_requests_total"]
    assert requests == 32 and runs < requests, "requests were not batched together"
    total, padding = delta["tritonkit_ort_input_elements_total"], delta["tritonkit_ort_padding_elements_total"]
    # Everything padded to 256 would be 2*32*256 elements; ragged batching pads to each run's longest only.
    assert total < 2 * 32 * 256 and 0 <= padding < total


def test_both_encoders_serve_their_packed_graph(server):
    """The build wrote and proved each encoder's packed graph, and the served encoders run it (their log says so;
    a missing file would fall back to length buckets with a warning instead)."""
    log = server.log_path.read_text()
    for encoder in ("text_encoder", "text_encoder_fp32"):
        assert (server.model_repository / encoder / "1" / "model.packed.onnx").exists(), encoder
        assert f"{encoder}: packed batches from model.packed.onnx" in log, encoder


def test_batch_of_texts_in_one_request_and_all_clients_agree(server):
    texts = _texts_of_mixed_lengths(10)
    http = embed(texts, url=server.http_url, batch_size=4, concurrency=3)
    grpc = embed(texts, url=server.grpc_url, protocol="grpc", batch_size=10)
    aio_http = asyncio.run(embed_async(texts, url=server.http_url, batch_size=3, concurrency=4))
    aio_grpc = asyncio.run(embed_async(texts, url=server.grpc_url, protocol="grpc", batch_size=5))
    for other in (grpc, aio_http, aio_grpc):
        # INT8 ensemble: batch-mates move a text by up to the measured packing noise.
        assert row_metric("cosine", other.vectors, http.vectors).min() > 1 - INT8_PACKING_NOISE
        assert (other.num_tokens == http.num_tokens).all() and (other.truncated == http.truncated).all()


def test_long_text_is_truncated_and_flagged(server):
    long_text = " ".join(data.split("evaluation")[400:440])
    result = embed([long_text, "short text"], url=server.http_url, model="text_embedding_fp32")
    assert result.truncated.tolist() == [True, False]
    assert result.num_tokens[0] == 256 and result.num_tokens[1] < 10
    # Truncated exactly like sentence-transformers (max_seq_length 256).
    assert row_metric("cosine", result.vectors[:1], st_model().encode([long_text]))[0] >= 0.9999


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"", "text[0] is empty or whitespace-only"),
        (b" \t\n ", "text[0] is empty or whitespace-only"),
        (b"caf\xe9 au lait", "text[0] is not valid UTF-8 (byte 0xe9 at offset 3)"),
    ],
)
def test_bad_text_gets_a_clear_error_and_server_stays_healthy(server, value, message):
    client = Client(server.http_url)
    with pytest.raises(ClientError, match=re.escape(message)):
        client.infer("text_embedding", {"text": np.array([[value]], dtype=object)}, OUTPUTS)
    # The error names the element: the second of a batch.
    with pytest.raises(ClientError, match=r"text\[1\]"):
        client.infer("text_embedding", {"text": np.array([[b"fine"], [value]], dtype=object)}, OUTPUTS)
    _good_request_works(server)


def test_wrong_dtype_is_rejected(server):
    client = httpclient.InferenceServerClient(server.http_url)
    tensor = httpclient.InferInput("text", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[7]], dtype=np.int32))
    with pytest.raises(InferenceServerException, match=r"(?i)data-?type"):
        client.infer("text_embedding", [tensor])
    _good_request_works(server)


def test_wrong_shape_is_rejected(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("text", [1, 2], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"a", b"b"]], dtype=object))
    with pytest.raises(InferenceServerException, match=r"(?i)shape"):
        client.infer("text_embedding", [tensor])
    _good_request_works(server)


def test_batch_over_max_batch_size_is_rejected(server):
    client = Client(server.http_url)
    texts = np.array([[b"word"]] * 65, dtype=object)
    with pytest.raises(ClientError, match=r"(?i)batch.?size must be <= 64"):
        client.infer("text_embedding", {"text": texts}, OUTPUTS)
    # 64 is fine, and the client library splits larger inputs itself.
    assert len(client.infer("text_embedding", {"text": texts[:64]}, OUTPUTS)["embedding"]) == 64
    assert embed(["word"] * 130, url=server.http_url, batch_size=64).vectors.shape == (130, 384)
    _good_request_works(server)


def test_async_client_reports_server_errors(server):
    async def go():
        async with AsyncClient(server.http_url) as client:
            await client.check_ready("text_embedding")
            with pytest.raises(ClientError, match="empty"):
                await client.infer("text_embedding", {"text": np.array([[b""]], dtype=object)}, OUTPUTS)

    asyncio.run(go())
