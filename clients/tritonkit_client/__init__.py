"""tritonkit_client: small clients for the tritonkit Triton deployments (HTTP/gRPC, sync/asyncio)."""

from tritonkit_client.core import AsyncClient, Client, ClientError, ServerUnavailable
from tritonkit_client.text import Embeddings, embed, embed_async, rank

__all__ = [
    "AsyncClient",
    "Client",
    "ClientError",
    "Embeddings",
    "ServerUnavailable",
    "embed",
    "embed_async",
    "rank",
]
