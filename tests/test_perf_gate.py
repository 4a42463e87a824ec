"""CI perf gate: served throughput must stay above a ratio of the in-process baseline measured in the same run.

Ratios, not absolute numbers: a slower or busier CI machine slows both sides. The thresholds (tritonkit.lab.GATE)
sit well under the ratios measured on the development machine; docs/performance.md ("CI perf gate") has the spread.
"""

from __future__ import annotations

import pytest

from tritonkit import lab

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("pipeline", ["text", "image"])
def test_served_beats_in_process_baseline_by_the_gate_ratio(pipeline):
    result = lab.gate_ratios(pipeline)
    print(f"perf gate {pipeline}: {result}")
    assert result["ratio"] >= result["min_ratio"], (
        f"{pipeline}: served {result['served']:.1f}/s is only {result['ratio']:.2f}x the in-process baseline "
        f"{result['baseline']:.1f}/s (gate {result['min_ratio']}x); runs: {result}"
    )
