"""Issue #28: no import circle in playground/ (views import charts, whatif, presenter one way only).
Every import of a playground module counts, at the top of a file or inside a function (an import
put in a function to dodge a circle is still a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def playground_graph() -> dict[str, set[str]]:
    files = sorted((ROOT / "playground").rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_detector_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_playground():
    graph = playground_graph()
    assert "playground.views.step" in graph and graph["playground.views.step"]  # the graph is real
    assert cycles(graph) == []


WHATIF_MODULES = ("playground.views.presenter", "playground.views.step", "playground.views.whatif",
                  "playground.whatif_service")


def test_charts_never_import_views_or_the_whatif_service():
    """#28: views (and the what-if service) import charts, never the reverse."""
    graph = playground_graph()
    charts = [name for name in graph if name.startswith("playground.charts")]
    assert "playground.charts.presenter" in charts
    for name in charts:
        upward = {t for t in graph[name] if t.startswith("playground.views") or t == "playground.whatif_service"}
        assert not upward, name


def test_the_whatif_modules_import_at_the_top_and_one_way():
    """#28: presenter, step, whatif and the service import each other at the top of the file only
    (no import inside a function to dodge a circle), and one way: step -> whatif -> service ->
    charts; nothing imports step from them, and the service imports no view."""
    graph = playground_graph()
    for name in WHATIF_MODULES:
        path = ROOT / (name.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text(), str(path))
        for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            inner = [n for n in ast.walk(func) if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not inner, f"{name}.{func.name} imports inside a function (line {inner[0].lineno})"
    assert "playground.views.whatif" in graph["playground.views.step"]
    assert "playground.whatif_service" in graph["playground.views.step"]
    assert not {t for t in graph["playground.whatif_service"] if t.startswith("playground.views")}
    assert "playground.views.step" not in graph["playground.views.whatif"] | graph["playground.views.presenter"]
    assert "playground.views.whatif" not in graph["playground.views.presenter"]


def test_only_the_service_writes_the_kept_logits():
    """#28: a session's kept logits are written by WhatIfService alone (under the session's lock)."""
    writers = set()
    for path in sorted((ROOT / "playground").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and part.attr == "kept":
                        writers.add(module_name(path))
    assert writers == {"playground.whatif_service"}
