"""The gateway's /v1/rerank and /v1/classify in process, over a stand-in for Triton that computes its answers from the
request: routing, ranking, top_n / top_k, return_documents, pairs, usage, the API key, and every bad input answered
400 naming the field and the limit while the gateway keeps serving. The real server is in test_rerank_classify.py."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tritonkit_client import ClientError, reranking, text_classification
from tritonkit_client.gateway import MAX_DOCUMENTS, MAX_INPUTS, MAX_TEXT_BYTES, Gateway

RANKER, CLASSIFIER, SINGLE = "ranker", "classifier", "single_classifier"
LABELS = ["negative", "neutral", "positive"]
KEY = "tk-routes-5b1d"


def _config(inputs: dict[str, bool], outputs: dict[str, int], max_batch: int) -> dict:
    """A config in Triton's JSON form: BYTES inputs (name → optional), FP32 outputs (name → width)."""
    return {
        "max_batch_size": max_batch,
        "input": [{"name": n, "data_type": "TYPE_STRING", "dims": ["1"], **({"optional": True} if o else {})}
                  for n, o in inputs.items()],
        "output": [{"name": n, "data_type": "TYPE_FP32", "dims": [str(w)]} for n, w in outputs.items()]
                  + [{"name": "num_tokens", "data_type": "TYPE_INT32", "dims": ["1"]}],
    }


