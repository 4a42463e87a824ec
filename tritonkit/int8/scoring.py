"""How far metrics are from their gates, in units of each gate: what ranks candidates and decides passes."""

from __future__ import annotations

from collections.abc import Sequence

from tritonkit.kinds.gates import Target


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


def summary(targets: Sequence[Target], metrics: dict[str, float]) -> str:
    return " ".join(f"{t.metric}={metrics.get(t.metric, float('nan')):.4f}" for t in targets)
