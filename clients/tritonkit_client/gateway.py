"""OpenAI-compatible `POST /v1/embeddings` for every text-embedding model a Triton server serves (aiohttp, gRPC).

Speaks the protocol LangChain, LlamaIndex and the OpenAI SDKs use: `input` (string or list of strings),
`encoding_format` (float | base64), `dimensions` (truncate, then re-normalise), `usage` token counts from the
server's tokenizer. At most `max_in_flight` requests are forwarded at once; beyond that the gateway answers 429
at once (with Retry-After) instead of queueing without bound.

Optional API key, as the OpenAI SDKs send it (`Authorization: Bearer <key>`): taken from $TRITONKIT_GATEWAY_API_KEY
or from the file named by --api-key-file (never from the command line, where `ps` shows it). With a key set, every
/v1/ route answers 401 with an OpenAI-shaped error to a request without it or with another; /health stays open for
probes.

    TRITONKIT_GATEWAY_API_KEY=... python -m tritonkit_client.gateway --port 8080 --triton 127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import base64
import hmac
import os
import time
from pathlib import Path

import numpy as np
from aiohttp import web

from tritonkit_client.core import AsyncClient, ClientError, ServerUnavailable
from tritonkit_client.text import MODEL, embed_async

# The first pipeline's model under the names OpenAI clients of sentence-transformers use.
ALIASES = {"all-MiniLM-L6-v2": MODEL, "sentence-transformers/all-MiniLM-L6-v2": MODEL}
REFRESH_S = 5.0  # an unknown model name re-reads the server's models at most this often
MAX_INPUTS = 2048  # OpenAI's own per-request limit
API_KEY_ENV = "TRITONKIT_GATEWAY_API_KEY"


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def text_models(configs: dict[str, dict]) -> dict[str, int]:
    """Served text-embedding models (BYTES `text` in, FP32 `embedding` out) → embedding width."""
    out = {}
    for name, cfg in configs.items():
        inputs = {t["name"]: t for t in cfg.get("input", [])}
        outputs = {t["name"]: t for t in cfg.get("output", [])}
        text, emb = inputs.get("text"), outputs.get("embedding")
        if text and emb and text.get("data_type") == "TYPE_STRING" and emb.get("data_type") == "TYPE_FP32":
            out[name] = int(emb["dims"][-1])
    return out


def parse_request(body: object, models: dict[str, int]) -> tuple[list[str], str, str, int]:
    """Validate an embeddings request against the served models (name → width); errors name the field and the
    limit, as OpenAI's do."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", None)
    if "input" not in body:
        raise RequestError("'input' is required", "input")
    raw = body["input"]
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts:
        raise RequestError("'input' must be a non-empty string or a non-empty list of strings", "input")
    if len(texts) > MAX_INPUTS:
        raise RequestError(f"'input' has {len(texts)} items; the limit is {MAX_INPUTS}", "input")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise RequestError(f"input[{i}] must be a string (token arrays are not supported)", f"input[{i}]")
        if not text.strip():
            raise RequestError(f"input[{i}] is empty or whitespace-only", f"input[{i}]")
    model = body.get("model", MODEL)
    if not isinstance(model, str) or ALIASES.get(model, model) not in models:
        names = sorted(models) + sorted(a for a, m in ALIASES.items() if m in models)
        raise RequestError(f"model '{model}' does not exist; this server has {', '.join(names) or 'none'}",
                           "model", status=404, code="model_not_found")
    width = models[ALIASES.get(model, model)]
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise RequestError(f"encoding_format must be 'float' or 'base64', not {encoding!r}", "encoding_format")
    dims = body.get("dimensions", width)
    if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= width:
        raise RequestError(f"dimensions must be an integer in 1..{width} for model '{model}', got {dims!r}",
                           "dimensions")
    return texts, model, encoding, dims


def shorten(vectors: np.ndarray, dims: int) -> np.ndarray:
    """Keep the first `dims` components and re-normalise, so cosine = dot product still holds."""
    if dims == vectors.shape[1]:
        return vectors
    cut = vectors[:, :dims]
    return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)


def load_api_key(key_file: str | None = None, env: dict | None = None) -> str | None:
    """The gateway's API key: the file's content (stripped) if a file is named, else $TRITONKIT_GATEWAY_API_KEY,
    else None (no authentication). An empty key is refused: it would look set and match nothing useful."""
    if key_file:
        key = Path(key_file).read_text().strip()
        if not key:
            raise ValueError(f"--api-key-file {key_file} is empty")
        return key
    key = (os.environ if env is None else env).get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"${API_KEY_ENV} is set but empty")
    return key.strip() if key else None


