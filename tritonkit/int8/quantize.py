"""Calibrated static INT8 quantization into explicit Q/DQ ONNX (onnxruntime.quantization), model-agnostic.

The output is what TensorRT's explicit-precision mode compiles and what onnxruntime's CPU kernels fuse into
integer MatMul/Conv: QuantFormat.QDQ, symmetric INT8 activations and weights, per-channel weights, every zero
point 0 (`check_qdq` enforces this after quantizing). A recipe may opt into onnxruntime's CPU form instead
(`activation_type="uint8"`: asymmetric uint8 activations, still symmetric per-channel int8 weights), which
TensorRT rejects but onnxruntime's x86 kernels run fastest. What differs per model is a `QuantRecipe` (calibration
method, op types, excluded nodes) and the metrics, which the model spec supplies; `QuantReport` writes them as
JSON and prints a table.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from onnxruntime.quantization import CalibrationDataReader

from tritonkit.errors import QuantizationError
from tritonkit.int8.tensors import fake_quant_weight, probe_tensors
from tritonkit.kinds.gates import Target

Feeds = dict[str, np.ndarray]


@dataclass
class QuantRecipe:
    name: str
    # "minmax", "entropy", "percentile" or "distribution" (onnxruntime CalibrationMethod).
    calibrate_method: str = "minmax"
    # Op types to quantize; None = onnxruntime's default set for QDQ.
    op_types: list[str] | None = None
    # Nodes left in float: exact names, and regexes, of the prepared graph (preprocessed, parallel MatMuls merged:
    # a search's float nodes are named there). The graph transforms still see them; only quantization skips them.
    nodes_to_exclude: list[str] = field(default_factory=list)
    exclude_patterns: list[str] = field(default_factory=list)
    per_channel: bool = True
    # Quantize the outputs of quantized ops too. Off: Q/DQ sit only on the inputs of MatMul/Conv/..., the
    # placement TensorRT's explicit-quantization docs recommend; it also keeps float bias/residual adds.
    quantize_outputs: bool = False
    # Give quantized ops a private copy (Identity) of an activation that float ops also read, so e.g. a
    # residual Add keeps the float tensor while the MatMul reading the same tensor gets Q/DQ.
    isolate_inputs: bool = True
    # SmoothQuant (Xiao et al., 2023) strength alpha for MatMuls with constant weights: per input channel k,
    # s_k = max|X_k|^alpha / max|W_k|^(1-alpha); X/s goes through a Mul, W rows are scaled by s. It moves
    # activation outliers (LayerNorm/GELU outputs in transformers) into the per-channel-quantized weights.
    smooth_alpha: float | None = None
    # Merge MatMuls that read the same activation with constant weights (attention Q/K/V) into one MatMul +
    # Split: one Q/DQ pair instead of three, which onnxruntime can fuse (it merges identical DQ nodes, and a
    # DQ shared by several MatMuls is left unfused), and one larger GEMM.
    merge_parallel_matmuls: bool = True
    # How many calibration batches to read (None: all the reader yields).
    calibration_batches: int | None = None
    # Passed through to quantize_static's extra_options (after the symmetric/zero-point rules below).
    extra_options: dict[str, Any] = field(default_factory=dict)
    # quant_pre_process: symbolic shape inference + ORT graph optimisation before quantizing.
    preprocess: bool = True
    # Why this recipe: goes into the report verbatim.
    rationale: str = ""
    # Activation form. "int8": symmetric, zero point 0, float biases: TensorRT's explicit-quantization form
    # (the default). "uint8": asymmetric uint8 activations with int32 biases (U8S8), the form onnxruntime's x86
    # kernels are made for: DQ→Conv→Q fuses into QLinearConv and a ReLU6 Clip folds into the Q's [0, 6] range;
    # TensorRT rejects its non-zero zero points. Weights are symmetric int8 in both forms.
    activation_type: str = "int8"
    # Bias correction (Nagel et al., 2019) for quantized 2-D Convs: subtract from each output channel's bias
    # the mean error its int8 weights add on the calibration data, E[conv(x, W_q - W)]. Rounding errors of
    # BN-folded depthwise filters do not average out; this removes their systematic part at no run-time cost.
    bias_correction: bool = False
    # "nearest" (onnxruntime's own rounding) or "gptq": round the weights before the quantizer so that each layer's
    # output error on the calibration data is minimised, not each weight's (tritonkit.int8.rounding).
    weight_rounding: str = "nearest"

    def to_json(self) -> dict:
        return asdict(self)


# Rules that make the Q/DQ graph TensorRT-compilable; a recipe's extra_options cannot override them.
# Biases stay float: TensorRT has no INT32 DequantizeLinear, it folds float biases into its INT8 kernels.
_FIXED_OPTIONS = {"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False}
# The onnxruntime CPU form (activation_type="uint8"): only the weights' symmetry is fixed; biases default to
# int32 (onnxruntime's QLinearConv needs them quantized).
_FIXED_OPTIONS_UINT8 = {"ActivationSymmetric": False, "WeightSymmetric": True}
ACTIVATION_TYPES = ("int8", "uint8")


class BatchReader(CalibrationDataReader):
    """onnxruntime CalibrationDataReader over a callable of real feed batches, with a tqdm progress bar."""

    def __init__(
        self,
        batches: Callable[[], Iterable[Feeds]],
        total: int | None = None,
        desc: str = "calibrate",
        input_names: list[str] | None = None,
        progress: bool = True,
    ):
        from tqdm import tqdm

        self._make = batches
        self._iter: Iterator[Feeds] | None = None
        self._bar = tqdm(total=total, desc=desc, unit="batch", disable=not progress)
        self._input_names = input_names
        self._count = 0

    def get_next(self) -> Feeds | None:
        if self._iter is None:
            self._iter = iter(self._make())
        if self._bar.total is not None and self._count >= self._bar.total:
            self._bar.close()
            return None
        feeds = next(self._iter, None)
        if feeds is None:
            self._bar.close()
            return None
        self._count += 1
        self._bar.update(1)
        if self._input_names is not None:
            feeds = {k: v for k, v in feeds.items() if k in self._input_names}
        return feeds

    def rewind(self) -> None:
        self._iter, self._count = None, 0


def _method(name: str):
    from onnxruntime.quantization import CalibrationMethod

    methods = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
        "distribution": CalibrationMethod.Distribution,
    }
    if name not in methods:
        raise QuantizationError(f"unknown calibrate_method '{name}' (known: {', '.join(methods)})")
    return methods[name]


def resolve_excluded(model_path, recipe: QuantRecipe) -> list[str]:
    """Exact names plus every node whose name matches one of the recipe's patterns (a path or a loaded model)."""
    import onnx

    graph = model_path.graph if isinstance(model_path, onnx.ModelProto) else \
        onnx.load(str(model_path), load_external_data=False).graph
    names = [n.name for n in graph.node]
    missing = [n for n in recipe.nodes_to_exclude if n not in names]
    if missing:
        raise QuantizationError(f"recipe '{recipe.name}': nodes_to_exclude not in graph: {missing[:5]}")
    excluded = list(recipe.nodes_to_exclude)
    for pattern in recipe.exclude_patterns:
        rx = re.compile(pattern)
        hits = [n for n in names if rx.search(n)]
        if not hits:
            raise QuantizationError(f"recipe '{recipe.name}': exclude pattern {pattern!r} matches no node")
        excluded += [n for n in hits if n not in excluded]
    return excluded


