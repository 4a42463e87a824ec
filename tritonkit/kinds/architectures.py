"""Transformer families a text-embedding model may use: one short class each over shared behaviour, and the
reader that takes a sentence-transformers directory's facts (modules.json, pooling, max length, width).

To support another family, add a class here with its `model_types` and how its forward is called; everything
else (pooling, export, INT8, configs) is shared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tritonkit.errors import SourceError
from tritonkit.kinds.spec import POOLINGS


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]
    # BERT-style encoders take segment ids; the graph makes them (all zeros for one text) so clients never send
    # them.
    token_type_ids: bool = False

    def forward(self, transformer, input_ids, attention_mask):
        import torch

        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.token_type_ids:
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)
        return transformer(**kwargs).last_hidden_state

    def prepare(self, transformer) -> None:
        """Make the loaded transformer export to plain ONNX; nothing to do for most families."""


def _mpnet_bucket(relative_position, num_buckets=32, max_distance=128):
    """MPNet's relative-position bucket with log() taken only where it is used: the original also takes
    log(0) = -inf for near positions and casts it to int64, which ONNX Runtime turns into a huge negative index."""
    import math

    import torch

    num_buckets //= 2
    n = -relative_position
    ret = (n < 0).to(torch.long) * num_buckets
    n = torch.abs(n)
    max_exact = num_buckets // 2
    large = n.clamp(min=max_exact).float()
    val_if_large = max_exact + (torch.log(large / max_exact) / math.log(max_distance / max_exact)
                                * (num_buckets - max_exact)).to(torch.long)
    val_if_large = torch.clamp(val_if_large, max=num_buckets - 1)
    return ret + torch.where(n < max_exact, n, val_if_large)


@dataclass(frozen=True)
class MPNetArchitecture(Architecture):
    def prepare(self, transformer) -> None:
        transformer.encoder.relative_position_bucket = _mpnet_bucket


BERT = Architecture("bert", ("bert",), token_type_ids=True)
MPNET = MPNetArchitecture("mpnet", ("mpnet",))
ROBERTA = Architecture("roberta", ("roberta", "xlm-roberta"))
DISTILBERT = Architecture("distilbert", ("distilbert",))
ARCHITECTURES = {a.name: a for a in (BERT, MPNET, ROBERTA, DISTILBERT)}


def get(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise SourceError(f"architecture '{name}' is not supported (supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[name]


def for_model_type(model_type: str) -> Architecture:
    for arch in ARCHITECTURES.values():
        if model_type in arch.model_types:
            return arch
    known = sorted(t for a in ARCHITECTURES.values() for t in a.model_types)
    raise SourceError(f"config.json model_type '{model_type}' is not supported (supported: {', '.join(known)})")


# sentence-transformers Pooling config flag → our pooling name
_POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
}
# sentence-transformers >= 6 writes one string instead of the flags
_POOLING_NAMES = {"mean": "mean", "cls": "cls", "max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len",
                  "mean_sqrt_len": "mean_sqrt_len"}
# Module classes by name: the import path in modules.json moved between sentence-transformers releases.
_SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")


def _read_json(path: Path, what: str) -> dict | list:
    if not path.exists():
        raise SourceError(f"{path.parent}: {path.name} is missing ({what})")
    return json.loads(path.read_text())


def inspect_directory(directory: Path) -> dict:
    """The facts a text-embedding spec needs, read from a sentence-transformers directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SourceError(f"{directory}: not a directory")
    modules = _read_json(directory / "modules.json", "sentence-transformers module list")
    types = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    unsupported = [m.get("type") for m, t in zip(modules, types) if t not in _SUPPORTED_MODULES]
    if unsupported:
        raise SourceError(f"{directory}: module {unsupported[0]} in modules.json is not supported (supported: "
                          f"{', '.join(_SUPPORTED_MODULES)})")
    if not types or types[0] != "Transformer":
        raise SourceError(f"{directory}: modules.json must start with a Transformer module")
    pooling_dirs = [m.get("path", "") for m, t in zip(modules, types) if t == "Pooling"]
    if len(pooling_dirs) != 1:
        raise SourceError(f"{directory}: modules.json needs exactly one Pooling module (found {len(pooling_dirs)})")
    pooling_cfg = _read_json(directory / pooling_dirs[0] / "config.json", "pooling config")
    if isinstance(pooling_cfg.get("pooling_mode"), str):
        mode = pooling_cfg["pooling_mode"]
        modes, other = ([_POOLING_NAMES[mode]], []) if mode in _POOLING_NAMES else ([], [mode])
    else:
        modes = [name for flag, name in _POOLING_FLAGS.items() if pooling_cfg.get(flag)]
        other = [k for k, v in pooling_cfg.items() if k.startswith("pooling_mode") and v and k not in _POOLING_FLAGS]
    if other or len(modes) != 1:
        raise SourceError(f"{directory}: pooling {other or modes or 'none'} is not supported (exactly one of "
                          f"{', '.join(POOLINGS)})")
    if not (directory / "tokenizer.json").exists():
        raise SourceError(f"{directory}: tokenizer.json is missing (a fast tokenizer file is needed; save the "
                          "model with a `tokenizers`-backed tokenizer)")
    config = _read_json(directory / "config.json", "transformer config")
    arch = for_model_type(config.get("model_type", "?"))
    if not any((directory / f).exists() for f in ("model.safetensors", "pytorch_model.bin")):
        raise SourceError(f"{directory}: no model.safetensors or pytorch_model.bin")
    st_config = directory / "sentence_bert_config.json"
    max_length = json.loads(st_config.read_text()).get("max_seq_length") if st_config.exists() else None
    tok_config = directory / "tokenizer_config.json"
    tok = json.loads(tok_config.read_text()) if tok_config.exists() else {}
    max_length = int(max_length or min(tok.get("model_max_length", 512), config.get("max_position_embeddings", 512)))
    return {
        "architecture": arch.name,
        "max_length": max_length,
        "dim": int(pooling_cfg.get("word_embedding_dimension") or pooling_cfg.get("embedding_dimension")
                   or config["hidden_size"]),
        "pooling": modes[0],
        "normalize": "Normalize" in types,
        "pad_id": _pad_id(directory, tok),
    }


def _pad_id(directory: Path, tok_config: dict) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    token = tok_config.get("pad_token")
    if isinstance(token, dict):
        token = token.get("content")
    pid = tok.token_to_id(token) if token else None
    return int(pid if pid is not None else 0)


def pooled_encoder(directory: Path, arch: Architecture, pooling: str, normalize: bool):
    """One torch module: ids, mask → pooled (and L2-normalised if the directory says so) embedding."""
    import torch
    from transformers import AutoModel

    transformer = AutoModel.from_pretrained(str(directory), attn_implementation="eager")
    arch.prepare(transformer)

    class PooledEncoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = transformer

        def forward(self, input_ids, attention_mask):
            hidden = arch.forward(self.transformer, input_ids, attention_mask)
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            if pooling == "cls":
                pooled = hidden[:, 0]
            elif pooling == "max":
                pooled = (hidden + (mask - 1.0) * 1e9).max(1).values
            else:
                total = (hidden * mask).sum(1)
                count = mask.sum(1).clamp(min=1e-9)
                pooled = total / (count.sqrt() if pooling == "mean_sqrt_len" else count)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1) if normalize else pooled

    return PooledEncoder().eval()
