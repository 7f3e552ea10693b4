"""Issues #28, #36 and #51: no import circle in playground/ or engine/ (views import charts, whatif,
presenter one way only; no view imports another view), and the engine's floors: a module imports
only from its own floor or below (FLOORS, lowest first; docs/architecture.md draws them). Every import
counts, at the top of a file or inside a function (an import put in a function to dodge a circle
is still a circle), and so does every package face it runs: ``import engine.strategies.spec`` runs
``engine/strategies/__init__.py`` first, which imports every strategy module, so it is an arrow to
``engine.strategies`` too (a module's own packages are left out: Python runs them before the module
whoever imports it). Only imports under ``if TYPE_CHECKING:`` are left out: they never run (they
name a type for the type checker)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                 for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
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
            for face in faces(target):  # the module and each package __init__ that runs before it
                if face in modules and face != name and not name.startswith(face + "."):
                    found.add(face)
    return found


def faces(target: str) -> list[str]:
    """``target`` and the packages above it, whose ``__init__.py`` Python runs first
    (``a.b.c`` -> ``a.b.c``, ``a.b``, ``a``)."""
    parts = target.split(".") if target else []
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def package_graph(package: str) -> dict[str, set[str]]:
    files = sorted((ROOT / package).rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def playground_graph() -> dict[str, set[str]]:
    return package_graph("playground")


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


def test_type_only_imports_are_left_out_and_function_imports_count(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n"
                              "def f():\n    from pkg import c\n")
    (pkg / "b.py").write_text("")
    (pkg / "c.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert imports_of(pkg / "a.py", {"pkg", "pkg.a", "pkg.b", "pkg.c"}) == {"pkg.c"}


def test_no_import_circle_in_engine():
    """#36: the engine's rooms (stages, strategies, backends, reports, the core) form no circle,
    counting imports inside functions (the trace reads its records from the strategy specs; the
    registry, not the loaded-model module, knows served models)."""
    graph = package_graph("engine")
    assert "engine.strategies.beam" in graph and "engine.backends.registry" in graph  # the rooms are real
    assert cycles(graph) == []


# The engine's floors, lowest first: a module imports from its own floor and the floors below, never
# from one above (a climb). A name covers the module and everything under it; "engine" (the package
# face: importing anything under engine/ registers every stage and strategy) only itself.
FLOORS = (
    ("leaves", ("engine.settings", "engine.numbers", "engine.threads", "engine.control", "engine.sampling")),
    ("base", ("engine.base",)),  # the knobs, the stage and strategy specs and registries, the model seam
    ("stages", ("engine.stages",)),
    ("core", ("engine.config", "engine.trace", "engine.chain", "engine.cache", "engine.core", "engine.presets",
              "engine.sharelink", "engine.interop")),
    ("backends", ("engine.backends",)),
    ("strategies", ("engine.strategies", "engine.explore")),
    ("reports", ("engine.reports",)),
    ("top", ("engine.runner", "engine.scheduler", "engine.__main__", "engine")),
)


def floor_of(module: str) -> int:
    """The index in FLOORS of ``module``'s floor (ValueError for a module no floor names)."""
    for index, (_, names) in enumerate(FLOORS):
        if any(module == n or (n != "engine" and module.startswith(n + ".")) for n in names):
            return index
    raise ValueError(f"{module}: on no floor; add it to FLOORS (tests/project/test_import_graph.py) and docs/architecture.md")


