"""Issue #51: the tests are grouped by room, and what more than one test file uses lives in
tests/helpers/; no test file imports another test file or the conftest (pytest loads those under a
name of its own: importing them again loads a second copy, with its own module state)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOMS = ("backends", "browser", "engine", "playground", "project", "remote")


def imported_modules(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def test_every_test_file_is_in_a_room_folder_and_every_folder_is_a_package():
    assert not sorted(p.name for p in TESTS.glob("test_*.py")), "a test file at the top of tests/: put it in its room"
    rooms = sorted(p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))
    assert rooms == list(ROOMS)
    for folder in (TESTS, *(TESTS / room for room in ROOMS), TESTS / "helpers"):
        assert (folder / "__init__.py").is_file(), folder
    names = [p.name for p in TESTS.glob("*/test_*.py")]
    assert len(names) == len(set(names)), "two test files of one name in two rooms"


def test_no_test_file_or_helper_imports_a_test_file_or_the_conftest():
    bad = []
    for path in sorted([*TESTS.glob("*/test_*.py"), *TESTS.glob("helpers/*.py"), TESTS / "conftest.py"]):
        for module in imported_modules(path):
            last = module.rsplit(".", 1)[-1]
            if last.startswith("test_") or last == "conftest":
                bad.append(f"{path.relative_to(TESTS)} imports {module}")
    assert not bad, bad


def test_the_helpers_import_no_test_file_and_are_used():
    """A helper module nobody imports is dead code."""
    users = [m for p in TESTS.rglob("*.py") for m in imported_modules(p)]
    for helper in sorted(TESTS.glob("helpers/*.py")):
        if helper.name != "__init__.py":
            assert f"tests.helpers.{helper.stem}" in users, f"{helper.name} is imported by no test"
