"""Helpers shared by the text-pipeline tests: build artefacts if missing, start a server with the text models."""

from __future__ import annotations

import os
from functools import cache

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import build, paths

TEXT_MODELS = ["text_embedding", "text_embedding_fp32"]


@cache
def ensure_text_built() -> build.BuildResult:
    """Build (export + validate, INT8 + report) unless up to date; minutes on a fresh 2-core machine."""
    return build.build("text", progress=False)


def start_text_server(start_server):
    ensure_text_built()
    return start_server(paths.MODEL_REPOSITORY, model_control_mode="explicit", models=TEXT_MODELS)


@cache
def st_model():
    from tritonkit.models import minilm

    return minilm.sentence_transformer()
