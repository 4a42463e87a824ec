"""requirements.lock is what `make setup` installs: every package pinned with hashes, every direct dependency of
requirements.txt in it within its stated range, no machine's paths or index URLs, and the running venv equal to it."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tritonkit import paths

REQUIREMENTS = paths.ROOT / "requirements.txt"
LOCK = paths.ROOT / "requirements.lock"
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})$")


def _logical_lines(path: Path) -> list[str]:
    """Requirement lines with continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = (line.split(" #", 1)[0].strip() for line in text.splitlines() if not line.lstrip().startswith("#"))
    return [line for line in lines if line]


def _locked() -> dict[str, tuple[Requirement, list[str]]]:
    """Canonical name -> (pinned requirement, its sha256 hashes)."""
    entries = {}
    for line in _logical_lines(LOCK):
        spec, *options = line.split()
        # Indexes and find-links come from pip's own config at install time, never from the lock.
        assert not spec.startswith("-"), f"requirements.lock: option line {line!r}"
        hashes = [m.group(1) for m in map(HASH.match, options) if m]
        assert len(hashes) == len(options), f"requirements.lock: {spec}: options other than --hash=sha256: {options}"
        req = Requirement(spec)
        entries[canonicalize_name(req.name)] = (req, hashes)
    return entries


def _pin(req: Requirement) -> Version:
    (clause,) = req.specifier
    assert clause.operator == "==", f"requirements.lock: {req} is not pinned with =="
    return Version(clause.version)


def test_every_locked_package_is_pinned_with_hashes():
    locked = _locked()
    assert len(locked) > 50, f"requirements.lock holds {len(locked)} packages; expected the whole transitive set"
    for name, (req, hashes) in locked.items():
        _pin(req)
        assert hashes, f"requirements.lock: {name} has no --hash (pip --require-hashes would refuse the lock)"


def test_direct_dependencies_are_locked_within_their_ranges():
    locked = _locked()
    for line in _logical_lines(REQUIREMENTS):
        want = Requirement(line)
        name = canonicalize_name(want.name)
        assert name in locked, f"requirements.txt: {want.name} is not in requirements.lock; run `make lock`"
        got, _ = locked[name]
        assert want.specifier.contains(_pin(got), prereleases=True), (
            f"requirements.lock pins {got} outside requirements.txt's {want}; run `make lock`")
        for extra in want.extras:
            for dep in _extra_only_requirements(want.name, extra):
                assert canonicalize_name(dep.name) in locked, (
                    f"requirements.lock lacks {dep.name}, which {want} needs; run `make lock`")


def _extra_only_requirements(dist: str, extra: str) -> list[Requirement]:
    """What the installed `dist` needs for `extra` alone on this platform (the lock lists them, not the extra)."""
    deps = [Requirement(r) for r in metadata.requires(dist) or []]
    return [d for d in deps if d.marker and d.marker.evaluate({"extra": extra})
            and not d.marker.evaluate({"extra": ""})]


def test_lock_names_no_machine_paths_or_indexes():
    text = LOCK.read_text()
    for needle in ("file:", "://", "--find-links", "--index-url", "--extra-index-url", " /"):
        assert needle not in text, f"requirements.lock contains {needle!r}; pip's own config supplies indexes"


def test_running_environment_is_the_locked_one():
    drift = []
    for name, (req, _) in _locked().items():
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            drift.append(f"{name}: locked {_pin(req)}, not installed")
            continue
        if installed != _pin(req):
            drift.append(f"{name}: locked {_pin(req)}, installed {installed}")
    assert not drift, "environment differs from requirements.lock (run `make setup`):\n" + "\n".join(drift)
