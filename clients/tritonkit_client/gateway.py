"""OpenAI-compatible `POST /v1/embeddings`, plus `POST /v1/rerank` and `POST /v1/classify`, for the text models a
Triton server serves (aiohttp, gRPC).

/v1/embeddings speaks the protocol LangChain, LlamaIndex and the OpenAI SDKs use: `input` (string or list of
strings), `encoding_format` (float | base64), `dimensions` (truncate, then re-normalise), `usage` token counts from
the server's tokenizer. /v1/rerank takes the request Cohere, Jina and Infinity share (`query`, `documents`, `top_n`,
`return_documents`) and answers `results` best first; /v1/classify takes Infinity's (`input`) and answers every
label's score per text, best first. Each route offers the served models of its contract, found by their tensors. At
most `max_in_flight` requests are forwarded at once; beyond that the gateway answers 429 at once (with Retry-After)
instead of queueing without bound.

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
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from aiohttp import web

from tritonkit_client import reranking, text_classification
from tritonkit_client.core import AsyncClient, ClientError, ServerUnavailable
from tritonkit_client.text import MODEL, embed_async

# The first pipeline's model under the names OpenAI clients of sentence-transformers use.
ALIASES = {"all-MiniLM-L6-v2": MODEL, "sentence-transformers/all-MiniLM-L6-v2": MODEL}
REFRESH_S = 5.0  # an unknown model name re-reads the server's models at most this often
MAX_INPUTS = 2048  # OpenAI's own per-request limit (/v1/embeddings, /v1/classify)
MAX_DOCUMENTS = 1000  # Cohere's documented most documents per rerank request
MAX_TEXT_BYTES = 100_000  # the server's tokenizer refuses longer texts by default (its parameter max_chars)
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


@dataclass(frozen=True)
class Classifier:
    labels: int
    pairs: bool  # takes a `text_pair` input


def rerank_models(configs: dict[str, dict]) -> dict[str, int]:
    """Served text-rerank models → max batch size."""
    return {name: int(cfg.get("max_batch_size", 0)) for name, cfg in configs.items() if reranking.is_reranker(cfg)}


def classify_models(configs: dict[str, dict]) -> dict[str, Classifier]:
    """Served text-classification models → their number of labels and whether they take pairs."""
    return {name: Classifier(text_classification.num_labels(cfg), text_classification.takes_pairs(cfg))
            for name, cfg in configs.items() if text_classification.is_text_classifier(cfg)}


def _body(body: object, *required: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", None)
    for field in required:
        if field not in body:
            raise RequestError(f"'{field}' is required", field)
    return body


def check_list(value: object, field: str, limit: int, what: str = "list of strings") -> list:
    if not isinstance(value, list) or not value:
        raise RequestError(f"'{field}' must be a non-empty {what}", field)
    if len(value) > limit:
        raise RequestError(f"'{field}' has {len(value)} items; the limit is {limit}", field)
    return value


def check_text(value: object, field: str, hint: str = "") -> str:
    """A text the models take: a string, not blank, within the server tokenizer's size limit."""
    if not isinstance(value, str):
        raise RequestError(f"{field} must be a string{hint}", field)
    if not value.strip():
        raise RequestError(f"{field} is empty or whitespace-only", field)
    size = len(value.encode("utf-8"))
    if size > MAX_TEXT_BYTES:
        raise RequestError(f"{field} is {size} bytes in UTF-8; the limit is {MAX_TEXT_BYTES}", field)
    return value


