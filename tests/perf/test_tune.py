"""Config search (tritonkit.perf.tune): knobs on the real configs, profile files written all-or-nothing, a real server
serving a profile, and one real measurement of a tiny ensemble with perf_analyzer."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from tritonkit import paths
from tritonkit.perf import tune
from tritonkit.perf.analyzer import PerfPoint, write_input_data
from tritonkit.repository import profiles, variants
from tritonkit.repository.config import (
    ConfigError,
    EnsembleStep,
    ModelSpec,
    Tensor,
    check_config,
    check_ensemble,
    find_profiles,
    load_profile,
    parse_config,
    to_pbtxt,
    validate_repository,
)

# The ensembles `make tune` accepts and the steps it tunes.
PIPELINES = {"text_embedding": ("tokenizer", "text_encoder"),
             "image_classification": ("image_preprocess", "image_classifier")}
STEPS = [m for steps in PIPELINES.values() for m in steps]


def _real_configs(ensemble: str) -> dict:
    # Working tree, as Tuner reads them.
    return {m: variants.read_config(m, committed=False) for m in (ensemble, *PIPELINES[ensemble])}


# -- knobs ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", STEPS)
def test_every_knob_value_round_trips_through_the_real_config(model):
    cfg = variants.read_config(model, committed=False)
    knobs = profiles.knobs_of(cfg)
    assert {"max_batch", "instances"} <= set(knobs)
    before = to_pbtxt(cfg)
    start = {k: profiles.get_knob(cfg, k) for k in knobs}
    assert to_pbtxt(cfg) == before, "reading the knobs changed the config"
    for knob in knobs:
        for value in profiles.VALUES[knob]:
            new = type(cfg)()
            new.CopyFrom(cfg)
            profiles.set_knob(new, knob, value)
            assert profiles.get_knob(new, knob) == value, f"{model}.{knob}={value}"
            check_config(new)
            # One knob moves nothing else (max_batch may only drop preferred sizes above it).
            others = {k: profiles.get_knob(new, k) for k in knobs if k != knob}
            if knob == "max_batch" and "preferred_batch" in others:
                assert others.pop("preferred_batch") <= value
                start_others = {k: v for k, v in start.items() if k not in (knob, "preferred_batch")}
            else:
                start_others = {k: v for k, v in start.items() if k != knob}
            assert others == start_others, f"setting {model}.{knob}={value}"


def test_knobs_follow_what_the_backend_reads():
    cfgs = {m: variants.read_config(m, committed=False) for m in STEPS}
    assert "threads" in profiles.knobs_of(cfgs["text_encoder"])  # onnxruntime: ORT thread pool
    assert "bucket_padding" in profiles.knobs_of(cfgs["text_encoder"])  # ragged inputs
    assert "bucket_padding" not in profiles.knobs_of(cfgs["image_classifier"])  # fixed-shape input
    assert "threads" not in profiles.knobs_of(cfgs["tokenizer"])  # Python backend: no ORT session


@pytest.mark.parametrize("ensemble", sorted(PIPELINES))
def test_apply_keeps_the_ensemble_within_every_step_and_leaves_the_inputs_alone(ensemble):
    configs = _real_configs(ensemble)
    originals = {m: to_pbtxt(c) for m, c in configs.items()}
    steps = PIPELINES[ensemble]
    for a, b in itertools.product(profiles.VALUES["max_batch"], repeat=2):
        out = profiles.apply(configs, ensemble, {steps[0]: {"max_batch": a}, steps[1]: {"max_batch": b}})
        assert out[ensemble].max_batch_size == min(a, b)
        assert all(out[ensemble].max_batch_size <= out[s].max_batch_size for s in steps)
        for cfg in out.values():
            check_config(cfg)
        check_ensemble(out[ensemble], out)  # the server's view: steps take every batch the ensemble passes
    assert {m: to_pbtxt(c) for m, c in configs.items()} == originals


@pytest.mark.parametrize("ensemble", sorted(PIPELINES))
def test_preferred_batch_never_exceeds_max_batch_in_either_order(ensemble):
    configs = _real_configs(ensemble)
    for step in PIPELINES[ensemble]:
        if "preferred_batch" not in profiles.knobs_of(configs[step]):
            continue
        for pref, maxb in itertools.product(profiles.VALUES["preferred_batch"], profiles.VALUES["max_batch"]):
            # A point's knobs are applied in dict order; both orders must give a valid config.
            for knobs in ({"preferred_batch": pref, "max_batch": maxb}, {"max_batch": maxb, "preferred_batch": pref}):
                cfg = profiles.apply(configs, ensemble, {step: knobs})[step]
                assert all(0 < p <= cfg.max_batch_size for p in cfg.dynamic_batching.preferred_batch_size), knobs
                assert profiles.get_knob(cfg, "preferred_batch") <= maxb


def test_neighbours_at_the_ends_and_off_the_list():
    assert tune.neighbours("queue_delay_us", 0) == [250]  # bottom: only up
    assert tune.neighbours("queue_delay_us", 16000) == [8000]  # top: only down
    assert tune.neighbours("max_batch", 32) == [64, 16]  # up first, then down
    assert tune.neighbours("threads", 3) == [4, 2]  # hand-tuned value between entries
    assert tune.neighbours("threads", 0) == [1]  # unset parameter (backend default) reads as 0
    assert tune.neighbours("max_batch", 256) == [128]  # above the list
    assert tune.neighbours("bucket_padding", 0.3) == [0.4, 0.25]


# -- profiles ---------------------------------------------------------------------------------------------------

@pytest.fixture
def profiles_dir(tmp_path, monkeypatch) -> Path:
    """Profile records go to a temporary folder, never to the project's profiles/."""
    target = tmp_path / "profiles"
    monkeypatch.setattr(profiles, "PROFILES", target)
    return target


