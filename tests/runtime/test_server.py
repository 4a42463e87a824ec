"""The embedded tritonserver and the Python-based onnxruntime backend, exercised over real HTTP and gRPC."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.tiny_models import B, W
from tritonkit.errors import ServerStartError
from tritonkit.perf import stats
from tritonkit.perf.analyzer import metrics_counters
from tritonkit.runtime.server import TritonServer


def _http_infer(url: str, model: str, name: str, x: np.ndarray):
    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    try:
        return client.infer(model, [inp])
    finally:
        # Closed here, in the calling thread: left to the garbage collector, a client made in a worker thread
        # is closed wherever it is collected, where gevent has no hub (an "Exception ignored" warning).
        client.close()


def _metric(server: TritonServer, name: str, model: str) -> float:
    counters = metrics_counters(server.metrics_url)
    assert (name, model) in counters, f"metric {name} for {model} not exported"
    return counters[(name, model)]


def test_http_inference_matches_numpy(smoke_server):
    x = np.random.default_rng(0).random((5, 4), dtype=np.float32)
    result = _http_infer(smoke_server.http_url, "smoke_linear", "X", x)
    np.testing.assert_allclose(result.as_numpy("Y"), x @ W + B, rtol=1e-6, atol=1e-6)


def test_grpc_inference_matches_numpy(smoke_server):
    x = np.random.default_rng(1).random((2, 4), dtype=np.float32)
    client = grpcclient.InferenceServerClient(smoke_server.grpc_url)
    inp = grpcclient.InferInput("X", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("smoke_linear", [inp])
    np.testing.assert_allclose(result.as_numpy("Y"), x @ W + B, rtol=1e-6, atol=1e-6)
    assert client.is_model_ready("smoke_linear")


def test_dynamic_batching_merges_requests_into_one_session_run(smoke_server):
    """Concurrent single-row requests must reach ORT as batches, not one session.run each."""
    before = stats.read(smoke_server.http_url, ["smoke_linear"])
    runs_before = _metric(smoke_server, "tritonkit_ort_session_runs_total", "smoke_linear")
    reqs_before = _metric(smoke_server, "tritonkit_ort_batched_requests_total", "smoke_linear")
    rows = np.random.default_rng(2).random((48, 1, 4), dtype=np.float32)

    async def fire():
        client = grpcaio.InferenceServerClient(smoke_server.grpc_url)
        try:
            async def one(x):
                inp = grpcaio.InferInput("X", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                return await client.infer("smoke_linear", [inp])

            return await asyncio.gather(*(one(x) for x in rows))
        finally:
            await client.close()

    results = asyncio.run(fire())
    for x, r in zip(rows, results):
        np.testing.assert_allclose(r.as_numpy("Y"), x @ W + B, rtol=1e-6, atol=1e-6)
    # The model itself reports the batch size each session.run saw.
    seen = [int(r.as_numpy("BATCH")[0, 0]) for r in results]
    assert max(seen) > 1, f"every request ran alone: {seen}"
    after = stats.read(smoke_server.http_url, ["smoke_linear"])
    spent = after["smoke_linear"] - before["smoke_linear"]
    assert spent.success == spent.inferences == len(rows) and spent.fail == 0
    assert spent.executions < spent.inferences
    # Triton's per-batch-size counts agree with its totals, as the lab's split reads them.
    assert sum(spent.batches.values()) == spent.executions
    assert sum(size * n for size, n in spent.batches.items()) == spent.inferences
    split = stats.between(before, after)["smoke_linear"]
    assert split["batch"] == spent.inferences / spent.executions > 1 and split["compute_ms"] > 0
    runs = _metric(smoke_server, "tritonkit_ort_session_runs_total", "smoke_linear") - runs_before
    served = _metric(smoke_server, "tritonkit_ort_batched_requests_total", "smoke_linear") - reqs_before
    assert served == len(rows)
    assert runs < served, f"{runs} session.run calls for {served} requests"


def test_ragged_inputs_batch_together_padded_to_the_longest(smoke_server):
    lengths = [3, 17, 8, 1, 12, 5, 9, 2] * 3
    rng = np.random.default_rng(3)
    rows = [rng.random((1, n), dtype=np.float32) for n in lengths]
    with ThreadPoolExecutor(len(rows)) as pool:
        results = list(pool.map(lambda x: _http_infer(smoke_server.http_url, "smoke_ragged", "TOKENS", x), rows))
    for x, r in zip(rows, results):
        # Zero padding leaves the sum exact; the padded length shows the request shared a longer batch.
        np.testing.assert_allclose(r.as_numpy("TOTAL")[0, 0], x.sum(), rtol=1e-5)
        assert r.as_numpy("SEEN_LEN")[0, 0] >= x.shape[1]
    assert any(r.as_numpy("SEEN_LEN")[0, 0] > x.shape[1] for x, r in zip(rows, results)), "no ragged batch formed"
    assert _metric(smoke_server, "tritonkit_ort_padding_elements_total", "smoke_ragged") > 0


def test_length_buckets_split_a_ragged_batch_and_bound_its_padding(smoke_server):
    counters = ("session_runs", "batched_requests", "input_elements", "padding_elements")
    before = {c: _metric(smoke_server, f"tritonkit_ort_{c}_total", "smoke_bucketed") for c in counters}
    lengths = [3, 17, 8, 1, 12, 5, 9, 2, 40, 16, 4, 33] * 2
    rng = np.random.default_rng(4)
    rows = [rng.random((1, n), dtype=np.float32) for n in lengths]
    with ThreadPoolExecutor(len(rows)) as pool:
        results = list(pool.map(lambda x: _http_infer(smoke_server.http_url, "smoke_bucketed", "TOKENS", x), rows))
    for x, r in zip(rows, results):
        np.testing.assert_allclose(r.as_numpy("TOTAL")[0, 0], x.sum(), rtol=1e-5)
        assert r.as_numpy("SEEN_LEN")[0, 0] >= x.shape[1]
    d = {c: _metric(smoke_server, f"tritonkit_ort_{c}_total", "smoke_bucketed") - before[c] for c in counters}
    assert d["batched_requests"] == len(rows)
    assert d["session_runs"] < len(rows), "requests were not batched together"
    # Shortest and longest never share a run: 1 padded to 40 would be 97 % padding.
    assert results[lengths.index(1)].as_numpy("SEEN_LEN")[0, 0] < 40
    assert d["padding_elements"] <= 0.25 * d["input_elements"], d


def test_bad_request_fails_alone_within_a_batch(smoke_server):
    """A request only the model can reject (5 features where ORT needs 4) must not fail its batch-mates."""
    rng = np.random.default_rng(4)
    rows = [rng.random((1, 4), dtype=np.float32) for _ in range(12)]
    rows[5] = rng.random((1, 5), dtype=np.float32)

    def call(x):
        try:
            return _http_infer(smoke_server.http_url, "smoke_loose", "X", x)
        except InferenceServerException as err:
            return err

    with ThreadPoolExecutor(len(rows)) as pool:
        results = list(pool.map(call, rows))
    assert isinstance(results[5], InferenceServerException)
    assert "smoke_loose" in str(results[5]) and "X" in str(results[5])
    assert results[5].status() == "400", results[5]  # the request's fault: a client error, not HTTP 500
    for i, (x, r) in enumerate(zip(rows, results)):
        if i != 5:
            assert not isinstance(r, Exception), f"request {i} failed with its bad neighbour: {r}"
            np.testing.assert_allclose(r.as_numpy("Y"), x @ W + B, rtol=1e-6, atol=1e-6)
    assert smoke_server.is_ready()


@pytest.mark.parametrize(
    "x, fragment",
    [
        (np.zeros((1, 4), np.float64), "FP64"),  # wrong dtype: rejected by Triton's own checks
        (np.zeros((1, 3), np.float32), "shape"),  # wrong width on a fixed-dims input
        (np.zeros((33, 4), np.float32), "batch-size must be <= 32"),  # over max_batch_size
    ],
)
def test_invalid_requests_get_clear_errors_and_server_stays_healthy(smoke_server, x, fragment):
    client = httpclient.InferenceServerClient(smoke_server.http_url)
    inp = httpclient.InferInput("X", list(x.shape), "FP64" if x.dtype == np.float64 else "FP32")
    inp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as info:
        client.infer("smoke_linear", [inp])
    assert fragment.lower() in str(info.value).lower()
    ok = _http_infer(smoke_server.http_url, "smoke_linear", "X", np.ones((1, 4), np.float32))
    np.testing.assert_allclose(ok.as_numpy("Y"), np.ones((1, 4)) @ W + B, rtol=1e-6)


def _processes() -> list[tuple[int, int, list[str]]]:
    """(pid, pgid, argv) of every process, read from /proc (ps truncates argv to the terminal width)."""
    procs = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        procs.append((int(entry), int(stat[2]), argv))
    return procs


def _stub_pids(server: TritonServer, model: str) -> dict[str, int]:
    """Instance name → pid of its Python-backend stub (the stub's argv names the instance)."""
    pids = {}
    for pid, pgid, argv in _processes():
        if pgid == server.process.pid and argv[0].endswith("triton_python_backend_stub"):
            instance = next((a for a in argv if a.startswith(f"{model}_")), None)
            if instance:
                pids[instance] = pid
    return pids


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_two_instances_both_serve(smoke_server):
    """instance_group count 2 → two stub processes, and concurrent load keeps both busy."""
    pids = _stub_pids(smoke_server, "smoke_linear")
    assert set(pids) == {"smoke_linear_0_0", "smoke_linear_0_1"}, pids
    before = {name: _cpu_ticks(pid) for name, pid in pids.items()}
    x = np.ones((1, 4), np.float32)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: _http_infer(smoke_server.http_url, "smoke_linear", "X", x), range(800)))
    worked = {name: _cpu_ticks(pid) - before[name] for name, pid in pids.items()}
    assert all(t > 0 for t in worked.values()), f"an instance stayed idle: {worked}"


