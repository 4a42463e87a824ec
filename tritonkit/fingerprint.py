"""The source files a build stage's artefact depends on, derived from its imports (tritonkit.build's fingerprints).

    sources(["tritonkit.int8.recipe"]) → sorted paths of that module and of every tritonkit module it imports
    digest(["tritonkit.int8.recipe", spec_file], extra=b"...") → 16 hex characters of a sha256 over those files

`sources(entries, root)` takes module names and returns the files, under `root` (the repository root by default),
of the entries, of every module they import (anywhere in a file: inside functions and under TYPE_CHECKING too),
transitively, and of the packages those live in; the walk follows only FOLLOWED. Source is parsed, never imported.
Imports by string (importlib) are not seen: pass such modules (a kind's class) as entries.
`digest(items, root, extra)` takes module names (walked as by sources) and file paths, and returns the sha256 hex
(first 16) of each file's path relative to `root` (its name, outside it) and bytes, in sorted order, then `extra`.
`stage(kind, stage, extra)` is a build stage's fingerprint; `up_to_date`/`stamp`/`unstamp` keep it beside the
stage's artefact (build/artifacts/<name>.<stage>.fingerprint), so an unchanged stage is not rebuilt.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from pathlib import Path

# The repository root: the directory tritonkit/ lives in.
ROOT = Path(__file__).resolve().parent.parent
# The modules a stage's code starts from: what tritonkit.build calls for it (the INT8 stage is one pipeline).
STAGE_ENTRIES = {"fp32": ("tritonkit.export",), "int8": ("tritonkit.export", "tritonkit.int8.pipeline"),
                 # a packed graph is proven against the INT8 gates where its source graph is INT8
                 "packed": ("tritonkit.export", "tritonkit.serving.packing", "tritonkit.int8.gates",
                            "tritonkit.int8.evaluate")}
# What a stage's code may import by the layering (tests/test_layers.py): the units above int8 (repository, tensorrt,
# build, runtime, perf, deploy) use artefacts and cannot be imported by the code that makes them.
FOLLOWED = ("tritonkit.int8", "tritonkit.kinds", "tritonkit.serving", "tritonkit.data",
            "tritonkit.export", "tritonkit.errors", "tritonkit.paths", "tritonkit.envinfo")


def _followed(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in FOLLOWED)


def _file(name: str, root: Path) -> Path | None:
    """The module's file under root (a package's __init__.py), or None when it is not ours (numpy, a function)."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_name(base.name + ".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _statements(nodes) -> Iterable[ast.AST]:
    """Every statement in `nodes`, nested ones included (function bodies, if/try/with/match blocks)."""
    for node in nodes:
        yield node
        # An import is a statement: expressions, most of a file's nodes, cannot hold one and are not walked.
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            yield from _statements(getattr(node, block, None) or ())


def _imports(name: str, path: Path, root: Path) -> set[str]:
    """The modules of ours that `name` (at `path`) imports anywhere in its body."""
    # A package's relative imports start from itself; a module's from the package it is in.
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _statements([ast.parse(path.read_bytes(), filename=str(path))]):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from pkg import mod` imports pkg.mod; `from mod import name` imports mod.
            targets = [f"{base}.{a.name}" if _file(f"{base}.{a.name}", root) else base for a in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` with c not a module of ours (or a third-party name) still runs what of it is ours.
            while target and _file(target, root) is None:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found


def sources(entries: Iterable[str], root: Path | str = ROOT) -> list[Path]:
    """Sorted files of `entries` and of the FOLLOWED modules they import, transitively (see the module's doc)."""
    root = Path(root)
    pending, seen, files = list(entries), set(), {}
    for entry in pending:
        if _file(entry, root) is None:
            raise LookupError(f"no module {entry} under {root}")
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _file(name, root)
        files[name] = path
        # Importing a.b.c runs a.b's __init__ first: its code is the module's too.
        parent = name.rpartition(".")[0]
        if parent and _followed(parent) and _file(parent, root):
            pending.append(parent)
        pending.extend(t for t in _imports(name, path, root) if _followed(t) and t not in seen)
    return sorted(files.values())


def digest(items: Iterable[str | Path], root: Path | str = ROOT, extra: bytes | str = b"") -> str:
    """sha256 hex (16 characters) of the files of module names in `items` (walked) and of its paths, then `extra`."""
    root = Path(root).resolve()
    items = list(items)
    names = [i for i in items if isinstance(i, str)]
    paths = {Path(p).resolve() for p in items if not isinstance(p, str)}
    paths.update(p.resolve() for p in sources(names, root))
    h = hashlib.sha256()
    for path in sorted(paths):
        label = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
        data = path.read_bytes()
        # Name and length first: a byte moved from one file to the next, or a renamed file, changes the digest.
        h.update(f"{label}\0{len(data)}\0".encode())
        h.update(data)
    h.update(extra.encode() if isinstance(extra, str) else extra)
    return h.hexdigest()[:16]


def stage(kind, stage: str, extra: str = "") -> str:
    """Hash of everything a build stage's artefact depends on: the spec file, the data, the code of the kind and of
    the stage with every tritonkit module it imports (derived, so a module added later is not missed), `extra`."""
    import inspect
    import sys

    from tritonkit import data

    # The kind's class and its bases; one defined outside tritonkit (a test's subclass) is hashed as its file.
    kind_code = dict.fromkeys(c.__module__ for c in type(kind).__mro__ if c is not object)
    entries = [m if m.startswith("tritonkit.") else Path(inspect.getfile(sys.modules[m])) for m in kind_code]
    entries += STAGE_ENTRIES.get(stage.split(".")[0], STAGE_ENTRIES["fp32"])
    files = [Path(kind.spec.file), Path(data.SENTENCES), *map(Path, getattr(kind, "DATA_FILES", ()))]
    return digest([*entries, *files], extra=extra.encode())


def _stamp_path(name: str, stage: str) -> Path:
    from tritonkit import paths

    return paths.ARTIFACTS / f"{name}.{stage}.fingerprint"


def up_to_date(path: Path, name: str, stage: str, fingerprint: str) -> bool:
    stamp = _stamp_path(name, stage)
    return Path(path).exists() and stamp.exists() and stamp.read_text().strip() == fingerprint


def stamp(name: str, stage: str, fingerprint: str) -> None:
    path = _stamp_path(name, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(fingerprint + "\n")


def unstamp(name: str, stage: str) -> None:
    _stamp_path(name, stage).unlink(missing_ok=True)
