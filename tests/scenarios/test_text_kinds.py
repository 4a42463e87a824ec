"""text-rerank and text-classification end to end on a real tritonserver: `add` → `build` → serve tiny random
BERT and XLM-RoBERTa sequence classifiers (tests/support/tiny_kinds.py), and check every served model (the INT8
ensemble, its `_fp32` twin and `_fused`) against sentence-transformers' CrossEncoder and transformers on the same
weights, bad input failing alone with the field and the limit named.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.tiny_kinds import TINY, build_tiny_kinds, serve_tiny_kinds, served_models
from tritonkit import data

pytestmark = pytest.mark.slow

RERANK = [n for n, t in TINY.items() if t.kind == "text-rerank"]
CLASSIFY = [n for n, t in TINY.items() if t.kind == "text-classification"]
# FP32 served (ONNX Runtime or OpenVINO) against torch: kernel order only.
FP32_ATOL = 1e-3


@pytest.fixture(scope="module")
def tree():
    return build_tiny_kinds()


@pytest.fixture(scope="module")
def server(start_server, tree):
    return serve_tiny_kinds(start_server, tree)


def infer(server, model: str, texts: dict[str, list], outputs: list[str], class_count: int = 0) -> dict:
    """One request: each BYTES input's rows (str or raw bytes), the named outputs as numpy."""
    client = httpclient.InferenceServerClient(server.http_url)
    inputs = []
    for name, rows in texts.items():
        array = np.array([[r.encode() if isinstance(r, str) else r] for r in rows], dtype=object)
        inputs.append(httpclient.InferInput(name, list(array.shape), "BYTES"))
        inputs[-1].set_data_from_numpy(array)
    requested = [httpclient.InferRequestedOutput(o, class_count=class_count) for o in outputs]
    result = client.infer(model, inputs, outputs=requested)
    return {o: result.as_numpy(o) for o in outputs}


def documents(n: int = 12) -> tuple[str, list[str]]:
    texts = data.eval_texts("test")
    return "what does the manual say about files", [texts[i * 37] for i in range(n)]


# -- text-rerank ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RERANK)
def test_rerank_scores_match_cross_encoder_in_input_order(server, tree, name):
    """One request of N rows (the query repeated, one document each): a logit and a score per document, in input
    order, as CrossEncoder.predict gives them on the same weights (raw, and with its default activation)."""
    import torch

    query, docs = documents()
    ce = tree.cross_encoder(name)
    want_logit = ce.predict([(query, d) for d in docs], activation_fn=torch.nn.Identity())
    want_score = ce.predict([(query, d) for d in docs])
    np.testing.assert_allclose(want_score, 1 / (1 + np.exp(-want_logit)), atol=1e-6)  # sigmoid: one logit
    for model in served_models(name):
        got = infer(server, model, {"query": [query] * len(docs), "document": docs},
                    ["logit", "score", "num_tokens", "truncated"])
        assert got["logit"].shape == got["score"].shape == (len(docs), 1)
        np.testing.assert_allclose(got["score"][:, 0], 1 / (1 + np.exp(-got["logit"][:, 0])), atol=1e-6)
        if model.endswith("_fp32"):
            np.testing.assert_allclose(got["logit"][:, 0], want_logit, atol=FP32_ATOL)
            np.testing.assert_allclose(got["score"][:, 0], want_score, atol=FP32_ATOL)
        else:  # INT8 (or its FP32 fallback): the build judged its rankings; here it keeps the top document
            assert np.argmax(got["logit"][:, 0]) == np.argmax(want_logit) or \
                np.sort(want_logit)[-1] - np.sort(want_logit)[-2] < 0.05, model


@pytest.mark.parametrize("name", RERANK)
def test_rerank_truncates_the_document_only_and_flags_it(server, tree, name):
    """Query first, the document cut at max_length (transformers' only_second); num_tokens and truncated say so."""
    import torch

    tokenizer, model = tree.transformers(name)
    max_length = tree.spec(name).MAX_LENGTH
    query, long_doc = "a question about the text", " ".join(data.eval_texts("test")[:40])
    enc = tokenizer([query], [long_doc], truncation="only_second", max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        want = model(**enc).logits[0, 0].item()
    got = infer(server, f"{name}_fp32", {"query": [query, query], "document": [long_doc, "short"]},
                ["logit", "num_tokens", "truncated"])
    assert got["truncated"][:, 0].tolist() == [True, False]
    assert int(got["num_tokens"][0, 0]) == max_length
    assert abs(float(got["logit"][0, 0]) - want) < FP32_ATOL


@pytest.mark.parametrize("model_suffix", ["", "_fused"])
def test_rerank_bad_input_fails_alone_naming_the_field_and_limit(server, tree, model_suffix):
    name = RERANK[0]
    model = f"{name}{model_suffix}"
    max_length = tree.spec(name).MAX_LENGTH
    cases = [
        ({"query": ["q"], "document": [""]}, "document[0] is empty"),
        ({"query": ["q", "q"], "document": ["fine", b"\xff\xfe"]}, "document[1] is not valid UTF-8"),
        ({"query": ["word " * (2 * max_length)], "document": ["d"]}, f"max_length {max_length}"),
    ]
    for texts, words in cases:
        with pytest.raises(InferenceServerException) as err:
            infer(server, model, texts, ["score"])
        assert words in str(err.value), str(err.value)
        assert "400" in str(err.value.status()), err.value.status()
    ok = infer(server, model, {"query": ["q"], "document": ["a document"]}, ["score"])
    assert ok["score"].shape == (1, 1)


def test_rerank_pairs_of_concurrent_requests_are_batched_and_answered_as_alone(server):
    name = RERANK[0]
    query, docs = documents(8)
    alone = [infer(server, f"{name}_fp32", {"query": [query], "document": [d]}, ["logit"])["logit"] for d in docs]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda d: infer(server, f"{name}_fp32", {"query": [query], "document": [d]},
                                                 ["logit"])["logit"], docs * 4))
    for i, got in enumerate(together):
        np.testing.assert_allclose(got, alone[i % len(docs)], atol=1e-5)


