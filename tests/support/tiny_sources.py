"""Small, randomly initialised model sources in the shapes users bring: a sentence-transformers directory
(any supported architecture, any pooling, with or without Normalize) and an image classifier loader file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tritonkit import kinds


def sentence_transformers_dir(path: Path, architecture: str = "bert", pooling: str = "cls",
                              normalize: bool = False, max_length: int = 64, hidden: int = 32) -> Path:
    """A tiny random encoder saved by sentence-transformers itself, with a real tokenizer of that family."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st_models
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertModel,
        DistilBertConfig,
        DistilBertModel,
        MPNetConfig,
        MPNetModel,
        RobertaConfig,
        RobertaModel,
    )

    torch.manual_seed(0)
    if architecture == "bert":
        tok_dir = kinds.get("text_embedding").model_dir()
        config = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=2 * hidden, max_position_embeddings=512)
        model = BertModel(config)
    elif architecture == "distilbert":  # BERT's WordPiece vocabulary, no segment ids
        tok_dir = kinds.get("text_embedding").model_dir()
        config = DistilBertConfig(vocab_size=30522, dim=hidden, n_layers=2, n_heads=2, hidden_dim=2 * hidden,
                                  max_position_embeddings=512)
        model = DistilBertModel(config)
    elif architecture == "roberta":  # positions counted from the pad id, as RoBERTa's own (MPNet's tokenizer: pad 1)
        tok_dir = kinds.get("all_mpnet_base_v2").model_dir()
        config = RobertaConfig(vocab_size=30527, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=2 * hidden, max_position_embeddings=514, pad_token_id=1)
        model = RobertaModel(config)
    elif architecture == "mpnet":
        tok_dir = kinds.get("all_mpnet_base_v2").model_dir()
        config = MPNetConfig(vocab_size=30527, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=2 * hidden, max_position_embeddings=514)
        model = MPNetModel(config)
    else:
        raise ValueError(architecture)
    raw = path.parent / f"{path.name}-transformer"
    model.save_pretrained(raw)
    AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(raw)
    transformer = st_models.Transformer(str(raw), max_seq_length=max_length)
    modes = {"mean": "mean", "cls": "cls", "max": "max", "mean_sqrt_len": "mean_sqrt_len_tokens"}
    modules = [transformer, st_models.Pooling(hidden, pooling_mode=modes[pooling])]
    if normalize:
        modules.append(st_models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    shutil.rmtree(raw)
    return path


def break_pooling(path: Path, mode: str) -> None:
    """Turn the pooling config into a mode the project does not support (e.g. weightedmean)."""
    cfg = path / "1_Pooling" / "config.json"
    data = json.loads(cfg.read_text())
    data["pooling_mode"] = mode
    cfg.write_text(json.dumps(data))


CLASSIFIER = '''
import torch


class Tiny(torch.nn.Module):
    """A small random conv classifier: any input size, 10 classes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU6(),
            torch.nn.Conv2d(16, 16, 3, stride=1, padding=1, groups=16), torch.nn.ReLU6(),
            torch.nn.Conv2d(16, 32, 1), torch.nn.ReLU6(),
            torch.nn.Conv2d(32, 32, 3, stride=2, padding=1), torch.nn.ReLU6())
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def load():
    return Tiny().eval()
'''


def classifier_loader(directory: Path) -> str:
    """Writes a loader file; returns the spec's loader string for it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiny_classifier.py").write_text(CLASSIFIER)
    (directory / "labels.txt").write_text("\n".join(f"class {i}" for i in range(10)) + "\n")
    return f"{directory / 'tiny_classifier.py'}:load"


def scratch_env(root: Path) -> dict[str, str]:
    """The environment of a user's commands whose specs, repository and build outputs live under `root`."""
    import os

    return {**os.environ, "TRITONKIT_SPECS": str(root / "models"), "TRITONKIT_MODEL_REPOSITORY": str(root / "repo"),
            "TRITONKIT_BUILD_OUTPUTS": str(root / "build")}
