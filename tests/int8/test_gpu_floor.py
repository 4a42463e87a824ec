"""The GPU fp16 floor check's plumbing (tritonkit.int8.gpu_floor) on the real text encoder, run on this CPU: the
bundle's batches are the floor's, row for row, so the fp16-weights run lines up with the FP32 graph's reference;
the compare step prints the emulated floor on the same rows beside it."""

from __future__ import annotations

import numpy as np

from tests.support.text_support import ensure_text_built
from tritonkit import kinds
from tritonkit.int8 import gpu_floor
from tritonkit.int8.evaluate import cosine_min, reference, row_count

LIMIT = 2  # batches of each split


def test_a_bundle_run_anywhere_lines_up_with_the_fp32_reference(tmp_path, capsys):
    built = ensure_text_built()
    kind = kinds.get("text_embedding")
    bundle = gpu_floor.bundle(kind, tmp_path / "bundle", limit=LIMIT)
    out = tmp_path / "out"
    run = gpu_floor.embed(bundle, out, device="cpu", variants=("fp32-fp16-weights", "fp16"))
    assert run["batches"] == {s: LIMIT for s in gpu_floor.SPLITS} and not run["full"]
    for split in gpu_floor.SPLITS:
        batches = kind.eval_batches(split)
        ref = reference(kind, built.fp32, split, batches)[: row_count(batches[:LIMIT])]
        weights_only = np.load(out / f"{split}.fp32-fp16-weights.npy")
        assert weights_only.shape == ref.shape
        # fp16 weights computed in fp32: MiniLM's rounding moves no embedding far; a row out of line would.
        assert cosine_min(weights_only, ref) > 0.999
        assert cosine_min(np.roll(weights_only, 1, axis=0), ref) < 0.99
        assert 0.99 < cosine_min(np.load(out / f"{split}.fp16.npy"), ref) < 1.0
    # torch's fp16 on this CPU lands within the floor slack of the emulation (onnxruntime, the converted graph).
    assert gpu_floor.compare(kind, built.fp32, out) == 0
    table = capsys.readouterr().out
    assert "| test | cosine_min |" in table and "first batches of each split" in table
