"""When a committed runtime choice still speaks for a served file, and when it must be measured again."""

from pathlib import Path

import numpy as np
import pytest

from tritonkit.int8.budget import Budget
from tritonkit.repository.runtime_choice import reusable

RECORD = {"sha256": "aaa", "source": "src", "file": "model_repository/m/1/model.onnx", "threads": 2}


def test_an_unchanged_file_at_its_timed_threads_keeps_its_choice():
    assert reusable(RECORD, "aaa", "other", RECORD["file"], 2)
    assert reusable(RECORD, "rebuilt", "src", RECORD["file"], 2)  # INT8 rebuilt from the same sources


def test_a_change_of_threads_file_or_contents_is_measured_again():
    assert not reusable(None, "aaa", "src", RECORD["file"], 2)
    assert not reusable(RECORD, "aaa", "src", RECORD["file"], 1)  # the spec now serves it on one thread
    assert not reusable(RECORD, "aaa", "src", "model_repository/m/1/model.packed.onnx", 2)
    assert not reusable(RECORD, "new", "new", RECORD["file"], 2)
    assert not reusable({**RECORD, "budget_cut": "not measured"}, "aaa", "src", RECORD["file"], 2)  # measured whole


def test_a_budget_cuts_the_timed_rounds_to_what_fits():
    """A round times SAMPLE_MIXES mixes on every variant (at least min_sample_s each); every further mix the rounds
    rotate through is warmed first. From the warm-up's seconds a mix, the most rounds whose total fits; where none
    does with more mixes, the rounds re-time the warmed ones; never under MIN_ROUNDS."""
    from tritonkit.repository.runtime_choice import MIN_ROUNDS, MIXES, ROUNDS, SAMPLE_MIXES, BudgetSpent, fit_rounds

    warm = {"onnxruntime": 0.125, "openvino": 0.25}  # seconds a mix (binary fractions: sums compare exactly)
    per_round = SAMPLE_MIXES * (0.125 + 0.25)

    def cost(rounds, mixes):  # seconds after the warm-up of the first SAMPLE_MIXES mixes
        return (mixes - SAMPLE_MIXES) * (0.125 + 0.25) + rounds * per_round

    assert fit_rounds(warm, 1e9, ROUNDS, 0.05) == (ROUNDS, MIXES)
    with pytest.raises(BudgetSpent, match=f"3 timed rounds need about {3 * per_round:.0f} s"):  # no median of fewer
        fit_rounds(warm, cost(MIN_ROUNDS, SAMPLE_MIXES) - 0.01, ROUNDS, 0.05)
    assert fit_rounds(warm, cost(MIN_ROUNDS, SAMPLE_MIXES), ROUNDS, 0.05) == (MIN_ROUNDS, SAMPLE_MIXES)
    for rounds in range(MIN_ROUNDS, ROUNDS + 1):
        rotating = min(MIXES, rounds * SAMPLE_MIXES)
        assert fit_rounds(warm, cost(rounds, rotating), ROUNDS, 0.05) == (rounds, rotating)
    # Under the cheapest rotating plan: the warmed mixes alone, as many rounds as fit.
    budget = cost(MIN_ROUNDS, MIN_ROUNDS * SAMPLE_MIXES) - 0.01
    fitting = max(r for r in range(MIN_ROUNDS, ROUNDS + 1) if cost(r, SAMPLE_MIXES) <= budget)
    assert fit_rounds(warm, budget, ROUNDS, 0.05) == (fitting, SAMPLE_MIXES)
    assert fit_rounds({"onnxruntime": 0.0}, 3 * 0.05, ROUNDS, 0.05) == (3, 3 * SAMPLE_MIXES)  # min_sample_s a sample
    assert fit_rounds(warm, 1e9, ROUNDS, 0.05, available=1) == (ROUNDS, 1)  # a kind timing one batch (images)
    assert fit_rounds(warm, 3 * per_round, ROUNDS, 0.05, available=1) == (3, 1)


