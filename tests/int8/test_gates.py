"""A form's gates measure its half-precision floor only where a judgement needs it (tritonkit.int8.gates).

The rule the deferral rests on is checked over the shipped kinds with numbers drawn here; the floor itself is
measured for real on the search tests' tiny model (tests.support.tiny_search), as tests/int8/test_floor.py does."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from tests.support.tiny_search import TinySpec, export_tiny
from tritonkit import kinds
from tritonkit.int8 import floor, gates, search
from tritonkit.int8.gates import passes
from tritonkit.kinds.gates import Target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gates") / "tiny.onnx"
    return path, export_tiny(path)


def _spec(absolute: float = 0.9999999) -> TinySpec:
    spec = TinySpec()
    spec.TARGETS = (Target("cosine_min", ">=", absolute), Target("cosine_mean", ">=", absolute))
    spec.FLOOR_SLACK = {"cosine_min": 0.002, "cosine_mean": 0.0005}
    spec.CATASTROPHE = (Target("cosine_min", ">=", 0.98),)
    spec.SPEED_TARGET = Target("int8_speedup", ">=", 0.0)
    return spec


@pytest.mark.parametrize("name", ["text_embedding", "image_classification"])
def test_the_absolute_and_the_loosest_bounds_judge_as_every_floor_would(name):
    """Metrics that hold the absolute bounds hold under any floor, and metrics that miss a bound no floor loosens
    miss under any: with and without the search's margin, over floors and metrics drawn around the bounds."""
    kind = kinds.get(name)
    rng = np.random.default_rng(0)
    loosest = gates.loosest(kind)
    metrics_of = {t.metric for t in gates.targets(kind, None)} | {t.metric for t in loosest}
    checked = {"held": 0, "lost": 0}
    for _ in range(3000):
        half = {m: float(rng.uniform(0.85, 1.0)) for m in kind.FLOOR_SLACK}
        got = {m: 1.0 if rng.random() < 0.4 else float(rng.uniform(0.88, 1.0)) for m in metrics_of}
        judged = gates.targets(kind, half)
        for margin in (0.0, 0.1):
            if passes(gates.targets(kind, None), got, margin):
                checked["held"] += 1
                assert passes(judged, got, margin), (half, got, margin)
            if not passes(loosest, got, margin):
                checked["lost"] += 1
                assert not passes(judged, got, margin), (half, got, margin)
    assert min(checked.values()) > 50, checked  # both rules were exercised


def test_a_deferred_floor_is_measured_once_and_only_where_the_absolute_bounds_cannot_decide(tiny):
    tiny, _ = tiny
    spec = _spec()
    half = floor.measure(spec, tiny, "fp16")  # measured by the test itself, to compare with
    g = gates.for_form(spec, tiny, "tensorrt", log=lambda _m: None)
    assert g.deferred and gates.NOT_NEEDED in g.floor and not g.measured
    measured = []
    pending = g.pending
    g.pending = lambda: measured.append(1) or pending()

    assert g.holds("test", {"cosine_min": 1.0, "cosine_mean": 1.0})  # the absolute bounds hold
    assert not g.holds("test", {"cosine_min": 0.975, "cosine_mean": 1.0})  # under the catastrophe bound
    assert not g.holds("validation", {"cosine_min": 0.979, "cosine_mean": 1.0}, margin=0.1)
    assert not measured and g.deferred

    between = {"cosine_min": half["test"]["cosine_min"] - 0.001, "cosine_mean": half["test"]["cosine_mean"]}
    assert between["cosine_min"] < spec.TARGETS[0].value  # only the floor can pass it
    assert g.holds("test", between)
    assert measured == [1] and not g.deferred and g.floor["test"] == half["test"]
    assert not g.missed("test", between)
    assert g.missed("test", {"cosine_min": half["test"]["cosine_min"] - 0.003, "cosine_mean": 1.0})
    assert measured == [1]  # once per build


