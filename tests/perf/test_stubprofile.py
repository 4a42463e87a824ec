"""tritonkit.perf.stubprofile: stages of py-spy's stacks, and a real recording of a process running our packing."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tritonkit.perf import stubprofile

RUN = "Session.run (onnxruntime/capi/onnxruntime_inference_collection.py:287)"
EMBED = "TritonPythonModel._embed (tritonkit/serving/fused.py:86)"
EXECUTE = "TritonPythonModel.execute (tritonkit/serving/fused.py:118)"


def test_a_sample_takes_the_stage_of_its_innermost_named_frame():
    assert stubprofile.stage(f"<module> (model.py:1);{EXECUTE};{EMBED};ArenaRelease.run "
                             f"(tritonkit/serving/backend_utils.py:291);{RUN}") == stubprofile.RUNTIME
    # numpy inside packing is packing's time; the tokenizer's Rust shows as its Python caller.
    assert stubprofile.stage(f"{EXECUTE};pack (tritonkit/serving/packing.py:133);full "
                             "(numpy/core/numeric.py:330)") == stubprofile.PACK
    assert stubprofile.stage(f"{EXECUTE};TextTokenizer.encode (tritonkit/serving/textproc.py:99)") == \
        stubprofile.TOKENIZE
    assert stubprofile.stage(f"{EXECUTE};deserialize_bytes_tensor (triton_python_backend_utils.py:115)") == \
        stubprofile.TENSORS
    assert stubprofile.stage(EXECUTE) == stubprofile.PYTHON
    assert stubprofile.stage("") == stubprofile.NATIVE


def test_raw_output_counts_samples_per_stage():
    raw = f"{EXECUTE};{EMBED};{RUN} 90\n{EXECUTE} 6\n 4\n"
    assert stubprofile.parse(raw) == {stubprofile.RUNTIME: 90, stubprofile.PYTHON: 6, stubprofile.NATIVE: 4}


_WORKER = """
import sys, numpy as np
from tritonkit.serving import packing
rng = np.random.default_rng(0)
texts = [rng.integers(1, 1000, size=n) for n in rng.integers(5, 60, size=64)]
print("ready", flush=True)
while True:
    packing.pack(texts, 256, "mean", width_multiple=16)
"""


def test_recording_a_running_process_finds_where_its_time_goes():
    if stubprofile.executable() is None:
        pytest.skip("py-spy is not installed")
    proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        try:
            with stubprofile.Recording({"worker": proc.pid}, seconds=2) as recording:
                time.sleep(2)
        except RuntimeError as err:
            if "ermission" in str(err) or "ptrace" in str(err).lower():
                pytest.skip(f"py-spy may not attach here: {err}")
            raise
        shares = recording.shares()
        assert sum(shares.values()) == pytest.approx(1.0)
        assert shares[stubprofile.PACK] > 0.8, shares
        assert sum(recording.samples["worker"].values()) > 100  # ~200 Hz for 2 s of a busy process
    finally:
        proc.kill()
        proc.wait()
