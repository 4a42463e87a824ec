"""What an INT8 build served on this machine, checked against the artefacts themselves."""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from tritonkit.int8 import recipe, report


def fell_back(spec, form: str = "served") -> bool:
    """This machine's build put the FP32 graph under the INT8 name: the recipe of this CPU's class found nothing,
    or one borrowed from another class missed here (its report says which; callers check the graph itself)."""
    return json.loads(report.report_path(spec, form).read_text())["status"] == recipe.FALLBACK


def holds_fp32_graph(path: Path, fp32: Path) -> bool:
    """`path` is the FP32 graph `fp32`, whatever metadata it carries."""
    return onnx.load(str(path)).graph.SerializeToString() == onnx.load(str(fp32)).graph.SerializeToString()


def assert_fp32_fallback(path: Path, fp32: Path) -> None:
    """`path` is the FP32 graph, marked as such in its ONNX metadata: never a failed INT8 model."""
    assert holds_fp32_graph(path, fp32), f"{path} is not the FP32 graph"
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert meta.get(recipe.PRECISION_KEY, "").startswith("fp32-fallback"), meta
