"""The `image_classification` spec (models/image_classification.toml, EfficientNet-Lite0) as a module:
attributes come from its kind object (tritonkit.kinds.image.ImageClassification), then from the kind's module."""

from tritonkit.kinds import image as _kind_module


def __getattr__(name: str):
    from tritonkit import kinds

    model = kinds.get("image_classification")
    return getattr(model, name) if hasattr(model, name) else getattr(_kind_module, name)
