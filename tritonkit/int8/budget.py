"""A build's time budget: one deadline, in one unit (time.perf_counter seconds), handed down and split by shares.

`make build` of a model that searches makes one `Budget` of its minutes; the search gets it less a share for the
steps after it, each form a share of that, and the runtime choice what is left at its turn. Nothing else counts
time against a budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# A whole search of one model (both forms) by default: a new model's `make build` ends within it on 2 cores.
DEFAULT_BUDGET_S = 15 * 60
# The served form's share when both forms are searched: it serves every CPU replica; TensorRT's form gets the rest
# (it reuses the served search's graphs, calibrations and references, so it needs less).
SERVED_SHARE = 2 / 3
# A build that searches spends its model's budget before the search (export) and after it (replays, packing, the
# runtime choice): perf/bench_new_model.py's 4-layer encoder, 2026-11-27, spent 25 s before and 199 s after (22 % of
# 15 min). The search gets the budget less what came before and this share, so the whole build keeps the budget.
AFTER_SEARCH_SHARE = 0.25
# What a form's first start costs (its calibration pass and its sample's scoring) in FP32 passes over the validation
# split: MPNet's took 190 s where a pass takes ~150 s (2-core Xeon, 2026-11-28). A form whose floor and first start
# would not fit in its share of the budget is not searched (pipeline.form_cut).
START_PASSES = 1.3


@dataclass(frozen=True)
class Budget:
    """Until `deadline` (time.perf_counter; None: unbounded); `seconds`: what it was given, for messages."""

    deadline: float | None = None
    seconds: float | None = None

    @classmethod
    def of(cls, seconds: float | None, start: float | None = None) -> Budget:
        """`seconds` from `start` (default now); None or 0: unbounded."""
        if not seconds:
            return cls()
        return cls((time.perf_counter() if start is None else start) + seconds, seconds)

    @property
    def bounded(self) -> bool:
        return self.deadline is not None

    def left(self) -> float | None:
        """Seconds to the deadline now, never below 0 (None: unbounded)."""
        return None if self.deadline is None else max(self.deadline - time.perf_counter(), 0.0)

    def spent(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def less(self, seconds: float) -> Budget:
        """This budget with `seconds` kept back at its end (for the steps after the one it is handed to)."""
        return self if self.deadline is None else Budget(self.deadline - seconds, self.seconds)

    def share(self, fraction: float) -> Budget:
        """`fraction` of what is left now."""
        if self.deadline is None:
            return self
        left = self.left()
        return Budget(time.perf_counter() + left * fraction, left * fraction)

    def describe(self) -> str:
        return "no budget" if self.seconds is None else f"its {self.seconds / 60:.0f}-minute budget"
