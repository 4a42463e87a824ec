"""tritonkit.perf.interleave: every way warmed once, then run once per repeat, in turn."""

from tritonkit.perf.interleave import interleaved


def test_each_repeat_runs_every_way_in_turn_after_one_untimed_warm_up():
    calls: list[str] = []
    times = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3)
    assert calls == ["a", "b"] * 4  # the warm-up, then 3 interleaved repeats
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for v in times.values() for t in v)