def test_a_report_is_written_with_the_floor_its_build_measured_last(tiny, tmp_path, monkeypatch):
    """A replay's Outcome holds its report; the build writes it after its last judgement (decide.write_records): "not
    needed" while its gates' floor is deferred, else the floor a later judgement of the same build (the packed proof,
    the runtime choice) measured, with the bounds it set."""
    from tritonkit.int8 import decide, report

    tiny, _ = tiny
    spec = _spec()
    monkeypatch.setattr(report, "REPORTS", tmp_path)
    g = gates.for_form(spec, tiny, "tensorrt", log=lambda _m: None)
    spec.EXPORT = type("Export", (), {"name": "tiny"})
    rep = {"created": "now", "search_env": {}, "status": "passed", "recipe_summary": "int8-inputs-minmax",
           "test": {"cosine_min": 0.9999, "cosine_mean": 0.99999}}
    outcome = decide.Outcome("tensorrt", tmp_path / "q.onnx", "passed", [], gates=g, report=rep)
    decide.write_records(spec, [outcome])  # still deferred: nothing to show yet
    page = report.report_path(spec, "tensorrt").with_suffix(".md")
    assert "not needed" in page.read_text()

    half = floor.measure(spec, tiny, "fp16")
    assert g.holds("test", {"cosine_min": half["test"]["cosine_min"] - 0.001,
                            "cosine_mean": half["test"]["cosine_mean"]})  # only the floor decides: measured now
    decide.write_records(spec, [outcome])
    written = json.loads(report.report_path(spec, "tensorrt").read_text())
    assert gates.NOT_NEEDED not in written["floor"] and written["floor"]["test"] == half["test"]
    assert written["test"] == rep["test"]  # the rest of the report is as it was
    bounds = [row["test"] for row in written["gates"] if row["metric"] == "cosine_min"]
    assert bounds == [pytest.approx(half["test"]["cosine_min"] - spec.FLOOR_SLACK["cosine_min"], abs=1e-6)]
    assert "not needed" not in page.read_text()


def test_gates_with_a_bound_at_its_maximum_measure_the_floor_up_front(tiny):
    """A gate at its metric's maximum (an image kind's every-sure-photo-agrees) is missed by nearly any INT8
    graph: its floor is measured before the search, where the budget counts it (pipeline.form_cut)."""
    tiny, _ = tiny
    spec = _spec()
    spec.TARGETS = (*spec.TARGETS, Target("cosine_min_strict", ">=", 1.0))
    assert not gates.deferrable(spec) and gates.deferrable(_spec())
    g = gates.for_form(spec, tiny, "tensorrt", log=lambda _m: None)
    assert not g.deferred and g.measured
    assert not gates.deferrable(kinds.get("image_classification")) and gates.deferrable(kinds.get("text_embedding"))


def _steps(result) -> list[tuple]:
    return [(s.stage, s.change, s.recipe, s.passed) for s in result.steps]


@pytest.mark.parametrize("absolute", [0.9999999, 0.99])
def test_a_search_with_its_floor_deferred_decides_as_one_that_measured_it_first(tiny, absolute):
    """Same steps, verdicts and recipe either way, the outlier layer float as the kind's prior (SEARCH_PRIOR_FLOAT).
    Under unreachable absolute bounds the prior's judgement needs the floor (measured then); under loose ones it holds
    them, the search ends there and no judgement needed the floor: the search's gates say so."""
    tiny, outlier = tiny
    spec = _spec(absolute)
    spec.SEARCH_PRIOR_FLOAT = (f"^{re.escape(outlier)}$",)
    quiet = {"check_speed": False, "progress": False, "log": lambda _m: None, "min_int8_share": 0}
    first = search.run(search.SearchContext(spec, tiny, ["int8"], gates=gates.of_floor(spec, "tensorrt", floor.measure(
        spec, tiny, "fp16")), **quiet))
    deferred = gates.for_form(spec, tiny, "tensorrt", log=lambda _m: None)
    later = search.run(search.SearchContext(spec, tiny, ["int8"], gates=deferred, **quiet))
    assert first.passed and later.passed
    assert dataclasses.asdict(later.recipe) == dataclasses.asdict(first.recipe)
    assert later.recipe.float_nodes == [outlier]
    assert _steps(later) == _steps(first)
    assert later.test == first.test
    assert deferred.measured == (absolute > 0.999)
    if absolute < 0.999:
        assert gates.NOT_NEEDED in deferred.floor and not any(s.stage == "fallback" for s in later.steps)
