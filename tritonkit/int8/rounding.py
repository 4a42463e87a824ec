"""Error-compensating int8 weight rounding (GPTQ, Frantar et al., 2023) on an ONNX graph, before the quantizer.

Round-to-nearest treats every weight alone. GPTQ rounds one input column at a time and moves the error it makes
onto the columns not yet rounded, weighted by the layer's input second moments H = E[x xᵀ] measured on the
calibration data, so the layer's *output* error is what gets minimised. The result is written back as float
weights that lie exactly on the symmetric per-output-channel int8 grid, scale = max|w| / 127: onnxruntime's
quantizer derives that same scale from them and recovers the same integers, so no quantizer change is needed.
Each row's largest weight is pinned to ±127 so that the grid survives the compensation; a row that still misses
it (all-zero rows) takes round-to-nearest (counted in the result).

Handled: 2-D Conv (any group count; depthwise is one 1-row matrix per channel), Gemm and MatMul with a constant
weight. Layers are rounded in graph order, in chunks; each chunk's inputs are measured on the graph whose earlier
chunks are already rounded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tritonkit.errors import QuantizationError

DAMPING = 0.01  # fraction of mean(diag H) added to H's diagonal: keeps the inverse stable (GPTQ's default)
QMAX = 127  # symmetric int8 weights as onnxruntime quantizes them: [-127, 127]
# Input rows (conv output positions, tokens) sampled per layer and batch for H: d is at most a few thousand, so
# tens of thousands of rows over a calibration set estimate it well, and a full 112x112 feature map costs 10x more.
POSITIONS = 4096
STAGES = 8  # calibration passes: layers are rounded in this many chunks, each measured after the ones before


@dataclass
class _Layer:
    node: str
    weight: str
    kind: str  # "conv", "gemm_t" (Gemm transB=1: W is [out, in]) or "in_out" (MatMul, Gemm transB=0: [in, out])
    groups: int = 1
    attrs: dict = field(default_factory=dict)
    hessian: np.ndarray | None = None  # [groups, d, d], summed over samples
    samples: int = 0


@dataclass
class RoundingResult:
    path: Path
    rounded: dict[str, str]  # weight initializer -> node name
    originals: dict[str, np.ndarray]  # weight initializer -> its float weights before rounding
    nearest_rows: int  # rows that fell back to round-to-nearest (see module doc)
    codes: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # weight -> (codes, row scales)
    nearest: dict[str, np.ndarray] = field(default_factory=dict)  # weight -> round-to-nearest codes


def _layers(graph, op_types: set[str] | None) -> list[_Layer]:
    from onnx import helper

    inits = {i.name: i for i in graph.initializer}
    layers = []
    for node in graph.node:
        if op_types is not None and node.op_type not in op_types:
            continue
        if node.op_type not in ("Conv", "Gemm", "MatMul") or len(node.input) < 2 or node.input[1] not in inits:
            continue
        rank = len(inits[node.input[1]].dims)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Conv" and rank == 4 and attrs.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET"):
            layers.append(_Layer(node.name, node.input[1], "conv", int(attrs.get("group", 1)), attrs))
        elif node.op_type == "Gemm" and rank == 2 and not attrs.get("transA", 0):
            layers.append(_Layer(node.name, node.input[1], "gemm_t" if attrs.get("transB", 0) else "in_out"))
        elif node.op_type == "MatMul" and rank == 2:
            layers.append(_Layer(node.name, node.input[1], "in_out"))
    return layers


def _positions(rng: np.random.Generator, total: int) -> np.ndarray | slice:
    return slice(None) if total <= POSITIONS else np.sort(rng.choice(total, POSITIONS, replace=False))


def _patches(x: np.ndarray, layer: _Layer, kernel: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """[groups, positions, d] input patches a conv multiplies with each output channel's d weights, at up to
    POSITIONS sampled output positions."""
    n, c = x.shape[:2]
    g = layer.groups
    kh, kw = kernel
    (sh, sw), (dh, dw) = layer.attrs.get("strides", [1, 1]), layer.attrs.get("dilations", [1, 1])
    top, left, bottom, right = layer.attrs.get("pads", [0, 0, 0, 0])
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right))) if any((top, left, bottom, right)) else x
    win = np.lib.stride_tricks.sliding_window_view(xp, (dh * (kh - 1) + 1, dw * (kw - 1) + 1), axis=(2, 3))
    win = win[:, :, ::sh, ::sw, ::dh, ::dw]  # a view: [n, c, ho, wo, kh, kw]
    ho, wo = win.shape[2:4]
    pick = _positions(rng, n * ho * wo)
    flat = np.arange(n * ho * wo)[pick]
    p = win[flat // (ho * wo), :, (flat // wo) % ho, flat % wo]  # [m, c, kh, kw], only the sampled patches
    return p.reshape(len(flat), g, (c // g) * kh * kw).transpose(1, 0, 2)


def _accumulate(layer: _Layer, x: np.ndarray, w_shape: tuple[int, ...], rng: np.random.Generator) -> None:
    x = x.astype(np.float32, copy=False)
    if layer.kind == "conv":
        p = _patches(x, layer, w_shape[2:], rng)
    else:
        rows = x.reshape(-1, x.shape[-1])
        p = rows[_positions(rng, len(rows))][None]
    h = np.matmul(p.transpose(0, 2, 1), p).astype(np.float64)
    layer.hessian = h if layer.hessian is None else layer.hessian + h
    layer.samples += p.shape[1]


def _matrices(w: np.ndarray, layer: _Layer) -> np.ndarray:
    """[groups, rows, d]: one row per output channel, its d input weights."""
    if layer.kind == "conv":
        cout = w.shape[0]
        return w.reshape(layer.groups, cout // layer.groups, -1)
    return (w if layer.kind == "gemm_t" else w.T)[None]


def _weights(m: np.ndarray, layer: _Layer, shape: tuple[int, ...]) -> np.ndarray:
    if layer.kind == "conv":
        return m.reshape(shape)
    return m[0] if layer.kind == "gemm_t" else m[0].T


def gptq(w: np.ndarray, h: np.ndarray, damping: float = DAMPING) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ over batched matrices w [g, rows, d] with input second moments h [g, d, d]. Returns the integer codes,
    each row's scale (max|w|/127: the rounded weights are codes x scale) and a [g, rows] mask of rows whose grid
    survived the compensation."""
    w = w.astype(np.float64).copy()
    d = w.shape[2]
    h = h.copy()
    diag = np.einsum("gii->gi", h)
    dead = diag <= 0
    idx = np.arange(d)
    h[:, idx, idx] = np.where(dead, 1.0, diag)  # an input that is always 0: its weights do not matter
    w[np.broadcast_to(dead[:, None, :], w.shape)] = 0.0
    scale = np.abs(w).max(axis=2) / QMAX
    scale = np.where(scale > 0, scale, 1.0)
    h[:, idx, idx] += damping * np.einsum("gii->gi", h).mean(axis=1, keepdims=True)
    # Columns with the largest input energy first (GPTQ's act-order): their error has the most columns left
    # to absorb it.
    order = np.argsort(-np.einsum("gii->gi", h), axis=1, kind="stable")
    gi = np.arange(len(h))[:, None]
    w = w[gi[:, :, None], np.arange(w.shape[1])[None, :, None], order[:, None, :]]
    h = h[gi[:, :, None], order[:, :, None], order[:, None, :]]
    # Upper Cholesky factor of H^-1: row i holds how column i's error spreads onto the columns after it.
    u = np.linalg.cholesky(np.linalg.inv(h)).transpose(0, 2, 1)
    # Each row's largest weight is pinned to +-127 when its column comes, whatever the compensation moved it to,
    # so the row keeps the grid the quantizer will derive (its error is compensated like any other).
    pin = np.abs(w).argmax(axis=2)
    sign = np.sign(np.take_along_axis(w, pin[:, :, None], axis=2)[:, :, 0])
    q = np.empty_like(w)
    for i in range(d):
        q[:, :, i] = np.where(pin == i, sign * QMAX, np.clip(np.round(w[:, :, i] / scale), -QMAX, QMAX))
        err = (w[:, :, i] - q[:, :, i] * scale) / u[:, i, i][:, None]
        if i + 1 < d:
            w[:, :, i + 1 :] -= err[:, :, None] * u[:, None, i, i + 1 :]
    kept = np.abs(q).max(axis=2) == QMAX
    back = np.argsort(order, axis=1)
    q = q[gi[:, :, None], np.arange(q.shape[1])[None, :, None], back[:, None, :]]
    return q, scale, kept