def test_the_files_share_a_build_budget_by_their_work(monkeypatch):
    """Each file to measure takes, of what is left at its turn, its variants over its threads against the files
    after it: MPNet's INT8 name (three variants at one thread where bf16 is native) three quarters, its FP32 file
    (two at two threads) the rest; a file measured alone all of it."""
    from tritonkit import envinfo, kinds
    from tritonkit.repository.runtime_choice import shares

    kind = kinds.get("all_mpnet_base_v2")
    assert (kind.spec.serving.model_threads, kind.spec.serving.fp32_threads) == (1, 2)
    both = [(kind.INT8_MODEL, True), (kind.FP32_MODEL, False)]
    monkeypatch.setattr(envinfo, "has_bf16", lambda: True)
    assert shares(kind, both) == [0.75, 1.0]
    monkeypatch.setattr(envinfo, "has_bf16", lambda: False)
    assert shares(kind, both) == pytest.approx([2 / 3, 1.0])
    assert shares(kind, both[1:]) == [1.0]
    assert shares(kind, both, frozenset({kind.FP32_MODEL})) == [1.0, 1.0]  # its timings borrowed: no work


@pytest.mark.slow  # times or judges the real MiniLM files (30-100 s on 2 cores)
def test_a_build_budget_bounds_the_runtime_choice_and_a_cut_is_measured_again(tmp_path):
    """Past a build's deadline a file is still timed, in the fewest rounds (never starved by the search before it),
    and the record says the budget cut it. Within a deadline it is timed in the rounds that fit, and the cut record
    is not reused. On the real text build,
    with the spec copied so that the choice file is written beside the copy."""
    import json
    import shutil
    import time

    from tests.support.text_support import ensure_text_built
    from tritonkit import envinfo, kinds, paths
    from tritonkit.repository.runtime_choice import MIN_ROUNDS, ROUNDS, choice_path, choose, reusable

    built = ensure_text_built()
    shutil.copy(paths.SPECS / "text_embedding.toml", tmp_path / "text_embedding.toml")
    kind = kinds.get("text_embedding", tmp_path)
    assert choice_path(kind).parent == tmp_path
    logged = []
    entry = choose(kind, built.fp32, None, log=logged.append, budget=Budget(time.perf_counter() - 1))
    cut = entry["models"][kind.FP32_MODEL]
    assert "budget" in cut["budget_cut"] and set(cut["items_per_s"]) == {"onnxruntime", "openvino"}
    assert cut["runtime"] in cut["items_per_s"] and not reusable(cut, cut["sha256"], cut["source"], cut["file"],
                                                                 cut["threads"])
    assert any(f"{MIN_ROUNDS} rounds" in line and "--choose-runtime" in line for line in logged), logged
    entry = choose(kind, built.fp32, None, log=logged.append, budget=Budget(time.perf_counter() + 60))
    record = entry["models"][kind.FP32_MODEL]
    assert set(record["items_per_s"]) == {"onnxruntime", "openvino"}
    rounds = record.get("rounds", {})  # given where the budget cut a batch size's rounds
    assert all(MIN_ROUNDS <= r <= ROUNDS for r in rounds.values()) and (not rounds or min(rounds.values()) < ROUNDS)
    if record.get("budget_cut"):  # OpenVINO won by the margin, but its accuracy check did not fit
        assert record["runtime"] == "onnxruntime" and "not started" in record["budget_cut"]
    assert json.loads(choice_path(kind).read_text())["classes"][envinfo.int8_class()] == entry


def test_an_accuracy_check_counts_the_fp32_reference_it_still_has_to_compute(monkeypatch):
    """From the FP32 graph's seconds a row on the split with every core: the variant at its threads and speed-up,
    plus the FP32 run where its reference is still to compute."""
    import os

    from tritonkit.repository.runtime_choice import check_seconds

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert check_seconds(1000, 0.01, 2.0, 1, False) == pytest.approx(1000 * 0.01 * 2 / 2.0)
    assert check_seconds(1000, 0.01, 2.0, 2, True) == pytest.approx(1000 * 0.01 * (1 / 2.0 + 1))
    assert check_seconds(1000, 0.01, 1.0, 4, False) == pytest.approx(10.0)  # more threads than cores: no credit


