"""Shared client core: one small API over tritonclient's HTTP/gRPC, sync and asyncio clients.

Every pipeline client (text embedding, image classification, ...) sends numpy dicts through `Client` /
`AsyncClient` and gets numpy dicts back; protocol differences and "server is down" errors are handled here.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

DEFAULT_URLS = {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:8001"}


class ClientError(RuntimeError):
    """A request failed; the message is the server's (or ours) and names the model."""


class ServerUnavailable(ClientError):
    """Nothing answers at the URL, or the server/model is not ready."""


@dataclass
class Prediction:
    label: str
    score: float
    index: int


def parse_classification(entry: bytes | str) -> Prediction:
    """One classification-extension entry 'score:index:label' (the label may itself contain ':')."""
    text = entry.decode("utf-8") if isinstance(entry, bytes) else str(entry)
    score, index, *label = text.split(":", 2)
    return Prediction(label=label[0] if label else "", score=float(score), index=int(index))


def parse_classifications(array: np.ndarray) -> list[list[Prediction]]:
    """A classification-extension output [n, k] → k predictions per row, best first (as the server sorts them)."""
    return [[parse_classification(e) for e in row] for row in array.reshape(len(array), -1)]


def tensors(config: dict, key: str) -> dict[str, dict]:
    """A model config's (JSON form) inputs or outputs by name."""
    return {t["name"]: t for t in config.get(key, [])}


def has_tensor(config: dict, key: str, name: str, data_type: str) -> bool:
    tensor = tensors(config, key).get(name)
    return bool(tensor) and tensor.get("data_type") == data_type


def rows_per_request(model: str, config: dict, wanted: int | None = None) -> int:
    """`wanted` rows per request (default: as many as the model takes), capped at the model's max batch size."""
    # gRPC's JSON form leaves out a zero field: no max_batch_size means the model does not batch.
    most = int(config.get("max_batch_size", 0))
    if most < 1:
        raise ClientError(f"{model}: max_batch_size is {most}; this client sends batched rows")
    if wanted is not None and wanted < 1:
        raise ValueError(f"batch size must be >= 1, got {wanted}")
    return most if wanted is None else min(wanted, most)


def default_url(protocol: str) -> str:
    env = os.environ.get("TRITON_GRPC_URL" if protocol == "grpc" else "TRITON_HTTP_URL")
    return env or DEFAULT_URLS[protocol]


def _strip_scheme(url: str) -> str:
    for scheme in ("http://", "https://", "grpc://"):
        if url.startswith(scheme):
            return url[len(scheme) :]
    return url