def nearest_codes(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest codes and row scales of matrices m [g, rows, d], as onnxruntime quantizes weights."""
    r = np.abs(m).max(axis=2)
    scale = np.where(r > 0, r / QMAX, 1.0)
    return np.clip(np.round(m / scale[:, :, None]), -QMAX, QMAX), scale


def round_weights(
    model_path: Path,
    out_path: Path,
    op_types: set[str] | None,
    batches: Callable[[], Iterable[dict[str, np.ndarray]]],
    max_batches: int | None = None,
    stages: int = STAGES,
    fixed: dict | None = None,
) -> RoundingResult:
    """GPTQ-round the constant weights of every Conv/Gemm/MatMul of `op_types` (None: all three) in `model_path`
    (see module doc). Layers the caller keeps float are rounded too; it restores them from `originals`.
    `fixed` ({weight: (codes or params.Delta, row scales)}, as a result's `codes`): the rounding of an earlier run,
    applied without calibration data."""
    import onnx
    from onnx import numpy_helper

    from tritonkit.int8.tensors import probe_tensors

    model = onnx.load(str(model_path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    layers = _layers(graph, op_types)
    if not layers:
        raise QuantizationError("weight_rounding='gptq' set but no quantized Conv/Gemm/MatMul with a constant weight")
    nodes = {n.name: n for n in graph.node}
    inputs = {layer.node: nodes[layer.node].input[0] for layer in layers}
    originals, rounded, fallback, codes, nearest = {}, {}, 0, {}, {}
    if fixed is not None:
        missing = sorted({layer.weight for layer in layers} - set(fixed))
        if missing:
            raise QuantizationError(f"GPTQ parameters lack weights {missing[:3]}: recompute them")
    # Layers in graph order, in `stages` chunks: each chunk is measured on the graph whose earlier chunks are
    # already rounded, so it compensates the error it actually receives (one calibration pass per chunk).
    chunk = -(-len(layers) // max(1, min(stages, len(layers))))
    for start in range(0, len(layers), chunk):
        stage = layers[start : start + chunk]
        names = list(dict.fromkeys(inputs[layer.node] for layer in stage))
        rng = np.random.default_rng(start)
        # Without the arena: one run outputs the activations of a whole chunk of layers.
        for outs in (probe_tensors(model, names, batches, max_batches, arena=False) if fixed is None else ()):
            for layer in stage:
                _accumulate(layer, outs[inputs[layer.node]], tuple(inits[layer.weight].dims), rng)
        for layer in stage:
            if layer.weight in rounded:  # a weight shared by two nodes is rounded once, for the first
                continue
            w = numpy_helper.to_array(inits[layer.weight])
            m = _matrices(w.astype(np.float64), layer)
            near, near_scale = nearest_codes(m)
            if fixed is not None:
                q, scale = fixed[layer.weight]
                q = q.resolve(near) if hasattr(q, "resolve") else q
            else:
                q, scale, kept = gptq(m, layer.hessian / max(layer.samples, 1))
                layer.hessian = None
                if not kept.all():  # those rows: round-to-nearest on their own max|w| grid (always hits ±127)
                    q = np.where(kept[:, :, None], q, near)
                    scale = np.where(kept, scale, near_scale)
                    fallback += int((~kept).sum())
            originals[layer.weight] = w
            rounded[layer.weight] = layer.node
            codes[layer.weight], nearest[layer.weight] = (q, scale), near
            inits[layer.weight].CopyFrom(numpy_helper.from_array(
                _weights(q * scale[:, :, None], layer, w.shape).astype(w.dtype), layer.weight))
    onnx.save(model, str(out_path))
    return RoundingResult(Path(out_path), rounded, originals, fallback, codes, nearest)
