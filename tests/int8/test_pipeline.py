"""The INT8 stage measures each fact once per build: counted over a real `make build` of a tiny new encoder
(tests/support/counted_build.py records every whole-split evaluation and every timing at the served batch sizes,
by the judged graph's bytes), for the three paths a user meets: a build that searches (then packs and chooses
runtimes), a replay on a machine that never judged the files (a fresh clone), and a rebuild here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter

import pytest

from tests.support.tiny_sources import scratch_env, sentence_transformers_dir
from tritonkit import paths

pytestmark = pytest.mark.slow
NAME = "counted_encoder"


def _add(root, env, name: str) -> None:
    """A tiny new encoder's spec, written by `python -m tritonkit.add` as a user would."""
    source = sentence_transformers_dir(root / name, architecture="bert", pooling="mean", normalize=True, hidden=128)
    out = subprocess.run([sys.executable, "-m", "tritonkit.add", "text-embedding", "--name", name, "--source",
                          str(source), "--max-batch-size", "16"], env=env, cwd=paths.ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("counted")
    env = scratch_env(root)
    _add(root, env, NAME)
    return root, env


def _build(tree, tag: str, *args: str) -> tuple[list[dict], str]:
    root, env = tree
    ledger = root / f"ledger-{tag}.json"
    out = subprocess.run([sys.executable, "tests/support/counted_build.py", NAME, "--no-progress", *args],
                         env={**env, "COUNTED_BUILD_LEDGER": str(ledger)}, cwd=paths.ROOT, capture_output=True,
                         text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(ledger.read_text()), out.stdout


def _report(tree, form: str) -> dict:
    root, _ = tree
    suffix = "" if form == "served" else "_trt"
    return json.loads((root / "build" / "reports" / f"{NAME}_int8{suffix}.json").read_text())


def _once(ledger: list[dict]) -> tuple[Counter, Counter]:
    """Every (split, graph, runtime, arithmetic) evaluated and every (graph, variants) timed or raced at most once."""
    evaluated = Counter((e["split"], e["graph"], e.get("variant"), e.get("exact")) for e in ledger
                        if e["what"] == "evaluate")
    # A graph's speed: timed against FP32 alone, or raced as a rival of its parent (a trim that beats it serves
    # with the race's timing).
    timed = Counter((e["graph"], tuple(e["variants"])) for e in ledger if e["what"] in ("time", "race"))
    assert not [k for k, n in evaluated.items() if n > 1], [k for k, n in evaluated.items() if n > 1]
    assert not [k for k, n in timed.items() if n > 1], [k for k, n in timed.items() if n > 1]
    return evaluated, timed


def _of(counter: Counter, graph: str, split: str | None = None) -> int:
    """How often `graph` was measured (on `split`, for evaluations)."""
    return sum(n for key, n in counter.items() if graph in key and (split is None or split in key))


@pytest.fixture(scope="module")
def searched(tree):
    return _build(tree, "search")


def test_a_build_that_searches_judges_each_graph_once_and_its_replay_measures_nothing(tree, searched):
    ledger, log = searched
    assert "searching" in log
    evaluated, timed = _once(ledger)
    for form in ("served", "tensorrt"):
        report = _report(tree, form)
        if report["status"] != "passed":
            continue  # an FP32 fallback: no INT8 file to judge
        # The file written is the one the search judged: its test split and its speed were measured by the search.
        assert report["judged_by"] == "search", report.get("judged_by")
        assert _of(evaluated, report["sha256"], "test") == 1, (form, evaluated)
        assert _of(timed, report["sha256"]) == (1 if form == "served" else 0), (form, timed)
    assert _report(tree, "tensorrt")["status"] == "passed"  # no speed gate: the tiny encoder's form always passes
    # The FP32 file's seconds a row at most once (the search's budget, its floor's estimate, the runtime choice),
    # and each form's gates built once (the probe, the search, the replay, the packed proof, the runtime choice).
    assert len([e for e in ledger if e["what"] == "row_seconds"]) <= 1, ledger
    assert Counter(e["form"] for e in ledger if e["what"] == "gates") == {"served": 1, "tensorrt": 1}, ledger


def test_a_replay_on_a_machine_that_never_judged_it_measures_each_file_once(tree, searched):
    root, _ = tree
    shutil.rmtree(root / "build" / "int8-judgements")  # as on a fresh clone of the committed recipe
    ledger, log = _build(tree, "replay", "--force")
    assert "searching" not in log
    evaluated, timed = _once(ledger)
    for form in ("served", "tensorrt"):
        report = _report(tree, form)
        if report["status"] != "passed":
            continue
        assert report["judged_by"] == "replay"
        assert _of(evaluated, report["sha256"], "test") == 1, (form, evaluated)
        assert _of(timed, report["sha256"]) == (1 if form == "served" else 0), (form, timed)


def test_a_rebuild_here_reuses_its_judgements(tree, searched):
    ledger, log = _build(tree, "again", "--force")
    for form in ("served", "tensorrt"):
        report = _report(tree, form)
        if report["status"] == "passed":
            assert _of(Counter(e.get("graph", "") for e in ledger), report["sha256"]) == 0, ledger
            assert "judged already" in log


def test_a_class_without_its_own_entry_serves_what_this_machine_proved_of_a_donors_recipe(tree, searched,
                                                                                          monkeypatch):
    """A build on a CPU class the recipe file has no entry for replays the donor class's recipe, judges it here and
    keeps the outcome as this machine's proof (build/proofs/); the embedded server's replica view serves it, the
    committed views do not, and nothing committed changes."""
    from tritonkit import envinfo, kinds
    from tritonkit.int8 import proof
    from tritonkit.kinds import spec as specs
    from tritonkit.repository import replica

    root, env = tree
    committed = {p.name: p.read_bytes() for p in (root / "models").iterdir()}
    faked = "avx512" if envinfo.int8_class() != "avx512" else "generic"
    env["TRITONKIT_CPU_CLASS"] = faked  # the module's later builds act as that class too: this test runs last
    _, log = _build(tree, "faked", "--force")
    assert "proof for this" in log, log[-3000:]
    assert {p.name: p.read_bytes() for p in (root / "models").iterdir()} == committed
    monkeypatch.setattr(paths, "BUILD_OUTPUTS", root / "build")
    monkeypatch.setenv(envinfo.CLASS_ENV, faked)
    kind = kinds.from_spec(specs.load(root / "models" / f"{NAME}.toml"))
    bf16 = envinfo.has_bf16()  # the faked class on this machine's cores, as its runtime choice recorded it
    made, why = proof.valid(kind, root / "repo" / kind.INT8_MODEL / "1" / "model.onnx")
    assert made is not None, why
    assert (made.cpu_class, made.donor) == (faked, envinfo.int8_class(envinfo.cpu_flags()))
    served = _report(tree, "served")
    assert made.status == served["status"]
    here = replica.decide(replica.record([kind], root / "repo", local=True)["models"][kind.INT8_MODEL],
                          kind.INT8_MODEL, faked, bf16=bf16)
    assert "this machine" in here.reason and here.int8 == (made.status == "passed"), here
    committed_view = replica.decide(replica.record([kind], root / "repo")["models"][kind.INT8_MODEL],
                                    kind.INT8_MODEL, faked, bf16=bf16)
    assert not committed_view.int8 and "this machine" not in committed_view.reason
    # Adopted (`--adopt-proof`), it is the class's committed entry: every view of that class serves it.
    out = subprocess.run([sys.executable, "-m", "tritonkit.build", NAME, "--adopt-proof", "--no-progress"], env=env,
                         cwd=paths.ROOT, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    entry = json.loads((root / "models" / f"{NAME}.int8.json").read_text())["served"][faked]
    assert (entry["proven_from"], entry["status"]) == (made.donor, made.status)
    adopted = replica.decide(replica.record([kind], root / "repo")["models"][kind.INT8_MODEL],
                             kind.INT8_MODEL, faked, bf16=bf16)
    assert adopted.int8 == (made.status == "passed") and "this machine" not in adopted.reason, adopted


def test_a_build_whose_search_spends_its_budget_serves_each_name_on_the_fastest_runtime_it_measured(tree):
    """A new model built with a budget its search cannot start in: INT8 falls back to FP32, and the runtime choice
    after it is not starved (it used to record "not measured: the build's budget was spent" and serve ONNX Runtime):
    each name is timed, in the fewest rounds, and serves the fastest variant that beat ONNX Runtime by the margin and
    held its checks."""
    from tritonkit.serving.runtimes import DEFAULT, MIN_GAIN

    root, env = tree
    name = f"{NAME}_spent"
    _add(root, env, name)
    out = subprocess.run([sys.executable, "-m", "tritonkit.build", name, "--no-progress", "--budget-minutes", "0.05"],
                         env=env, cwd=paths.ROOT, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    served = json.loads((root / "build" / "reports" / f"{name}_int8.json").read_text())
    assert served["status"] == "fp32-fallback", served  # the budget, or the speed probe, ended its search
    choice = json.loads((root / "models" / f"{name}.runtime.json").read_text())
    records = next(iter(choice["classes"].values()))["models"]
    assert len(records) == 2, records  # the INT8 name (its FP32 fallback) and the FP32 name
    for model, record in records.items():
        gains = record.get("vs_onnxruntime")
        assert gains and record.get("items_per_s"), (model, record)  # measured, though the budget was spent
        # marked so a later build measures it whole, unless it took its twin's timings (an FP32 fallback's graph)
        assert "budget" in record.get("budget_cut", "") or record.get("timed_as"), record
        chosen = record["runtime"]
        if chosen == DEFAULT:
            assert max(gains.values()) < MIN_GAIN or "misses" in record["reason"], record
        else:
            assert gains[chosen] >= MIN_GAIN, record
            assert all(f"{v} {gains[v]:.2f}x but misses" in record["reason"] for v in gains if gains[v] > gains[chosen])