@pytest.fixture
def text_repo(tmp_path) -> Path:
    """The text_embedding pipeline's configs (no model files: validation reads configs only)."""
    repo = tmp_path / "repo"
    for m in ("text_embedding", *PIPELINES["text_embedding"]):
        (repo / m).mkdir(parents=True)
        shutil.copy(paths.MODEL_REPOSITORY / m / "config.pbtxt", repo / m / "config.pbtxt")
    return repo


def _tuner(tmp_path: Path, ensemble: str = "text_embedding") -> tune.Tuner:
    # Reading configs starts nothing; input_data is only used when measuring.
    return tune.Tuner(ensemble, p99_ms=50, input_data=tmp_path / "unused.json", progress=lambda _: None)


def _record(tuner: tune.Tuner, profile: str, point: profiles.Point) -> dict:
    return {"ensemble": tuner.ensemble, "profile": profile, "command": f"make tune PROFILE={profile}",
            "models": [*tuner.steps, tuner.ensemble], "start": tuner.start, "winner": point}


def _point(tuner: tune.Tuner, **changes: dict) -> profiles.Point:
    point = json.loads(json.dumps(tuner.start))
    for model, knobs in changes.items():
        point[model].update(knobs)
    return point


def _snapshot(*dirs: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for d in dirs for p in d.rglob("*") if p.is_file() and p.suffix in (".pbtxt", ".json")}


