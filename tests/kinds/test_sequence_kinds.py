"""text-rerank and text-classification without a server: what `add` reads from a directory, the refusals that
name the problem, the spec rules, the generated layout and the INT8 gate metrics (checked by their own rule)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.tiny_kinds import sequence_classifier_dir
from tritonkit import add, kinds
from tritonkit.kinds import spec as specs
from tritonkit.kinds.classification import classifier_agreement
from tritonkit.kinds.rerank import GROUP, ranking_agreement, ranking_items


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence_sources")
    return {
        "ce_bert": sequence_classifier_dir(root / "ce_bert", "bert", 1),
        "nli_xlmr": sequence_classifier_dir(root / "nli_xlmr", "xlm-roberta", 3, "single_label_classification"),
        "tags_bert": sequence_classifier_dir(root / "tags_bert", "bert", 4, "multi_label_classification"),
        "ce_identity": sequence_classifier_dir(root / "ce_identity", "bert", 1,
                                               activation_fn="torch.nn.modules.linear.Identity"),
    }


def _table(kind: str, name: str, source, *extra: str) -> dict:
    parser_args = ["--name", name, "--source", str(source), *extra]
    import argparse

    cls = kinds.kind_class(kind)
    parser = argparse.ArgumentParser()
    parser.add_argument("--name")
    parser.add_argument("--max-batch-size", type=int, default=64)
    cls.add_arguments(parser)
    return add.kind_spec(kind, parser.parse_args(parser_args))


def test_add_reads_a_cross_encoder_directory(sources):
    facts = _table("text-rerank", "ce", sources["ce_bert"])["model"]
    assert facts == {**facts, "architecture": "bert", "max_length": 64, "num_labels": 1, "segment_ids": True,
                     "pad_id": 0, "activation": "sigmoid", "label": 0}
    # The directory's own word wins, as CrossEncoder reads it.
    assert _table("text-rerank", "ce", sources["ce_identity"])["model"]["activation"] == "identity"


def test_add_reads_a_classifier_directory(sources):
    facts = _table("text-classification", "nli", sources["nli_xlmr"])["model"]
    assert facts["architecture"] == "roberta" and facts["segment_ids"] is False and facts["pad_id"] == 1
    assert facts["labels"] == ["entailment", "neutral", "contradiction"] and facts["activation"] == "softmax"
    # 514 positions, counted from pad id 1 + 1: the tokenizer's 64 is the smaller.
    assert facts["max_length"] == 64
    assert _table("text-classification", "tags", sources["tags_bert"])["model"]["activation"] == "sigmoid"


def test_add_refuses_what_it_cannot_serve_naming_why(sources, tmp_path):
    with pytest.raises(add.AddError, match="name the one to read with --label"):
        _table("text-rerank", "x", sources["nli_xlmr"])
    assert _table("text-rerank", "x", sources["nli_xlmr"], "--label", "entailment")["model"]["label"] == 0
    with pytest.raises(add.AddError, match="--label maybe: not one of"):
        _table("text-rerank", "x", sources["nli_xlmr"], "--label", "maybe")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("config.json", "model.safetensors"):
        (broken / f).write_bytes((sources["ce_bert"] / f).read_bytes())
    with pytest.raises(add.AddError, match=r"tokenizer\.json is missing"):
        _table("text-classification", "x", broken)
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(add.AddError, match="model_type 'gpt2' is not supported"):
        _table("text-classification", "x", broken)


def test_spec_checks_name_the_field():
    base = {"name": "r", "kind": "text-rerank", "source": {"dir": "x"}, "model": {"max_length": 64}}
    assert specs.parse(base).int8_model == "r_scorer"
    with pytest.raises(specs.SpecError, match=r"model\.activation"):
        specs.parse({**base, "model": {"max_length": 64, "activation": "relu"}})
    with pytest.raises(specs.SpecError, match=r"model\.label"):
        specs.parse({**base, "model": {"max_length": 64, "label": 2}})
    with pytest.raises(specs.SpecError, match=r"source\.dir"):
        specs.parse({**base, "source": {}})
    # kl_mean is bounded from above: a spec tightens it by lowering it.
    classify = {**base, "kind": "text-classification", "name": "c"}
    assert kinds.from_spec(specs.parse({**classify, "gates": {"kl_mean": 0.005}})).gate("kl_mean") == 0.005
    with pytest.raises(specs.SpecError, match="looser"):
        kinds.from_spec(specs.parse({**classify, "gates": {"kl_mean": 0.05}}))


def test_layout_declares_the_serving_contract():
    from tritonkit.repository import generate

    rerank = kinds.from_spec(specs.parse({"name": "r", "kind": "text-rerank", "source": {"dir": "x"},
                                          "model": {"max_length": 64, "segment_ids": True},
                                          "serving": {"fused": True}}))
    configs = {e.config.name: e.config for e in generate.repository(rerank)}
    assert set(configs) == {"r", "r_fp32", "r_fused", "r_tokenizer", "r_scorer", "r_scorer_fp32"}
    for name in ("r", "r_fp32", "r_fused"):
        c = configs[name]
        assert [(t.name, t.dtype, t.dims) for t in c.inputs] == [("query", "STRING", [1]), ("document", "STRING", [1])]
        assert [(t.name, t.dtype, t.dims) for t in c.outputs] == [
            ("logit", "FP32", [1]), ("score", "FP32", [1]), ("num_tokens", "INT32", [1]), ("truncated", "BOOL", [1])]
        assert c.max_batch_size > 0
    assert "token_type_ids" in [t.name for t in configs["r_tokenizer"].outputs]
    classify = kinds.from_spec(specs.parse({"name": "c", "kind": "text-classification", "source": {"dir": "x"},
                                            "model": {"max_length": 64, "num_labels": 3},
                                            "serving": {"fused": True}}))
    configs = {e.config.name: e.config for e in generate.repository(classify)}
    for name in ("c", "c_fp32", "c_fused"):
        c = configs[name]
        assert [(t.name, t.optional) for t in c.inputs] == [("text", False), ("text_pair", True)]
        assert [(t.name, t.dims) for t in c.outputs][:2] == [("logits", [3]), ("scores", [3])]
    assert configs["c_classifier"].outputs[1].label_filename == "labels.txt"
    assert "token_type_ids" not in [t.name for t in configs["c_tokenizer"].outputs]


def test_ranking_items_group_each_query_with_own_and_other_sources():
    rows = ranking_items("validation", queries=10)
    assert len(rows) == 10 * GROUP
    for start in range(0, len(rows), GROUP):
        assert len({q for q, _ in rows[start : start + GROUP]}) == 1
    assert set(ranking_items("validation", queries=10)) == set(rows)  # fixed
    assert not {d for _, d in rows} & {d for _, d in ranking_items("test", queries=10)}


def test_ranking_agreement_by_its_own_rule():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(4 * GROUP, 1))
    same = ranking_agreement(ref, ref + 1.0)  # a shift keeps every order
    assert same["kendall_tau_mean"] == same["kendall_tau_worst10"] == same["top1_agreement"] == 1.0
    flipped = ref.copy()
    flipped[:GROUP] *= -1  # the first query's order reversed
    got = ranking_agreement(ref, flipped)
    assert got["kendall_tau_min"] == -1.0 and got["top1_agreement"] == 0.75
    assert got["kendall_tau_mean"] == pytest.approx((3 - 1) / 4)


def test_classifier_agreement_by_its_own_rule():
    ref = np.array([[3.0, 0.0, 0.0], [0.0, 0.01, 0.0], [0.0, 0.0, 5.0]])
    got = ref.copy()
    got[1] = [0.02, 0.0, 0.0]  # a near tie flips: top-1 moves, the margin rule forgives it
    m = classifier_agreement(ref, got, "softmax")
    assert m["top1_agreement"] == pytest.approx(2 / 3) and m["top1_agreement_margin0.05"] == 1.0
    assert 0 < m["kl_mean"] < 1e-3
    single = classifier_agreement(np.array([[2.0], [-2.0]]), np.array([[2.0], [2.0]]), "sigmoid")
    assert single["top1_agreement"] == 0.5