def merge_parallel_matmuls(model_path: Path, out_path: Path) -> Path:
    """X@W1, X@W2, X@W3 (constant 2-D W, same X) → Split(X@[W1|W2|W3]); outputs keep their names."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(model_path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
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
) -> Path:
    """SmoothQuant on MatMuls with a 2-D constant weight: insert Mul(X, 1/s) and scale W by s (see QuantRecipe)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(model_path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    groups: dict[str, list] = {}
    for node in graph.node:
        if node.op_type != "MatMul" or "MatMul" not in op_types:
            continue
        weight = inits.get(node.input[1])
        if weight is not None and len(weight.dims) == 2 and node.input[0] not in inits:
            groups.setdefault(node.input[0], []).append(node)
    if not groups:
        raise QuantizationError("smooth_alpha set but no MatMul with a constant 2-D weight to smooth")

    # Per-channel max |X| over the calibration data (last axis = MatMul input channels).
    names = list(groups)
    absmax = {name: None for name in names}
    for outs in probe_tensors(model, names, batches, max_batches):
        for name, out in outs.items():
            m = np.abs(out.reshape(-1, out.shape[-1])).max(0)
            absmax[name] = m if absmax[name] is None else np.maximum(absmax[name], m)

    new_nodes = []
    for name, nodes in groups.items():
        w_max = np.max([np.abs(numpy_helper.to_array(inits[n.input[1]])).max(1) for n in nodes], axis=0)
        s = np.power(np.maximum(absmax[name], 1e-5), alpha) / np.power(np.maximum(w_max, 1e-5), 1 - alpha)
        s = np.clip(s, 1e-4, 1e4).astype(np.float32)
        for n in nodes:
            w = numpy_helper.to_array(inits[n.input[1]]) * s[:, None]
            inits[n.input[1]].CopyFrom(numpy_helper.from_array(w.astype(np.float32), n.input[1]))
        scale_name, smoothed = f"{name}_smooth_scale", f"{name}_smoothed"
        graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), scale_name))
        new_nodes.append((name, helper.make_node("Mul", [name, scale_name], [smoothed], name=f"{name}_smooth")))
        for n in nodes:
            n.input[0] = smoothed
    producer_index = {o: i for i, n in enumerate(graph.node) for o in n.output}
    nodes = list(graph.node)
    for tensor, mul in sorted(new_nodes, key=lambda t: -producer_index.get(t[0], -1)):
        nodes.insert(producer_index.get(tensor, -1) + 1, mul)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(out_path))
    return out_path


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
) -> Path:
    """Bias correction for quantized 2-D Convs with constant weights and bias (see QuantRecipe.bias_correction)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    convs = [n for n in graph.node if n.op_type == "Conv" and (op_types is None or "Conv" in op_types)
             and n.input[1] in inits and len(inits[n.input[1]].dims) == 4
             and len(n.input) > 2 and n.input[2] in inits]
    if not convs:
        raise QuantizationError("bias_correction set but no quantized Conv with constant weights and bias")
    names = list(dict.fromkeys(n.input[0] for n in convs))
    sums: dict[str, np.ndarray] = {}
    count = 0
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
        inits[node.input[2]].CopyFrom(numpy_helper.from_array((bias - error.reshape(-1)).astype(bias.dtype),
                                                                node.input[2]))
    onnx.save(model, str(out_path))
    return out_path


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
    # Keep topological order: each Identity right after the node producing its input (or first, for inputs).
    producer_index = {o: i for i, n in enumerate(graph.node) for o in n.output}
    nodes = list(graph.node)
    for tensor, identity in sorted(new_nodes, key=lambda t: -producer_index.get(t[0], -1)):
        nodes.insert(producer_index.get(tensor, -1) + 1, identity)
    del graph.node[:]
    graph.node.extend(nodes)
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
        if node.op_type not in weight_ops or weight is None:
            continue
        positions = math.prod(d for d in dims.get(node.output[0], [])[2:] if d) if node.op_type == "Conv" else 1
        out[node.name] = float(weight * positions)
    return out


def int8_share(macs: dict[str, float], float_nodes: Iterable[str]) -> float:
    """The share of a graph's weighted multiply-accumulates that a recipe leaves in INT8."""
    total = sum(macs.values())
    return 1.0 - sum(macs.get(n, 0.0) for n in set(float_nodes)) / total if total else 0.0


