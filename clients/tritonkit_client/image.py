"""Image classification client for the `image_classification` ensemble (EfficientNet-Lite0, ImageNet-1k).

Images travel as their encoded file bytes (JPEG, PNG, WebP); the server decodes, resizes and normalises them.
Top-k labels come from Triton's classification extension (class_count on PROBABILITIES).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tritonkit_client.core import AsyncClient, Client, ClientError, Prediction, chunks, parse_classifications

MODEL = "image_classification"
INPUT = "IMAGE"
OUTPUT = "PROBABILITIES"


def read_images(paths: Sequence[str | Path]) -> list[bytes]:
    out = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ClientError(f"{p}: no such file")
        out.append(path.read_bytes())
    return out


def _request(images: Sequence[bytes]) -> dict[str, np.ndarray]:
    return {INPUT: np.array(list(images), dtype=object).reshape(-1, 1)}


def _merge(results: list[dict[str, np.ndarray]]) -> list[list[Prediction]]:
    return [row for r in results for row in parse_classifications(r[OUTPUT])]


def classify(images: Sequence[bytes], top_k: int = 5, client: Client | None = None, model: str = MODEL,
             batch_size: int = 8, concurrency: int = 2, shared_memory: bool = False,
             **client_kwargs) -> list[list[Prediction]]:
    """Top-k predictions per image (in input order)."""
    own = client is None
    client = client or Client(**client_kwargs)
    try:
        batches = [_request(b) for b in chunks(list(images), batch_size)]
        results = client.map(model, batches, [OUTPUT], concurrency=concurrency,
                             class_count={OUTPUT: top_k}, shared_memory=shared_memory)
        return _merge(results)
    finally:
        if own:
            client.close()


async def classify_async(images: Sequence[bytes], top_k: int = 5, client: AsyncClient | None = None,
                         model: str = MODEL, batch_size: int = 8, concurrency: int = 2,
                         shared_memory: bool = False, **client_kwargs) -> list[list[Prediction]]:
    own = client is None
    client = client or AsyncClient(**client_kwargs)
    try:
        batches = [_request(b) for b in chunks(list(images), batch_size)]
        results = await client.map(model, batches, [OUTPUT], concurrency=concurrency,
                                   class_count={OUTPUT: top_k}, shared_memory=shared_memory)
        return _merge(results)
    finally:
        if own:
            await client.close()


def probabilities(images: Sequence[bytes], client: Client | None = None, model: str = MODEL,
                  outputs: Sequence[str] = ("PROBABILITIES", "LOGITS"), **client_kwargs) -> dict[str, np.ndarray]:
    """Raw float32 [n, 1000] outputs (no classification extension), one request."""
    own = client is None
    client = client or Client(**client_kwargs)
    try:
        return client.infer(model, _request(images), list(outputs))
    finally:
        if own:
            client.close()
