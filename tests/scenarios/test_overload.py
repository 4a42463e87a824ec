"""Overload: queue policies shed a burst far over capacity with clear, fast errors; the server stays healthy.

Behaviour, not timings: the tiny model (tests/support/overload_models.py) takes 300 ms per batch of 2, and a burst of 40
requests meets a queue of 4. perf/bench_overload.py measures the real pipelines.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.grpc import aio as grpc_aio

from tests.support.overload_models import build_bounded_repository
from tritonkit import paths
from tritonkit.perf import load
from tritonkit.repository import variants as rv
from tritonkit.repository.config import load_profile, load_repository, to_pbtxt

BURST = 40


def _echo_workload(model: str = "bounded") -> load.Workload:
    def inputs(i: int) -> list:
        x = grpc_aio.InferInput("X", [1, 1], "FP32")
        x.set_data_from_numpy(np.full((1, 1), i, np.float32))
        return [x]

    def check(result, i: int) -> None:
        y = result.as_numpy("Y")
        assert y is not None and y.shape == (1, 1) and float(y[0, 0]) == float(i), (i, y)

    return load.Workload("echo", model, inputs, check)


def _burst_grpc(url: str, n: int = BURST) -> list[load.Outcome]:
    """n requests sent within ~40 ms (open loop, constant arrivals): far over 2 requests per 300 ms."""
    return load.open_loop(url, [(_echo_workload(), n / 0.04)], 0.04 - 1e-6, arrivals="constant")


def _assert_shed(outcomes: list[load.Outcome], message: str, instant: bool = True) -> None:
    ok = [o for o in outcomes if o.status == "ok"]
    rejected = [o for o in outcomes if o.status == "rejected"]
    errors = [o for o in outcomes if o.status == "error"]
    assert not errors, errors[:3]  # every failure is a queue-policy rejection (gRPC UNAVAILABLE), nothing else
    assert ok, "some requests must be accepted and answered"
    assert len(rejected) >= len(outcomes) // 2, f"{len(rejected)} of {len(outcomes)} rejected"
    assert all(message in o.message for o in rejected), {o.message for o in rejected}
    if instant:  # a full queue refuses at once, before the accepted requests have even finished
        assert max(o.latency_s for o in rejected) < max(o.latency_s for o in ok)


def _server_healthy(server) -> None:
    assert server.is_ready()
    assert server.stub_processes(), "the model's stub is gone"
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        x = httpclient.InferInput("X", [1, 1], "FP32")
        x.set_data_from_numpy(np.full((1, 1), 42.0, np.float32))
        assert float(client.infer("bounded", [x]).as_numpy("Y")[0, 0]) == 42.0
    finally:
        client.close()


def test_default_configs_have_no_queue_policy_and_the_overload_profile_sheds_at_each_entrance():
    defaults = load_repository(paths.MODEL_REPOSITORY)
    # Policies cost the Triton 2.51 batcher its prefetching (500 ms stalls): never on by default.
    assert not [m for m, cfg in defaults.items() if cfg.dynamic_batching.HasField("default_queue_policy")]
    profile = load_profile(paths.MODEL_REPOSITORY, rv.OVERLOAD_PROFILE)
    for model in rv.OVERLOAD_POLICIES:
        policy = profile[model].dynamic_batching.default_queue_policy
        assert profile[model].dynamic_batching.HasField("default_queue_policy"), model
        assert policy.timeout_action == policy.REJECT, model
        assert 0 < policy.max_queue_size <= 4096, (model, policy.max_queue_size)
        assert 0 < policy.default_timeout_microseconds <= 2_000_000, (model, policy.default_timeout_microseconds)
        assert policy.allow_timeout_override, model
        # Only the queue policy differs from the default config, and the instance count where the profile
        # keeps a first step from outrunning the next one.
        profile[model].dynamic_batching.ClearField("default_queue_policy")
        if model in rv.OVERLOAD_INSTANCES:
            assert [g.count for g in profile[model].instance_group] == [rv.OVERLOAD_INSTANCES[model]], model
            for g_profile, g_default in zip(profile[model].instance_group, defaults[model].instance_group, strict=True):
                g_profile.count = g_default.count
        assert to_pbtxt(profile[model]) == to_pbtxt(defaults[model]), model
    # The first step of every served ensemble (not the TensorRT variants) sheds under the profile.
    for cfg in defaults.values():
        if cfg.platform == "ensemble" and "_trt_" not in cfg.name:
            assert cfg.ensemble_scheduling.step[0].model_name in rv.OVERLOAD_POLICIES, cfg.name


def test_committed_overload_profile_is_the_generated_one():
    for path, text in rv.overload_profile().items():
        assert path.read_text() == text, f"{path} is stale: run `python -m tritonkit.repository.variants`"


def test_full_queue_rejects_a_burst_over_grpc_and_http(start_server, tmp_path):
    repo = build_bounded_repository(tmp_path / "repo", delay_ms=300, max_queue_size=4)
    server = start_server(repo)
    try:
        _assert_shed(_burst_grpc(server.grpc_url), "Exceeds maximum queue size")
        _server_healthy(server)

        client = httpclient.InferenceServerClient(server.http_url, concurrency=BURST)
        try:
            pending = []
            for i in range(BURST):
                x = httpclient.InferInput("X", [1, 1], "FP32")
                x.set_data_from_numpy(np.full((1, 1), i, np.float32))
                pending.append((i, client.async_infer("bounded", [x])))
            ok, rejected = 0, []
            for i, request in pending:
                try:
                    assert float(request.get_result().as_numpy("Y")[0, 0]) == i
                    ok += 1
                except httpclient.InferenceServerException as err:
                    rejected.append(err)
        finally:
            client.close()
        assert ok >= 1 and len(rejected) >= BURST // 2, (ok, len(rejected))
        # HTTP 503 Service Unavailable with Triton's message.
        assert all(str(e.status()) == "503" and "Exceeds maximum queue size" in e.message() for e in rejected), \
            {(e.status(), e.message()) for e in rejected}
        _server_healthy(server)
    finally:
        server.stop()


def test_queue_timeout_rejects_what_waited_too_long(start_server, tmp_path):
    # The committed configs' primary mechanism: a large queue, and REJECT after default_timeout_microseconds.
    repo = build_bounded_repository(tmp_path / "repo", delay_ms=300, max_queue_size=1000, timeout_us=200_000)
    server = start_server(repo)
    try:
        outcomes = _burst_grpc(server.grpc_url)
        # Triton 2.51 expires queued requests lazily, when the batcher next forms a batch: a shed request is
        # answered after about the timeout plus one batch, not at once. Bounded, not instant:
        _assert_shed(outcomes, "Request timeout expired", instant=False)
        # 40 requests at 2 per 300 ms would take 6 s to serve; shedding answers all of them much sooner.
        assert max(o.latency_s for o in outcomes) < 3, max(o.latency_s for o in outcomes)
        _server_healthy(server)
    finally:
        server.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_client_can_ask_for_a_shorter_queue_timeout(start_server, tmp_path, protocol):
    # allow_timeout_override: a request's own `timeout` (microseconds) replaces the model's default (60 s here).
    import tritonclient.grpc as grpcclient

    repo = build_bounded_repository(tmp_path / "repo", delay_ms=300, max_queue_size=1000, timeout_us=60_000_000)
    server = start_server(repo)
    try:
        module = grpcclient if protocol == "grpc" else httpclient
        url = server.grpc_url if protocol == "grpc" else server.http_url
        client = module.InferenceServerClient(url, **({} if protocol == "grpc" else {"concurrency": 6}))
        x = module.InferInput("X", [1, 1], "FP32")
        x.set_data_from_numpy(np.ones((1, 1), np.float32))
        results: list = []
        if protocol == "grpc":
            done = threading.Event()

            def callback(result, error) -> None:
                results.append(error)
                if len(results) == 6:
                    done.set()

            for _ in range(6):
                client.async_infer("bounded", [x], callback=callback, timeout=50_000)
            assert done.wait(30)
        else:
            for request in [client.async_infer("bounded", [x], timeout=50_000) for _ in range(6)]:
                try:
                    request.get_result()
                    results.append(None)
                except httpclient.InferenceServerException as err:
                    results.append(err)
        client.close()
        shed = [e for e in results if e is not None]
        # One batch of 2 runs at once; the rest wait 300 ms, far beyond the 50 ms they asked for.
        assert len(shed) >= 3 and all("Request timeout expired" in e.message() for e in shed), results
        assert len(shed) < 6, "the first batch ran: nothing had waited yet"
        _server_healthy(server)
    finally:
        server.stop()
