"""The page's JavaScript and CSS as files (playground/static/, issue #28): each file is some constant's
text, its placeholders filled with the Python values named here; nothing is left unfilled; every
file parses in chromium (the ``js=`` snippets are functions, the page script runs on a blank page,
each CSS rule is kept); the Space folder ships them."""

import json
import re

import pytest

from engine.sharelink import SHARE_PARAM
from playground import app, assets, ids, knobs, page_js, share_links
from playground.assets import STATIC, AssetError, static_text
from playground.user_presets import CUSTOM
from playground.panels import presenter
from playground.views import inside, lessons, speculative

# (the constant Gradio gets, its file, the placeholders' values); a constant may hold another one.
JS_FUNCTIONS = [  # js= snippets: a function expression each
    (page_js.OPEN_RUN_JS, "open_run.js", {"LANDINGS": json.dumps(page_js.RUN_LANDINGS)}),
    (page_js.LESSON_READY_JS, "lessons_link_ready.js", {}),
    (page_js._DRAW_INTO, "whatif_draw_into.js", {}),
    (page_js._DRAW, "whatif_draw_step.js", {"DRAW_INTO": page_js._DRAW_INTO}),
    (page_js._POST, "whatif_post.js", {"ROUTE": json.dumps(page_js.ROUTE)}),
    (page_js.DRAW_JS, "whatif_draw_figure.js", {"DRAW_STEP": page_js._DRAW}),
    (page_js.WHATIF_JS, "whatif_knob.js", {"POST": page_js._POST, "DRAW_STEP": page_js._DRAW}),
    (page_js.PRESENTER_JS, "whatif_presenter.js", {"POST": page_js._POST, "DRAW_INTO": page_js._DRAW_INTO}),
    (page_js.PREPARE_JS, "whatif_prepare.js", {"POST": page_js._POST}),
    (page_js.PRESENTER_PREPARE_JS, "whatif_presenter_prepare.js", {"POST": page_js._POST}),
    (page_js.owner_js(3), "page_owner.js", {"AT": "3"}),  # the owner secret at an event's input 3
    (presenter.ARROW_KEYS_JS, "presenter_keys.js", {}),
    (presenter.EXIT_JS, "presenter_exit.js", {}),
    (presenter.RUN_JS, "presenter_run.js", {}),
    (knobs.MODIFIED_JS, "knobs_modified.js", {"CUSTOM": json.dumps(CUSTOM)}),
    (knobs.STAGE_MODIFIED_JS, "knobs_stage_modified.js", {"MODIFIED": knobs.MODIFIED_JS}),
    (share_links.COPY_LINK_JS, "share_copy_link.js", {"SHARE_PARAM": json.dumps(SHARE_PARAM)}),
    (lessons.BASE_URL_JS, "lessons_base_url.js", {}),
    (inside.PICK_JS, "inside_pick_step.js", {}),
]
PAGE_SCRIPT = page_js.HEAD.removeprefix("<script>").removesuffix("</script>")
JS_BODIES = [  # a script (launch's head) and a js_on_load body (element, trigger, props given)
    (PAGE_SCRIPT, "page.js", {"PROMPTS": json.dumps(page_js.PROMPT_BUTTONS),
                              "NARROW": str(page_js.PRESENT_NARROW_PX), "PHONE": str(page_js.PHONE_PX),
                              "LESSON_PARAM": json.dumps(page_js.LESSON_PARAM)}),
    (speculative.CHIP_JS, "speculative_chips.js", {}),
]
CSS = [(page_js.CSS, "page.css", {}), (app.CSS.removesuffix("\n" + page_js.CSS), "app.css", {})]
ALL = JS_FUNCTIONS + JS_BODIES + CSS
LEFTOVER = re.compile(r"__[A-Z][A-Z0-9_]*__")


ID_PLACEHOLDER = re.compile(r"__ID_([A-Z][A-Z0-9_]*)__")


