"""Server-level failure behaviour on the embedded server: restricted control API, drain on SIGTERM, stub crashes."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tiny_models import build_sleepy_repository
from tritonclient.utils import InferenceServerException

from tritonkit.server import CONTROL_HEADER, TritonServer


def _echo(url: str, value: float, model: str = "sleepy") -> float:
    client = httpclient.InferenceServerClient(url)
    try:
        inp = httpclient.InferInput("X", [1, 1], "FP32")
        inp.set_data_from_numpy(np.full((1, 1), value, np.float32))
        return float(client.infer(model, [inp]).as_numpy("Y")[0, 0])
    finally:
        client.close()  # an idle keep-alive connection would hold a draining server for its whole exit timeout


@pytest.fixture
def sleepy_repo(tmp_path):
    return build_sleepy_repository(tmp_path / "repo", delay_ms=1500)


def test_control_api_needs_the_key_over_http_and_grpc(smoke_server):
    http = httpclient.InferenceServerClient(smoke_server.http_url)
    with pytest.raises(InferenceServerException, match=r"(?i)restricted|header|forbidden|permission"):
        http.get_model_repository_index()
    with pytest.raises(InferenceServerException):
        http.unload_model("smoke_linear")
    index = http.get_model_repository_index(headers={CONTROL_HEADER: smoke_server.control_key})
    assert {m["name"] for m in index} >= {"smoke_linear", "smoke_ragged"}
    grpc = grpcclient.InferenceServerClient(smoke_server.grpc_url)
    with pytest.raises(InferenceServerException):
        grpc.unload_model("smoke_linear")
    assert grpc.is_model_ready("smoke_linear")  # the refused unload did nothing
    # Inference, health and statistics stay open.
    assert http.get_inference_statistics("smoke_linear")["model_stats"]


def test_sigterm_drains_in_flight_requests_then_refuses_new_ones(start_server, sleepy_repo):
    server = start_server(sleepy_repo)
    pgid = server.process.pid
    results: dict[int, object] = {}

    def call(i):
        try:
            results[i] = _echo(server.http_url, float(i))
        except Exception as err:  # recorded, asserted below
            results[i] = err

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.4)  # all three accepted; the first is executing
    proc = server.process
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(Exception):  # noqa: B017 (refused at the socket, whatever the client library raises)
        _echo(server.http_url, 99.0)
    for t in threads:
        t.join(30)
    assert results == {0: 0.0, 1: 1.0, 2: 2.0}, results  # in flight when SIGTERM came, and all completed
    assert proc.wait(30) == 0
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _pgid(p) == pgid]
    server.stop()


def _pgid(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[2])
    except OSError:
        return None


def test_killed_stub_is_reloaded_with_bounded_failures(start_server, tmp_path):
    # A version whose stub died mid-request never finishes unloading: a short exit timeout keeps teardown quick.
    server: TritonServer = start_server(build_sleepy_repository(tmp_path / "repo", delay_ms=5), exit_timeout_s=5)
    (pid, model), = server.stub_processes().values()
    assert model == "sleepy"
    failures, successes = 0, 0
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            assert _echo(server.http_url, 3.0) == 3.0
            successes += 1
            if successes >= 5:
                break
        except InferenceServerException as err:
            assert "not healthy" in str(err) or "unavailable" in str(err).lower() or "sleepy" in str(err), err
            failures += 1
        time.sleep(0.05)
    assert successes >= 5, f"no recovery within 60 s ({failures} failed requests; watchdog: {server.recoveries})"
    assert server.recoveries and server.recoveries[0]["model"] == "sleepy"
    assert server.recoveries[0]["outcome"] == "reloaded"
    assert failures < 200, failures
    (new_pid, _), = server.stub_processes().values()
    assert new_pid != pid
