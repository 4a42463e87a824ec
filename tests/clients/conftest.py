"""What the rerank / classify suites (test_rerank_classify.py, test_gateway_routes.py) share, once for the package:
one real tritonserver serving tests.support.tiny_kinds' BERT reranker and classifier (ensemble, _fp32, _fused) and
a single-text variant of the classifier, and real gateway processes (`python -m tritonkit_client.gateway`) in front
of it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest

from tests.support.gateway_support import start_gateway
from tests.support.tiny_kinds import build_tiny_kinds, served_models, single_text_variant
from tritonkit.runtime.server import TritonServer

RERANKER, CLASSIFIER = "tiny_rerank_bert", "tiny_classify_bert"
KEY = "tk-rerank-3c9e"
_OWN = object()  # post/get: send the gateway's own key


@pytest.fixture(scope="package")
def tiny_tree():
    return build_tiny_kinds((RERANKER, CLASSIFIER))


@pytest.fixture(scope="package")
def tiny_server(tmp_path_factory, tiny_tree):
    """Package scope: both suites on one server, stopped once the package's tests are done (start_server's servers
    live per module, start_session_server's to the end of the whole session)."""
    variants = tmp_path_factory.mktemp("tiny_variants")
    single = single_text_variant(tiny_tree.repository, f"{CLASSIFIER}_fp32", variants)
    server = TritonServer.on_free_ports(
        model_repository=tiny_tree.repository, log_path=tmp_path_factory.mktemp("triton-log") / "server.log",
        exit_timeout_s=8, model_control_mode="explicit",
        models=[*served_models(RERANKER), *served_models(CLASSIFIER), single],
        extra_args=[f"--model-repository={variants}"],  # Triton reads several repositories; names stay unique
    )
    server.start()  # a failed start stops what it started
    yield server
    server.stop()


@dataclass
class GatewayProcess:
    """A gateway process on a free port and the API key it requires (None: open)."""

    url: str
    key: str | None
    process: object = field(repr=False)

    def request(self, method: str, path: str, body: object = None, key: object = _OWN) -> tuple[int, dict]:
        """(status, JSON answer); body bytes go as they are, anything else as JSON; key None: no Authorization."""
        key = self.key if key is _OWN else key
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {key}"} if key else {})})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def post(self, path: str, body: object, key: object = _OWN) -> tuple[int, dict]:
        return self.request("POST", path, body, key)

    def get(self, path: str, key: object = _OWN) -> tuple[int, dict]:
        return self.request("GET", path, None, key)


@pytest.fixture(scope="package")
def start_tiny_gateway(tiny_server):
    """Factory: `start(*flags, key=None)` → a GatewayProcess in front of tiny_server; all stopped at the end."""
    started = []

    def start(*flags: str, key: str | None = None) -> GatewayProcess:
        proc, port = start_gateway(tiny_server, "--health-model", "", *flags,
                                   env={"TRITONKIT_GATEWAY_API_KEY": key} if key else None)
        started.append(proc)
        return GatewayProcess(f"http://127.0.0.1:{port}", key, proc)

    yield start
    for proc in started:
        proc.terminate()
    for proc in started:
        proc.wait(10)


@pytest.fixture(scope="package")
def tiny_gateway(start_tiny_gateway):
    """The gateway both suites call: an API key, and 4 rows per Triton request so a few texts span requests."""
    return start_tiny_gateway("--batch-size", "4", key=KEY)
