"""rerank() / classify_text(), the CLI and the gateway's /v1/rerank and /v1/classify against a real tritonserver
serving tiny random-weight models (tests.support.tiny_kinds), checked against sentence-transformers' CrossEncoder
and transformers on the same weights."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest
from tritonkit_client import (
    Client,
    ClientError,
    classify_text,
    classify_text_async,
    rerank,
    rerank_async,
)

from tests.support.tiny_kinds import (
    LOGIT_TOL,
    PRINTED_TOL,
    assert_best_first,
    classify_reference,
    rerank_reference,
)

pytestmark = pytest.mark.slow  # builds (once, kept under build/cache) and serves tiny models

RERANKER, CLASSIFIER = "tiny_rerank_bert", "tiny_classify_bert"  # tests/clients/conftest.py serves both

QUERY = "how do I open a network connection to a server"
DOCUMENTS = [
    "Open a socket and connect it to the remote host and port.",
    "The weather today is sunny and warm.",
    "Compress data with the zlib algorithm.",
    "Return the number of items in a container.",
    "A quick brown fox jumps over the lazy dog near the river bank at dawn.",
    "Triton batches requests dynamically.",
    "Create a TCP client, then send the request bytes. " * 12,  # past the tiny models' 64 tokens: truncated
]
TEXTS = ["A man is playing a guitar on stage.", "The committee rejected the proposal.", "Stocks fell sharply today."]
PAIRS = ["Someone is making music.", "The proposal was approved.", "Markets went down."]


# -- client ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_rerank_matches_cross_encoder_in_input_order(tiny_server, tiny_tree, protocol):
    want_scores, want_logits, want_tokens = rerank_reference(tiny_tree, RERANKER, QUERY, DOCUMENTS)
    url = tiny_server.http_url if protocol == "http" else tiny_server.grpc_url
    got = rerank(QUERY, DOCUMENTS, model=f"{RERANKER}_fp32", url=url, protocol=protocol)
    np.testing.assert_allclose(got.logits, want_logits, atol=LOGIT_TOL)
    np.testing.assert_allclose(got.scores, want_scores, atol=LOGIT_TOL / 4)  # sigmoid' <= 1/4
    assert got.num_tokens.tolist() == want_tokens.tolist()
    assert got.truncated.tolist() == [False] * (len(DOCUMENTS) - 1) + [True]
    assert_best_first([i for i, _ in got.ranking()], want_scores, LOGIT_TOL)


def test_rerank_in_batches_async_and_top_n_gives_the_same_scores(tiny_server, tiny_tree):
    documents = [f"{d} ({i})" for i, d in enumerate(DOCUMENTS[:-1] * 6)]  # 36 rows, over the models' 32
    want_scores, *_ = rerank_reference(tiny_tree, RERANKER, QUERY, documents)
    with Client(tiny_server.grpc_url, protocol="grpc") as client:
        whole = rerank(QUERY, documents, model=f"{RERANKER}_fp32", client=client)
        small = rerank(QUERY, documents, model=f"{RERANKER}_fp32", client=client, batch_size=5, concurrency=3)
    top = asyncio.run(rerank_async(QUERY, documents, model=f"{RERANKER}_fp32", top_n=4, url=tiny_server.http_url))
    np.testing.assert_allclose(whole.scores, want_scores, atol=LOGIT_TOL / 4)
    np.testing.assert_allclose(small.scores, whole.scores, atol=1e-6)
    np.testing.assert_allclose(top.scores, whole.scores, atol=1e-6)
    assert [i for i, _ in top.ranking()] == [i for i, _ in whole.ranking()][:4]


@pytest.mark.parametrize("suffix", ["", "_fused"])
def test_the_ensemble_and_fused_model_answer_the_same_contract(tiny_server, suffix):
    """INT8 where the build proved it, whose promise is the kind's rank gates on held-out data, not closeness on
    these near-tied tiny logits (the server's suites compare them): here the same tokens, scores the sigmoid of the
    logits, and the ranking best first by the model's own scores."""
    got = rerank(QUERY, DOCUMENTS, model=RERANKER + suffix, url=tiny_server.grpc_url, protocol="grpc")
    fp32 = rerank(QUERY, DOCUMENTS, model=f"{RERANKER}_fp32", url=tiny_server.grpc_url, protocol="grpc")
    assert got.num_tokens.tolist() == fp32.num_tokens.tolist() and got.truncated.tolist() == fp32.truncated.tolist()
    np.testing.assert_allclose(got.scores, 1 / (1 + np.exp(-got.logits.astype(np.float64))), atol=1e-6)
    assert_best_first([i for i, _ in got.ranking()], got.scores, 0.0)
    names = classify_text(TEXTS, model=f"{CLASSIFIER}_fp32", top_k=1, url=tiny_server.http_url).predictions
    for row in classify_text(TEXTS, model=CLASSIFIER + suffix, url=tiny_server.http_url).predictions:
        assert sorted(p.index for p in row) == [0, 1, 2] and [p.score for p in row] == sorted(
            (p.score for p in row), reverse=True)
        assert {p.label for p in row} >= {names[0][0].label}  # the same label file


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_classify_text_matches_transformers_labels_and_top_k(tiny_server, tiny_tree, protocol):
    labels, probs, logits, _ = classify_reference(tiny_tree, CLASSIFIER, TEXTS)
    url = tiny_server.http_url if protocol == "http" else tiny_server.grpc_url
    got = classify_text(TEXTS, model=f"{CLASSIFIER}_fp32", url=url, protocol=protocol)
    np.testing.assert_allclose(got.logits, logits, atol=LOGIT_TOL)
    for n, preds in enumerate(got.predictions):
        assert sorted(p.index for p in preds) == list(range(len(labels)))
        assert [p.label for p in preds] == [labels[p.index] for p in preds]
        np.testing.assert_allclose([p.score for p in preds], probs[n, [p.index for p in preds]], atol=PRINTED_TOL)
        assert_best_first([p.index for p in preds], probs[n], LOGIT_TOL)
    top1 = classify_text(TEXTS, model=f"{CLASSIFIER}_fp32", top_k=1, url=url, protocol=protocol)
    assert [[p.index for p in preds] for preds in top1.predictions] == [[p[0].index] for p in got.predictions]


def test_classify_text_pairs_and_async(tiny_server, tiny_tree):
    labels, probs, logits, _ = classify_reference(tiny_tree, CLASSIFIER, TEXTS, PAIRS)
    got = asyncio.run(classify_text_async(TEXTS, PAIRS, model=f"{CLASSIFIER}_fp32", top_k=2,
                                          url=tiny_server.grpc_url, protocol="grpc", batch_size=2))
    np.testing.assert_allclose(got.logits, logits, atol=LOGIT_TOL)
    single = classify_text(TEXTS, model=f"{CLASSIFIER}_fp32", url=tiny_server.grpc_url, protocol="grpc")
    assert np.abs(got.logits - single.logits).max() > 10 * LOGIT_TOL, "the pair's second text made no difference"
    for n, preds in enumerate(got.predictions):
        assert [p.index for p in preds] == list(np.argsort(-probs[n], kind="stable")[:2])
        assert [p.label for p in preds] == [labels[p.index] for p in preds]
    with pytest.raises(ValueError, match=r"top_k must be an integer in 1\.\.3"):
        classify_text(TEXTS, model=f"{CLASSIFIER}_fp32", top_k=9, url=tiny_server.http_url)
    with pytest.raises(ClientError, match="not a text-classification model"):
        classify_text(TEXTS, model=f"{RERANKER}_fp32", url=tiny_server.http_url)
    with pytest.raises(ClientError, match="not a text-rerank model"):
        rerank(QUERY, DOCUMENTS, model=f"{CLASSIFIER}_fp32", url=tiny_server.http_url)


# -- CLI ---------------------------------------------------------------------------------------------------


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tritonkit_client", *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_cli_rerank_and_classify_text(tiny_server, tiny_tree, tmp_path):
    want_scores, *_ = rerank_reference(tiny_tree, RERANKER, QUERY, DOCUMENTS)
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(DOCUMENTS) + "\n")
    proc = cli("rerank", QUERY, "--file", str(docs), "--model", f"{RERANKER}_fp32", "--top-n", "3", "--json",
               "--url", tiny_server.grpc_url, "--protocol", "grpc")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["rank"] for r in rows] == [1, 2, 3]
    assert [r["text"] for r in rows] == [DOCUMENTS[r["index"]] for r in rows]
    np.testing.assert_allclose([r["score"] for r in rows], want_scores[[r["index"] for r in rows]], atol=LOGIT_TOL)
    assert_best_first([r["index"] for r in rows], want_scores, LOGIT_TOL)
    assert "1 input(s) were truncated" in proc.stderr

    labels, probs, *_ = classify_reference(tiny_tree, CLASSIFIER, TEXTS, PAIRS)
    tsv = "".join(f"{t}\t{p}\n" for t, p in zip(TEXTS, PAIRS))
    proc = cli("classify-text", "--model", f"{CLASSIFIER}_fp32", "--pairs", "--top-k", "1", "--json",
               "--url", tiny_server.http_url, stdin=tsv)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["text"], r["text_pair"]) for r in rows] == list(zip(TEXTS, PAIRS))
    assert [r["top"][0]["label"] for r in rows] == [labels[i] for i in probs.argmax(1)]
    proc = cli("classify-text", "a text", "--model", f"{CLASSIFIER}_fp32", "--top-k", "7",
               "--url", tiny_server.http_url)
    assert proc.returncode == 2 and "top_k must be an integer in 1..3" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("rerank", QUERY, "fine", "\u200b", "--model", f"{RERANKER}_fp32", "--url", tiny_server.http_url)
    assert proc.returncode == 2 and RERANKER in proc.stderr and "Traceback" not in proc.stderr


