"""The documentation (README.md and docs/*.md) against the code it describes: every relative link and image
resolves (and every #anchor to a heading), every repository path and ``engine.*`` name it quotes exists, every
setting of engine/settings.py's SETTINGS has exactly one table row, every named API endpoint registered in
playground/ has exactly one row in docs/api.md, every screenshot in docs/ is shown somewhere, the README stays
short, and the examples the docs show are the code the tests run (the stage recipe, the engine API)."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

from engine import settings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
API_PAGE = ROOT / "docs" / "api.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
# a path into the repository, as prose or inline code quotes it (not inside a longer path or word)
REPO_PATH = re.compile(r"(?<![\w/.~-])((?:engine|playground|tests|bench|deploy|presets|docs)/[\w/.*<>:-]*)")
DOTTED = re.compile(r"(?<![\w/.-])((?:engine|bench|deploy)(?:\.[A-Za-z_]\w*)+)")


def text(path: Path) -> str:
    return path.read_text("utf-8")


def prose(markdown: str) -> str:
    """The markdown without its fenced code blocks (their text is code, not links or headings)."""
    return FENCE.sub("", markdown)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    plain = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors as its text
    plain = plain.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", plain).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``, with GitHub's -1, -2... for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(prose(text(path))):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[str]:
    """Every link and image target in ``path``'s prose (inline code spans masked, so a bracket in code is not
    read as a link)."""
    body = INLINE_CODE.sub(lambda m: "x" * len(m.group()), prose(text(path)))
    return LINK.findall(body)


def table_rows(path: Path) -> list[list[str]]:
    """The cells of every table row in ``path``'s prose (header and separator rows included)."""
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")]
            for line in prose(text(path)).splitlines() if line.startswith("|")]


# --- links, images, anchors -----------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_image_resolves(page):
    found = links(page)
    assert found, f"{page.name}: no links found (the scan works)"
    broken = []
    for target in found:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... (none reach the network here)
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.is_file() or ROOT not in resolved.parents:
            broken.append(f"{target}: no such file in the repository")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{target}: no heading with that anchor in {resolved.name}")
    assert broken == []


def test_every_docs_page_is_linked_from_the_readme():
    targets = {(ROOT / t.partition("#")[0]).resolve() for t in links(README) if not t.startswith(("http", "#"))}
    pages = set((ROOT / "docs").glob("*.md"))
    assert pages and pages - targets == set()


def test_every_screenshot_is_shown_somewhere():
    """None lost: every picture in docs/ is an image of some page."""
    shown = {(page.parent / t.partition("#")[0]).resolve() for page in PAGES for t in links(page)}
    pictures = set((ROOT / "docs").glob("*.png"))
    assert len(pictures) >= 20 and {p.name for p in pictures - shown} == set()


def test_slugs_follow_github():
    assert slug("3. Public mode and limits (a room of 30-100 people)") == "3-public-mode-and-limits-a-room-of-30-100-people"
    assert slug("Quantization & KV cache") == "quantization--kv-cache"
    assert slug("Running `make test`") == "running-make-test"


# --- paths and names the pages quote -----------------------------------------------------------------------
def quoted_paths(page: Path) -> set[str]:
    out = set()
    for raw in REPO_PATH.findall(prose(text(page))):
        path = raw.split("::")[0].rstrip(".,:;")
        if "<" not in path:  # engine/stages/<family>.py is a placeholder
            out.add(path)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_quoted_repository_path_exists(page):
    paths = quoted_paths(page)
    missing = sorted(p for p in paths if not (list(ROOT.glob(p)) if "*" in p else (ROOT / p).exists()))
    assert missing == []


def module_file(parts: list[str]) -> tuple[Path, list[str]] | None:
    """The longest prefix of ``parts`` that is a module (a .py file or a package) and the names after it."""
    for k in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:k])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, parts[k:]
    return None


def defines(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The statement of ``body`` that binds ``name`` (def, class, assignment or import), if any."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name.split(".")[0]) == name
                                                                     for a in node.names):
            return node
        if isinstance(node, (ast.If, ast.Try)):  # if TYPE_CHECKING: / try: imports
            inner = defines(node.body, name)
            if inner is not None:
                return inner
    return None


