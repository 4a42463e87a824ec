"""The `onnxruntime` backend on the real server: errors a request causes are client errors naming the input and the
limit (HTTP 400 / gRPC INVALID_ARGUMENT), and a batched run that fails is bisected, not rerun request by request."""

from __future__ import annotations

import math
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.backend_support import (
    CLIENT_ERROR,
    ROWS,
    TABLE,
    assert_bad_id_is_a_client_error,
    assert_wrong_width_is_a_client_error,
    counters,
    lookup_model,
)
from tests.support.tiny_models import masked_rows_model
from tritonkit import paths
from tritonkit.perf import stats
from tritonkit.repository.config import DynamicBatching, ModelSpec, Tensor


def _spec(name: str, **batching) -> ModelSpec:
    return ModelSpec(
        name=name, backend="onnxruntime", max_batch_size=64,
        inputs=[Tensor("IDS", "INT64", [-1], allow_ragged_batch=True)],
        outputs=[Tensor("Y", "FP32", [1]), Tensor("BATCH", "FP32", [1])],
        dynamic_batching=DynamicBatching(**batching),
        parameters={"ragged_max_padding": "0.25", "intra_op_thread_count": "1"},
    )


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    repo = tmp_path_factory.mktemp("lookup_repo")
    lookup_model(repo / "lookup" / "1" / "model.onnx", computed_table=False)
    _spec("lookup", max_queue_delay_microseconds=1000).write(repo)
    lookup_model(repo / "lookup_late" / "1" / "model.onnx", computed_table=True)
    # A long queue delay and a preferred size equal to the test's burst: the burst becomes one execute().
    _spec("lookup_late", max_queue_delay_microseconds=2_000_000, preferred_batch_size=[24]).write(repo)
    return start_server(repo)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("bad", [ROWS, 1000, -1])
def test_out_of_range_id_is_a_client_error_naming_input_and_limit(server, protocol, bad):
    assert_bad_id_is_a_client_error(server, protocol, "lookup", bad)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tensor_the_model_rejects_is_a_client_error(smoke_server, protocol):
    # smoke_loose's config takes any width, its model only 4: onnxruntime refuses the feed (INVALID_ARGUMENT).
    assert_wrong_width_is_a_client_error(smoke_server, protocol, "smoke_loose")


def _executions(server, model: str) -> int:
    return stats.read(server.http_url, [model])[model].executions


def test_failed_batch_is_bisected_and_other_groups_are_not_rerun(server):
    """8 short and 16 long requests in one burst; one long one has an id past the table, found only by
    session.run. Only the long group is retried, by halves: at most 2*log2(16) extra runs, not 24."""
    shorts = [np.array([[i % ROWS]], np.int64) for i in range(8)]
    longs = [np.array([[(i + j) % ROWS for j in range(8)]], np.int64) for i in range(16)]
    bad = 11
    longs[bad] = longs[bad].copy()
    longs[bad][0, 3] = 99
    before, executions_before = counters(server, "lookup_late"), _executions(server, "lookup_late")

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for n, ids in enumerate(shorts + longs):
            inp = grpcclient.InferInput("IDS", list(ids.shape), "INT64")
            inp.set_data_from_numpy(ids)
            client.async_infer("lookup_late", [inp], lambda result, error, n=n: answers.put((n, result, error)))
        results = dict((n, (r, e)) for n, r, e in (answers.get(timeout=60) for _ in range(24)))
    finally:
        client.close()

    after, executions = counters(server, "lookup_late"), _executions(server, "lookup_late") - executions_before
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("session_runs", "failed_runs", "retried_runs")}
    for n, ids in enumerate(shorts + longs):
        result, error = results[n]
        if n == len(shorts) + bad:
            assert error is not None and str(error.status()) == CLIENT_ERROR["grpc"], error
            assert "out of data bounds" in str(error), error
            continue
        assert error is None, (n, error)
        assert result.as_numpy("Y")[0, 0] == TABLE[ids[0], 0].sum()
    # Two length buckets per execute(); the failed one costs 1 + 2 runs per halving of its (<= 16) requests.
    budget = 2 * executions + 2 * math.ceil(math.log2(len(longs)))
    runs = delta["session_runs"] + delta["failed_runs"]
    assert runs <= budget, f"{runs} session.run calls for {executions} execute(s) (budget {budget}): {delta}"
    assert 1 <= delta["retried_runs"] <= 2 * math.ceil(math.log2(len(longs))), delta
    if executions == 1:  # the short group shared the execute() with the failed one and was not rerun
        assert all(results[n][0].as_numpy("BATCH")[0, 0] == len(shorts) for n in range(len(shorts)))


