"""What one quantization does: a `QuantRecipe` (calibration method, op types, float nodes, graph transforms,
activation form), the activation forms there are, and the nodes a recipe leaves in float."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from tritonkit.errors import QuantizationError


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


ACTIVATION_TYPES = ("int8", "uint8")


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
