"""Activations quantized at run time at a finer granularity than one static range per tensor, for the MatMuls a
search would otherwise leave in float (their static ranges meet outliers): the served form's step before float
(tritonkit.int8.steps.granular). Weights stay per-channel INT8; a scheme needs no calibration, so a recipe
that names one replays byte-identically from its weights alone.

Schemes, in the order a search tries them (docs/int8-search.md, "Finer granularity"):
- `nbits8-b128`, `nbits8-b64`, `nbits8-b32`: onnxruntime's `MatMulNBits`, 8-bit symmetric weights in blocks of
  128, 64 or 32 along K, activations quantized per block at run time (accuracy_level 4: int8 products). OpenVINO
  reads it as a FullyConnectedCompressed on INT8 weights, whose activations its CPU plugin quantizes per group of
  DYNAMIC_QUANTIZATION_GROUP_SIZE on a VNNI CPU; the runner sets that to the file's block
  (tritonkit.serving.runtimes.openvino_properties), so both runtimes quantize the same groups. Coarser
  blocks cost fewer rescales.
- `token-g4`: standard ONNX ops: activations u8 per token (row) and per 4 groups of K, each group a
  `MatMulInteger` on per-channel symmetric INT8 weights, zero points folded out through the weights' column sums
  (the exact-int8 session option keeps the sums exact).

Neither is TensorRT's explicit symmetric Q/DQ: the TensorRT form never uses them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

NBITS, NBITS_64, NBITS_COARSE, TOKEN_GROUPS = "nbits8-b32", "nbits8-b64", "nbits8-b128", "token-g4"
SCHEMES = (NBITS_COARSE, NBITS_64, NBITS, TOKEN_GROUPS)  # in the order a search tries them
# Each MatMulNBits scheme's block along K. 32 is onnxruntime's default (16 gained nothing on AVX2). A coarser block
# rescales less often but ranges more values at once: MPNet's 32 such MatMuls ran 1.12x (64) and 1.19x (128) the
# speed of 32 in OpenVINO bf16, 128 missing the served margin there (docs/int8-search.md).
BLOCKS = {NBITS: 32, NBITS_64: 64, NBITS_COARSE: 128}
GROUPS = 4  # token-g4's groups: per token alone missed MiniLM's cosine gate, 12 groups ran 0.74x (AVX2)


def weighted_matmuls(model, nodes: Sequence[str] | None = None, multiple_of: int = 1) -> list[str]:
    """The MatMuls of `model` on a constant 2-D weight whose rows (K) are a multiple of `multiple_of`, in graph
    order, of `nodes` only where given (attention's activation x activation products have no weight to quantize
    ahead)."""
    wanted, shapes = None if nodes is None else set(nodes), {i.name: tuple(i.dims) for i in model.graph.initializer}
    out = []
    for n in model.graph.node:
        dims = shapes.get(n.input[1]) if n.op_type == "MatMul" and len(n.input) == 2 else None
        if (wanted is not None and n.name not in wanted) or dims is None or len(dims) != 2 or dims[0] % multiple_of:
            continue
        out.append(n.name)
    return out


def eligible(model, nodes: Sequence[str], name: str) -> list[str]:
    """Of `nodes` (a recipe's float nodes), those scheme `name` can run."""
    return weighted_matmuls(model, nodes, BLOCKS.get(_checked(name), GROUPS))


def _checked(name: str) -> str:
    from tritonkit.errors import QuantizationError

    if name not in SCHEMES:
        raise QuantizationError(f"recipe dynamic.scheme: '{name}' is not one of {', '.join(SCHEMES)}")
    return name


def apply(model, name: str, nodes: Sequence[str]):
    """`model` (a ModelProto, changed in place and returned) with `nodes` rewritten by scheme `name`."""
    _checked(name)
    if not nodes:
        return model
    if name in BLOCKS:
        return nbits(model, nodes, BLOCKS[name])
    return token_groups(model, nodes, GROUPS)


def nbits(model, nodes: Sequence[str], block: int = BLOCKS[NBITS]):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level, log.level = log.level, logging.WARNING  # it logs every node it skips
    try:
        quantizer = MatMulNBitsQuantizer(model, nodes_to_include=list(nodes), algo_config=DefaultWeightOnlyQuantConfig(
            block_size=block, is_symmetric=True, accuracy_level=4, bits=8))
        quantizer.process()
    finally:
        log.level = level
    model = quantizer.model.model
    wanted = set(nodes)
    for n in model.graph.node:  # it suffixes what it rewrites; a recipe names a node as its float graph did
        base = n.name.rsplit("_Q8", 1)[0]
        if n.op_type == "MatMulNBits" and base in wanted:
            n.name = base
    return model


def token_groups(model, nodes: Sequence[str], groups: int = GROUPS):
    """Each node as [G, rows, K/G] u8 activations (scale and zero point per row and group) x INT8 weights."""
    from onnx import TensorProto
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    targets = set(nodes)
    rewritten, added = [], []
    # Since opset 18 a reduction takes its axes as an input, before as an attribute.
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)

    def const(name: str, value) -> str:
        added.append(nh.from_array(np.asarray(value), name))
        return name

    def reduce(op: str, x: str, y: str):
        if opset >= 18:
            return oh.make_node(op, [x, const(y + "_axes", np.array([-1], np.int64))], [y], keepdims=1)
        return oh.make_node(op, [x], [y], axes=[-1], keepdims=1)

    for n in graph.node:
        if n.name not in targets:
            rewritten.append(n)
            continue
        w = nh.to_array(inits[n.input[1]]).astype(np.float32)
        k, cols = w.shape[0] // groups, w.shape[1]
        w_scale = (np.maximum(np.abs(w).max(0), 1e-12) / 127.0).astype(np.float32)
        wq = np.clip(np.round(w / w_scale), -127, 127).astype(np.int8).reshape(groups, k, cols)
        p = f"{n.name}/{TOKEN_GROUPS}/"  # under the node's name, as are the helper nodes below
        x = n.input[0]
        zero, top = const(p + "0", np.float32(0)), const(p + "255", np.float32(255))
        parts = [
            oh.make_node("Shape", [x], [p + "shape"]),
            oh.make_node("Reshape", [x, const(p + "rows", np.array([-1, groups, k], np.int64))], [p + "x3"]),
            oh.make_node("Transpose", [p + "x3"], [p + "xg"], perm=[1, 0, 2]),
            reduce("ReduceMin", p + "xg", p + "min"),
            reduce("ReduceMax", p + "xg", p + "max"),
            oh.make_node("Min", [p + "min", zero], [p + "lo"]),  # the range holds 0, so it maps to an integer
            oh.make_node("Max", [p + "max", zero], [p + "hi"]),
            oh.make_node("Sub", [p + "hi", p + "lo"], [p + "range"]),
            oh.make_node("Div", [p + "range", top], [p + "s0"]),
            oh.make_node("Max", [p + "s0", const(p + "eps", np.float32(1e-12))], [p + "s"]),
            oh.make_node("Div", [p + "lo", p + "s"], [p + "lo_s"]),
            oh.make_node("Neg", [p + "lo_s"], [p + "zp0"]),
            oh.make_node("Round", [p + "zp0"], [p + "zp"]),
            oh.make_node("Div", [p + "xg", p + "s"], [p + "xs"]),
            oh.make_node("Round", [p + "xs"], [p + "xr"]),
            oh.make_node("Add", [p + "xr", p + "zp"], [p + "xz"]),
            oh.make_node("Clip", [p + "xz", zero, top], [p + "xc"]),
            oh.make_node("Cast", [p + "xc"], [p + "q"], to=TensorProto.UINT8),
            # Both zero points as inputs: onnxruntime's exact-int8 rewrite asserts on a MatMulInteger without them.
            oh.make_node("MatMulInteger", [p + "q", const(p + "wq", wq), const(p + "azp", np.uint8(0)),
                                           const(p + "bzp", np.int8(0))], [p + "acc"], name=n.name),
            oh.make_node("Cast", [p + "acc"], [p + "accf"], to=TensorProto.FLOAT),
            oh.make_node("Mul", [p + "zp", const(p + "colsum", wq.astype(np.float32).sum(1)[:, None, :])],
                         [p + "corr"]),
            oh.make_node("Sub", [p + "accf", p + "corr"], [p + "d"]),
            oh.make_node("Mul", [p + "d", p + "s"], [p + "ds"]),
            oh.make_node("ReduceSum", [p + "ds", const(p + "g_axis", np.array([0], np.int64))], [p + "sum"],
                         keepdims=0),
            oh.make_node("Mul", [p + "sum", const(p + "w_scale", w_scale)], [p + "y"]),
            oh.make_node("Slice", [p + "shape", const(p + "first", np.array([0], np.int64)),
                                   const(p + "last", np.array([-1], np.int64))], [p + "lead"]),
            oh.make_node("Concat", [p + "lead", const(p + "cols", np.array([cols], np.int64))], [p + "out_shape"],
                         axis=0),
            oh.make_node("Reshape", [p + "y", p + "out_shape"], [n.output[0]]),
        ]
        for j, part in enumerate(parts):  # named under the node, so a profile counts them as its cost
            part.name = part.name or f"{n.name}/{TOKEN_GROUPS}/{part.op_type}_{j}"
        rewritten += parts
    used = {i for n in rewritten for i in n.input}
    replaced = {n.input[1] for n in graph.node if n.name in targets} - used  # float weights no node reads now
    kept = [i for i in graph.initializer if i.name not in replaced]
    del graph.node[:]
    graph.node.extend(rewritten)
    del graph.initializer[:]
    graph.initializer.extend([*kept, *added])
    return model