def _numpy_to_triton(array: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return "BYTES" if array.dtype == object or array.dtype.kind in "SU" else np_to_triton_dtype(array.dtype)


def _as_triton_array(array: np.ndarray) -> np.ndarray:
    if array.dtype.kind == "U":
        return np.array([s.encode("utf-8") for s in array.reshape(-1)], dtype=object).reshape(array.shape)
    return array


@dataclass
class Endpoint:
    url: str | None = None
    protocol: str = "http"
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.protocol not in ("http", "grpc"):
            raise ValueError(f"protocol must be 'http' or 'grpc', not {self.protocol!r}")
        self.url = _strip_scheme(self.url or default_url(self.protocol))

    def down(self, err: Exception) -> ServerUnavailable:
        return ServerUnavailable(
            f"cannot reach Triton at {self.protocol}://{self.url} ({type(err).__name__}: {err}); "
            "is the server running? (`make serve`, or pass --url/--protocol)"
        )


def _is_connection_error(err: Exception) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    return isinstance(err, ConnectionError | OSError) or any(
        s in text for s in ("connection refused", "failed to connect", "unavailable", "connect call failed",
                            "name or service not known", "timed out", "deadline exceeded")
    )


class _ClientBase:
    """What the sync and asyncio clients share: the endpoint and tritonclient's module for the protocol."""

    _MODULE_SUFFIX = ""  # ".aio" for the asyncio clients

    def _translate(self, model: str, err: Exception) -> Exception:
        """A connection failure → ServerUnavailable; the server's refusal → ClientError naming the model."""
        from tritonclient.utils import InferenceServerException

        if _is_connection_error(err):
            return self.endpoint.down(err)
        if isinstance(err, InferenceServerException):
            return ClientError(f"{model}: {err.message() if hasattr(err, 'message') else err}")
        return err

    def __init__(self, url: str | None, protocol: str, timeout_s: float):
        self.endpoint = Endpoint(url, protocol, timeout_s)
        self._configs: dict[str, dict] = {}  # model → config (JSON form), read once per client

    def _as_json(self) -> dict:
        return {"as_json": True} if self.protocol == "grpc" else {}

    @property
    def protocol(self) -> str:
        return self.endpoint.protocol

    def _module(self):
        return importlib.import_module(f"tritonclient.{self.protocol}{self._MODULE_SUFFIX}")


class Client(_ClientBase):
    """Synchronous client (HTTP or gRPC). Thread-safe: each thread gets its own tritonclient connection."""

    def __init__(self, url: str | None = None, protocol: str = "http", timeout_s: float = 60.0):
        super().__init__(url, protocol, timeout_s)
        self._local = threading.local()

    def _client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            module = self._module()
            if self.protocol == "grpc":
                client = module.InferenceServerClient(self.endpoint.url)
            else:
                client = module.InferenceServerClient(
                    self.endpoint.url, connection_timeout=self.endpoint.timeout_s,
                    network_timeout=self.endpoint.timeout_s,
                )
            self._local.client = client
        return client

    def check_ready(self, model: str | None = None) -> None:
        try:
            client = self._client()
            live = client.is_server_live()
            ready = client.is_model_ready(model) if model else live
        except Exception as err:
            raise self.endpoint.down(err) from None
        if not live:
            raise ServerUnavailable(f"Triton at {self.endpoint.url} is not live")
        if not ready:
            raise ServerUnavailable(f"model '{model}' is not ready on {self.endpoint.url}")

    def infer(self, model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
              class_count: dict[str, int] | None = None, shared_memory: bool = False) -> dict[str, np.ndarray]:
        """class_count: top-k via the classification extension per output; shared_memory: send inputs through
        system shared memory regions (server on the same host) instead of the request body."""
        tensors, requested, regions = _request(self._module(), inputs, outputs, class_count, shared_memory)
        kwargs = {"client_timeout": self.endpoint.timeout_s} if self.protocol == "grpc" else {}
        try:
            if regions:
                regions.register(self._client())
            result = self._client().infer(model, tensors, outputs=requested, **kwargs)
        except Exception as err:
            raise self._translate(model, err) from None
        finally:
            if regions:
                regions.release(self._client())
        return {name: result.as_numpy(name) for name in outputs}

    def model_config(self, model: str) -> dict:
        """The model's config (JSON form): its tensors and max batch size, read once per client."""
        if model not in self._configs:
            try:
                got = self._client().get_model_config(model, **self._as_json())
            except Exception as err:
                raise self._translate(model, err) from None
            self._configs[model] = got.get("config", got)
        return self._configs[model]

    def map(self, model: str, batches: Iterable[dict[str, np.ndarray]], outputs: Sequence[str],
            concurrency: int = 1, **infer_kwargs) -> list[dict[str, np.ndarray]]:
        """infer() over batches with up to `concurrency` requests in flight; results in input order."""
        batches = list(batches)
        if concurrency <= 1 or len(batches) <= 1:
            return [self.infer(model, b, outputs, **infer_kwargs) for b in batches]
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(lambda b: self.infer(model, b, outputs, **infer_kwargs), batches))

    def close(self) -> None:
        client = getattr(self._local, "client", None)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
            self._local.client = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _request(module, inputs: dict[str, np.ndarray], outputs: Sequence[str], class_count: dict[str, int] | None,
             shared_memory: bool):
    """InferInputs, requested outputs and (optionally) shared-memory regions: one builder for both clients."""
    tensors = []
    for name, array in inputs.items():
        array = _as_triton_array(np.asarray(array))
        t = module.InferInput(name, list(array.shape), _numpy_to_triton(array))
        t.set_data_from_numpy(array)
        tensors.append(t)
    regions = _SystemShm(tensors, inputs) if shared_memory else None
    return tensors, _requested(module, outputs, class_count), regions