def filled(name: str, values: dict) -> str:
    """The file's text with each ``__KEY__`` and ``__ID_NAME__`` replaced by hand (not through static_text)."""
    text = (STATIC / name).read_text(encoding="utf-8").removesuffix("\n")
    for key, value in values.items():
        assert f"__{key}__" in text, f"{name} lacks __{key}__"
        text = text.replace(f"__{key}__", value)
    return ID_PLACEHOLDER.sub(lambda m: json.dumps(getattr(ids, m.group(1))), text)


def test_every_static_file_is_some_constants_and_not_empty():
    named = sorted(name for _, name, _ in ALL)
    assert len(set(named)) == len(named)
    assert sorted(p.name for p in STATIC.iterdir() if p.is_file()) == named
    for _, name, _ in ALL:
        assert (STATIC / name).read_text(encoding="utf-8").strip(), name


@pytest.mark.parametrize("constant, name, values", ALL, ids=[name for _, name, _ in ALL])
def test_constant_is_its_file_with_the_values_filled_in(constant, name, values):
    assert constant == filled(name, values)
    assert not LEFTOVER.search(constant), f"{name}: a placeholder left in {LEFTOVER.search(constant).group()}"


def test_the_page_gets_the_constants():
    kwargs = app.launch_kwargs()
    assert kwargs["head"] == page_js.HEAD and kwargs["css"] == app.CSS
    assert app.CSS.endswith("\n" + page_js.CSS)


def test_a_missing_file_or_unfilled_placeholder_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "STATIC", tmp_path)
    with pytest.raises(AssetError, match="gone.js is missing"):
        static_text("gone.js")
    (tmp_path / "x.js").write_text("(a) => a + __ONE__ + __TWO__\n", encoding="utf-8")
    with pytest.raises(AssetError, match=r"holds placeholders \['ONE', 'TWO'\], values given for \['ONE'\]"):
        static_text("x.js", ONE="1")
    with pytest.raises(AssetError, match="values given for"):
        static_text("x.js", ONE="1", TWO="2", THREE="3")
    # one pass: a value's own text is not filled in again
    assert static_text("x.js", ONE="__TWO__", TWO="2") == "(a) => a + __TWO__ + 2"
    (tmp_path / "id.js").write_text("() => [__ID_STEP_CHART__, __ID_NO_SUCH__]\n", encoding="utf-8")
    with pytest.raises(AssetError, match=r"names element ids \['ID_NO_SUCH'\] that playground/ids.py lacks"):
        static_text("id.js")
    (tmp_path / "id.js").write_text("() => __ID_STEP_CHART__\n", encoding="utf-8")
    assert static_text("id.js") == '() => "step-chart"'
    with pytest.raises(AssetError, match="values given for"):
        static_text("id.js", ID_STEP_CHART='"x"')  # an id is filled from the table only


def built_page_ids(monkeypatch) -> set[str]:
    """Every elem_id of the whole app, built with no model loaded (no startup examples)."""
    from engine.backends.registry import ModelRegistry

    monkeypatch.setenv("DP_EXAMPLES", "0")
    demo = app.build_app(ModelRegistry())
    return {b.elem_id for b in demo.blocks.values() if getattr(b, "elem_id", None)}


def test_every_id_the_scripts_name_is_in_the_built_page(monkeypatch):
    """#28: the scripts name element ids only through playground/ids.py, each one is in the page."""
    named = {m for _, name, _ in JS_FUNCTIONS + JS_BODIES
             for m in ID_PLACEHOLDER.findall((STATIC / name).read_text(encoding="utf-8"))}
    assert named and named <= set(ids.IDS), sorted(named - set(ids.IDS))
    page = built_page_ids(monkeypatch)
    missing = {name: value for name, value in ids.IDS.items() if value not in page}
    assert not missing, f"ids.py names ids the built page lacks: {missing}"
    buttons = {*page_js.PROMPT_BUTTONS, *page_js.PROMPT_BUTTONS.values(), *page_js.RUN_BUTTONS.values()}
    assert buttons <= set(ids.IDS.values()) and buttons <= page