class Gateway:
    def __init__(self, triton_url: str, protocol: str = "grpc", max_in_flight: int = 64,
                 batch_size: int = 32, concurrency: int = 8, triton_model: str = MODEL, api_key: str | None = None):
        self.triton_url, self.protocol, self.triton_model = triton_url, protocol, triton_model
        self._api_key = api_key.encode() if api_key else None
        self.max_in_flight, self.batch_size, self.concurrency = max_in_flight, batch_size, concurrency
        self.in_flight = 0
        self.rejected = 0
        self.client: AsyncClient | None = None
        self.served: dict[str, int] = {}
        self._read_at = float("-inf")

    async def _startup(self, _app) -> None:
        self.client = AsyncClient(self.triton_url, protocol=self.protocol)

    async def served_models(self, refresh: bool = False) -> dict[str, int]:
        """The server's text-embedding models (name → width), re-read when asked and not read in REFRESH_S."""
        if (refresh or not self.served) and time.monotonic() - self._read_at >= REFRESH_S:
            self._read_at = time.monotonic()
            self.served = text_models(await self.client.model_configs())
        return self.served

    async def _cleanup(self, _app) -> None:
        if self.client:
            await self.client.close()

    @web.middleware
    async def _authenticate(self, request: web.Request, handler):
        if self._api_key is None or not request.path.startswith("/v1/"):
            return await handler(request)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return _error(401, "You didn't provide an API key: send 'Authorization: Bearer <key>'.", kind=
                          "invalid_request_error", code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        # Constant time: the answer's timing must not tell how much of a guessed key was right.
        if not hmac.compare_digest(given.strip().encode(), self._api_key):
            return _error(401, "Incorrect API key provided.", kind="invalid_request_error", code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=32 * 1024 * 1024, middlewares=[self._authenticate])
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def models(self, _request: web.Request) -> web.Response:
        try:
            served = await self.served_models(refresh=True)
        except ServerUnavailable as err:
            return _error(503, str(err), kind="server_error")
        names = sorted(served) + sorted(a for a, m in ALIASES.items() if m in served)
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "tritonkit"} for name in names]})

    async def health(self, _request: web.Request) -> web.Response:
        try:
            await self.client.check_ready(self.triton_model)
        except ServerUnavailable as err:
            return _error(503, str(err), kind="server_error")
        return web.json_response({"status": "ok"})

    async def embeddings(self, request: web.Request) -> web.Response:
        if self.in_flight >= self.max_in_flight:
            self.rejected += 1
            return _error(429, f"gateway is at its limit of {self.max_in_flight} requests in flight; retry shortly",
                          kind="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.in_flight += 1
        try:
            try:
                body = await request.json()
                served = await self.served_models()
                if isinstance(body, dict) and ALIASES.get(body.get("model"), body.get("model")) not in served:
                    served = await self.served_models(refresh=True)  # loaded since the last read?
                texts, model, encoding, dims = parse_request(body, served)
            except ValueError as err:  # RequestError, or a body that is not JSON
                if isinstance(err, RequestError):
                    return _error(err.status, str(err), err.param, code=err.code)
                return _error(400, f"request body is not valid JSON ({err})")
            except ServerUnavailable as err:
                return _error(503, str(err), kind="server_error")
            try:
                result = await embed_async(texts, client=self.client, model=ALIASES.get(model, model),
                                           batch_size=self.batch_size, concurrency=self.concurrency)
            except ServerUnavailable as err:
                return _error(503, str(err), kind="server_error")
            except ClientError as err:
                return _error(400, str(err), "input")
            vectors = shorten(result.vectors, dims).astype(np.float32)
            tokens = int(result.num_tokens.sum())
            data = []
            for i, vector in enumerate(vectors):
                value = base64.b64encode(vector.tobytes()).decode() if encoding == "base64" else vector.tolist()
                data.append({"object": "embedding", "index": i, "embedding": value})
            return web.json_response({
                "object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            })
        finally:
            self.in_flight -= 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonkit-gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--triton", default="127.0.0.1:8001", help="Triton gRPC address")
    parser.add_argument("--max-in-flight", type=int, default=64, help="answer 429 beyond this many requests")
    parser.add_argument("--batch-size", type=int, default=32, help="texts per Triton request")
    parser.add_argument("--api-key-file", default="",
                        help=f"file holding the API key clients must send (default: ${API_KEY_ENV}; none: open)")
    args = parser.parse_args(argv)
    try:
        api_key = load_api_key(args.api_key_file or None)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    gateway = Gateway(args.triton, max_in_flight=args.max_in_flight, batch_size=args.batch_size, api_key=api_key)
    started = time.strftime("%H:%M:%S")
    auth = "API key required" if api_key else f"no API key (set ${API_KEY_ENV} or --api-key-file)"
    print(f"[{started}] OpenAI-compatible embeddings at http://{args.host}:{args.port}/v1 → Triton {args.triton}; "
          f"{auth}")
    web.run_app(gateway.app(), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
