"""Accuracy-aware INT8 search: finds a model's quantization recipe with no person in the loop.

    python -m tritonkit.build <model> --search        (re-run after a model, data or dependency change)

For one activation form (the CPU-served one, or TensorRT's symmetric INT8) the search
1. measures the starting knobs (Q/DQ placement, activation form) on the *validation* split, then tries the knobs
   that matter one at a time, keeping what helps: SmoothQuant alpha for MatMul models, bias correction or GPTQ
   weight rounding for conv models, the calibration method where onnxruntime allows it (histogram calibrators
   need equal-shape feeds);
2. ranks every quantizable unit (a node with a constant weight, or a block of them when a graph has many) by its
   sensitivity: how much the validation metrics recover when that unit alone stays float;
3. puts the most sensitive units back in float, cumulatively, until every gate holds on the validation split (with
   a margin): the shortest such prefix of the ranking, found by galloping then bisecting, is the fastest candidate;
4. measures INT8 against FP32 at the served batch sizes and keeps the fastest track that passes; then confirms the
   winner once on the *test* split, which played no part in any choice.
Calibration is done once per prepared graph and method; each candidate only re-quantizes with the same ranges
(seconds), so a search costs minutes. The outcome is a `Recipe` (data), committed beside the model's facts and
replayed by an ordinary build.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tritonkit.errors import SearchError
from tritonkit.int8.checks import int8_share
from tritonkit.int8.evaluate import (
    EXACT_COSINE,
    as_file,
    cosine_min,
    reference,
    reference_ready,
    row_count,
    run_batches,
    run_variant,
    session,
)
from tritonkit.int8.settings import QuantRecipe
from tritonkit.int8.transforms import smoothable_tensors
from tritonkit.kinds.gates import Target, missed
from tritonkit.serving.runtimes import DEFAULT, open_variant

# Steps that may use the time kept back for a found candidate (Search._reserve).
RESERVED = ("confirm", "speed", "test")
# A track's knob variants (Search.variants), which a kind's SEARCH_PRIOR may name besides form and placement.
KNOBS = ("smooth_alpha", "weight_rounding", "bias_correction", "calibrate_method")
PATIENCE = 3  # fallback doublings of the float units without improvement before a knob variant is given up
# A strongly typed TensorRT network runs a Q/DQ graph's float nodes in FP32: at a quarter of INT8's tensor-core
# rate and half FP16's, an INT8 plan beats the FP16 plan only with over 2/3 of its multiply-accumulates in INT8.
MIN_TENSORRT_INT8_SHARE = 2 / 3

Feeds = dict[str, np.ndarray]


# -- what a model kind supplies ------------------------------------------------------------------------------

class SearchSpec(Protocol):
    NAME: str
    WEIGHT_OPS: Sequence[str]  # op types with constant weights that run in INT8 (MatMul, Conv, Gemm)
    TARGETS: Sequence[Target]  # accuracy gates
    SPEED_TARGET: Target  # INT8 vs FP32 at the served batch sizes ("int8_speedup")
    SPEED_BATCHES: Sequence[int]
    SERVE_THREADS: int
    # Optional: the knobs to try first ("form", "placement" and KNOBS' names), what won on the kind's shipped models,
    # so a budget that ends early has tried them.
    SEARCH_PRIOR: dict
    # Optional: family names or node-name patterns its shipped models kept float, tried as one candidate first
    # (Search.prior_float).
    SEARCH_PRIOR_FLOAT: tuple[str, ...]

    def calibration_batches(self): ...
    def calibration_batch_count(self) -> int: ...
    def eval_batches(self, split: str) -> list[Feeds]: ...
    def gate_metrics(self, ref: np.ndarray, got: np.ndarray) -> dict[str, float]: ...
    def speed_feeds(self, batch: int) -> Feeds: ...


# -- scoring -------------------------------------------------------------------------------------------------

def slack(target: Target, metrics: dict[str, float]) -> float:
    """Distance to a gate in units of its scale: >= 0 passes."""
    got = metrics.get(target.metric, float("-inf") if target.op == ">=" else float("inf"))
    gap = got - target.value if target.op == ">=" else target.value - got
    return gap / target_scale(target)


def target_scale(target: Target) -> float:
    """How much of a metric is 'one gate': the distance from the gate to perfect (1.0) for >= gates near 1."""
    if target.scale:
        return target.scale
    if target.op == ">=" and 0 < target.value < 1:
        return 1.0 - target.value
    return abs(target.value) or 1.0


def distortion(targets: Sequence[Target], metrics: dict[str, float]) -> float:
    """Continuous badness used to rank candidates and units: summed gate-normalised shortfall (not clipped, so it
    keeps ranking once every gate passes)."""
    return float(sum(-slack(t, metrics) for t in targets))


def passes(targets: Sequence[Target], metrics: dict[str, float], margin: float = 0.0) -> bool:
    # A gate at perfection (e.g. 100 % agreement) has no room for a margin.
    return all(slack(t, metrics) >= (margin if t.value < 1 else 0.0) for t in targets)


# -- the outcome ---------------------------------------------------------------------------------------------

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
        return "-".join(parts) + f" +{len(self.float_nodes)} float"

    @classmethod
    def from_json(cls, data: dict) -> Recipe:
        return cls(**data)


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
    # Fallbacks ended by the speed gate (Search._at_wall): recipe, float_nodes, batch, speed; their longer prefixes
    # were not tried (only slower), their shorter ones missed accuracy.
    walls: list[dict] = field(default_factory=list)
    # The fastest candidate that held every accuracy gate on the whole validation split and the test split when the
    # speed gate alone rejected it (recipe, validation, test, speed): a CPU that cannot run the FP32 competitor it
    # lost to races it there.
    accurate: dict | None = None
    # The variant the speed gate timed the recipe's INT8 graph on (Search.int8_variant): a replay times it there.
    int8_variant: str | None = None

    def to_json(self) -> dict:
        return {**asdict(self), "recipe": asdict(self.recipe) if self.recipe else None}


# -- evaluation ----------------------------------------------------------------------------------------------

class Evaluator:
    """FP32 reference outputs of one split, computed once; `metrics(model)` scores an INT8 candidate on it."""

    def __init__(self, spec: SearchSpec, fp32: Path, split: str, stride: int = 1,
                 extra_rows: dict[int, list[int]] | None = None):
        self.spec, self.split = spec, split
        batches = spec.eval_batches(split)
        # Every stride-th batch: a cheaper sample for ranking many candidates; gates always use the whole split.
        picked = [(i, None) for i in range(0, len(batches), stride)]
        # Plus, from the other batches, only the rows `extra_rows` names ({batch: rows}): the outliers that decide
        # worst-case gates ride along at the cost of those rows, not of their whole batches.
        picked += [(i, rows) for i, rows in sorted((extra_rows or {}).items()) if i % stride]
        self.batches = [batches[i] if rows is None else {k: v[rows] for k, v in batches[i].items()}
                        for i, rows in picked]
        if stride == 1 and not extra_rows:
            self.ref = reference(spec, fp32, split, self.batches)
        elif reference_ready(spec, fp32, split, batches):  # the whole split's, computed already: its rows
            whole, starts = reference(spec, fp32, split, batches), np.cumsum([0] + [row_count([b]) for b in batches])
            self.ref = np.concatenate([whole[starts[i]:starts[i + 1]][slice(None) if rows is None else rows]
                                       for i, rows in picked])
        else:
            self.ref = run_batches(session(fp32), self.batches)

    def metrics(self, model, exact: bool = False) -> dict[str, float]:
        return self.spec.gate_metrics(self.ref, run_batches(session(model, exact=exact), self.batches))

    def served_problems(self, model, variant: str, targets: Sequence[Target], threads: int, margin: float = 0.0,
                        exact: bool = False) -> tuple[dict[str, float], list[str]]:
        """(metrics, what `model` misses) run as `variant` serves it: `targets` with `margin` (the search's, which
        left its candidates room for the held-out split) against the FP32 outputs, and, where the search judges exact
        int32 arithmetic (a CPU without VNNI), agreement with it (the runtime choice's rule)."""
        got = run_variant(variant, model, self.batches, threads)
        metrics = self.spec.gate_metrics(self.ref, got)
        problems = missed(targets, metrics)
        if not problems and not passes(targets, metrics, margin):
            problems.append(f"within the {margin} margin of a gate: {_summary(targets, metrics)}")
        if exact:
            agreement = cosine_min(got, run_batches(session(model, exact=True), self.batches))
            if agreement < EXACT_COSINE:
                problems.append(f"not exact int32 arithmetic: cosine min {agreement:.6f} (< {EXACT_COSINE})")
        return metrics, problems

    def worst_rows(self, model, share: float = 0.01, exact: bool = False) -> dict[int, list[int]]:
        """{batch index: row indices} of the `share` of rows `model` gets most wrong (relative L2 error), so a
        sample can carry the outliers that decide worst-case gates."""
        got = run_batches(session(model, exact=exact), self.batches)
        err = np.linalg.norm(got - self.ref, axis=1) / np.maximum(np.linalg.norm(self.ref, axis=1), 1e-12)
        bounds = np.cumsum([len(next(iter(b.values()))) for b in self.batches])
        out: dict[int, list[int]] = {}
        for row in sorted(int(r) for r in np.argsort(-err)[: max(1, int(len(err) * share))]):
            batch = int(np.searchsorted(bounds, row, side="right"))
            out.setdefault(batch, []).append(row - (int(bounds[batch - 1]) if batch else 0))
        return out


# The speed gate judges INT8 ÷ FP32 by a 95 % interval, not one median: rounds of `repeats` interleaved pairs are
# added until the interval lies wholly above or below the gate, or MAX_SPEED_ROUNDS rounds were spent.
SPEED_CONFIDENCE = 0.95
MAX_SPEED_ROUNDS = 5
BOOTSTRAP_RESAMPLES = 2000


def ratio_interval(fp32_s: Sequence[float], int8_s: Sequence[float],
                   confidence: float = SPEED_CONFIDENCE) -> tuple[float, float]:
    """A percentile-bootstrap interval of median(FP32 time) ÷ median(INT8 time) over paired samples (each pair
    resampled together: interleaved runs share the machine's moment). Seeded: the same samples give the same
    interval."""
    fp32, int8 = np.asarray(fp32_s, np.float64), np.asarray(int8_s, np.float64)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(fp32), size=(BOOTSTRAP_RESAMPLES, len(fp32)))
    ratios = np.median(fp32[picks], axis=1) / np.median(int8[picks], axis=1)
    tail = (1 - confidence) / 2 * 100
    return float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))


