"""A graph's quantizable units: the nodes with constant weights of the INT8 op types, grouped into families (one
block of a transformer) where a graph has more than a search can rank one by one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def quantizable_nodes(model_path: Path, weight_ops: Sequence[str]) -> list[str]:
    """Nodes of the INT8 op types (MatMul, Conv, Gemm): with constant weights, or two activations (attention)."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    return [n.name for n in graph.node if n.op_type in weight_ops]


def families(model_path: Path, weight_ops: Sequence[str]) -> dict[str, list[str]]:
    """Nodes that share a structural role, offered to the search as one unit each (besides the single nodes):
    depthwise convolutions (group == channels: little INT8 gain, the usual accuracy loss) and MatMuls of two
    activations (attention scores and mixing)."""
    import onnx
    from onnx import helper

    graph = onnx.load(str(model_path), load_external_data=False).graph
    constants = {i.name for i in graph.initializer} | {o for n in graph.node if n.op_type == "Constant"
                                                       for o in n.output}
    out: dict[str, list[str]] = {"family:depthwise-conv": [], "family:activation-matmul": []}
    for n in graph.node:
        if n.op_type not in weight_ops:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "Conv" and attrs.get("group", 1) > 1:
            out["family:depthwise-conv"].append(n.name)
        if n.op_type == "MatMul" and not any(i in constants for i in n.input):
            out["family:activation-matmul"].append(n.name)
    return {k: v for k, v in out.items() if len(v) > 1}


def group_units(nodes: Sequence[str], max_units: int) -> dict[str, list[str]]:
    """One unit per node or, when there are too many for a one-at-a-time scan to stay cheap, one per block (the
    name up to its first indexed path segment) and one per role across blocks (that name with the index
    wildcarded, e.g. every layer's FFN output): sensitivity concentrates in either, and units may overlap."""
    import re

    if len(nodes) <= max_units:
        return {n: [n] for n in nodes}
    blocks: dict[str, list[str]] = {}
    roles: dict[str, list[str]] = {}
    for n in nodes:
        parts = n.strip("/").split("/")
        i = next((i for i, p in enumerate(parts) if re.search(r"[._]\d+$", p)), None)
        if i is None:
            blocks.setdefault(n, []).append(n)
            continue
        blocks.setdefault("/".join(parts[: i + 1]), []).append(n)
        role = "/".join([*parts[:i], re.sub(r"\d+$", "*", parts[i]), *parts[i + 1:]])
        roles.setdefault(f"role:{role}", []).append(n)
    return {**blocks, **{k: v for k, v in roles.items() if len(v) > 1}}
