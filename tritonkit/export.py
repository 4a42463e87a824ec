"""Model-agnostic PyTorch → ONNX export with validation against a reference over a shape grid.

An `ExportSpec` (in the spirit of optimum's OnnxConfig) says everything model-specific: how to load the torch
module, the input/output names with their named dynamic axes, the opset, how to compare outputs (cosine per row
or max-abs difference), the grid of shapes to validate on, where real sample inputs come from and, optionally,
an independent reference (e.g. sentence-transformers) instead of the torch module itself.

`export_onnx(spec, path)` writes the graph; `validate_onnx(spec, path)` runs it under onnxruntime on every grid
point and raises `ExportValidationError` listing the worst cases when any sample misses the tolerance.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tritonkit.errors import ExportValidationError

# One validation grid point, e.g. {"batch": 8, "seq": 64} or {"batch": 4}.
GridPoint = Mapping[str, int]


@dataclass
class ExportSample:
    """Real inputs for one grid point: ONNX feeds, one label per row (shown in errors), free-form context."""

    feeds: dict[str, np.ndarray]
    labels: list[str] = field(default_factory=list)
    context: Any = None


@dataclass
class ExportSpec:
    name: str
    # Returns the torch.nn.Module to export (eval mode is set here); its forward takes inputs in `inputs` order.
    loader: Callable[[], Any]
    # Input name → {axis index: axis name} for dynamic axes; dict order is the forward() argument order.
    inputs: dict[str, dict[int, str]]
    outputs: dict[str, dict[int, str]]
    # Real inputs for a grid point (the first point is also the tracing example).
    sample_inputs: Callable[[GridPoint], ExportSample]
    validation_grid: Sequence[GridPoint]
    opset: int = 17
    # "cosine": per-row cosine similarity must be >= tolerance; "max_abs": per-row max |diff| <= tolerance.
    metric: str = "cosine"
    tolerance: float = 0.9999
    # Which output is compared (default: the first).
    compare_output: str | None = None
    # Independent reference: sample → expected output rows. Default: the exported torch module itself.
    reference: Callable[[ExportSample], np.ndarray] | None = None
    # How many worst cases an error lists.
    report_worst: int = 10

    @property
    def output_to_compare(self) -> str:
        return self.compare_output or next(iter(self.outputs))


@dataclass
class Case:
    point: dict[str, int]
    row: int
    value: float
    label: str = ""

    def __str__(self) -> str:
        where = ",".join(f"{k}={v}" for k, v in self.point.items())
        label = f"  {self.label[:70]!r}" if self.label else ""
        return f"[{where}] row {self.row}: {self.value:.6f}{label}"


@dataclass
class ValidationResult:
    spec: str
    metric: str
    tolerance: float
    samples: int
    grid_points: int
    worst: list[Case]
    failures: int
    summary: dict[str, float]

    def to_json(self) -> dict:
        return {
            "spec": self.spec,
            "metric": self.metric,
            "tolerance": self.tolerance,
            "samples": self.samples,
            "grid_points": self.grid_points,
            "failures": self.failures,
            "summary": self.summary,
            "worst": [c.__dict__ for c in self.worst],
        }


def row_metric(metric: str, got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per-row cosine similarity or max-abs difference of two [N, ...] arrays."""
    got = got.reshape(len(got), -1).astype(np.float64)
    want = want.reshape(len(want), -1).astype(np.float64)
    if metric == "cosine":
        num = (got * want).sum(1)
        den = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
        return num / np.maximum(den, 1e-30)
    if metric == "max_abs":
        return np.abs(got - want).max(1)
    raise ValueError(f"unknown metric '{metric}' (use 'cosine' or 'max_abs')")


def _is_worse(metric: str) -> Callable[[float], float]:
    # Sort key: larger = worse.
    return (lambda v: -v) if metric == "cosine" else (lambda v: v)


def _passes(metric: str, values: np.ndarray, tolerance: float) -> np.ndarray:
    return values >= tolerance if metric == "cosine" else values <= tolerance