def prepare(
    model_path: Path,
    recipe: QuantRecipe,
    batches: Callable[[], Iterable[Feeds]],
    workdir: Path,
    total_batches: int | None = None,
) -> Prepared:
    """Preprocess, merge parallel MatMuls, smooth, bias-correct and isolate inputs as `recipe` says. The transforms
    see every node, the recipe's float ones too: those only stay out of quantization (quantize_prepared), so one
    prepared graph serves every exclusion set and a replay builds what a search measured."""
    import onnx
    from onnx import numpy_helper

    workdir = Path(workdir)
    source = Path(model_path)
    if recipe.preprocess:
        source = preprocess(source, workdir / "preprocessed.onnx")
    if recipe.merge_parallel_matmuls and "MatMul" in (recipe.op_types or ["MatMul"]):
        source = merge_parallel_matmuls(source, workdir / "merged.onnx")
    max_batches = recipe.calibration_batches or total_batches
    if recipe.smooth_alpha is not None:
        source = smooth(source, workdir / "smoothed.onnx", set(recipe.op_types or ["MatMul"]), batches,
                        recipe.smooth_alpha, max_batches)
    rounding = None
    if recipe.weight_rounding == "gptq":
        from tritonkit.int8.rounding import round_weights

        op_types = set(recipe.op_types) if recipe.op_types is not None else None
        # Every quantizable layer is rounded, float ones too (quantize_prepared restores theirs): each chunk's
        # rounding depends on the chunks before it, so a replay must round exactly what the search rounded.
        rounding = round_weights(source, workdir / "rounded.onnx", op_types, batches, max_batches)
        source = rounding.path
    elif recipe.weight_rounding != "nearest":
        raise QuantizationError(f"recipe '{recipe.name}': weight_rounding must be 'nearest' or 'gptq', "
                                f"not {recipe.weight_rounding!r}")
    originals: dict[str, np.ndarray] = {}
    corrected_by: dict[str, str] = {}
    if recipe.bias_correction:
        before = {i.name: i for i in onnx.load(str(source)).graph.initializer}
        op_types = set(recipe.op_types) if recipe.op_types is not None else None
        source = correct_biases(source, workdir / "bias_corrected.onnx", op_types, batches, recipe.per_channel,
                                max_batches)
        for node in onnx.load(str(source), load_external_data=False).graph.node:
            if node.op_type == "Conv" and len(node.input) > 2 and node.input[2] in before:
                originals[node.input[2]] = numpy_helper.to_array(before[node.input[2]])
                corrected_by[node.input[2]] = node.name
    base, copies = source, {}
    if recipe.isolate_inputs and recipe.op_types:
        source, copies = isolate_inputs(source, workdir / "isolated.onnx", set(recipe.op_types))
    return Prepared(source, originals, corrected_by, rounding.originals if rounding else {},
                    rounding.rounded if rounding else {}, base, copies)


