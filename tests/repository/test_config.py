"""Every committed config parses against Triton's ModelConfig schema; ensembles connect end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from tritonkit import paths
from tritonkit.repository.config import (
    ConfigError,
    DynamicBatching,
    EnsembleStep,
    ModelSpec,
    Tensor,
    find_configs,
    load_config,
    parse_config,
    validate_repository,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "invalid_configs"
REPO_CONFIGS = find_configs(paths.MODEL_REPOSITORY)


def test_repository_has_configs():
    assert REPO_CONFIGS, f"no config.pbtxt under {paths.MODEL_REPOSITORY}"


@pytest.mark.parametrize("path", REPO_CONFIGS, ids=lambda p: p.parent.name)
def test_committed_config_parses(path):
    cfg = load_config(path)
    assert cfg.name == path.parent.name


def test_committed_repository_ensembles_connect():
    configs = validate_repository(paths.MODEL_REPOSITORY)
    ensembles = [c for c in configs.values() if c.platform == "ensemble"]
    for ens in ensembles:
        assert all(step.model_name in configs for step in ens.ensemble_scheduling.step)


@pytest.mark.parametrize(
    "case, field",
    [("typo_field", "max_batch_sizes"), ("bad_preferred_batch", "dynamic_batching.preferred_batch_size"),
     ("missing_dtype", "input[0].data_type"), ("bad_enum", "data_type")],
)
def test_invalid_fixture_names_the_field(case, field):
    with pytest.raises(ConfigError) as info:
        load_config(FIXTURES / case / "config.pbtxt")
    assert info.value.field == field
    assert field in str(info.value)


def test_name_must_match_directory(tmp_path):
    path = tmp_path / "right" / "config.pbtxt"
    path.parent.mkdir()
    path.write_text((FIXTURES / "bad_preferred_batch" / "config.pbtxt").read_text().replace(
        '"bad_preferred_batch"', '"wrong"').replace("16", "8"))
    with pytest.raises(ConfigError, match="name"):
        load_config(path)


def _pipeline(repo: Path, *, ids_type: str = "INT64", out_dims: list[int] | None = None,
              step_model: str = "encoder", map_from: str = "ids") -> Path:
    ModelSpec(
        name="pre", backend="python", max_batch_size=8,
        inputs=[Tensor("TEXT", "STRING", [1])], outputs=[Tensor("ids", "INT64", [-1])],
        dynamic_batching=DynamicBatching(),
    ).write(repo)
    ModelSpec(
        name="encoder", backend="onnxruntime", max_batch_size=8,
        inputs=[Tensor("input_ids", ids_type, [-1])], outputs=[Tensor("emb", "FP32", [4])],
    ).write(repo)
    ModelSpec(
        name="pipe", platform="ensemble", max_batch_size=8,
        inputs=[Tensor("TEXT", "STRING", [1])], outputs=[Tensor("EMB", "FP32", out_dims or [4])],
        ensemble_steps=[
            EnsembleStep("pre", {"TEXT": "TEXT"}, {"ids": "ids"}),
            EnsembleStep(step_model, {"input_ids": map_from}, {"emb": "EMB"}),
        ],
    ).write(repo)
    return repo


def test_valid_ensemble_passes(tmp_path):
    configs = validate_repository(_pipeline(tmp_path))
    assert set(configs) == {"pre", "encoder", "pipe"}
    # The generated pbtxt round-trips through the schema unchanged.
    text = (tmp_path / "pipe" / "config.pbtxt").read_text()
    assert parse_config(text) == configs["pipe"]


@pytest.mark.parametrize(
    "kwargs, field, fragment",
    [
        ({"ids_type": "INT32"}, "ensemble_scheduling.step[1].input_map", "TYPE_INT64"),
        ({"out_dims": [5]}, "output[0].dims", "EMB"),
        ({"step_model": "missing"}, "ensemble_scheduling.step[1].model_name", "missing"),
        ({"map_from": "nowhere"}, "ensemble_scheduling.step[1].input_map", "nowhere"),
    ],
)
def test_broken_ensemble_names_the_field(tmp_path, kwargs, field, fragment):
    with pytest.raises(ConfigError) as info:
        validate_repository(_pipeline(tmp_path, **kwargs))
    assert info.value.field == field
    assert fragment in str(info.value)
