"""Packed text batches (tritonkit.serving.packing): the row layout, and the graph rewrite against the padded graph it
came from, for tiny random BERT and MPNet encoders exported the way the build exports them (torch.onnx, opset 17)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.tiny_sources import sentence_transformers_dir
from tritonkit.export import row_metric
from tritonkit.kinds import architectures
from tritonkit.serving import packing

HIDDEN = 32  # the tiny encoders' width


def test_pack_lays_texts_end_to_end_with_positions_restarting_and_pooling_weights():
    seqs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 28), np.array([7])]
    feeds = packing.pack(seqs, row_tokens=10, pooling="mean", pad_id=0)
    ids, pos, seg, pool = (feeds[k] for k in packing.INPUTS)
    assert ids.shape == pos.shape == seg.shape and pool.shape == (4, ids.size)
    assert int((seg >= 0).sum()) == 17 and ids.shape[0] == 2  # 17 tokens in rows of at most 10
    flat_ids, flat_pos, flat_seg = ids.reshape(-1), pos.reshape(-1), seg.reshape(-1)
    for i, s in enumerate(seqs):
        where = np.flatnonzero(flat_seg == i)
        assert np.array_equal(flat_ids[where], s) and np.array_equal(flat_pos[where], np.arange(len(s)))
        assert np.allclose(pool[i, where], 1.0 / len(s)) and pool[i].sum() == pytest.approx(1.0)
    assert (flat_ids[flat_seg < 0] == 0).all()
    cls = packing.pack(seqs, 10, "cls")["pool"]
    assert (cls.sum(1) == 1).all() and all(flat_ids[cls[i].argmax()] == s[0] for i, s in enumerate(seqs))
    # A text longer than a row gets a row of its own length.
    assert packing.pack([np.arange(1, 30)], 10, "mean")["input_ids"].shape == (1, 29)


def test_layout_balances_rows_so_the_last_is_not_mostly_padding():
    # 160 tokens: rows filled to 128 run 2 x 110 slots; balanced rows 2 x 80, no padding at all.
    assert packing.layout([60, 50, 30, 20], 128, balanced=False)[1] == 110
    rows, width = packing.layout([60, 50, 30, 20], 128)
    assert (len(rows), width) == (2, 80)
    rng = np.random.default_rng(1)
    for _ in range(200):
        lengths = [int(n) for n in rng.integers(1, 150, rng.integers(1, 40))]
        rows, width = packing.layout(lengths, 128)
        full_rows, full_width = packing.layout(lengths, 128, balanced=False)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert width == max(sum(lengths[i] for i in row) for row in rows) <= max(128, max(lengths))
        assert len(rows) * width <= len(full_rows) * full_width


def test_pack_refuses_what_it_cannot_express():
    with pytest.raises(packing.PackingError, match="max"):
        packing.pack([np.arange(3)], 8, "max")
    with pytest.raises(packing.PackingError, match="at least one token"):
        packing.pack([np.arange(3), np.arange(0)], 8, "mean")


def _export(tmp_path, architecture, pooling, normalize):
    import torch

    st_dir = sentence_transformers_dir(tmp_path / architecture, architecture=architecture, pooling=pooling,
                                       normalize=normalize, hidden=HIDDEN)
    module = architectures.pooled_encoder(st_dir, architectures.get(architecture), pooling, normalize)
    ids = torch.randint(5, 90, (2, 7))
    path = tmp_path / f"{architecture}.onnx"
    with torch.no_grad():
        torch.onnx.export(module, (ids, torch.ones_like(ids)), str(path), input_names=["input_ids", "attention_mask"],
                          output_names=["embedding"], opset_version=17, dynamo=False,
                          dynamic_axes={"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"},
                                        "embedding": {0: "b"}})
    return path


@pytest.mark.parametrize(("architecture", "pooling", "normalize"),
                         [("bert", "mean", True), ("mpnet", "cls", False), ("bert", "mean_sqrt_len", False),
                          ("roberta", "mean", True), ("distilbert", "cls", False)])
def test_packed_graph_gives_each_text_its_padded_embedding(tmp_path, architecture, pooling, normalize):
    import onnx
    import onnxruntime as ort

    path = _export(tmp_path, architecture, pooling, normalize)
    packed = packing.pack_graph(onnx.load(str(path)), pooling, normalize, HIDDEN)
    assert sorted(i.name for i in packed.graph.input) == sorted(packing.INPUTS)
    padded = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    session = ort.InferenceSession(packed.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.get_modelmeta().custom_metadata_map[packing.META_POOLING] == pooling
    rng = np.random.default_rng(0)
    seqs = [rng.integers(5, 90, n) for n in (3, 17, 9, 30, 1, 12, 5)]
    want = np.concatenate([padded.run(None, {"input_ids": s[None], "attention_mask": np.ones((1, len(s)),
                                                                                                np.int64)})[0]
                           for s in seqs])
    for row_tokens in (8, 32, 128):  # many rows, a few, one
        got = session.run(None, packing.pack(seqs, row_tokens, pooling))[0]
        assert got.shape == want.shape
        assert row_metric("cosine", got, want).min() > 0.99999 and np.abs(got - want).max() < 1e-4
        # Shape buckets (what the openvino backend feeds): wider rows, a power-of-two pool; the first rows agree.
        feeds = packing.pack(seqs, row_tokens, pooling, width_multiple=16)
        assert feeds["input_ids"].shape[1] % 16 == 0 and feeds["pool"].shape[0] == 8
        bucketed = session.run(None, feeds)[0]
        assert row_metric("cosine", bucketed[: len(seqs)], want).min() > 0.99999
        assert np.abs(bucketed[: len(seqs)] - want).max() < 1e-4


def test_a_graph_without_position_embeddings_is_refused_by_name(tmp_path):
    import onnx

    path = _export(tmp_path, "bert", "mean", True)
    model = onnx.load(str(path))
    for init in model.graph.initializer:
        init.name = init.name.replace("position_embeddings", "pos_table")
    for node in model.graph.node:
        node.input[:] = [i.replace("position_embeddings", "pos_table") for i in node.input]
    with pytest.raises(packing.PackingError, match="position_embeddings"):
        packing.pack_graph(model, "mean", True, HIDDEN)


def test_static_shapes_parse_and_name_what_is_wrong():
    assert packing.StaticShapes.parse("", 128, 16, 64) is None
    static = packing.StaticShapes.parse("2, 1", 64, 16, 8)
    assert static.rows == (1, 2) and list(static.widths()) == [16, 32, 48, 64]
    examples = static.examples()
    assert [e["input_ids"].shape for e in examples] == [(r, w) for r in (1, 2) for w in (16, 32, 48, 64)]
    assert all(e["pool"].shape == (8, e["input_ids"].size) for e in examples)
    for bad, why in (("one", "row counts such as"), ("0", "row counts >= 1")):
        with pytest.raises(packing.PackingError, match=why):
            packing.StaticShapes.parse(bad, 128, 16, 64)
    with pytest.raises(packing.PackingError, match="width multiple >= 2"):
        packing.StaticShapes.parse("1", 128, 1, 64)


def test_row_widths_bucket_by_sixteen_to_128_then_by_steps_doubling_every_eight():
    widths = [packing.bucket_width(w, 16) for w in (1, 16, 17, 128, 129, 161, 256, 257)]
    assert widths == [16, 16, 32, 128, 160, 192, 256, 320]
    assert packing.bucket_width(37, 1) == 37  # no multiple: exact widths (ONNX Runtime)
    static = packing.StaticShapes.parse("1", 256, 16, 8)
    assert static.widths() == (*range(16, 129, 16), 160, 192, 224, 256)
    feeds = packing.pack([np.arange(1, 140), np.arange(1, 4)], 256, "mean", width_multiple=16)
    assert feeds["input_ids"].shape == (1, 160) and feeds["pool"].shape == (2, 160)  # 142 tokens, one row
    fitted, keep = static.fit(feeds)
    assert keep == 2 and fitted["pool"].shape == (8, 160)
    wide = packing.pack([np.arange(1, 200), np.arange(1, 100)], 256, "mean", width_multiple=16)
    assert wide["input_ids"].shape == (2, 224) and static.fit(wide)[1] is None  # two rows: the dynamic model


def test_static_shapes_on_openvino_give_the_dynamic_models_embeddings(tmp_path):
    import onnx

    from tritonkit.errors import ConfigError
    from tritonkit.serving import runtimes

    path = _export(tmp_path, "bert", "mean", True)
    packed_path = tmp_path / "model.packed.onnx"
    onnx.save(packing.pack_graph(onnx.load(str(path)), "mean", True, HIDDEN), str(packed_path))
    config = {"name": "enc", "parameters": {"INFERENCE_NUM_THREADS": {"string_value": "1"},
                                             "packed_static_rows": {"string_value": "1"}}}
    dynamic = runtimes.open_runner("openvino", packed_path, config)
    runner = runtimes.open_runner("openvino", packed_path, config)
    static = runtimes.static_shapes(runner, config, row_tokens=32, width_multiple=16, texts=8)
    assert len(runner.static) == 2 and "2 static shapes" in runner.describe()
    rng = np.random.default_rng(1)
    one_row = [rng.integers(5, 90, n) for n in (3, 9, 5)]  # 17 tokens: one row of width 32
    two_rows = [rng.integers(5, 90, n) for n in (20, 25)]  # two rows: dynamic
    for seqs, covered in ((one_row, True), (two_rows, False)):
        feeds = packing.pack(seqs, 32, "mean", width_multiple=16)
        fitted, keep = static.fit(feeds)
        assert (keep == feeds["pool"].shape[0] and fitted["pool"].shape[0] == 8) is covered
        assert (runtimes._shapes(fitted) in runner.static) is covered
        want = dynamic.run(["embedding"], feeds, len(seqs))[0][0]
        got = runner.run(["embedding"], feeds, len(seqs))[0][0]  # the runner fits the feeds itself
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-5
    ort_runner = runtimes.open_runner("onnxruntime", packed_path, config)
    with pytest.raises(ConfigError, match=r"parameters\.packed_static_rows: only the openvino runtime"):
        runtimes.static_shapes(ort_runner, config, row_tokens=32, width_multiple=16, texts=8)
