"""Shared fixtures: a real tritonserver on free loopback ports, always stopped (also when a test fails)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tritonkit.runtime.server import TritonServer


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


# A killed pytest (SIGTERM, e.g. `pkill pytest`) would otherwise skip fixture teardown and atexit, leaving its
# tritonservers (own process groups) running; as an interrupt, teardown stops them.
signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(autouse=True)
def _own_judgements(tmp_path_factory, monkeypatch):
    """Each test judges its INT8 graphs itself: a judgement another test kept (tritonkit.int8.judge) never stands in."""
    from tritonkit.int8 import judge

    monkeypatch.setattr(judge, "STORE", tmp_path_factory.mktemp("judgements"))


@contextlib.contextmanager
def _servers(tmp_path_factory) -> Iterator[Callable[..., TritonServer]]:
    """Factory: `start(repo, **kwargs)` → a ready server; every one started is stopped on leaving."""
    started: list[TritonServer] = []

    def start(model_repository: Path, **kwargs) -> TritonServer:
        log = tmp_path_factory.mktemp("triton-log") / "server.log"
        # An idle client connection otherwise holds the stop for the whole 30 s drain; drain tests set their own.
        kwargs.setdefault("exit_timeout_s", 8)
        server = TritonServer.on_free_ports(model_repository=Path(model_repository), log_path=log, **kwargs)
        started.append(server)
        return server.start()

    yield start
    # Together: each drains for up to exit_timeout_s, and one after another they held the session's end ~50 s.
    with concurrent.futures.ThreadPoolExecutor(max(1, len(started))) as pool:
        list(pool.map(TritonServer.stop, started))


@pytest.fixture(scope="module")
def start_server(tmp_path_factory) -> Iterator[Callable[..., TritonServer]]:
    """Servers stopped when their module's tests are done: kept for the session, the text encoders' stubs alone
    (~0.9 GiB each with static shapes) outgrew a 24 GiB machine."""
    with _servers(tmp_path_factory) as start:
        yield start


@pytest.fixture(scope="session")
def start_session_server(tmp_path_factory) -> Iterator[Callable[..., TritonServer]]:
    """For servers every module shares (the tiny smoke server)."""
    with _servers(tmp_path_factory) as start:
        yield start


@pytest.fixture(scope="session")
def smoke_repository(tmp_path_factory) -> Path:
    from tests.support.tiny_models import build_smoke_repository

    return build_smoke_repository(tmp_path_factory.mktemp("smoke_repo"))


@pytest.fixture(scope="session")
def smoke_server(start_session_server, smoke_repository) -> TritonServer:
    return start_session_server(smoke_repository)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need TensorRT and a CUDA GPU; without them they skip with the exact reason."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from tritonkit.tensorrt.environment import detect

    reason = detect().skip_reason
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"needs TensorRT + GPU: {reason}"))