class AsyncClient(_ClientBase):
    """asyncio client (tritonclient.http.aio / tritonclient.grpc.aio)."""

    _MODULE_SUFFIX = ".aio"

    def __init__(self, url: str | None = None, protocol: str = "http", timeout_s: float = 60.0):
        super().__init__(url, protocol, timeout_s)
        self._client = None

    def _get(self):
        if self._client is None:
            self._client = self._module().InferenceServerClient(self.endpoint.url)
        return self._client

    async def check_ready(self, model: str | None = None) -> None:
        try:
            live = await self._get().is_server_live()
            ready = await self._get().is_model_ready(model) if model else live
        except Exception as err:
            raise self.endpoint.down(err) from None
        if not (live and ready):
            raise ServerUnavailable(f"Triton at {self.endpoint.url}: server live={live}, model ready={ready}")

    async def infer(self, model: str, inputs: dict[str, np.ndarray], outputs: Sequence[str],
                    class_count: dict[str, int] | None = None, shared_memory: bool = False) -> dict[str, np.ndarray]:
        tensors, requested, regions = _request(self._module(), inputs, outputs, class_count, shared_memory)
        try:
            if regions:
                await regions.register_async(self._get())
            result = await self._get().infer(model, tensors, outputs=requested)
        except Exception as err:
            raise self._translate(model, err) from None
        finally:
            if regions:
                await regions.release_async(self._get())
        return {name: result.as_numpy(name) for name in outputs}

    async def model_configs(self) -> dict[str, dict]:
        """Config (JSON form) of every ready model on the server, by name. The statistics API lists the loaded
        models without the control key that the repository index needs."""
        try:
            stats = await self._get().get_inference_statistics(**self._as_json())
            names = sorted({m["name"] for m in stats.get("model_stats", [])})
            configs = {}
            for name in names:
                if not await self._get().is_model_ready(name):
                    continue
                cfg = await self._get().get_model_config(name, **self._as_json())
                configs[name] = cfg.get("config", cfg)
        except Exception as err:
            raise self._translate("", err) from None
        self._configs = dict(configs)  # a reloaded model's new config replaces the one read before
        return configs

    async def model_config(self, model: str) -> dict:
        if model not in self._configs:
            try:
                got = await self._get().get_model_config(model, **self._as_json())
            except Exception as err:
                raise self._translate(model, err) from None
            self._configs[model] = got.get("config", got)
        return self._configs[model]

    async def map(self, model: str, batches: Iterable[dict[str, np.ndarray]], outputs: Sequence[str],
                  concurrency: int = 1, **infer_kwargs) -> list[dict[str, np.ndarray]]:
        gate = asyncio.Semaphore(max(1, concurrency))

        async def one(batch):
            async with gate:
                return await self.infer(model, batch, outputs, **infer_kwargs)

        return list(await asyncio.gather(*(one(b) for b in batches)))

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()
            self._client = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _requested(module, outputs: Sequence[str], class_count: dict[str, int] | None) -> list:
    counts = class_count or {}
    unknown = set(counts) - set(outputs)
    if unknown:
        raise ValueError(f"class_count for outputs not requested: {sorted(unknown)}")
    return [module.InferRequestedOutput(name, class_count=counts.get(name, 0)) for name in outputs]


class _SystemShm:
    """Inputs of one request in POSIX shared memory (/dev/shm), registered with the server for the request.

    Python's multiprocessing.shared_memory makes the region (tritonclient's own helper needs pkg_resources).
    """

    def __init__(self, tensors: list, inputs: dict[str, np.ndarray]):
        import uuid
        from multiprocessing import shared_memory

        from tritonclient.utils import serialize_byte_tensor

        self.regions = []
        for tensor, array in zip(tensors, inputs.values()):
            array = _as_triton_array(np.asarray(array))
            if array.dtype == object:
                data = serialize_byte_tensor(array).item()
            else:
                data = np.ascontiguousarray(array).tobytes()
            name = f"tritonkit_{os.getpid()}_{uuid.uuid4().hex[:12]}"
            region = shared_memory.SharedMemory(name=name, create=True, size=max(1, len(data)))
            region.buf[: len(data)] = data
            self.regions.append((name, region, len(data), tensor))

    def register(self, client) -> None:
        for name, _region, size, tensor in self.regions:
            client.register_system_shared_memory(name, f"/{name}", size)
            tensor.set_shared_memory(name, size)

    async def register_async(self, client) -> None:
        for name, _region, size, tensor in self.regions:
            await client.register_system_shared_memory(name, f"/{name}", size)
            tensor.set_shared_memory(name, size)

    def _free(self) -> None:
        for _name, region, _size, _tensor in self.regions:
            with contextlib.suppress(Exception):
                region.close()
                region.unlink()

    def release(self, client) -> None:
        for name, *_ in self.regions:
            with contextlib.suppress(Exception):
                client.unregister_system_shared_memory(name)
        self._free()

    async def release_async(self, client) -> None:
        for name, *_ in self.regions:
            with contextlib.suppress(Exception):
                await client.unregister_system_shared_memory(name)
        self._free()


def chunks(items: Sequence, size: int) -> list[Sequence]:
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    return [items[i : i + size] for i in range(0, len(items), size)]