def speedup(spec: SearchSpec, fp32: Path, model, batches: Sequence[int], repeats: int = 7,
            min_sample_s: float = 0.02, variants: tuple[str, str] = (DEFAULT, DEFAULT),
            separate_from: float | None = None) -> dict[str, float]:
    """INT8 ÷ FP32 throughput per batch size, each file on the variant that serves it (`variants`: FP32's, INT8's;
    tritonkit.serving.runtimes.VARIANTS), single-instance threads as served, runs interleaved (median), with its
    interval (`ratio_interval`). With `separate_from` (the speed gate's bound), rounds are added until the interval
    lies wholly on one side of it or MAX_SPEED_ROUNDS are spent.

    Each sample loops a run until it lasts `min_sample_s`: a small model's single run takes tens of microseconds,
    where the timer and the scheduler decide the ratio."""
    with tempfile.TemporaryDirectory(prefix="tritonkit-speed-") as tmp:
        model = as_file(model, Path(tmp))  # a candidate built in memory: the runtimes open files
        sessions = {"fp32": open_variant(variants[0], fp32, spec.SERVE_THREADS),
                    "int8": open_variant(variants[1], model, spec.SERVE_THREADS)}
        return _timed(spec, sessions, batches, repeats, min_sample_s, separate_from)


# On a CPU with native bf16 the INT8 name may serve the FP32 file on OpenVINO bf16 instead (the runtime choice
# times it there when the search falls back): it computes the served form's floor, so it meets the floor-judged
# gates by construction, and on AMX it outran INT8 (docs/int8-search.md). INT8 must beat that, not FP32 in fp32.
BF16_COMPETITOR = "openvino-bf16"


def fp32_competitor(spec: SearchSpec, fp32: Path, served: str, min_gain: float, repeats: int = 3,
                    min_sample_s: float = 0.02, log=None) -> tuple[str, dict[str, float]]:
    """(variant, its timings) of the FP32 file as the INT8 name would serve it here when no INT8 holds: `served`
    (the FP32 model's variant), or BF16_COMPETITOR on a CPU with native bf16 where it is faster by `min_gain`
    (geometric mean over the served batch sizes, the runtime choice's rule). The served speed gate races it."""
    from tritonkit import envinfo

    if not envinfo.has_bf16() or served == BF16_COMPETITOR:
        return served, {}
    sessions = {"fp32": open_variant(served, fp32, spec.SERVE_THREADS),
                "int8": open_variant(BF16_COMPETITOR, fp32, spec.SERVE_THREADS)}  # _timed's keys: a, then b
    timed = _timed(spec, sessions, spec.SPEED_BATCHES, repeats, min_sample_s)
    gain = float(np.exp(np.mean([np.log(timed[f"speedup_batch{b}"]) for b in spec.SPEED_BATCHES])))
    chosen = BF16_COMPETITOR if gain >= min_gain else served
    if log is not None:
        log(f"  the FP32 file on {BF16_COMPETITOR} runs {gain:.2f}x its {served} speed here: the speed gate races "
            f"INT8 against FP32 on {chosen}")
    return chosen, {"bf16_vs_served": round(gain, 3), **{k.replace("speedup", "bf16_gain"): round(v, 3)
                                                           for k, v in timed.items() if k.startswith("speedup_batch")}}


