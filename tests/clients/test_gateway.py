"""The OpenAI-compatible embeddings gateway, driven by the official `openai` client against the real server."""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from tritonkit_client.core import Client
from tritonkit_client.text import embed

from tests.support.gateway_support import start_gateway
from tests.support.text_support import start_text_server

pytestmark = pytest.mark.slow  # serves the built MiniLM pipeline

TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank at dawn.",
    "Triton batches requests dynamically.",
]


@pytest.fixture(scope="module")
def server(start_server):
    return start_text_server(start_server)


@pytest.fixture(scope="module")
def gateway(server):
    proc, port = start_gateway(server)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    proc.terminate()
    proc.wait(10)


def _direct(server, texts):
    with Client(server.grpc_url, protocol="grpc") as client:
        return embed(texts, client=client)


def test_openai_client_gets_the_servers_embeddings_and_token_usage(server, gateway):
    response = gateway.embeddings.create(input=TEXTS, model="all-MiniLM-L6-v2")
    got = np.array([d.embedding for d in response.data], np.float32)
    want = _direct(server, TEXTS)
    assert [d.index for d in response.data] == [0, 1, 2]
    np.testing.assert_allclose(got, want.vectors, atol=1e-6)
    assert response.usage.prompt_tokens == response.usage.total_tokens == int(want.num_tokens.sum())
    assert response.model == "all-MiniLM-L6-v2"


def test_single_string_base64_and_dimensions(server, gateway):
    want = _direct(server, [TEXTS[1]]).vectors[0]
    single = gateway.embeddings.create(input=TEXTS[1], model="text_embedding", encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, want, atol=1e-6)
    # The SDK decodes base64 itself when it asked for it; ask raw to check the wire format too.
    raw = gateway.embeddings.with_raw_response.create(input=[TEXTS[1]], model="text_embedding",
                                                      encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(raw.http_response.json()["data"][0]["embedding"]), np.float32)
    np.testing.assert_allclose(vector, want, atol=1e-6)
    short = gateway.embeddings.create(input=TEXTS[1], model="text_embedding", dimensions=128)
    vec = np.array(short.data[0].embedding)
    assert vec.shape == (128,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    np.testing.assert_allclose(vec, want[:128] / np.linalg.norm(want[:128]), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"input": ["fine", "   "]}, openai.BadRequestError, "input[1] is empty"),
        ({"input": []}, openai.BadRequestError, "'input' must be a non-empty"),
        ({"input": "x", "dimensions": 999}, openai.BadRequestError, "1..384"),
        ({"input": "x", "model": "text-embedding-3-large"}, openai.NotFoundError, "does not exist"),
    ],
)
def test_bad_requests_get_openai_style_errors(gateway, kwargs, error, fragment):
    kwargs.setdefault("model", "all-MiniLM-L6-v2")
    with pytest.raises(error) as info:
        gateway.embeddings.create(**kwargs)
    assert fragment in str(info.value)
    assert gateway.embeddings.create(input="still serving", model="all-MiniLM-L6-v2").data


def test_overload_is_answered_429_not_queued(server):
    proc, port = start_gateway(server, "--max-in-flight", "1")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    outcomes: list[str] = []

    def call():
        # No assert here: an AssertionError in a thread is only a warning. Record, and assert below.
        try:
            client.embeddings.create(input=TEXTS * 20, model="all-MiniLM-L6-v2")
            outcomes.append("ok")
        except openai.RateLimitError as err:
            outcomes.append("429" if "limit of 1" in str(err) else f"429 without the limit: {err}")
        except Exception as err:  # anything else is a failure, reported by the assert below
            outcomes.append(f"{type(err).__name__}: {err}")

    try:
        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        proc.terminate()
        proc.wait(10)
    assert len(outcomes) == 8 and set(outcomes) == {"ok", "429"}, outcomes


KEY = "tk-test-7f3a9c"


def _raw_status(port: int, path: str, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize("source", ["env", "file"])
def test_api_key_is_required_and_checked(server, tmp_path, source):
    key_file = tmp_path / "gateway-key"
    key_file.write_text(KEY + "\n")
    if source == "env":
        proc, port = start_gateway(server, env={"TRITONKIT_GATEWAY_API_KEY": KEY})
    else:
        proc, port = start_gateway(server, "--api-key-file", str(key_file))
    try:
        assert KEY not in " ".join(proc.args)  # never on the command line
        base = f"http://127.0.0.1:{port}/v1"
        good = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        want = _direct(server, TEXTS[:1]).vectors[0]
        np.testing.assert_allclose(good.embeddings.create(input=TEXTS[0], model="all-MiniLM-L6-v2")
                                   .data[0].embedding, want, atol=1e-6)
        for wrong in ("nope", KEY[:-1], KEY + "x"):
            with pytest.raises(openai.AuthenticationError) as info:
                openai.OpenAI(base_url=base, api_key=wrong, max_retries=0).embeddings.create(
                    input="x", model="all-MiniLM-L6-v2")
            assert info.value.status_code == 401
            assert info.value.body["code"] == "invalid_api_key" and info.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key=KEY, max_retries=0).models.with_raw_response.list(
                extra_headers={"Authorization": ""})
        status, body = _raw_status(port, "/v1/models")  # no Authorization header at all
        assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["code"] == "missing_api_key"
        assert _raw_status(port, "/v1/models", {"Authorization": f"Bearer {KEY}"})[0] == 200
        assert _raw_status(port, "/health")[0] == 200  # probes need no key
    finally:
        proc.terminate()
        proc.wait(10)


def test_every_served_text_model_is_offered_under_its_own_name(server, gateway):
    listed = {m.id for m in gateway.models.list()}
    assert {"text_embedding", "text_embedding_fp32", "all-MiniLM-L6-v2"} <= listed
    assert not listed & {"tokenizer", "text_encoder"}, "only text-in, embedding-out models are embedding models"
    fp32 = gateway.embeddings.create(input=TEXTS[0], model="text_embedding_fp32")
    with Client(server.grpc_url, protocol="grpc") as client:
        want = embed([TEXTS[0]], client=client, model="text_embedding_fp32").vectors[0]
    np.testing.assert_allclose(fp32.data[0].embedding, want, atol=1e-6)
    assert fp32.model == "text_embedding_fp32"


def test_dimensions_are_bounded_by_each_models_width():
    from tritonkit_client.gateway import RequestError, parse_request, text_models

    def config(width, out="embedding", in_type="TYPE_STRING"):
        return {"input": [{"name": "text", "data_type": in_type, "dims": [1]}],
                "output": [{"name": out, "data_type": "TYPE_FP32", "dims": [width]}]}

    served = text_models({"big": config(768), "small": config(32), "ids": config(8, out="input_ids"),
                          "tensor": config(4, in_type="TYPE_FP32")})
    assert served == {"big": 768, "small": 32}
    assert parse_request({"input": "x", "model": "big", "dimensions": 700}, served)[3] == 700
    assert parse_request({"input": "x", "model": "small"}, served)[3] == 32
    with pytest.raises(RequestError, match=r"1\.\.32 for model 'small'"):
        parse_request({"input": "x", "model": "small", "dimensions": 33}, served)
    with pytest.raises(RequestError, match="this server has big, small"):
        parse_request({"input": "x", "model": "text_embedding"}, served)
