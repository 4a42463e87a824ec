"""Where Triton's Python stubs spend their time: py-spy samples of their stacks, each sample put in one stage.

    pids = {instance: pid for instance, (pid, _model) in server.stub_processes().items()}
    with stubprofile.Recording(pids, seconds=8) as recording:
        drive_load()
    shares = recording.shares()   # {"runtime": 0.89, "tokenize": 0.02, ...}

py-spy reads a running process's Python stacks from outside (ptrace), without changing the stub; `--nonblocking`
leaves the process running while it reads. A sample falls in the stage of its innermost frame that names one: the
runtime's run call (onnxruntime or OpenVINO, tritonkit.serving.runtimes), tokenization, packing or bucketing, image
decoding, the Python backend's tensor helpers; other Python frames are the stub's own Python (execute, responses),
and a sample with no Python frame is the stub's C++ (requests and responses through shared memory).
"""

from __future__ import annotations

import collections
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RUNTIME, TOKENIZE, PACK, DECODE, TENSORS = "runtime", "tokenize", "pack", "decode", "tensors"
PYTHON, NATIVE = "stub Python", "stub native"
STAGES = (RUNTIME, TOKENIZE, PACK, DECODE, TENSORS, PYTHON, NATIVE)
# (stage, substrings of a frame "function (file:line)"), looked up from the innermost frame outwards.
RULES = (
    (RUNTIME, ("tritonkit/serving/runtimes.py", "onnxruntime/", "openvino/", "ArenaRelease.run")),
    (TOKENIZE, ("tritonkit/serving/textproc.py", "tokenizers/")),
    (PACK, ("tritonkit/serving/packing.py", "tritonkit/serving/batching.py")),
    (DECODE, ("tritonkit/serving/imaging.py", "PIL/")),
    (TENSORS, ("triton_python_backend_utils",)),
)
RATE_HZ = 200


def executable() -> str | None:
    """py-spy's path (the venv's first), or None where it is not installed."""
    local = Path(sys.prefix) / "bin" / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def stage(stack: str) -> str:
    """The stage of one sample: `stack` as py-spy's raw format writes it (frames outermost first, `;`-joined)."""
    frames = [f for f in stack.split(";") if f.strip()]
    for frame in reversed(frames):
        for name, marks in RULES:
            if any(m in frame for m in marks):
                return name
    return PYTHON if frames else NATIVE


def parse(raw: str) -> collections.Counter:
    """Samples per stage of py-spy's raw output (one `stack count` line per distinct stack)."""
    out: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            out[stage(stack)] += int(count)
    return out


class Recording:
    """py-spy recording every process of `pids` ({label: pid}) for `seconds`, from entering the block; `shares()`
    after it: the fraction of all their samples in each stage."""

    def __init__(self, pids: dict[str, int], seconds: float, rate_hz: int = RATE_HZ):
        self.pids, self.seconds, self.rate_hz = pids, max(1, int(seconds)), rate_hz
        self.samples: dict[str, collections.Counter] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._procs: dict[str, tuple[subprocess.Popen, Path]] = {}

    def __enter__(self) -> Recording:
        tool = executable()
        if tool is None:
            raise RuntimeError("py-spy is not installed (it is in requirements.txt: `make setup`)")
        self._tmp = tempfile.TemporaryDirectory(prefix="stubprofile-")
        for label, pid in self.pids.items():
            out = Path(self._tmp.name) / f"{pid}.txt"
            cmd = [tool, "record", "--pid", str(pid), "--duration", str(self.seconds), "--rate", str(self.rate_hz),
                   "--format", "raw", "--output", str(out), "--nonblocking"]
            self._procs[label] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), out)
        return self

    def __exit__(self, *exc) -> None:
        try:
            for label, (proc, out) in self._procs.items():
                _, err = proc.communicate(timeout=self.seconds + 30)
                if proc.returncode != 0 or not out.exists():
                    raise RuntimeError(f"py-spy could not sample {label} (pid {self.pids[label]}): "
                                       f"{err.decode(errors='replace').strip()[-300:]}")
                self.samples[label] = parse(out.read_text())
        finally:
            for proc, _ in self._procs.values():
                if proc.poll() is None:
                    proc.kill()
            self._tmp.cleanup()

    def shares(self) -> dict[str, float]:
        """Every stage's share of the samples of all processes together (each stage present)."""
        total = collections.Counter()
        for counts in self.samples.values():
            total.update(counts)
        n = sum(total.values())
        return {s: (total[s] / n if n else 0.0) for s in STAGES}
