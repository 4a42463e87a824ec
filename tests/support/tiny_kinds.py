"""Tiny random-weight sequence-classification models for the text-rerank and text-classification kinds, built and
served the way a user does it (`python -m tritonkit.add` → `python -m tritonkit.build` → tritonserver).

    from tests.support.tiny_kinds import TINY, build_tiny_kinds, serve_tiny_kinds

    tree = build_tiny_kinds()                                   # once per process (and kept under build/cache)
    server = serve_tiny_kinds(start_server, tree)               # every tiny model, ensemble + _fp32 + _fused
    tree.cross_encoder("tiny_rerank_bert").predict([(q, d)])    # the reference on the same weights

Sources are saved by transformers itself (`AutoModelForSequenceClassification.from_config`, seed 0) with a real
tokenizer of their family: BERT with MiniLM's WordPiece tokenizer, XLM-RoBERTa with MPNet's (both installed with
the project). Function names here are stable: other suites (gateway, client) build on them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from tritonkit import kinds, paths

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARCHITECTURES = ("bert", "xlm-roberta")


@dataclass(frozen=True)
class Tiny:
    """One tiny spec: its kind, the source's architecture and head, and extra `add` arguments."""

    kind: str
    architecture: str
    num_labels: int = 1
    problem_type: str | None = None
    add_args: tuple[str, ...] = ()
    max_length: int = 64


# Spec name → what it is. Two architectures per kind; the classifiers one single-label, one multi-label.
TINY = {
    "tiny_rerank_bert": Tiny("text-rerank", "bert"),
    "tiny_rerank_xlmr": Tiny("text-rerank", "xlm-roberta"),
    "tiny_classify_bert": Tiny("text-classification", "bert", 3, "single_label_classification"),
    "tiny_classify_xlmr": Tiny("text-classification", "xlm-roberta", 4, "multi_label_classification"),
}
LABELS = {3: ["entailment", "neutral", "contradiction"], 4: ["sports", "politics", "science", "arts"]}


def sequence_classifier_dir(path: Path, architecture: str = "bert", num_labels: int = 1,
                            problem_type: str | None = None, max_length: int = 64, hidden: int = 32,
                            labels: list[str] | None = None, activation_fn: str | None = None) -> Path:
    """A tiny random `AutoModelForSequenceClassification` directory (config.json, model.safetensors,
    tokenizer.json) of `architecture` ("bert" or "xlm-roberta"). `activation_fn` (e.g. "torch.nn.Identity") is
    written where sentence-transformers' CrossEncoder reads its activation."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, XLMRobertaConfig

    torch.manual_seed(0)
    labels = labels or LABELS.get(num_labels) or [f"LABEL_{i}" for i in range(num_labels)]
    head = {"num_labels": num_labels, "id2label": dict(enumerate(labels)),
            "label2id": {lab: i for i, lab in enumerate(labels)}, "problem_type": problem_type}
    body = {"hidden_size": hidden, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 2 * hidden}
    if architecture == "bert":
        tok_dir = kinds.get("text_embedding").model_dir()
        config = BertConfig(vocab_size=30522, max_position_embeddings=512, **body, **head)
    elif architecture == "xlm-roberta":  # positions counted from the pad id; MPNet's tokenizer has pad 1
        tok_dir = kinds.get("all_mpnet_base_v2").model_dir()
        config = XLMRobertaConfig(vocab_size=30527, max_position_embeddings=514, pad_token_id=1, bos_token_id=0,
                                  eos_token_id=2, type_vocab_size=1, **body, **head)
    else:
        raise ValueError(f"architecture {architecture!r} (tiny ones: {', '.join(ARCHITECTURES)})")
    if activation_fn:
        config.sentence_transformers = {"activation_fn": activation_fn}
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            # Biases and norms start constant (0, 1), which a trained model's never are and onnxruntime's histogram
            # calibrators cannot bin (a zero range).
            p.add_(0.02 * torch.randn_like(p))
            # Random heads give logits near 0; a wider spread makes rankings and top-1 answers less tied.
            if p.dim() == 2 and p.shape[0] == num_labels:
                p.mul_(8.0)
    model.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(path)
    return path


def scratch_env(root: Path) -> dict[str, str]:
    """Commands whose specs, repository and build outputs live under `root`."""
    return {**os.environ, "TRITONKIT_SPECS": str(root / "models"), "TRITONKIT_MODEL_REPOSITORY": str(root / "repo"),
            "TRITONKIT_BUILD_OUTPUTS": str(root / "build"), "HF_HUB_OFFLINE": "1"}


@dataclass
class TinyTree:
    root: Path
    sources: dict[str, Path]
    logs: dict[str, str] = field(default_factory=dict)

    @property
    def repository(self) -> Path:
        return self.root / "repo"

    @property
    def env(self) -> dict[str, str]:
        return scratch_env(self.root)

    def spec(self, name: str):
        """The built spec's kind object, read from the tree's models/ (facts as `add` wrote them)."""
        from tritonkit.kinds import spec as specs

        return kinds.from_spec(specs.load(self.root / "models" / f"{name}.toml"))

    def cross_encoder(self, name: str):
        """sentence-transformers' CrossEncoder on the source's weights (its default activation)."""
        from sentence_transformers import CrossEncoder

        return CrossEncoder(str(self.sources[name]), device="cpu")

    def transformers(self, name: str):
        """(AutoTokenizer, AutoModelForSequenceClassification) of the source, eval mode."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        src = str(self.sources[name])
        return AutoTokenizer.from_pretrained(src), AutoModelForSequenceClassification.from_pretrained(src).eval()


