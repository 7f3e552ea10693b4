"""The one rendering of a token, used by every chart, chip, table and text flow.

A token's text is shown so that nothing is invisible or mistaken for prose:

- a space as ␣ (also SentencePiece's ▁), a newline as ↵, a tab as ⇥, a carriage return as ⏎,
  the empty string as ∅;
- a special (control) token such as ``<|im_start|>`` or ``<gh_stars>`` as a badge: ⟪im_start⟫ in
  plain text (chart labels), a framed ``<span class="dp-special">`` in HTML. These tokens are not
  text: they come from the chat template or the model's training format.

``LEGEND`` says this in one line; every view that shows tokens shows it once. No gradio here.
"""

from __future__ import annotations

import html
import re

# A special token is a whole token written <|name|>, or <name> / </name> where the name has an
# underscore or is a known control name (so an HTML tag like "<b>" stays text). On the embedded
# SmolLM2 tokenizer this matches exactly its 17 added tokens and no ordinary token.
SPECIAL = re.compile(r"^(?:<\|([^|\s]+)\|>|<(/?[A-Za-z_][A-Za-z0-9_.-]*)>)$")
KNOWN_NAMES = {"s", "/s", "unk", "pad", "mask", "bos", "eos", "cls", "sep", "reponame", "filename"}
WHITESPACE = {" ": "␣", "▁": "␣", "\n": "↵", "\t": "⇥", "\r": "⏎"}
EMPTY = "∅"
BADGE_OPEN, BADGE_CLOSE = "⟪", "⟫"
LEGEND = ("␣ space · ↵ newline · ⇥ tab · ∅ empty · ⟪name⟫ special token "
          "(from the chat template or the model's format, not text)")
SPECIAL_STYLE = ("display:inline-block;padding:0 4px;margin:0 1px;border:1px solid #5e35b1;border-radius:4px;"
                 "background:#ede7f6;color:#4527a0;font-family:ui-monospace,monospace;font-size:0.85em")


def special_name(token: str) -> str | None:
    """The name inside a special token (``<|im_end|>`` -> ``im_end``), None for ordinary text."""
    match = SPECIAL.match(token)
    if match is None:
        return None
    if match.group(1):
        return match.group(1)
    name = match.group(2)
    return name if "_" in name or name.lower() in KNOWN_NAMES else None


def is_special(token: str) -> bool:
    return special_name(token) is not None


def _visible(text: str) -> str:
    return "".join(WHITESPACE.get(ch, ch) for ch in text)


def render(token: str) -> str:
    """Plain text for labels and ticks: ``" the\\n"`` -> ``"␣the↵"``, ``"<|im_end|>"`` -> ``"⟪im_end⟫"``."""
    if token == "":
        return EMPTY
    name = special_name(token)
    if name is not None:
        return f"{BADGE_OPEN}{name}{BADGE_CLOSE}"
    return _visible(token)


def render_flow(token: str) -> str:
    """Text for running output (one chip per token): spaces stay spaces, so the text reads as
    prose; a newline token shows ↵ and then breaks the line (a chip one can see and click);
    special tokens show as their badge text."""
    if token == "":
        return EMPTY
    if is_special(token):
        return render(token)
    if token.strip() == "" and "\n" in token:
        return _visible(token.replace(" ", "")) + "\n" * token.count("\n")
    return token.replace("\n", "↵\n")


def render_html(token: str, flow: bool = False) -> str:
    """HTML-escaped rendering: special tokens as a framed badge (with a title saying what they
    are). ``flow``: running text (spaces kept, ↵ then a line break), else label style (␣ ↵ ⇥)."""
    name = special_name(token)
    if name is not None:
        return (f'<span class="dp-special" title="special token {html.escape(token)}: not text" '
                f'style="{SPECIAL_STYLE}">{html.escape(name)}</span>')
    if not flow:
        return html.escape(render(token))
    return html.escape(render_flow(token)).replace("\n", "<br>")


def unique_labels(tokens: list[str], ids: list[int]) -> list[str]:
    """Rendered labels, disambiguated with the token id when two tokens render the same."""
    labels, seen = [], set()
    for text, token_id in zip(tokens, ids):
        label = render(text)
        if label in seen:
            label = f"{label} #{token_id}"
        seen.add(label)
        labels.append(label)
    return labels


def legend_html() -> str:
    """The legend as a small HTML line (for a view to place once above its token displays)."""
    return (f'<div class="dp-token-legend" style="font-size:14px;color:#333">Tokens: {html.escape(LEGEND)}</div>')
