"""Helpers the backend tests share (onnxruntime and openvino, one ONNX file each): the lookup model, calls on it,
the backend's counters, and the client errors both backends must give alike."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from tritonkit.perf.analyzer import metrics_counters

ROWS = 10
TABLE = np.arange(ROWS, dtype=np.float32).reshape(ROWS, 1)  # row 0 is 0: right-padding adds nothing
CLIENT_ERROR = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}


def lookup_model(path, computed_table: bool) -> None:
    """Y = sum over the sequence of TABLE[IDS]; BATCH = rows of the run. With `computed_table` the table comes out
    of a node, so the backend cannot check ids up front and a bad id fails inside session.run."""
    table = "T_src" if computed_table else "T"
    nodes = [helper.make_node("Identity", ["T_src"], ["T"])] if computed_table else []
    nodes += [
        helper.make_node("Gather", ["T", "IDS"], ["G"]),  # [B, L, 1]
        helper.make_node("ReduceSum", ["G", "ax1"], ["Y3"], keepdims=0),  # [B, 1]
        helper.make_node("Identity", ["Y3"], ["Y"]),
        helper.make_node("Shape", ["IDS"], ["shape"]),
        helper.make_node("Slice", ["shape", "z", "o"], ["b_i64"]),
        helper.make_node("Cast", ["b_i64"], ["b_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["Y", "zero"], ["Yz"]),
        helper.make_node("Add", ["Yz", "b_f"], ["BATCH"]),
    ]
    inits = [
        numpy_helper.from_array(TABLE, table),
        numpy_helper.from_array(np.array([1], np.int64), "ax1"),
        numpy_helper.from_array(np.array([0], np.int64), "z"),
        numpy_helper.from_array(np.array([1], np.int64), "o"),
        numpy_helper.from_array(np.array(0, np.float32), "zero"),
    ]
    graph = helper.make_graph(
        nodes, "lookup", [helper.make_tensor_value_info("IDS", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 1]),
         helper.make_tensor_value_info("BATCH", TensorProto.FLOAT, ["batch", 1])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def client_for(server, protocol: str):
    """(tritonclient module, client) for `protocol` ("http" or "grpc") on `server`; the caller closes the client."""
    lib = httpclient if protocol == "http" else grpcclient
    return lib, lib.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)


def infer(server, protocol: str, model: str, ids: np.ndarray) -> np.ndarray:
    lib, client = client_for(server, protocol)
    try:
        inp = lib.InferInput("IDS", list(ids.shape), "INT64")
        inp.set_data_from_numpy(ids)
        return client.infer(model, [inp]).as_numpy("Y")
    finally:
        client.close()


def counters(server, model: str) -> dict[str, float]:
    """The backend's tritonkit_ort_* counters of `model`, named without prefix and _total."""
    return {name.removeprefix("tritonkit_ort_").removesuffix("_total"): value
            for (name, m), value in metrics_counters(server.metrics_url).items() if m == model}


def assert_bad_id_is_a_client_error(server, protocol: str, model: str, bad: int) -> None:
    """An id past the table fails its request as the client's error naming input and limit; the model serves on."""
    with pytest.raises(InferenceServerException) as info:
        infer(server, protocol, model, np.array([[1, bad, 2]], np.int64))
    assert str(info.value.status()) == CLIENT_ERROR[protocol], info.value
    assert "'IDS'" in str(info.value) and f"[0, {ROWS})" in str(info.value) and str(bad) in str(info.value)
    assert infer(server, protocol, model, np.array([[1, 2]], np.int64))[0, 0] == TABLE[1, 0] + TABLE[2, 0]


def assert_wrong_width_is_a_client_error(server, protocol: str, model: str) -> None:
    """`model`'s config takes any width of X, its graph only 4: a width of 5 is the client's error naming X and 4."""
    lib, client = client_for(server, protocol)
    try:
        inp = lib.InferInput("X", [1, 5], "FP32")
        inp.set_data_from_numpy(np.ones((1, 5), np.float32))
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, [inp])
        assert str(info.value.status()) == CLIENT_ERROR[protocol], info.value
        assert "'X'" in str(info.value) and "Expected: 4" in str(info.value)
    finally:
        client.close()
