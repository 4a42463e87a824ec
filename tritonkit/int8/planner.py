"""A search's budget planner: each step's time is estimated from the steps of its kind already timed, and a step
that would not finish in what is left of the budget (less the reserve kept for a found candidate's checks) is not
started. One `Plan` per search, held by its context (tritonkit.int8.context.SearchContext); it owns every time sum
of the search (the Budget it is handed is the deadline)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from tritonkit.int8.budget import Budget

# Steps that may use the time kept back for a found candidate (Plan.reserve).
RESERVED = ("confirm", "speed", "test")


class Plan:
    """The search's clock: what each kind of step took, what is still planned, what was cut, and its progress bar."""

    def __init__(self, budget: Budget, form: str, check_speed: bool, sample_stride: int, max_variants: int,
                 log: Callable = print, progress: bool = True):
        self.budget, self.form, self.check_speed = budget, form, check_speed
        self.sample_stride, self.max_variants, self.log, self.progress = sample_stride, max_variants, log, progress
        self.budget_s = max(budget.left(), 1e-6) if budget.bounded else None  # left at the start (start())
        self.deadline = budget.deadline if budget.bounded else float("inf")
        self.durations: dict[str, list[float]] = {}  # seconds of each finished step, by kind of step
        self.planned: dict[str, int] = {}  # steps still planned, by kind: the progress bar's ETA
        self.cuts: list[dict] = []
        self.stopped = False  # a step did not fit in what was left: nothing more is started
        self.granted: tuple[float | None, float | None] = (None, None)  # the last step's estimate and left
        self.t0 = time.perf_counter()  # reset by start()
        self._bar = None

    def start(self) -> None:
        """The search starts now: the budget's clock and the progress bar (seconds spent, ETA from the plan)."""
        from tqdm import tqdm

        self.t0 = time.perf_counter()
        if self.budget.bounded:
            self.deadline, self.budget_s = self.budget.deadline, max(self.budget.left(), 1e-6)
        self._bar = tqdm(total=round(self.budget_s) if self.budget_s else None, desc=f"search {self.form}",
                         unit="s", disable=not self.progress,
                         bar_format="{n}/{total} s |{bar:20}| {desc}" if self.budget_s else "{n} s | {desc}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def spent(self) -> bool:
        return self.stopped or time.perf_counter() > self.deadline

    def took(self, kind: str, seconds: float) -> None:
        self.durations.setdefault(kind, []).append(seconds)
        if self.planned.get(kind):
            self.planned[kind] -= 1
        self._progress(kind)

    def plan(self, kind: str, count: int) -> None:
        """`count` steps of `kind` are still to come (the ETA counts them)."""
        self.planned[kind] = max(0, count)
        self._progress()

    def eta(self) -> float | None:
        """Seconds until the search ends: the planned steps at their estimates plus the reserve, capped by what is
        left of the budget (None: nothing timed yet to go by)."""
        if not self.durations:
            return None
        planned = sum(n * (self.estimate(k) or 0.0) for k, n in self.planned.items() if n) + self.reserve()
        return max(0.0, min(planned, self.deadline - time.perf_counter()))

    def _progress(self, kind: str = "") -> None:
        if self._bar is None:
            return
        elapsed = time.perf_counter() - self.t0
        self._bar.n = min(self._bar.total, round(elapsed)) if self._bar.total else round(elapsed)
        eta = self.eta()
        self._bar.set_description_str(f"search {self.form}, ETA {'?' if eta is None else _clock(eta)}"
                                      + (f" (last: {kind})" if kind else ""), refresh=True)

    def plan_track(self, units: int, variants: int, fallbacks: int | None = None) -> None:
        """A track's steps still to come: `variants` knob variants, then the resample, the sensitivity scan of its
        `units` and a fallback for each of the best variants (`fallbacks` of them measured)."""
        self.plan("variant:sample", variants)
        self.plan("resample", 1)
        self.plan("unit:sample", units + 1)
        self.plan("fallback:sample", min(self.max_variants, fallbacks or variants + 1) * self.fallback_steps(units))

    def log_eta(self, phase: str) -> None:
        """One log line per phase (a build's log has no progress bar)."""
        if self.stopped:
            return
        eta = self.eta()
        budget = f" of {self.budget_s:.0f} s" if self.budget_s else ""
        self.log(f"  [{phase}] {time.perf_counter() - self.t0:.0f} s{budget} spent, ETA "
                 f"{'?' if eta is None else _clock(eta)}")

    def estimate(self, kind: str) -> float | None:
        """The median time of the steps of `kind` done so far. Before the first of its kind, from its kin: an
        evaluation costs about what another one on the same split did (the whole split is `sample_stride` samples;
        a final speed run, a start's). None: nothing to go by."""
        done = self.durations.get(kind)
        if done:
            return float(np.median(done))

        def kin(*suffixes: str) -> list[float]:
            return [d for k, ds in self.durations.items() if k.endswith(suffixes) for d in ds]

        sample, whole = kin(":sample"), kin(":split", "test")
        if kind.endswith(":split") or kind == "test":
            return float(np.median(whole)) if whole else self.sample_stride * float(np.median(sample)) \
                if sample else None
        if kind == "resample":  # the whole split's worst rows, then a new sample's FP32 reference
            split = self.estimate("confirm:split")
            return None if split is None else split + (float(np.median(sample)) if sample else 0.0)
        if kind.endswith(":sample") or kind == "speed":
            if sample:
                return float(np.median(sample))
            # Before any sample, a sample step is a share of a whole split (a committed candidate's).
            return float(np.median(whole)) / self.sample_stride if whole and kind != "speed" else None
        return None

    def reserve(self) -> float:
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
            return reserved or not self.stopped
        now = time.perf_counter()
        reserve = 0.0 if reserved else self.reserve() + (ahead or 0.0)
        left = self.deadline - now - reserve
        if (reserved or not self.stopped) and (estimate <= left if estimate is not None else left > 0):
            self.granted = (None if estimate is None else round(estimate, 3), round(left, 3))
            return True
        if reserved or not self.stopped:  # once stopped, later steps are not started, nor listed one by one
            self.cuts.append({"stage": kind, "what": what,
                              "estimate_s": None if estimate is None else round(estimate, 3),
                              "left_s": round(max(left, 0.0), 3), "reserve_s": round(reserve, 3),
                              "at_s": round(now - self.t0, 3)})
            # What is left counts after the time kept for the phases that follow (a bare "0 s left" misled).
            self.log(f"  budget: {kind} '{what}' not started ("
                     + (f"about {estimate:.0f} s, " if estimate else "") + f"{max(left, 0.0):.0f} s left of "
                     f"{max(self.deadline - now, 0.0):.0f} s once {reserve:.0f} s are kept for what follows)")
        if not reserved and not alone:
            self.stopped = True
        return False

    def fallback_steps(self, units: int) -> int:
        """Candidates one fallback over a ranking of `units` tries: galloping then bisecting over its prefixes (half
        the ranking with a speed gate; fallback.prefixes), plus the unperturbed one."""
        prefixes = max(1, units // 2) if self.check_speed else units
        return 2 * math.ceil(math.log2(prefixes + 1)) + 1

    def after_scan(self, ranked: int) -> float:
        """Seconds one fallback over `ranked` units takes: what the sensitivity scan leaves when it ranks them."""
        return self.fallback_steps(ranked) * (self.estimate("fallback:sample") or 0.0)

    def after_start(self, units: int) -> float:
        """Seconds the first track takes after its start: a knob variant, the resample, the scan of its `units` and
        one fallback, each candidate at a start's sample time (the resample at its own estimate)."""
        sample = self.estimate("start:sample") or 0.0
        return (2 + units + self.fallback_steps(units)) * sample + (self.estimate("resample") or 0.0)

    def after_variants(self) -> float:
        """Seconds the rest of a track takes after its knob variants: the resample, the whole scan, one fallback:
        what a further variant must leave (the prior's need not: it is the likeliest to pass)."""
        units = max(0, self.planned.get("unit:sample", 1) - 1)
        return ((self.estimate("resample") or 0.0) + (units + 1) * (self.estimate("unit:sample") or 0.0)
                + self.after_scan(units))

    def after_trim(self, schemes: int) -> float:
        """Seconds a trim's returns leave to the steps after them (served form): the trimmed recipe's confirmation
        and race against its parent, then the finer-granularity step's `schemes` on what stays float (each judged
        on the whole split, then raced). MPNet's trim, at 50 s a return, took a 40-minute budget before that step
        ran; its 33 float MatMuls as nbits8-b32 cut a batch of 8 from 144 to 123 ms in OpenVINO bf16."""
        if not self.check_speed:
            return 0.0
        split, speed = self.estimate("confirm:split") or 0.0, self.estimate("speed") or 0.0
        return split + speed + (schemes * split + speed if schemes else 0.0)


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