# -- gateway -----------------------------------------------------------------------------------------------


def test_gateway_rerank_ranks_as_cross_encoder(tiny_server, tiny_tree, tiny_gateway):
    want_scores, *_ = rerank_reference(tiny_tree, RERANKER, QUERY, DOCUMENTS)
    model = f"{RERANKER}_fp32"
    status, body = tiny_gateway.post("/v1/rerank", {"model": model, "query": QUERY, "documents": DOCUMENTS})
    assert status == 200, body
    assert body["model"] == model and body["object"] == "rerank" and len(body["results"]) == len(DOCUMENTS)
    indices = [r["index"] for r in body["results"]]
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], want_scores[indices],
                               atol=LOGIT_TOL / 4)
    assert_best_first(indices, want_scores, LOGIT_TOL)
    direct = rerank(QUERY, DOCUMENTS, model=model, url=tiny_server.grpc_url, protocol="grpc")
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] == int(direct.num_tokens.sum())

    status, top = tiny_gateway.post("/v1/rerank", {"model": model, "query": QUERY, "documents": DOCUMENTS,
                                                   "top_n": 2, "return_documents": True})
    assert status == 200 and [r["index"] for r in top["results"]] == indices[:2]
    assert [r["document"]["text"] for r in top["results"]] == [DOCUMENTS[i] for i in indices[:2]]
    status, raw = tiny_gateway.post("/v1/rerank", {"model": model, "query": QUERY, "documents": DOCUMENTS,
                                                   "raw_scores": True})
    np.testing.assert_allclose([r["relevance_score"] for r in raw["results"]],
                               direct.logits[[r["index"] for r in raw["results"]]], atol=1e-6)