def export_onnx(spec: ExportSpec, path: Path, module: Any = None) -> Path:
    """torch.onnx.export (TorchScript exporter, dynamo=False) with the spec's names and dynamic axes."""
    import onnx
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    module = spec.loader() if module is None else module
    module.eval()
    example = spec.sample_inputs(spec.validation_grid[0])
    args = tuple(torch.from_numpy(np.ascontiguousarray(example.feeds[name])) for name in spec.inputs)
    dynamic_axes = {**spec.inputs, **spec.outputs}
    tmp = path.with_suffix(".tmp.onnx")
    with torch.no_grad():
        torch.onnx.export(
            module,
            args,
            str(tmp),
            input_names=list(spec.inputs),
            output_names=list(spec.outputs),
            dynamic_axes={k: v for k, v in dynamic_axes.items() if v},
            opset_version=spec.opset,
            do_constant_folding=True,
            dynamo=False,
        )
    model = onnx.load(str(tmp))
    onnx.checker.check_model(model)
    model.producer_name = f"tritonkit.export:{spec.name}"
    onnx.save(model, str(path))
    tmp.unlink(missing_ok=True)
    return path


def _torch_reference(module: Any, spec: ExportSpec) -> Callable[[ExportSample], np.ndarray]:
    import torch

    def run(sample: ExportSample) -> np.ndarray:
        args = tuple(torch.from_numpy(np.ascontiguousarray(sample.feeds[n])) for n in spec.inputs)
        with torch.no_grad():
            out = module(*args)
        out = out[list(spec.outputs).index(spec.output_to_compare)] if isinstance(out, tuple | list) else out
        return out.detach().cpu().numpy()

    return run


def validate_onnx(
    spec: ExportSpec,
    path: Path,
    module: Any = None,
    progress: bool = True,
    raise_on_failure: bool = True,
) -> ValidationResult:
    """Compare the ONNX graph with the reference on every grid point; typed error listing the worst cases."""
    import onnxruntime as ort
    from tqdm import tqdm

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    if spec.reference is not None:
        reference = spec.reference
    else:
        module = spec.loader() if module is None else module
        module.eval()
        reference = _torch_reference(module, spec)
    out_index = [o.name for o in session.get_outputs()].index(spec.output_to_compare)
    cases: list[Case] = []
    points = list(spec.validation_grid)
    for point in tqdm(points, desc=f"validate {spec.name}", unit="shape", disable=not progress):
        sample = spec.sample_inputs(point)
        got = session.run(None, sample.feeds)[out_index]
        want = reference(sample)
        if got.shape != want.shape:
            raise ExportValidationError(
                spec.name, spec.metric, spec.tolerance,
                [Case(dict(point), -1, float("nan"), f"shape {got.shape} != reference {want.shape}")], 1,
            )
        values = row_metric(spec.metric, got, want)
        for row, value in enumerate(values):
            label = sample.labels[row] if row < len(sample.labels) else ""
            cases.append(Case(dict(point), row, float(value), label))
    values = np.array([c.value for c in cases])
    ok = _passes(spec.metric, values, spec.tolerance)
    worst = sorted(cases, key=lambda c: _is_worse(spec.metric)(c.value), reverse=True)[: spec.report_worst]
    result = ValidationResult(
        spec=spec.name,
        metric=spec.metric,
        tolerance=spec.tolerance,
        samples=len(cases),
        grid_points=len(points),
        worst=worst,
        failures=int((~ok).sum()),
        summary={
            "min": float(values.min()),
            "mean": float(values.mean()),
            "max": float(values.max()),
        },
    )
    if raise_on_failure and result.failures:
        failures = [c for c in worst if not _passes(spec.metric, np.array([c.value]), spec.tolerance)[0]]
        raise ExportValidationError(spec.name, spec.metric, spec.tolerance, failures, len(cases))
    return result


def float16(model):
    """An FP16 copy of an FP32 onnx ModelProto with FP32 inputs and outputs (onnxruntime's converter, which keeps a
    graph ONNX Runtime loads; onnxconverter-common's retyped the text encoder's mask Cast and the classifier's
    Softmax inconsistently): the graph TensorRT 11 builds as FP16 and the FP16 floor is measured on."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    # The converter names its I/O casts after the consuming nodes: unnamed nodes would give duplicate casts.
    for i, node in enumerate(model.graph.node):
        node.name = node.name or f"{node.op_type}_{i}"
    return convert_float_to_float16(model, keep_io_types=True)


def write_json(path: Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
