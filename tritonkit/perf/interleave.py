"""Timing several ways of doing the same work in one run: each repeat runs every way once, back to back, so a change
in the machine's load hits them all (the lab's rule: ratios within one run, median of interleaved repeats)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


def interleaved(ways: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """{name: seconds of each repeat} for every way in `ways`, each run once first (warm-up, untimed)."""
    for way in ways.values():
        way()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            t0 = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - t0)
    return times