def _timed(spec: SearchSpec, sessions: dict, batches: Sequence[int], repeats: int, min_sample_s: float,
           separate_from: float | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    names = {k: [s.runner.output_names[0]] for k, s in sessions.items()}
    for batch in batches:
        feeds = spec.speed_feeds(batch)
        loops: dict[str, int] = {}
        for k, s in sessions.items():
            s.run(names[k], feeds)
            t0 = time.perf_counter()
            s.run(names[k], feeds)
            loops[k] = max(1, math.ceil(min_sample_s / max(time.perf_counter() - t0, 1e-6)))
        n = max(loops.values())  # the same loop count for both, so each sample costs them alike
        times: dict[str, list[float]] = {k: [] for k in sessions}
        for _round in range(MAX_SPEED_ROUNDS):
            for _ in range(repeats):
                for k, s in sessions.items():
                    t0 = time.perf_counter()
                    for _ in range(n):
                        s.run(names[k], feeds)
                    times[k].append((time.perf_counter() - t0) / n)
            lo, hi = ratio_interval(times["fp32"], times["int8"])
            if separate_from is None or lo > separate_from or hi < separate_from:
                break
        fp32_ms, int8_ms = (float(np.median(times[k])) * 1e3 for k in ("fp32", "int8"))
        out[f"fp32_ms_batch{batch}"] = fp32_ms
        out[f"int8_ms_batch{batch}"] = int8_ms
        out[f"speedup_batch{batch}"] = fp32_ms / int8_ms
        out[f"speedup_lo_batch{batch}"], out[f"speedup_hi_batch{batch}"] = round(lo, 4), round(hi, 4)
        out[f"speed_samples_batch{batch}"] = len(times["int8"])
    out["int8_speedup"] = min(v for k, v in out.items() if k.startswith("speedup_batch"))
    # What the gate judges: the slowest batch size's lower bound (INT8 faster by more than the noise measured).
    out["int8_speedup_lo"] = min(v for k, v in out.items() if k.startswith("speedup_lo_batch"))
    return out


# -- units ---------------------------------------------------------------------------------------------------

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


# -- the search ----------------------------------------------------------------------------------------------

@dataclass
class Track:
    """One starting point (form × placement) carried through knobs, sensitivity and fallback."""

    recipe: Recipe
    metrics: dict[str, float]
    distortion: float
    scored_on: Evaluator | None = None  # the sample its start was measured on (replaced between tracks)


class Workspace:
    """What searches of one model share: prepared graphs, calibrated ranges, the validation references. The
    TensorRT form's graphs and ranges are the served search's int8/inputs ones, so the second search calibrates
    nothing new."""

    def __init__(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="tritonkit-search-")
        self.prepared: dict[tuple, Any] = {}
        self.stats: dict[str, Any] = {}  # calibrated graph digest -> calibration.Statistics
        self.ranges: dict[tuple, Any] = {}
        self.digests: dict[Path, str] = {}
        self.val: Evaluator | None = None

    def graphs_only(self) -> Workspace:
        """A workspace with this one's prepared graphs (a plain start's do not depend on the calibration data) but
        no ranges: a speed probe's, calibrated on a few batches, must never reach a search. Closed by this one."""
        other = Workspace.__new__(Workspace)
        other.tmp, other.prepared, other.digests = self.tmp, self.prepared, self.digests
        other.stats, other.ranges, other.val = {}, {}, None
        return other

    def close(self) -> None:
        self.tmp.cleanup()


# Calibration batches a speed probe's graphs read (Search.speed_probe): a graph's speed does not depend on its ranges.
PROBE_CALIBRATION_BATCHES = 2


class FewCalibrationBatches:
    """A search spec whose calibration reads PROBE_CALIBRATION_BATCHES batches: what a speed probe searches with."""

    def __init__(self, spec: SearchSpec):
        self._spec = spec

    def __getattr__(self, name: str):
        return getattr(self._spec, name)

    def calibration_batch_count(self) -> int:
        return min(PROBE_CALIBRATION_BATCHES, self._spec.calibration_batch_count())


def _passed(step: Step | None) -> bool:
    return step is not None and step.passed


class _Prefixes:
    """One fallback's candidates: prefix k keeps the ranking's first k units float; each is scored on the search's
    validation sample at most once. A prefix the form rejects (every unit float: nothing left to quantize) ends the
    list, as every longer one would be rejected too."""

    def __init__(self, search: Search, name: str, items: list[tuple[str, Recipe]]):
        self.search, self.name, self.items = search, name, items
        self.last = len(items) - 1
        self.scored: dict[int, Step | None] = {}

    def score(self, k: int, whole: bool = False) -> Step | None:
        unit, r = self.items[k]
        name = self.name
        change = name if not k else f"{name} +float {unit}" if k == 1 else f"{name} +{k} units float, to {unit}"
        if whole:
            return self.search.measure("fallback", change, r)
        if k not in self.scored:
            self.scored[k] = self.search.measure("fallback", change, r, evaluator=self.search.sample)
        return self.scored[k]

    def buildable(self, k: int) -> int:
        """The longest prefix up to k the form accepts."""
        while k > 0 and self.score(k) is None and not self.search.spent():
            self.last = k = k - 1
        return k


def _opens_exactly(model) -> None:
    """Raises QuantizationError where onnxruntime's exact int8 path, which every served session off VNNI takes, cannot
    open `model`: on an AVX2 EPYC its s8-to-u8 weight rewrite refused a tiny encoder's uint8/all start (a LayerNorm
    weight's converted initializer added twice), which crashed the build rather than rejecting the candidate."""
    from tritonkit.errors import QuantizationError
    from tritonkit.int8 import evaluate

    try:
        evaluate.session(model, exact=True)
    except Exception as exc:  # onnxruntime raises its own RuntimeException types
        raise QuantizationError(f"onnxruntime's exact int8 path cannot open this graph: {str(exc)[-200:]}") from exc


class Search:
    def __init__(self, spec: SearchSpec, fp32: Path, forms: Sequence[str], *, check_speed: bool, margin: float = 0.1,
                 max_units: int = 64, max_tracks: int = 2, max_variants: int = 3, sample_stride: int = 3,
                 budget_s: float | None = None, progress: bool = True, log: Callable = print,
                 workspace: Workspace | None = None, exact: bool = False, min_int8_share: float | None = None,
                 floor: dict | None = None, speed_variants: tuple[str, str] = (DEFAULT, DEFAULT),
                 committed: tuple[Recipe, object] | None = None):
        from tritonkit.int8 import floor as floors

        self.spec, self.fp32, self.forms = spec, Path(fp32), list(forms)
        # The gates of each split, judged against the FP32 graph's half-precision floor there (tritonkit.int8.floor).
        self.floor = floor
        self.targets = {split: floors.targets(spec, floors.split_floor(floor, split))
                        for split in ("validation", "test")}
        self.form = "/".join(self.forms)
        self.check_speed, self.margin, self.max_units, self.max_tracks = check_speed, margin, max_units, max_tracks
        self.speed_variants = speed_variants  # (FP32's, INT8's) serving variants: the speed gate times on them
        self.exact = exact  # judge in a session asking for exact int32 sums: this CPU lacks VNNI
        # Without a speed gate, compute stands in for speed (MIN_TENSORRT_INT8_SHARE); with one, speed decides.
        self.min_int8_share = (0.0 if check_speed else MIN_TENSORRT_INT8_SHARE) if min_int8_share is None \
            else min_int8_share
        self.max_variants = max_variants  # only the best-scoring knob variants get the fallback
        self.progress, self.log, self.sample_stride = progress, log, sample_stride
        self.budget_s = budget_s  # wall-clock cap: past it the search stops adding work and reports what it has
        self._deadline = float("inf")
        # Gates decide; proxies (continuous, e.g. KL) only help rank candidates whose gates move in steps.
        self.rank_targets = [*self.targets["validation"], *getattr(spec, "PROXY_TARGETS", [])]
        self.steps: list[Step] = []
        self.sensitivity: list[dict] = []
        self.cuts: list[dict] = []
        self.walls: list[dict] = []
        self._tight_batch: int | None = None  # the served batch size where the fastest start's lead is smallest
        self._durations: dict[str, list[float]] = {}  # seconds of each finished step, by kind of step
        self._stopped = False  # a step did not fit in what was left: nothing more is started
        self._fastest: tuple[Recipe, float] | None = None  # the start that timed fastest, every unit INT8
        self._setup_s = 0.0  # time spent preparing and calibrating graphs, kept apart from the steps' own
        self._granted: tuple[float | None, float | None] = (None, None)  # the last step's estimate and left
        self._planned: dict[str, int] = {}  # steps still planned, by kind: the progress bar's ETA
        self._units: dict[Path, dict[str, list[str]]] = {}
        self._split_metrics: dict[str, dict[str, float]] = {}  # whole-split metrics by recipe: not measured twice
        self._t0 = time.perf_counter()  # reset by run()
        self._bar = None
        self._own = workspace is None  # a workspace passed in outlives this search; its owner closes it
        self.ws = workspace or Workspace()
        self._sample: Evaluator | None = None
        # (recipe, its QuantParams): the committed candidate of this model, form and CPU class, judged first and
        # built from its parameters (no calibration pass), as a replay builds it (Search.committed_first).
        self.committed = committed
        self._judged = False  # the committed candidate was measured: no start must run whatever the budget
        self._int8_variants: dict[str, str] = {}  # by recipe: the variant its INT8 graph was timed on
        self._built: tuple[str, object] | None = None  # (recipe key, graph): the last recipe quantized

    # cached pieces: prepare once per transform set, calibrate once per (transforms, method)
    def _prepare(self, r: Recipe):
        from tritonkit.int8.calibration import smooths_twins_graph
        from tritonkit.int8.transforms import prepare

        key = _prepared_key(r)
        if key not in self.ws.prepared:
            absmax, given = None, self._given(r)
            if given is None and smooths_twins_graph(r):  # its activations' maxima came with the unsmoothed pass
                twin = replace(r, smooth_alpha=None)
                self._calibrate(twin)
                absmax = self.ws.stats[self._digest(self._graph(twin))].channel_absmax
            work = Path(self.ws.tmp.name) / f"prep{len(self.ws.prepared)}"
            work.mkdir()
            t0 = time.perf_counter()
            self.ws.prepared[key] = prepare(self.fp32, r.to_quant(self.spec.WEIGHT_OPS),
                                          self.spec.calibration_batches, work, self.spec.calibration_batch_count(),
                                          given, absmax=absmax)
            self._setup_s += time.perf_counter() - t0
        return self.ws.prepared[key]

    def _graph(self, r: Recipe) -> Path:
        prepared = self._prepare(r)
        return prepared.base or prepared.path

    def _calibrate(self, r: Recipe):
        from tritonkit.int8.calibration import collect, smoothed_from_twin, with_isolated_copies

        prepared = self._prepare(r)
        graph = prepared.base or prepared.path
        # Keyed by the calibrated graph's content: placements whose graphs differ only by input isolation share it.
        digest = self._digest(graph)
        key = (digest, r.calibrate_method, json.dumps(r.extra_options))
        if key in self.ws.ranges:
            return with_isolated_copies(self.ws.ranges[key], prepared)
        given = self._given(r)
        if given is not None and (r.calibrate_method, r.extra_options) == \
                (self.committed[0].calibrate_method, self.committed[0].extra_options):
            self.ws.ranges[key] = given.tensors_data()  # what a pass over the same data gives (test_params)
            return with_isolated_copies(self.ws.ranges[key], prepared)
        if smoothed_from_twin(r):
            # SmoothQuant on the graph its twin calibrated (_prepare did): that pass gives these ranges, as a replay
            # computes them (tritonkit.int8.quantize).
            twin = self.ws.stats[self._digest(self._graph(replace(r, smooth_alpha=None)))]
            self.ws.ranges[key] = twin.smoothed(prepared.smooth_scales).ranges(r.calibrate_method, r.extra_options)
            return with_isolated_copies(self.ws.ranges[key], prepared)
        # One pass collects every applicable method's statistics; each method's ranges are computed from them.
        if digest not in self.ws.stats:
            # An unsmoothed graph's pass also takes what SmoothQuant variants read (per-channel max |x|, min, max).
            channels = [] if r.smooth_alpha is not None or "MatMul" not in self.spec.WEIGHT_OPS else \
                list(smoothable_tensors(graph))
            t0 = time.perf_counter()
            setup = self._setup_s
            self.ws.stats[digest] = collect(graph, self.spec.calibration_batches, prepared.path.parent,
                                            [m for m, _ in self._applicable_methods()],
                                            self.spec.calibration_batch_count(), self.progress,
                                            desc=f"calibrate {r.describe()}", channels=channels)
            # Without the twin's preparing it may have triggered (a SmoothQuant graph reads its twin's pass).
            took = time.perf_counter() - t0 - (self._setup_s - setup)
            self._took("calibrate", took)
            self._took("forward", self.ws.stats[digest].run_s)
            self._setup_s += took
        self.ws.ranges[key] = self.ws.stats[digest].ranges(r.calibrate_method, r.extra_options)
        return with_isolated_copies(self.ws.ranges[key], prepared)

    def _given(self, r: Recipe):
        """The committed parameters where `r` prepares the committed recipe's graph (the same transforms), else None."""
        if self.committed is None or _prepared_key(r) != _prepared_key(self.committed[0]):
            return None
        return self.committed[1]

    def quant_params(self, r: Recipe, recipe_digest: str, origin: str = ""):
        """The quantization parameters (tritonkit.int8.params) of `r` as this search built it: a replay of the
        committed recipe then rebuilds the same graph without calibrating."""
        from tritonkit.int8 import params

        self._calibrate(r)
        prepared = self._prepare(r)
        key = (self._digest(prepared.base or prepared.path), r.calibrate_method, json.dumps(r.extra_options))
        return params.capture(prepared, self.ws.ranges[key], r.calibrate_method, params.file_digest(self.fp32),
                              recipe_digest, origin)

    def _digest(self, path: Path) -> str:
        import hashlib

        import onnx

        if path not in self.ws.digests:
            self.ws.digests[path] = hashlib.sha256(onnx.load(str(path)).SerializeToString()).hexdigest()
        return self.ws.digests[path]

    def build(self, r: Recipe):
        """`r`'s INT8 graph. The last one is kept: a winner is scored, checked on its runtime, timed and tested in
        turn, and nothing downstream changes a graph (sessions and files are made from copies)."""
        from tritonkit.int8.quantize import quantize_prepared

        key = _key(r)
        if self._built is None or self._built[0] != key:
            self._built = None  # the old graph's memory goes before the new one is made
            model = quantize_prepared(self._prepare(r), self._calibrate(r), r.to_quant(self.spec.WEIGHT_OPS),
                                      r.float_nodes, check=False)
            if self.exact:
                _opens_exactly(model)
            self._built = (key, model)
        return self._built[1]

    @property
    def val(self) -> Evaluator:
        if self.ws.val is None:
            self.ws.val = Evaluator(self.spec, self.fp32, "validation")
        return self.ws.val

    @property
    def early_speed(self) -> float:
        """Quick single-batch timings drop a candidate only well below the speed gate (shared machines are noisy);
        the gate itself is judged on the served batch sizes at the end."""
        return 0.8 * self.spec.SPEED_TARGET.value

    @property
    def sample(self) -> Evaluator:
        """A third of the validation split, for the one-unit-at-a-time sensitivity scan."""
        if self._sample is None:
            self._sample = Evaluator(self.spec, self.fp32, "validation", stride=self.sample_stride)
        return self._sample

    def measure(self, stage: str, change: str, r: Recipe, speed: bool = False,
                evaluator: Evaluator | None = None, must: bool = False, ahead: float | None = None,
                drop_under: float | None = None) -> Step | None:
        """Quantize + score one candidate on validation (or the sample); None when the form rejects the graph or
        the budget does not start it. `must`: run whatever the budget (a search's first start); `ahead`: an
        optional step, skipped alone unless it leaves that many seconds (Search.fits); `drop_under`: timed first,
        a candidate under that speed-up is not scored (its step has no metrics)."""
        from tritonkit.errors import QuantizationError

        kind = f"{stage}:{'sample' if evaluator is not None else 'split'}"
        self._granted = (None, None)
        if not must and not self.fits(kind, change, self._step_estimate(kind, r), ahead):
            return None
        t0, setup = time.perf_counter(), self._setup_s
        started = (round(t0 - self._t0, 3), *self._granted)

        def unscored(sp: float | None) -> Step:  # rejected by the form (no speed-up), or too slow to score
            step = Step(stage, change, r.describe(), {}, float("inf"), False, sp, round(time.perf_counter() - t0, 3),
                        *started)
            self.steps.append(step)
            return step

        try:
            model = self.build(r)
        except QuantizationError as exc:
            self.log(f"  {stage:<11} {change:<42} rejected: {exc}")
            unscored(None)
            return None
        sp = None
        if speed and self.check_speed:
            sp = speedup(self.spec, self.fp32, model, self.spec.SPEED_BATCHES[-1:], repeats=3,
                         variants=self.speed_variants)["int8_speedup"]
        if sp is not None and drop_under is not None and sp < drop_under:
            step = unscored(sp)
            self._took(f"{stage}:speed", time.perf_counter() - t0 - (self._setup_s - setup))  # not a scored step
            self.log(f"  {stage:<11} {change:<42} not scored: speed x{sp:.2f}")
            return step
        metrics = (evaluator or self.val).metrics(model, exact=self.exact)
        if evaluator is None:
            self._split_metrics[_key(r)] = metrics
        step = Step(stage, change, r.describe(), metrics, distortion(self.rank_targets, metrics),
                    passes(self.targets["validation"], metrics, self.margin), sp, round(time.perf_counter() - t0, 3),
                    *started)
        self.steps.append(step)
        # A step's own cost, without the preparing and calibrating of a new graph it triggered (timed apart).
        self._took(kind, time.perf_counter() - t0 - (self._setup_s - setup))
        self.log(f"  {stage:<11} {change:<42} {_summary(self.targets['validation'], metrics)}"
                 + (f" speed x{sp:.2f}" if sp is not None else "") + (" PASS" if step.passed else ""))
        return step

    def spent(self) -> bool:
        return self._stopped or time.perf_counter() > self._deadline

    # -- the budget: steps are estimated from those of their kind already timed; one that does not fit is not started

    def _took(self, kind: str, seconds: float) -> None:
        self._durations.setdefault(kind, []).append(seconds)
        if self._planned.get(kind):
            self._planned[kind] -= 1
        self._progress(kind)

    def _plan(self, kind: str, count: int) -> None:
        """`count` steps of `kind` are still to come (the ETA counts them)."""
        self._planned[kind] = max(0, count)
        self._progress()

    def eta(self) -> float | None:
        """Seconds until the search ends: the planned steps at their estimates plus the reserve, capped by what is
        left of the budget (None: nothing timed yet to go by)."""
        if not self._durations:
            return None
        planned = sum(n * (self.estimate(k) or 0.0) for k, n in self._planned.items() if n) + self._reserve()
        return max(0.0, min(planned, self._deadline - time.perf_counter()))

    def _progress(self, kind: str = "") -> None:
        if self._bar is None:
            return
        elapsed = time.perf_counter() - self._t0
        self._bar.n = min(self._bar.total, round(elapsed)) if self._bar.total else round(elapsed)
        eta = self.eta()
        self._bar.set_description_str(f"search {self.form}, ETA {'?' if eta is None else _clock(eta)}"
                                      + (f" (last: {kind})" if kind else ""), refresh=True)

    def _plan_track(self, r: Recipe, variants: int, fallbacks: int | None = None) -> None:
        """A track's steps still to come: `variants` knob variants, then the resample, the sensitivity scan of
        `r`'s units and a fallback for each of the best variants (`fallbacks` of them measured)."""
        units = len(self.units(r))
        self._plan("variant:sample", variants)
        self._plan("resample", 1)
        self._plan("unit:sample", units + 1)
        self._plan("fallback:sample", min(self.max_variants, fallbacks or variants + 1) * self._fallback_steps(units))

    def _log_eta(self, phase: str) -> None:
        """One log line per phase (a build's log has no progress bar)."""
        if self._stopped:
            return
        eta = self.eta()
        budget = f" of {self.budget_s:.0f} s" if self.budget_s else ""
        self.log(f"  [{phase}] {time.perf_counter() - self._t0:.0f} s{budget} spent, ETA "
                 f"{'?' if eta is None else _clock(eta)}")

    def estimate(self, kind: str) -> float | None:
        """The median time of the steps of `kind` done so far. Before the first of its kind, from its kin: an
        evaluation costs about what another one on the same split did (the whole split is `sample_stride` samples;
        a final speed run, a start's). None: nothing to go by."""
        done = self._durations.get(kind)
        if done:
            return float(np.median(done))

        def kin(*suffixes: str) -> list[float]:
            return [d for k, ds in self._durations.items() if k.endswith(suffixes) for d in ds]

        sample, whole = kin(":sample"), kin(":split", "test")
        if kind.endswith(":split") or kind == "test":
            return float(np.median(whole)) if whole else self.sample_stride * float(np.median(sample)) \
                if sample else None
        if kind == "resample":  # the whole split's worst rows, then a new sample's FP32 reference
            split = self.estimate("confirm:split")
            return None if split is None else split + float(np.median(sample))
        if kind.endswith(":sample") or kind == "speed":
            if sample:
                return float(np.median(sample))
            # Before any sample, a sample step is a share of a whole split (a committed candidate's).
            return float(np.median(whole)) / self.sample_stride if whole and kind != "speed" else None
        return None

    def _step_estimate(self, kind: str, r: Recipe) -> float | None:
        """A candidate's evaluation plus what its graph still needs: preparing (GPTQ reads the calibration data
        once per chunk of layers) and calibrating. None when nothing of its kind or kin has been timed yet."""
        step = self.estimate(kind)
        if step is None:
            return None
        calibrate = self.estimate("calibrate") or 0.0
        key = _prepared_key(r)
        if key in self.ws.prepared:
            prepared = self.ws.prepared[key]
            digest = self._digest(prepared.base or prepared.path)
            # Calibrated, or its ranges taken from its twin's pass (a SmoothQuant graph's): no pass to pay.
            ranges = (digest, r.calibrate_method, json.dumps(r.extra_options))
            done = digest in self.ws.stats or ranges in self.ws.ranges
            return step + (0.0 if done else calibrate)
        from tritonkit.int8 import calibration
        from tritonkit.int8.rounding import STAGES

        def calibrated(smooth_alpha) -> bool:  # a graph of any placement with these transforms has had its pass
            return any(self._digest(v.base or v.path) in self.ws.stats for k, v in self.ws.prepared.items()
                       if k[1:] == (smooth_alpha, *key[2:]))

        # Placements differ by input isolation only: without data-driven weight changes they calibrate one graph;
        # a SmoothQuant variant's ranges come from its twin's pass, once that ran (Search._calibrate).
        shared = (r.weight_rounding == "nearest" and not r.bias_correction and calibrated(r.smooth_alpha)) or \
            (calibration.smoothed_from_twin(r) and calibrated(None))
        # GPTQ and bias correction read the data in plain forward passes (GPTQ one per chunk of layers).
        forwards = (STAGES if r.weight_rounding == "gptq" else 0) + (1 if r.bias_correction else 0)
        return step + (0.0 if shared else calibrate) + forwards * (self.estimate("forward") or calibrate)

    def _reserve(self) -> float:
        """Kept back from every other step: confirming a found candidate on the whole validation split, timing it
        at the served batch sizes (with a speed gate) and measuring the test split."""
        kinds = ("confirm:split", "speed", "test") if self.check_speed else ("confirm:split", "test")
        return sum(self.estimate(k) or 0.0 for k in kinds)

    def fits(self, kind: str, what: str, estimate: float | None = None, ahead: float | None = None) -> bool:
        """Whether a step can finish in what is left of the budget, less the reserve for a found candidate's checks
        (which may use it); one that cannot is not started and is recorded in `cuts`. `ahead`: the step is one of
        a phase's options (a further start, a knob variant, the resample, a sensitivity unit) and must also leave
        that many seconds to the phases after it; one that does not fit is skipped alone, and the search goes on
        to its next phase. Any other step that does not fit ends the search: nothing after it is started but those
        checks."""
        reserved = kind.split(":")[0] in RESERVED
        alone = ahead is not None or kind.startswith("start:")
        if self.budget_s is None:
            return reserved or not self._stopped
        now = time.perf_counter()
        reserve = 0.0 if reserved else self._reserve() + (ahead or 0.0)
        left = self._deadline - now - reserve
        if (reserved or not self._stopped) and (estimate <= left if estimate is not None else left > 0):
            self._granted = (None if estimate is None else round(estimate, 3), round(left, 3))
            return True
        if reserved or not self._stopped:  # once stopped, later steps are not started, nor listed one by one
            self.cuts.append({"stage": kind, "what": what,
                              "estimate_s": None if estimate is None else round(estimate, 3),
                              "left_s": round(max(left, 0.0), 3), "reserve_s": round(reserve, 3),
                              "at_s": round(now - self._t0, 3)})
            self.log(f"  budget: {kind} '{what}' not started ("
                     + (f"about {estimate:.0f} s, " if estimate else "") + f"{max(left, 0.0):.0f} s left)")
        if not reserved and not alone:
            self._stopped = True
        return False

    def _fallback_steps(self, units: int) -> int:
        """Candidates one fallback over a ranking of `units` tries: galloping then bisecting over its prefixes (half
        the ranking with a speed gate; Search._prefixes), plus the unperturbed one."""
        prefixes = max(1, units // 2) if self.check_speed else units
        return 2 * math.ceil(math.log2(prefixes + 1)) + 1

    def _after_scan(self, ranked: int) -> float:
        """Seconds one fallback over `ranked` units takes: what the sensitivity scan leaves when it ranks them."""
        return self._fallback_steps(ranked) * (self.estimate("fallback:sample") or 0.0)

    def _after_start(self, first: Recipe) -> float:
        """Seconds the first track takes after its start: a knob variant, the resample, the scan of its units and
        one fallback, each candidate at a start's sample time (the resample at its own estimate)."""
        units = len(self.units(first))
        sample = self.estimate("start:sample") or 0.0
        return (2 + units + self._fallback_steps(units)) * sample + (self.estimate("resample") or 0.0)

    def _after_variants(self) -> float:
        """Seconds the rest of a track takes after its knob variants: the resample, the whole scan, one fallback:
        what a further variant must leave (the prior's need not: it is the likeliest to pass)."""
        units = max(0, self._planned.get("unit:sample", 1) - 1)
        return ((self.estimate("resample") or 0.0) + (units + 1) * (self.estimate("unit:sample") or 0.0)
                + self._after_scan(units))

    def int8_share(self, r: Recipe) -> float:
        """The share of the weighted multiply-accumulates `r` leaves in INT8 (on its prepared graph, where merged
        MatMuls carry their new names)."""
        return int8_share(self._prepare(r).macs(self.spec.WEIGHT_OPS), r.float_nodes)

    def _applicable_methods(self) -> list[tuple[str, dict]]:
        """Histogram calibrators concatenate every batch's tensors: they need equal-shape calibration feeds."""
        shapes = {tuple(v.shape for v in b.values()) for b in self.spec.calibration_batches()}
        methods = [("minmax", {})]
        if len(shapes) == 1:  # (their statistics come from the same pass as minmax's: calibration.collect)
            methods += [("percentile", {"CalibPercentile": 99.999}), ("entropy", {})]
        return methods

    def start(self) -> list[Track]:
        # TensorRT's form is placed on weighted ops' inputs only (the placement its explicit-quantization fuses).
        placements = ["inputs", "all"] if self.check_speed else ["inputs"]
        # The kind's prior start first (a stable sort: forms, then placements, as listed, break ties), so a budget
        # that cannot afford every start has measured the one that won before.
        starts = sorted((Recipe(form=f, placement=p) for f in self.forms for p in placements),
                        key=lambda r: self._prior_misses(r, ("form", "placement")))
        self._plan("start:sample", len(starts))
        tracks, slow = [], {}
        for r in starts:
            form, placement = r.form, r.placement
            # Starting points are only ranked: the sample is enough (the whole split costs 3x on big encoders).
            # Starts run until one gives a track, whatever the budget: a search reports at least that (a judged
            # committed candidate is that report; a build does not start a form without time for one,
            # recipe.form_cut). A further start is an option that must leave the first track
            # its time where that track can meet the speed gate (on a large encoder the prior's track tells more
            # than three more starts).
            viable = tracks and not slow[tracks[0].recipe.describe()]
            # Timed before it is scored: a start too slow to keep is dropped without its accuracy.
            step = self.measure("start", f"form={form} placement={placement}", r, speed=True,
                                evaluator=self.sample, must=not tracks and not self._judged,
                                ahead=self._after_start(tracks[0].recipe) if viable else None,
                                drop_under=self.early_speed)
            if step is None:
                continue
            if step.speedup is not None and (self._fastest is None or step.speedup > self._fastest[1]):
                self._fastest = (r, step.speedup)  # dropped or not: the speed ceiling times the fastest
            if self.check_speed and step.speedup is not None and step.speedup < self.early_speed:
                self.log(f"  dropped {form}/{placement}: x{step.speedup:.2f} before any unit is put back in float")
                continue
            tracks.append(Track(r, step.metrics, step.distortion, self.sample))
            slow[r.describe()] = self.check_speed and step.speedup is not None and \
                step.speedup < self.spec.SPEED_TARGET.value
        self._plan("start:sample", 0)
        # Units put back in float only slow a graph down: a start already under the speed gate goes last, whatever
        # its accuracy (Lite0's uint8/inputs start ran 1.07x and took a whole budget; uint8/all ran 1.89x).
        # Then the kind's prior (what won on its shipped models), then the lowest distortion.
        tracks.sort(key=lambda t: (slow[t.recipe.describe()], self._prior_misses(t.recipe, ("form", "placement")),
                                   t.distortion))
        return tracks[: self.max_tracks]

    def committed_first(self) -> tuple[Recipe, dict] | None:
        """The committed candidate (the recipe, or the accurate candidate a speed gate rejected) judged before any
        start, whatever the budget: built from its parameters in seconds, on the whole validation split, then timed at
        the served batch sizes. A re-search (after a dependency change, on another machine of the class) so proves or
        drops what the last one found before it pays for a calibration: MPNet's candidate took a 45-minute search,
        whose 15-minute re-search otherwise has time for one start. (recipe, speed) where every accuracy gate holds,
        else None."""
        if self.committed is None:
            return None
        r = self.committed[0]
        if self._under_share(r, "committed"):
            return None
        self._judged = True
        step = self.measure("committed", "the committed candidate on all validation", r, must=True)
        if not _passed(step):
            self.log(f"  committed {r.describe()} misses here: searching without it")
            return None
        return r, self._time_candidate(r, "committed")

    def prior_nodes(self, r: Recipe) -> list[str]:
        """The nodes of `r`'s prepared graph that the kind's SEARCH_PRIOR_FLOAT names: "family:<name>" units
        (tritonkit.int8.search.families) and regular expressions searched in node names."""
        import re

        patterns = getattr(self.spec, "SEARCH_PRIOR_FLOAT", ())
        if not patterns:
            return []
        units = self.units(r)
        nodes = quantizable_nodes(self._prepare(r).path, self.spec.WEIGHT_OPS)
        named = {n for p in patterns if p.startswith("family:") for n in units.get(p, [])}
        named |= {n for p in patterns if not p.startswith("family:") for n in nodes if re.search(p, n)}
        return [n for n in nodes if n in named]

    def prior_variants(self, scored: Sequence[Recipe]) -> list[Recipe]:
        """The variants the prior float nodes go on, in turn, of a track's `scored` ones (best first): the prior's own
        knobs, where measured, then the best. An all-INT8 score does not rank variants for a recipe whose worst units
        stay float: on all-MiniLM-L6-v2 itself (a new model's build, no bf16) the plain variant scored best at full
        INT8 and missed with the prior float nodes (cosine min 0.9836), where the shipped recipe is smoothing's."""
        prior = [v for v in scored if self._priors_knobs(v)][:1]
        return prior + [v for v in scored[:1] if v not in prior]

    def prior_float(self, variant: Recipe) -> tuple[Recipe, dict] | None:
        """`variant` with the kind's prior float nodes (SEARCH_PRIOR_FLOAT: what its shipped models kept float),
        scored on the sample and, where it holds there, confirmed on the whole split and timed: (recipe, speed), else
        None. One candidate at a scan unit's price, where a large encoder's budget reaches no scan (MPNet's 19 units
        cost 12 minutes on 2 cores)."""
        nodes = self.prior_nodes(variant)
        if not nodes:
            return None
        r = replace(variant, float_nodes=nodes)
        if self._under_share(r, "prior"):
            return None
        step = self.measure("prior", f"the kind's {len(nodes)} prior float nodes", r, evaluator=self.sample, ahead=0.0)
        if not _passed(step):
            return None
        confirmed = self.measure("confirm", "the prior float nodes on all validation", r, speed=True)
        if not _passed(confirmed):
            return None
        return r, self._time_candidate(r)

    def _under_share(self, r: Recipe, what: str) -> bool:
        """Whether `r` leaves less of the compute in INT8 than the form's share allows (said): not worth judging."""
        if not self.min_int8_share or self.int8_share(r) >= self.min_int8_share:
            return False
        self.log(f"  {what} {r.describe()}: under {self.min_int8_share:.0%} of the multiply-accumulates in INT8; not "
                 "judged")
        return True

    def _time_candidate(self, r: Recipe, what: str = "candidate") -> dict[str, float]:
        """A candidate that held every accuracy gate on the whole split, timed as the speed gate judges it (nothing
        to time without one), the time kept as a speed step's."""
        t0 = time.perf_counter()
        speed = {}
        if self.check_speed:
            self._int8_variants[_key(r)] = self.int8_variant(r)
            speed = self.candidate_speed(r)
        self._took("speed", time.perf_counter() - t0)
        self.log(f"  {what} {r.describe()}: speed {_speed(speed)}"
                 + (f" (INT8 on {self._variants(r)[1]})" if self.check_speed else ""))
        return speed

    def int8_variant(self, r: Recipe) -> str:
        """The variant the speed gate times `r`'s INT8 graph on: the INT8 model's (speed_variants[1]) where `r` holds
        the validation gates run so, with the search's margin, else ONNX Runtime, where the search judged it. The
        runtime choice serves INT8 only where its gates hold: MPNet's 36 prior float nodes held under ONNX Runtime,
        passed the gate timed on OpenVINO bf16, then missed there on the test split (float nodes in bf16; cosine
        min 0.9893 < 0.99; without the margin they held on validation) and served on OpenVINO f32, slower than FP32."""
        variant = self.speed_variants[1]
        if variant == DEFAULT:
            return variant
        metrics, problems = self.val.served_problems(self.build(r), variant, self.targets["validation"],
                                                     self.spec.SERVE_THREADS, self.margin, self.exact)
        if not problems:
            self.log(f"  {r.describe()} holds run as {variant}: {_summary(self.targets['validation'], metrics)}")
            return variant
        self.log(f"  {r.describe()} misses run as {variant} ({'; '.join(problems)}): timed on {DEFAULT}")
        return DEFAULT

    def _variants(self, r: Recipe) -> tuple[str, str]:
        """(FP32's, INT8's) variants `r` is timed on: INT8's as int8_variant chose it, else the INT8 model's."""
        return self.speed_variants[0], self._int8_variants.get(_key(r), self.speed_variants[1])

    def speed_ceiling(self, start: Recipe | None = None) -> tuple[str, dict] | None:
        """(why, its timings) when no recipe can meet the speed gate, else None. The fastest start (or `start`) has
        every unit in INT8, and units put back in float only slow a graph down: where its 95 % interval at some served
        batch size lies wholly under the gate, every candidate's would, so nothing is searched (MiniLM and MPNet
        against the FP32 file on OpenVINO bf16 on an AMX CPU). Timed at every served batch size, as the gate is."""
        if not self.check_speed or (self._fastest is None and start is None):
            return None
        r, gate = start or self._fastest[0], self.spec.SPEED_TARGET.value
        t1 = time.perf_counter()
        speed = speedup(self.spec, self.fp32, self.build(r), self.spec.SPEED_BATCHES, variants=self.speed_variants,
                        separate_from=gate)
        self._took("speed", time.perf_counter() - t1)
        under = [b for b in self.spec.SPEED_BATCHES if speed[f"speedup_hi_batch{b}"] < gate]
        self._tight_batch = min(self.spec.SPEED_BATCHES, key=lambda b: speed[f"speedup_hi_batch{b}"])
        self.log(f"[search] speed ceiling: {r.describe()} (every unit INT8) runs {_speed(speed)} against FP32 on "
                 f"{self.speed_variants[0]}")
        if not under:
            return None
        b = under[0]
        cut = sum(c["stage"] == "start:sample" for c in self.cuts)  # a faster form may be among them
        which = f"no recipe of the starts measured ({cut} cut by the budget)" if cut else "no recipe"
        return (f"{which} can meet the speed gate: the fastest start, {r.describe()} with every unit INT8, runs "
                f"{_speed(speed)} against FP32 on {self.speed_variants[0]}; at batch {b} its 95 % interval tops out "
                f"at {speed[f'speedup_hi_batch{b}']:.2f}x, under the {gate}x gate, and units put back in float only "
                "slow a graph down"), speed

    def speed_probe(self) -> tuple[str, dict] | None:
        """speed_ceiling before any floor, calibration or scoring: the starts built (from the few calibration
        batches of a FewCalibrationBatches spec) and timed at the largest served batch size, the kind's prior first
        (_probe_order); the first over the gate there is timed at every batch size, and ends the probe where it
        clears the gate at each; else the fastest is. (why, its timings) where even that cannot meet the speed
        gate: nothing need be measured for accuracy (MPNet-sized encoders against FP32 in bf16 on an AMX CPU)."""
        from tritonkit.errors import QuantizationError

        gate, timed = self.spec.SPEED_TARGET.value, None  # timed: (start, its ceiling) timed at every batch size
        for r in self._probe_order():
            try:
                model = self.build(r)
            except QuantizationError as exc:
                self.log(f"  probe       {r.describe():<42} rejected: {exc}")
                continue
            sp = speedup(self.spec, self.fp32, model, self.spec.SPEED_BATCHES[-1:], repeats=3,
                         variants=self.speed_variants)["int8_speedup"]
            self.log(f"  probe       {r.describe():<42} speed x{sp:.2f} (batch {self.spec.SPEED_BATCHES[-1]})")
            if self._fastest is None or sp > self._fastest[1]:
                self._fastest = (r, sp)
            if sp >= gate and timed is None:
                # One start over the gate at every batch size ends the probe, whatever the others run (MPNet without
                # bf16: the prior's start ran 3.0x, and three more starts took ~110 s to show nothing more).
                timed = (r, self.speed_ceiling(r))
                if timed[1] is None:
                    self.log(f"  probe       {r.describe()} can meet the speed gate: the other starts not probed")
                    return None
        if timed is not None and timed[0] == self._fastest[0]:
            return timed[1]
        return self.speed_ceiling()

    def _probe_order(self) -> list[Recipe]:
        """Every start, the kind's prior's form and placement first: what won on the shipped models is likeliest
        to clear the speed gate and end the probe."""
        starts = [Recipe(form=f, placement=p) for f in self.forms for p in ("inputs", "all")]
        return sorted(starts, key=lambda r: self._prior_misses(r, ("form", "placement")))

    def _prior_misses(self, r: Recipe, knobs: Sequence[str]) -> int:
        """How many of `knobs` that the kind's SEARCH_PRIOR names `r` sets otherwise (0: the prior's own)."""
        prior = getattr(self.spec, "SEARCH_PRIOR", None) or {}
        return sum(getattr(r, k) != prior[k] for k in knobs if k in prior)

    def _priors_knobs(self, r: Recipe) -> bool:
        """Whether `r` sets every knob as the kind's SEARCH_PRIOR does (False for a kind without one)."""
        return bool(getattr(self.spec, "SEARCH_PRIOR", None)) and not self._prior_misses(r, KNOBS)

    def variants(self, track: Track) -> list[tuple[str, Recipe]]:
        """The track's knobs that matter for its graph: SmoothQuant alpha (MatMul models), bias correction or GPTQ
        weight rounding (conv models), the calibration method (where the feeds allow histograms)."""
        ops = set(self.spec.WEIGHT_OPS)
        out = [("as started", track.recipe)]
        if "MatMul" in ops:
            out += [(f"smooth_alpha={a}", replace(track.recipe, smooth_alpha=a)) for a in (0.5, 0.8)]
        if "Conv" in ops:
            out.append(("bias_correction", replace(track.recipe, bias_correction=True)))
            out.append(("weight_rounding=gptq", replace(track.recipe, weight_rounding="gptq")))
        methods = self._applicable_methods()[1:]
        out += [(f"{name} + calibrate={m}", replace(r, calibrate_method=m, extra_options=x))
                for name, r in list(out) for m, x in methods]
        # The start (measured already) first, then the kind's prior knobs, then those nearest to them (fewest knobs
        # off the prior; a stable sort keeps the listed order among equals): a budget that ends early tried them.
        return sorted(out, key=lambda v: (v[0] != "as started", self._prior_misses(v[1], KNOBS)))

    def units(self, r: Recipe) -> dict[str, list[str]]:
        """The units the sensitivity scan ranks on `r`'s prepared graph: families, then nodes or blocks of them.
        Kept per graph: the ETA counts them before the scan (a large encoder's graph takes seconds to load)."""
        path = self._prepare(r).path
        if path not in self._units:
            nodes = quantizable_nodes(path, self.spec.WEIGHT_OPS)
            if not nodes:
                raise SearchError(f"{self.spec.NAME}: no {'/'.join(self.spec.WEIGHT_OPS)} node to quantize")
            self._units[path] = {**families(path, self.spec.WEIGHT_OPS), **group_units(nodes, self.max_units)}
        return self._units[path]

    def rank_units(self, track: Track) -> list[tuple[str, list[str], float]]:
        """[(unit, nodes, gain)]: the units that recover distortion most when left float first, measured one at a
        time on the sample in graph order (early layers first). Units the budget left unmeasured come after those
        that helped, in graph order; those that did not help come last."""
        from tqdm import tqdm

        from tritonkit.errors import QuantizationError

        units = self.units(track.recipe)
        self._plan("unit:sample", len(units) + 1)
        t0 = time.perf_counter()
        measured: list[tuple[str, list[str], float]] = []

        def ranking() -> list[tuple[str, list[str], float]]:
            by_gain = sorted(measured, key=lambda m: -m[2])
            done = {u for u, _, _ in measured}
            rest = [(u, members, 0.0) for u, members in units.items() if u not in done]
            self.sensitivity.append({
                "recipe": track.recipe.describe(), "seconds": round(time.perf_counter() - t0, 1),
                "units": [{"unit": u, "nodes": len(m), "gain": round(g, 4)} for u, m, g in by_gain],
                "unmeasured": [u for u, _, _ in rest]})
            return [m for m in by_gain if m[2] > 0] + rest + [m for m in by_gain if m[2] <= 0]

        if not self.fits("unit:sample", "unperturbed", self.estimate("unit:sample"), self._after_scan(1)):
            return ranking()
        base = distortion(self.rank_targets, self.sample.metrics(self.build(track.recipe), exact=self.exact))
        self._took("unit:sample", time.perf_counter() - t0)
        for unit in tqdm(units, desc=f"sensitivity {track.recipe.describe()}", unit="unit",
                         disable=not self.progress):
            # A scan cut short still orders the units it measured: the fallback gets the time it needs.
            if not self.fits("unit:sample", unit, self.estimate("unit:sample"), self._after_scan(len(measured) + 1)):
                self.log(f"  budget: sensitivity measured {len(measured)} of {len(units)} units (the rest in graph "
                         "order)")
                break
            t1 = time.perf_counter()
            try:
                model = self.build(replace(track.recipe, float_nodes=units[unit]))
            except QuantizationError:
                continue
            gain = base - distortion(self.rank_targets, self.sample.metrics(model, exact=self.exact))
            measured.append((unit, units[unit], gain))
            self._took("unit:sample", time.perf_counter() - t1)
        return ranking()

    def fallback(self, name: str, start: Recipe, ranked, max_float: int | None = None) -> Recipe | None:
        """The shortest prefix of the sensitivity ranking that, kept in float, makes every gate hold (with the
        margin). Found on the validation sample by galloping (1, 2, 4, ... units float) and then bisecting, so a
        prefix of n units costs about 2 log2(n) candidates, not n; then confirmed on the whole validation split,
        adding units one at a time while it does not hold there yet.
        `max_float`: a candidate already passed with that many float nodes; one with as many cannot be faster, so
        only the longest prefix under it is tried first and, when that misses, nothing shorter is."""
        prefixes = _Prefixes(self, name, self._prefixes(name, start, ranked, max_float))
        bounds = self._bracket(prefixes, max_float)
        if bounds is None:
            return None
        lo, hi = bounds  # the longest prefix that missed on the sample, the shortest that passed
        # A passing prefix is never lost to the budget: where bisecting no longer fits, the shortest one found so
        # far goes to confirmation, which the reserve was kept for.
        while hi - lo > 1 and not self._out_of_budget():
            mid = (lo + hi) // 2
            step = prefixes.score(mid)
            if step is None and self.spent():  # not started: the budget, not the graph, said no
                break
            lo, hi = (lo, mid) if _passed(step) else (mid, hi)
        return self._confirm(name, prefixes, hi)

    def _prefixes(self, name: str, start: Recipe, ranked, max_float: int | None) -> list[tuple[str, Recipe]]:
        """[(unit, recipe)]: `start`, then each next unit of the ranking added to the float nodes."""
        # Past half the units in float a CPU form cannot meet its speed gate; a form without one (TensorRT's,
        # whose speed is the GPU's) may go down the whole ranking.
        budget = ranked[: max(1, len(ranked) // 2)] if self.check_speed else ranked
        prefixes: list[tuple[str, Recipe]] = [("", start)]
        for unit, members, _gain in budget:
            r = prefixes[-1][1]
            if set(members) <= set(r.float_nodes):
                continue  # already float through a family
            r = replace(r, float_nodes=[*r.float_nodes, *(m for m in members if m not in r.float_nodes)])
            if max_float is not None and len(r.float_nodes) >= max_float:
                break
            if self.min_int8_share and self.int8_share(r) < self.min_int8_share:
                self.log(f"  {name}: prefixes stop before {unit}: under {self.min_int8_share:.0%} of the "
                         "multiply-accumulates would stay INT8")
                break
            prefixes.append((unit, r))
        return prefixes

    def _out_of_budget(self) -> bool:
        if self.spent():
            if not self._stopped:  # past the deadline, nothing cut yet: the cuts say where it stopped
                self.fits("fallback", "the rest of this fallback")
            self.log(f"  stopped: the search budget ({self.budget_s / 60:.0f} min) is spent")
        return self.spent()

    def _bracket(self, prefixes: _Prefixes, max_float: int | None) -> tuple[int, int] | None:
        """(lo, hi): prefix lo missed on the sample (-1: none did), prefix hi passed; None: none passes."""
        if _passed(prefixes.score(0)):
            return -1, 0
        if max_float is None:
            return self._gallop(prefixes)
        if self._out_of_budget():
            return None
        if prefixes.buildable(prefixes.last) == 0 or not _passed(prefixes.score(prefixes.last)):
            self.log(f"  stopped: no candidate under {max_float} float nodes passes")
            return None
        return 0, prefixes.last

    def _gallop(self, prefixes: _Prefixes) -> tuple[int, int] | None:
        """Prefixes 1, 2, 4, ... until one passes, giving up after PATIENCE doublings that do not lower the
        distortion."""
        first = prefixes.scored[0]
        lo, k, best, stale = 0, 1, first.distortion if first else float("inf"), 0
        while lo < prefixes.last:
            k = prefixes.buildable(min(k, prefixes.last))
            if k > lo and _passed(prefixes.scored.get(k)):
                return lo, k  # whatever the budget: a passing prefix goes on to confirmation (Search.fallback)
            if self._out_of_budget() or k <= lo:
                return None
            step = prefixes.scored[k]
            if self._at_wall(prefixes.items[k][1]):
                return None
            lo = k
            best, stale = (step.distortion, 0) if step.distortion < best - 1e-9 else (best, stale + 1)
            if stale >= PATIENCE:
                self.log(f"  stopped: no improvement in {PATIENCE} doublings of the float units")
                return None
            k *= 2
        return None

    @property
    def _wall_batch(self) -> int:
        """The batch size a wall is timed at: where the fastest start led least (the largest before the ceiling)."""
        return self._tight_batch or self.spec.SPEED_BATCHES[-1]

    def prefix_speed(self, r: Recipe) -> dict[str, float]:
        """`r` timed against FP32 at the wall's batch size, until its interval lies on one side of the gate."""
        return speedup(self.spec, self.fp32, self.build(r), [self._wall_batch], repeats=3,
                       variants=self.speed_variants, separate_from=self.spec.SPEED_TARGET.value)

    def _at_wall(self, r: Recipe) -> bool:
        """Whether `r`, a prefix that missed accuracy, already runs under the speed gate: its 95 % interval wholly
        below it at a served batch size. Longer prefixes put more units in float and only slow the graph down, and
        shorter ones are less accurate (the gallop's premise): this ranking holds no recipe, and its fallback ends.
        Without a speed gate, or when the timing does not fit the budget, the gallop goes on."""
        if not self.check_speed or not self.fits("wall", r.describe(), self.estimate("wall") or
                                                 self.estimate("speed"), ahead=0.0):
            return False
        t0 = time.perf_counter()
        speed = self.prefix_speed(r)
        self._took("wall", time.perf_counter() - t0)
        batch = self._wall_batch
        if speed[f"speedup_hi_batch{batch}"] >= self.spec.SPEED_TARGET.value:
            return False
        self.walls.append({"recipe": r.describe(), "float_nodes": len(r.float_nodes), "batch": batch,
                           "speed": {k: round(v, 4) for k, v in speed.items()}})
        self.log(f"  stopped: {r.describe()} missed accuracy and already runs {_speed(speed)}, under the "
                 f"{self.spec.SPEED_TARGET.value}x speed gate: longer prefixes are only slower")
        return True

    def _confirm(self, name: str, prefixes: _Prefixes, hi: int) -> Recipe | None:
        """Prefix `hi` passed on the sample: the whole validation split decides, adding units while it misses."""
        recipe = prefixes.items[hi][1]
        step = self.measure("confirm", f"{name} on all validation", recipe, speed=True)
        if _passed(step):
            return recipe
        if self.check_speed and step is not None and step.speedup is not None and step.speedup < self.early_speed:
            self.log("  stopped: the speed gate no longer holds")
            return None
        for k in range(hi + 1, prefixes.last + 1):
            if self._out_of_budget():
                return None
            if _passed(prefixes.score(k, whole=True)):
                return prefixes.items[k][1]
        return None

    def run(self) -> SearchResult:
        from tqdm import tqdm

        t0 = self._t0 = time.perf_counter()
        if self.budget_s:
            self._deadline = t0 + self.budget_s
        # Seconds spent against the budget, and the ETA from the steps still planned (Search.eta), per step.
        self._bar = tqdm(total=round(self.budget_s) if self.budget_s else None, desc=f"search {self.form}",
                         unit="s", disable=not self.progress,
                         bar_format="{n}/{total} s |{bar:20}| {desc}" if self.budget_s else "{n} s | {desc}")
        self.log(f"[search] {self.spec.NAME} ({self.form}): validation split, margin {self.margin} of each gate"
                 + (f", budget {self.budget_s / 60:.0f} min" if self.budget_s else ""))
        failed: list[dict] = []
        ok: list[tuple[Recipe, dict]] = []
        slow: list[tuple[Recipe, dict]] = []  # met every accuracy gate, missed the speed gate
        first = self.committed_first()
        if first is not None:
            self._sort_by_speed(ok, slow, failed, [first])
        tracks = self.start()
        ceiling = None if ok else self.speed_ceiling()
        if ceiling is not None:
            accurate = self._held_out(*max(slow, key=lambda rs: rs[1].get("int8_speedup", 0.0))) if slow else None
            return self._result(None, {}, {}, ceiling[1], failed, t0, ceiling[0], accurate=accurate)
        for i, track in enumerate(tracks):
            # The first track always reports; another starts only with time left beyond the reserve.
            if i and not self.fits("track", track.recipe.describe()):
                self.log(f"  budget spent: track {track.recipe.describe()} not searched")
                break
            # Every variant at full INT8 on the sample; the best one orders the units for all of them.
            scored = []
            variants = self.variants(track)
            self._plan_track(track.recipe, len(variants) - 1)  # "as started" was measured at the start
            self._log_eta(f"variants of {track.recipe.describe()}")
            for name, variant in variants:
                if self._stopped:
                    break
                if variant == track.recipe and track.scored_on is self.sample:  # measured at the start
                    scored.append((track.distortion, name, variant))
                    continue
                # Variants are options: one that does not fit is skipped alone, and any but the prior's must leave
                # the rest of the track its time.
                step = self.measure("variant", name, variant, evaluator=self.sample,
                                    ahead=0.0 if self._priors_knobs(variant) else self._after_variants())
                if step is not None:
                    scored.append((step.distortion, name, variant))
            scored.sort(key=lambda v: v[0])
            if scored:
                self._plan_track(scored[0][2], 0, len(scored))
            # What won on the kind's shipped models, before a scan the budget may not reach; it caps the fallbacks.
            found = None
            for variant in self.prior_variants([v for _, _, v in scored]):
                found = self.prior_float(variant)
                if found is not None:
                    break
            # The sample also carries the whole split's worst rows, which decide worst-case gates.
            # It must leave a scan of one unit and its fallback.
            if scored and self.fits("resample", "the whole split's worst rows", self.estimate("resample"),
                                    2 * (self.estimate("unit:sample") or 0.0) + self._after_scan(1)):
                t1 = time.perf_counter()
                hard = self.val.worst_rows(self.build(scored[0][2]), exact=self.exact)
                self._sample = Evaluator(self.spec, self.fp32, "validation", self.sample_stride, extra_rows=hard)
                self._took("resample", time.perf_counter() - t1)
                self.log(f"  sample: every {self.sample_stride}th batch + the {sum(map(len, hard.values()))} worst "
                         "rows of the split")
                self._log_eta("sensitivity")
            ranked = self.rank_units(Track(scored[0][2], {}, scored[0][0])) if scored else []
            self._log_eta("fallback")
            finals = [found] if found is not None else []
            wall = None  # float nodes at this track's first wall: its variants share its speed, so stay under it
            for _, name, variant in scored[: self.max_variants]:
                if len(finals) >= 2:  # two passing candidates to compare speeds is enough
                    break
                first, walls = len(self.steps), len(self.walls)
                caps = [len(r.float_nodes) for r, _ in (*finals, *ok)] + ([wall] if wall is not None else [])
                recipe = self.fallback(name, variant, ranked, min(caps) if caps else None)
                if wall is None and len(self.walls) > walls:
                    wall = self.walls[-1]["float_nodes"]
                if recipe is None:
                    # This fallback's own steps: variant names prefix one another ("x" and "x + calibrate=...")
                    # and recur across tracks ("as started"), so matching by name repeated entries.
                    best = min((s for s in self.steps[first:] if s.stage in ("fallback", "confirm")),
                               key=lambda s: s.distortion, default=None)
                    if best is not None:
                        failed.append({"recipe": best.recipe, "metrics": best.metrics, "speedup": best.speedup})
                    continue
                # The first passing candidate is always timed (the reserve was kept for it): it is never lost.
                if self.check_speed and finals and not self.fits("speed", recipe.describe(), self.estimate("speed")):
                    break
                finals.append((recipe, self._time_candidate(recipe)))
            self._sort_by_speed(ok, slow, failed, finals)
            if ok:  # tracks run best first: the first that passes ends the search
                break
        if not ok:
            why, accurate = "no candidate met the accuracy and speed gates", None
            if slow:  # the accuracy gates held, at a price in float nodes the speed gate does not allow
                r, sp = max(slow, key=lambda rs: rs[1].get("int8_speedup", 0.0))
                accurate = self._held_out(r, sp)
                why += (f"; the fastest that met the accuracy gates ({r.describe()}) ran {_speed(sp)} on "
                        f"{self._variants(r)[1]} against FP32 on {self.speed_variants[0]}, not above the "
                        f"{self.spec.SPEED_TARGET.value}x speed gate beyond the noise measured (95 % interval of the "
                        f"slowest batch size {sp.get('int8_speedup_lo', 0):.2f}x and up)")
            if self.walls:
                w = self.walls[0]
                why += (f"; the speed gate ended {len(self.walls)} fallback(s) first: {w['recipe']} missed the "
                        f"accuracy gates and already ran {_speed(w['speed'])} against FP32 on "
                        f"{self.speed_variants[0]}, under the {self.spec.SPEED_TARGET.value}x gate, and more float "
                        "units only slow a graph down")
            if self.min_int8_share:
                why += (f" with at least {self.min_int8_share:.0%} of the weighted multiply-accumulates in INT8 "
                        "(below that the FP16 plan is faster)")
            if self.spent() or self.cuts:
                why += f" within the search budget ({self.budget_s / 60:.0f} min)"
            return self._result(None, {}, {}, {}, failed, t0, why, accurate=accurate)
        looks = confirmation_order(ok, {_key(r): self._split_metrics.get(_key(r)) for r, _ in ok}, self.rank_targets)
        misses, why, first = [], [], None  # each look's miss (a report entry; the reason's part); the first look's
        for i, (recipe, speed) in enumerate(looks):
            if i and not self.fits("test", f"second look: {recipe.describe()}", self.estimate("test")):
                break
            model = self.build(recipe)
            # Measured when it was confirmed on the whole split (the same graph): not again, outside any budget.
            validation = self._split_metrics.get(_key(recipe)) or self.val.metrics(model, exact=self.exact)
            self.log("[search] confirming on the test split" + (f" (second look, {recipe.describe()}: the most "
                                                                "accurate on validation)" if i else ""))
            test, ok_test = self._on_test(model)
            first = first or (validation, test)
            if ok_test:
                failed[:0] = misses
                return self._result(recipe, validation, test, speed, failed, t0, "", chosen=recipe)
            missing = "; ".join(missed(self.targets["test"], test))
            misses.append({"recipe": recipe.describe(), "test": test, "accuracy": f"test split: {missing}"})
            why.append(f"{recipe.describe()}: {missing}")
        failed[:0] = misses[1:]  # the first look's miss is the result's own (chosen, test)
        return self._result(None, first[0], first[1], looks[0][1], failed, t0, "test split: " + "; ".join(why),
                            chosen=looks[0][0])

    def _sort_by_speed(self, ok: list, slow: list, failed: list, found: list[tuple[Recipe, dict]]) -> None:
        """Candidates that held every accuracy gate go to `ok`, or to `slow` (and `failed`) where the speed gate
        rejects them."""
        for r, s in found:
            if not self.check_speed or self.spec.SPEED_TARGET.met(s):
                ok.append((r, s))
                continue
            slow.append((r, s))
            failed.append({"recipe": r.describe(), "accuracy": "passed (validation)", "speed": s,
                           "speedup": s.get("int8_speedup")})

    def _on_test(self, model) -> tuple[dict[str, float], bool]:
        """A chosen graph on the held-out test split, once (the reserve was kept for it): its metrics, and whether
        they meet the test split's gates."""
        t1 = time.perf_counter()
        test = Evaluator(self.spec, self.fp32, "test").metrics(model, exact=self.exact)
        self._took("test", time.perf_counter() - t1)
        return test, passes(self.targets["test"], test)

    def _held_out(self, r: Recipe, speed: dict[str, float]) -> dict | None:
        """The accurate candidate kept for CPUs that cannot run the FP32 competitor it lost to, once the test split
        holds it too (as a passing recipe must), else None. Logged either way."""
        test, held = self._on_test(self.build(r))
        self.log(f"  accurate candidate {r.describe()} on the test split: {_summary(self.targets['test'], test)}"
                 + ("" if held else " (missed: not kept)"))
        if not held:
            return None
        return {"recipe": asdict(r), "validation": self._split_metrics.get(_key(r), {}), "test": test, "speed": speed,
                "int8_variant": self._variants(r)[1]}

    def candidate_speed(self, r: Recipe) -> dict[str, float]:
        """A candidate that holds every accuracy gate, timed as the gate judges it: every served batch size."""
        return speedup(self.spec, self.fp32, self.build(r), self.spec.SPEED_BATCHES, variants=self._variants(r),
                       separate_from=self.spec.SPEED_TARGET.value)

    def _result(self, recipe, validation, test, speed, failed, t0, reason, chosen=None,
                accurate=None) -> SearchResult:
        if self._own:
            self.ws.close()
        if self._bar is not None:
            self._bar.close()
        if self.cuts:
            self.log(f"[search] the budget cut {len(self.cuts)} step(s), first {self.cuts[0]['stage']} "
                     f"'{self.cuts[0]['what']}' at {self.cuts[0]['at_s']:.0f} s of {self.budget_s:.0f} s")
        res = SearchResult(self.form, recipe, validation, test, speed, self.steps, self.sensitivity, failed,
                           round(time.perf_counter() - t0, 1), recipe is not None, reason, list(self.cuts),
                           list(self.walls), accurate,
                           self._variants(recipe)[1] if recipe is not None and self.check_speed else None)
        if chosen is not None and recipe is None:
            res.best_failed.insert(0, {"recipe": chosen.describe(), "test": test})
        return res


def confirmation_order(ok: Sequence[tuple[Recipe, dict]], validation: Mapping[str, Mapping[str, float] | None],
                       targets: Sequence[Target]) -> list[tuple[Recipe, dict]]:
    """The candidates that may look at the held-out test split, in order, all named before the first look: the
    fastest (without a speed check, the fewest float units); should it miss, the one most accurate on the whole
    validation split (`validation`, by recipe key), where that is another and strictly more accurate. A worst-case
    gate can miss on the other split by more than any margin (docs/int8-search.md); two looks at most, so the test
    split stays a check, not a choice."""
    def badness(r: Recipe) -> float:
        metrics = validation.get(_key(r))
        return distortion(targets, metrics) if metrics else float("inf")

    ranked = sorted(ok, key=lambda rs: (rs[1].get("int8_speedup", 0.0), -len(rs[0].float_nodes)), reverse=True)
    if not ranked:
        return []
    first = ranked[0]
    backup = min(ranked[1:], key=lambda rs: badness(rs[0]), default=None)
    if backup is None or not badness(backup[0]) < badness(first[0]):
        return [first]
    return [first, backup]


def _prepared_key(r: Recipe) -> tuple:
    """What a recipe's prepared graph depends on: recipes equal in it share one (Workspace.prepared)."""
    return r.placement, r.smooth_alpha, r.bias_correction, r.weight_rounding


def _key(r: Recipe) -> str:
    return json.dumps(asdict(r), sort_keys=True)


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def _summary(targets: Sequence[Target], metrics: dict[str, float]) -> str:
    return " ".join(f"{t.metric}={metrics.get(t.metric, float('nan')):.4f}" for t in targets)


def _speed(speed: dict[str, float]) -> str:
    def one(b: str, v: float) -> str:
        lo, hi = speed.get(f"speedup_lo_batch{b}"), speed.get(f"speedup_hi_batch{b}")
        return f"b{b}:x{v:.2f}" + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else "")
    return " ".join(one(k.removeprefix("speedup_batch"), v) for k, v in speed.items()
                    if k.startswith("speedup_batch")) or "-"
