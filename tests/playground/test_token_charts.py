"""The one token rendering (charts/tokens.py) and the glossary, checked on hand-written tokens."""

import pytest

from playground.charts import glossary, tokens


@pytest.mark.parametrize("token, shown", [
    (" the", "␣the"), ("\n", "↵"), ("\t", "⇥"), ("▁the", "␣the"), ("", "∅"), ("a\r\n", "a⏎↵"),
    ("<|im_start|>", "⟪im_start⟫"), ("<|im_end|>", "⟪im_end⟫"), ("<gh_stars>", "⟪gh_stars⟫"), ("</s>", "⟪/s⟫"),
    ("<", "<"), (" <div", "␣<div"), ("<a b>", "<a␣b>"), ("<b>", "<b>"),  # ordinary text, not special
])
def test_render_labels(token, shown):
    assert tokens.render(token) == shown


def test_flow_keeps_spaces_and_breaks_lines_after_a_visible_newline():
    assert tokens.render_flow(" the") == " the"
    assert tokens.render_flow("\n") == "↵\n" and tokens.render_flow(" \n\n") == "↵↵\n\n"
    assert tokens.render_flow("end.\n") == "end.↵\n"
    assert tokens.render_flow("<|im_end|>") == "⟪im_end⟫"


def test_html_badge_for_special_tokens_and_escaping():
    badge = tokens.render_html("<|im_end|>")
    assert 'class="dp-special"' in badge and ">im_end</span>" in badge and "<|" not in badge.split("title")[0]
    assert tokens.render_html("<b") == "&lt;b"
    assert tokens.render_html("a\nb", flow=True) == "a↵<br>b"
    assert "⟪name⟫ special token" in tokens.LEGEND and "↵ newline" in tokens.legend_html()


def test_unique_labels_disambiguate_with_the_id():
    assert tokens.unique_labels([" a", " a", "b"], [5, 7, 9]) == ["␣a", "␣a #7", "b"]


def test_every_special_token_of_the_embedded_tokenizer_and_no_ordinary_one():
    """The pattern matches exactly the embedded tokenizer's 17 added tokens among its 49,152."""
    from transformers import AutoTokenizer

    from engine.backends.local import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    added = {t.content for t in tok.added_tokens_decoder.values()}
    matched = {t for t in (tok.convert_tokens_to_string([x]) for x in tok.get_vocab()) if tokens.is_special(t)}
    assert matched == added and len(added) == 17


def test_glossary_lines_are_one_line_and_cover_the_issue_terms():
    for term in ("kept", "typical_p", "ε", "residual", "KL(p‖q)", "rep-4", "distinct-2", "nats"):
        text = glossary.hover(term)
        assert "\n" not in text and len(text) < 200
    assert glossary.abbr("rep-4").startswith('<abbr title="rep-4: the share')
    with pytest.raises(KeyError):
        glossary.hover("not a term")
