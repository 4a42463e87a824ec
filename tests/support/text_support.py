"""Helpers shared by the text-pipeline tests: build artefacts if missing, start a server with the text models."""

from __future__ import annotations

import os
from functools import cache

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import build, paths

TEXT_MODELS = ["text_embedding", "text_embedding_fp32"]

# How far one text's served embedding may move with its batch-mates (packing, kernel blocking): measured by
# test_text_pipeline.test_batching_noise_is_bounded; every served-vs-offline comparison allows this and no more.
BATCHING_NOISE = 2e-5  # 1 - cosine
# The INT8 encoder's packed graph moves more: a text's softmax sums its row in another order when other texts
# share the row, and a last-bit change can cross a uint8 level (tritonkit.kinds.text.write_packed; up to 6e-4
# measured on 96 validation texts). The build proves the packed INT8 graph against the gates, not this bound.
INT8_PACKING_NOISE = 2e-3


@cache
def ensure_built(pipeline: str) -> build.BuildResult:
    """Build `pipeline` (export + validate, INT8 + report) unless up to date; minutes on a fresh 2-core machine. One
    test process at a time (`make test` runs two workers): the other waits, then finds it up to date."""
    import fcntl

    lock = paths.BUILD_OUTPUTS / "cache" / f"{pipeline}-build.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        return build.build(pipeline, progress=False)


def ensure_text_built() -> build.BuildResult:
    return ensure_built("text")


def start_text_server(start_server):
    """The text models as `make serve` serves them on this CPU: the replica view of what its class proved (the
    committed configs name the vnni class's runtimes; an AVX2 CPU serves its own record's, ONNX Runtime)."""
    from tritonkit import kinds

    ensure_text_built()
    return start_server(paths.MODEL_REPOSITORY, model_control_mode="explicit", models=TEXT_MODELS, per_replica=True,
                        replica_kinds=[kinds.get("text_embedding")])


@cache
def st_model():
    from tritonkit import kinds

    minilm = kinds.get("text_embedding")

    return minilm.sentence_transformer()
