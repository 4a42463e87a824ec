"""The one context an INT8 search's steps share (tritonkit.int8.search runs them in order): the spec, the FP32
file, the form's gates, the graph builder, the evaluators, the budget's plan, the log and what the steps found so
far. Steps (tritonkit.int8.steps, .fallback, .timing) are functions over it; it holds no step of its own, only
the services every step uses: build a candidate, measure it on a split, judge it against the gates."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tritonkit.errors import SearchError
from tritonkit.int8.budget import Budget
from tritonkit.int8.builder import Builder, Workspace
from tritonkit.int8.builder import recipe_key as key
from tritonkit.int8.checks import int8_share
from tritonkit.int8.evaluate import Evaluator
from tritonkit.int8.facts import FP32Facts
from tritonkit.int8.gates import Gates, distortion, of_floor, passes
from tritonkit.int8.gates import summary as _summary
from tritonkit.int8.planner import Plan
from tritonkit.int8.records import ProbeTimings, Recipe, SearchSpec, Step
from tritonkit.int8.speed import speedup
from tritonkit.int8.units import families, group_units, quantizable_nodes
from tritonkit.kinds.gates import Target
from tritonkit.serving.runtimes import DEFAULT

# A track's knob variants (steps.knob_variants), which a kind's SEARCH_PRIOR may name besides form and placement.
KNOBS = ("smooth_alpha", "weight_rounding", "bias_correction", "calibrate_method")
# A candidate holds each validation gate by this share of the gate's scale (scoring.slack) to spare.
MARGIN = 0.1


@dataclass
class Track:
    """One starting point (form × placement) carried through knobs, sensitivity and fallback."""

    recipe: Recipe
    metrics: dict[str, float]
    scored_on: Evaluator | None = None  # the sample its start was measured on (replaced between tracks)
    slow: bool = False  # its start timed under the speed gate already


def passed(step: Step | None) -> bool:
    return step is not None and step.passed


def prior_misses(spec, r: Recipe, knobs: Sequence[str]) -> int:
    """How many of `knobs` that the kind's SEARCH_PRIOR names `r` sets otherwise (0: the prior's own)."""
    prior = getattr(spec, "SEARCH_PRIOR", None) or {}
    return sum(getattr(r, k) != prior[k] for k in knobs if k in prior)


def priors_knobs(spec, r: Recipe) -> bool:
    """Whether `r` sets every knob as the kind's SEARCH_PRIOR does (False for a kind without one)."""
    return bool(getattr(spec, "SEARCH_PRIOR", None)) and not prior_misses(spec, r, KNOBS)