def resolves(dotted: str) -> bool:
    """``engine.x.y.Name.attr``: a module file, then names it defines (a class's own attributes too), read
    from the source without importing it."""
    found = module_file(dotted.split("."))
    if found is None:
        return False
    path, names = found
    body = ast.parse(path.read_text("utf-8")).body
    for i, name in enumerate(names):
        node = defines(body, name)
        if node is None:
            return False
        if i + 1 < len(names):
            if not isinstance(node, ast.ClassDef):
                return True  # an attribute of a function's result or an instance: beyond a static read
            body = node.body
    return True


def test_the_name_reader_works():
    assert resolves("engine.backends.served.RemoteSpec.parse") and resolves("engine.config.KNOBS")
    assert resolves("engine.strategies.medusa_train") and resolves("bench.concurrency")
    assert not resolves("engine.served_decode.run_step") and not resolves("engine.backends.served.RemoteSpec.nothing")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_quoted_engine_name_exists(page):
    names = {m.rstrip(".") for span in INLINE_CODE.findall(prose(text(page))) for m in DOTTED.findall(span)}
    assert sorted(n for n in names if not resolves(n)) == []


# --- settings, endpoints, the README --------------------------------------------------------------------
def test_every_setting_has_exactly_one_row_in_the_docs():
    rows = [(page.name, cells[0]) for page in PAGES for cells in table_rows(page)]
    for setting in settings.SETTINGS:
        where = [name for name, first in rows if first == f"`{setting.name}`"]
        assert len(where) == 1, f"{setting.name}: {len(where)} table rows ({where}); expected one"
        assert where != ["README.md"], f"{setting.name}: documented in the README, not in docs/"
    documented = {first.strip("`") for _, first in rows if re.fullmatch(r"`DP_[A-Z_]+`", first)}
    assert documented - set(settings.BY_NAME) == set()  # no row for a setting the code no longer has


def registered_endpoints() -> list[str]:
    """The names every ``events.api(fn, "name")`` / ``data_api(fn, "name")`` call in playground/ registers."""
    calls = re.compile(r"\b(?:events\.api|data_api)\(")
    named = re.compile(r"\b(?:events\.api|data_api)\(\s*(?:[^,()]|\([^()]*\))+,\s*\"([a-z_]+)\"")
    names, sites = [], 0
    for path in sorted((ROOT / "playground").rglob("*.py")):
        source = "\n".join(line for line in path.read_text("utf-8").splitlines() if not line.lstrip().startswith("def "))
        sites += len(calls.findall(source))
        names += named.findall(source)
    assert sites == len(names) and len(names) >= 10, "every registration call's name was read"
    return names


def test_every_api_endpoint_has_exactly_one_row_in_api_md():
    names = registered_endpoints()
    assert len(names) == len(set(names)) and "step_trace" in names
    rows = [cells[0] for cells in table_rows(API_PAGE)]
    for name in names:
        assert rows.count(f"`/{name}`") == 1, f"/{name}: {rows.count(f'`/{name}`')} rows in docs/api.md"
    listed = {first.strip("`/") for first in rows if re.fullmatch(r"`/[a-z_]+`", first)}
    assert listed - set(names) == set()  # no row for an endpoint the app no longer has


def test_the_readme_is_short_and_gives_the_two_commands():
    readme = text(README)
    assert len(readme.splitlines()) < 200
    assert "make run" in readme and "make test" in readme


# --- the examples the docs show are the tested code --------------------------------------------------------
def code_blocks(path: Path, language: str) -> list[str]:
    """The fenced blocks of ``language`` in ``path`` (a block indented under a list item dedented)."""
    return [textwrap.dedent(b) for b in re.findall(rf"^[ \t]*```{language}\n(.*?)^[ \t]*```", text(path), re.M | re.S)]


def top_level(source: str) -> dict[str, str]:
    """Each top-level class and function of ``source`` by name, and each ``StageSpec("name", ...)`` call as
    "StageSpec name"."""
    out: dict = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            out[node.name] = ast.get_source_segment(source, node)
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "StageSpec" and call.args:
                out.setdefault(f"StageSpec {getattr(call.args[0], 'value', '')}", call)
    return out


