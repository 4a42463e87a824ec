"""The gateway's /v1/rerank and /v1/classify as their users meet them: a real gateway process in front of a real
tritonserver serving tests.support.tiny_kinds' BERT reranker and classifier (tests/clients/conftest.py), answers
checked against sentence-transformers' CrossEncoder and transformers on the same weights: ranking, ties, top_n,
return_documents, raw_scores, pairs, top_k, usage, how a request is split into Triton requests (the server's own
per-model statistics), the API key, /v1/models, and every bad input answered 400 / 404 naming the field and the
limit while the gateway keeps serving."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonkit_client import Client, ClientError, reranking, text_classification
from tritonkit_client.gateway import MAX_DOCUMENTS, MAX_INPUTS, MAX_TEXT_BYTES

from tests.support.tiny_kinds import (
    LOGIT_TOL,
    PRINTED_TOL,
    TINY,
    assert_best_first,
    classify_reference,
    rerank_reference,
    served_models,
)

RERANKER, CLASSIFIER = "tiny_rerank_bert", "tiny_classify_bert"  # tests/clients/conftest.py serves both
# The FP32 twins: what CrossEncoder / transformers on the same weights predict, within LOGIT_TOL.
RANKER, CLASSIFY = f"{RERANKER}_fp32", f"{CLASSIFIER}_fp32"
SINGLE = f"{CLASSIFY}_single"  # conftest's variant of CLASSIFY without the text_pair input
LABELS = TINY[CLASSIFIER].num_labels

QUERY = "how do I open a network connection to a server"
DOCUMENTS = [
    "Open a socket and connect it to the remote host and port.",
    "The weather today is sunny and warm.",
    "Compress data with the zlib algorithm.",
    "A quick brown fox jumps over the lazy dog near the river bank at dawn.",
    "Create a TCP client, then send the request bytes. " * 12,  # past the tiny models' 64 tokens: truncated
]
TEXTS = ["A man is playing a guitar on stage.", "The committee rejected the proposal.", "Stocks fell sharply today."]
PAIRS = ["Someone is making music.", "The proposal was approved.", "Markets went down."]


@pytest.fixture(scope="module")
def wide_gateway(start_tiny_gateway):
    """An open gateway asked for more rows per Triton request than the models take."""
    return start_tiny_gateway("--batch-size", "64")


def scores_of(results: list[dict]) -> np.ndarray:
    return np.array([r["relevance_score"] for r in results], np.float64)


def assert_ranked_as_cross_encoder(tree, query: str, documents: list[str], results: list[dict],
                                   raw: bool = False) -> list[int]:
    """results are `documents` best first by the gateway's own scores, which are CrossEncoder's (raw: the logits
    transformers gives) on the same weights; returns the order."""
    scores, logits, _ = rerank_reference(tree, RERANKER, query, documents)
    want, tol = (logits, LOGIT_TOL) if raw else (scores, LOGIT_TOL / 4)  # sigmoid' <= 1/4
    order = [r["index"] for r in results]
    np.testing.assert_allclose(scores_of(results), want[order], atol=tol)
    assert (np.diff(scores_of(results)) <= 0).all(), results
    assert_best_first(order, want, LOGIT_TOL)
    return order


def assert_classified_as_transformers(tree, texts: list[str], data: list[list[dict]], pairs=None,
                                      raw: bool = False, top_k: int = LABELS) -> None:
    """Per text, its top_k labels best first with transformers' probabilities (raw: logits) on the same weights."""
    labels, probs, logits, _ = classify_reference(tree, CLASSIFIER, texts, pairs)
    want, tol = (logits, LOGIT_TOL) if raw else (probs, PRINTED_TOL)
    assert len(data) == len(texts)
    for n, row in enumerate(data):
        index = [labels.index(x["label"]) for x in row]
        got = np.array([x["score"] for x in row])
        assert len(row) == top_k and len(set(index)) == top_k, row
        np.testing.assert_allclose(got, want[n, index], atol=tol)
        assert (np.diff(got) <= 0).all(), row
        assert want[n, index[-1]] >= np.sort(want[n])[::-1][top_k - 1] - tol, (row, want[n])  # the best top_k
        assert_best_first(index, want[n], tol)


