"""Graph transforms a recipe applies before quantizing, each giving the same function as the FP32 graph:
onnxruntime's preprocessing, merged parallel MatMuls, SmoothQuant, bias correction, isolated inputs of quantized
ops, and GPTQ weight rounding (tritonkit.int8.rounding); `prepare` applies them as the recipe says."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tritonkit.errors import QuantizationError
from tritonkit.int8.checks import weight_macs
from tritonkit.int8.settings import QuantRecipe
from tritonkit.int8.tensors import Feeds, fake_quant_weight, probe_tensors


def _load_with_initializers(model_path: Path):
    """(the ONNX model, its initializers by name): what every weight-editing transform starts from."""
    import onnx

    model = onnx.load(str(model_path))
    return model, {i.name: i for i in model.graph.initializer}


def _insert_after_producers(graph, new_nodes: list[tuple[str, Any]]) -> None:
    """Insert each (tensor, node) right after the node producing `tensor` (first, for a graph input), so the graph
    stays in topological order."""
    producer_index = {o: i for i, n in enumerate(graph.node) for o in n.output}
    nodes = list(graph.node)
    for tensor, node in sorted(new_nodes, key=lambda t: -producer_index.get(t[0], -1)):
        nodes.insert(producer_index.get(tensor, -1) + 1, node)
    del graph.node[:]
    graph.node.extend(nodes)


def merge_parallel_matmuls(model_path: Path, out_path: Path) -> Path:
    """X@W1, X@W2, X@W3 (constant 2-D W, same X) → Split(X@[W1|W2|W3]); outputs keep their names."""
    import onnx
    from onnx import helper, numpy_helper

    model, inits = _load_with_initializers(model_path)
    graph = model.graph
    groups: dict[str, list] = {}
    for node in graph.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if w is not None and len(w.dims) == 2 and node.input[0] not in inits:
            groups.setdefault(node.input[0], []).append(node)
    merged = {}
    for x, nodes in groups.items():
        if len(nodes) < 2:
            continue
        weights = [numpy_helper.to_array(inits[n.input[1]]) for n in nodes]
        name = f"{nodes[0].name}_merged{len(nodes)}"
        w_name, sizes_name, y = f"{name}_weight", f"{name}_split", f"{name}_output"
        graph.initializer.append(numpy_helper.from_array(np.concatenate(weights, axis=1), w_name))
        graph.initializer.append(
            numpy_helper.from_array(np.array([w.shape[1] for w in weights], dtype=np.int64), sizes_name)
        )
        matmul = helper.make_node("MatMul", [x, w_name], [y], name=name)
        split = helper.make_node("Split", [y, sizes_name], [n.output[0] for n in nodes], name=f"{name}_split",
                                 axis=-1)
        merged[nodes[0].name] = (matmul, split)
        for n in nodes[1:]:
            merged[n.name] = None
    if not merged:
        shutil.copyfile(model_path, out_path)
        return out_path
    nodes = []
    for node in graph.node:
        if node.name not in merged:
            nodes.append(node)
        elif merged[node.name] is not None:
            nodes.extend(merged[node.name])
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    onnx.save(model, str(out_path))
    return out_path


def smooth(
    model_path: Path,
    out_path: Path,
    op_types: set[str],
    batches: Callable[[], Iterable[Feeds]],
    alpha: float,
    max_batches: int | None = None,
    scales: dict[str, np.ndarray] | None = None,
    absmax: dict[str, np.ndarray] | None = None,
) -> tuple[Path, dict[str, np.ndarray]]:
    """SmoothQuant on MatMuls with a 2-D constant weight: insert Mul(X, 1/s) and scale W by s (see QuantRecipe).
    Returns the graph and {tensor: s}; given `scales` (an earlier run's), no calibration data is read, nor with
    `absmax` (each smoothed tensor's per-channel max |x| on the calibration data, from a calibration pass)."""
    import onnx
    from onnx import helper, numpy_helper

    model, inits = _load_with_initializers(model_path)
    graph = model.graph
    groups = smoothable(graph, inits, op_types)
    if not groups:
        raise QuantizationError("smooth_alpha set but no MatMul with a constant 2-D weight to smooth")

    names = list(groups)
    if scales is not None and set(scales) != set(names):
        raise QuantizationError("SmoothQuant parameters name other tensors than this graph smooths: recompute them")
    if absmax is not None and not set(names) <= set(absmax):
        raise QuantizationError("the per-channel maxima given for SmoothQuant lack tensors this graph smooths")
    absmax = dict(absmax) if absmax is not None else {name: None for name in names}
    probe = scales is None and any(v is None for v in absmax.values())
    # Per-channel max |X| over the calibration data (last axis = MatMul input channels).
    for outs in (probe_tensors(model, names, batches, max_batches) if probe else ()):
        for name, out in outs.items():
            absmax[name] = channel_absmax([out] if absmax[name] is None else [out, absmax[name][None]])

    new_nodes, used = [], {}
    for name, nodes in groups.items():
        if scales is not None:
            s = scales[name]
        else:
            w_max = np.max([np.abs(numpy_helper.to_array(inits[n.input[1]])).max(1) for n in nodes], axis=0)
            s = np.power(np.maximum(absmax[name], 1e-5), alpha) / np.power(np.maximum(w_max, 1e-5), 1 - alpha)
            s = np.clip(s, 1e-4, 1e4).astype(np.float32)
        used[name] = s
        for n in nodes:
            w = numpy_helper.to_array(inits[n.input[1]]) * s[:, None]
            inits[n.input[1]].CopyFrom(numpy_helper.from_array(w.astype(np.float32), n.input[1]))
        scale_name, smoothed = f"{name}_smooth_scale", smoothed_name(name)
        graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), scale_name))
        new_nodes.append((name, helper.make_node("Mul", [name, scale_name], [smoothed], name=f"{name}_smooth")))
        for n in nodes:
            n.input[0] = smoothed
    _insert_after_producers(graph, new_nodes)
    onnx.save(model, str(out_path))
    return out_path, used


