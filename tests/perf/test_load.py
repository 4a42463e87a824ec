"""The lab's one percentile (tritonkit.perf.load.percentile), which in-process timings use too."""

from __future__ import annotations

import math

from tritonkit.perf import load


def test_the_labs_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, in no order
    assert load.percentile(values, 99) == 99.0  # int(q * n) read the maximum here: one outlier made the p99
    assert load.percentile(values, 100) == 100.0
    assert load.percentile(values, 50) == 50.0
    assert load.percentile(values, 0.5) == 1.0
    assert load.percentile([7.0], 99) == 7.0
    assert math.isnan(load.percentile([], 50))
