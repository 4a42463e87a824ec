"""text-rerank: a cross-encoder (any transformers sequence-classification directory, as sentence-transformers'
CrossEncoder uses it) served as tokenizer (query, document) → scorer (one logit and its score per pair).

A batch row is one (query, document) pair; a client reranking one query over N documents sends one request of N
rows, and Triton's dynamic batching runs pairs of several requests together. The pair is tokenized query first,
truncating only the document at the model's max length (a query that alone fills it fails its request, naming the
limit). `logit` is the model's raw logit (the `label` column of a multi-logit model), `score` the activation
CrossEncoder applies by default: the directory's own word (config.json `sentence_transformers.activation_fn`), else
sigmoid for one logit and identity otherwise.

INT8 is judged per query on held-out rankings the build makes from the committed eval corpus
(tritonkit.data): each query ranks GROUP documents, half from its own source, half from the others, and INT8's
order must agree with FP32's (Kendall tau, its worst decile of queries, the same top document).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from tritonkit import data
from tritonkit.errors import SourceError
from tritonkit.kinds.gates import Target
from tritonkit.kinds.sequence import SequenceKind, first_words, long_text, st_activation

GROUP = 16  # documents ranked per held-out query; EVAL_BATCH (32) holds whole queries
QUERIES = 64  # held-out queries per split
CALIBRATION_PAIRS = 256
DOCUMENT_KINDS = ("sentence", "passage", "paragraph")
# Gates (a spec's [gates] may only tighten them): INT8's ranking of each query's documents against FP32's.
DEFAULT_GATES = {"kendall_tau_mean": 0.95, "kendall_tau_worst10": 0.8, "top1_agreement": 0.95, "int8_speedup": 1.0}


def kendall_tau(ref: np.ndarray, got: np.ndarray) -> float:
    """Pairs ordered alike minus pairs ordered otherwise, over the pairs FP32 does not tie (1.0: same order)."""
    dr = np.sign(ref[:, None] - ref[None, :])
    dg = np.sign(got[:, None] - got[None, :])
    upper = np.triu(np.ones_like(dr, dtype=bool), 1) & (dr != 0)
    return float((dr * dg)[upper].mean()) if upper.any() else 1.0


def ndcg(ref: np.ndarray, got: np.ndarray, k: int = 10) -> float:
    """NDCG@k of INT8's order, FP32's rank as graded relevance (its top document GROUP - 1, its last 0)."""
    relevance = np.empty(len(ref))
    relevance[np.argsort(-ref, kind="stable")] = np.arange(len(ref))[::-1]
    discount = 1.0 / np.log2(np.arange(2, min(k, len(ref)) + 2))
    ideal = (relevance[np.argsort(-ref, kind="stable")][:k] * discount).sum()
    return float((relevance[np.argsort(-got, kind="stable")][:k] * discount).sum() / max(ideal, 1e-12))


def ranking_agreement(ref: np.ndarray, got: np.ndarray, group: int = GROUP) -> dict[str, float]:
    """Per query (consecutive rows of `group` documents): Kendall tau of INT8's order against FP32's, its mean and
    the mean of the worst decile of queries, NDCG@10 and top-1 agreement. A trailing part-group (the search's
    outlier rows riding along with a sample) is ranked as one more group."""
    ref, got = np.asarray(ref, np.float64).reshape(len(ref), -1)[:, 0], np.asarray(got, np.float64).reshape(
        len(got), -1)[:, 0]
    groups = [slice(i, min(i + group, len(ref))) for i in range(0, len(ref), group) if min(group, len(ref) - i) > 1]
    if not groups:
        return {"kendall_tau_mean": 1.0, "kendall_tau_worst10": 1.0, "top1_agreement": 1.0, "ndcg10_mean": 1.0,
                "queries": 0.0, "pairs": float(len(ref))}
    tau = np.array([kendall_tau(ref[g], got[g]) for g in groups])
    worst = np.sort(tau)[: max(1, len(tau) // 10)]
    return {
        "kendall_tau_mean": float(tau.mean()),
        "kendall_tau_worst10": float(worst.mean()),
        "kendall_tau_min": float(tau.min()),
        "top1_agreement": float(np.mean([ref[g].argmax() == got[g].argmax() for g in groups])),
        "ndcg10_mean": float(np.mean([ndcg(ref[g], got[g]) for g in groups])),
        # How far INT8's logits are off, in FP32's spread: continuous, so the search can rank small steps.
        "logit_nrmse": float(np.sqrt(np.mean((got - ref) ** 2)) / max(float(ref.std()), 1e-12)),
        "queries": float(len(groups)),
        "pairs": float(len(ref)),
    }


def ranking_items(split: str, queries: int = QUERIES, group: int = GROUP) -> list[tuple[str, str]]:
    """Held-out (query, document) rows, `group` consecutive rows per query: half its documents from the query's own
    source, half from the other sources, in a fixed shuffled order (seeded by the split)."""
    items = data.eval_items(split)
    rng = np.random.default_rng(sum(map(ord, split)))
    sources = sorted({t.source for t in items})
    docs = {s: [t.text for t in items if t.source == s and t.kind in DOCUMENT_KINDS] for s in sources}
    by_source = {s: [t.text for t in items if t.source == s and t.kind == "query"] for s in sources}
    chosen: list[tuple[str, str]] = []  # (source, query): sources taken in turn, so every one is asked
    while len(chosen) < queries and any(by_source.values()):
        for s in sources:
            if by_source[s] and len(chosen) < queries:
                chosen.append((s, by_source[s].pop(int(rng.integers(len(by_source[s]))))))
    rows: list[tuple[str, str]] = []
    for source, query in chosen:
        own = [docs[source][int(j)] for j in rng.choice(len(docs[source]), group // 2, replace=False)]
        others = [d for s in sources if s != source for d in docs[s]]
        other = [others[int(j)] for j in rng.choice(len(others), group - len(own), replace=False)]
        mixed = own + other
        rows += [(query, mixed[int(j)]) for j in rng.permutation(len(mixed))]
    return rows


class TextRerank(SequenceKind):
    """A cross-encoder: (query, document) pairs → one logit and score each."""

    OUTPUTS: ClassVar[tuple[str, str]] = ("logit", "score")
    TEXT_INPUTS: ClassVar[tuple[str, ...]] = ("query", "document")
    TRUNCATION = "only_second"
    DEFAULT_GATES = DEFAULT_GATES
    # How far under its bf16 floor INT8 may fall where the floor is below a gate (tritonkit.int8.floor): documents
    # of other sources score alike, and any reduced precision swaps some of those near-ties.
    FLOOR_SLACK: ClassVar[dict[str, float]] = {"kendall_tau_mean": 0.01, "kendall_tau_worst10": 0.05,
                                               "top1_agreement": 0.03}
    # Never looser, whatever the floor: rankings this far off are another model's.
    CATASTROPHE: ClassVar[tuple[Target, ...]] = (Target("kendall_tau_mean", ">=", 0.9),
                                                 Target("top1_agreement", ">=", 0.85))
    PROXY_TARGETS: ClassVar[list[Target]] = [Target("logit_nrmse", "<=", 0.0, scale=0.01)]

    @property
    def TARGETS(self) -> list[Target]:
        return [Target("kendall_tau_mean", ">=", self.gate("kendall_tau_mean")),
                Target("kendall_tau_worst10", ">=", self.gate("kendall_tau_worst10"), scale=0.05),
                Target("top1_agreement", ">=", self.gate("top1_agreement"))]

    @property
    def width(self) -> int:
        return 1

    @property
    def read_label(self) -> int:
        return self.spec.facts.label

    # -- add -------------------------------------------------------------------------------------------------

    @classmethod
    def add_arguments(cls, parser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--label", help="the logit read as the score, by id2label name or index (needed where "
                            "the model has more than one)")

    @classmethod
    def activation(cls, config: dict, facts: dict) -> str:
        """CrossEncoder's default: the directory's own activation, else sigmoid for one logit, identity for more."""
        return st_activation(config) or ("sigmoid" if facts["num_labels"] == 1 else "identity")

    @classmethod
    def source_facts(cls, directory, args) -> dict:
        facts = super().source_facts(directory, args)
        if facts["activation"] == "softmax":
            raise SourceError(f"{directory}: a softmax over labels is not one score per pair; serve it as "
                              "text-classification")
        label = getattr(args, "label", None)
        if label is None:
            if facts["num_labels"] > 1:
                raise SourceError(f"{directory}: {facts['num_labels']} logits ({', '.join(facts['labels'])}); "
                                  "name the one to read with --label")
            facts["label"] = 0
        elif label in facts["labels"]:
            facts["label"] = facts["labels"].index(label)
        elif label.isdigit() and int(label) < facts["num_labels"]:
            facts["label"] = int(label)
        else:
            raise SourceError(f"--label {label}: not one of {', '.join(facts['labels'])} or "
                              f"0..{facts['num_labels'] - 1}")
        return facts

    # -- data ------------------------------------------------------------------------------------------------

    def validation_items(self, point: dict[str, int]) -> list[tuple[str, str]]:
        sentences = data.split("validation")
        rows = []
        for row in range(point["batch"]):
            i = point["start"] + row
            # Every other document is long enough to be cut to the grid point's length.
            doc = long_text(sentences, i + 1, point["seq"]) if row % 2 and point["seq"] >= 32 else \
                sentences[(i + 1) % len(sentences)]
            rows.append((first_words(sentences[i % len(sentences)], point["seq"] // 4), doc))
        return rows

    def calibration_items(self) -> list[tuple[str, str]]:
        sentences = data.split("calibration")
        n = len(sentences)
        # Queries against unrelated sentences and against longer documents, every tenth past the length limit.
        words = [200 if i % 10 == 9 else 8 + 40 * (i % 3) for i in range(CALIBRATION_PAIRS)]
        return [(first_words(sentences[i], self.MAX_LENGTH // 4), long_text(sentences, (7 * i + 3) % n, words[i]))
                for i in range(CALIBRATION_PAIRS)]

    def eval_items(self, split: str) -> list[tuple[str, str]]:
        return [(first_words(q, self.MAX_LENGTH // 4), d) for q, d in ranking_items(split)]

    def speed_item(self, sentences, i: int) -> tuple[str, str]:
        return (first_words(sentences[i], self.MAX_LENGTH // 4), long_text(sentences, i + 1, 60))

    def gate_metrics(self, ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
        return ranking_agreement(ref, got)