def calibrate(
    prepared: Prepared,
    recipe: QuantRecipe,
    batches: Callable[[], Iterable[Feeds]],
    workdir: Path,
    total_batches: int | None = None,
    progress: bool = True,
):
    """Activation ranges (onnxruntime TensorsData) of every quantizable tensor: one calibration serves any
    exclusion set and both activation forms, so a search quantizes many times per calibration. The graph before
    input isolation is calibrated (an isolated copy's range is its source's), so both placements can share it."""
    import onnx
    from onnxruntime.quantization.calibrate import create_calibrator

    graph_path = prepared.base or prepared.path
    input_names = [i.name for i in onnx.load(str(graph_path), load_external_data=False).graph.input]
    reader = BatchReader(batches, total=recipe.calibration_batches or total_batches,
                         desc=f"calibrate {recipe.name}", input_names=input_names, progress=progress)
    keys = {"CalibPercentile": "percentile", "CalibMovingAverage": "moving_average",
            "CalibMaxIntermediateOutputs": "max_intermediate_outputs"}
    options = {key: recipe.extra_options[name] for name, key in keys.items() if name in recipe.extra_options}
    calibrator = create_calibrator(
        Path(graph_path),
        _all_op_types(),
        augmented_model_path=str(Path(workdir) / f"augmented-{recipe.calibrate_method}.onnx"),
        calibrate_method=_method(recipe.calibrate_method),
        providers=["CPUExecutionProvider"],
        extra_options=options,
    )
    if Path(graph_path).stat().st_size > ARENA_MAX_BYTES:
        _without_arena(calibrator)
    if recipe.calibrate_method == "minmax":
        calibrator.collect_data(reader)
    else:
        # Histogram calibrators keep every batch's activations until collect_data returns: feed a few at a time
        # (the histograms merge across calls) so memory stays at a few batches, not the whole calibration set.
        while True:
            chunk = [f for f in (reader.get_next() for _ in range(HISTOGRAM_CHUNK)) if f is not None]
            if chunk:
                calibrator.collect_data(_ListReader(chunk))
            if len(chunk) < HISTOGRAM_CHUNK:
                break
    ranges = calibrator.compute_data()
    del calibrator
    return with_isolated_copies(ranges, prepared)


