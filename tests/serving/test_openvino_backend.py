"""The embedded `openvino` backend on the real server: the same batching, per-request errors, warm-up, statistics
and crash recovery as the `onnxruntime` backend, over the same ONNX file (tritonkit.serving.onnx_backend)."""

from __future__ import annotations

import os
import queue
import signal
import time

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tests.support.backend_support import (
    ROWS,
    TABLE,
    assert_bad_id_is_a_client_error,
    assert_wrong_width_is_a_client_error,
    client_for,
    counters,
    infer,
    lookup_model,
)
from tritonkit.errors import RepositoryCallError
from tritonkit.repository.config import DynamicBatching, ModelSpec, Tensor

THREADS = {"onnxruntime": "intra_op_thread_count", "openvino": "INFERENCE_NUM_THREADS"}


def _lookup(name: str, runtime: str, **params: str) -> ModelSpec:
    return ModelSpec(
        name=name, backend=runtime, max_batch_size=64,
        inputs=[Tensor("IDS", "INT64", [-1], allow_ragged_batch=True)],
        outputs=[Tensor("Y", "FP32", [1]), Tensor("BATCH", "FP32", [1])],
        # A preferred size equal to the burst below: the burst becomes one execute().
        dynamic_batching=DynamicBatching(max_queue_delay_microseconds=2_000_000, preferred_batch_size=[24]),
        parameters={THREADS[runtime]: "1", **params},
        # Triton's default file name for openvino is model.xml; our generator names the .onnx the same way.
        default_model_filename="model.onnx",
    )


def _double_model(path) -> None:
    """Y = 2 X over a graph whose width is fixed at 4 (the config below takes any width)."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "X"], ["Y"])], "double",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    repo = tmp_path_factory.mktemp("openvino_repo")
    for runtime in THREADS:
        lookup_model(repo / f"lookup_{runtime}" / "1" / "model.onnx", computed_table=False)
        _lookup(f"lookup_{runtime}", runtime).write(repo)
    lookup_model(repo / "lookup_cold" / "1" / "model.onnx", computed_table=False)
    _lookup("lookup_cold", "openvino", warmup_runs="0").write(repo)
    _double_model(repo / "double" / "1" / "model.onnx")
    ModelSpec(name="double", backend="openvino", max_batch_size=8, inputs=[Tensor("X", "FP32", [-1])],
              outputs=[Tensor("Y", "FP32", [-1])], parameters={"INFERENCE_NUM_THREADS": "1"},
              default_model_filename="model.onnx").write(repo)
    lookup_model(repo / "bad_streams" / "1" / "model.onnx", computed_table=False)
    _lookup("bad_streams", "openvino", NUM_STREAMS="many").write(repo)
    return start_server(repo, model_control_mode="explicit",
                        models=["lookup_onnxruntime", "lookup_openvino", "lookup_cold", "double"])


def _burst(server, model: str, requests: list[np.ndarray]) -> list[tuple]:
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for n, ids in enumerate(requests):
            inp = grpcclient.InferInput("IDS", list(ids.shape), "INT64")
            inp.set_data_from_numpy(ids)
            client.async_infer(model, [inp], lambda result, error, n=n: answers.put((n, result, error)))
        got = dict((n, (r, e)) for n, r, e in (answers.get(timeout=60) for _ in requests))
    finally:
        client.close()
    return [got[n] for n in range(len(requests))]


def test_a_ragged_burst_is_one_padded_run_with_the_same_answers_as_onnxruntime(server):
    rng = np.random.default_rng(7)
    requests = [rng.integers(0, ROWS, (1 + n % 3, 1 + n % 9)).astype(np.int64) for n in range(24)]
    answers = {}
    for runtime in THREADS:
        before = counters(server, f"lookup_{runtime}")
        answers[runtime] = _burst(server, f"lookup_{runtime}", requests)
        after = counters(server, f"lookup_{runtime}")
        runs = after["session_runs"] - before.get("session_runs", 0)
        assert 1 <= runs <= 3, f"{runtime}: {runs} runs for one burst of 24 requests"
        assert after["padding_elements"] > before.get("padding_elements", 0), "ragged requests were not padded"
    for n, ids in enumerate(requests):
        for runtime in THREADS:
            result, error = answers[runtime][n]
            assert error is None, (runtime, n, error)
            np.testing.assert_array_equal(result.as_numpy("Y")[:, 0], TABLE[ids, 0].sum(axis=1))
        np.testing.assert_array_equal(answers["openvino"][n][0].as_numpy("Y"),
                                      answers["onnxruntime"][n][0].as_numpy("Y"))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("bad", [ROWS, -1])
def test_out_of_range_id_is_a_client_error_and_the_model_keeps_serving(server, protocol, bad):
    assert_bad_id_is_a_client_error(server, protocol, "lookup_openvino", bad)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_width_the_graph_does_not_take_is_a_client_error_naming_it(server, protocol):
    assert_wrong_width_is_a_client_error(server, protocol, "double")
    lib, client = client_for(server, protocol)
    try:
        inp = lib.InferInput("X", [2, 4], "FP32")
        inp.set_data_from_numpy(np.arange(8, dtype=np.float32).reshape(2, 4))
        np.testing.assert_array_equal(client.infer("double", [inp]).as_numpy("Y"),
                                      2 * np.arange(8, dtype=np.float32).reshape(2, 4))
    finally:
        client.close()


def test_warm_up_runs_at_load_unless_turned_off(server):
    assert counters(server, "lookup_openvino")["warmup_runs"] == 2
    assert counters(server, "lookup_cold")["warmup_runs"] == 0


def test_a_bad_openvino_parameter_fails_the_load_naming_it(server):
    with pytest.raises(RepositoryCallError, match="HTTP 400") as info:
        server.load_model("bad_streams", timeout_s=60)
    assert "NUM_STREAMS" in str(info.value) and "many" in str(info.value), info.value  # Triton's reason, passed on
    assert infer(server, "http", "lookup_openvino", np.array([[3]], np.int64))[0, 0] == TABLE[3, 0]


def test_a_killed_openvino_stub_is_reloaded(server):
    pid = next(pid for pid, model in server.stub_processes().values() if model == "double")
    os.kill(pid, signal.SIGKILL)
    deadline, answer = time.monotonic() + 60, None
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        while time.monotonic() < deadline and answer is None:
            inp = httpclient.InferInput("X", [1, 4], "FP32")
            inp.set_data_from_numpy(np.ones((1, 4), np.float32))
            try:
                answer = client.infer("double", [inp]).as_numpy("Y")
            except InferenceServerException:
                time.sleep(0.1)
    finally:
        client.close()
    assert answer is not None, f"no recovery within 60 s (watchdog: {server.recoveries})"
    np.testing.assert_array_equal(answer, np.full((1, 4), 2.0, np.float32))
    assert any(r["model"] == "double" and r["outcome"] == "reloaded" for r in server.recoveries), server.recoveries
