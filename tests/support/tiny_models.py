"""Tiny ONNX models made by the tests (Polygraphy style): small, exact, and they report what the backend did.

Each model also outputs the batch size (and padded length) that `session.run` saw, so a test can tell a real
batched run from one run per request.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tritonkit.repository.config import DynamicBatching, ModelSpec, Tensor

OPSET = 17
W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0
B = np.array([0.5, -1.0, 2.0], dtype=np.float32)


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _ones_and_count(src: str, axis: int, prefix: str) -> list[onnx.NodeProto]:
    """Nodes making `{prefix}_count` [B,1]: the size of axis `axis` of src (float), per row."""
    return [
        helper.make_node("Mul", [src, "zero"], [f"{prefix}_z"]),
        helper.make_node("Add", [f"{prefix}_z", "one"], [f"{prefix}_ones"]),
        helper.make_node("ReduceSum", [f"{prefix}_ones", f"{prefix}_axes"], [f"{prefix}_sum"], keepdims=1),
    ]


def linear_model(path: Path) -> Path:
    """Y = X @ W + B ; BATCH = batch size of the run, per row."""
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["XW"]),
        helper.make_node("Add", ["XW", "B"], ["Y"]),
        helper.make_node("Slice", ["X", "s0", "s1", "s_ax"], ["X0"]),  # [B,1]
        *_ones_and_count("X0", 0, "b"),
        helper.make_node("Mul", ["b_ones", "b_sum"], ["BATCH"]),
    ]
    inits = [
        numpy_helper.from_array(W, "W"),
        numpy_helper.from_array(B, "B"),
        numpy_helper.from_array(np.array(0, np.float32), "zero"),
        numpy_helper.from_array(np.array(1, np.float32), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "s0"),
        numpy_helper.from_array(np.array([1], np.int64), "s1"),
        numpy_helper.from_array(np.array([1], np.int64), "s_ax"),
        numpy_helper.from_array(np.array([0], np.int64), "b_axes"),
    ]
    graph = helper.make_graph(
        nodes, "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("BATCH", TensorProto.FLOAT, ["batch", 1]),
        ],
        inits,
    )
    return _save(graph, path)


def _length_inits() -> list[onnx.TensorProto]:
    """Constants of a sum over axis 1 and of `_ones_and_count(..., 1, "l")`."""
    return [numpy_helper.from_array(np.array(0, np.float32), "zero"),
            numpy_helper.from_array(np.array(1, np.float32), "one"),
            numpy_helper.from_array(np.array([1], np.int64), "ax1"),
            numpy_helper.from_array(np.array([1], np.int64), "l_axes")]


def ragged_model(path: Path) -> Path:
    """TOTAL = sum over the (padded) sequence; SEEN_LEN = padded length of the run, per row."""
    nodes = [
        helper.make_node("ReduceSum", ["TOKENS", "ax1"], ["TOTAL"], keepdims=1),
        *_ones_and_count("TOKENS", 1, "l"),
    ]
    nodes.append(helper.make_node("Identity", ["l_sum"], ["SEEN_LEN"]))
    inits = _length_inits()
    graph = helper.make_graph(
        nodes, "ragged",
        [helper.make_tensor_value_info("TOKENS", TensorProto.FLOAT, ["batch", "seq"])],
        [
            helper.make_tensor_value_info("TOTAL", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("SEEN_LEN", TensorProto.FLOAT, ["batch", 1]),
        ],
        inits,
    )
    return _save(graph, path)


def masked_rows_model(path: Path) -> Path:
    """A text model's inputs (input_ids, attention_mask): TOTAL = sum of the unmasked ids, SEEN_LEN = padded length
    of the run, one value per row."""
    nodes = [
        helper.make_node("Mul", ["input_ids", "attention_mask"], ["kept"]),
        helper.make_node("Cast", ["kept"], ["kept_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["kept_f", "ax1"], ["TOTAL"], keepdims=1),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        *_ones_and_count("mask_f", 1, "l"),
        helper.make_node("Identity", ["l_sum"], ["SEEN_LEN"]),
    ]
    inits = _length_inits()
    graph = helper.make_graph(
        nodes, "masked_rows",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
         for n in ("input_ids", "attention_mask")],
        [
            helper.make_tensor_value_info("TOTAL", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("SEEN_LEN", TensorProto.FLOAT, ["batch", 1]),
        ],
        inits,
    )
    return _save(graph, path)


def fixed_width_model(path: Path) -> Path:
    """Needs exactly 4 features although its config says -1: only the model can reject a bad request."""
    return linear_model(path)


def build_smoke_repository(repo: Path) -> Path:
    """A model repository of tiny ONNX models served by the `onnxruntime` backend."""
    batching = DynamicBatching(preferred_batch_size=[8, 16], max_queue_delay_microseconds=20_000)
    linear_model(repo / "smoke_linear" / "1" / "model.onnx")
    ModelSpec(
        name="smoke_linear", backend="onnxruntime", max_batch_size=32,
        inputs=[Tensor("X", "FP32", [4])],
        outputs=[Tensor("Y", "FP32", [3]), Tensor("BATCH", "FP32", [1])],
        instance_count=2, dynamic_batching=batching,
        parameters={"intra_op_thread_count": "1"},
    ).write(repo)
    ragged_model(repo / "smoke_ragged" / "1" / "model.onnx")
    ModelSpec(
        name="smoke_ragged", backend="onnxruntime", max_batch_size=32,
        inputs=[Tensor("TOKENS", "FP32", [-1], allow_ragged_batch=True)],
        outputs=[Tensor("TOTAL", "FP32", [1]), Tensor("SEEN_LEN", "FP32", [1])],
        dynamic_batching=batching,
        parameters={"pad_value.TOKENS": "0"},
    ).write(repo)
    # The same model with length bucketing: a batch splits into runs whose padding is at most 25 %.
    ragged_model(repo / "smoke_bucketed" / "1" / "model.onnx")
    ModelSpec(
        name="smoke_bucketed", backend="onnxruntime", max_batch_size=32,
        inputs=[Tensor("TOKENS", "FP32", [-1], allow_ragged_batch=True)],
        outputs=[Tensor("TOTAL", "FP32", [1]), Tensor("SEEN_LEN", "FP32", [1])],
        dynamic_batching=batching,
        parameters={"pad_value.TOKENS": "0", "ragged_max_padding": "0.25"},
    ).write(repo)
    fixed_width_model(repo / "smoke_loose" / "1" / "model.onnx")
    ModelSpec(
        name="smoke_loose", backend="onnxruntime", max_batch_size=32,
        inputs=[Tensor("X", "FP32", [-1])],
        outputs=[Tensor("Y", "FP32", [3]), Tensor("BATCH", "FP32", [1])],
        dynamic_batching=batching,
    ).write(repo)
    return repo


SLEEPY_MODEL_PY = '''
import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.delay = float(json.loads(args["model_config"])["parameters"]["delay_ms"]["string_value"]) / 1000

    def execute(self, requests):
        time.sleep(self.delay)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
            for r in requests
        ]
'''


def build_sleepy_repository(repo: Path, delay_ms: int) -> Path:
    """A Python-backend echo model that takes `delay_ms` per execute(): in-flight work for drain/crash tests."""
    ModelSpec(
        name="sleepy", backend="python", max_batch_size=8,
        inputs=[Tensor("X", "FP32", [1])], outputs=[Tensor("Y", "FP32", [1])],
        dynamic_batching=DynamicBatching(max_queue_delay_microseconds=1000),
        parameters={"delay_ms": str(delay_ms)},
    ).write(repo)
    (repo / "sleepy" / "1").mkdir(parents=True, exist_ok=True)
    (repo / "sleepy" / "1" / "model.py").write_text(SLEEPY_MODEL_PY)
    return repo
