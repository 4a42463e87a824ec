"""A search's budget planner: each step's time is estimated from the steps of its kind already timed, and a step
that would not finish in what is left of the budget (less the reserve kept for a found candidate's checks) is not
started. A mixin of tritonkit.int8.search.Search, whose state (durations, plans, deadline, cuts) it reads."""

from __future__ import annotations

import json
import math
import time

import numpy as np

from tritonkit.int8.records import Recipe

# Steps that may use the time kept back for a found candidate (Planner._reserve).
RESERVED = ("confirm", "speed", "test")


class Planner:
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
            return None if split is None else split + (float(np.median(sample)) if sample else 0.0)
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
        key = self.builder.prepared_key(r)
        if key in self.ws.prepared:
            prepared = self.ws.prepared[key]
            digest = self.builder.digest(prepared.base or prepared.path)
            # Calibrated, or its ranges taken from its twin's pass (a SmoothQuant graph's): no pass to pay.
            ranges = (digest, r.calibrate_method, json.dumps(r.extra_options))
            done = digest in self.ws.stats or ranges in self.ws.ranges
            return step + (0.0 if done else calibrate)
        from tritonkit.int8 import calibration
        from tritonkit.int8.rounding import STAGES

        def calibrated(smooth_alpha) -> bool:  # a graph of any placement with these transforms has had its pass
            return any(self.builder.digest(v.base or v.path) in self.ws.stats for k, v in self.ws.prepared.items()
                       if k[1:] == (smooth_alpha, *key[2:]))

        # Placements differ by input isolation only: without data-driven weight changes they calibrate one graph;
        # a SmoothQuant variant's ranges come from its twin's pass, once that ran (Builder.calibrate).
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
            # What is left counts after the time kept for the phases that follow (a bare "0 s left" misled).
            self.log(f"  budget: {kind} '{what}' not started ("
                     + (f"about {estimate:.0f} s, " if estimate else "") + f"{max(left, 0.0):.0f} s left of "
                     f"{max(self._deadline - now, 0.0):.0f} s once {reserve:.0f} s are kept for what follows)")
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


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
