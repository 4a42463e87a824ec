"""What text-rerank and text-classification share: a transformers sequence-classification directory
(`AutoModelForSequenceClassification`: config.json, weights, tokenizer.json) served as tokenizer (one text or a
pair) → a graph that returns the logits and the scores after the model's activation.

The exported graph takes input_ids, attention_mask and, where the model reads segment ids (BERT's
token_type_ids), token_type_ids, so a pair's second text is embedded as the model was trained. Its first output is
the logits: the INT8 search (tritonkit.int8) judges a candidate by each kind's gate metrics over them. The export is
validated against transformers run on transformers' own tokenization of the same texts (its `AutoTokenizer`, the
truncation the server uses), not on our token ids. Each kind (tritonkit.kinds.rerank, tritonkit.kinds.classification)
says which texts form its pairs, how its activation is read from the directory, and its gates.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from functools import cache, cached_property
from pathlib import Path
from typing import ClassVar

import numpy as np

from tritonkit import data
from tritonkit.errors import SourceError
from tritonkit.export import ExportSample, ExportSpec
from tritonkit.kinds import architectures
from tritonkit.kinds.base import TransformerKind
from tritonkit.serving.textproc import pad

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Families whose positions start after the pad id (RoBERTa's create_position_ids_from_input_ids): pad id + 1 of
# max_position_embeddings are not usable.
POSITION_OFFSET_TYPES = ("roberta", "xlm-roberta", "mpnet", "camembert")
VALIDATION_BATCHES = (1, 8, 33)
VALIDATION_LENGTHS = (16, 64, 128)
CALIBRATION_ITEMS = 256
CALIBRATION_BATCH = 16
EVAL_BATCH = 32
SPEED_WORDS = 60  # a benchmark document's length: a typical passage


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """The served `scores` of `logits` [n, labels] (float64 math, as the metrics use it)."""
    z = np.asarray(logits, np.float64)
    return {"sigmoid": sigmoid, "softmax": softmax, "identity": lambda x: x}[activation](z)


def long_text(sentences: Sequence[str], i: int, min_words: int) -> str:
    """Consecutive real sentences joined until the text has `min_words` words: a document past the length limit."""
    parts, j = [], i
    while sum(len(p.split()) for p in parts) < min_words:
        parts.append(sentences[j % len(sentences)])
        j += 1
    return " ".join(parts)


def first_words(text: str, words: int) -> str:
    """A query-length text: the first `words` words (a query must leave the document room, truncation only_second)."""
    return " ".join(text.split()[: max(1, words)])


# -- reading a directory (python -m tritonkit.add) --------------------------------------------------------------

def _read_json(path: Path, what: str) -> dict:
    if not path.exists():
        raise SourceError(f"{path.parent}: {path.name} is missing ({what})")
    return json.loads(path.read_text())


def st_activation(config: dict) -> str | None:
    """The activation sentence-transformers' CrossEncoder applies by the directory's own word (config.json's
    `sentence_transformers.activation_fn`, or `sbert_ce_default_activation_function` before v4), as our name;
    None where the directory says nothing. Raises SourceError for one we cannot serve."""
    path = (config.get("sentence_transformers") or {}).get("activation_fn") or \
        config.get("sbert_ce_default_activation_function")
    if not path:
        return None
    name = str(path).rsplit(".", 1)[-1]
    known = {"Sigmoid": "sigmoid", "Identity": "identity", "Softmax": "softmax"}
    # CrossEncoder trusts only torch's own classes without trust_remote_code; it falls back to its default.
    if not str(path).startswith("torch."):
        return None
    if name not in known:
        raise SourceError(f"config.json: activation {path} is not supported (supported: torch.nn.Sigmoid, "
                          "torch.nn.Identity, torch.nn.Softmax)")
    return known[name]


def inspect_directory(directory: Path) -> tuple[dict, dict]:
    """(facts every sequence-classification spec needs, config.json) of a transformers directory; SourceError
    names what makes it unservable."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SourceError(f"{directory}: not a directory")
    config = _read_json(directory / "config.json", "transformers config")
    model_type = config.get("model_type", "?")
    arch = architectures.for_model_type(model_type)
    if not (directory / "tokenizer.json").exists():
        raise SourceError(f"{directory}: tokenizer.json is missing (a fast tokenizer file is needed; save the "
                          "model with a `tokenizers`-backed tokenizer)")
    if not any((directory / f).exists() for f in ("model.safetensors", "pytorch_model.bin")):
        raise SourceError(f"{directory}: no model.safetensors or pytorch_model.bin")
    id2label = config.get("id2label") or {}
    num_labels = int(len(id2label) or config.get("num_labels", 2))
    labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels)]
    if any(not lab.strip() or "\n" in lab for lab in labels):
        raise SourceError(f"{directory}: config.json id2label has an empty or multi-line label")
    tok_config = directory / "tokenizer_config.json"
    tok = json.loads(tok_config.read_text()) if tok_config.exists() else {}
    positions = int(config.get("max_position_embeddings", 512))
    if model_type in POSITION_OFFSET_TYPES:
        positions -= int(config.get("pad_token_id", 1)) + 1
    declared = tok.get("model_max_length")
    max_length = min(int(declared), positions) if isinstance(declared, int | float) and declared < 1e6 else positions
    facts = {
        "architecture": arch.name,
        "max_length": int(max_length),
        "num_labels": num_labels,
        "labels": labels,
        "segment_ids": int(config.get("type_vocab_size", 0) or 0) > 1,
        "pad_id": architectures._pad_id(directory, tok),
    }
    return facts, config


