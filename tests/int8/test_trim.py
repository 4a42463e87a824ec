"""The fallback's trim (tritonkit.int8.fallback.trim, steps.refine): a passing candidate's float nodes put
back in INT8 one at a time where every gate still holds, on the small MatMul model whose middle layer reads an
outlier token (tests/int8/test_granularity.py)."""

from __future__ import annotations

import pytest

from tests.int8.test_granularity import MatMulSpec, model  # noqa: F401 (the module's fixture)
from tritonkit.int8 import fallback, search, steps, timing
from tritonkit.int8.records import Recipe
from tritonkit.serving.runtimes import DEFAULT

LAYERS = ("/a/MatMul", "/b/MatMul", "/c/MatMul")


@pytest.fixture
def whole_block(model):  # noqa: F811
    """(a candidate with every layer float, as a fallback over one block would leave it; the outlier layer; the
    activation product; a search context of the model, given whether it has a speed gate)."""
    path, outlier, activation = model

    def searcher(check_speed: bool) -> search.SearchContext:
        return search.SearchContext(MatMulSpec(), path, ["uint8"], check_speed=check_speed, progress=False,
                                    log=lambda _m: None)

    return Recipe(form="uint8", placement="inputs", float_nodes=[*LAYERS, activation]), outlier, activation, searcher


def test_trim_puts_back_in_int8_every_float_node_but_the_one_the_gates_need(whole_block):
    r, outlier, _activation, searcher = whole_block
    s = searcher(check_speed=False)
    assert s.measure("confirm", "the block float", r).passed  # what a fallback hands over
    trimmed = fallback.trim(s, r)
    assert trimmed is not None and trimmed.float_nodes == [outlier]  # the activation product holds INT8 here
    steps = [st for st in s.steps if st.stage == "trim"]
    # No ranking: the recipe's order reversed (a fallback adds its most sensitive units first).
    assert [st.change.split(" back")[0] for st in steps] == r.float_nodes[::-1]
    assert [st.passed for st in steps] == [n != outlier for n in r.float_nodes[::-1]]
    assert s.steps[-1].stage == "confirm" and s.steps[-1].passed  # the whole split confirms the trimmed recipe


def test_trim_tries_the_least_sensitive_units_nodes_first(whole_block):
    r, _outlier, activation, searcher = whole_block
    s = searcher(check_speed=False)
    ranked = [("/b", ["/b/MatMul"], 0.9), ("/c", ["/c/MatMul"], 0.1), ("family:act", [activation], 0.3)]
    fallback.trim(s, r, ranked)
    tried = [st.change.split(" back")[0] for st in s.steps if st.stage == "trim"]
    assert tried == ["/c/MatMul", activation, "/b/MatMul", "/a/MatMul"]  # by gain, then unranked in order


def test_a_trim_the_whole_split_rejects_keeps_the_longest_run_of_its_returns_that_holds(whole_block):
    """The sample's passes can add up to a miss on the whole split (scripted: the confirmation of all the returns
    misses); runs of the returns, in the order they were kept, are then bisected on the whole split, for real."""
    from dataclasses import replace as with_

    r, outlier, _activation, searcher = whole_block
    s = searcher(check_speed=False)
    real = s.measure

    def measure(stage, change, recipe, **kw):
        step = real(stage, change, recipe, **kw)
        return with_(step, passed=False) if stage == "confirm" else step

    s.measure = measure
    trimmed = fallback.trim(s, r)
    returned = [n for n in r.float_nodes[::-1] if n != outlier]  # the sample let these back, in this order
    assert trimmed is not None
    assert trimmed.float_nodes == [n for n in r.float_nodes if n not in returned[:2]]  # all 3 "missed"
    bisected = [st.change for st in s.steps if st.stage == "trim" and st.change.endswith("on all validation")]
    assert bisected == ["the first 1 of them, on all validation", "the first 2 of them, on all validation"]


def test_trim_judges_on_a_sample_with_the_rows_its_returns_hurt_most(whole_block):
    r, _outlier, _activation, searcher = whole_block
    s = searcher(check_speed=False)
    fallback.trim(s, r)
    assert s.sample.extra_rows  # the whole split's worst rows under every trimmable node in INT8


def test_a_trim_that_brings_nothing_back_leaves_the_candidate(whole_block):
    _r, outlier, _activation, searcher = whole_block
    s = searcher(check_speed=False)
    assert fallback.trim(s, Recipe(form="uint8", placement="inputs", float_nodes=[outlier])) is None