def test_write_profile_writes_a_valid_profile_and_removes_stale_files(tmp_path, text_repo, profiles_dir):
    tuner = _tuner(tmp_path)
    point = _point(tuner, text_encoder={"max_batch": 32})
    changed = tune.profile_configs(tuner, point)
    assert set(changed) == {"text_encoder", "text_embedding"}  # the ensemble follows its step's max batch
    written = profiles.write_profile("fast", changed, _record(tuner, "fast", point), repository=text_repo)
    enc, ens, tok = (text_repo / m / "configs" / "fast.pbtxt" for m in ("text_encoder", "text_embedding", "tokenizer"))
    record = profiles_dir / "text_embedding.fast.json"
    assert written == sorted([enc, ens, record])
    assert not tok.exists()
    for path in (enc, ens):
        text = path.read_text()
        assert text.startswith("# Profile 'fast': config.pbtxt with the knobs `make tune PROFILE=fast` chose")
        assert "--model-config-name=fast" in text
        assert to_pbtxt(parse_config(text)) == to_pbtxt(changed[path.parent.parent.name])
    assert json.loads(record.read_text())["winner"] == point
    assert find_profiles(text_repo) == ["fast"]
    view = load_profile(text_repo, "fast")
    assert (view["text_encoder"].max_batch_size, view["text_embedding"].max_batch_size) == (32, 32)
    assert view["tokenizer"].max_batch_size == 64  # no profile file: config.pbtxt
    validate_repository(text_repo)

    # The ensemble's profile file is what keeps the profile view valid: without it the ensemble (64) outgrows
    # the encoder (32), and validation must see that.
    moved = ens.rename(tmp_path / "ensemble.pbtxt")
    with pytest.raises(ConfigError, match="max_batch_size 32 < ensemble's 64"):
        validate_repository(text_repo)
    moved.rename(ens)

    # A later search that only changes the tokenizer: the encoder's and the ensemble's files are stale.
    point2 = _point(tuner, tokenizer={"queue_delay_us": 1000})
    changed2 = tune.profile_configs(tuner, point2)
    assert set(changed2) == {"tokenizer"}
    written2 = profiles.write_profile("fast", changed2, _record(tuner, "fast", point2), repository=text_repo)
    assert written2 == sorted([tok, record])
    assert not enc.exists() and not ens.exists()
    assert load_profile(text_repo, "fast")["tokenizer"].dynamic_batching.max_queue_delay_microseconds == 1000
    assert json.loads(record.read_text())["winner"] == point2
    validate_repository(text_repo)


def test_a_tuned_profile_follows_config_changes_made_after_tuning(tmp_path, text_repo, profiles_dir):
    """A profile is config.pbtxt plus the knobs its tuner changed: regenerating gives what tune wrote, and a
    parameter added to the config after tuning reaches the profile instead of being frozen out of it."""
    tuner = _tuner(tmp_path)
    point = _point(tuner, text_encoder={"max_batch": 32})
    written = profiles.write_profile("fast", tune.profile_configs(tuner, point), _record(tuner, "fast", point),
                                 repository=text_repo)
    assert profiles.tuned_profiles(text_repo) == {p: p.read_text() for p in written if p.suffix == ".pbtxt"}
    config = text_repo / "text_encoder" / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "added_later" value { string_value: "1" } }\n')
    profile = parse_config(profiles.tuned_profiles(text_repo)[text_repo / "text_encoder" / "configs" / "fast.pbtxt"])
    assert profile.parameters["added_later"].string_value == "1"
    assert profile.max_batch_size == 32


