"""text-classification: any transformers sequence-classification directory served as tokenizer (a text, or a
text pair such as NLI's premise and hypothesis) → classifier (the logits and their scores).

`scores` follow transformers' text-classification pipeline: `problem_type` regression → the logits as they are;
multi_label_classification, or a single logit → sigmoid; otherwise softmax. Labels are the directory's id2label,
written as the scores' `label_filename`, so Triton's classification extension (class_count=k) returns the top k
as "score:index:label". A pair is truncated longest first at the model's max length, as transformers does.

INT8 is judged as a classifier is, on held-out single texts and pairs of the committed eval corpus
(tritonkit.data): top-1 agreement with FP32, every row where FP32 is sure (top-2 margin >= 0.05) agreeing, and the
mean KL divergence of the scores.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from tritonkit import data
from tritonkit.kinds.gates import Target
from tritonkit.kinds.sequence import SequenceKind, activate, long_text

CALIBRATION_ITEMS = 256
EVAL_ITEMS = 768  # per split, every other one a pair
DEFAULT_GATES = {"top1_agreement": 0.98, "top1_agreement_margin0.05": 1.0, "kl_mean": 0.01, "int8_speedup": 1.0}


def probabilities(logits: np.ndarray, activation: str) -> np.ndarray:
    """Per row, what the labels' scores are read as: softmax's distribution; sigmoid's per-label probabilities
    (one logit: [1 - p, p]); a regression's logits through softmax, so rows still have a top label."""
    z = np.asarray(logits, np.float64).reshape(len(logits), -1)
    if activation == "sigmoid":
        p = activate(z, "sigmoid")
        return np.concatenate([1 - p, p], axis=1) if p.shape[1] == 1 else p
    return activate(z, "softmax")


def classifier_agreement(ref: np.ndarray, got: np.ndarray, activation: str) -> dict[str, float]:
    """Top-1 agreement (all rows, and rows where FP32's top-2 margin is >= 0.05 and 0.1) and the mean / max
    divergence of the scores (softmax: KL(P_ref || P_got); sigmoid: per-label Bernoulli KL, averaged)."""
    p, q = probabilities(ref, activation), probabilities(got, activation)
    if len(p) == 0:
        return {"top1_agreement": 1.0, "top1_agreement_margin0.05": 1.0, "top1_agreement_margin0.1": 1.0,
                "kl_mean": 0.0, "kl_max": 0.0, "texts": 0.0}
    same = p.argmax(1) == q.argmax(1)
    eps = 1e-12
    if activation == "sigmoid" and np.asarray(ref).reshape(len(ref), -1).shape[1] > 1:
        kl = (p * (np.log(p + eps) - np.log(q + eps)) + (1 - p) * (np.log(1 - p + eps) - np.log(1 - q + eps))).mean(1)
    else:
        kl = (p * (np.log(p + eps) - np.log(q + eps))).sum(1)
    top2 = np.sort(p, axis=1)[:, -2:] if p.shape[1] > 1 else np.concatenate([np.zeros_like(p), p], axis=1)
    margin = top2[:, 1] - top2[:, 0]
    out = {"top1_agreement": float(same.mean())}
    for m in (0.05, 0.1):
        keep = margin >= m
        out[f"top1_agreement_margin{m}"] = float(same[keep].mean()) if keep.any() else 1.0
        out[f"texts_margin{m}"] = float(keep.sum())
    return {**out, "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "texts": float(len(p))}


class TextClassification(SequenceKind):
    """A sequence classifier: a text or a text pair → labels with scores."""

    OUTPUTS: ClassVar[tuple[str, str]] = ("logits", "scores")
    TEXT_INPUTS: ClassVar[tuple[str, ...]] = ("text", "text_pair")
    OPTIONAL_PAIR = True
    TRUNCATION = "longest_first"
    DEFAULT_GATES = DEFAULT_GATES
    UPPER_GATES = frozenset({"kl_mean"})
    # How far past its bf16 floor INT8 may go where the floor misses a gate (tritonkit.int8.floor): near-tie texts
    # flip top-1 at any reduced precision, as near-tie photos do.
    FLOOR_SLACK: ClassVar[dict[str, float]] = {"top1_agreement": 0.02, "top1_agreement_margin0.05": 0.01,
                                               "kl_mean": 0.005}
    # Never looser, whatever the floor: where FP32 is sure (margin >= 0.1) INT8 agrees on nearly every text.
    CATASTROPHE: ClassVar[tuple[Target, ...]] = (Target("top1_agreement_margin0.1", ">=", 0.99, scale=0.01),)

    @property
    def TARGETS(self) -> list[Target]:
        return [Target("top1_agreement", ">=", self.gate("top1_agreement")),
                # Where FP32 is sure (top-2 score margin >= 0.05) INT8 must agree on every text.
                Target("top1_agreement_margin0.05", ">=", self.gate("top1_agreement_margin0.05"), scale=0.01),
                Target("kl_mean", "<=", self.gate("kl_mean"), scale=0.005)]

    @classmethod
    def activation(cls, config: dict, facts: dict) -> str:
        """transformers' text-classification pipeline's rule for the scores."""
        problem = config.get("problem_type")
        if problem == "regression":
            return "identity"
        if problem == "multi_label_classification" or facts["num_labels"] == 1:
            return "sigmoid"
        return "softmax"

    # -- data ------------------------------------------------------------------------------------------------

    def validation_items(self, point: dict[str, int]) -> list[str | tuple[str, str]]:
        sentences = data.split("validation")
        rows: list[str | tuple[str, str]] = []
        for row in range(point["batch"]):
            i = point["start"] + row
            long = point["seq"] >= 32 and row % 4 >= 2  # a quarter of each: long singles, long pairs
            text = long_text(sentences, i, point["seq"]) if long else sentences[i % len(sentences)]
            rows.append((text, sentences[(i + 7) % len(sentences)]) if row % 2 else text)
        return rows

    def calibration_items(self) -> list[str | tuple[str, str]]:
        sentences = data.split("calibration")
        n = len(sentences)
        items: list[str | tuple[str, str]] = []
        for i in range(CALIBRATION_ITEMS):
            text = long_text(sentences, i, 200) if i % 10 == 9 else sentences[i]
            items.append((text, sentences[(7 * i + 3) % n]) if i % 2 else text)
        return items

    def eval_items(self, split: str) -> list[str | tuple[str, str]]:
        """Held-out texts of every source and length; every other row pairs a text with one of another row (half
        of those of the same source, as a premise and a related hypothesis)."""
        items = data.eval_items(split)
        rng = np.random.default_rng(sum(map(ord, split)) + 1)
        picked = [items[int(j)] for j in rng.choice(len(items), min(EVAL_ITEMS, len(items)), replace=False)]
        rows: list[str | tuple[str, str]] = []
        for k, item in enumerate(picked):
            if k % 2 == 0:
                rows.append(item.text)
                continue
            pool = [t for t in items if (t.source == item.source) == (k % 4 == 1) and t.text != item.text]
            rows.append((item.text, pool[int(rng.integers(len(pool)))].text))
        return rows

    def gate_metrics(self, ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
        return classifier_agreement(ref, got, self.spec.facts.activation)