@pytest.mark.parametrize("faster", [True, False])
def test_the_trimmed_candidate_leads_only_where_it_beats_its_parent_head_to_head(whole_block, monkeypatch, faster):
    """The served form: the trimmed recipe races its parent (scripted here: which is faster is the point); the
    parent stays a candidate either way. TensorRT's form, without a speed gate, puts the trimmed one first."""
    r, outlier, _activation, searcher = whole_block
    s = searcher(check_speed=True)
    monkeypatch.setattr(steps, "granular", lambda ctx, timed: [timed])  # this test is about the trim's offer
    ratio = 1.3 if faster else 0.97
    monkeypatch.setattr(timing, "race_parent", lambda ctx, parent, rivals: [
        {"int8_speedup": 1.2}, *({"int8_speedup": 1.2 * ratio, "over_parent_lo": ratio} for _ in rivals)])
    offered = steps.refine(s, (r, {"int8_speedup": 1.25}))
    if faster:
        assert [g.float_nodes for g, _ in offered] == [[outlier], r.float_nodes]
        assert offered[1][1] == {"int8_speedup": 1.2}  # the parent's time from the same race
    else:
        assert offered == [(r, {"int8_speedup": 1.25})]
    assert steps.refine(s, (r, {"int8_speedup": 1.25})) == [(r, {"int8_speedup": 1.25})]  # trimmed once per recipe
    trt = searcher(check_speed=False)
    assert [g.float_nodes for g, _ in steps.refine(trt, (r, {}))] == [[outlier], r.float_nodes]


@pytest.mark.parametrize("served", ["all", "parent", "none"])
def test_a_return_is_kept_only_where_it_holds_run_as_its_parent_is_served(whole_block, monkeypatch, served):
    """With a speed gate timing INT8 on another runtime (OpenVINO, where Lite1's returns that held in exact int32
    arithmetic missed in bf16), each return the sample passes is also run there, and kept only where the gates
    hold so too. A parent that misses there itself is timed on ONNX Runtime, the judged arithmetic, and so are its
    returns (Lite1's committed +39 missed in bf16 and kept none); on ONNX Runtime nothing more runs."""
    from tritonkit.int8.evaluate import Evaluator

    r, outlier, _activation, _searcher = whole_block
    path = _searcher(False).fp32
    ran: list[str] = []
    real = Evaluator.served_problems

    def served_problems(self, graph, variant, judge, threads, exact=False):
        ran.append(variant)
        metrics, problems = real(self, graph, variant, judge, threads, exact)
        refused = served == "none" or (served == "parent" and len(ran) > 1)  # the first run is the parent's
        return metrics, [*problems, "refused by the test"] if refused else problems

    monkeypatch.setattr(Evaluator, "served_problems", served_problems)
    s = search.SearchContext(MatMulSpec(), path, ["uint8"], check_speed=True, progress=False, log=lambda _m: None,
                             speed_variants=(DEFAULT, "openvino"))
    trimmed = fallback.trim(s, r)
    passing = [st for st in s.steps if st.stage == "trim" and st.passed]
    assert passing
    if served == "none":  # the parent's run only: its returns are judged as ONNX Runtime computes them
        assert ran == ["openvino"] and timing.served_variant(s, r) == DEFAULT, ran
    else:  # the parent's run, then each sample pass run as served
        assert ran == ["openvino"] * (1 + len(passing)) and timing.served_variant(s, r) == "openvino", ran
    if served == "parent":
        assert trimmed is None
    else:  # OpenVINO f32 computes within the gates here what onnxruntime does
        assert trimmed is not None and trimmed.float_nodes == [outlier], trimmed
    ran.clear()
    s = search.SearchContext(MatMulSpec(), path, ["uint8"], check_speed=True, progress=False, log=lambda _m: None)
    fallback.trim(s, r)
    assert ran == []


@pytest.mark.parametrize("check_speed", [True, False])
def test_the_trim_leaves_time_for_the_finer_granularity_step_after_it(whole_block, check_speed):
    """A served trim starts a return only where the steps after it still fit: the trimmed recipe's confirmation and
    race, then each granularity scheme on the whole split and its race (MPNet's returns, 50 s each, once took the
    whole budget and the step never ran). TensorRT's form has no such step: the same budget starts its returns."""
    import time

    from tritonkit.int8.budget import Budget

    r, _outlier, _activation, searcher = whole_block
    s = searcher(check_speed)
    s.measure("confirm", "the block float", r)
    s.plan.durations = {"confirm:split": [20.0], "speed": [10.0], "test": [20.0], "trim:sample": [1.0]}
    reserve = s.plan.reserve()
    # the trimmed recipe's confirmation and race, then at least one scheme's whole split and race (MatMuls here),
    # reckoned as steps.refine hands it to the trim
    later = s.plan.after_trim(len(steps.granular_nodes(s, r)))
    assert later >= (20.0 + 10.0 + 20.0 + 10.0 if check_speed else 0.0)
    s.plan.deadline = time.perf_counter() + reserve + 30.0  # room for the returns, not for the served steps after
    s.plan.budget_s, s.plan.budget = 100.0, Budget(s.plan.deadline, 100.0)
    fallback.trim(s, r, later=later)
    started = [st for st in s.steps if st.stage == "trim"]
    assert (not started) == check_speed, [st.change for st in started]