def climbs(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every arrow from a module to a module on a higher floor."""
    return sorted((name, target) for name, targets in graph.items() for target in targets
                  if floor_of(target) > floor_of(name))


def test_faces_count_and_climbs_are_seen(tmp_path, monkeypatch):
    """An import of ``pkg.room.spec`` runs ``pkg/room/__init__.py``: an arrow to ``pkg.room`` too, so a
    loop through a package face is a loop; the importer's own packages are not arrows."""
    pkg = tmp_path / "pkg"
    (pkg / "room").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("from pkg.room.spec import X\n")
    (pkg / "room" / "__init__.py").write_text("from pkg.room import impl\n")
    (pkg / "room" / "spec.py").write_text("X = 1\n")
    (pkg / "room" / "impl.py").write_text("from pkg.config import X\nfrom pkg.room import spec\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = package_graph("pkg")
    assert graph["pkg.config"] == {"pkg.room", "pkg.room.spec"}
    assert graph["pkg.room.impl"] == {"pkg.config", "pkg.room.spec"}
    assert cycles(graph) == [["pkg.config", "pkg.room", "pkg.room.impl", "pkg.config"]]
    assert climbs({"engine.config": {"engine.strategies.spec"}, "engine.strategies.spec": {"engine.base.knobs"}}) \
        == [("engine.config", "engine.strategies.spec")]


def test_the_engine_has_floors_without_climbs():
    """#51: every engine module is on a floor (FLOORS) and imports nothing from a floor above it."""
    graph = package_graph("engine")
    assert graph["engine.config"] and graph["engine.strategies"]  # the graph is real
    for name in graph:
        floor_of(name)
    assert climbs(graph) == []


def test_the_engine_is_in_rooms():
    """#36: stages, strategies, backends and reports each a package; the core stays a handful of files."""
    rooms = {p.name for p in (ROOT / "engine").iterdir() if (p / "__init__.py").exists()}
    assert {"stages", "strategies", "backends", "reports"} <= rooms
    core = [p.name for p in (ROOT / "engine").glob("*.py")]
    assert len(core) <= 20, sorted(core)


def test_no_import_circle_in_playground():
    graph = playground_graph()
    assert "playground.views.step" in graph and graph["playground.views.step"]  # the graph is real
    assert cycles(graph) == []


WHATIF_MODULES = ("playground.panels.presenter", "playground.views.step", "playground.panels.whatif",
                  "playground.whatif_service")


def test_charts_never_import_views_or_the_whatif_service():
    """#28: views, panels (and the what-if service) import charts, never the reverse."""
    graph = playground_graph()
    charts = [name for name in graph if name.startswith("playground.charts")]
    assert "playground.charts.presenter" in charts
    for name in charts:
        upward = {t for t in graph[name] if t.startswith(("playground.views", "playground.panels"))
                  or t == "playground.whatif_service"}
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
    assert "playground.panels.whatif" in graph["playground.views.step"]
    assert "playground.whatif_service" in graph["playground.views.step"]
    assert not {t for t in graph["playground.whatif_service"] if t.startswith("playground.views")}
    assert "playground.views.step" not in graph["playground.panels.whatif"] | graph["playground.panels.presenter"]
    assert "playground.panels.whatif" not in graph["playground.panels.presenter"]


def view_of(module: str) -> str | None:
    """The view a playground module belongs to: ``step`` for playground.views.step, ``compare`` for
    any module of the playground.views.compare package; None outside playground/views/."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["playground", "views"] else None


def test_no_view_imports_another_view():
    """#36: a view imports no other view, at the top of a file or inside a function (a view's own
    package, Compare's modules, may import each other); what several views embed is a panel
    (playground/panels/), and the Lessons tab reaches the pages it opens through shared.LessonTarget,
    which the app hands over."""
    graph = playground_graph()
    views = {view_of(name) for name in graph} - {None}
    assert {"step", "compare", "lessons", "quantization"} <= views  # the graph is real
    assert {"playground.panels.presenter", "playground.panels.whatif"} <= set(graph)
    crossing = sorted((name, target) for name, targets in graph.items() for target in targets
                      if view_of(name) and view_of(target) and view_of(target) != view_of(name))
    assert crossing == []


def test_the_view_rule_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    pkg = tmp_path / "playground"
    (pkg / "views").mkdir(parents=True)
    for name in ("__init__.py", "views/__init__.py", "views/b.py"):
        (pkg / name).write_text("")
    (pkg / "views" / "a.py").write_text("def f():\n    from . import b\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = package_graph("playground")
    assert graph["playground.views.a"] == {"playground.views.b"}
    assert view_of("playground.views.a") != view_of("playground.views.b")


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
