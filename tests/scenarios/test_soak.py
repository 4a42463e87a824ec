"""Soak, CI length: 60 s of mixed text + image traffic at half of capacity (perf/bench_soak.py runs 10 min at 70 %).

Asserts what must hold at any length: no errors, nothing shed below capacity, every answer checked, memory of
server + stubs not growing beyond the bench's bound after warm-up. p99 drift is reported by the 10-minute bench;
60 s on a shared 2-core machine is too short to judge it. Half, not 70 %: capacity is measured in seconds on a
shared machine, and one Poisson burst above a mis-measured capacity turns into a backlog of max-size batches whose
arena growth reads as a leak (a CI run offered 70 % and queued 4 s in the image classifier).
"""

from __future__ import annotations

import pytest

from tests.support.text_support import ensure_text_built
from tritonkit import build, paths
from tritonkit.perf import soak


@pytest.mark.slow
def test_soak_60s_mixed_pipelines(start_server):
    ensure_text_built()
    build.build("image", progress=False)
    server = start_server(paths.MODEL_REPOSITORY, model_control_mode="explicit", models=soak.MODELS)
    try:
        result = soak.soak(server, duration_s=60, rate_fraction=0.5, window_s=20, sample_s=5, capacity_s=6,
                           progress=lambda m: print(m, flush=True))
    finally:
        server.stop()
    print(soak.markdown(result))
    total, memory = result["total"], result["memory"]
    assert total["requests"] > 0.8 * 60 * sum(result["offered_rates_per_s"].values())
    assert total["errors"] == 0, total["messages"]
    # Half of capacity sheds nothing; allow a trace in case another job takes the cores mid-run.
    assert total["rejected"] <= 0.01 * total["requests"], total["messages"]
    assert memory["growth_pss_mib"] <= memory["bound_mib"], memory
