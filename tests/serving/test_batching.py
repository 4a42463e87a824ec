"""tritonkit.serving.batching.length_buckets: the plan the onnxruntime backend follows for ragged batches."""

from __future__ import annotations

import numpy as np
import pytest

from tritonkit.serving.batching import length_buckets, right_padded_lengths, run_in_buckets


def _padding(lengths, rows, run) -> tuple[int, int]:
    longest = max(lengths[i] for i in run)
    padded = longest * sum(rows[i] for i in run)
    return padded - sum(rows[i] * lengths[i] for i in run), padded


def test_without_a_limit_everything_is_one_run():
    assert length_buckets([5, 200, 7]) == [[0, 1, 2]]


@pytest.mark.parametrize("max_padding", [0.0, 0.1, 0.25, 0.5])
def test_runs_cover_every_item_once_and_respect_the_limit(max_padding):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 257, 64).tolist()
    rows = rng.integers(1, 5, 64).tolist()
    runs = length_buckets(lengths, rows, max_padding)
    assert sorted(i for run in runs for i in run) == list(range(64))
    for run in runs:
        waste, padded = _padding(lengths, rows, run)
        assert len(run) == 1 or waste <= max_padding * padded + 1e-9, (run, waste, padded)


def test_equal_lengths_stay_together_and_outliers_split_off():
    assert length_buckets([10, 10, 10], None, 0.0) == [[0, 1, 2]]
    runs = length_buckets([5, 200, 7, 180, 30], None, 0.25)
    assert [0, 2] in runs and sorted(runs[-1]) == [1, 3]


def test_a_looser_limit_never_makes_more_runs():
    lengths = np.random.default_rng(1).integers(1, 257, 100).tolist()
    counts = [len(length_buckets(lengths, None, m)) for m in (0.0, 0.1, 0.25, 0.5, 0.9)]
    assert counts == sorted(counts, reverse=True) and counts[-1] < counts[0]


def test_run_in_buckets_puts_every_rows_output_back_in_row_order():
    lengths = [7, 1, 30, 2, 29, 8]
    seen: list[list[int]] = []

    def run(rows):
        seen.append(list(rows))
        return [np.array([[lengths[i] * 10] for i in rows]), np.array(rows)]

    (values, rows), runs = run_in_buckets(lengths, 0.25, run)
    assert values[:, 0].tolist() == [n * 10 for n in lengths] and rows.tolist() == list(range(len(lengths)))
    assert runs == len(seen) > 1 and sorted(i for r in seen for i in r) == list(range(len(lengths)))


def test_right_padded_lengths_end_at_the_last_unmasked_slot():
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    assert right_padded_lengths(mask).tolist() == [2, 4, 1, 3]
