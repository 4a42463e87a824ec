"""Accuracy-aware INT8 search: finds a model's quantization recipe with no person in the loop.

    python -m tritonkit.build <model> --search        (re-run after a model, data or dependency change)

For one activation form (the CPU-served one, or TensorRT's symmetric INT8) the search
1. measures the starting knobs (Q/DQ placement, activation form) on the *validation* split, then tries the knobs
   that matter one at a time, keeping what helps: SmoothQuant alpha for MatMul models, bias correction or GPTQ
   weight rounding for conv models, the calibration method where onnxruntime allows it (histogram calibrators
   need equal-shape feeds);
   Where the kind names what its shipped models kept float (SEARCH_PRIOR_FLOAT) and that set holds every gate
   here, it is the result: steps 2 and 3 could only find fewer float nodes, which those models did not keep;
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

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tritonkit.errors import SearchError
from tritonkit.int8.budget import Budget
from tritonkit.int8.builder import Builder, Workspace
from tritonkit.int8.builder import recipe_key as _key
from tritonkit.int8.checks import int8_share
from tritonkit.int8.evaluate import Evaluator
from tritonkit.int8.fallback import Fallbacks
from tritonkit.int8.fallback import passed as _passed
from tritonkit.int8.gates import MIN_TENSORRT_INT8_SHARE, Gates, of_floor
from tritonkit.int8.judge import digest_of
from tritonkit.int8.planner import Planner
from tritonkit.int8.records import ProbeTimings, Recipe, SearchResult, SearchSpec, Step
from tritonkit.int8.scoring import distortion, passes
from tritonkit.int8.scoring import summary as _summary
from tritonkit.int8.speed import describe as _speed
from tritonkit.int8.speed import race, speedup
from tritonkit.int8.units import families, group_units, quantizable_nodes
from tritonkit.kinds.gates import Target
from tritonkit.serving.runtimes import DEFAULT

# A track's knob variants (Search.variants), which a kind's SEARCH_PRIOR may name besides form and placement.
KNOBS = ("smooth_alpha", "weight_rounding", "bias_correction", "calibrate_method")


@dataclass
class Track:
    """One starting point (form × placement) carried through knobs, sensitivity and fallback."""

    recipe: Recipe
    metrics: dict[str, float]
    scored_on: Evaluator | None = None  # the sample its start was measured on (replaced between tracks)
    slow: bool = False  # its start timed under the speed gate already


# A candidate holds each validation gate by this share of the gate's scale (scoring.slack) to spare.
MARGIN = 0.1

class Search(Planner, Fallbacks):
    """One form's accuracy-aware search (the module's docstring); its budget is Planner's, its fallback Fallbacks'."""

    def __init__(self, spec: SearchSpec, fp32: Path, forms: Sequence[str], *, check_speed: bool, margin: float = MARGIN,
                 max_units: int = 64, max_tracks: int = 2, max_variants: int = 3, sample_stride: int = 3,
                 budget: Budget | None = None, progress: bool = True, log: Callable = print,
                 workspace: Workspace | None = None, exact: bool = False, min_int8_share: float | None = None,
                 gates: Gates | None = None, speed_variants: tuple[str, str] = (DEFAULT, DEFAULT),
                 committed: tuple[Recipe, object] | None = None, probed: ProbeTimings | None = None):
        self.spec, self.fp32, self.forms = spec, Path(fp32), list(forms)
        # The gates of each split, judged against the FP32 graph's half-precision floor there (tritonkit.int8.gates).
        self.gates = gates or of_floor(spec, "served" if check_speed else "tensorrt", None)
        self.form = "/".join(self.forms)
        self.check_speed, self.margin, self.max_units, self.max_tracks = check_speed, margin, max_units, max_tracks
        self.speed_variants = speed_variants  # (FP32's, INT8's) serving variants: the speed gate times on them
        self.exact = exact  # judge in a session asking for exact int32 sums: this CPU lacks VNNI
        # Without a speed gate, compute stands in for speed (MIN_TENSORRT_INT8_SHARE); with one, speed decides.
        self.min_int8_share = (0.0 if check_speed else MIN_TENSORRT_INT8_SHARE) if min_int8_share is None \
            else min_int8_share
        self.max_variants = max_variants  # only the best-scoring knob variants get the fallback
        self.progress, self.log, self.sample_stride = progress, log, sample_stride
        self.budget = budget or Budget()  # past its deadline the search stops adding work and reports what it has
        self.budget_s = max(self.budget.left(), 1e-6) if self.budget.bounded else None  # left at the start (run)
        self._deadline = self.budget.deadline if self.budget.bounded else float("inf")
        self.steps: list[Step] = []
        self.sensitivity: list[dict] = []
        self.cuts: list[dict] = []
        self.walls: list[dict] = []
        self._tight_batch: int | None = None  # the served batch size where the fastest start's lead is smallest
        self._durations: dict[str, list[float]] = {}  # seconds of each finished step, by kind of step
        self._stopped = False  # a step did not fit in what was left: nothing more is started
        self._fastest: tuple[Recipe, float] | None = None  # the start that timed fastest, every unit INT8
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
        self.builder = Builder(spec, fp32, self.ws, committed, exact, progress, took=self._took,
                               name=f"{spec.NAME}-{'served' if check_speed else 'tensorrt'}")  # as replays name it
        self._judged = False  # the committed candidate was measured: no start must run whatever the budget
        self._int8_variants: dict[str, str] = {}  # by recipe: the variant its INT8 graph was timed on
        self._granular_tried: set[str] = set()  # recipes whose float MatMuls were tried at a finer granularity
        self._schemes: dict[str, dict[str, list[str]]] = {}  # granular_nodes per recipe: the trim asks first
        self._trimmed: set[str] = set()  # recipes whose float nodes were tried back in INT8 (Fallbacks.trim)
        self.probed = probed or ProbeTimings({})  # what the speed probe timed (speed_probe fills its own)
        self._ceiling_timed: dict[str, float] | None = None  # speed_ceiling's last timings
        self._row_s: float | None = None  # FP32 seconds a row (floor.row_seconds), where a deferred floor is priced

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
        if self.budget_s is not None:
            self._row_s = self._row_s or floor.row_seconds(self.spec, self.fp32)
            estimate = floor.estimate_s(self.spec, self.fp32, precision, self._row_s)
        if not self.fits(f"{stage}:floor", f"the {precision} floor ({why})", estimate,
                         ahead=0.0 if stage == "rank" else None):
            return
        self.log(f"  measuring the {precision} floor: {why}")
        t0 = time.perf_counter()
        self.gates.resolve()
        self._took("floor", time.perf_counter() - t0)
        for step in self.steps:
            if step.metrics:
                step.distortion = self.rank(step.metrics)
                step.passed = passes(self.targets["validation"], step.metrics, self.margin)

    # cached pieces: prepare once per transform set, calibrate once per (transforms, method)
    def build(self, r: Recipe):
        """`r`'s INT8 graph, from the builder (the last one is kept: scored, checked, timed and tested in turn)."""
        return self.builder.build(r)

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
                drop_under: float | None = None, decides: bool = True, margin: float | None = None) -> Step | None:
        """Quantize + score one candidate on validation (or the sample); None when the form rejects the graph or
        the budget does not start it. `must`: run whatever the budget (a search's first start); `ahead`: an
        optional step, skipped alone unless it leaves that many seconds (Search.fits); `drop_under`: timed first,
        a candidate under that speed-up is not scored (its step has no metrics); `decides`: its pass decides what
        the search does next (a start's or knob variant's is only ranked, so it never needs the floor); `margin`:
        the one its pass is judged with (default the search's)."""
        from tritonkit.errors import QuantizationError

        kind = f"{stage}:{'sample' if evaluator is not None else 'split'}"
        self._granted = (None, None)
        if not must and not self.fits(kind, change, self._step_estimate(kind, r), ahead):
            return None
        t0, setup = time.perf_counter(), self.builder.setup_s
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
            sp = self.probed.quick.get(_key(r))  # the probe timed this start's graph (other ranges, same ops)
            if sp is None:
                sp = speedup(self.spec, self.fp32, model, self.spec.SPEED_BATCHES[-1:], repeats=3,
                             variants=self.speed_variants)["int8_speedup"]
        if sp is not None and drop_under is not None and sp < drop_under:
            step = unscored(sp)
            self._took(f"{stage}:speed", time.perf_counter() - t0 - (self.builder.setup_s - setup))  # not a scored step
            self.log(f"  {stage:<11} {change:<42} not scored: speed x{sp:.2f}")
            return step
        metrics = (evaluator or self.val).metrics(model, exact=self.exact)
        if evaluator is None:
            self._split_metrics[_key(r)] = metrics
        margin = self.margin if margin is None else margin
        held = self.holds("validation", metrics, stage, margin) if decides else \
            bool(self.gates.decided("validation", metrics, margin))
        step = Step(stage, change, r.describe(), metrics, self.rank(metrics), held, sp,
                    round(time.perf_counter() - t0, 3), *started)
        self.steps.append(step)
        # A step's own cost, without the preparing and calibrating of a new graph it triggered (timed apart).
        self._took(kind, time.perf_counter() - t0 - (self.builder.setup_s - setup))
        self.log(f"  {stage:<11} {change:<42} {_summary(self.targets['validation'], metrics)}"
                 + (f" speed x{sp:.2f}" if sp is not None else "") + (" PASS" if step.passed else ""))
        return step

    def spent(self) -> bool:
        return self._stopped or time.perf_counter() > self._deadline

    # -- the budget: steps are estimated from those of their kind already timed; one that does not fit is not started

    def int8_share(self, r: Recipe) -> float:
        """The share of the weighted multiply-accumulates `r` leaves in INT8 (on its prepared graph, where merged
        MatMuls carry their new names)."""
        dynamic = set(r.dynamic_nodes)
        return int8_share(self.builder.prepare(r).macs(self.spec.WEIGHT_OPS),
                          [n for n in r.float_nodes if n not in dynamic])

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
        tracks: list[Track] = []
        for r in starts:
            form, placement = r.form, r.placement
            # Starting points are only ranked: the sample is enough (the whole split costs 3x on big encoders).
            # Starts run until one gives a track, whatever the budget: a search reports at least that (a judged
            # committed candidate is that report; a build does not start a form without time for one,
            # recipe.form_cut). A further start is an option that must leave the first track
            # its time where that track can meet the speed gate (on a large encoder the prior's track tells more
            # than three more starts).
            viable = tracks and not tracks[0].slow
            # Timed before it is scored: a start too slow to keep is dropped without its accuracy.
            step = self.measure("start", f"form={form} placement={placement}", r, speed=True,
                                evaluator=self.sample, must=not tracks and not self._judged,
                                ahead=self._after_start(tracks[0].recipe) if viable else None,
                                drop_under=self.early_speed, decides=False)
            if step is None:
                continue
            if step.speedup is not None and (self._fastest is None or step.speedup > self._fastest[1]):
                self._fastest = (r, step.speedup)  # dropped or not: the speed ceiling times the fastest
            if self.check_speed and step.speedup is not None and step.speedup < self.early_speed:
                self.log(f"  dropped {form}/{placement}: x{step.speedup:.2f} before any unit is put back in float")
                continue
            tracks.append(Track(r, step.metrics, self.sample, self.check_speed and step.speedup is not None and
                                step.speedup < self.spec.SPEED_TARGET.value))
        self._plan("start:sample", 0)
        order = self.track_order(tracks)
        if len(order) > 1 and self._track_key(order[0])[:2] == self._track_key(order[1])[:2]:
            self.need_floor("the starts tie but for their distortion")  # which is first is a decision
            order = self.track_order(tracks)
        return order[: self.max_tracks]

    def _track_key(self, t: Track) -> tuple:
        # Units put back in float only slow a graph down: a start already under the speed gate goes last, whatever
        # its accuracy (Lite0's uint8/inputs start ran 1.07x and took a whole budget; uint8/all ran 1.89x).
        # Then the kind's prior (what won on its shipped models), then the lowest distortion.
        return t.slow, self._prior_misses(t.recipe, ("form", "placement")), self.rank(t.metrics)

    def track_order(self, tracks: Sequence[Track]) -> list[Track]:
        """`tracks`, best first, against the bounds known now."""
        return sorted(tracks, key=self._track_key)

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
        if _passed(step):
            return r, self._time_candidate(r, "committed")
        if step is None or not self.holds("validation", step.metrics, "committed", margin=0.0):
            self.log(f"  committed {r.describe()} misses here: searching without it")
            return None
        # Within the margin only (another machine's FP32 file: Lite1's +39 here): its trim may hold with it.
        self.log(f"  committed {r.describe()} holds the gates here, not the margin: trimmed before it is dropped")
        self._trimmed.add(_key(r))
        trimmed = self.trim(r)
        if trimmed is None:
            self.log("  no trim of it holds with the margin: searching without it")
            return None
        self._trimmed.add(_key(trimmed))
        return trimmed, self._time_candidate(trimmed, "committed")

    def prior_nodes(self, r: Recipe) -> list[str]:
        """The nodes of `r`'s prepared graph that the kind's SEARCH_PRIOR_FLOAT names: "family:<name>" units
        (tritonkit.int8.search.families) and regular expressions searched in node names."""
        import re

        patterns = getattr(self.spec, "SEARCH_PRIOR_FLOAT", ())
        if not patterns:
            return []
        units = self.units(r)
        nodes = quantizable_nodes(self.builder.prepare(r).path, self.spec.WEIGHT_OPS)
        named = {n for p in patterns if p.startswith("family:") for n in units.get(p, [])}
        named |= {n for p in patterns if not p.startswith("family:") for n in nodes if re.search(p, n)}
        return [n for n in nodes if n in named]

    def prior_variant(self, scored: Sequence[Recipe], tried: Sequence[Recipe]) -> Recipe | None:
        """The next variant the prior float nodes go on, of a track's `scored` ones (best first, ranked when asked:
        trying one may have measured the floor), after those `tried`: the prior's own knobs, where measured, then the
        best; None after both. An all-INT8 score does not rank variants for a recipe whose worst units stay float: on
        all-MiniLM-L6-v2 itself (a new model's build, no bf16) the plain variant scored best at full INT8 and missed
        with the prior float nodes (cosine min 0.9836), where the shipped recipe is smoothing's."""
        prior = [v for v in scored if self._priors_knobs(v)][:1]
        order = prior + [v for v in scored[:1] if v not in prior]
        return next((v for v in order if v not in tried), None) if len(tried) < len(order) else None

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
        # Untimed here: a confirmed candidate is timed at every served batch size next (_time_candidate).
        confirmed = self.measure("confirm", "the prior float nodes on all validation", r)
        if not _passed(confirmed):
            return None
        return r, self._time_candidate(r)

    def refine(self, timed: tuple[Recipe, dict], ranked=()) -> list[tuple[Recipe, dict]]:
        """A found candidate, (recipe, speed), refined: its float nodes put back in INT8 one by one where the gates
        allow (`trim`), then its float MatMuls at a finer granularity (`granular`). With a speed gate the trimmed
        recipe races its parent head to head and leads only where it beats it beyond the noise; without one (TensorRT's
        form) fewer float nodes lead. Returns [(recipe, speed)] for the speed gate and the test split to choose
        among, the parent kept as a candidate."""
        r = timed[0]
        if _key(r) in self._trimmed:
            return self.granular(timed)
        self._trimmed.add(_key(r))
        trimmed = self.trim(r, ranked)
        if trimmed is None:
            return self.granular(timed)
        if not self.check_speed:
            return [(trimmed, {}), timed]
        t0 = time.perf_counter()
        self.served_variant(trimmed)
        parent, speed = self.race_parent(r, [trimmed])
        self._took("speed", time.perf_counter() - t0)
        faster = speed.get("over_parent_lo", 0.0) > 1.0
        self.log(f"  trimmed {trimmed.describe()}: speed {_speed(speed)}; x{speed.get('over_parent_lo', 0.0):.2f} "
                 "and up over its parent head to head" + ("" if faster else ": not faster beyond the noise"))
        if not faster:
            return self.granular(timed)
        return [*self.granular((trimmed, speed)), (r, parent)]

    def granular(self, timed: tuple[Recipe, dict]) -> list[tuple[Recipe, dict]]:
        """A candidate that held every accuracy gate on the whole split, (recipe, speed), with its float MatMuls
        quantized at run time instead, by each scheme in turn (tritonkit.int8.granularity), where that holds every
        gate on the whole split and there is time to judge it. Those that hold race their parent head to head
        (`race_parent`); one is offered only where it beats the parent beyond the noise at the slowest batch size.
        Returns [(recipe, speed)]: the parent (its speed from the race where a scheme is offered) and those, for the
        speed gate and the test split to choose among (the fastest holding wins). The served form's step before
        float; TensorRT's form runs only explicit Q/DQ, so it never takes one."""
        r = timed[0]
        schemes = self.granular_nodes(r)
        self._granular_tried.add(_key(r))
        if not schemes:
            return [timed]
        held = []
        for name, nodes in schemes.items():
            g = r.with_dynamic(name, nodes)
            # An option: skipped alone where it cannot also leave its timing's time.
            step = self.measure("granular", f"{len(nodes)} {'run-time' if r.dynamic else 'float'} MatMuls as {name}", g,
                                ahead=self.estimate("speed") or 0.0)
            if _passed(step) and self.fits("speed", g.describe(), self.estimate("speed"), ahead=0.0):
                held.append(g)
        if not held:
            return [timed]
        t0 = time.perf_counter()
        for g in held:
            self.served_variant(g)
        speeds = self.race_parent(r, held)
        self._took("speed", (time.perf_counter() - t0) / len(held))
        out = []
        for g, speed in zip(held, speeds[1:], strict=True):
            faster = speed.get("over_parent_lo", 0.0) > 1.0
            self.log(f"  granular {g.describe()}: speed {_speed(speed)} (INT8 on {self._variants(g)[1]}); x"
                     f"{speed.get('over_parent_lo', 0.0):.2f} and up over its parent head to head"
                     + ("" if faster else ": not faster beyond the noise, not offered"))
            if faster:
                out.append((g, speed))
        # Offered schemes rank against the parent's time from the same race; else its own timing stands.
        return [(r, speeds[0]) if out else timed, *out]

    def granular_nodes(self, r: Recipe) -> dict[str, list[str]]:
        """{scheme: the nodes it would run} for each scheme the finer-granularity step (`granular`) would try on
        `r`: `r`'s float nodes it can run; for a recipe already quantized at run time, each other scheme that can
        run all of its run-time nodes (a committed `nbits8-b32` meets `nbits8-b128`). Empty where that step does
        not run: no speed gate, or `r` was tried (a recipe found twice, committed then the prior, competes with
        its variants once)."""
        if not self.check_speed or _key(r) in self._granular_tried:
            return {}
        if _key(r) not in self._schemes:  # each answer builds a graph, which the builder keeps only one of
            self._schemes[_key(r)] = self._eligible_schemes(r)
        return self._schemes[_key(r)]

    def _eligible_schemes(self, r: Recipe) -> dict[str, list[str]]:
        from tritonkit.int8 import granularity

        if r.dynamic:
            own, nodes = r.dynamic["scheme"], r.dynamic_nodes
            model = self.build(replace(r, dynamic={}))
            return {name: nodes for name in granularity.SCHEMES
                    if name != own and granularity.eligible(model, nodes, name) == nodes}
        model = self.build(r)
        found = {name: granularity.eligible(model, r.float_nodes, name) for name in granularity.SCHEMES}
        return {name: nodes for name, nodes in found.items() if nodes}

    def race_parent(self, r: Recipe, rivals: Sequence[Recipe]) -> list[dict[str, float]]:
        """`r` and its `rivals` timed interleaved with FP32 in one run (tritonkit.int8.speed.race): [r's speed,
        each rival's], the rivals' with their ratio over `r` (`over_parent*`)."""
        fp32_variant, parent_variant = self._variants(r)
        names = [f"rival{i}" for i in range(len(rivals))]
        raced = race(self.spec, (fp32_variant, self.fp32), (parent_variant, self.build(r)),
                     {n: (self._variants(g)[1], self.build(g)) for n, g in zip(names, rivals, strict=True)},
                     self.spec.SPEED_BATCHES, separate_from=self.spec.SPEED_TARGET.value)
        return [raced["parent"], *(raced[n] for n in names)]

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
            self.served_variant(r)
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
        def missed(metrics: dict[str, float]) -> list[str]:
            return [] if self.holds("validation", metrics, "speed") else self.gates.lines("validation", metrics,
                                                                                          self.margin)
        metrics, problems = self.val.served_problems(self.build(r), variant, missed, self.spec.SERVE_THREADS,
                                                     self.exact)
        if not problems:
            self.log(f"  {r.describe()} holds run as {variant}: {_summary(self.targets['validation'], metrics)}")
            return variant
        self.log(f"  {r.describe()} misses run as {variant} ({'; '.join(problems)}): timed on {DEFAULT}")
        return DEFAULT

    def served_variant(self, r: Recipe) -> str:
        """int8_variant of `r`, decided once per recipe: the variant its INT8 graph is timed on and its trim's returns
        are judged on."""
        if _key(r) not in self._int8_variants:
            self._int8_variants[_key(r)] = self.int8_variant(r)
        return self._int8_variants[_key(r)]

    def _variants(self, r: Recipe) -> tuple[str, str]:
        """(FP32's, INT8's) variants `r` is timed on: INT8's as int8_variant chose it, else the INT8 model's."""
        return self.speed_variants[0], self._int8_variants.get(_key(r), self.speed_variants[1])

    def speed_ceiling(self, start: Recipe | None = None) -> tuple[str, dict] | None:
        """(why, its timings) when no recipe can meet the speed gate, else None. The fastest start (or `start`) has
        every unit in INT8, and units put back in float only slow a graph down: where its 95 % interval at some served
        batch size lies wholly under the gate, every candidate's would, so nothing is searched (MiniLM and MPNet
        against the FP32 file on OpenVINO bf16 on an AMX CPU). Timed at every served batch size, as the gate is,
        unless it is the start the speed probe timed so (its graph had other ranges, the same ops)."""
        if not self.check_speed or (self._fastest is None and start is None):
            return None
        r, gate = start or self._fastest[0], self.spec.SPEED_TARGET.value
        if self.probed.cleared is not None and _key(r) == _key(self.probed.cleared):
            speed = self.probed.ceiling
            how = f"ran {_speed(speed)} in the speed probe: not timed again"
        else:
            t1 = time.perf_counter()
            speed = speedup(self.spec, self.fp32, self.build(r), self.spec.SPEED_BATCHES,
                            variants=self.speed_variants, separate_from=gate)
            self._took("speed", time.perf_counter() - t1)
            how = f"runs {_speed(speed)} against FP32 on {self.speed_variants[0]}"
        under = [b for b in self.spec.SPEED_BATCHES if speed[f"speedup_hi_batch{b}"] < gate]
        self._tight_batch = min(self.spec.SPEED_BATCHES, key=lambda b: speed[f"speedup_hi_batch{b}"])
        self._ceiling_timed = speed
        self.log(f"[search] speed ceiling: {r.describe()} (every unit INT8) {how}")
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
        quick: dict[str, float] = {}
        self.probed = ProbeTimings(quick)  # filled as the starts are timed
        for r in self._probe_order():
            try:
                model = self.build(r)
            except QuantizationError as exc:
                self.log(f"  probe       {r.describe():<42} rejected: {exc}")
                continue
            sp = speedup(self.spec, self.fp32, model, self.spec.SPEED_BATCHES[-1:], repeats=3,
                         variants=self.speed_variants)["int8_speedup"]
            self.log(f"  probe       {r.describe():<42} speed x{sp:.2f} (batch {self.spec.SPEED_BATCHES[-1]})")
            quick[_key(r)] = sp
            if self._fastest is None or sp > self._fastest[1]:
                self._fastest = (r, sp)
            if sp >= gate and timed is None:
                # One start over the gate at every batch size ends the probe, whatever the others run (MPNet without
                # bf16: the prior's start ran 3.0x, and three more starts took ~110 s to show nothing more).
                timed = (r, self.speed_ceiling(r))
                if timed[1] is None:
                    self.log(f"  probe       {r.describe()} can meet the speed gate: the other starts not probed")
                    self.probed = ProbeTimings(quick, r, self._ceiling_timed)
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
        methods = self.builder.methods()[1:]
        out += [(f"{name} + calibrate={m}", replace(r, calibrate_method=m, extra_options=x))
                for name, r in list(out) for m, x in methods]
        # The start (measured already) first, then the kind's prior knobs, then those nearest to them (fewest knobs
        # off the prior; a stable sort keeps the listed order among equals): a budget that ends early tried them.
        return sorted(out, key=lambda v: (v[0] != "as started", self._prior_misses(v[1], KNOBS)))

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

    def run(self) -> SearchResult:
        from tqdm import tqdm

        t0 = self._t0 = time.perf_counter()
        if self.budget.bounded:
            self._deadline, self.budget_s = self.budget.deadline, max(self.budget.left(), 1e-6)
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
        if first is not None:  # trimmed first: the cheapest way to fewer float nodes (Lite1's +39 ran 1.00x bf16)
            self._sort_by_speed(ok, slow, failed, self.refine(first))
        tracks = self.start()
        ceiling = None if ok else self.speed_ceiling()
        if ceiling is not None:
            accurate = self._held_out(*max(slow, key=lambda rs: rs[1].get("int8_speedup", 0.0))) if slow else None
            return self._result(None, {}, {}, ceiling[1], failed, t0, ceiling[0], accurate=accurate)
        for i in range(len(tracks)):
            track = tracks[i]
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
                    scored.append((track.metrics, name, variant))
                    continue
                # Variants are options: one that does not fit is skipped alone, and any but the prior's must leave
                # the rest of the track its time.
                step = self.measure("variant", name, variant, evaluator=self.sample, decides=False,
                                    ahead=0.0 if self._priors_knobs(variant) else self._after_variants())
                if step is not None:
                    scored.append((step.metrics, name, variant))
            scored.sort(key=lambda v: self.rank(v[0]))
            if scored:
                self._plan_track(scored[0][2], 0, len(scored))
            # What won on the kind's shipped models, before a scan the budget may not reach; it caps the fallbacks.
            found, tried = None, []
            while found is None:
                scored.sort(key=lambda v: self.rank(v[0]))  # the last try may have measured the floor
                variant = self.prior_variant([v for _, _, v in scored], tried)
                if variant is None:
                    break
                tried.append(variant)
                found = self.prior_float(variant)
            if found is not None and (not self.check_speed or self.spec.SPEED_TARGET.met(found[1])):
                # The scan and fallback would only look for fewer float nodes than the kind's shipped models kept:
                # a passing prior ends the search (a 6-layer MiniLM cut: 43 s of fallbacks found nothing shorter).
                self.log(f"  prior {found[0].describe()} holds every gate: the search ends with it (no scan)")
                self._sort_by_speed(ok, slow, failed, self.refine(found))
                break
            # The scan ranks units by their distance to the gates, and the fallbacks judge: by the floor's bounds.
            self.need_floor("the sensitivity scan ranks by the gates")
            scored.sort(key=lambda v: self.rank(v[0]))
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
            ranked = self.rank_units(Track(scored[0][2], scored[0][0])) if scored else []
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
            if finals:  # the first passing candidate's float nodes back in INT8 where they hold, then finer
                finals[:1] = self.refine(finals[0], ranked)
            self._sort_by_speed(ok, slow, failed, finals)
            if ok:  # tracks run best first: the first that passes ends the search
                break
            tracks[i + 1:] = self.track_order(tracks[i + 1:])  # against the floor, where this track measured it
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
            missing = "; ".join(self.gates.lines("test", test))  # as _on_test judged it
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
        return test, self.holds("test", test, "test", 0.0)

    def _held_out(self, r: Recipe, speed: dict[str, float]) -> dict | None:
        """The accurate candidate kept for CPUs that cannot run the FP32 competitor it lost to, once the test split
        holds it too (as a passing recipe must), else None. Logged either way."""
        test, held = self._on_test(self.build(r))
        self.log(f"  accurate candidate {r.describe()} on the test split: {_summary(self.targets['test'], test)}"
                 + ("" if held else " (missed: not kept)"))
        if not held:
            return None
        return {"recipe": r.to_json(), "validation": self._split_metrics.get(_key(r), {}), "test": test, "speed": speed,
                "int8_variant": self._variants(r)[1]}

    def candidate_speed(self, r: Recipe) -> dict[str, float]:
        """A candidate that holds every accuracy gate, timed as the gate judges it: every served batch size."""
        return speedup(self.spec, self.fp32, self.build(r), self.spec.SPEED_BATCHES, variants=self._variants(r),
                       separate_from=self.spec.SPEED_TARGET.value)

    def _result(self, recipe, validation, test, speed, failed, t0, reason, chosen=None,
                accurate=None) -> SearchResult:
        # The judged graph's bytes: a replay that rebuilds them reuses this search's judgement (tritonkit.int8.judge).
        digest = digest_of(self.build(recipe)) if recipe else None
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
                           self._variants(recipe)[1] if recipe is not None and self.check_speed else None, digest)
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
