"""The NGC releases: one table (tritonkit.release) that engines, deploy, native_check, the container files and the
docs all read; a release whose exact TensorRT the sources do not give needs TRITONKIT_TENSORRT, of its major."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

from tritonkit import paths, release
from tritonkit.errors import EngineError
from tritonkit.repository import native_check
from tritonkit.tensorrt import plans

FIXTURES = Path(__file__).parent / "fixtures" / "native"
TARGET = release.ServerTarget("24.10", "2.51.0", "10.5.0")


def test_every_module_reads_the_one_table():
    default = release.get(release.DEFAULT)
    assert (default.image, f"{release.IMAGE_NAME}:{default.ngc}") == (release.BASE_IMAGE, release.IMAGE)
    assert release.target_server is release.target_server and release.ServerTarget is release.ServerTarget
    assert native_check.RELEASE_BRANCH == default.branch == f"r{release.DEFAULT}"


def test_no_other_module_names_a_release():
    """A release literal anywhere else in the package would be a second source (docstrings may mention one)."""
    names = set(release.RELEASES) | {f"r{n}" for n in release.RELEASES}
    found = []
    for path in sorted((paths.ROOT / "tritonkit").rglob("*.py")):
        if path.name == "release.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        found += [f"{path.name}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value in names and id(n) not in docstrings]
    assert found == []


def test_container_files_and_docs_agree_with_the_table():
    dockerfile = (paths.ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG NGC_RELEASE=(\S+)$", dockerfile, re.M).group(1) == release.DEFAULT
    compose = (paths.ROOT / "docker" / "compose.yaml").read_text()
    assert set(re.findall(r"\$\{TRITONKIT_NGC_RELEASE:-([^}]+)\}", compose)) == {release.DEFAULT}
    for manifest in sorted((paths.ROOT / "deploy" / "k8s").glob("*/tritonkit.yaml")):
        assert set(re.findall(rf"image: {release.IMAGE_NAME}:(\S+)", manifest.read_text())) <= {release.DEFAULT}
    assert release.markdown_table() in (paths.ROOT / "docs" / "container.md").read_text()


def test_a_release_without_an_exact_tensorrt_needs_one_of_its_major(monkeypatch):
    monkeypatch.delenv(release.TENSORRT_ENV, raising=False)
    assert release.target_server("24.10") == release.ServerTarget("24.10", "2.51.0", "10.5.0")
    with pytest.raises(EngineError, match=r"26\.06 has no exact TensorRT version.*set TRITONKIT_TENSORRT"):
        release.target_server("26.06")
    assert release.target_server("26.06", "11.0.1") == release.ServerTarget("26.06", "2.70.0", "11.0.1")
    with pytest.raises(EngineError, match=re.escape("TRITONKIT_TENSORRT=10.5.0: NGC 26.07 runs TensorRT 11.x")):
        release.target_server("26.07", "10.5.0")
    monkeypatch.setenv(release.TENSORRT_ENV, "11.2.0")  # the newest release's TensorRT is not in the sources
    assert release.target_server("26.11").triton == "2.75.0"
    assert plans.recipe_for(release.target_server("26.06").tensorrt, "int8").strongly_typed  # no implicit INT8


def test_an_unknown_release_is_a_typed_error_naming_the_setting():
    with pytest.raises(release.ReleaseError) as err:
        release.get("99.01")
    assert err.value.field == release.RELEASE_ENV and "24.10" in str(err.value)
    assert release.selected({release.RELEASE_ENV: "99.01"}).triton is None
    assert release.selected({}).ngc == release.DEFAULT


def test_rule_urls_point_at_the_checked_releases_branch(monkeypatch, capsys):
    rule = native_check.RULES["ov.model_file"]
    assert rule.url_for(release.get("26.07")) == (
        "https://github.com/triton-inference-server/openvino_backend/blob/r26.07/src/openvino.cc")
    assert rule.url == rule.url_for(release.get(release.DEFAULT))
    # A CPU view needs no TensorRT, so a release without an exact one checks without TRITONKIT_TENSORRT.
    monkeypatch.setenv(release.RELEASE_ENV, "26.06")
    monkeypatch.delenv(release.TENSORRT_ENV, raising=False)
    assert native_check.main([str(FIXTURES / "base"), "--view", "ngc-cpu"]) == 0
    assert "NGC 26.06, rules as on the r26.06 branches" in capsys.readouterr().out


def test_refusals_print_the_source_on_the_checked_branch(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "base", repo)
    shutil.copyfile(FIXTURES / "ov.model_file" / "ov_enc" / "config.pbtxt", repo / "ov_enc" / "config.pbtxt")
    monkeypatch.setenv(release.RELEASE_ENV, "26.07")
    assert native_check.main([str(repo), "--view", "ngc-cpu"]) == 1
    out = capsys.readouterr().out
    assert "[ov.model_file: openvino_backend/src/openvino.cc (ModelState::ReadModel)]" in out
    assert "openvino_backend/blob/r26.07/src/openvino.cc" in out


def test_target_server_is_one_setting(monkeypatch):
    monkeypatch.delenv("TRITONKIT_NGC_RELEASE", raising=False)
    monkeypatch.delenv("TRITONKIT_TENSORRT", raising=False)
    assert release.target_server() == TARGET
    assert TARGET.image == "nvcr.io/nvidia/tritonserver:24.10-py3"
    monkeypatch.setenv("TRITONKIT_NGC_RELEASE", "99.01")
    with pytest.raises(EngineError, match="set TRITONKIT_TENSORRT"):
        release.target_server()
    monkeypatch.setenv("TRITONKIT_TENSORRT", "11.0.0")
    assert release.target_server().tensorrt == "11.0.0"


def test_builder_must_be_the_servers_tensorrt():
    release.check_builder("10.5.0.18", TARGET)  # build number beyond major.minor.patch does not matter
    for other in ("10.8.0", "10.5.1", "11.0.0"):
        with pytest.raises(EngineError, match=re.escape("build inside nvcr.io/nvidia/tritonserver:24.10-py3")):
            release.check_builder(other, TARGET)
    with pytest.raises(EngineError, match=re.escape("built by TensorRT 11.0.0")):
        release.check_plan_metadata({"tensorrt": "11.0.0"}, TARGET, "x.plan")
