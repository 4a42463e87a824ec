"""Native-load check: each rule fails on its own fixture and nowhere else; both views of the real repository pass
where they should, and the embedded repository's ragged text encoders are refused by the native rules."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tritonkit import native_check, paths, repo_variants
from tritonkit.engines import EngineError, ServerTarget

FIXTURES = Path(__file__).parent / "fixtures" / "native"
RULE_FIXTURES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name != "base")
TARGET_TRT = "10.5.0"


def compose(tmp_path: Path, overlay: str) -> tuple[Path, str]:
    """base/ with the overlay's files on top and its DELETE list removed; the view named in VIEW (default GPU)."""
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "base", repo)
    src = FIXTURES / overlay
    for f in src.rglob("*"):
        if f.is_file() and f.parent == src and f.name in ("DELETE", "VIEW"):
            continue
        if f.is_file():
            (repo / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, repo / f.relative_to(src))
    if (src / "DELETE").exists():
        for rel in (src / "DELETE").read_text().split():
            (repo / rel).unlink()
    view = (src / "VIEW").read_text().strip() if (src / "VIEW").exists() else "ngc-gpu"
    return repo, view


def test_every_rule_has_a_fixture_and_an_upstream_source():
    assert sorted(native_check.RULES) == RULE_FIXTURES
    for rule in native_check.RULES.values():
        repo, _, path = rule.source.partition("/")
        assert repo in ("core", "onnxruntime_backend", "tensorrt_backend", "python_backend") and path.startswith("src/")
        assert rule.url.startswith(f"{native_check.UPSTREAM}/{repo}/blob/{native_check.RELEASE_BRANCH}/src/")


@pytest.mark.parametrize("view", sorted(native_check.VIEWS))
def test_base_fixture_passes_every_view(view):
    assert native_check.check_repository(FIXTURES / "base", view, TARGET_TRT) == []


@pytest.mark.parametrize("rule", RULE_FIXTURES)
def test_each_fixture_fails_exactly_its_rule(tmp_path, rule):
    repo, view = compose(tmp_path, rule)
    violations = native_check.check_repository(repo, view, TARGET_TRT)
    assert violations, f"{rule} fixture passed the {view} view"
    assert {v.rule for v in violations} == {rule}, [str(v) for v in violations]
    assert native_check.RULES[rule].source in str(violations[0])


def test_ragged_inputs_mean_padding_to_the_embedded_backend(tmp_path):
    """The same ragged config is fine for our Python-based ORT backend (it pads) and refused by the native one."""
    repo, _ = compose(tmp_path, "ort.ragged_input")
    assert native_check.check_repository(repo, "embedded", TARGET_TRT) == []


# The two pipelines `make build` has always built; other specs' models may be in the repository unbuilt.
PIPELINES = ("text_embedding", "text_embedding_fp32", "image_classification", "image_classification_fp32")


def _built_models() -> list[str]:
    """The pipelines' models (ensembles and their steps); skips until `make build` has produced them."""
    configs = native_check.load_repository(paths.MODEL_REPOSITORY)
    names = set(PIPELINES) | {s.model_name for p in PIPELINES for s in configs[p].ensemble_scheduling.step}
    unbuilt = [n for n in sorted(names) if native_check.is_onnxruntime(configs[n])
               and not (paths.MODEL_REPOSITORY / n / "1" / "model.onnx").exists()]
    if unbuilt:
        pytest.skip(f"`make build` has not produced {unbuilt} yet")
    return sorted(names)


def _subset(tmp_path: Path, names: list[str]) -> Path:
    repo = tmp_path / "embedded"
    for name in names:
        shutil.copytree(paths.MODEL_REPOSITORY / name, repo / name, symlinks=True)
    return repo


def test_embedded_repository_is_refused_by_the_native_backend_as_it_stands(tmp_path):
    repo = _subset(tmp_path, _built_models())
    assert native_check.check_repository(repo, "embedded", TARGET_TRT) == []
    refused = native_check.check_repository(repo, "ngc-gpu", TARGET_TRT)
    encoders = ("text_encoder", "text_encoder_fp32")
    assert {(v.rule, v.model) for v in refused} == {("ort.ragged_input", m) for m in encoders}


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_generated_ngc_views_pass(tmp_path, gpu):
    repo = paths.MODEL_REPOSITORY
    view = repo_variants.ngc_view(tmp_path / "ngc", repo, gpu=gpu, only=_built_models())
    assert native_check.check_repository(view, "ngc-gpu" if gpu else "ngc-cpu", TARGET_TRT) == []
    cfg = native_check.load_repository(view)["text_encoder"]
    assert not any(t.allow_ragged_batch for t in cfg.input)
    assert not any(k.startswith(repo_variants.EMBEDDED_ORT_PARAMETERS) for k in cfg.parameters)
    if (repo / "text_encoder" / "1" / "model.packed.onnx").exists():  # only our backend runs the packed graph
        assert not list(view.rglob("*.packed.onnx")) and (view / "text_encoder" / "1" / "model.onnx").exists()
    assert "Generated by" in (view / "text_encoder" / "config.pbtxt").read_text()
    for profile in (repo / "text_encoder" / "configs").glob("*.pbtxt"):  # named profiles get the same edit
        assert "allow_ragged_batch" not in (view / "text_encoder" / "configs" / profile.name).read_text()
    assert not (view / "text_encoder" / "1" / "model.onnx").is_symlink()  # a container mount needs real files


def test_ngc_view_keeps_tensorrt_only_for_gpus_and_refuses_foreign_plans(tmp_path):
    view = repo_variants.ngc_view(tmp_path / "gpu", FIXTURES / "base", gpu=True,
                                  target=ServerTarget("24.10", "2.51.0", TARGET_TRT))
    assert (view / "enc_trt" / "1" / "model_sm90.plan").exists() and (view / "pipe_trt").exists()
    cpu = repo_variants.ngc_view(tmp_path / "cpu", FIXTURES / "base", gpu=False,
                                 target=ServerTarget("24.10", "2.51.0", TARGET_TRT))
    assert not (cpu / "enc_trt").exists() and not (cpu / "pipe_trt").exists() and (cpu / "pipe").exists()
    with pytest.raises(EngineError, match=re.escape("built by TensorRT 10.5.0; NGC trt11 runs 11.0.0")):
        repo_variants.ngc_view(tmp_path / "trt11", FIXTURES / "base", gpu=True,
                               target=ServerTarget("trt11", "?", "11.0.0"))


def test_ngc_view_never_overwrites_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    with pytest.raises(FileExistsError):
        repo_variants.ngc_view(tmp_path / "mine", FIXTURES / "base")
