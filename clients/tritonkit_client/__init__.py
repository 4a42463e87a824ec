"""tritonkit_client: small clients for the tritonkit Triton deployments (HTTP/gRPC, sync/asyncio)."""

from tritonkit_client.core import AsyncClient, Client, ClientError, Prediction, ServerUnavailable
from tritonkit_client.reranking import Reranked, rerank, rerank_async
from tritonkit_client.text import Embeddings, embed, embed_async, rank
from tritonkit_client.text_classification import TextClassification, classify_text, classify_text_async

__all__ = [
    "AsyncClient",
    "Client",
    "ClientError",
    "Embeddings",
    "Prediction",
    "Reranked",
    "ServerUnavailable",
    "TextClassification",
    "classify_text",
    "classify_text_async",
    "embed",
    "embed_async",
    "rank",
    "rerank",
    "rerank_async",
]