# -- text-classification -------------------------------------------------------------------------------------------


def _reference(tree, name: str, texts: list[str], pairs: list[str] | None) -> np.ndarray:
    import torch

    tokenizer, model = tree.transformers(name)
    args = (texts, pairs) if pairs else (texts,)
    enc = tokenizer(*args, padding=True, truncation=True, max_length=tree.spec(name).MAX_LENGTH, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits.numpy()


@pytest.mark.parametrize("name", CLASSIFY)
def test_classification_matches_transformers_for_texts_and_pairs(server, tree, name):
    """Single texts (text_pair left out) and NLI-style pairs; scores are the activation the config's problem_type
    names (softmax for single-label, sigmoid for multi-label)."""
    kind = tree.spec(name)
    texts = data.eval_texts("test")[5:13]
    pairs = data.eval_texts("test")[105:113]
    activation = kind.spec.facts.activation
    assert activation == ("softmax" if TINY[name].problem_type == "single_label_classification" else "sigmoid")
    for second in (None, pairs):
        want = _reference(tree, name, texts, second)
        want_scores = (np.exp(want) / np.exp(want).sum(1, keepdims=True)) if activation == "softmax" else \
            1 / (1 + np.exp(-want))
        for model in served_models(name):
            feed = {"text": texts, **({"text_pair": second} if second else {})}
            got = infer(server, model, feed, ["logits", "scores", "num_tokens", "truncated"])
            assert got["logits"].shape == (len(texts), kind.spec.facts.num_labels)
            if model.endswith("_fp32"):
                np.testing.assert_allclose(got["logits"], want, atol=FP32_ATOL)
                np.testing.assert_allclose(got["scores"], want_scores, atol=FP32_ATOL)


@pytest.mark.parametrize("name", CLASSIFY)
def test_classification_extension_gives_top_k_with_the_config_labels(server, tree, name):
    kind = tree.spec(name)
    texts = data.eval_texts("test")[20:24]
    for model in served_models(name):
        full = infer(server, model, {"text": texts}, ["scores"])["scores"]
        top = infer(server, model, {"text": texts}, ["scores"], class_count=2)["scores"]
        assert top.shape == (len(texts), 2)
        for row, entries in enumerate(top):
            score, index, label = entries[0].decode().split(":")
            assert int(index) == int(np.argmax(full[row])), (model, entries)
            assert label == kind.spec.facts.labels[int(index)]
            assert abs(float(score) - full[row].max()) < 1e-5


def test_classification_bad_input_fails_alone(server):
    name = CLASSIFY[0]
    for model in served_models(name):
        for texts, words in (({"text": ["fine", ""]}, "text[1] is empty"),
                             ({"text": ["a"], "text_pair": [b"\xc3"]}, "text_pair[0] is not valid UTF-8"),
                             # Triton itself refuses rows that differ in number, naming the input.
                             ({"text": ["a", "b"], "text_pair": ["c"]}, "batch size does not match")):
            with pytest.raises(InferenceServerException) as err:
                infer(server, model, texts, ["scores"])
            assert words in str(err.value), (model, str(err.value))
        assert infer(server, model, {"text": ["still serving"]}, ["scores"])["scores"].shape[0] == 1


@pytest.mark.parametrize("name", list(TINY))
def test_build_judged_int8_by_the_kinds_own_gates(tree, name):
    """The served form was searched and judged by the kind's metrics (rank agreement; top-1 and KL) against its
    floor: INT8 serves, or FP32 does with the reason (these tiny models are too narrow for INT8 to outrun FP32)."""
    import json

    report = json.loads((tree.root / "build" / "reports" / f"{name}_int8.json").read_text())
    metrics = {t.metric for t in tree.spec(name).TARGETS}
    assert all(f'"{m}"' in json.dumps(report) for m in metrics), metrics
    assert report["status"] in ("passed", "fp32-fallback"), report.get("missed")
    if report["status"] == "fp32-fallback":
        assert report.get("reason"), report