def test_stop_leaves_no_stub_processes(start_server, smoke_repository):
    server = start_server(smoke_repository, models=["smoke_linear"], model_control_mode="explicit")
    pgid = server.process.pid
    assert _group_members(pgid) > 1  # server + its stubs
    with pytest.raises(ServerStartError, match="already running"):  # a second start would orphan this one
        server.start()
    assert server.process.pid == pgid
    assert server.stop() == 0
    assert _group_members(pgid) == 0


def _group_members(pgid: int) -> int:
    return sum(1 for _, group, _ in _processes() if group == pgid)


def _maps_jemalloc(pid: int) -> bool:
    return "libjemalloc" in Path(f"/proc/{pid}/maps").read_text()


def test_jemalloc_runs_in_the_server_only(smoke_server):
    """The server runs on jemalloc (it keeps a drained backlog's memory under glibc); the stubs, behind the stub
    wrapper, do not (it cost image throughput there) and get the launcher's own LD_PRELOAD back."""
    assert _maps_jemalloc(smoke_server.process.pid)
    stubs = smoke_server.stub_processes()
    assert stubs
    for instance, (pid, _model) in stubs.items():
        assert not _maps_jemalloc(pid), instance
        env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
        assert env.get("LD_PRELOAD", "") == os.environ.get("LD_PRELOAD", ""), instance
        assert "TRITONKIT_STUB_LD_PRELOAD" not in env, instance


def test_glibc_allocator_preloads_nothing(start_server, smoke_repository):
    server = start_server(smoke_repository, models=["smoke_linear"], allocator="glibc")
    assert not _maps_jemalloc(server.process.pid)
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(_http_infer(server.http_url, "smoke_linear", "X", x).as_numpy("Y"), x @ W + B,
                               rtol=1e-6, atol=1e-6)


def test_free_ports_are_distinct_and_released():
    """All three held while drawn (a port drawn twice once spun on_free_ports forever), then freed for the server."""
    import socket

    from tritonkit.runtime.server import free_ports

    for _ in range(200):
        ports = free_ports(3)
        assert len(set(ports)) == 3, ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    server = TritonServer.on_free_ports()
    assert len({server.http_port, server.grpc_port, server.metrics_port}) == 3
