"""Build targets → model kinds. Every model is a spec file (models/<name>.toml) read by its kind class
(tritonkit.kinds); `text` and `image` are short aliases of the first two pipelines' specs.

`tritonkit.models.minilm` and `tritonkit.models.efficientnet_lite0` are those two specs seen as modules (their
attributes are the kind object's), kept so older call sites read naturally; they hold no model facts.
"""

from __future__ import annotations

from tritonkit import kinds


def names() -> list[str]:
    return kinds.names()


def get(name: str):
    return kinds.get(name)


def __getattr__(name: str):
    if name == "REGISTRY":  # spec names, for call sites that iterate the registered models
        return {n: n for n in kinds.names()}
    raise AttributeError(name)