def test_no_script_names_an_id_or_a_global_of_its_own():
    """#28: no literal element id in a script ('#step-chart', getElementById('x')), and one global,
    ``window.dp``, instead of one per script (window.dpWhatIfSeq, window.dpStageEdit...)."""
    literal_id = re.compile(r"""(getElementById\(\s*['"`])|(['"`]#[A-Za-z])""")
    for _, name, _ in JS_FUNCTIONS + JS_BODIES:
        text = (STATIC / name).read_text(encoding="utf-8")
        assert not literal_id.search(text), f"{name}: {literal_id.search(text).group()}"
        globals_named = set(re.findall(r"window\.(dp\w*)", text))
        assert globals_named <= {"dp"}, f"{name}: {globals_named}"
    assert "window.dp = window.dp || {};" in PAGE_SCRIPT  # the page script makes the namespace first


def test_the_space_folder_ships_the_static_files(tmp_path):
    from deploy.make_space import build_space

    out = build_space(tmp_path / "space")
    for _, name, _ in ALL:
        assert (out / "playground" / "static" / name).read_bytes() == (STATIC / name).read_bytes(), name


@pytest.fixture
def blank(browser):
    """A blank page and the uncaught errors it reports."""
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page, errors
    context.close()


@pytest.mark.browser
def test_each_js_file_parses_and_the_js_snippets_are_functions(blank):
    page, _ = blank
    files = [[name + " (file)", (STATIC / name).read_text(encoding="utf-8"), False]
             for _, name, _ in JS_FUNCTIONS + JS_BODIES]  # placeholders stand as names: parses as it is
    items = ([[name, constant, True] for constant, name, _ in JS_FUNCTIONS]
             + [[name, constant, False] for constant, name, _ in JS_BODIES] + files)
    kinds = page.evaluate("""(items) => items.map(([name, text, isFunction]) => {
      try {
        new Function(text);  // parses, runs nothing
        return isFunction ? typeof (0, eval)('(' + text + ')') : 'parsed';
      } catch (e) { return name + ': ' + e; }
    })""", items)
    assert kinds == ["function"] * len(JS_FUNCTIONS) + ["parsed"] * (len(JS_BODIES) + len(files))


@pytest.mark.browser
def test_the_page_script_runs_on_a_blank_page(blank):
    page, errors = blank
    page.set_content(f"<html><head>{page_js.HEAD}</head><body><p>text</p></body></html>")
    page.click("p")
    page.wait_for_timeout(300)  # its interval and observer have run
    assert errors == []


def top_level_rules(css: str) -> int:
    """Blocks at brace depth 0 (a rule or an @media), comments dropped."""
    depth = rules = 0
    for ch in re.sub(r"/\*.*?\*/", "", css, flags=re.S):
        if ch == "{":
            rules += depth == 0
            depth += 1
        elif ch == "}":
            depth -= 1
    assert depth == 0
    return rules


@pytest.mark.browser
@pytest.mark.parametrize("css, name", [(c, n) for c, n, _ in CSS], ids=[n for _, n, _ in CSS])
def test_each_css_file_parses_rule_by_rule(blank, css, name):
    page, _ = blank
    page.add_style_tag(content=css)
    kept = page.evaluate("() => document.styleSheets[document.styleSheets.length - 1].cssRules.length")
    assert top_level_rules(css) > 0
    assert kept == top_level_rules(css), name  # chromium drops a rule it cannot parse


def test_no_view_types_an_id_of_the_ids_table_as_a_literal():
    """A component whose id a script names takes it from playground/ids.py (elem_id=ids.X): renaming it in the
    table then renames it everywhere (#36: ten such ids were typed as literals beside the table)."""
    import re
    from pathlib import Path

    from playground import ids

    table = {v for k, v in vars(ids).items() if k.isupper() and isinstance(v, str)}
    root = Path(__file__).resolve().parents[2] / "playground"
    typed = [f"{path.relative_to(root)}:{n}: {m.group(1)}" for path in root.rglob("*.py") if path.name != "ids.py"
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             for m in re.finditer(r'elem_id="([^"]+)"', line) if m.group(1) in table]
    assert typed == []
