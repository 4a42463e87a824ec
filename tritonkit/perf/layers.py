"""Where a served file's time goes, node by node, from the runtime's own profiler.

    feeds = runtime_choice.served_feeds(kind, path, 6, "onnxruntime")
    prof = layers.profile(path, "onnxruntime", feeds, calls=32)
    prof.by_group()    # {"INT8 linear": us per call, "float linear": ..., "attention": ..., ...}

ONNX Runtime's session profiler (`enable_profiling`: one event per kernel run, named after the ONNX node the
kernel came from) or OpenVINO's per-layer counters (`PERF_COUNT`: layer type and the kernel it ran, whose name says
its precision; a fused attention block, a Snippets `Subgraph`, is named after its last node), on the session
options or compile properties the variant is served with. Each node's time falls in
one group, so two files of one model (the served INT8 file, a rewrite of its float nodes, the FP32 file) compare
group by group: what the float nodes an INT8 recipe keeps cost, and what turning them INT8 saves.
"""

from __future__ import annotations

import collections
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from tritonkit import envinfo

INT8_LINEAR, RUNTIME_INT8, FLOAT_LINEAR = "INT8 linear", "run-time INT8 linear", "float linear"
WEIGHT_ONLY = "INT8-weight float linear"
ATTENTION, QUANTIZE, OTHER = "attention", "quantize", "other"
GROUPS = (INT8_LINEAR, RUNTIME_INT8, WEIGHT_ONLY, FLOAT_LINEAR, ATTENTION, QUANTIZE, OTHER)

# onnxruntime kernels (after its graph fusions) by group; a MatMul, Gemm or Conv is float linear when its ONNX
# node has a constant weight, else attention's activation x activation product.
_ORT_INT8 = {"MatMulIntegerToFloat", "QLinearMatMul", "QLinearConv", "QGemm", "QAttention", "DynamicQuantizeMatMul",
             "ConvInteger", "NhwcQLinearConv", "QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool",
             "QLinearSigmoid", "QLinearLeakyRelu", "QLinearConcat", "QLinearAveragePool"}
_ORT_FLOAT = {"MatMul", "FusedMatMul", "Gemm", "FusedGemm", "Conv", "FusedConv", "NhwcFusedConv"}
_ORT_QUANTIZE = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}
# OpenVINO layer types: weighted ones (constant-weight MatMuls become FullyConnected) and attention's.
_OV_WEIGHTED = {"FullyConnected", "Convolution", "GroupConvolution", "Deconvolution"}
# A MatMulNBits node becomes FullyConnectedCompressed: its kernel quantizes activations at run time (`..._I8`) or,
# where the CPU plugin does not (AVX-512 VNNI without AMX), decompresses the INT8 weights into float math.
_OV_COMPRESSED = {"FullyConnectedCompressed"}
_OV_ATTENTION = {"MatMul", "Softmax", "ScaledDotProductAttention"}
_OV_QUANTIZE = {"FakeQuantize"}


@dataclass(frozen=True)
class LayerTime:
    name: str  # the ONNX node the kernel ran for (onnxruntime) or OpenVINO's layer name
    op: str  # onnxruntime's kernel op, or OpenVINO's "layer type/kernel"
    group: str
    us: float  # per call


@dataclass(frozen=True)
class Profile:
    file: str
    variant: str
    calls: int
    layers: tuple[LayerTime, ...]

    @property
    def us_per_call(self) -> float:
        return sum(t.us for t in self.layers)

    def by_group(self) -> dict[str, float]:
        """Microseconds per call in each group, every group present (0 where none ran)."""
        out = dict.fromkeys(GROUPS, 0.0)
        for t in self.layers:
            out[t.group] += t.us
        return out

    def top(self, n: int) -> list[LayerTime]:
        return sorted(self.layers, key=lambda t: -t.us)[:n]


def median(profiles: list[Profile]) -> Profile:
    """One profile of repeats of the same file and feeds: each node's median time per call (0 in a repeat where
    it did not run)."""
    first = profiles[0]
    times: dict[tuple, list[float]] = collections.defaultdict(list)
    for p in profiles:
        for t in p.layers:
            times[t.name, t.op, t.group].append(t.us)
    merged = tuple(LayerTime(name, op, group, statistics.median(us + [0.0] * (len(profiles) - len(us))))
                   for (name, op, group), us in times.items())
    return replace(first, calls=sum(p.calls for p in profiles), layers=merged)


def weighted_nodes(model) -> set[str]:
    """Names of `model`'s MatMul/Gemm/Conv nodes on a constant weight (an initializer, or one through
    DequantizeLinear), as the INT8 share counts them (tritonkit.int8.checks.weight_macs)."""
    from tritonkit.int8.checks import weight_macs

    return set(weight_macs(model, ("MatMul", "Gemm", "Conv")))


def attention_nodes(model) -> set[str]:
    """Names of `model`'s attention nodes (activation x activation MatMuls, Softmax) and of the nodes reading their
    outputs: OpenVINO names a fused attention block (a Snippets `Subgraph`) after its last node."""
    weighted = weighted_nodes(model)
    core = [n for n in model.graph.node
            if n.op_type == "Softmax" or (n.op_type == "MatMul" and n.name not in weighted)]
    outputs = {o for n in core for o in n.output}
    return {n.name for n in core} | {n.name for n in model.graph.node if any(i in outputs for i in n.input)}


