"""The `text_embedding` spec (models/text_embedding.toml, all-MiniLM-L6-v2) as a module: attributes come from
its kind object (tritonkit.kinds.text.TextEmbedding), then from the kind's module."""

from tritonkit.kinds import text as _kind_module


def __getattr__(name: str):
    from tritonkit import kinds

    model = kinds.get("text_embedding")
    return getattr(model, name) if hasattr(model, name) else getattr(_kind_module, name)
