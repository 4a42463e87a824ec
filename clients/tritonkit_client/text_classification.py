"""Text classification client for `text-classification` models: a text (or a text pair, e.g. NLI) → labels.

BYTES `text` [1] (and `text_pair` [1], optional, where the model takes pairs) in; FP32 `logits` and `scores`
[num_labels] (softmax, sigmoid or identity, as the model's config says), INT32 `num_tokens` and BOOL `truncated`
out. Top-k labels come from Triton's classification extension on `scores` (class_count), which reads the labels
from the model's label file: 'score:index:label'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tritonkit_client.core import (
    AsyncClient,
    Client,
    ClientError,
    Prediction,
    has_tensor,
    parse_classifications,
    rows_per_request,
    tensors,
)

SCORES = "scores"
OUTPUTS = (SCORES, "logits", "num_tokens", "truncated")


def is_text_classifier(config: dict) -> bool:
    """A served model with the text-classification contract (config in JSON form)."""
    return has_tensor(config, "input", "text", "TYPE_STRING") and has_tensor(config, "output", SCORES, "TYPE_FP32")


def num_labels(config: dict) -> int:
    return int(tensors(config, "output")[SCORES]["dims"][-1])


def takes_pairs(config: dict) -> bool:
    return has_tensor(config, "input", "text_pair", "TYPE_STRING")


@dataclass
class TextClassification:
    predictions: list[list[Prediction]]  # per text, top-k labels best first
    logits: np.ndarray  # float32 [n, num_labels] raw, label index order
    num_tokens: np.ndarray  # int32 [n] tokens used (after truncation)
    truncated: np.ndarray  # bool [n] the text (pair) was longer than the model's max length

    def __len__(self) -> int:
        return len(self.predictions)


def _plan(model: str, config: dict, texts: Sequence[str], text_pairs: Sequence[str] | None, top_k: int | None,
          batch_size: int | None) -> tuple[list[dict[str, np.ndarray]], int]:
    """The requests' inputs and the top-k to ask for, checked against the model's config."""
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings, not one string")
    if not is_text_classifier(config):
        raise ClientError(f"{model}: not a text-classification model (BYTES text in, FP32 scores out)")
    texts = list(texts)
    labels = num_labels(config)
    k = labels if top_k is None else top_k
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= labels:
        raise ValueError(f"top_k must be an integer in 1..{labels} for model '{model}', got {top_k!r}")
    pairs = None if text_pairs is None else list(text_pairs)
    if pairs is not None and len(pairs) != len(texts):
        raise ValueError(f"text_pairs has {len(pairs)} items for {len(texts)} texts")
    pair_input = tensors(config, "input").get("text_pair")
    if pairs is not None and pair_input is None:
        raise ClientError(f"{model}: this model takes single texts, not text pairs")
    if pairs is None and pair_input is not None and not pair_input.get("optional", False):
        # Only a hand-written config requires it (tritonkit's are optional); Triton refuses a request without it.
        pairs = [""] * len(texts)
    size = rows_per_request(model, config, batch_size)
    batches = []
    for start in range(0, len(texts), size):
        batch = {"text": _column(texts[start : start + size])}
        if pairs is not None:
            batch["text_pair"] = _column(pairs[start : start + size])
        batches.append(batch)
    return batches, k


def _column(items: Sequence[str]) -> np.ndarray:
    return np.array([t.encode("utf-8") for t in items], dtype=object).reshape(-1, 1)


def _merge(results: list[dict[str, np.ndarray]], labels: int) -> TextClassification:
    if not results:
        return TextClassification([], np.zeros((0, labels), np.float32), np.zeros(0, np.int32), np.zeros(0, bool))
    return TextClassification(
        predictions=[row for r in results for row in parse_classifications(r[SCORES])],
        logits=np.concatenate([r["logits"].reshape(len(r["logits"]), -1) for r in results]).astype(np.float32),
        num_tokens=np.concatenate([r["num_tokens"].reshape(-1) for r in results]).astype(np.int32),
        truncated=np.concatenate([r["truncated"].reshape(-1) for r in results]).astype(bool),
    )


def classify_text(texts: Sequence[str], text_pairs: Sequence[str] | None = None, *, model: str,
                  top_k: int | None = None, client: Client | None = None, batch_size: int | None = None,
                  concurrency: int = 4, **client_kwargs) -> TextClassification:
    """Top-k labels (default: all, best first) per text or (text, text_pair), in input order. Rows go in requests
    of `batch_size` (default and cap: the model's max batch size), `concurrency` in flight."""
    own = client is None
    client = client or Client(**client_kwargs)
    try:
        config = client.model_config(model)
        batches, k = _plan(model, config, texts, text_pairs, top_k, batch_size)
        results = client.map(model, batches, OUTPUTS, concurrency=concurrency, class_count={SCORES: k})
        return _merge(results, num_labels(config))
    finally:
        if own:
            client.close()


async def classify_text_async(texts: Sequence[str], text_pairs: Sequence[str] | None = None, *, model: str,
                              top_k: int | None = None, client: AsyncClient | None = None,
                              batch_size: int | None = None, concurrency: int = 4,
                              **client_kwargs) -> TextClassification:
    own = client is None
    client = client or AsyncClient(**client_kwargs)
    try:
        config = await client.model_config(model)
        batches, k = _plan(model, config, texts, text_pairs, top_k, batch_size)
        results = await client.map(model, batches, OUTPUTS, concurrency=concurrency, class_count={SCORES: k})
        return _merge(results, num_labels(config))
    finally:
        if own:
            await client.close()