def smoothed_name(tensor: str) -> str:
    """The tensor SmoothQuant's Mul(X, 1/s) writes for X, which the smoothed MatMuls read."""
    return f"{tensor}_smoothed"


def smoothable_tensors(model_path: Path) -> list[str]:
    """The activations SmoothQuant would scale in this graph (`smoothable`)."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    return list(smoothable(graph, {i.name: i for i in graph.initializer}, {"MatMul"}))


def smoothable(graph, inits: dict, op_types: set[str]) -> dict[str, list]:
    """{activation: the MatMuls with a 2-D constant weight that read it}: what SmoothQuant scales."""
    groups: dict[str, list] = {}
    for node in graph.node:
        if node.op_type != "MatMul" or "MatMul" not in op_types:
            continue
        weight = inits.get(node.input[1])
        if weight is not None and len(weight.dims) == 2 and node.input[0] not in inits:
            groups.setdefault(node.input[0], []).append(node)
    return groups


def channel_absmax(values: Iterable[np.ndarray]) -> np.ndarray:
    """Per-channel max |x| (last axis) over arrays of one tensor, as SmoothQuant reads its activations."""
    out = None
    for v in values:
        m = np.abs(v.reshape(-1, v.shape[-1])).max(0)
        out = m if out is None else np.maximum(out, m)
    return out


def _tap_means(x: np.ndarray, node, kernel: tuple[int, int]) -> np.ndarray | None:
    """[C, kh, kw] mean over the output positions of the input each kernel tap reads (zero padding included),
    so that mean(conv(x, dW)) = sum over taps of dW * these means; None for convs it does not model."""
    from onnx import helper

    a = {attr.name: helper.get_attribute_value(attr) for attr in node.attribute}
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or x.ndim != 3:
        return None
    top, left, bottom, right = a.get("pads", [0, 0, 0, 0])
    (sh, sw), (dh, dw) = a.get("strides", [1, 1]), a.get("dilations", [1, 1])
    xp = np.pad(x, ((0, 0), (top, bottom), (left, right)))
    ho, wo = (xp.shape[1] - dh * (kernel[0] - 1) - 1) // sh + 1, (xp.shape[2] - dw * (kernel[1] - 1) - 1) // sw + 1
    out = np.empty((x.shape[0], *kernel), dtype=np.float64)
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            window = xp[:, i * dh : i * dh + sh * (ho - 1) + 1 : sh, j * dw : j * dw + sw * (wo - 1) + 1 : sw]
            out[:, i, j] = window.mean(axis=(1, 2))
    return out


def correct_biases(
    model_path: Path,
    out_path: Path,
    op_types: set[str] | None,
    batches: Callable[[], Iterable[Feeds]],
    per_channel: bool,
    max_batches: int | None = None,
    biases: dict[str, np.ndarray] | None = None,
) -> tuple[Path, dict[str, np.ndarray]]:
    """Bias correction for quantized 2-D Convs with constant weights and bias (see QuantRecipe.bias_correction).
    Returns the graph and {bias: corrected bias}; given `biases` (an earlier run's), no calibration data is read."""
    import onnx
    from onnx import numpy_helper

    model, inits = _load_with_initializers(model_path)
    graph = model.graph
    convs = [n for n in graph.node if n.op_type == "Conv" and (op_types is None or "Conv" in op_types)
             and n.input[1] in inits and len(inits[n.input[1]].dims) == 4
             and len(n.input) > 2 and n.input[2] in inits]
    if not convs:
        raise QuantizationError("bias_correction set but no quantized Conv with constant weights and bias")
    if biases is not None:
        for name, bias in biases.items():
            inits[name].CopyFrom(numpy_helper.from_array(bias, name))
        onnx.save(model, str(out_path))
        return out_path, biases
    names = list(dict.fromkeys(n.input[0] for n in convs))
    sums: dict[str, np.ndarray] = {}
    count = 0
    corrected = {}
    for outs in probe_tensors(model, names, batches, max_batches):
        for name, out in outs.items():
            sums[name] = sums.get(name, 0) + out.astype(np.float64).sum(0)
        count += len(outs[names[0]])
    for node in convs:
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float64)
        means = _tap_means(sums[node.input[0]] / count, node, w.shape[2:])
        if means is None:
            continue
        dw = fake_quant_weight(w, per_channel) - w
        groups = next((a.i for a in node.attribute if a.name == "group"), 1)
        cin, cout = w.shape[1], w.shape[0]
        means = means.reshape(groups, cin, *w.shape[2:])
        error = np.einsum("gockl,gckl->go", dw.reshape(groups, cout // groups, cin, *w.shape[2:]), means)
        bias = numpy_helper.to_array(inits[node.input[2]])
        corrected[node.input[2]] = (bias - error.reshape(-1)).astype(bias.dtype)
        inits[node.input[2]].CopyFrom(numpy_helper.from_array(corrected[node.input[2]], node.input[2]))
    onnx.save(model, str(out_path))
    return out_path, corrected


def isolate_inputs(model_path: Path, out_path: Path, op_types: set[str]) -> tuple[Path, dict[str, str]]:
    """Insert one Identity per activation that feeds both quantized and float consumers; returns the new graph's
    path and {copy: the tensor it copies}.

    onnxruntime puts Q/DQ on the tensor itself, so every reader sees the rounded value; for a transformer that
    quantizes the residual stream (LayerNorm output → next residual Add) and costs most of the accuracy.
    """
    import onnx
    from onnx import helper

    model = onnx.load(str(model_path))
    graph = model.graph
    constants = {i.name for i in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output
    }
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}

    def quantized(node) -> bool:
        return node.op_type in op_types

    new_nodes, renamed = [], {}
    for tensor, readers in consumers.items():
        if tensor in constants or not tensor or not any(quantized(n) for n in readers):
            continue
        if all(quantized(n) for n in readers) and tensor not in outputs:
            continue
        copy = f"{tensor}_qinput"
        renamed[tensor] = copy
        new_nodes.append((tensor, helper.make_node("Identity", [tensor], [copy], name=f"{tensor}_qinput_identity")))
    for node in graph.node:
        if quantized(node):
            for i, name in enumerate(node.input):
                if name in renamed:
                    node.input[i] = renamed[name]
    _insert_after_producers(graph, new_nodes)
    onnx.save(model, str(out_path))
    return out_path, {copy: tensor for tensor, copy in renamed.items()}


def preprocess(model_path: Path, out_path: Path) -> Path:
    from onnxruntime.quantization.shape_inference import quant_pre_process

    model_path, out_path = Path(model_path).resolve(), Path(out_path).resolve()
    # quant_pre_process leaves temp models and 90 MB external-data files in the working directory: use a scratch one.
    with tempfile.TemporaryDirectory(prefix="tritonkit-preprocess-") as tmp, contextlib.chdir(tmp):
        try:
            quant_pre_process(str(model_path), str(out_path), skip_symbolic_shape=False)
        except Exception:
            # Symbolic inference gives up on some traced graphs (e.g. HF attention masks); ONNX inference suffices.
            quant_pre_process(str(model_path), str(out_path), skip_symbolic_shape=True)
    return out_path


@dataclass
class Prepared:
    """A float graph ready to quantize: the recipe's graph transforms applied (same function as the FP32 model),
    plus what exclusions need to undo (bias correction is only right for a conv that is quantized)."""

    path: Path
    original_biases: dict[str, np.ndarray] = field(default_factory=dict)
    corrected_by: dict[str, str] = field(default_factory=dict)  # bias initializer -> conv node name
    original_weights: dict[str, np.ndarray] = field(default_factory=dict)  # before weight_rounding="gptq"
    rounded_by: dict[str, str] = field(default_factory=dict)  # weight initializer -> node name
    base: Path | None = None  # the graph before input isolation (same tensors, fewer copies): what is calibrated
    copies: dict[str, str] = field(default_factory=dict)  # isolated input copy -> the tensor it copies
    # What the transforms computed from calibration data (tritonkit.int8.params stores it for replays).
    smooth_scales: dict[str, np.ndarray] = field(default_factory=dict)
    rounding: Any = None  # rounding.RoundingResult
    corrected_biases: dict[str, np.ndarray] = field(default_factory=dict)
    _inferred: Any = field(default=None, init=False, repr=False, compare=False)
    # Per quantizer configuration: initializer -> scale/zero point, shared by the candidates (quantize_prepared).
    initializer_params: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _macs: dict | None = field(default=None, init=False, repr=False, compare=False)

    def inferred_copy(self):
        """A fresh copy of the shape-inferred graph the quantizer edits; inferred once (seconds on an encoder)."""
        import onnx

        model = onnx.ModelProto()
        model.CopyFrom(self._inferred_graph())
        return model

    def _inferred_graph(self):
        """The shape-inferred graph itself, loaded once; callers that edit it take inferred_copy()."""
        from onnxruntime.quantization.quant_utils import load_model_with_shape_infer

        if self._inferred is None:
            self._inferred = load_model_with_shape_infer(Path(self.path))
        return self._inferred

    def macs(self, weight_ops: Sequence[str]) -> dict[str, float]:
        """Multiply-accumulates per sample of each node with a constant weight (weight_macs), computed once."""
        if self._macs is None:
            self._macs = weight_macs(self._inferred_graph(), weight_ops)
        return self._macs


def prepare(
    model_path: Path,
    recipe: QuantRecipe,
    batches: Callable[[], Iterable[Feeds]],
    workdir: Path,
    total_batches: int | None = None,
    params=None,
    absmax: dict[str, np.ndarray] | None = None,
) -> Prepared:
    """Preprocess, merge parallel MatMuls, smooth, bias-correct and isolate inputs as `recipe` says. The transforms
    see every node, the recipe's float ones too: those only stay out of quantization (quantize_prepared), so one
    prepared graph serves every exclusion set and a replay builds what a search measured. With `params`
    (tritonkit.int8.params.QuantParams) the transforms apply its values and read no calibration data."""
    import onnx
    from onnx import numpy_helper

    workdir = Path(workdir)
    source = Path(model_path)
    if recipe.preprocess:
        source = preprocess(source, workdir / "preprocessed.onnx")
    if recipe.merge_parallel_matmuls and "MatMul" in (recipe.op_types or ["MatMul"]):
        source = merge_parallel_matmuls(source, workdir / "merged.onnx")
    max_batches = recipe.calibration_batches or total_batches
    scales: dict[str, np.ndarray] = {}
    if recipe.smooth_alpha is not None:
        source, scales = smooth(source, workdir / "smoothed.onnx", set(recipe.op_types or ["MatMul"]), batches,
                                recipe.smooth_alpha, max_batches, params.smooth if params is not None else None,
                                absmax)
    rounding = None
    if recipe.weight_rounding == "gptq":
        from tritonkit.int8.rounding import round_weights

        op_types = set(recipe.op_types) if recipe.op_types is not None else None
        # Every quantizable layer is rounded, float ones too (quantize_prepared restores theirs): each chunk's
        # rounding depends on the chunks before it, so a replay must round exactly what the search rounded.
        rounding = round_weights(source, workdir / "rounded.onnx", op_types, batches, max_batches,
                                 fixed=params.rounding if params is not None else None)
        source = rounding.path
    elif recipe.weight_rounding != "nearest":
        raise QuantizationError(f"recipe '{recipe.name}': weight_rounding must be 'nearest' or 'gptq', "
                                f"not {recipe.weight_rounding!r}")
    originals: dict[str, np.ndarray] = {}
    corrected_by: dict[str, str] = {}
    corrected: dict[str, np.ndarray] = {}
    if recipe.bias_correction:
        before = {i.name: i for i in onnx.load(str(source)).graph.initializer}
        op_types = set(recipe.op_types) if recipe.op_types is not None else None
        source, corrected = correct_biases(source, workdir / "bias_corrected.onnx", op_types, batches,
                                           recipe.per_channel, max_batches,
                                           params.biases if params is not None else None)
        for node in onnx.load(str(source), load_external_data=False).graph.node:
            if node.op_type == "Conv" and len(node.input) > 2 and node.input[2] in before:
                originals[node.input[2]] = numpy_helper.to_array(before[node.input[2]])
                corrected_by[node.input[2]] = node.name
    base, copies = source, {}
    if recipe.isolate_inputs and recipe.op_types:
        source, copies = isolate_inputs(source, workdir / "isolated.onnx", set(recipe.op_types))
    return Prepared(source, originals, corrected_by, rounding.originals if rounding else {},
                    rounding.rounded if rounding else {}, base, copies, scales, rounding, corrected)
