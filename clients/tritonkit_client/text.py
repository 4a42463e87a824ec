"""Text embedding client for the `text_embedding` ensemble (all-MiniLM-L6-v2, 384-dim, L2-normalised)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tritonkit_client.core import AsyncClient, Client, chunks

MODEL = "text_embedding"
OUTPUTS = ("embedding", "num_tokens", "truncated")


@dataclass
class Embeddings:
    vectors: np.ndarray  # float32 [n, 384], L2-normalised
    num_tokens: np.ndarray  # int32 [n] tokens used (after truncation)
    truncated: np.ndarray  # bool [n] the text was longer than the server's max length

    def __len__(self) -> int:
        return len(self.vectors)


def _request(texts: Sequence[str]) -> dict[str, np.ndarray]:
    return {"text": np.array([t.encode("utf-8") for t in texts], dtype=object).reshape(-1, 1)}


def _merge(results: list[dict[str, np.ndarray]]) -> Embeddings:
    if not results:
        return Embeddings(np.zeros((0, 384), np.float32), np.zeros(0, np.int32), np.zeros(0, bool))
    return Embeddings(
        vectors=np.concatenate([r["embedding"] for r in results]).astype(np.float32),
        num_tokens=np.concatenate([r["num_tokens"].reshape(-1) for r in results]),
        truncated=np.concatenate([r["truncated"].reshape(-1) for r in results]).astype(bool),
    )


def embed(texts: Sequence[str], client: Client | None = None, model: str = MODEL, batch_size: int = 32,
          concurrency: int = 4, **client_kwargs) -> Embeddings:
    """Embed texts in batches of `batch_size` with up to `concurrency` requests in flight."""
    own = client is None
    client = client or Client(**client_kwargs)
    try:
        batches = [_request(b) for b in chunks(list(texts), batch_size)]
        return _merge(client.map(model, batches, OUTPUTS, concurrency=concurrency))
    finally:
        if own:
            client.close()


async def embed_async(texts: Sequence[str], client: AsyncClient | None = None, model: str = MODEL,
                      batch_size: int = 32, concurrency: int = 4, **client_kwargs) -> Embeddings:
    own = client is None
    client = client or AsyncClient(**client_kwargs)
    try:
        batches = [_request(b) for b in chunks(list(texts), batch_size)]
        return _merge(await client.map(model, batches, OUTPUTS, concurrency=concurrency))
    finally:
        if own:
            await client.close()


def rank(query: np.ndarray, corpus: np.ndarray, top_k: int = 10) -> list[tuple[int, float]]:
    """Indices and cosine scores of the `top_k` corpus rows nearest the query (embeddings are normalised)."""
    scores = corpus @ query.reshape(-1)
    order = np.argsort(-scores, kind="stable")[:top_k]
    return [(int(i), float(scores[i])) for i in order]