@pytest.mark.slow  # times or judges the real MiniLM files (30-100 s on 2 cores)
def test_an_int8_file_that_holds_the_absolute_gates_needs_no_floor(tmp_path, monkeypatch):
    """The floor only loosens gates, so the runtime choice measures it only for a variant that misses the absolute
    ones (MPNet's, not measured by a search the speed probe ended, is ~9 min here). MiniLM's INT8 file, timed
    within a deadline: whatever variant is checked holds the absolute gates, and no floor is asked for."""
    import shutil
    import time

    from tests.support.text_support import ensure_text_built
    from tritonkit import kinds, paths
    from tritonkit.int8 import floor, gates
    from tritonkit.repository.runtime_choice import choose

    built = ensure_text_built()
    shutil.copy(paths.SPECS / "text_embedding.toml", tmp_path / "text_embedding.toml")
    kind = kinds.get("text_embedding", tmp_path)
    asked = []
    monkeypatch.setattr(floor, "measure", lambda *a, **k: asked.append(a) or {})
    entry = choose(kind, built.fp32, built.int8, log=lambda _m: None, budget=Budget(time.perf_counter() + 300))
    record = entry["models"][kind.INT8_MODEL]
    if not record.get("accuracy"):
        pytest.skip(f"no variant was checked for accuracy on this CPU: {record['reason']}")
    absolute = {t.metric: t for t in gates.targets(kind, None)}
    for metrics in record.get("accuracy", {}).values():
        assert all(absolute[m].met(metrics) for m in absolute), metrics
    assert not asked, "a floor was measured for a variant that held the absolute gates"


def test_the_served_int8_precision_follows_the_chosen_variant(monkeypatch):
    from tritonkit import kinds
    from tritonkit.repository import runtime_choice

    kind = kinds.get("text_embedding")
    for variant, precision in [("openvino-bf16", "bf16"), ("openvino", "f32"), ("onnxruntime", "f32")]:
        monkeypatch.setattr(runtime_choice, "variant_for", lambda _kind, _model, v=variant: v)
        chosen, path, got = runtime_choice.served_int8(kind)
        assert (chosen, got) == (variant, precision)
        assert path.parent.parent.name == kind.INT8_MODEL and path.name.startswith("model.")


def test_a_fresh_clone_reuses_the_committed_choices_whatever_its_files_bytes():
    """A committed record is reused by what its files are built from (spec, packages, the class's recipe), not by
    the files' bytes, which differ between CPUs (Lite0's FP32 export) and builds (its calibration): otherwise every
    fresh clone on another machine re-times and rewrites models/<name>.runtime.json."""
    from tritonkit import kinds
    from tritonkit.repository.runtime_choice import load, source_digest

    kind = kinds.get("text_embedding")
    assert source_digest(kind, False, "vnni") == source_digest(kind, False, "avx2")  # FP32: no recipe in it
    assert source_digest(kind, True, "vnni") != source_digest(kind, True, "avx2")  # each class's own recipe
    for name in ("text_embedding", "image_classification"):
        kind = kinds.get(name)
        for cpu_class, entry in load(kind)["classes"].items():
            for model, record in entry["models"].items():
                assert record["source"] == source_digest(kind, model == kind.INT8_MODEL, cpu_class), (name, model)


