"""The import structure of tritonkit: no circles among its modules, lower layers never importing higher ones
(imports inside functions and under TYPE_CHECKING count: they hide a dependency, they do not remove it), at most
MAX_TOP_LEVEL_MODULES modules beside the stage packages, and the code that runs inside Triton's stubs (serving/,
the Python backends, the generated model shims) loading nothing of ours but serving/, errors and paths."""

from __future__ import annotations

import ast

from tritonkit import paths

PACKAGE = paths.ROOT / "tritonkit"
MAX_TOP_LEVEL_MODULES = 12
# What stub-side code may import besides tritonkit.serving: no build, quantization, repository or perf code in a stub.
# envinfo (stdlib and errors only): a stub reads the CPU class of the node it runs on (its INT8 session's exact path).
STUB_IMPORTS = {"tritonkit.errors", "tritonkit.paths", "tritonkit.envinfo"}
# The units of tritonkit (a package under tritonkit/, or a top-level module), from the bottom up: a unit imports
# units of lower layers only, never one of its own layer or above. A new unit must be placed here.
LAYERS = (
    ("tritonkit", "errors"),  # tritonkit/__init__.py imports nothing
    ("paths", "envinfo", "release", "export"),  # facts and helpers every stage reads
    ("data",),  # evaluation and calibration data
    ("fingerprint",),  # what a build stage's artefact depends on (its code, found by imports; the data)
    ("serving",),  # code inside Triton's stubs
    ("kinds",),  # specs, gates, one class per kind
    ("int8",),
    ("repository",),  # configs, generation, views, runtime choice
    ("tensorrt", "build", "add"),  # plans; the build command; writing a spec (checks it against generated names)
    ("runtime",),  # the server process, preflight (reads build stamps), the GPU view
    ("perf",),  # lab, load, baselines, peers, tune (build what they measure)
    ("deploy",),  # Kubernetes and monitoring rendering
)


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


def unit(module: str) -> str:
    """tritonkit.int8.search → int8, tritonkit.build → build, tritonkit → tritonkit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """'a -> b' for every import of a unit of the same layer or a higher one."""
    rank = {u: i for i, layer in enumerate(layers) for u in layer}
    return [f"{m} -> {t}" for m in sorted(graph) for t in sorted(graph[m])
            if unit(m) != unit(t) and rank[unit(t)] >= rank[unit(m)]]


def stub_leaks(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """serving/ module → what it imports outside serving/ and STUB_IMPORTS."""
    out = {m: sorted(t for t in targets if unit(t) != "serving" and t not in STUB_IMPORTS)
           for m, targets in graph.items() if unit(m) == "serving"}
    return {m: leaks for m, leaks in sorted(out.items()) if leaks}


def test_circle_finder_finds_a_hidden_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_layer_and_stub_checks_find_violations():
    graph = {"tritonkit.kinds.base": {"tritonkit.int8.quantize", "tritonkit.serving.packing"},
             "tritonkit.int8.quantize": {"tritonkit.kinds.gates", "tritonkit.tensorrt.engines"},
             "tritonkit.tensorrt.engines": {"tritonkit.build"},
             "tritonkit.serving.packing": {"tritonkit.errors", "tritonkit.data"}}
    assert upward_imports(graph) == ["tritonkit.int8.quantize -> tritonkit.tensorrt.engines",
                                     "tritonkit.kinds.base -> tritonkit.int8.quantize",
                                     "tritonkit.tensorrt.engines -> tritonkit.build"]
    assert stub_leaks(graph) == {"tritonkit.serving.packing": ["tritonkit.data"]}


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_every_unit_has_a_layer_and_lower_layers_never_import_higher_ones():
    graph = import_graph()
    placed = {u for layer in LAYERS for u in layer}
    assert {unit(m) for m in graph} - placed == set()
    assert upward_imports(graph) == []


def test_at_most_twelve_top_level_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules


def test_stub_code_imports_only_stub_side_modules():
    """serving/ imports nothing of ours but serving/, errors, paths and envinfo."""
    assert stub_leaks(import_graph()) == {}


def test_backends_and_model_shims_import_only_stub_side_code():
    """The Python backends (backends/*/model.py) and the generated shims (model_repository/*/1/model.py)."""
    found = {}
    for path in sorted(paths.ROOT.glob("backends/*/model.py")) + sorted(paths.MODEL_REPOSITORY.glob("*/1/model.py")):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        ours = {n for n in names if n.split(".")[0] == "tritonkit"}
        bad = sorted(n for n in ours if unit(n) != "serving" and n not in STUB_IMPORTS)
        if bad:
            found[paths.rel(path)] = bad
    assert found == {}
