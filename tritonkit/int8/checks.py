"""Checks of a Q/DQ graph: its form (check_qdq: TensorRT's symmetric INT8 or onnxruntime's uint8 CPU form), the op
types that run in INT8, and the share of a graph's weighted multiply-accumulates in INT8."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from tritonkit.errors import QuantizationError
from tritonkit.int8.settings import ACTIVATION_TYPES


def check_qdq(model, activation_type: str = "int8", per_channel: bool = False) -> dict[str, int]:
    """Returns Q/DQ op counts after checking the form. "int8" (TensorRT explicit quantization): every Q/DQ pair
    is INT8 with zero point 0. "uint8" (onnxruntime CPU): activations uint8 (any zero point), weights symmetric
    INT8 (zero point 0), biases INT32 with zero point 0. per_channel: weights of rank >= 2 have one scale per
    channel of their quantization axis."""
    from onnx import TensorProto, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    counts = {"QuantizeLinear": 0, "DequantizeLinear": 0}
    if activation_type == "uint8":
        return _check_qdq_uint8(model, inits, counts, per_channel)
    if activation_type != "int8":
        raise QuantizationError(f"activation_type must be one of {ACTIVATION_TYPES}, not {activation_type!r}")
    for node in model.graph.node:
        if node.op_type not in counts:
            continue
        counts[node.op_type] += 1
        if len(node.input) < 3:
            continue  # no zero point: defaults to uint8 0, but we always ask for int8
        zp = inits.get(node.input[2])
        if zp is None:
            raise QuantizationError(f"{node.name}: zero point {node.input[2]} is not a constant")
        if zp.data_type != TensorProto.INT8:
            raise QuantizationError(f"{node.name}: zero point type {zp.data_type} is not INT8")
        if np.any(numpy_helper.to_array(zp) != 0):
            raise QuantizationError(f"{node.name}: non-zero zero point (TensorRT needs symmetric INT8)")
    if counts["QuantizeLinear"] == 0:
        raise QuantizationError("no QuantizeLinear nodes: nothing was quantized")
    return counts


# Ops whose input 1 onnxruntime quantizes as a weight when it is a constant.
_WEIGHT_SLOT_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose")


def _check_qdq_uint8(model, inits: dict, counts: dict[str, int], per_channel: bool) -> dict[str, int]:
    from onnx import TensorProto, numpy_helper

    weight_reads = {n.input[1] for n in model.graph.node if n.op_type in _WEIGHT_SLOT_OPS and len(n.input) > 1}
    for node in model.graph.node:
        if node.op_type not in counts:
            continue
        counts[node.op_type] += 1
        zp = inits.get(node.input[2]) if len(node.input) >= 3 and node.input[2] else None
        if len(node.input) >= 3 and node.input[2] and zp is None:
            raise QuantizationError(f"{node.name}: zero point {node.input[2]} is not a constant")
        const = inits.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        # A constant an element-wise op reads (GELU's 0.5, sqrt(2), 1) is quantized as an activation: uint8, any
        # zero point. Only a weighted op's weight must be the s8 side of onnxruntime's u8s8 kernels.
        if const is None or (const.data_type == TensorProto.UINT8 and node.output[0] not in weight_reads):
            if zp is not None and zp.data_type != TensorProto.UINT8:
                raise QuantizationError(f"{node.name}: activation zero point type {zp.data_type} is not UINT8")
            continue
        if const.data_type not in (TensorProto.INT8, TensorProto.INT32):
            raise QuantizationError(f"{node.name}: weight {const.name} type {const.data_type} is not INT8/INT32")
        if zp is not None and (zp.data_type != const.data_type or np.any(numpy_helper.to_array(zp) != 0)):
            raise QuantizationError(f"{node.name}: weight {const.name} is not symmetric (zero point must be 0)")
        scale = inits.get(node.input[1])
        if per_channel and const.data_type == TensorProto.INT8 and len(const.dims) >= 2 and scale is not None:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
            if int(np.prod(scale.dims)) != const.dims[axis]:
                raise QuantizationError(f"{node.name}: weight {const.name} is not per-channel")
    if counts["QuantizeLinear"] == 0:
        raise QuantizationError("no QuantizeLinear nodes: nothing was quantized")
    return counts


def quantized_ops(model_path: Path) -> dict[str, int]:
    """Op types whose inputs are fed by DequantizeLinear (i.e. that run in INT8 once fused)."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    dq_outputs = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    ops: dict[str, int] = {}
    for node in graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") and any(i in dq_outputs for i in node.input):
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return ops


# Weighted ops whose activations are quantized at run time (tritonkit.int8.granularity): INT8 without Q/DQ.
RUNTIME_QUANTIZED = ("MatMulNBits", "MatMulInteger")


def weight_macs(model, weight_ops: Sequence[str]) -> dict[str, float]:
    """Multiply-accumulates per sample of each `weight_ops` node with a constant weight, from a shape-inferred
    graph: weight elements × output positions (a conv's output pixels; 1 for MatMul/Gemm, whose rows per sample,
    the tokens, are the same for every layer). Activation × activation MatMuls have no weight and count 0."""
    sizes = {i.name: math.prod(i.dims) for i in model.graph.initializer}
    # A Q/DQ graph's quantized weight reaches its node through DequantizeLinear.
    sizes |= {n.output[0]: sizes[n.input[0]] for n in model.graph.node
              if n.op_type == "DequantizeLinear" and n.input[0] in sizes}
    dims = {v.name: [d.dim_value if d.HasField("dim_value") else 0 for d in v.type.tensor_type.shape.dim]
            for v in [*model.graph.value_info, *model.graph.output]}
    out = {}
    for node in model.graph.node:
        weight = next((sizes[i] for i in node.input[1:2] if i in sizes), None)
        if node.op_type in RUNTIME_QUANTIZED and "MatMul" in weight_ops:  # tritonkit.int8.granularity's nodes
            attrs = {a.name: a.i for a in node.attribute}
            out[node.name] = float(attrs["K"] * attrs["N"]) if node.op_type == "MatMulNBits" else float(weight or 0)
            continue
        if node.op_type not in weight_ops or weight is None:
            continue
        positions = math.prod(d for d in dims.get(node.output[0], [])[2:] if d) if node.op_type == "Conv" else 1
        out[node.name] = float(weight * positions)
    return out


def int8_share(macs: dict[str, float], float_nodes: Iterable[str]) -> float:
    """The share of a graph's weighted multiply-accumulates that a recipe leaves in INT8."""
    total = sum(macs.values())
    return 1.0 - sum(macs.get(n, 0.0) for n in set(float_nodes)) / total if total else 0.0


def artefact_int8_share(model_path: Path, weight_ops: Sequence[str]) -> float:
    """The share of a built graph's weighted multiply-accumulates that run in INT8 (their weight is quantized)."""
    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load(str(model_path), load_external_data=False))
    dq_outputs = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    macs = weight_macs(model, weight_ops)
    return int8_share(macs, [n.name for n in model.graph.node if n.name in macs and n.input[1] not in dq_outputs
                             and n.op_type not in RUNTIME_QUANTIZED])
