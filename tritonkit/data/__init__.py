"""Committed real text used for export validation, INT8 calibration, evaluation and benchmarks.

`sentences.txt` is made by `make_corpus.py` (Python standard-library docstrings, PSF License v2). Splits are
fixed slices of the shuffled file, so calibration and evaluation text are disjoint by construction.

`eval_corpus.jsonl` (made by `make_eval_corpus.py` from five other sources) is the held-out text for INT8 gates:
`eval_texts("validation")` for choices made on data, `eval_texts("test")` only to confirm them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SENTENCES = Path(__file__).with_name("sentences.txt")
EVAL_CORPUS = Path(__file__).with_name("eval_corpus.jsonl")
EVAL_SPLITS = ("validation", "test")
EVAL_KINDS = ("query", "sentence", "paragraph", "passage")

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


@dataclass(frozen=True)
class EvalText:
    text: str
    source: str  # fortunes, wordnet, bible-kjv, manpages, licenses
    kind: str  # one of EVAL_KINDS
    split: str  # one of EVAL_SPLITS


@cache
def eval_corpus() -> tuple[EvalText, ...]:
    return tuple(EvalText(**json.loads(line)) for line in EVAL_CORPUS.read_text(encoding="utf-8").splitlines())


def eval_items(split: str) -> list[EvalText]:
    """One held-out split, stratified by source and kind; the two splits share no text."""
    if split not in EVAL_SPLITS:
        raise KeyError(f"unknown eval split '{split}' (known: {', '.join(EVAL_SPLITS)})")
    return [t for t in eval_corpus() if t.split == split]


def eval_texts(split: str) -> list[str]:
    return [t.text for t in eval_items(split)]