# -- the exported module ---------------------------------------------------------------------------------------

def scoring_module(directory: Path, arch: architectures.Architecture, activation: str, label: int | None,
                   segment_ids: bool):
    """forward(input_ids, attention_mask[, token_type_ids]) → (logits, scores): the classifier's logits (the one
    column `label` where given) and the activation's scores, in one torch module (eager attention)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(directory), attn_implementation="eager")
    arch.prepare(model.base_model)

    class Scorer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
            if segment_ids:
                kwargs["token_type_ids"] = token_type_ids
            logits = self.model(**kwargs).logits
            if label is not None:
                logits = logits[:, label : label + 1]
            if activation == "sigmoid":
                scores = torch.sigmoid(logits)
            elif activation == "softmax":
                scores = torch.softmax(logits, dim=-1)
            else:
                scores = logits + 0.0  # a graph output of its own, not an alias of the logits
            return logits, scores

    return Scorer().eval()


class SequenceKind(TransformerKind):
    """The shared half of the two kinds; a subclass sets OUTPUTS, TEXT_INPUTS, TRUNCATION and its data and gates."""

    WEIGHT_OPS = ("MatMul", "Gemm")
    SEARCH_PRIOR: ClassVar[dict] = {"form": "uint8", "placement": "inputs", "calibrate_method": "minmax"}
    SEARCH_PRIOR_FLOAT: ClassVar[tuple[str, ...]] = ("family:activation-matmul",)
    SPEED_BATCHES = (1, 8, 32)
    DATA_FILES = (data.EVAL_CORPUS,)
    OUTPUTS: ClassVar[tuple[str, str]] = ("logits", "scores")
    # The served text inputs (BYTES, dims [1]): one text, or a pair (the second optional where OPTIONAL_PAIR).
    TEXT_INPUTS: ClassVar[tuple[str, ...]] = ("text",)
    OPTIONAL_PAIR = False
    TRUNCATION = "longest_first"  # of a pair (tritonkit.serving.textproc)

    def __init__(self, spec):
        super().__init__(spec)
        self.MAX_LENGTH = spec.facts.max_length
        self.SERVE_THREADS = spec.serving.model_threads

    @property
    def INPUTS(self) -> tuple[str, ...]:
        return ("input_ids", "attention_mask", *(("token_type_ids",) if self.spec.facts.segment_ids else ()))

    @property
    def width(self) -> int:
        """Columns of the served logits and scores."""
        return self.spec.facts.num_labels

    @property
    def read_label(self) -> int | None:
        """The one logit column a kind serves (rerank), or None: all of them."""
        return None

    # -- source ------------------------------------------------------------------------------------------

    @cache  # noqa: B019 - one tokenizer per (kind object, length); kinds live for the process
    def _tokenizer(self, max_length: int):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(self.tokenizer_file()))
        tok.no_padding()
        tok.enable_truncation(max_length=max_length, strategy=self.TRUNCATION)
        return tok

    def encode_items(self, items: Sequence[str | tuple[str, str]], max_length: int | None = None
                     ) -> dict[str, np.ndarray]:
        """Feeds of the graph for texts or (first, second) pairs, padded with the pad id as served."""
        encodings = self._tokenizer(max_length or self.MAX_LENGTH).encode_batch(list(items))
        ids, mask = pad(encodings, self.spec.facts.pad_id)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self.spec.facts.segment_ids:
            from tritonkit.serving.textproc import pad_types

            feeds["token_type_ids"] = pad_types(encodings)
        return feeds

    def load_scorer(self):
        f = self.spec.facts
        return scoring_module(self.model_dir(), self.architecture, f.activation, self.read_label, f.segment_ids)

    # -- export ------------------------------------------------------------------------------------------

    def validation_items(self, point: dict[str, int]) -> list[str | tuple[str, str]]:
        """A grid point's rows: the kind's pairs (or texts), every other one long enough to be truncated."""
        raise NotImplementedError

    def _grid(self) -> list[dict[str, int]]:
        grid, start = [], 0
        for seq in [s for s in VALIDATION_LENGTHS if s < self.MAX_LENGTH] + [self.MAX_LENGTH]:
            for batch in VALIDATION_BATCHES:
                grid.append({"batch": batch, "seq": seq, "start": start})
                start += batch
        return grid

    def _sample(self, point) -> ExportSample:
        items = self.validation_items(point)
        return ExportSample(feeds=self.encode_items(items, point["seq"]), labels=[" | ".join(i) if isinstance(i, tuple)
                                                                                  else i for i in items], context=point)

    @cache  # noqa: B019
    def _hf(self):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(str(self.model_dir()), attn_implementation="eager")
        return AutoTokenizer.from_pretrained(str(self.model_dir())), model.eval()

    def hf_logits(self, items: Sequence[str | tuple[str, str]], max_length: int | None = None) -> np.ndarray:
        """transformers on its own tokenization of `items` (the served truncation), the logits the kind serves."""
        import torch

        tokenizer, model = self._hf()
        out = np.zeros((len(items), self.width if self.read_label is None else 1), np.float32)
        for pairs in (True, False):
            rows = [i for i, item in enumerate(items) if isinstance(item, tuple) == pairs]
            if not rows:
                continue
            args = ([items[i][0] for i in rows], [items[i][1] for i in rows]) if pairs else ([items[i] for i in rows],)
            enc = tokenizer(*args, padding=True, truncation=self.TRUNCATION if pairs else True,
                            max_length=max_length or self.MAX_LENGTH, return_tensors="pt")
            with torch.no_grad():
                logits = model(**enc).logits.numpy()
            out[rows] = logits if self.read_label is None else logits[:, self.read_label : self.read_label + 1]
        return out

    def _reference(self, sample: ExportSample) -> np.ndarray:
        return self.hf_logits(self.validation_items(sample.context), sample.context["seq"])

    @cached_property
    def EXPORT(self) -> ExportSpec:
        axes = {0: "batch", 1: "sequence"}
        return ExportSpec(
            name=self.spec.name,
            loader=self.load_scorer,
            inputs={name: axes for name in self.INPUTS},
            outputs={name: {0: "batch"} for name in self.OUTPUTS},
            sample_inputs=self._sample,
            validation_grid=self._grid(),
            opset=17,
            metric="max_abs",
            # Logits of a trained classifier span about ±10; fp32 kernel order moves them by ~1e-5.
            tolerance=2e-3,
            compare_output=self.OUTPUTS[0],
            reference=self._reference,
        )

    # -- INT8 data ---------------------------------------------------------------------------------------

    def calibration_items(self) -> list[str | tuple[str, str]]:
        raise NotImplementedError

    def eval_items(self, split: str) -> list[str | tuple[str, str]]:
        """A held-out split's rows in the order eval_batches runs them (its gate metrics read that order)."""
        raise NotImplementedError

    def calibration_batches(self) -> Iterable[dict[str, np.ndarray]]:
        items = self.calibration_items()
        for start in range(0, len(items), CALIBRATION_BATCH):
            yield self.encode_items(items[start : start + CALIBRATION_BATCH])

    def calibration_batch_count(self) -> int:
        return -(-len(self.calibration_items()) // CALIBRATION_BATCH)

    @cache  # noqa: B019
    def eval_batches(self, split: str) -> list[dict[str, np.ndarray]]:
        items = self.eval_items(split)
        return [self.encode_items(items[i : i + EVAL_BATCH]) for i in range(0, len(items), EVAL_BATCH)]

    def speed_feeds(self, batch: int) -> dict[str, np.ndarray]:
        """`batch` rows of the kind's served shape: benchmark sentences paired with passage-length documents."""
        sentences = data.split("benchmark")
        return self.encode_items([self.speed_item(sentences, i) for i in range(batch)])

    def speed_item(self, sentences: Sequence[str], i: int) -> str | tuple[str, str]:
        return (sentences[i], long_text(sentences, i + 1, SPEED_WORDS))

    # -- served model repository ------------------------------------------------------------------------

    def write_labels(self, path: Path) -> Path:
        """One label per line, line i = logit i: Triton's `label_filename` format."""
        f = self.spec.facts
        labels = f.labels or [f"LABEL_{i}" for i in range(f.num_labels)]
        if self.read_label is not None:
            labels = [labels[self.read_label]]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(labels) + "\n")
        return path

    def write_assets(self, model_repository: Path) -> list[Path]:
        """The tokenizer file beside the preprocessor's config (the fused model reads it there), the labels file
        beside every model that serves the scores."""
        import shutil

        repo = Path(model_repository)
        target = repo / self.PREPROCESSOR / "tokenizer.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.tokenizer_file(), target)
        fused = [f"{self.NAME}_fused"] if self.spec.serving.fused else []
        return [target, *(self.write_labels(repo / m / "labels.txt") for m in (self.FP32_MODEL, self.INT8_MODEL,
                                                                                 *fused))]

    # -- python -m tritonkit.add ------------------------------------------------------------------------

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument("--source", required=True, help="transformers sequence-classification directory "
                            "(config.json, weights, tokenizer.json)")
        parser.add_argument("--max-length", type=int, help="tokens per text or pair (default: the model's)")

    @classmethod
    def activation(cls, config: dict, facts: dict) -> str:
        """The served activation of a directory's logits."""
        raise NotImplementedError

    @classmethod
    def source_facts(cls, directory: Path, args) -> dict:
        """The spec's [model] table of a directory (SourceError: why it cannot be served)."""
        facts, config = inspect_directory(directory)
        if getattr(args, "max_length", None):
            if not 1 <= args.max_length <= facts["max_length"]:
                raise SourceError(f"--max-length {args.max_length}: outside 1..{facts['max_length']} (the model's)")
            facts["max_length"] = args.max_length
        facts["activation"] = cls.activation(config, facts)
        return facts
