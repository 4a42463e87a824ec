"""Committed real text used for export validation, INT8 calibration, evaluation and benchmarks.

`sentences.txt` is made by `make_corpus.py` (Python standard-library docstrings, PSF License v2). Splits are
fixed slices of the shuffled file, so calibration and evaluation text are disjoint by construction.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

SENTENCES = Path(__file__).with_name("sentences.txt")

# Disjoint [start, stop) slices of sentences.txt.
SPLITS = {
    "calibration": (0, 1000),
    "evaluation": (1000, 3000),
    "validation": (3000, 4000),
    "benchmark": (4000, 6000),
    "demo": (6000, 8000),
}


@cache
def sentences() -> tuple[str, ...]:
    return tuple(line for line in SENTENCES.read_text(encoding="utf-8").splitlines() if line.strip())


def split(name: str) -> list[str]:
    if name not in SPLITS:
        raise KeyError(f"unknown split '{name}' (known: {', '.join(SPLITS)})")
    start, stop = SPLITS[name]
    return list(sentences()[start:stop])