CONFIGS = {
    RANKER: _config({"query": False, "document": False}, {"logit": 1, "score": 1}, max_batch=16),
    CLASSIFIER: _config({"text": False, "text_pair": True}, {"logits": 3, "scores": 3}, max_batch=8),
    SINGLE: _config({"text": False}, {"logits": 3, "scores": 3}, max_batch=8),
    "embedder": _config({"text": False}, {"embedding": 4}, max_batch=8),
    "tokenizer": {"max_batch_size": 8, "input": [{"name": "text", "data_type": "TYPE_STRING", "dims": ["1"]}],
                  "output": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": ["-1"]}]},
}


def words(text: str) -> set[str]:
    return set(text.lower().replace(".", "").split())


def tokens(*texts: str) -> int:
    return 2 + sum(len(t.split()) for t in texts)


def ref_logit(query: str, document: str) -> float:
    """The stand-in reranker: shared words, less a little per document word (no two test documents tie)."""
    return len(words(query) & words(document)) - 0.01 * len(document.split()) - 0.5


def ref_logits(text: str, pair: str | None) -> np.ndarray:
    text = f"{text} {pair or ''}".lower()
    return np.array([text.count("bad"), 0.5 + text.count("meh"), text.count("good")], np.float64)


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


class FakeTriton:
    """What the routes call on tritonkit_client's AsyncClient, answered as the served contracts would; each batch's
    rows are recorded."""

    def __init__(self):
        self.batches: list[tuple[str, int]] = []

    async def model_configs(self) -> dict:
        return CONFIGS

    async def model_config(self, model: str) -> dict:
        return CONFIGS[model]

    async def check_ready(self, model=None) -> None:
        return None

    async def close(self) -> None:
        return None

    async def map(self, model, batches, outputs, concurrency=1, class_count=None):
        return [self._infer(model, batch, outputs, class_count or {}) for batch in batches]

    def _infer(self, model, inputs, outputs, class_count):
        rows = len(next(iter(inputs.values())))
        assert rows <= CONFIGS[model]["max_batch_size"], "a request over the model's max batch size"
        self.batches.append((model, rows))
        texts = {name: [v.decode() for v in array.reshape(-1)] for name, array in inputs.items()}
        if any("explode" in t for column in texts.values() for t in column):
            raise ClientError(f"{model}: tokenizer: text[0] is refused (the server's own check)")
        if model == "embedder":  # a unit vector from the text's length
            vectors = np.array([[len(t), 1, 0, 0] for t in texts["text"]], np.float32)
            return {"embedding": vectors / np.linalg.norm(vectors, axis=1, keepdims=True),
                    "num_tokens": np.array([[tokens(t)] for t in texts["text"]], np.int32),
                    "truncated": np.zeros((rows, 1), bool)}
        if model == RANKER:
            logit = np.array([[ref_logit(q, d)] for q, d in zip(texts["query"], texts["document"])], np.float32)
            return {"logit": logit, "score": 1 / (1 + np.exp(-logit)), "truncated": np.zeros((rows, 1), bool),
                    "num_tokens": np.array([[tokens(q, d)] for q, d in zip(texts["query"], texts["document"])],
                                           np.int32)}
        pairs = texts.get("text_pair", [None] * rows)
        logits = np.array([ref_logits(t, p) for t, p in zip(texts["text"], pairs)], np.float32)
        scores = np.array([softmax(z) for z in logits.astype(np.float64)], np.float32)
        k = class_count["scores"]
        top = [[f"{row[i]:f}:{i}:{LABELS[i]}".encode() for i in np.argsort(-row, kind="stable")[:k]] for row in scores]
        return {"scores": np.array(top, dtype=object), "logits": logits, "truncated": np.zeros((rows, 1), bool),
                "num_tokens": np.array([[tokens(t, p or "")] for t, p in zip(texts["text"], pairs)], np.int32)}


def run(scenario, api_key: str | None = None, batch_size: int = 32):
    """scenario(http, fake) against a gateway on a free port whose Triton is the stand-in."""
    fake = FakeTriton()

    async def main():
        gateway = Gateway("unused:0", batch_size=batch_size, triton_model=None, api_key=api_key)

        async def startup(_app):
            gateway.client = fake

        gateway._startup = startup
        async with TestClient(TestServer(gateway.app())) as http:
            return await scenario(http, fake)

    return asyncio.run(main())


async def post(http, path: str, body, key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = await http.post(path, json=body, headers=headers)
    return response.status, await response.json()


QUERY = "where is the capital of france"
DOCUMENTS = [
    "Berlin is the capital of Germany.",
    "Paris is the capital of France.",
    "The weather is sunny today.",
    "France is a country in western Europe where people speak French.",
    "Where is the nearest bus stop?",
]


def reference_ranking(query: str, documents: list[str]) -> list[tuple[int, float]]:
    scores = [1 / (1 + math.exp(-ref_logit(query, d))) for d in documents]
    return sorted(enumerate(scores), key=lambda p: -p[1])


def test_rerank_answers_best_first_with_scores_usage_and_documents():
    async def scenario(http, _fake):
        full = await post(http, "/v1/rerank", {"model": RANKER, "query": QUERY, "documents": DOCUMENTS})
        top = await post(http, "/v1/rerank", {"model": RANKER, "query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                              "return_documents": True})
        many = await post(http, "/v1/rerank", {"model": RANKER, "query": QUERY, "documents": DOCUMENTS, "top_n": 50})
        raw = await post(http, "/v1/rerank", {"model": RANKER, "query": QUERY, "raw_scores": True,
                                              "documents": [{"text": d} for d in DOCUMENTS]})
        return full, top, many, raw

    (status, full), (s2, top), (s3, many), (s4, raw) = run(scenario)
    assert (status, s2, s3, s4) == (200, 200, 200, 200), (full, top, many, raw)
    want = reference_ranking(QUERY, DOCUMENTS)
    assert [r["index"] for r in full["results"]] == [i for i, _ in want]
    np.testing.assert_allclose([r["relevance_score"] for r in full["results"]], [s for _, s in want], rtol=1e-6)
    assert full["object"] == "rerank" and full["model"] == RANKER and "document" not in full["results"][0]
    assert full["usage"]["prompt_tokens"] == full["usage"]["total_tokens"] == sum(tokens(QUERY, d) for d in DOCUMENTS)
    assert [(r["index"], r["document"]["text"]) for r in top["results"]] == [(i, DOCUMENTS[i]) for i, _ in want[:2]]
    assert len(many["results"]) == len(DOCUMENTS)  # top_n past the documents: all of them, as Cohere does
    logits = sorted(((i, ref_logit(QUERY, d)) for i, d in enumerate(DOCUMENTS)), key=lambda p: -p[1])
    assert [r["index"] for r in raw["results"]] == [i for i, _ in logits]
    np.testing.assert_allclose([r["relevance_score"] for r in raw["results"]], [v for _, v in logits], rtol=1e-6)


def test_rerank_sends_pairs_in_batches_of_the_model_and_keeps_the_documents_order():
    documents = [f"document {i} about {'france capital' if i % 7 == 0 else 'nothing'} " + "word " * (i % 5)
                 for i in range(70)]

    async def scenario(http, fake):
        return await post(http, "/v1/rerank", {"model": RANKER, "query": QUERY, "documents": documents}), fake.batches

    (status, body), batches = run(scenario, batch_size=12)
    assert status == 200, body
    assert sorted(rows for _, rows in batches) == sorted([12] * 5 + [10])  # --batch-size 12, under the model's 16
    want = reference_ranking(QUERY, documents)
    assert [r["index"] for r in body["results"]] == [i for i, _ in want]


def test_classify_answers_every_label_best_first_and_takes_pairs():
    texts = ["good good food", "bad service, meh", "meh"]

    async def scenario(http, _fake):
        return (await post(http, "/v1/classify", {"model": CLASSIFIER, "input": texts}),
                await post(http, "/v1/classify", {"model": CLASSIFIER, "input": "bad and good and good", "top_k": 1}),
                await post(http, "/v1/classify", {"model": CLASSIFIER, "raw_scores": True, "input": [
                    {"text": "a premise", "text_pair": "bad bad"}, {"text": "good", "text_pair": "meh meh"}]}))

    (status, body), (s2, top1), (s3, pairs) = run(scenario)
    assert (status, s2, s3) == (200, 200, 200), (body, top1, pairs)
    assert body["object"] == "classify" and body["model"] == CLASSIFIER and len(body["data"]) == len(texts)
    for text, labels in zip(texts, body["data"]):
        probs = softmax(ref_logits(text, None))
        order = np.argsort(-probs, kind="stable")
        assert [x["label"] for x in labels] == [LABELS[i] for i in order]
        np.testing.assert_allclose([x["score"] for x in labels], probs[order], atol=1e-6)  # Triton's 6 decimals
    assert body["usage"]["total_tokens"] == sum(tokens(t) for t in texts)
    assert [x["label"] for x in top1["data"][0]] == ["positive"]
    for (text, pair), labels in zip([("a premise", "bad bad"), ("good", "meh meh")], pairs["data"]):
        logits = ref_logits(text, pair)
        order = np.argsort(-softmax(logits), kind="stable")
        assert [x["label"] for x in labels] == [LABELS[i] for i in order]
        np.testing.assert_allclose([x["score"] for x in labels], logits[order], rtol=1e-6)


LONG = "x" * (MAX_TEXT_BYTES + 1)
WIDE = "é" * (MAX_TEXT_BYTES // 2 + 1)  # under the limit in characters, over it in UTF-8 bytes
RERANK_OK = {"model": RANKER, "query": "q", "documents": ["d"]}


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
    ({"model": "nope"}, 404, "model", f"it has {RANKER}"),
    ({"model": CLASSIFIER}, 404, "model", "is not a rerank model"),
]
CLASSIFY_OK = {"model": CLASSIFIER, "input": ["good"]}
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
    ({"top_k": 4}, 400, "top_k", "top_k must be an integer in 1..3"),
    ({"top_k": 0}, 400, "top_k", "1..3"),
    ({"raw_scores": 1}, 400, "raw_scores", "must be true or false"),
    ({"model": RANKER}, 404, "model", "is not a text-classification model"),
]


@pytest.mark.parametrize(
    "path, ok, change, status, param, fragment",
    [("/v1/rerank", RERANK_OK, *case) for case in RERANK_BAD]
    + [("/v1/classify", CLASSIFY_OK, *case) for case in CLASSIFY_BAD],
)
def test_bad_input_is_400_naming_the_field_and_the_gateway_keeps_serving(path, ok, change, status, param, fragment):
    body = {k: v for k, v in {**ok, **change}.items() if v is not None}  # None: the field left out

    async def scenario(http, _fake):
        return await post(http, path, body), await post(http, path, ok)

    (got, answer), (after, good) = run(scenario)
    assert got == status and answer["error"]["param"] == param and fragment in answer["error"]["message"], answer
    assert after == 200
    assert (good["results"][0]["index"] if "results" in good else good["data"][0][0]["label"]) in (0, "positive")


def test_a_model_error_from_triton_is_400_and_not_json_is_400():
    async def scenario(http, _fake):
        refused = await post(http, "/v1/rerank", {**RERANK_OK, "documents": ["fine", "explode"]})
        refused_classify = await post(http, "/v1/classify", {**CLASSIFY_OK, "input": ["explode"]})
        garbled = await http.post("/v1/rerank", data=b"{not json", headers={"Content-Type": "application/json"})
        return refused, refused_classify, garbled.status, await post(http, "/v1/rerank", RERANK_OK)

    (s1, refused), (s2, refused_classify), s3, (after, _) = run(scenario)
    assert (s1, refused["error"]["param"]) == (400, "documents") and "the server's own check" in str(refused)
    assert (s2, refused_classify["error"]["param"]) == (400, "input")
    assert (s3, after) == (400, 200)


def test_api_key_guards_the_new_routes_and_models_lists_them():
    async def scenario(http, _fake):
        no_key = await post(http, "/v1/rerank", RERANK_OK)
        wrong = await post(http, "/v1/classify", CLASSIFY_OK, key=KEY + "x")
        good = await post(http, "/v1/classify", CLASSIFY_OK, key=KEY)
        models = await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        return no_key, wrong, good, await models.json()

    (s1, no_key), (s2, wrong), (s3, _), models = run(scenario, api_key=KEY)
    assert (s1, no_key["error"]["code"]) == (401, "missing_api_key")
    assert (s2, wrong["error"]["code"]) == (401, "invalid_api_key")
    assert s3 == 200
    assert {m["id"] for m in models["data"]} == {RANKER, CLASSIFIER, SINGLE, "embedder"}


def test_embeddings_route_is_unchanged_beside_them():
    async def scenario(http, _fake):
        return (await post(http, "/v1/embeddings", {"model": "embedder", "input": ["ab", "abcd"], "dimensions": 2}),
                await post(http, "/v1/embeddings", {"model": "embedder", "input": ["ok", ""]}),
                await post(http, "/v1/embeddings", {"model": RANKER, "input": "x"}))

    (status, body), (bad, error), (missing, not_found) = run(scenario)
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1]
    for text, row in zip(["ab", "abcd"], body["data"]):
        np.testing.assert_allclose(row["embedding"], np.array([len(text), 1]) / math.hypot(len(text), 1), rtol=1e-6)
    assert body["usage"]["total_tokens"] == tokens("ab") + tokens("abcd")
    assert (bad, error["error"]["param"]) == (400, "input[1]") and "input[1] is empty" in error["error"]["message"]
    assert (missing, not_found["error"]["code"]) == (404, "model_not_found")


# -- the client functions' own checks -----------------------------------------------------------------------


def test_ranking_is_best_first_ties_in_input_order_cut_to_top_n():
    result = reranking.Reranked(np.array([0.2, 0.9, 0.2, 0.5], np.float32), np.array([3, 1, 2, 0], np.float32),
                                np.zeros(4, np.int32), np.zeros(4, bool), top_n=3)
    assert [i for i, _ in result.ranking()] == [1, 3, 0]
    assert [i for i, _ in result.ranking(raw=True)] == [0, 2, 1]
    with pytest.raises(ValueError, match="top_n must be an integer >= 1"):
        reranking.rerank("q", ["d"], model=RANKER, top_n=0, client=object())
    with pytest.raises(TypeError, match="not one string"):
        reranking.rerank("q", "d", model=RANKER, client=object())


def test_classify_plan_follows_the_models_text_pair_input():
    required = _config({"text": False, "text_pair": False}, {"logits": 3, "scores": 3}, max_batch=2)
    batches, k = text_classification._plan("m", required, ["a", "b", "c"], None, None, None)
    assert k == 3 and [len(b["text"]) for b in batches] == [2, 1]
    assert [b["text_pair"].reshape(-1).tolist() for b in batches] == [[b"", b""], [b""]]  # required: empty = none
    batches, k = text_classification._plan("m", CONFIGS[CLASSIFIER], ["a"], ["b"], 2, 5)
    assert k == 2 and batches[0]["text_pair"].reshape(-1).tolist() == [b"b"]
    assert "text_pair" not in text_classification._plan("m", CONFIGS[CLASSIFIER], ["a"], None, 1, None)[0][0]
    with pytest.raises(ClientError, match="takes single texts"):
        text_classification._plan("m", CONFIGS[SINGLE], ["a"], ["b"], None, None)
    with pytest.raises(ValueError, match=r"top_k must be an integer in 1\.\.3"):
        text_classification._plan("m", CONFIGS[SINGLE], ["a"], None, 4, None)
    with pytest.raises(ValueError, match="text_pairs has 2 items for 1 texts"):
        text_classification._plan("m", CONFIGS[CLASSIFIER], ["a"], ["b", "c"], None, None)
