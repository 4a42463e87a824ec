"""Calibrated static INT8 quantization into explicit Q/DQ ONNX (onnxruntime.quantization), model-agnostic.

The output is what TensorRT's explicit-precision mode compiles and what onnxruntime's CPU kernels fuse into
integer MatMul/Conv: QuantFormat.QDQ, symmetric INT8 activations and weights, per-channel weights, every zero
point 0 (`check_qdq` enforces this after quantizing). A recipe may opt into onnxruntime's CPU form instead
(`activation_type="uint8"`: asymmetric uint8 activations, still symmetric per-channel int8 weights), which
TensorRT rejects but onnxruntime's x86 kernels run fastest. What differs per model is a `QuantRecipe` (calibration
method, op types, excluded nodes) and the metrics, which the model spec supplies.

By job: tritonkit.int8.settings (the recipe), .transforms (the graph prepared for quantizing), .calibration
(activation ranges), this module (the Q/DQ graph), .checks (its form and INT8 share), .report (JSON and a table).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tritonkit.errors import QuantizationError
from tritonkit.int8.calibration import all_op_types
from tritonkit.int8.checks import check_qdq
from tritonkit.int8.settings import ACTIVATION_TYPES, QuantRecipe, resolve_excluded
from tritonkit.int8.transforms import Prepared

# Rules that make the Q/DQ graph TensorRT-compilable; a recipe's extra_options cannot override them.
# Biases stay float: TensorRT has no INT32 DequantizeLinear, it folds float biases into its INT8 kernels.
_FIXED_OPTIONS = {"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False}
# The onnxruntime CPU form (activation_type="uint8"): only the weights' symmetry is fixed; biases default to
# int32 (onnxruntime's QLinearConv needs them quantized).
_FIXED_OPTIONS_UINT8 = {"ActivationSymmetric": False, "WeightSymmetric": True}


def quantize_prepared(prepared: Prepared, ranges, recipe: QuantRecipe, excluded: Iterable[str] = (),
                      check: bool = True):
    """Q/DQ ModelProto of a prepared graph with precomputed ranges; `excluded` nodes (plus the recipe's) stay float.
    `check=False` skips onnx's full checker (a search's candidates only feed onnxruntime, which checks them)."""
    import copy

    import onnx
    from onnx import numpy_helper
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

    if recipe.activation_type not in ACTIVATION_TYPES:
        raise QuantizationError(f"recipe '{recipe.name}': activation_type must be one of {ACTIVATION_TYPES}")
    model = prepared.inferred_copy()
    excluded = list(dict.fromkeys([*resolve_excluded(model, recipe), *excluded]))
    # A float conv must keep its original bias: the correction only offsets its int8 weights' error.
    # ... and its original weights: their rounding compensates errors only an int8 layer makes.
    floats = set(excluded)
    restore = {b: prepared.original_biases[b] for b, node in prepared.corrected_by.items() if node in floats}
    restore |= {w: prepared.original_weights[w] for w, node in prepared.rounded_by.items() if node in floats}
    for init in model.graph.initializer:
        if init.name in restore:
            init.CopyFrom(numpy_helper.from_array(restore[init.name], init.name))
    uint8 = recipe.activation_type == "uint8"
    fixed = _FIXED_OPTIONS_UINT8 if uint8 else _FIXED_OPTIONS
    # A DequantizeLinear shared by several MatMuls (Q, K and V read one tensor) blocks onnxruntime's fusion
    # into MatMulIntegerToFloat, leaving float MatMuls on dequantized weights: give each its own pair.
    extra = {"DedicatedQDQPair": True, **recipe.extra_options, **fixed}
    if not recipe.quantize_outputs and recipe.op_types:
        extra.setdefault("OpTypesToExcludeOutputQuantization", list(recipe.op_types))
    # Every argument that shapes the weights' scales and zero points: (per_channel, reduce_range, weight type,
    # activation type).
    shaping = (recipe.per_channel, False, QuantType.QInt8, QuantType.QUInt8 if uint8 else QuantType.QInt8)
    # Candidates of one prepared graph share its weights: their scales and zero points are computed once.
    key = (*shaping, json.dumps(extra, sort_keys=True, default=str))
    quantizer = _cached_quantizer(QDQQuantizer, prepared.initializer_params.setdefault(key, {}), set(restore))(
        model, *shaping, copy.deepcopy(ranges), [], excluded, recipe.op_types or all_op_types(), extra)
    quantizer.quantize_model()
    quantizer.model.topological_sort()
    out = quantizer.model.model
    keep_float(out, excluded)
    float_outputs(out)
    out.producer_name = f"tritonkit.int8.quantize:{recipe.name}"
    check_qdq(out, recipe.activation_type, per_channel=recipe.per_channel)
    if check:
        onnx.checker.check_model(out)
    return out


def _cached_quantizer(base, cache: dict, fresh: set[str]):
    """`base` (onnxruntime's QDQQuantizer) reusing initializers' scales and zero points from `cache`, filling it:
    onnxruntime computes per-channel ones in a Python loop over channels, most of a candidate's quantization time.
    `fresh` initializers (weights restored for float nodes) are computed anew and not cached."""

    class CachedQuantizer(base):
        def _calc_initializer_quant_params(self):
            def key(name):
                info = self.tensors_to_quantize[name]
                return name, info.tensor_type, info.axis

            todo = {n: i for n, i in self.tensors_to_quantize.items() if n in fresh or key(n) not in cache}
            every = self.tensors_to_quantize
            self.tensors_to_quantize = todo
            try:
                computed = super()._calc_initializer_quant_params()
            finally:
                self.tensors_to_quantize = every
            cache.update({key(n): p for n, p in computed.items() if n not in fresh})
            return {**{n: cache[key(n)] for n in every if n not in todo and key(n) in cache}, **computed}

    return CachedQuantizer


def float_outputs(model) -> list[str]:
    """Drop the Q/DQ pair onnxruntime's all-ops placement puts on a graph output; returns the outputs freed.

    A client reads graph outputs as they are: Lite0's probabilities in uint8 steps of 1/255 summed to 0.5-0.7 over
    1000 classes (most rounded to zero), and its logits lost their precision. The output's readers inside the graph
    (Softmax reading logits) then read the float tensor too, so logits and probabilities agree."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    freed = []
    for output in graph.output:
        dq = producer.get(output.name)
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is None or q.op_type != "QuantizeLinear" or readers.get(q.output[0]) != 1 or q.input[0] not in producer:
            continue
        source = q.input[0]
        for node in graph.node:
            node.input[:] = [output.name if name == source else name for name in node.input]
            node.output[:] = [output.name if name == source else name for name in node.output]
        graph.node.remove(q)
        graph.node.remove(dq)
        freed.append(output.name)
    if freed:
        used = {name for node in graph.node for name in node.input}
        keep = [init for init in graph.initializer if init.name in used]
        del graph.initializer[:]
        graph.initializer.extend(keep)
    return freed


def keep_float(model, excluded: Iterable[str]) -> list[str]:
    """Stop onnxruntime re-quantizing the float convs of an all-ops Q/DQ graph; returns the nodes it guarded.

    onnxruntime's WeightBiasQuantization pass (1.21+) takes a Conv/Gemm that reads a DequantizeLinear and reaches a
    QuantizeLinear through only Relu/Clip, and gives its float weights per-tensor int8 Q/DQ at session load: a depthwise
    conv left in float then runs worse than its per-channel int8 form (Lite0: top-1 agreement 0.83 -> 0.47 with
    every depthwise conv "in float"), and where that output's readers are several QuantizeLinear nodes. A second kind
    of consumer on that path (a Shape node, which reads no data) is a branch the pass skips."""
    import onnx

    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    producer = {out: node for node in model.graph.node for out in node.output}
    floats, guarded = set(excluded), []
    for node in list(model.graph.node):
        if node.name not in floats or node.op_type not in ("Conv", "ConvTranspose", "Gemm"):
            continue
        source = producer.get(node.input[0])
        if source is None or source.op_type != "DequantizeLinear":
            continue
        tensor = node.output[0]
        while len(consumers.get(tensor, [])) == 1 and consumers[tensor][0].op_type in ("Relu", "Clip"):
            tensor = consumers[tensor][0].output[0]
        after = consumers.get(tensor, [])
        # Every reader a QuantizeLinear: one, or one per reader where each got its own pair (DedicatedQDQPair).
        if after and all(c.op_type == "QuantizeLinear" for c in after):
            model.graph.node.append(onnx.helper.make_node("Shape", [tensor], [f"{node.name}_keep_float"],
                                                          name=f"{node.name}_keep_float"))
            guarded.append(node.name)
    return guarded