def check_int(body: dict, field: str, low: int, high: int) -> int | None:
    value = body.get(field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
        raise RequestError(f"{field} must be an integer in {low}..{high}, got {value!r}", field)
    return value


def check_flag(body: dict, field: str) -> bool:
    value = body.get(field, False)
    if not isinstance(value, bool):
        raise RequestError(f"{field} must be true or false, got {value!r}", field)
    return value


def check_model(body: dict, served: dict, what: str) -> str:
    model = body["model"]
    if not isinstance(model, str) or model not in served:
        raise RequestError(f"model {model!r} is not a {what} model on this server; it has "
                           f"{', '.join(sorted(served)) or 'none'}", "model", status=404, code="model_not_found")
    return model


def parse_request(body: object, models: dict[str, int]) -> tuple[list[str], str, str, int]:
    """Validate an embeddings request against the served models (name → width); errors name the field and the
    limit, as OpenAI's do."""
    body = _body(body, "input")
    raw = body["input"]
    texts = check_list([raw] if isinstance(raw, str) else raw, "input", MAX_INPUTS,
                       "string or a non-empty list of strings")
    for i, text in enumerate(texts):
        check_text(text, f"input[{i}]", " (token arrays are not supported)")
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


@dataclass(frozen=True)
class RerankRequest:
    model: str
    query: str
    documents: list[str]
    top_n: int | None  # more than len(documents) returns them all, as Cohere and Infinity do
    return_documents: bool
    raw_scores: bool  # relevance_score is the raw logit, not the model's activation of it (Infinity's option)


def parse_rerank(body: object, models: dict) -> RerankRequest:
    """Validate a rerank request (Cohere / Jina / Infinity shape) against the served rerank models."""
    body = _body(body, "model", "query", "documents")
    model = check_model(body, models, "rerank")
    query = check_text(body["query"], "query")
    documents = []
    for i, item in enumerate(check_list(body["documents"], "documents", MAX_DOCUMENTS)):
        if isinstance(item, dict):  # Cohere's object form: the text to rank is its 'text'
            documents.append(check_text(item.get("text"), f"documents[{i}].text"))
        else:
            documents.append(check_text(item, f"documents[{i}]", " or an object with a 'text' string"))
    top_n = check_int(body, "top_n", 1, MAX_DOCUMENTS)
    return RerankRequest(model, query, documents, top_n, check_flag(body, "return_documents"),
                         check_flag(body, "raw_scores"))


@dataclass(frozen=True)
class ClassifyRequest:
    model: str
    texts: list[str]
    pairs: list[str] | None  # text_pair per text (NLI), or none at all
    top_k: int  # labels per text, best first; default: all of them, as Infinity answers
    raw_scores: bool  # score is the label's raw logit


def parse_classify(body: object, models: dict[str, Classifier]) -> ClassifyRequest:
    """Validate a classify request (Infinity's shape; an item may be {"text", "text_pair"}) against the served
    text-classification models."""
    body = _body(body, "model", "input")
    model = check_model(body, models, "text-classification")
    raw = body["input"]
    items: list[tuple[str, str | None]] = []
    for i, item in enumerate(check_list([raw] if isinstance(raw, str) else raw, "input", MAX_INPUTS,
                                        "string or a non-empty list of strings")):
        if not isinstance(item, dict):
            items.append((check_text(item, f"input[{i}]", " or an object with 'text' and 'text_pair' strings"), None))
            continue
        # A pair as transformers' text-classification pipeline takes it: {"text": ..., "text_pair": ...}.
        text, pair = check_text(item.get("text"), f"input[{i}].text"), item.get("text_pair")
        if pair is not None and not models[model].pairs:
            raise RequestError(f"input[{i}].text_pair: model '{model}' takes single texts, not pairs",
                               f"input[{i}].text_pair")
        items.append((text, None if pair is None else check_text(pair, f"input[{i}].text_pair")))
    paired = [pair is not None for _, pair in items]
    if any(paired) and not all(paired):
        lone, first = paired.index(False), paired.index(True)
        raise RequestError(f"input[{lone}] has no text_pair while input[{first}] has one: send a text_pair with "
                           "every text or with none", f"input[{lone}]")
    labels = models[model].labels
    top_k = check_int(body, "top_k", 1, labels) or labels
    pairs = [pair for _, pair in items] if any(paired) else None
    return ClassifyRequest(model, [text for text, _ in items], pairs, top_k, check_flag(body, "raw_scores"))


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


# The routes' catalogues: each offers the served models of its contract.
ROUTES = {"embeddings": text_models, "rerank": rerank_models, "classify": classify_models}


class Gateway:
    def __init__(self, triton_url: str, protocol: str = "grpc", max_in_flight: int = 64,
                 batch_size: int = 32, concurrency: int = 8, triton_model: str | None = MODEL,
                 api_key: str | None = None):
        """triton_model: the model /health requires ready (None: the server's readiness alone)."""
        self.triton_url, self.protocol, self.triton_model = triton_url, protocol, triton_model
        self._api_key = api_key.encode() if api_key else None
        self.max_in_flight, self.batch_size, self.concurrency = max_in_flight, batch_size, concurrency
        self.in_flight = 0
        self.rejected = 0
        self.client: AsyncClient | None = None
        self.catalogues: dict[str, dict] = {}
        self._read_at = float("-inf")

    async def _startup(self, _app) -> None:
        self.client = AsyncClient(self.triton_url, protocol=self.protocol)

    async def served_models(self, route: str = "embeddings", refresh: bool = False) -> dict:
        """The route's served models (name → what its checks need), re-read when asked and not read in REFRESH_S."""
        if (refresh or not self.catalogues) and time.monotonic() - self._read_at >= REFRESH_S:
            self._read_at = time.monotonic()
            configs = await self.client.model_configs()
            self.catalogues = {name: find(configs) for name, find in ROUTES.items()}
        return self.catalogues.get(route, {})

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
        app.router.add_post("/v1/rerank", self.rerank)
        app.router.add_post("/v1/classify", self.classify)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def models(self, _request: web.Request) -> web.Response:
        try:
            await self.served_models(refresh=True)
        except ServerUnavailable as err:
            return _error(503, str(err), kind="server_error")
        served = self.catalogues.get("embeddings", {})
        names = sorted({name for catalogue in self.catalogues.values() for name in catalogue})
        names += sorted(a for a, m in ALIASES.items() if m in served)
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "tritonkit"} for name in names]})

    async def health(self, _request: web.Request) -> web.Response:
        try:
            await self.client.check_ready(self.triton_model)
        except ServerUnavailable as err:
            return _error(503, str(err), kind="server_error")
        return web.json_response({"status": "ok"})

    async def _answer(self, request: web.Request, route: str, parse: Callable[[object, dict], object],
                      run: Callable[[object], Awaitable[dict]], field: str) -> web.Response:
        """One request of a route: the in-flight limit, parse against the route's served models (re-read once for
        a name not seen yet), run; a model error from Triton is the request's fault (400, naming `field`)."""
        if self.in_flight >= self.max_in_flight:
            self.rejected += 1
            return _error(429, f"gateway is at its limit of {self.max_in_flight} requests in flight; retry shortly",
                          kind="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.in_flight += 1
        try:
            try:
                body = await request.json()
                served = await self.served_models(route)
                wanted = body.get("model", MODEL if route == "embeddings" else None) if isinstance(body, dict) else None
                if not isinstance(wanted, str) or ALIASES.get(wanted, wanted) not in served:
                    served = await self.served_models(route, refresh=True)  # loaded since the last read?
                parsed = parse(body, served)
            except ValueError as err:  # RequestError, or a body that is not JSON
                if isinstance(err, RequestError):
                    return _error(err.status, str(err), err.param, code=err.code)
                return _error(400, f"request body is not valid JSON ({err})")
            except ServerUnavailable as err:
                return _error(503, str(err), kind="server_error")
            try:
                return web.json_response(await run(parsed))
            except ServerUnavailable as err:
                return _error(503, str(err), kind="server_error")
            except ClientError as err:
                return _error(400, str(err), field)
        finally:
            self.in_flight -= 1

    async def embeddings(self, request: web.Request) -> web.Response:
        return await self._answer(request, "embeddings", parse_request, self._embed, "input")

    async def rerank(self, request: web.Request) -> web.Response:
        return await self._answer(request, "rerank", parse_rerank, self._rerank, "documents")

    async def classify(self, request: web.Request) -> web.Response:
        return await self._answer(request, "classify", parse_classify, self._classify, "input")

    async def _embed(self, parsed: tuple[list[str], str, str, int]) -> dict:
        texts, model, encoding, dims = parsed
        result = await embed_async(texts, client=self.client, model=ALIASES.get(model, model),
                                   batch_size=self.batch_size, concurrency=self.concurrency)
        vectors = shorten(result.vectors, dims).astype(np.float32)
        tokens = int(result.num_tokens.sum())
        data = []
        for i, vector in enumerate(vectors):
            value = base64.b64encode(vector.tobytes()).decode() if encoding == "base64" else vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _rerank(self, req: RerankRequest) -> dict:
        result = await reranking.rerank_async(req.query, req.documents, model=req.model, top_n=req.top_n,
                                              client=self.client, batch_size=self.batch_size,
                                              concurrency=self.concurrency)
        results = []
        for index, score in result.ranking(raw=req.raw_scores):
            row = {"index": index, "relevance_score": score}
            if req.return_documents:
                row["document"] = {"text": req.documents[index]}
            results.append(row)
        return {"object": "rerank", "id": f"rerank-{uuid.uuid4().hex}", "model": req.model, "results": results,
                "usage": _usage(result.num_tokens)}

    async def _classify(self, req: ClassifyRequest) -> dict:
        result = await text_classification.classify_text_async(
            req.texts, req.pairs, model=req.model, top_k=req.top_k, client=self.client, batch_size=self.batch_size,
            concurrency=self.concurrency)
        data = [[{"label": p.label, "score": float(logits[p.index]) if req.raw_scores else p.score} for p in row]
                for row, logits in zip(result.predictions, result.logits)]
        return {"object": "classify", "id": f"classify-{uuid.uuid4().hex}", "model": req.model, "data": data,
                "usage": _usage(result.num_tokens)}


def _usage(num_tokens: np.ndarray) -> dict:
    tokens = int(num_tokens.sum())
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonkit-gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--triton", default="127.0.0.1:8001", help="Triton gRPC address")
    parser.add_argument("--max-in-flight", type=int, default=64, help="answer 429 beyond this many requests")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="texts (rerank: pairs) per Triton request, at most each model's max batch size")
    parser.add_argument("--health-model", default=MODEL,
                        help="the model /health requires ready ('': the server's readiness alone)")
    parser.add_argument("--api-key-file", default="",
                        help=f"file holding the API key clients must send (default: ${API_KEY_ENV}; none: open)")
    args = parser.parse_args(argv)
    try:
        api_key = load_api_key(args.api_key_file or None)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    gateway = Gateway(args.triton, max_in_flight=args.max_in_flight, batch_size=args.batch_size,
                      triton_model=args.health_model or None, api_key=api_key)
    started = time.strftime("%H:%M:%S")
    auth = "API key required" if api_key else f"no API key (set ${API_KEY_ENV} or --api-key-file)"
    print(f"[{started}] embeddings, rerank and classify at http://{args.host}:{args.port}/v1 → Triton "
          f"{args.triton}; {auth}")
    web.run_app(gateway.app(), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
