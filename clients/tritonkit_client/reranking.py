"""Cross-encoder reranking client for `text-rerank` models: one query and N documents → one score per document.

Each batch row is one (query, document) pair: BYTES `query` [1] and `document` [1] in; FP32 `logit` (raw) and
`score` (after the model's activation), INT32 `num_tokens` and BOOL `truncated` out. One query over N documents is
sent as requests of up to the model's max batch size rows, the query repeated in each row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tritonkit_client.core import AsyncClient, Client, ClientError, chunks, has_tensor, rows_per_request

OUTPUTS = ("score", "logit", "num_tokens", "truncated")


def is_reranker(config: dict) -> bool:
    """A served model with the text-rerank contract (config in JSON form)."""
    return (has_tensor(config, "input", "query", "TYPE_STRING")
            and has_tensor(config, "input", "document", "TYPE_STRING")
            and has_tensor(config, "output", "score", "TYPE_FP32"))


@dataclass
class Reranked:
    scores: np.ndarray  # float32 [n] after the model's activation, in the documents' order
    logits: np.ndarray  # float32 [n] raw
    num_tokens: np.ndarray  # int32 [n] tokens of each (query, document) pair after truncation
    truncated: np.ndarray  # bool [n] the pair was longer than the model's max length
    top_n: int | None = None

    def __len__(self) -> int:
        return len(self.scores)

    def ranking(self, raw: bool = False) -> list[tuple[int, float]]:
        """(document index, score) best first, ties in input order, cut to top_n; raw: by logit."""
        values = self.logits if raw else self.scores
        order = np.argsort(-values, kind="stable")[: self.top_n]
        return [(int(i), float(values[i])) for i in order]


def _contract(model: str, config: dict) -> dict:
    if not is_reranker(config):
        raise ClientError(f"{model}: not a text-rerank model (BYTES query and document in, FP32 score out)")
    return config


def _check(query: str, documents: Sequence[str], top_n: int | None) -> list[str]:
    if not isinstance(query, str):
        raise TypeError(f"query must be a string, not {type(query).__name__}")
    if isinstance(documents, str):
        raise TypeError("documents must be a list of strings, not one string")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise ValueError(f"top_n must be an integer >= 1, got {top_n!r}")
    return list(documents)


def _batches(query: str, documents: list[str], size: int) -> list[dict[str, np.ndarray]]:
    q = query.encode("utf-8")
    return [{"query": np.array([q] * len(part), dtype=object).reshape(-1, 1),
             "document": np.array([d.encode("utf-8") for d in part], dtype=object).reshape(-1, 1)}
            for part in chunks(documents, size)]


def _merge(results: list[dict[str, np.ndarray]], top_n: int | None) -> Reranked:
    def column(name, dtype):
        return np.concatenate([r[name].reshape(-1) for r in results]).astype(dtype) if results else np.zeros(0, dtype)

    return Reranked(column("score", np.float32), column("logit", np.float32), column("num_tokens", np.int32),
                    column("truncated", bool), top_n)


def rerank(query: str, documents: Sequence[str], *, model: str, top_n: int | None = None,
           client: Client | None = None, batch_size: int | None = None, concurrency: int = 4,
           **client_kwargs) -> Reranked:
    """Score every document against the query (scores in input order; `.ranking()` best first, cut to top_n).
    Rows go in requests of `batch_size` (default and cap: the model's max batch size), `concurrency` in flight."""
    documents = _check(query, documents, top_n)
    own = client is None
    client = client or Client(**client_kwargs)
    try:
        if not documents:
            return _merge([], top_n)
        size = rows_per_request(model, _contract(model, client.model_config(model)), batch_size)
        return _merge(client.map(model, _batches(query, documents, size), OUTPUTS, concurrency=concurrency), top_n)
    finally:
        if own:
            client.close()


async def rerank_async(query: str, documents: Sequence[str], *, model: str, top_n: int | None = None,
                       client: AsyncClient | None = None, batch_size: int | None = None, concurrency: int = 4,
                       **client_kwargs) -> Reranked:
    documents = _check(query, documents, top_n)
    own = client is None
    client = client or AsyncClient(**client_kwargs)
    try:
        if not documents:
            return _merge([], top_n)
        size = rows_per_request(model, _contract(model, await client.model_config(model)), batch_size)
        batches = _batches(query, documents, size)
        return _merge(await client.map(model, batches, OUTPUTS, concurrency=concurrency), top_n)
    finally:
        if own:
            await client.close()
