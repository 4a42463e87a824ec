"""The import structure of tritonkit: no circles among its modules (imports inside functions and under
TYPE_CHECKING count: they hide circles, they do not remove them), and the code that runs inside Triton's stubs
loads only stub-side modules of ours (no build, quantization or perf code in a stub)."""

from __future__ import annotations

import ast

from tritonkit import paths

PACKAGE = paths.ROOT / "tritonkit"
# The small modules serving/ reads inside a stub: errors, paths, parameter and batching helpers, text and image
# decoding, the packed-batch layout.
STUB_SIDE = {f"tritonkit.{m}" for m in ("errors", "paths", "backend_utils", "batching", "textproc", "imaging",
                                        "packing")}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(paths.ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (path, ast.parse(path.read_text()))
    return out


def import_graph() -> dict[str, set[str]]:
    """module → the tritonkit modules it imports anywhere in its body."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, tree) in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                # `from pkg import mod` imports pkg.mod (and runs pkg/__init__, which counts as pkg)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_circle_finder_finds_a_hidden_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_stub_code_imports_only_stub_side_modules():
    graph = import_graph()
    stub = {m for m in graph if m.startswith("tritonkit.serving")} | STUB_SIDE
    leaks = {m: sorted(graph[m] - stub) for m in sorted(stub) if graph[m] - stub}
    assert leaks == {}