def test_the_stage_recipe_is_the_tested_example():
    """docs/architecture.md's tail-free stage, its spec and its test are tests/engine/test_stage_spec.py's, word for
    word (the spec's ``oracle`` aside: the docs name where a contributor puts the test)."""
    blocks = [top_level(b) for b in code_blocks(ARCHITECTURE, "python") if "TailFree" in b]
    docs = {k: v for b in blocks for k, v in b.items()}
    tested = top_level(text(ROOT / "tests" / "engine" / "test_stage_spec.py"))
    assert docs["TailFree"] == tested["TailFree"]
    assert docs["test_tail_free_by_hand"] == tested["test_tail_free_by_hand"]

    def without_oracle(call: ast.Call) -> str:
        return ast.dump(ast.Call(call.func, call.args, [k for k in call.keywords if k.arg != "oracle"]))

    assert without_oracle(docs["StageSpec tail_free"]) == without_oracle(tested["StageSpec tail_free"])


def test_the_strategy_recipe_is_the_tested_example():
    """docs/architecture.md's toy strategy (its record, stream, cross-check and spec) is
    tests/engine/test_strategy_spec.py's, word for word."""
    blocks = [b for b in code_blocks(ARCHITECTURE, "python") if "toy_rank" in b]
    assert len(blocks) == 1
    docs, tested = ast.parse(blocks[0]), ast.parse(text(ROOT / "tests" / "engine" / "test_strategy_spec.py"))
    named = {getattr(n, "name", None) or getattr(n.targets[0], "id", None): ast.dump(n) for n in tested.body
             if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.Assign))}
    shown = [n for n in docs.body if not isinstance(n, ast.Expr)]
    assert [getattr(n, "name", None) or n.targets[0].id for n in shown] == ["RankPick", "rank_stream", "check_rank", "TOY"]
    for node in shown:
        assert ast.dump(node) == named[getattr(node, "name", None) or node.targets[0].id]
    assert ast.unparse(docs.body[-1]) == "register(TOY)"


def test_the_recipes_use_the_specs_real_fields():
    """Every keyword the recipes pass to StageSpec, StrategySpec, Knob, Interop, Export or RunRequest is one of
    its fields."""
    import dataclasses

    from engine.runner import RunRequest
    from engine.stages import Export, Interop, Knob, StageSpec
    from engine.base.strategy_spec import StrategySpec

    kinds = {c.__name__: {f.name for f in dataclasses.fields(c)}
             for c in (StageSpec, StrategySpec, Knob, Interop, Export, RunRequest)}
    used = []
    for page in (ARCHITECTURE, API_PAGE):
        for block in code_blocks(page, "python"):
            for call in ast.walk(ast.parse(textwrap.dedent(block))):
                name = getattr(call, "func", None) and getattr(call.func, "id", "")
                if isinstance(call, ast.Call) and name in kinds:
                    used += [(name, k.arg) for k in call.keywords if k.arg is not None]
    assert {name for name, _ in used} >= {"StageSpec", "StrategySpec", "Knob", "Interop", "Export"}
    assert [(name, arg) for name, arg in used if arg not in kinds[name]] == []


def test_the_engine_api_example_runs(tiny_lm):
    """docs/api.md's engine example is this test's body (between the markers), run on a tiny model: the stream's
    steps and last trace are the run's, and a seeded run repeats."""
    lm = tiny_lm
    # --- docs/api.md: the engine API example
    from engine import runner
    from engine.config import DecodingConfig
    from engine.runner import RunRequest

    config = DecodingConfig(strategy="sample", temperature=0.8, top_p=0.9, seed=7, max_new_tokens=16)
    request = RunRequest(lm, "The sea is", config)
    steps = []
    for event in runner.stream(request):  # every strategy, one event type
        steps += event.steps  # StepTraces this event adds to the output (none for a beam search step)
        record = event.record  # the strategy's own typed record, or None (greedy / sampling)
        if event.trace is not None:  # the assembled Trace, on the last event only
            streamed = event.trace
    trace = runner.run(request)  # the stream collected
    # --- end of the example
    assert record is None and 1 <= len(steps) <= 16
    assert [s.chosen_token_id for s in steps] == streamed.generated_token_ids == trace.generated_token_ids
    assert trace.config["temperature"] == 0.8 and trace.steps[0].draw is not None

    source = Path(__file__).read_text("utf-8")
    example = source.split("# --- docs/api.md: the engine API example\n")[1].split("    # --- end of the example")[0]
    assert textwrap.dedent(example) in code_blocks(API_PAGE, "python")