@pytest.mark.parametrize("suffix", ["", "_fused"])
def test_gateway_serves_the_ensemble_and_fused_model_as_the_client_does(tiny_server, tiny_gateway, suffix):
    model = RERANKER + suffix
    status, body = tiny_gateway.post("/v1/rerank", {"model": model, "query": QUERY, "documents": DOCUMENTS})
    direct = rerank(QUERY, DOCUMENTS, model=model, url=tiny_server.grpc_url, protocol="grpc", batch_size=4)
    assert status == 200 and [r["index"] for r in body["results"]] == [i for i, _ in direct.ranking()]
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], direct.scores[
        [r["index"] for r in body["results"]]], atol=1e-6)
    status, body = tiny_gateway.post("/v1/classify", {"model": CLASSIFIER + suffix, "input": TEXTS, "top_k": 1})
    direct = classify_text(TEXTS, model=CLASSIFIER + suffix, url=tiny_server.grpc_url, protocol="grpc", top_k=1)
    assert status == 200 and [row[0]["label"] for row in body["data"]] == [p[0].label for p in direct.predictions]


def test_gateway_classify_gives_labels_and_scores_as_transformers(tiny_server, tiny_tree, tiny_gateway):
    labels, probs, *_ = classify_reference(tiny_tree, CLASSIFIER, TEXTS)
    model = f"{CLASSIFIER}_fp32"
    status, body = tiny_gateway.post("/v1/classify", {"model": model, "input": TEXTS})
    assert status == 200, body
    assert body["object"] == "classify" and body["model"] == model and len(body["data"]) == len(TEXTS)
    for n, row in enumerate(body["data"]):
        assert sorted(x["label"] for x in row) == sorted(labels)
        got = np.array([x["score"] for x in row])
        np.testing.assert_allclose(got, probs[n, [labels.index(x["label"]) for x in row]], atol=PRINTED_TOL)
        assert (np.diff(got) <= 0).all()
    direct = classify_text(TEXTS, model=model, url=tiny_server.grpc_url, protocol="grpc")
    assert body["usage"]["total_tokens"] == int(direct.num_tokens.sum())

    _, pair_probs, *_ = classify_reference(tiny_tree, CLASSIFIER, TEXTS, PAIRS)
    status, pairs = tiny_gateway.post("/v1/classify", {"model": model, "top_k": 1, "input": [
        {"text": t, "text_pair": p} for t, p in zip(TEXTS, PAIRS)]})
    assert status == 200 and [row[0]["label"] for row in pairs["data"]] == [labels[i] for i in pair_probs.argmax(1)]