def executions(server, model: str) -> Counter:
    """Triton's count of `model`'s executions per batch size. An ensemble has no batcher of its own: one execution
    per request sent to it, of the rows sent."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return Counter({int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats.get("batch_stats", [])})


def executions_since(server, model: str, before: Counter, want: Counter, wait_s: float = 10.0) -> Counter:
    """`model`'s executions since `before`, read until they reach `want` or `wait_s` passes: Triton may count an
    execution a moment after its response went out (a loaded machine shows it); more than `want` still shows."""
    deadline = time.monotonic() + wait_s
    while True:
        got = executions(server, model) - before
        if sum(got.values()) >= sum(want.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def split(rows: int, size: int) -> Counter:
    return Counter([size] * (rows // size) + ([rows % size] if rows % size else []))


def max_batch_size(server, model: str) -> int:
    with Client(server.grpc_url, protocol="grpc") as client:
        return int(client.model_config(model)["max_batch_size"])


# -- answers -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rerank_answers_best_first_with_scores_usage_and_documents(tiny_tree, tiny_gateway):
    body = {"model": RANKER, "query": QUERY, "documents": DOCUMENTS}
    s1, full = tiny_gateway.post("/v1/rerank", body)
    s2, top = tiny_gateway.post("/v1/rerank", {**body, "top_n": 2, "return_documents": True})
    s3, many = tiny_gateway.post("/v1/rerank", {**body, "top_n": 50})
    objects = [{"text": d} for d in DOCUMENTS]  # Cohere's object form
    s4, raw = tiny_gateway.post("/v1/rerank", {**body, "raw_scores": True, "documents": objects})
    assert (s1, s2, s3, s4) == (200, 200, 200, 200), (full, top, many, raw)
    assert full["object"] == "rerank" and full["model"] == RANKER and full["id"].startswith("rerank-")
    order = assert_ranked_as_cross_encoder(tiny_tree, QUERY, DOCUMENTS, full["results"])
    assert sorted(order) == list(range(len(DOCUMENTS))) and not any("document" in r for r in full["results"])
    _, _, tokens = rerank_reference(tiny_tree, RERANKER, QUERY, DOCUMENTS)
    assert full["usage"] == {"prompt_tokens": int(tokens.sum()), "total_tokens": int(tokens.sum())}
    assert [(r["index"], r["document"]["text"]) for r in top["results"]] == [(i, DOCUMENTS[i]) for i in order[:2]]
    np.testing.assert_allclose(scores_of(top["results"]), scores_of(full["results"])[:2], atol=1e-6)
    assert [r["index"] for r in many["results"]] == order  # top_n past the documents: all of them, as Cohere does
    raw_order = assert_ranked_as_cross_encoder(tiny_tree, QUERY, DOCUMENTS, raw["results"], raw=True)
    assert sorted(raw_order) == list(range(len(DOCUMENTS)))


@pytest.mark.slow
def test_equal_scores_keep_the_documents_order(tiny_tree, wide_gateway):
    documents = [DOCUMENTS[i] for i in (0, 1, 0, 2, 1, 0, 2, 0)]
    status, body = wide_gateway.post("/v1/rerank", {"model": RANKER, "query": QUERY, "documents": documents})
    assert status == 200, body
    order = assert_ranked_as_cross_encoder(tiny_tree, QUERY, documents, body["results"])
    score = dict(zip(order, scores_of(body["results"])))
    # The same pair in one Triton request scores the same to the bit: ties the ranking must break by input order.
    assert all(len({score[i] for i, d in enumerate(documents) if d == text}) == 1 for text in set(documents))
    for text in set(documents):
        places = [p for p, i in enumerate(order) if documents[i] == text]
        assert [order[p] for p in places] == [i for i, d in enumerate(documents) if d == text]
        assert places == list(range(places[0], places[0] + len(places)))  # together


@pytest.mark.slow
@pytest.mark.parametrize("route", ["rerank", "classify"])
def test_requests_go_to_triton_in_batches_capped_at_the_models_max(tiny_server, tiny_tree, tiny_gateway,
                                                                   wide_gateway, route):
    """--batch-size 4 sends 70 rows as requests of 4; --batch-size 64 as requests of the model's max batch size;
    each answer in the order of the request's rows."""
    texts = [f"document {i} about {'a network connection' if i % 7 == 0 else 'nothing'} " + "word " * (i % 5)
             for i in range(70)]
    model = RANKER if route == "rerank" else CLASSIFY
    most = max_batch_size(tiny_server, model)
    assert most < 64
    for gateway, rows in ((tiny_gateway, 4), (wide_gateway, most)):
        before = executions(tiny_server, model)
        if route == "rerank":
            status, body = gateway.post("/v1/rerank", {"model": model, "query": QUERY, "documents": texts})
            assert status == 200, body
            assert_ranked_as_cross_encoder(tiny_tree, QUERY, texts, body["results"])
        else:
            status, body = gateway.post("/v1/classify", {"model": model, "input": texts})
            assert status == 200, body
            assert_classified_as_transformers(tiny_tree, texts, body["data"])
        want = split(len(texts), rows)
        assert executions_since(tiny_server, model, before, want) == want