def with_isolated_copies(ranges, prepared: Prepared):
    """`ranges` plus one entry per input copy of `prepared`'s isolation (a copy's range is its source's)."""
    from onnxruntime.quantization.calibrate import TensorsData

    copies = {copy: ranges[tensor] for copy, tensor in prepared.copies.items() if tensor in ranges}
    if not copies:
        return ranges
    return TensorsData(ranges.calibration_method, {**ranges.data, **copies})


# Graphs up to this size calibrate with onnxruntime's CPU arena (about twice as fast, the same ranges); a larger
# encoder's unoptimised graph would hold gigabytes per batch shape in it.
ARENA_MAX_BYTES = 256 * 2**20


def _without_arena(calibrator) -> None:
    """The calibrator's session without ORT's CPU arena, which keeps its peak for every new batch shape; the
    unoptimised calibration graph of a large encoder peaks at gigabytes per shape."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as the calibrator's own
    options.enable_cpu_mem_arena = False
    calibrator.infer_session = ort.InferenceSession(calibrator.augmented_model_path, sess_options=options,
                                                    providers=["CPUExecutionProvider"])


HISTOGRAM_CHUNK = 4  # calibration batches per histogram-collection pass


class _ListReader(CalibrationDataReader):
    def __init__(self, batches: list):
        self.batches = iter(batches)

    def get_next(self):
        return next(self.batches, None)


def _all_op_types() -> list[str]:
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return sorted(set(QLinearOpsRegistry) | set(QDQRegistry))


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
    # Candidates of one prepared graph share its weights: their scales and zero points are computed once.
    key = (recipe.activation_type, recipe.per_channel, json.dumps(extra, sort_keys=True, default=str))
    quantizer = _cached_quantizer(QDQQuantizer, prepared.initializer_params.setdefault(key, {}), set(restore))(
        model,
        recipe.per_channel,
        False,
        QuantType.QInt8,
        QuantType.QUInt8 if uint8 else QuantType.QInt8,
        copy.deepcopy(ranges),
        [],
        excluded,
        recipe.op_types or _all_op_types(),
        extra,
    )
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
    every depthwise conv "in float"). A second consumer on that path (a Shape node, which reads no data) is a branch
    the pass skips."""
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
        if len(after) == 1 and after[0].op_type == "QuantizeLinear":
            model.graph.node.append(onnx.helper.make_node("Shape", [tensor], [f"{node.name}_keep_float"],
                                                          name=f"{node.name}_keep_float"))
            guarded.append(node.name)
    return guarded


