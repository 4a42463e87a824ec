"""Accuracy gates: a metric, its bound and how a candidate is ranked against it. Each kind states its gates
(kinds.base.Kind.TARGETS, CATASTROPHE); INT8 (tritonkit.int8) and the runtime choice judge built files by them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass
class Target:
    metric: str
    op: str  # ">=" or "<="
    value: float
    # How much of the metric counts as one gate when the search ranks candidates (see tritonkit.int8.search).
    scale: float | None = None

    def met(self, metrics: Mapping[str, float]) -> bool:
        got = metrics.get(self.metric)
        if got is None:
            return False
        return got >= self.value if self.op == ">=" else got <= self.value


def missed(targets: Sequence[Target], metrics: dict[str, float]) -> list[str]:
    """One line per gate that `metrics` fails, naming the metric, its value and the bound."""
    return [f"{t.metric} {metrics.get(t.metric, float('nan')):.4f} (gate {t.op} {t.value})"
            for t in targets if not t.met(metrics)]