def test_gateway_bad_input_and_model_errors_are_400_and_it_keeps_serving(tiny_server, tiny_gateway):
    model = f"{RERANKER}_fp32"
    good = {"model": model, "query": QUERY, "documents": DOCUMENTS[:2]}
    cases = [
        ({"model": model, "documents": ["d"]}, "query", "'query' is required"),
        ({**good, "documents": []}, "documents", "non-empty"),
        ({**good, "documents": ["d"] * 1001}, "documents", "the limit is 1000"),
        ({**good, "documents": ["fine", "  "]}, "documents[1]", "is empty"),
        ({**good, "top_n": 0}, "top_n", "1..1000"),
        # Past the gateway's checks: the server's tokenizer refuses a text that tokenizes to nothing.
        ({**good, "documents": ["fine", "\u200b\u200b"]}, "documents", RERANKER),
        ({"model": f"{CLASSIFIER}_fp32", "input": ["\u200b"]}, "input", CLASSIFIER),
    ]
    for body, param, fragment in cases:
        path = "/v1/classify" if "input" in body else "/v1/rerank"
        status, answer = tiny_gateway.post(path, body)
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
        assert fragment in answer["error"]["message"], answer
        status, after = tiny_gateway.post("/v1/rerank", good)
        assert status == 200 and len(after["results"]) == 2
    assert tiny_gateway.post("/v1/rerank", good, key=None)[0] == 401
    assert tiny_gateway.post("/v1/classify", {"model": CLASSIFIER, "input": ["x"]}, key="wrong")[0] == 401