@pytest.mark.slow
def test_classify_answers_every_label_best_first_and_takes_pairs(tiny_tree, tiny_gateway):
    s1, body = tiny_gateway.post("/v1/classify", {"model": CLASSIFY, "input": TEXTS})
    s2, top1 = tiny_gateway.post("/v1/classify", {"model": CLASSIFY, "input": TEXTS[1], "top_k": 1})
    s3, pairs = tiny_gateway.post("/v1/classify", {"model": CLASSIFY, "raw_scores": True, "input": [
        {"text": t, "text_pair": p} for t, p in zip(TEXTS, PAIRS)]})
    s4, single = tiny_gateway.post("/v1/classify", {"model": SINGLE, "input": TEXTS})
    assert (s1, s2, s3, s4) == (200, 200, 200, 200), (body, top1, pairs, single)
    assert body["object"] == "classify" and body["model"] == CLASSIFY and body["id"].startswith("classify-")
    assert_classified_as_transformers(tiny_tree, TEXTS, body["data"])
    *_, tokens = classify_reference(tiny_tree, CLASSIFIER, TEXTS)
    assert body["usage"] == {"prompt_tokens": int(tokens.sum()), "total_tokens": int(tokens.sum())}
    assert_classified_as_transformers(tiny_tree, TEXTS[1:2], top1["data"], top_k=1)
    assert top1["data"][0][0]["label"] == body["data"][1][0]["label"]
    assert_classified_as_transformers(tiny_tree, TEXTS, pairs["data"], pairs=PAIRS, raw=True)
    *_, pair_tokens = classify_reference(tiny_tree, CLASSIFIER, TEXTS, PAIRS)
    assert pairs["usage"]["total_tokens"] == int(pair_tokens.sum()) > int(tokens.sum())
    assert single["model"] == SINGLE  # the same tokenizer and classifier, for single texts only
    assert_classified_as_transformers(tiny_tree, TEXTS, single["data"])


# -- bad input ---------------------------------------------------------------------------------------------