@pytest.fixture(scope="module")
def encoder_server(start_server):
    if not (paths.MODEL_REPOSITORY / "text_encoder" / "1" / "model.onnx").exists():
        pytest.skip("the text encoder is not built (make build)")
    return start_server(paths.MODEL_REPOSITORY, model_control_mode="explicit", models=["text_encoder"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_token_ids_past_the_vocabulary_sent_to_the_encoder_are_client_errors(encoder_server, protocol):
    lib = httpclient if protocol == "http" else grpcclient
    url = encoder_server.http_url if protocol == "http" else encoder_server.grpc_url
    client = lib.InferenceServerClient(url)

    def infer(ids):
        inputs = []
        for name in ("input_ids", "attention_mask"):
            inp = lib.InferInput(name, [1, len(ids)], "INT64")
            inp.set_data_from_numpy(np.array([ids] if name == "input_ids" else [[1] * len(ids)], np.int64))
            inputs.append(inp)
        return client.infer("text_encoder", inputs).as_numpy("embedding")

    try:
        with pytest.raises(InferenceServerException) as info:
            infer([101, 40_000, 102])
        assert str(info.value.status()) == CLIENT_ERROR[protocol], info.value
        assert "'input_ids'" in str(info.value) and "[0, 30522)" in str(info.value) and "40000" in str(info.value)
        assert infer([101, 7592, 102]).shape == (1, 384)
    finally:
        client.close()


@pytest.fixture(scope="module")
def rows_server(start_server, tmp_path_factory):
    repo = tmp_path_factory.mktemp("rows_repo")
    masked_rows_model(repo / "rows" / "1" / "model.onnx")
    ModelSpec(
        name="rows", backend="onnxruntime", max_batch_size=64,
        inputs=[Tensor(n, "INT64", [-1], allow_ragged_batch=True) for n in ("input_ids", "attention_mask")],
        outputs=[Tensor("TOTAL", "FP32", [1]), Tensor("SEEN_LEN", "FP32", [1])],
        dynamic_batching=DynamicBatching(max_queue_delay_microseconds=1000),
        parameters={"ragged_max_padding": "0.25", "intra_op_thread_count": "1"},
    ).write(repo)
    return start_server(repo)


def test_rows_of_one_request_run_in_length_buckets_of_their_own(rows_server):
    """A reranker's request holds documents of many lengths, right-padded to its longest: each row runs cut to its
    bucket's longest, and every row's answer is the one the whole padded request gives."""
    lengths = [2, 3, 10, 9, 1]
    ids = np.zeros((len(lengths), 10), np.int64)
    mask = np.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, :n] = np.arange(1, n + 1) * (r + 1)
        mask[r, :n] = 1
    client = httpclient.InferenceServerClient(rows_server.http_url)
    try:
        inputs = []
        for name, array in (("input_ids", ids), ("attention_mask", mask)):
            inputs.append(httpclient.InferInput(name, list(array.shape), "INT64"))
            inputs[-1].set_data_from_numpy(array)
        before = counters(rows_server, "rows")
        result = client.infer("rows", inputs)
        after = counters(rows_server, "rows")
    finally:
        client.close()
    np.testing.assert_array_equal(result.as_numpy("TOTAL")[:, 0], (ids * mask).sum(1))
    seen = result.as_numpy("SEEN_LEN")[:, 0]
    assert seen.tolist() == [2, 3, 10, 10, 2], seen  # runs (1, 2), (3), (9, 10): each within 25 % padding
    assert after["session_runs"] - before["session_runs"] == 3
    assert after["padding_elements"] - before["padding_elements"] == 2 * (1 + 1)
