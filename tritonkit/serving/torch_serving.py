"""The torch side of the `torch_cuda` backend (backends/torch_cuda/model.py): build a model's torch module from
its config parameters, and merge / split the requests of one execute().

Free of `triton_python_backend_utils`, so the GPU repository builder and the tests import it anywhere.

Config parameters (string values) read by `build_module`:
  architecture   "bert-mean-pooled" (sentence-transformers encoder: BERT → mean pooling → L2 norm) or
                 "efficientnet-lite" (classifier: pixels → logits, softmax probabilities)
  arch_config    bert-mean-pooled: a HF config.json (path relative to the version directory);
                 efficientnet-lite: the architecture name, e.g. "efficientnet-lite0"
  weights        a state dict file relative to the version directory (.safetensors or .pth), or "random"
                 (seeded initialisation: same shapes and kernels as the trained model, outputs meaningless)
  seed           for "random" (default 0)
  precision      "fp16" or "fp32" (default fp16 on a GPU, fp32 on the CPU)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tritonkit.errors import ModuleConfigError
from tritonkit.serving.backend_utils import pad_concat, param

ARCHITECTURES = ("bert-mean-pooled", "efficientnet-lite")
PRECISIONS = {"fp16": "float16", "fp32": "float32"}


def _bert_mean_pooled(arch_config: Path, weights: Path | None):
    """BERT (HF parameter names, so the spec's checkpoint loads as is) → mean pooling → L2 norm, in plain torch:
    attention through torch's SDPA kernels, and no transformers import in the serving process (its import chain
    pulls in packages built against a newer numpy than the Python backend's stub accepts)."""
    import json

    import torch
    from torch import nn

    c = json.loads(Path(arch_config).read_text())
    if c.get("hidden_act", "gelu") != "gelu" or c.get("position_embedding_type", "absolute") != "absolute":
        raise ModuleConfigError("arch_config", f"{arch_config.name}: only absolute positions and exact GELU")
    width, heads, eps = c["hidden_size"], c["num_attention_heads"], c.get("layer_norm_eps", 1e-12)

    def linear(n_in: int, n_out: int) -> nn.Linear:
        return nn.Linear(n_in, n_out)

    def dense_norm(n_in: int) -> nn.Module:
        block = nn.Module()
        block.dense, block.LayerNorm = linear(n_in, width), nn.LayerNorm(width, eps=eps)
        return block

    def layer() -> nn.Module:
        blk = nn.Module()
        blk.attention = nn.Module()
        blk.attention.self = nn.Module()
        for name in ("query", "key", "value"):
            setattr(blk.attention.self, name, linear(width, width))
        blk.attention.output = dense_norm(width)
        blk.intermediate = nn.Module()
        blk.intermediate.dense = linear(width, c["intermediate_size"])
        blk.output = dense_norm(c["intermediate_size"])
        return blk

    class MeanPooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.embeddings = nn.Module()
            self.embeddings.word_embeddings = nn.Embedding(c["vocab_size"], width)
            self.embeddings.position_embeddings = nn.Embedding(c["max_position_embeddings"], width)
            self.embeddings.token_type_embeddings = nn.Embedding(c.get("type_vocab_size", 2), width)
            self.embeddings.LayerNorm = nn.LayerNorm(width, eps=eps)
            self.encoder = nn.Module()
            self.encoder.layer = nn.ModuleList(layer() for _ in range(c["num_hidden_layers"]))
            # Unused by the embedding; kept so the checkpoint loads strictly.
            self.pooler = nn.Module()
            self.pooler.dense = linear(width, width)

        def _split(self, x, batch, length):
            return x.view(batch, length, heads, width // heads).transpose(1, 2)

        def forward(self, input_ids, attention_mask):
            batch, length = input_ids.shape
            emb = self.embeddings
            positions = torch.arange(length, device=input_ids.device)
            # Single sentences: token type 0 everywhere (as the exported graph does).
            x = (emb.word_embeddings(input_ids) + emb.position_embeddings(positions)
                 + emb.token_type_embeddings.weight[0])
            x = emb.LayerNorm(x)
            # Padded keys get the most negative value of the dtype, as HF's extended mask does.
            bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
            for blk in self.encoder.layer:
                att = blk.attention.self
                q, k, v = (self._split(getattr(att, n)(x), batch, length) for n in ("query", "key", "value"))
                a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
                a = a.transpose(1, 2).reshape(batch, length, width)
                x = blk.attention.output.LayerNorm(x + blk.attention.output.dense(a))
                h = nn.functional.gelu(blk.intermediate.dense(x))
                x = blk.output.LayerNorm(x + blk.output.dense(h))
            # Pool and normalise in FP32: FP16 sums over 256 tokens lose digits the embedding keeps.
            hidden = x.float()
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return (nn.functional.normalize(pooled, p=2.0, dim=1),)

    model = MeanPooled()
    if weights is not None:
        # position_ids is a buffer older checkpoints carry; positions are computed here.
        state = {k: v for k, v in _read_state(weights).items() if not k.endswith("position_ids")}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ModuleConfigError("weights", f"{weights.name} does not fit {arch_config.name}: "
                                               f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def _efficientnet_lite(arch: str, weights: Path | None):
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    backbone = EfficientNet.from_name(arch)
    if weights is not None:
        backbone.load_state_dict(_read_state(weights), strict=True)

    class Classifier(torch.nn.Module):
        def __init__(self, backbone):
            super().__init__()
            self.backbone = backbone

        def forward(self, pixels):
            logits = self.backbone(pixels).float()
            return logits, torch.softmax(logits, dim=-1)

    return Classifier(backbone)


def _read_state(path: Path) -> dict:
    import torch

    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(str(path), map_location="cpu", weights_only=True)


def build_module(config: dict, version_dir: Path, device: str = "cpu"):
    """(module in eval mode on `device` at the configured precision, torch dtype of float inputs)."""
    import torch

    arch = param(config, "architecture")
    if arch not in ARCHITECTURES:
        raise ModuleConfigError("architecture", f"{arch!r} is not one of {ARCHITECTURES}")
    arch_config = param(config, "arch_config")
    if not arch_config:
        raise ModuleConfigError("arch_config", "missing")
    weights_ref = param(config, "weights", "random")
    weights = None if weights_ref == "random" else Path(version_dir) / weights_ref
    if weights is not None and not weights.exists():
        raise ModuleConfigError("weights", f"file not found: {weights}")
    precision = param(config, "precision", "fp16" if device.startswith("cuda") else "fp32")
    if precision not in PRECISIONS:
        raise ModuleConfigError("precision", f"{precision!r} is not one of {sorted(PRECISIONS)}")
    if precision == "fp16" and not device.startswith("cuda"):
        raise ModuleConfigError("precision", "fp16 needs a KIND_GPU instance (CPU kernels are FP32)")

    torch.manual_seed(int(param(config, "seed", "0")))
    if arch == "bert-mean-pooled":
        path = Path(version_dir) / arch_config
        if not path.exists():
            raise ModuleConfigError("arch_config", f"file not found: {path}")
        module = _bert_mean_pooled(path, weights)
    else:
        module = _efficientnet_lite(arch_config, weights)
    dtype = getattr(torch, PRECISIONS[precision])
    module = module.eval().to(device=device, dtype=dtype)
    if arch == "efficientnet-lite" and device.startswith("cuda"):
        # cuDNN's convolutions are fastest on NHWC; the input is converted per batch in the backend.
        module = module.to(memory_format=torch.channels_last)
    return module, dtype


class RequestError(ValueError):
    """One request's tensors do not fit the config; it fails alone."""


def check_request(feeds: dict[str, np.ndarray], inputs: list[dict], max_batch_size: int) -> int:
    """Validate one request's arrays against the config inputs (name, dtype, dims); returns its batch size."""
    sizes = set()
    for spec in inputs:
        array = feeds.get(spec["name"])
        if array is None:
            raise RequestError(f"input '{spec['name']}' is missing")
        if array.dtype != spec["dtype"]:
            raise RequestError(f"input '{spec['name']}': dtype {array.dtype} does not match config "
                               f"{np.dtype(spec['dtype'])}")
        dims = spec["dims"]
        if array.ndim != len(dims) + 1:
            raise RequestError(f"input '{spec['name']}': rank {array.ndim} != {len(dims) + 1} (batch + dims {dims})")
        if array.shape[0] > max_batch_size:
            raise RequestError(f"input '{spec['name']}': batch {array.shape[0]} exceeds max_batch_size "
                               f"{max_batch_size}")
        if any(d != -1 and d != s for d, s in zip(dims, array.shape[1:])):
            raise RequestError(f"input '{spec['name']}': shape {list(array.shape[1:])} does not match config "
                               f"dims {dims}")
        sizes.add(array.shape[0])
    if len(sizes) != 1:
        raise RequestError(f"inputs disagree on batch size: {sorted(sizes)}")
    return sizes.pop()


def merge(feeds_list: list[dict[str, np.ndarray]], inputs: list[dict]) -> dict[str, np.ndarray]:
    """Concatenate requests on the batch axis; `ragged` inputs are right-padded with their `pad` value to the
    longest of the group (a non-ragged input whose shapes differ is an error, as in Triton)."""
    merged = {}
    for spec in inputs:
        arrays = [f[spec["name"]] for f in feeds_list]
        merged[spec["name"]] = pad_concat(arrays, spec["name"], spec["ragged"], spec["pad"], RequestError)
    return merged


def split(outputs: list[np.ndarray], rows: list[int]) -> list[list[np.ndarray]]:
    """Per request, its rows of every output (`rows[i]` = request i's batch size, in merge order)."""
    bounds = np.cumsum([0, *rows])
    return [[o[bounds[i]: bounds[i + 1]] for o in outputs] for i in range(len(rows))]