def ort_group(op: str, node: str | None, weighted: set[str], runtime: set[str] = frozenset()) -> str:
    """The group of an onnxruntime kernel `op` that ran for ONNX node `node` (None: a node its fusions made);
    `runtime`: the nodes whose activations are quantized at run time, whose helper nodes are named under them
    (tritonkit.int8.granularity) and count as their cost."""
    from tritonkit.int8.checks import RUNTIME_QUANTIZED

    if op in _ORT_INT8:
        return INT8_LINEAR
    if op in RUNTIME_QUANTIZED or node in runtime or (node and any(node.startswith(r + "/") for r in runtime)):
        return RUNTIME_INT8
    if op in _ORT_QUANTIZE:
        return QUANTIZE
    if op in _ORT_FLOAT:
        return FLOAT_LINEAR if node in weighted else ATTENTION
    return ATTENTION if op == "Softmax" else OTHER


def ov_group(layer_type: str, kernel: str, attention: bool = False, run_time_int8: bool = False) -> str:
    """The group of an OpenVINO layer; its kernel name carries the precision it ran in (`..._I8`, `..._bf16`).
    `attention`: the layer is named after an attention node (`attention_nodes`), as a fused attention block is.
    `run_time_int8`: the plugin quantizes compressed-weight layers' activations at run time (a VNNI CPU and a
    non-zero DYNAMIC_QUANTIZATION_GROUP_SIZE), which their kernel's name, after its input precision, omits."""
    int8 = any(p in kernel.lower() for p in ("i8", "u8"))
    if layer_type in _OV_COMPRESSED:
        return RUNTIME_INT8 if int8 or run_time_int8 else WEIGHT_ONLY
    if attention and layer_type not in _OV_WEIGHTED:
        return ATTENTION
    if layer_type in _OV_WEIGHTED:
        return INT8_LINEAR if int8 else FLOAT_LINEAR
    if layer_type in _OV_ATTENTION:
        return ATTENTION
    return QUANTIZE if layer_type in _OV_QUANTIZE else OTHER


def _node_of(kernel_name: str, names: list[str]) -> str | None:
    """The ONNX node an onnxruntime kernel event names: its name less `_kernel_time`, or the longest node name it
    extends (fusions append to the name: `.../MatMul/MatMulScaleFusion/`, `..._merged3`)."""
    base = kernel_name.removesuffix("_kernel_time")
    return next((n for n in names if base == n or base.startswith(n)), None)


def profile(path: Path, variant: str, feeds: list[dict], calls: int = 32, threads: int = 1) -> Profile:
    """`calls` runs of `path` as `variant` serves it (tritonkit.serving.runtimes.VARIANTS) with `threads` threads,
    cycling through `feeds` (tritonkit.repository.runtime_choice.served_feeds: batches as its backend feeds them),
    after one warm-up pass over them; per node, its time per call."""
    from tritonkit.serving.runtimes import VARIANTS, variant_config

    run = _ort if VARIANTS[variant][0] == "onnxruntime" else _openvino
    return Profile(Path(path).name, variant, calls, run(Path(path), variant_config(threads, variant), feeds, calls))


def _ort(path: Path, config: dict, feeds: list[dict], calls: int) -> tuple[LayerTime, ...]:
    import tempfile

    import onnx
    import onnxruntime as ort

    from tritonkit.int8.checks import RUNTIME_QUANTIZED
    from tritonkit.serving.backend_utils import session_options

    model = onnx.load(str(path), load_external_data=False)
    weighted = weighted_nodes(model)
    runtime = {n.name for n in model.graph.node if n.op_type in RUNTIME_QUANTIZED}
    names = sorted((n.name for n in model.graph.node if n.name), key=len, reverse=True)  # longest prefix first
    options = session_options(config)
    with tempfile.TemporaryDirectory(prefix="ort-profile-") as tmp:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "profile")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        inputs = {i.name for i in session.get_inputs()}
        for f in feeds:
            session.run(None, {k: v for k, v in f.items() if k in inputs})
        for i in range(calls):
            session.run(None, {k: v for k, v in feeds[i % len(feeds)].items() if k in inputs})
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    start = runs[len(feeds)]  # the first timed run; the warm-up's kernels ran before it
    spent: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            spent[e["name"], e["args"]["op_name"]] += e["dur"]
    out = []
    for (kernel, op), us in spent.items():
        node = _node_of(kernel, names)
        out.append(LayerTime(node or kernel.removesuffix("_kernel_time"), op, ort_group(op, node, weighted, runtime),
                             us / calls))
    return tuple(out)


def _openvino(path: Path, config: dict, feeds: list[dict], calls: int) -> tuple[LayerTime, ...]:
    import onnx

    from tritonkit.serving.runtimes import openvino_core, openvino_properties

    graph = onnx.load(str(path), load_external_data=False)
    attention = attention_nodes(graph)
    compiled = openvino_core().compile_model(str(path), "CPU", {**openvino_properties(config, graph),
                                                                "PERF_COUNT": True})
    # The plugin's own condition for quantizing a compressed-weight layer's activations (dnnl_fullyconnected).
    run_time_int8 = envinfo.openvino_quantizes_at_run_time() and \
        int(compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) > 0
    request = compiled.create_infer_request()
    inputs = {name for port in compiled.inputs for name in port.get_names()}
    feeds = [{k: v for k, v in f.items() if k in inputs} for f in feeds]
    for f in feeds:  # every shape once, as a warm server has
        request.infer(f)
    spent: collections.Counter = collections.Counter()
    for i in range(calls):
        request.infer(feeds[i % len(feeds)])
        for layer in request.profiling_info:
            us = layer.real_time.total_seconds() * 1e6
            if us > 0:
                spent[layer.node_name, layer.node_type, layer.exec_type] += us
    return tuple(LayerTime(name, f"{layer_type}/{kernel}", ov_group(layer_type, kernel, name in attention,
                                                                    run_time_int8), us / calls)
                 for (name, layer_type, kernel), us in spent.items())
