"""The INT8 stage's records: what a search spec supplies (`SearchSpec`), a searched `Recipe` (committed data), a
search's `Step`s and `SearchResult`. Plain dataclasses with one writer each; reports render them, never recompute
them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from tritonkit.int8.settings import QuantRecipe
from tritonkit.kinds.gates import Target

Feeds = dict[str, np.ndarray]


class SearchSpec(Protocol):
    NAME: str
    WEIGHT_OPS: Sequence[str]  # op types with constant weights that run in INT8 (MatMul, Conv, Gemm)
    TARGETS: Sequence[Target]  # accuracy gates
    SPEED_TARGET: Target  # INT8 vs FP32 at the served batch sizes ("int8_speedup")
    SPEED_BATCHES: Sequence[int]
    SERVE_THREADS: int
    # Optional: the knobs to try first ("form", "placement" and tritonkit.int8.context.KNOBS' names), what won
    # on the kind's shipped models, so a budget that ends early has tried them.
    SEARCH_PRIOR: dict
    # Optional: family names or node-name patterns its shipped models kept float, tried as one candidate first
    # (steps.prior_float).
    SEARCH_PRIOR_FLOAT: tuple[str, ...]

    def calibration_batches(self): ...
    def calibration_batch_count(self) -> int: ...
    def eval_batches(self, split: str) -> list[Feeds]: ...
    def gate_metrics(self, ref: np.ndarray, got: np.ndarray) -> dict[str, float]: ...
    def speed_feeds(self, batch: int) -> Feeds: ...


@dataclass
class Recipe:
    """A searched recipe: the knobs and the units kept in float. Committed; `to_quant` rebuilds the QuantRecipe."""

    form: str  # "int8" (symmetric, zero points 0: TensorRT) or "uint8" (onnxruntime's CPU form)
    placement: str  # "inputs": Q/DQ on weighted ops' inputs only; "all": every op onnxruntime quantizes
    calibrate_method: str = "minmax"
    smooth_alpha: float | None = None
    bias_correction: bool = False
    weight_rounding: str = "nearest"
    float_nodes: list[str] = field(default_factory=list)
    extra_options: dict[str, Any] = field(default_factory=dict)
    # Float nodes whose activations are quantized at run time instead (tritonkit.int8.granularity): {"scheme":
    # name, "nodes": [...]}; empty: every float node runs in float. Absent from a recipe file where empty.
    dynamic: dict[str, Any] = field(default_factory=dict)

    @property
    def dynamic_nodes(self) -> list[str]:
        return list(self.dynamic.get("nodes", []))

    def with_dynamic(self, scheme: str, nodes: Sequence[str]) -> Recipe:
        """This recipe with `nodes` (of its float nodes) quantized at run time by `scheme`."""
        return replace(self, dynamic={"scheme": scheme, "nodes": list(nodes)} if nodes else {})

    def to_quant(self, weight_ops: Sequence[str], name: str = "searched") -> QuantRecipe:
        inputs = self.placement == "inputs"
        return QuantRecipe(
            name=name,
            calibrate_method=self.calibrate_method,
            op_types=list(weight_ops) if inputs else None,
            nodes_to_exclude=list(self.float_nodes),
            quantize_outputs=not inputs,
            isolate_inputs=inputs,
            smooth_alpha=self.smooth_alpha,
            bias_correction=self.bias_correction,
            weight_rounding=self.weight_rounding,
            activation_type=self.form,
            extra_options=dict(self.extra_options),
            rationale="found by tritonkit.int8.search (see the search report)",
        )

    def describe(self) -> str:
        parts = [self.form, self.placement, self.calibrate_method]
        if self.smooth_alpha is not None:
            parts.append(f"smooth{self.smooth_alpha}")
        if self.bias_correction:
            parts.append("biascorr")
        if self.weight_rounding != "nearest":
            parts.append(self.weight_rounding)
        dynamic = self.dynamic_nodes
        return "-".join(parts) + f" +{len(self.float_nodes) - len(dynamic)} float" + \
            (f" +{len(dynamic)} {self.dynamic['scheme']}" if dynamic else "")

    def to_json(self) -> dict:
        """The committed form: a recipe without dynamic nodes reads as it did before they existed (its digest, which
        its quantization parameters name, is unchanged)."""
        data = asdict(self)
        if not self.dynamic:
            del data["dynamic"]
        return data

    @classmethod
    def from_json(cls, data: dict) -> Recipe:
        return cls(**data)


@dataclass(frozen=True)
class ProbeTimings:
    """What the served form's speed probe (timing.speed_probe) timed, which its search then does not time again:
    `quick`, each start's speed-up at the largest served batch size by recipe key; `cleared`, the start timed over
    the speed gate at every served batch size, and `ceiling`, those timings."""

    quick: dict[str, float]
    cleared: Recipe | None = None
    ceiling: dict[str, float] | None = None


@dataclass
class Step:
    stage: str
    change: str
    recipe: str
    metrics: dict[str, float]
    distortion: float
    passed: bool
    speedup: float | None = None
    seconds: float = 0.0
    # When it began (seconds from the search's start), and the estimate and budget left (less the reserve) it was
    # started under (None: started whatever the budget): what the budget decided can be checked against the times.
    started_s: float = 0.0
    estimate_s: float | None = None
    left_s: float | None = None


@dataclass
class SearchResult:
    form: str
    recipe: Recipe | None  # None: nothing passed; the FP32 model is served
    validation: dict[str, float]
    test: dict[str, float]
    speed: dict[str, float]
    steps: list[Step]
    sensitivity: list[dict]
    best_failed: list[dict]
    seconds: float
    passed: bool
    reason: str = ""
    # Steps the budget did not start: stage, what, estimate_s, left_s (after reserve_s), at_s (from the start)
    cuts: list[dict] = field(default_factory=list)
    # Fallbacks ended by the speed gate (fallback._at_wall): recipe, float_nodes, batch, speed; their longer prefixes
    # were not tried (only slower), their shorter ones missed accuracy.
    walls: list[dict] = field(default_factory=list)
    # The fastest candidate that held every accuracy gate on the whole validation split and the test split when the
    # speed gate alone rejected it (recipe, validation, test, speed): a CPU that cannot run the FP32 competitor it
    # lost to races it there.
    accurate: dict | None = None
    # The variant the speed gate timed the recipe's INT8 graph on (timing.int8_variant): a replay times it there.
    int8_variant: str | None = None
    # sha256 of the recipe's graph as the search judged it (tritonkit.int8.judge keys its judgement by it).
    digest: str | None = None

    def to_json(self) -> dict:
        return {**asdict(self), "recipe": self.recipe.to_json() if self.recipe else None}