class SearchContext:
    """One form's search state (tritonkit.int8.search). `gates`: the form's, judged against the FP32 graph's
    half-precision floor (the build's, constructed once per form); `exact`: judge in a session asking for exact
    int32 sums (this CPU lacks VNNI); `speed_variants`: (FP32's, INT8's) serving variants the speed gate times on;
    `committed`: (recipe, its QuantParams), this model, form and CPU class's committed candidate, judged first
    (steps.committed_first) and built from its parameters, as a replay builds it; `probed`: what the speed probe
    timed (timing.speed_probe), not timed again; `facts`: the build's measured facts of the FP32 file."""

    def __init__(self, spec: SearchSpec, fp32: Path, forms: Sequence[str], *, check_speed: bool, margin: float = MARGIN,
                 max_units: int = 64, max_tracks: int = 2, max_variants: int = 3, sample_stride: int = 3,
                 budget: Budget | None = None, progress: bool = True, log: Callable = print,
                 workspace: Workspace | None = None, exact: bool = False, min_int8_share: float | None = None,
                 gates: Gates | None = None, speed_variants: tuple[str, str] = (DEFAULT, DEFAULT),
                 committed: tuple[Recipe, object] | None = None, probed: ProbeTimings | None = None,
                 facts: FP32Facts | None = None):
        self.spec, self.fp32, self.forms = spec, Path(fp32), list(forms)
        self.gates = gates or of_floor(spec, "served" if check_speed else "tensorrt", None)
        self.form = "/".join(self.forms)
        self.check_speed, self.margin, self.max_units, self.max_tracks = check_speed, margin, max_units, max_tracks
        self.speed_variants, self.exact, self.max_variants = speed_variants, exact, max_variants
        # Without a speed gate, compute stands in for speed (the gates' TensorRT share); with one, speed decides.
        self.min_int8_share = self.gates.min_int8_share if min_int8_share is None else min_int8_share
        self.progress, self.log, self.sample_stride = progress, log, sample_stride
        self.plan = Plan(budget or Budget(), self.form, check_speed, sample_stride, max_variants, log, progress)
        self.steps: list[Step] = []
        self.sensitivity: list[dict] = []
        self.walls: list[dict] = []
        self.tight_batch: int | None = None  # the served batch size where the fastest start's lead is smallest
        self.fastest: tuple[Recipe, float] | None = None  # the start that timed fastest, every unit INT8
        self.ceiling_timed: dict[str, float] | None = None  # timing.speed_ceiling's last timings
        self.split_metrics: dict[str, dict[str, float]] = {}  # whole-split metrics by recipe: not measured twice
        self.int8_variants: dict[str, str] = {}  # by recipe: the variant its INT8 graph was timed on
        self.granular_tried: set[str] = set()  # recipes whose float MatMuls were tried at a finer granularity
        self.schemes: dict[str, dict[str, list[str]]] = {}  # steps.granular_nodes per recipe: the trim asks first
        self.trimmed: set[str] = set()  # recipes whose float nodes were tried back in INT8 (fallback.trim)
        self.judged = False  # the committed candidate was measured: no start must run whatever the budget
        self.facts = facts or FP32Facts(spec, fp32)  # its seconds a row price a deferred floor
        self.probed = probed or ProbeTimings({})
        self.committed = committed
        self._units: dict[Path, dict[str, list[str]]] = {}
        self._own = workspace is None  # a workspace passed in outlives this search; its owner closes it
        self.ws = workspace or Workspace()
        self._sample: Evaluator | None = None
        self.builder = Builder(spec, fp32, self.ws, committed, exact, progress, took=self.plan.took,
                               name=f"{spec.NAME}-{'served' if check_speed else 'tensorrt'}")  # as replays name it

    # -- judging against the gates -------------------------------------------------------------------------------

    @property
    def targets(self) -> dict[str, list[Target]]:
        """Per split, the bounds known now: the absolute ones while the floor waits for a judgement to need it."""
        return self.gates.targets

    @property
    def rank_targets(self) -> list[Target]:
        # Gates decide; proxies (continuous, e.g. KL) only help rank candidates whose gates move in steps.
        return [*self.targets["validation"], *getattr(self.spec, "PROXY_TARGETS", [])]

    def rank(self, metrics: dict[str, float]) -> float:
        """A candidate's distortion against the bounds known now (lower ranks first)."""
        return distortion(self.rank_targets, metrics) if metrics else float("inf")

    def holds(self, split: str, metrics: dict[str, float], stage: str, margin: float | None = None) -> bool:
        """Whether `metrics` hold `split`'s gates with `margin` (default the search's); where only the deferred floor
        can tell (tritonkit.int8.gates), it is measured first, as a part of `stage` (a candidate's confirmation,
        timing and test may use the reserve), if the budget has its time; else the absolute bounds judge."""
        margin = self.margin if margin is None else margin
        verdict = self.gates.decided(split, metrics, margin)
        if verdict is None:
            self.need_floor(f"a {stage} judgement between the absolute and the loosest bounds", stage)
            verdict = self.gates.decided(split, metrics, margin)
        return bool(verdict)  # still undecided: the floor did not fit, and the absolute bounds missed

    def need_floor(self, why: str, stage: str = "rank") -> None:
        """Measure the deferred floor now (`why`: what needs it) where it fits the budget (planned as a part of
        `stage`; one that only ranks candidates goes on by the absolute bounds where it does not fit), and judge and
        rank the steps so far against it, as if it had been measured first."""
        if not self.gates.deferred:
            return
        from tritonkit.int8 import floor

        precision = self.gates.floor.get("precision", "")
        estimate = None
        if self.plan.budget_s is not None:
            estimate = floor.estimate_s(self.spec, self.fp32, precision, self.facts.row_s())
        if not self.plan.fits(f"{stage}:floor", f"the {precision} floor ({why})", estimate,
                              ahead=0.0 if stage == "rank" else None):
            return
        self.log(f"  measuring the {precision} floor: {why}")
        t0 = time.perf_counter()
        self.gates.resolve()
        self.plan.took("floor", time.perf_counter() - t0)
        for step in self.steps:
            if step.metrics:
                step.distortion = self.rank(step.metrics)
                step.passed = passes(self.targets["validation"], step.metrics, self.margin)

    # -- building and measuring candidates -----------------------------------------------------------------------

    def build(self, r: Recipe):
        """`r`'s INT8 graph, from the builder (the last one is kept: scored, checked, timed and tested in turn)."""
        return self.builder.build(r)

    @property
    def val(self) -> Evaluator:
        if self.ws.val is None:
            self.ws.val = Evaluator(self.spec, self.fp32, "validation")
        return self.ws.val

    @property
    def sample(self) -> Evaluator:
        """A third of the validation split, for the one-unit-at-a-time sensitivity scan."""
        if self._sample is None:
            self._sample = Evaluator(self.spec, self.fp32, "validation", stride=self.sample_stride)
        return self._sample

    def resample(self, r: Recipe, what: str, ahead: float | None) -> bool:
        """The sample with the whole split's worst rows under `r` added, where the budget allows (`what` it is for,
        `ahead`: as Plan.fits): worst-case gates are decided by a few rows a plain sample misses."""
        if not self.plan.fits("resample", what, self.plan.estimate("resample"), ahead):
            return False
        t0 = time.perf_counter()
        hard = self.val.worst_rows(self.build(r), exact=self.exact)
        self._sample = Evaluator(self.spec, self.fp32, "validation", self.sample_stride, extra_rows=hard)
        self.plan.took("resample", time.perf_counter() - t0)
        self.log(f"  sample: every {self.sample_stride}th batch + the {sum(map(len, hard.values()))} worst rows of "
                 "the split")
        return True

    @property
    def early_speed(self) -> float:
        """Quick single-batch timings drop a candidate only well below the speed gate (shared machines are noisy);
        the gate itself is judged on the served batch sizes at the end."""
        return 0.8 * self.gates.speed.value if self.gates.speed is not None else 0.0

    def measure(self, stage: str, change: str, r: Recipe, speed: bool = False,
                evaluator: Evaluator | None = None, must: bool = False, ahead: float | None = None,
                drop_under: float | None = None, decides: bool = True, margin: float | None = None) -> Step | None:
        """Quantize + score one candidate on validation (or the sample); None when the form rejects the graph or
        the budget does not start it. `must`: run whatever the budget (a search's first start); `ahead`: an
        optional step, skipped alone unless it leaves that many seconds (Plan.fits); `drop_under`: timed first,
        a candidate under that speed-up is not scored (its step has no metrics); `decides`: its pass decides what
        the search does next (a start's or knob variant's is only ranked, so it never needs the floor); `margin`:
        the one its pass is judged with (default the search's)."""
        from tritonkit.errors import QuantizationError

        kind = f"{stage}:{'sample' if evaluator is not None else 'split'}"
        self.plan.granted = (None, None)
        if not must and not self.plan.fits(kind, change, self.step_estimate(kind, r), ahead):
            return None
        t0, setup = time.perf_counter(), self.builder.setup_s
        started = (round(t0 - self.plan.t0, 3), *self.plan.granted)

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
            sp = self.probed.quick.get(key(r))  # the probe timed this start's graph (other ranges, same ops)
            if sp is None:
                sp = speedup(self.spec, self.fp32, model, self.spec.SPEED_BATCHES[-1:], repeats=3,
                             variants=self.speed_variants)["int8_speedup"]
        if sp is not None and drop_under is not None and sp < drop_under:
            step = unscored(sp)
            self.plan.took(f"{stage}:speed", time.perf_counter() - t0 - (self.builder.setup_s - setup))
            self.log(f"  {stage:<11} {change:<42} not scored: speed x{sp:.2f}")
            return step
        # A recipe confirmed on the whole split already (a trim that ends at a fallback's recipe) is the same graph.
        metrics = self.split_metrics.get(key(r)) if evaluator is None else None
        if metrics is None:
            metrics = (evaluator or self.val).metrics(model, exact=self.exact)
        if evaluator is None:
            self.split_metrics[key(r)] = metrics
        margin = self.margin if margin is None else margin
        held = self.holds("validation", metrics, stage, margin) if decides else \
            bool(self.gates.decided("validation", metrics, margin))
        step = Step(stage, change, r.describe(), metrics, self.rank(metrics), held, sp,
                    round(time.perf_counter() - t0, 3), *started)
        self.steps.append(step)
        # A step's own cost, without the preparing and calibrating of a new graph it triggered (timed apart).
        self.plan.took(kind, time.perf_counter() - t0 - (self.builder.setup_s - setup))
        self.log(f"  {stage:<11} {change:<42} {_summary(self.targets['validation'], metrics)}"
                 + (f" speed x{sp:.2f}" if sp is not None else "") + (" PASS" if step.passed else ""))
        return step

    def step_estimate(self, kind: str, r: Recipe) -> float | None:
        """A candidate's evaluation plus what its graph still needs: preparing (GPTQ reads the calibration data
        once per chunk of layers) and calibrating. None when nothing of its kind or kin has been timed yet."""
        step = self.plan.estimate(kind)
        if step is None:
            return None
        calibrate = self.plan.estimate("calibrate") or 0.0
        prepared_key = self.builder.prepared_key(r)
        if prepared_key in self.ws.prepared:
            prepared = self.ws.prepared[prepared_key]
            digest = self.builder.digest(prepared.base or prepared.path)
            # Calibrated, or its ranges taken from its twin's pass (a SmoothQuant graph's): no pass to pay.
            ranges = (digest, r.calibrate_method, json.dumps(r.extra_options))
            done = self._collected(digest, r.calibrate_method) or ranges in self.ws.ranges
            return step + (0.0 if done else calibrate)
        from tritonkit.int8 import calibration
        from tritonkit.int8.rounding import STAGES

        def calibrated(smooth_alpha) -> bool:  # a graph of any placement with these transforms has had its pass
            return any(self._collected(self.builder.digest(v.base or v.path), r.calibrate_method)
                       for k, v in self.ws.prepared.items() if k[1:] == (smooth_alpha, *prepared_key[2:]))

        # Placements differ by input isolation only: without data-driven weight changes they calibrate one graph;
        # a SmoothQuant variant's ranges come from its twin's pass, once that ran (Builder.calibrate).
        shared = (r.weight_rounding == "nearest" and not r.bias_correction and calibrated(r.smooth_alpha)) or \
            (calibration.smoothed_from_twin(r) and calibrated(None))
        # GPTQ and bias correction read the data in plain forward passes (GPTQ one per chunk of layers).
        forwards = (STAGES if r.weight_rounding == "gptq" else 0) + (1 if r.bias_correction else 0)
        return step + (0.0 if shared else calibrate) + forwards * (self.plan.estimate("forward") or calibrate)

    def spent(self) -> bool:
        return self.plan.spent()

    def _collected(self, digest: str, method: str) -> bool:
        """Whether a pass over graph `digest` took `method`'s statistics (Builder._ranges: histograms come later)."""
        stats = self.ws.stats.get(digest)
        return stats is not None and (method == "minmax" or method in stats.histograms)

    def int8_share(self, r: Recipe) -> float:
        """The share of the weighted multiply-accumulates `r` leaves in INT8 (on its prepared graph, where merged
        MatMuls carry their new names)."""
        dynamic = set(r.dynamic_nodes)
        return int8_share(self.builder.prepare(r).macs(self.spec.WEIGHT_OPS),
                          [n for n in r.float_nodes if n not in dynamic])

    def under_share(self, r: Recipe, what: str) -> bool:
        """Whether `r` leaves less of the compute in INT8 than the form's share allows (said): not worth judging."""
        if not self.min_int8_share or self.int8_share(r) >= self.min_int8_share:
            return False
        self.log(f"  {what} {r.describe()}: under {self.min_int8_share:.0%} of the multiply-accumulates in INT8; not "
                 "judged")
        return True

    def units(self, r: Recipe) -> dict[str, list[str]]:
        """The units the sensitivity scan ranks on `r`'s prepared graph: families, then nodes or blocks of them.
        Kept per graph: the ETA counts them before the scan (a large encoder's graph takes seconds to load)."""
        path = self.builder.prepare(r).path
        if path not in self._units:
            nodes = quantizable_nodes(path, self.spec.WEIGHT_OPS)
            if not nodes:
                raise SearchError(f"{self.spec.NAME}: no {'/'.join(self.spec.WEIGHT_OPS)} node to quantize")
            self._units[path] = {**families(path, self.spec.WEIGHT_OPS), **group_units(nodes, self.max_units)}
        return self._units[path]

    def close(self) -> None:
        if self._own:
            self.ws.close()
        self.plan.close()
