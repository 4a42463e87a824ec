"""What users would run without us, timed like the served models (closed loop, same items, same process run).

- text: sentence-transformers FP32 (the model's own library), one text per call from N threads, and its best case:
  one caller batching N texts per call;
- image: the naive first attempt: plain PIL decode + resize + crop per image, torch FP32 at batch 32.

Benchmarks, the perf lab and the CI ratio gate all compare against these, so a ratio means the same everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from tritonkit.backend_utils import usable_cpus
from tritonkit.perf import PerfPoint, time_in_process

IMAGE_BATCH = 32


def text(texts: Sequence[str], concurrency: int, seconds: float,
         model: str = "text_embedding") -> tuple[PerfPoint, PerfPoint]:
    """(N threads × 1 text per call, 1 thread × N texts per call) with sentence-transformers FP32 on all cores."""
    import torch

    torch.set_num_threads(usable_cpus())
    model = _st_model(model)
    per_text = time_in_process(lambda t: model.encode([t]), texts, concurrency, duration_s=seconds,
                               label="sentence-transformers FP32 (1 text/call)")
    groups = [list(texts[i : i + concurrency]) for i in range(0, len(texts) - concurrency, concurrency)]
    batched = time_in_process(lambda g: model.encode(g, batch_size=len(g)), groups, 1, duration_s=seconds,
                              items_per_call=concurrency,
                              label=f"sentence-transformers FP32 ({concurrency} texts/call)")
    batched.concurrency = concurrency
    return per_text, batched


@cache
def _st_model(name: str):
    from tritonkit import kinds

    return kinds.get(name).sentence_transformer()


def image(images: Sequence[bytes], seconds: float, model: str = "image_classification") -> PerfPoint:
    """PIL full decode + resize + crop per image, the model in torch FP32 at batch 32, all cores."""
    import numpy as np
    import torch

    from tritonkit import imaging, kinds

    torch.set_num_threads(usable_cpus())
    kind = kinds.get(model)
    cfg = kind.PREPROCESS
    model = kind.load_classifier()
    batches = [[images[(i + j) % len(images)] for j in range(IMAGE_BATCH)] for i in range(len(images))]

    def run(batch: list[bytes]):
        x = torch.from_numpy(np.stack([imaging.plain_preprocess(b, cfg) for b in batch]))
        with torch.no_grad():
            return model(x)[1].topk(5)

    return time_in_process(run, batches, concurrency=1, duration_s=seconds, warmup=1,
                           label=f"naive baseline: PIL + torch FP32, batch {IMAGE_BATCH}", items_per_call=IMAGE_BATCH)