def quantize(
    model_path: Path,
    out_path: Path,
    recipe: QuantRecipe,
    batches: Callable[[], Iterable[Feeds]],
    total_batches: int | None = None,
    progress: bool = True,
) -> Path:
    """Static Q/DQ INT8 of `model_path` calibrated on `batches()`; returns `out_path` (checked by check_qdq)."""
    import onnx

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tritonkit-quant-") as tmp:
        prepared = prepare(model_path, recipe, batches, Path(tmp), total_batches)
        ranges = calibrate(prepared, recipe, batches, Path(tmp), total_batches, progress)
        onnx.save(quantize_prepared(prepared, ranges, recipe), str(out_path))
    return out_path


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


def _check_qdq_uint8(model, inits: dict, counts: dict[str, int], per_channel: bool) -> dict[str, int]:
    from onnx import TensorProto, numpy_helper

    for node in model.graph.node:
        if node.op_type not in counts:
            continue
        counts[node.op_type] += 1
        zp = inits.get(node.input[2]) if len(node.input) >= 3 and node.input[2] else None
        if len(node.input) >= 3 and node.input[2] and zp is None:
            raise QuantizationError(f"{node.name}: zero point {node.input[2]} is not a constant")
        const = inits.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if const is None:  # an activation
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


def artefact_int8_share(model_path: Path, weight_ops: Sequence[str]) -> float:
    """The share of a built graph's weighted multiply-accumulates that run in INT8 (their weight is quantized)."""
    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load(str(model_path), load_external_data=False))
    dq_outputs = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    macs = weight_macs(model, weight_ops)
    return int8_share(macs, [n.name for n in model.graph.node if n.name in macs and n.input[1] not in dq_outputs])


# -- report --------------------------------------------------------------------------------------------------

@dataclass
class QuantReport:
    model: str
    recipe: QuantRecipe
    metrics: dict[str, float]
    targets: list[Target]
    # Other recipes measured the same way (the reason this one was chosen), each {"recipe": ..., metrics...}.
    candidates: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))

    @property
    def passed(self) -> bool:
        return all(t.met(self.metrics) for t in self.targets)

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "created": self.created,
            "passed": self.passed,
            "recipe": self.recipe.to_json(),
            "metrics": self.metrics,
            "targets": [
                {**asdict(t), "met": t.met(self.metrics), "got": self.metrics.get(t.metric)} for t in self.targets
            ],
            "candidates": self.candidates,
            "details": self.details,
        }

    def write(self, path: Path) -> Path:
        import json

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    def print_table(self, console=None) -> None:
        from rich.console import Console
        from rich.table import Table

        # Wide enough for the candidates table when printed to a file or CI log.
        console = console or Console(width=None if sys.stdout.isatty() else 150)
        table = Table(title=f"{self.model} INT8 vs FP32 — recipe '{self.recipe.name}'")
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_column("target", justify="right")
        table.add_column("met", justify="center")
        by_metric = {t.metric: t for t in self.targets}
        for name, value in self.metrics.items():
            t = by_metric.get(name)
            table.add_row(
                name,
                f"{value:.5f}" if isinstance(value, float) else str(value),
                f"{t.op} {t.value}" if t else "",
                ("yes" if t.met(self.metrics) else "NO") if t else "",
            )
        console.print(table)
        if self.candidates:
            keys = [k for k in self.candidates[0] if k != "recipe"]
            cand = Table(title="recipes measured (same calibration and evaluation sets)")
            cand.add_column("recipe")
            for k in keys:
                cand.add_column(k, justify="right")
            for row in self.candidates:
                cand.add_row(row["recipe"], *[_fmt(row.get(k)) for k in keys])
            console.print(cand)
        console.print(f"targets {'met' if self.passed else 'NOT met'}; why this recipe: {self.recipe.rationale}")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return "" if value is None else str(value)