def test_exactness_is_measured_against_int32_arithmetic_of_the_same_file(tmp_path, monkeypatch):
    """The guard a CPU without VNNI applies before serving an INT8 file on a runtime other than ONNX Runtime:
    the worst row cosine to the file's exact int32 arithmetic. ONNX Runtime's served session (exact path on such
    a class) meets it on the full-range Q/DQ MatMul; a graph with other weights does not."""
    import numpy as np

    from tests.serving.test_exact_int8 import _qdq_matmul
    from tritonkit import envinfo
    from tritonkit.repository.runtime_choice import EXACT_COSINE, ExactSession, worst_cosine
    from tritonkit.serving import runtimes

    monkeypatch.setattr(envinfo, "int8_class", lambda features=None: "avx2")
    rng = np.random.default_rng(3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    path, *_ = _qdq_matmul(tmp_path / "a", rng)
    other, *_ = _qdq_matmul(tmp_path / "b", rng)
    feeds = [{"x": rng.uniform(-6, 6, size=(16, 64)).astype(np.float32)} for _ in range(3)]
    served = runtimes.open_variant("onnxruntime", path, 1)
    assert worst_cosine(served, ExactSession(path), "y", feeds) >= EXACT_COSINE
    assert worst_cosine(served, ExactSession(other), "y", feeds) < 0.9


@pytest.mark.slow  # times or judges the real MiniLM files (30-100 s on 2 cores)
def test_a_packed_file_is_scored_against_the_fp32_reference_in_its_texts_order():
    """The runtime choice scores a packed file's embeddings (texts in arrival order) against the FP32 reference the
    replay computed over eval_batches (texts length-sorted): rows put back in arrival order, the packed FP32 file
    run on each runtime matches FP32 within the export tolerance; misordered rows would not (cosine ~0)."""
    from tests.support.text_support import ensure_text_built
    from tritonkit import data, kinds
    from tritonkit.int8.evaluate import reference, session
    from tritonkit.repository.runtime_choice import accuracy, served_file

    built = ensure_text_built()
    kind = kinds.get("text_embedding")
    texts = data.eval_texts("test")
    ordered = kind.arrival_order(reference(kind, built.fp32, "test"), texts)
    assert np.allclose(ordered, kind.embed_onnx(session(built.fp32), texts), atol=1e-4)
    packed = served_file(built.fp32)
    assert packed.name.endswith(".packed.onnx"), packed
    for variant in ("onnxruntime", "openvino"):
        got = accuracy(kind, packed, built.fp32, variant, 2)
        assert got["cosine_min"] >= kind.EXPORT.tolerance and got["texts"] == len(texts), (variant, got)


def test_an_fp32_fallbacks_packed_form_is_its_twins_with_the_fallbacks_marks(tmp_path, capsys):
    """An FP32 fallback under the INT8 name is the FP32 graph with a mark: its packed form is the FP32 twin's packed
    graph with that mark (nothing packed or proven again), computing what the twin's does for every text."""
    import onnx

    from tests.support.text_support import ensure_text_built
    from tritonkit import build, data, fingerprint, kinds
    from tritonkit.int8 import recipe
    from tritonkit.int8.evaluate import session
    from tritonkit.serving import packing

    built = ensure_text_built()
    kind = kinds.get("text_embedding")
    out = tmp_path / "fallback_probe_model" / "1" / "model.onnx"
    out.parent.mkdir(parents=True)
    recipe.write_fp32_fallback(built.fp32, out, "a test's fallback")
    try:
        packed = build.build_packed(kind, out, None, force=True, twin=built.fp32)
    finally:  # the build's stamp for this test's made-up model
        fingerprint.unstamp(kind.NAME, "packed.fallback_probe_model")
    assert "its FP32 twin's, with the fallback's marks" in capsys.readouterr().out  # not packed again
    assert packed == packing.packed_path(out) and packed.exists()
    marks = {p.key: p.value for p in onnx.load(str(packed), load_external_data=False).metadata_props}
    assert marks[recipe.PRECISION_KEY] == "fp32-fallback: a test's fallback" and packing.META_POOLING in marks
    texts = data.eval_texts("test")[:40]
    twin = kind.embed_packed(session(packing.packed_path(built.fp32)), texts)
    assert np.array_equal(kind.embed_packed(session(packed), texts), twin)


@pytest.mark.slow  # times or judges the real MiniLM files (30-100 s on 2 cores)
def test_an_fp32_fallback_at_its_twins_threads_is_timed_once(tmp_path):
    """An FP32 fallback under the INT8 name is its FP32 twin's graph; at the same threads the twin's timings are
    the INT8 name's, measured once (Lite1's files; an added image model's). The INT8 name then has the
    whole budget. A real INT8 graph is not the same graph, so its twin is timed itself."""
    import shutil
    import time

    from tests.support.text_support import ensure_text_built
    from tritonkit import build, fingerprint, kinds, paths
    from tritonkit.int8 import recipe
    from tritonkit.repository.runtime_choice import choose, same_graph, served_file

    built = ensure_text_built()
    spec = (paths.SPECS / "text_embedding.toml").read_text()
    assert "model_threads = 1\n" in spec
    (tmp_path / "text_embedding.toml").write_text(spec.replace("model_threads = 1\n", "model_threads = 2\n"))
    kind = kinds.get("text_embedding", tmp_path)
    assert kind.spec.serving.model_threads == kind.spec.serving.fp32_threads == 2
    out = tmp_path / "fallback_twin_model" / "1" / "model.onnx"
    out.parent.mkdir(parents=True)
    recipe.write_fp32_fallback(built.fp32, out, "a test's fallback")
    try:
        build.build_packed(kind, out, None, force=True, twin=built.fp32)
    finally:  # the build's stamp for this test's made-up model
        fingerprint.unstamp(kind.NAME, "packed.fallback_twin_model")
    assert same_graph(served_file(out), served_file(built.fp32))
    assert not same_graph(served_file(built.int8), served_file(built.fp32))
    logged: list[str] = []
    entry = choose(kind, built.fp32, out, log=logged.append, budget=Budget(time.perf_counter() + 240))
    int8, fp32 = entry["models"][kind.INT8_MODEL], entry["models"][kind.FP32_MODEL]
    assert "items_per_s" in int8, int8
    assert fp32["timed_as"] == kind.INT8_MODEL and fp32["threads"] == int8["threads"] == 2
    assert fp32["items_per_s"] == {v: int8["items_per_s"][v] for v in ("onnxruntime", "openvino")}
    assert sum(line.startswith(f"{kind.NAME}: timing ") for line in logged) == 1, logged
    shutil.rmtree(out.parent.parent)


def test_a_new_models_int8_file_is_timed_where_its_fp32_runs_fastest(monkeypatch):
    """Before the INT8 name has a record, its search times the INT8 file on the FP32 competitor's variant, not on
    ONNX Runtime by default (the MiniLM reranker's INT8 ran 0.87x there, 1.45x on OpenVINO bf16); replays and
    fingerprints see ONNX Runtime until the runtime choice records one."""
    from tritonkit import kinds
    from tritonkit.int8 import pipeline, speed
    from tritonkit.repository import runtime_choice

    kind = kinds.get("text_embedding")
    record = {"classes": {"vnni": {"models": {kind.FP32_MODEL: {"runtime": "openvino"}}}}}
    monkeypatch.setattr(runtime_choice, "load", lambda _kind: record)
    assert runtime_choice.served_variants(kind) == ("openvino", None)
    record["classes"]["vnni"]["models"][kind.INT8_MODEL] = {"runtime": "onnxruntime"}
    assert runtime_choice.served_variants(kind) == ("openvino", "onnxruntime")

    seen = []

    class Stop(Exception):
        pass

    def search_forms(_kind, _fp32, _progress, _budget, _only, speed_variants, *_rest):
        seen.append(speed_variants)
        raise Stop

    monkeypatch.setattr(speed, "fp32_competitor", lambda *_a, **_k: ("openvino-bf16", {}))
    monkeypatch.setattr(pipeline, "search_forms", search_forms)
    monkeypatch.setattr(pipeline, "FP32Facts", lambda *_a: None)
    for int8, timed in ((None, "openvino-bf16"), ("onnxruntime", "onnxruntime")):
        with pytest.raises(Stop):
            pipeline.run(kind, Path("fp32.onnx"), ("openvino", int8), search=True)
        assert seen[-1] == ("openvino-bf16", timed)