LONG = "x" * (MAX_TEXT_BYTES + 1)
WIDE = "é" * (MAX_TEXT_BYTES // 2 + 1)  # under the limit in characters, over it in UTF-8 bytes
RERANK_OK = {"model": RANKER, "query": QUERY, "documents": DOCUMENTS[:2]}
CLASSIFY_OK = {"model": CLASSIFY, "input": TEXTS[:2]}

RERANK_BAD = [
    ({"query": None}, 400, "query", "'query' is required"),
    ({"documents": None}, 400, "documents", "'documents' is required"),
    ({"model": None}, 400, "model", "'model' is required"),
    ({"query": ""}, 400, "query", "query is empty"),
    ({"query": "   "}, 400, "query", "query is empty"),
    ({"query": 7}, 400, "query", "query must be a string"),
    ({"query": LONG}, 400, "query", f"the limit is {MAX_TEXT_BYTES}"),
    ({"documents": []}, 400, "documents", "'documents' must be a non-empty list"),
    ({"documents": "one string"}, 400, "documents", "'documents' must be a non-empty list"),
    ({"documents": ["d"] * (MAX_DOCUMENTS + 1)}, 400, "documents", f"the limit is {MAX_DOCUMENTS}"),
    ({"documents": ["fine", ""]}, 400, "documents[1]", "documents[1] is empty"),
    ({"documents": ["fine", 3]}, 400, "documents[1]", "documents[1] must be a string"),
    ({"documents": [WIDE]}, 400, "documents[0]", f"bytes in UTF-8; the limit is {MAX_TEXT_BYTES}"),
    ({"documents": [{"title": "no text"}]}, 400, "documents[0].text", "documents[0].text must be a string"),
    ({"top_n": 0}, 400, "top_n", f"top_n must be an integer in 1..{MAX_DOCUMENTS}, got 0"),
    ({"top_n": -3}, 400, "top_n", "1.."),
    ({"top_n": "2"}, 400, "top_n", "got '2'"),
    ({"top_n": True}, 400, "top_n", "got True"),
    ({"return_documents": "yes"}, 400, "return_documents", "must be true or false"),
    # A 404 lists what the route offers: the rerank models the server was told to load, and only those.
    ({"model": "nope"}, 404, "model", f"it has {', '.join(sorted(served_models(RERANKER)))}"),
    ({"model": CLASSIFY}, 404, "model", "is not a rerank model"),
]
CLASSIFY_BAD = [
    ({"input": None}, 400, "input", "'input' is required"),
    ({"input": []}, 400, "input", "'input' must be a non-empty"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, 400, "input", f"the limit is {MAX_INPUTS}"),
    ({"input": ["ok", " "]}, 400, "input[1]", "input[1] is empty"),
    ({"input": [LONG]}, 400, "input[0]", f"the limit is {MAX_TEXT_BYTES}"),
    ({"input": [["a", "b"]]}, 400, "input[0]", "input[0] must be a string"),
    ({"input": [{"text": "a", "text_pair": ""}]}, 400, "input[0].text_pair", "text_pair is empty"),
    ({"input": [{"text": "a", "text_pair": "b"}, "c"]}, 400, "input[1]", "send a text_pair with every text"),
    ({"input": [{"text": "a", "text_pair": "b"}], "model": SINGLE}, 400, "input[0].text_pair",
     "takes single texts"),
    ({"top_k": LABELS + 1}, 400, "top_k", f"top_k must be an integer in 1..{LABELS}"),
    ({"top_k": 0}, 400, "top_k", f"1..{LABELS}"),
    ({"raw_scores": 1}, 400, "raw_scores", "must be true or false"),
    ({"model": RANKER}, 404, "model", "is not a text-classification model"),
]
BAD = [("rerank", RERANK_OK, *case) for case in RERANK_BAD] + [("classify", CLASSIFY_OK, *case)
                                                               for case in CLASSIFY_BAD]


def assert_good_answer(tree, route: str, ok: dict, status: int, answer: dict) -> None:
    """`ok` answered 200 as the references on the same weights say."""
    assert status == 200, answer
    if route == "rerank":
        order = assert_ranked_as_cross_encoder(tree, ok["query"], ok["documents"], answer["results"])
        assert sorted(order) == list(range(len(ok["documents"])))
    else:
        assert_classified_as_transformers(tree, ok["input"], answer["data"])


@pytest.mark.slow
@pytest.mark.parametrize("route, ok, change, status, param, fragment", BAD,
                         ids=[f"{case[0]}-{case[4]}-{n}" for n, case in enumerate(BAD)])
def test_bad_input_is_named_with_its_limit_and_the_gateway_keeps_serving(tiny_tree, tiny_gateway, route, ok, change,
                                                                         status, param, fragment):
    body = {k: v for k, v in {**ok, **change}.items() if v is not None}  # None: the field left out
    got, answer = tiny_gateway.post(f"/v1/{route}", body)
    assert got == status and answer["error"]["param"] == param and fragment in answer["error"]["message"], answer
    assert_good_answer(tiny_tree, route, ok, *tiny_gateway.post(f"/v1/{route}", ok))


@pytest.mark.slow
def test_a_text_tritons_tokenizer_refuses_is_400_and_not_json_is_400(tiny_tree, tiny_gateway):
    # Past the gateway's checks: the server's tokenizer refuses a text that tokenizes to nothing, in its own words.
    s1, refused = tiny_gateway.post("/v1/rerank", {**RERANK_OK, "documents": ["fine", "\u200b\u200b"]})
    s2, refused_classify = tiny_gateway.post("/v1/classify", {**CLASSIFY_OK, "input": ["\u200b"]})
    s3, garbled = tiny_gateway.post("/v1/rerank", b"{not json")
    s4, listed = tiny_gateway.post("/v1/rerank", [RERANK_OK])
    assert (s1, refused["error"]["param"]) == (400, "documents"), refused
    assert RANKER in refused["error"]["message"] and "has no tokens" in refused["error"]["message"]
    assert (s2, refused_classify["error"]["param"]) == (400, "input"), refused_classify
    assert CLASSIFY in refused_classify["error"]["message"] and "has no tokens" in refused_classify["error"]["message"]
    assert s3 == 400 and "not valid JSON" in garbled["error"]["message"]
    assert s4 == 400 and "must be a JSON object" in listed["error"]["message"]
    assert_good_answer(tiny_tree, "rerank", RERANK_OK, *tiny_gateway.post("/v1/rerank", RERANK_OK))
    assert_good_answer(tiny_tree, "classify", CLASSIFY_OK, *tiny_gateway.post("/v1/classify", CLASSIFY_OK))


@pytest.mark.slow
def test_api_key_guards_the_routes_and_models_lists_them(tiny_tree, tiny_gateway):
    s1, no_key = tiny_gateway.post("/v1/rerank", RERANK_OK, key=None)
    s2, wrong = tiny_gateway.post("/v1/classify", CLASSIFY_OK, key=tiny_gateway.key + "x")
    s3, unlisted = tiny_gateway.get("/v1/models", key=None)
    s4, models = tiny_gateway.get("/v1/models")
    assert (s1, no_key["error"]["code"]) == (401, "missing_api_key")
    assert (s2, wrong["error"]["code"]) == (401, "invalid_api_key")
    assert (s3, unlisted["error"]["code"]) == (401, "missing_api_key")
    assert_good_answer(tiny_tree, "classify", CLASSIFY_OK, *tiny_gateway.post("/v1/classify", CLASSIFY_OK))
    # Every served model of a route's contract, found by its tensors; the ensembles' steps have none of them.
    assert s4 == 200 and {m["id"] for m in models["data"]} == {*served_models(RERANKER), *served_models(CLASSIFIER),
                                                               SINGLE}
    assert {m["object"] for m in models["data"]} == {"model"}


@pytest.mark.slow
def test_embeddings_route_offers_neither_kind(tiny_gateway):
    """This server serves no embedding model (test_gateway.py covers /v1/embeddings on the real MiniLM server)."""
    s1, ranker = tiny_gateway.post("/v1/embeddings", {"model": RANKER, "input": "x"})
    s2, classifier = tiny_gateway.post("/v1/embeddings", {"model": CLASSIFY, "input": "x"})  # a `text` input too
    s3, default = tiny_gateway.post("/v1/embeddings", {"input": "x"})
    s4, empty = tiny_gateway.post("/v1/embeddings", {"model": RANKER, "input": ["ok", ""]})
    for status, answer in ((s1, ranker), (s2, classifier), (s3, default)):
        assert (status, answer["error"]["code"]) == (404, "model_not_found"), answer
        assert "this server has none" in answer["error"]["message"]
    assert (s4, empty["error"]["param"]) == (400, "input[1]") and "input[1] is empty" in empty["error"]["message"]


# -- the client functions' own checks ----------------------------------------------------------------------


def test_ranking_is_best_first_ties_in_input_order_cut_to_top_n():
    result = reranking.Reranked(np.array([0.2, 0.9, 0.2, 0.5], np.float32), np.array([3, 1, 2, 0], np.float32),
                                np.zeros(4, np.int32), np.zeros(4, bool), top_n=3)
    assert [i for i, _ in result.ranking()] == [1, 3, 0]
    assert [i for i, _ in result.ranking(raw=True)] == [0, 2, 1]
    # Checked before any client is made: nothing listens on port 1.
    with pytest.raises(ValueError, match="top_n must be an integer >= 1"):
        reranking.rerank("q", ["d"], model=RANKER, top_n=0, url="127.0.0.1:1")
    with pytest.raises(TypeError, match="not one string"):
        reranking.rerank("q", "d", model=RANKER, url="127.0.0.1:1")


@pytest.mark.slow
def test_classify_plan_follows_the_models_text_pair_input(tiny_server):
    """On the served configs. Not here: a required text_pair (sent empty for none), which no served model has and
    tritonkit's tokenizer would refuse ("text_pair[0] is empty")."""
    with Client(tiny_server.grpc_url, protocol="grpc") as client:
        paired, single = client.model_config(CLASSIFY), client.model_config(SINGLE)
    most = max_batch_size(tiny_server, CLASSIFY)
    texts = [f"t{i}" for i in range(2 * most + 1)]
    batches, k = text_classification._plan(CLASSIFY, paired, texts, None, None, None)
    assert k == LABELS and [len(b["text"]) for b in batches] == [most, most, 1]
    assert not any("text_pair" in b for b in batches)  # optional: left out, not sent empty
    batches, k = text_classification._plan(CLASSIFY, paired, ["a", "b", "c"], ["x", "y", "z"], 2, 2)
    assert k == 2 and [b["text_pair"].reshape(-1).tolist() for b in batches] == [[b"x", b"y"], [b"z"]]
    assert [b["text"].reshape(-1).tolist() for b in batches] == [[b"a", b"b"], [b"c"]]
    with pytest.raises(ClientError, match="takes single texts"):
        text_classification._plan(SINGLE, single, ["a"], ["b"], None, None)
    with pytest.raises(ValueError, match=rf"top_k must be an integer in 1\.\.{LABELS}"):
        text_classification._plan(SINGLE, single, ["a"], None, LABELS + 1, None)
    with pytest.raises(ValueError, match="text_pairs has 2 items for 1 texts"):
        text_classification._plan(CLASSIFY, paired, ["a"], ["b", "c"], None, None)
