"""Server-level failure behaviour on the embedded server: restricted control API, drain on SIGTERM, stub crashes and
the stub watchdog (crashes only, never what an operator does through the repository API; failed reloads retried)."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.tiny_models import SLEEPY_MODEL_PY, build_sleepy_repository
from tritonkit.repository.config import ModelSpec, Tensor
from tritonkit.runtime.server import CONTROL_HEADER, TritonServer, free_port


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


# Echo model whose initialize() fails while a marker file exists: a reload that fails until the marker is removed.
FLAKY_MODEL_PY = SLEEPY_MODEL_PY.replace(
    "    def initialize(self, args):\n",
    "    def initialize(self, args):\n"
    "        import os\n"
    "        marker = json.loads(args['model_config'])['parameters']['fail_while']['string_value']\n"
    "        if os.path.exists(marker):\n"
    "            raise RuntimeError(f'refusing to load while {marker} exists')\n",
)


@pytest.fixture
def watched(start_server, tmp_path):
    """sleepy + flaky on a server whose watchdog counters are served; returns (server, marker, metrics url)."""
    repo = build_sleepy_repository(tmp_path / "repo", delay_ms=5)
    marker = tmp_path / "flaky-fails"
    ModelSpec(name="flaky", backend="python", max_batch_size=8, inputs=[Tensor("X", "FP32", [1])],
              outputs=[Tensor("Y", "FP32", [1])],
              parameters={"delay_ms": "5", "fail_while": str(marker)}).write(repo)
    (repo / "flaky" / "1").mkdir(parents=True)
    (repo / "flaky" / "1" / "model.py").write_text(FLAKY_MODEL_PY)
    server: TritonServer = start_server(repo, exit_timeout_s=5)
    port = server.serve_watchdog_metrics(free_port())
    return server, marker, f"http://127.0.0.1:{port}/metrics"


def _stub_pid(server: TritonServer, model: str) -> int:
    return next(pid for pid, m in server.stub_processes().values() if m == model)


def _wait(predicate, timeout_s: float, what: str, server: TritonServer) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s}s: {what}; watchdog {dict(server.watchdog_counts)}, "
                         f"recoveries {server.recoveries}")


def _loads(server: TritonServer, model: str) -> int:
    return server.log_tail(100_000).count(f"successfully loaded '{model}'")


def test_operator_unload_and_reload_are_left_alone_and_crashes_still_watched(watched):
    server, _, metrics_url = watched
    control = httpclient.InferenceServerClient(server.http_url)
    key = {CONTROL_HEADER: server.control_key}
    try:
        control.unload_model("sleepy", headers=key)
        _wait(lambda: server.model_states()["sleepy"][0] == "UNAVAILABLE", 30, "sleepy unloaded", server)
        time.sleep(4)  # eight watchdog ticks
        assert server.model_states()["sleepy"][0] == "UNAVAILABLE", "the watchdog undid an operator's unload"
        assert not server.recoveries and server.watchdog_counts[("sleepy", "left_to_operator")] == 1

        loads = _loads(server, "sleepy")
        control.load_model("sleepy", headers=key)
        time.sleep(4)
        assert _loads(server, "sleepy") == loads + 1, "an operator's load was followed by a second one"
        # A reload of a loaded model (Triton reloads only a changed one): new stubs replace the old.
        model_py = server.model_repository / "sleepy" / "1" / "model.py"
        os.utime(model_py, (time.time() + 5, time.time() + 5))
        control.load_model("sleepy", headers=key)
        time.sleep(4)
        assert _loads(server, "sleepy") == loads + 2 and not server.recoveries, server.recoveries
        assert _echo(server.http_url, 4.0) == 4.0
    finally:
        control.close()

    # Still watching the stubs the operator's load made: a crash is recovered.
    os.kill(_stub_pid(server, "sleepy"), signal.SIGKILL)
    _wait(lambda: any(r["outcome"] == "reloaded" for r in server.recoveries), 60, "crash recovered", server)
    assert _echo(server.http_url, 5.0) == 5.0
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        scraped = r.read().decode()
    for action in ("left_to_operator", "crash_detected", "reloaded"):
        assert f'tritonkit_watchdog_actions_total{{model="sleepy",action="{action}"}} 1' in scraped, scraped
    log = server.log_tail(100_000)
    assert "watchdog: model 'sleepy': crash_detected" in log and "watchdog: model 'sleepy': reloaded" in log


def test_failed_reload_is_retried_with_backoff_while_other_crashes_are_handled(watched):
    server, marker, _ = watched
    marker.write_text("")
    os.kill(_stub_pid(server, "flaky"), signal.SIGKILL)
    _wait(lambda: server.watchdog_counts[("flaky", "reload_failed")] >= 2, 60, "flaky retried", server)
    # While flaky cannot load (and the server may report not ready), another model's crash is still handled.
    sleepy_pid = _stub_pid(server, "sleepy")
    os.kill(sleepy_pid, signal.SIGKILL)
    _wait(lambda: server.watchdog_counts[("sleepy", "reloaded")] == 1, 60, "sleepy recovered", server)
    assert _stub_pid(server, "sleepy") != sleepy_pid and _echo(server.http_url, 6.0) == 6.0
    marker.unlink()  # the cause is fixed: the next retry loads it
    _wait(lambda: server.watchdog_counts[("flaky", "reloaded")] == 1, 90, "flaky recovered", server)
    assert _echo(server.http_url, 7.0, model="flaky") == 7.0
    assert "next try in" in server.log_tail(100_000)


def test_stopping_the_server_closes_its_watchdog_metrics_port(watched):
    """The counters' listener belongs to the stub watchdog: the server's stop frees its port, not the process exit."""
    import socket
    import urllib.error

    server, _, url = watched
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200 and b"tritonkit_watchdog_actions_total" in r.read()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)
    with socket.socket() as s:  # no listener left: a restarted server can take it (as http.server binds: reuse)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