def run_tool(tree_root: Path, *args: str, timeout: int = 1800) -> str:
    """`python -m <args>` as a user runs it (or `python -c ...` where args start with "-c"), in the tree;
    AssertionError with its output when it fails."""
    argv = list(args) if args[0] == "-c" else ["-m", *args]
    out = subprocess.run([sys.executable, *argv], env=scratch_env(tree_root), cwd=paths.ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{args}: {out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout + out.stderr


BUILD_SERVED = """
from tritonkit import build
result = build.build({name!r}, progress=False, search_if_missing=True, search_budget_s={seconds}, forms=("served",))
for o in result.outcomes:
    print(f"[tiny] {{o.form}} INT8 {{o.status}}: {{o.reason or '; '.join(o.missed)}}")
"""


def served_models(name: str) -> list[str]:
    """The Triton models a tiny spec's clients call: the INT8 ensemble, its FP32 twin and the fused model."""
    return [name, f"{name}_fp32", f"{name}_fused"]


@cache
def build_tiny_kinds(names: tuple[str, ...] = tuple(TINY), root: Path | None = None,
                     budget_minutes: float = 3) -> TinyTree:
    """add + build every tiny spec of `names` under `root` (default build/cache/tiny_kinds, kept between runs: a
    current build is a no-op), one process at a time. `budget_minutes` caps each INT8 search."""
    import fcntl

    root = Path(root or paths.ROOT / "build" / "cache" / "tiny_kinds")
    root.mkdir(parents=True, exist_ok=True)
    tree = TinyTree(root, {})
    with (root / "build.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        for name in names:
            t = TINY[name]
            source = root / "sources" / name
            if not (source / "tokenizer.json").exists():
                sequence_classifier_dir(source, t.architecture, t.num_labels, t.problem_type, t.max_length)
            tree.sources[name] = source
            run_tool(root, "tritonkit.add", t.kind, "--name", name, "--source", str(source), "--max-batch-size", "32",
                     "--force", *t.add_args)
            # `python -m tritonkit.build NAME` less the TensorRT form, which only a GPU serves (`make demo` builds
            # the same): its search on the tiny XLM-R stops in onnxruntime's percentile calibrator.
            tree.logs[name] = run_tool(root, "-c", BUILD_SERVED.format(name=name, seconds=budget_minutes * 60))
    return tree


def serve_tiny_kinds(start_server, tree: TinyTree, names: tuple[str, ...] | None = None):
    """A tritonserver on free loopback ports serving `names`' ensembles, FP32 twins and fused models."""
    models = [m for n in (names or tuple(tree.sources)) for m in served_models(n)]
    return start_server(tree.repository, model_control_mode="explicit", models=models)


MADE_CALLS: list[Path] = []  # where made_classifier wrote, in this process


def made_classifier(target: Path, num_labels: int = 1) -> None:
    """A source maker (spec `[source] make`, tritonkit.kinds.spec.make_source): a tiny random classifier."""
    MADE_CALLS.append(Path(target))
    sequence_classifier_dir(Path(target), num_labels=num_labels)


# -- references on the same weights (the client and gateway suites share them) --------------------------------

# fp32 ONNX Runtime against fp32 torch on the same weights: the tiny models' logits (about 0.1, spread ~1e-4 over
# documents: random weights barely tell texts apart) moved 3e-8 here; kernel order elsewhere may move them more.
LOGIT_TOL = 2e-6
# Triton's classification extension prints a score with 6 decimals.
PRINTED_TOL = LOGIT_TOL + 5e-7

_REFERENCES: dict[tuple, tuple] = {}


def rerank_reference(tree: TinyTree, name: str, query: str, documents):
    """(CrossEncoder's scores, transformers' logits, token counts) of each (query, document) pair, float64."""
    key = ("rerank", tree.root, name, query, tuple(documents))
    if key not in _REFERENCES:
        _REFERENCES[key] = _rerank_reference(tree, name, query, list(documents))
    return _REFERENCES[key]


def _rerank_reference(tree: TinyTree, name: str, query: str, documents: list[str]):
    import numpy as np
    import torch

    scores = np.asarray(tree.cross_encoder(name).predict([(query, d) for d in documents]), np.float64).reshape(-1)
    tokenizer, model = tree.transformers(name)
    enc = tokenizer([query] * len(documents), documents, padding=True, truncation="only_second",
                    max_length=TINY[name].max_length, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits[:, 0].numpy().astype(np.float64)
    return scores, logits, enc["attention_mask"].sum(1).numpy()


def classify_reference(tree: TinyTree, name: str, texts, pairs=None):
    """(label names, softmax probabilities, logits, token counts) by transformers, with the pair truncation the
    server uses."""
    key = ("classify", tree.root, name, tuple(texts), None if pairs is None else tuple(pairs))
    if key not in _REFERENCES:
        _REFERENCES[key] = _classify_reference(tree, name, list(texts), None if pairs is None else list(pairs))
    return _REFERENCES[key]


def _classify_reference(tree: TinyTree, name: str, texts: list[str], pairs: list[str] | None):
    import numpy as np
    import torch

    tokenizer, model = tree.transformers(name)
    enc = tokenizer(texts, pairs, padding=True, truncation=True, max_length=TINY[name].max_length,
                    return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits.numpy().astype(np.float64)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    labels = [model.config.id2label[i] for i in range(logits.shape[1])]
    return labels, probs / probs.sum(1, keepdims=True), logits, enc["attention_mask"].sum(1).numpy()


def assert_best_first(indices: list[int], reference, tol: float) -> None:
    """Each next index is no better than the one before by the reference (within its tolerance)."""
    import itertools

    assert sorted(indices) == sorted(set(indices))
    for a, b in itertools.pairwise(indices):
        assert reference[a] >= reference[b] - tol, (indices, reference)


def single_text_variant(repository: Path, model: str, dest: Path) -> str:
    """Write `<model>_single` into the model repository `dest`: `model`'s ensemble config less its optional
    `text_pair` input, so a classifier that takes single texts only, served by the same tokenizer and classifier
    (no text-classification spec makes one; the clients and gateway still must refuse pairs for it). Its name."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig()
    text_format.Parse((Path(repository) / model / "config.pbtxt").read_text(), config)
    config.name = f"{model}_single"
    inputs = [t for t in config.input if t.name != "text_pair"]
    del config.input[:]
    config.input.extend(inputs)
    for step in config.ensemble_scheduling.step:
        step.input_map.pop("text_pair", None)
    (Path(dest) / config.name / "1").mkdir(parents=True, exist_ok=True)  # an ensemble's (empty) version folder
    (Path(dest) / config.name / "config.pbtxt").write_text(text_format.MessageToString(config))
    return config.name