def test_interrupted_write_profile_leaves_the_previous_profile_byte_identical(
        tmp_path, text_repo, profiles_dir, monkeypatch):
    tuner = _tuner(tmp_path)
    first = _point(tuner, text_encoder={"max_batch": 32})
    profiles.write_profile("fast", tune.profile_configs(tuner, first), _record(tuner, "fast", first),
                       repository=text_repo)
    before = _snapshot(text_repo, profiles_dir)
    assert len(before) == 3 + 3  # three config.pbtxt, two profile configs, the record

    second = _point(tuner, tokenizer={"queue_delay_us": 1000}, text_encoder={"threads": 4})
    changed = tune.profile_configs(tuner, second)
    assert len(changed) >= 2  # so the interruption falls after one file was already replaced
    real_replace, calls = os.replace, []

    def replace_then_ctrl_c(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        profiles.write_profile("fast", changed, _record(tuner, "fast", second), repository=text_repo)
    monkeypatch.setattr(os, "replace", real_replace)
    assert len(calls) == 2
    assert _snapshot(text_repo, profiles_dir) == before
    assert load_profile(text_repo, "fast")["text_encoder"].max_batch_size == 32


# -- a real server serving a profile ---------------------------------------------------------------------------

def test_server_started_with_a_profile_serves_the_profile_config(start_server, smoke_repository, tmp_path,
                                                                 profiles_dir):
    repo = shutil.copytree(smoke_repository, tmp_path / "repo")
    base = variants.read_config("smoke_linear", repo, committed=False)
    fast = type(base)()
    fast.CopyFrom(base)
    profiles.set_knob(fast, "max_batch", 7)  # also drops the preferred sizes 8 and 16
    record = {"ensemble": "smoke_linear", "command": "test", "models": ["smoke_linear"]}
    profiles.write_profile("fast", {"smoke_linear": fast}, record, repository=repo)

    served = {}
    for profile in ("fast", ""):
        server = start_server(repo, profile=profile, models=["smoke_linear"])
        try:
            served[profile] = httpclient.InferenceServerClient(server.http_url).get_model_config("smoke_linear")
        finally:
            server.stop()
    assert served["fast"]["max_batch_size"] == 7
    # Our profile has no preferred sizes (Triton fills in max_batch_size for an empty list).
    assert not {8, 16} & set(served["fast"]["dynamic_batching"].get("preferred_batch_size", []))
    assert served[""]["max_batch_size"] == base.max_batch_size == 32
    assert served[""]["dynamic_batching"]["preferred_batch_size"] == [8, 16]


# -- one real measurement ---------------------------------------------------------------------------------------

@pytest.fixture
def smoke_ensemble(smoke_repository, tmp_path) -> Path:
    """A one-step ensemble over smoke_linear in a copy of the smoke repository."""
    repo = shutil.copytree(smoke_repository, tmp_path / "repo")
    ModelSpec(
        name="smoke_pipeline", platform="ensemble", max_batch_size=32,
        inputs=[Tensor("X", "FP32", [4])], outputs=[Tensor("Y", "FP32", [3])],
        ensemble_steps=[EnsembleStep("smoke_linear", {"X": "X"}, {"Y": "Y"})],
    ).write(repo)
    validate_repository(repo)
    return repo


@pytest.mark.slow  # perf_analyzer up a concurrency ladder, twice
def test_measure_climbs_the_ladder_and_scores_the_best_throughput_within_budget(smoke_ensemble, tmp_path):
    data = write_input_data(tmp_path / "input.json",
                            [{"X": {"content": [float(i), 1.0, 2.0, 3.0], "shape": [4]}} for i in range(4)])
    messages: list[str] = []
    tuner = tune.Tuner("smoke_pipeline", p99_ms=60_000, input_data=data, measurement_ms=500,
                       progress=messages.append, repository=smoke_ensemble)
    assert tuner.steps == ["smoke_linear"]
    assert tuner.start == {"smoke_linear": {"queue_delay_us": 20_000, "preferred_batch": 16, "max_batch": 32,
                                            "instances": 2, "threads": 1}}
    # A changed point, so the variant repository is really edited; c=16 keeps the ladder short.
    tuner.start_c = 16
    point = _point(tuner, smoke_linear={"queue_delay_us": 1000})
    trial = tuner.measure(point)
    assert trial.note == "", trial.note
    ladder = trial.ladder
    assert len(ladder) >= 2 and all(isinstance(p, PerfPoint) for p in ladder)
    assert [p.concurrency for p in ladder] == list(tune.LADDER[tune.LADDER.index(16):][:len(ladder)])
    assert all(p.throughput > 0 and 0 < p.p50_ms <= p.p99_ms for p in ladder)
    # The climb stops at the top, over budget, or when throughput stops growing by 2 %.
    last, prev = ladder[-1], ladder[-2]
    assert last.concurrency == tune.LADDER[-1] or last.p99_ms > tuner.p99_ms or last.throughput < prev.throughput * 1.02
    within = [p for p in ladder if p.p99_ms <= tuner.p99_ms]
    assert trial.score == max(p.throughput for p in within) == trial.best.throughput > 0
    assert tuner.trials == [trial]
    assert "smoke_linear.queue_delay_us=1000" in messages[-1]
    assert json.loads(json.dumps(trial.to_json()))["score"] == trial.score

    # No point can meet a 1 µs p99: the ladder walks down to c=1 and the score is 0.
    tuner.p99_ms, tuner.start_c = 0.001, 2
    hopeless = tuner.measure(tuner.start)
    assert [p.concurrency for p in hopeless.ladder] == [2, 1]
    assert all(p.throughput > 0 and not math.isnan(p.p99_ms) for p in hopeless.ladder)
    assert (hopeless.score, hopeless.best) == (0.0, None)
    assert messages[-1].endswith("start: nothing")


# -- command line -----------------------------------------------------------------------------------------------

def test_tune_help_exits_zero():
    proc = subprocess.run([sys.executable, "-m", "tritonkit.perf.tune", "--help"], cwd=paths.ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--p99-ms" in proc.stdout and "text_embedding" in proc.stdout
