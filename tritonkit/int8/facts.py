"""What one build measures of its FP32 file, once, and hands on in memory to every stage that needs it (the search's
budget, its deferred floor's estimate, the runtime choice's accuracy-check estimate)."""

from __future__ import annotations

from pathlib import Path


class FP32Facts:
    """The FP32 file's measured facts for one build: seconds a row on onnxruntime here (floor.row_seconds, on the
    validation split), measured the first time a stage asks."""

    def __init__(self, kind, fp32: Path):
        self.kind, self.fp32 = kind, Path(fp32)
        self._row_s: float | None = None

    def row_s(self) -> float:
        if self._row_s is None:
            from tritonkit.int8 import floor

            self._row_s = floor.row_seconds(self.kind, self.fp32)
        return self._row_s
