"""A build stage's fingerprint covers the code it runs (tritonkit.fingerprint): the sources are derived from the
imports of the modules tritonkit.build calls, so editing any of them rebuilds the stage's artefact, and editing code
outside the layers a stage may import (perf, repository, runtime) does not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tritonkit import fingerprint, kinds, paths


@pytest.fixture(scope="module")
def int8_entries() -> list[str]:
    """The module names fingerprint.stage hands to fingerprint.digest for the INT8 stage (recorded, not restated)."""
    calls = []
    real = fingerprint.digest
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fingerprint, "digest", lambda items, **kw: calls.append(list(items)) or real(items, **kw))
        fingerprint.stage(kinds.get("text_embedding"), "int8")
    assert len(calls) == 1
    return [item for item in calls[0] if isinstance(item, str)]


@pytest.fixture(scope="module")
def copy_root(tmp_path_factory) -> Path:
    """The tritonkit/ tree copied, to edit freely."""
    root = tmp_path_factory.mktemp("repo")
    shutil.copytree(paths.ROOT / "tritonkit", root / "tritonkit", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _append(path: Path, text: str = "# edited\n") -> bytes:
    original = path.read_bytes()
    path.write_bytes(original + text.encode())
    return original


def test_the_int8_stage_covers_the_modules_the_hand_written_list_missed(int8_entries):
    assert "tritonkit.int8.pipeline" in int8_entries
    covered = {p.relative_to(paths.ROOT).as_posix() for p in fingerprint.sources(int8_entries)}
    missed = {f"tritonkit/int8/{m}.py" for m in ("rounding", "params", "tensors", "evaluate", "floor")}
    assert missed <= covered, sorted(missed - covered)
    # The former list and the kind's own code stay covered.
    former = {f"tritonkit/int8/{m}.py" for m in ("settings", "transforms", "calibration", "quantize", "checks",
                                                  "search", "recipe")}
    assert former | {"tritonkit/export.py", "tritonkit/kinds/text.py"} <= covered
    assert not any(p.startswith(("tritonkit/perf/", "tritonkit/repository/", "tritonkit/runtime/")) for p in covered)
    assert "tritonkit/build.py" not in covered


def test_the_fp32_stage_does_not_hash_int8_code():
    calls = []
    real = fingerprint.digest
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fingerprint, "digest", lambda items, **kw: calls.append(list(items)) or real(items, **kw))
        fingerprint.stage(kinds.get("text_embedding"), "fp32")
    names = [item for item in calls[0] if isinstance(item, str)]
    covered = {p.relative_to(paths.ROOT).as_posix() for p in fingerprint.sources(names)}
    assert {"tritonkit/export.py", "tritonkit/kinds/text.py", "tritonkit/kinds/base.py"} <= covered
    assert not any(p.startswith("tritonkit/int8/") for p in covered)


def test_editing_any_int8_stage_source_changes_the_digest(int8_entries, copy_root):
    files = fingerprint.sources(int8_entries, root=copy_root)
    assert len(files) >= 20  # the walk found the stage's code, not just its entries
    before = fingerprint.digest(int8_entries, root=copy_root)
    unchanged = []
    for path in files:
        original = _append(path)
        try:
            if fingerprint.digest(int8_entries, root=copy_root) == before:
                unchanged.append(path.relative_to(copy_root).as_posix())
        finally:
            path.write_bytes(original)
    assert unchanged == []
    assert fingerprint.digest(int8_entries, root=copy_root) == before  # restored: the same digest again


def test_extra_and_a_renamed_entry_set_change_the_digest(int8_entries, copy_root):
    before = fingerprint.digest(int8_entries, root=copy_root)
    assert fingerprint.digest(int8_entries, root=copy_root, extra=b"recipe") != before
    assert fingerprint.digest(["tritonkit.export"], root=copy_root) != before


def test_code_outside_the_walk_does_not_change_the_digest(int8_entries, copy_root):
    lab = copy_root / "tritonkit" / "perf" / "lab.py"
    recipe = copy_root / "tritonkit" / "int8" / "recipe.py"
    # Even imported from the stage's code, perf/ is not followed (nor are repository/, runtime/, build).
    original_recipe = _append(recipe, "\n\ndef _lab():\n    from tritonkit.perf import lab\n    return lab\n")
    try:
        before = fingerprint.digest(int8_entries, root=copy_root)
        assert lab not in fingerprint.sources(int8_entries, root=copy_root)
        original_lab = _append(lab)
        try:
            assert fingerprint.digest(int8_entries, root=copy_root) == before
        finally:
            lab.write_bytes(original_lab)
    finally:
        recipe.write_bytes(original_recipe)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_imports_in_function_bodies_relative_and_from_imports_are_followed(tmp_path):
    _write(tmp_path, {
        "tritonkit/__init__.py": "",
        "tritonkit/errors.py": "",
        "tritonkit/int8/__init__.py": "",
        "tritonkit/int8/entry.py": "import numpy\n\n\ndef late():\n    from tritonkit.int8 import hidden\n"
                                   "    return hidden\n\n\ndef other():\n    from tritonkit.perf import lab\n",
        "tritonkit/int8/hidden.py": "from . import sibling\nfrom tritonkit.int8.deep import VALUE\n",
        "tritonkit/int8/sibling.py": "try:\n    import tritonkit.errors\nexcept ImportError:\n    pass\n",
        "tritonkit/int8/deep.py": "VALUE = 1\n",
        "tritonkit/int8/unused.py": "",
        "tritonkit/perf/__init__.py": "",
        "tritonkit/perf/lab.py": "",
    })
    found = [p.relative_to(tmp_path).as_posix() for p in fingerprint.sources(["tritonkit.int8.entry"], root=tmp_path)]
    assert found == ["tritonkit/errors.py", "tritonkit/int8/__init__.py", "tritonkit/int8/deep.py",
                     "tritonkit/int8/entry.py", "tritonkit/int8/hidden.py", "tritonkit/int8/sibling.py"]
    before = fingerprint.digest(["tritonkit.int8.entry"], root=tmp_path)
    _append(tmp_path / "tritonkit" / "int8" / "hidden.py")  # reached only through late()'s import
    assert fingerprint.digest(["tritonkit.int8.entry"], root=tmp_path) != before


def test_an_entry_that_is_not_a_module_is_an_error(tmp_path):
    with pytest.raises(LookupError, match=r"no module tritonkit\.int8\.nothing"):
        fingerprint.sources(["tritonkit.int8.nothing"], root=tmp_path)
