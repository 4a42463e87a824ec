"""Model kinds: one class per kind holds the behaviour every model of that kind shares (loading, export,
calibration and evaluation data, metrics, INT8 gates, generated configs); a model is a spec file (tritonkit.kinds.spec).

    from tritonkit import kinds
    model = kinds.get("text_embedding")     # models/text_embedding.toml → TextEmbedding

A new model of a known kind needs no Python: `python -m tritonkit.add <kind> --name NAME --source ...`.
Kind modules are imported lazily, so the text stack never imports the image stack.
"""

from __future__ import annotations

import importlib
from functools import cache
from pathlib import Path

from tritonkit.kinds import spec as specs

KIND_CLASSES = {
    "text-embedding": "tritonkit.kinds.text:TextEmbedding",
    "image-classification": "tritonkit.kinds.image:ImageClassification",
    "text-rerank": "tritonkit.kinds.rerank:TextRerank",
    "text-classification": "tritonkit.kinds.classification:TextClassification",
}
# Build targets of the first two pipelines, kept as short aliases.
ALIASES = {"text": "text_embedding", "image": "image_classification"}


def kind_class(kind: str):
    module, cls = KIND_CLASSES[kind].split(":")
    return getattr(importlib.import_module(module), cls)


def names(directory: Path = specs.SPECS_DIR) -> list[str]:
    return list(specs.discover(directory))


@cache
def get(name: str, directory: Path = specs.SPECS_DIR):
    name = ALIASES.get(name, name)
    found = specs.discover(directory)
    if name not in found:
        raise KeyError(f"unknown model '{name}' (specs in {directory.name}/: {', '.join(found) or 'none'}; add "
                       f"one with `python -m tritonkit.add`)")
    return from_spec(specs.load(found[name]))


def from_spec(spec: specs.Spec):
    return kind_class(spec.kind)(spec)
