"""CI perf gate: the served INT8 ensemble must keep up with the in-process INT8 ceiling of the same built model
(our own ONNX file in ONNX Runtime on all cores, fed like the server feeds it), measured in the same test.

Ratios, not absolute numbers: a slower or busier CI machine slows both sides. `tritonkit.perf.lab.GATE` holds each
threshold: the measured median ratio minus the measured run-to-run spread (`perf/gate_noise.py`, docs/performance.md
"CI perf gate"), never above the target (`lab.TARGET`, served ≥ 1.0× in-process). The last test serves a copy of
the repository whose encoder batches badly and checks that the gate notices.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tritonkit import kinds, paths
from tritonkit.perf import lab
from tritonkit.repository import config

pytestmark = pytest.mark.slow

# What the slowed copy's encoder does: wait 100 ms for a batch that 16 callers can never fill.
SLOW_QUEUE_DELAY_US = 100_000


def test_gate_thresholds_sit_under_the_target():
    for name, spec in lab.GATE.items():
        assert 0 < spec["min_ratio"] <= lab.TARGET, name


@pytest.mark.parametrize("pipeline", ["text", "image"])
def test_served_keeps_up_with_the_in_process_int8_ceiling(pipeline):
    result = lab.gate_ratios(pipeline)
    print(f"perf gate {pipeline}: {result}")
    assert result["ratio"] >= result["min_ratio"], (
        f"{pipeline}: served {result['served']:.1f}/s is only {result['ratio']:.2f}x the in-process INT8 ceiling "
        f"{result['baseline']:.1f}/s (gate {result['min_ratio']}x, target {lab.TARGET}x); runs: {result}"
    )


def slowed_copy(tmp_path: Path, name: str) -> Path:
    """The ensemble, its preprocessor and its INT8 model copied (model files linked), the INT8 model's dynamic
    batcher told to wait SLOW_QUEUE_DELAY_US for a full batch: a serving regression, same model, same results."""
    kind = kinds.get(name)
    repo = tmp_path / "repository"
    for model in (kind.NAME, kind.PREPROCESSOR, kind.INT8_MODEL):
        shutil.copytree(paths.MODEL_REPOSITORY / model, repo / model, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.onnx"))
    for onnx in (paths.MODEL_REPOSITORY / kind.INT8_MODEL).rglob("*.onnx"):
        os.symlink(onnx, repo / kind.INT8_MODEL / onnx.relative_to(paths.MODEL_REPOSITORY / kind.INT8_MODEL))
    path = repo / kind.INT8_MODEL / "config.pbtxt"
    cfg = config.load_config(path)
    cfg.dynamic_batching.max_queue_delay_microseconds = SLOW_QUEUE_DELAY_US
    cfg.dynamic_batching.preferred_batch_size[:] = [cfg.max_batch_size]
    path.write_text(config.to_pbtxt(cfg))
    return repo


def test_gate_trips_on_a_slowed_serving_path(tmp_path):
    result = lab.gate_ratios("text", repository=slowed_copy(tmp_path, "text"), build_first=False)
    print(f"perf gate text, slowed copy: {result}")
    assert result["ratio"] < result["min_ratio"], f"the gate did not notice a slowed encoder: {result}"
