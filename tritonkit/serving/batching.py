"""Length bucketing for ragged batches: one dynamic batch → a few runs, each padded only to its own longest.

A dynamic batch of texts right-padded to its longest member wastes work in proportion to the spread of lengths
(and attention's cost grows with the square of the padded length): one 256-token text in a batch of short ones
makes every row cost 256. Splitting the batch, sorted by length, into runs whose padding stays under a fraction
of their elements keeps the batching win (few large GEMMs) without that waste. Used by our Python-based
onnxruntime backend (`ragged_max_padding` in config parameters) and by the fused text model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def length_buckets(lengths: Sequence[int], rows: Sequence[int] | None = None,
                   max_padding: float | None = None) -> list[list[int]]:
    """Indices of `lengths` grouped into runs; each run is padded to its longest member.

    `rows[i]` is how many rows item i contributes (a request may carry several texts, already padded to its own
    longest). Items are taken shortest first and a run grows while the padding it would need stays at most
    `max_padding` of its elements. `max_padding=None` keeps everything in one run (plain ragged batching).
    """
    n = len(lengths)
    if max_padding is None or n <= 1:
        return [list(range(n))]
    rows = rows or [1] * n
    order = sorted(range(n), key=lambda i: lengths[i])
    runs: list[list[int]] = [[]]
    real = count = 0  # elements without padding / rows in the current run
    for i in order:
        # Sorted ascending, so item i would be the run's new longest.
        new_real, new_count = real + rows[i] * lengths[i], count + rows[i]
        padded = new_count * lengths[i]
        if runs[-1] and padded and (padded - new_real) > max_padding * padded:
            runs.append([])
            new_real, new_count = rows[i] * lengths[i], rows[i]
        runs[-1].append(i)
        real, count = new_real, new_count
    return runs


def run_in_buckets(lengths: Sequence[int], max_padding: float | None, run) -> tuple[list[np.ndarray], int]:
    """Every output of `run(rows)` (the graph over those row indices, padded to their longest) for all rows, in row
    order, over length_buckets of single rows; and the number of runs."""
    buckets = length_buckets(lengths, None, max_padding)
    out: list[np.ndarray] | None = None
    for rows in buckets:
        results = run(rows)
        if out is None:
            out = [np.empty((len(lengths), *r.shape[1:]), dtype=r.dtype) for r in results]
        for whole, part in zip(out, results):
            whole[rows] = part
    return out, len(buckets)


def right_padded_lengths(mask: np.ndarray) -> np.ndarray:
    """Each row's length up to its last unmasked slot (at least 1), so cutting a row there drops padding only."""
    seen = mask != 0
    last = mask.shape[1] - np.argmax(seen[:, ::-1], axis=1)
    return np.where(seen.any(axis=1), last, 1)
