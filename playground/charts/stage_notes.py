"""One line per stage and step saying what the stage did, in words, from the trace alone.

``stage_note(stage)`` reads a ``StageTrace`` (its params, kept count, removed mass and tokens) and
returns a sentence for the step chart, e.g. "XTC fired (u=0.21 < 0.5): removed 'the', 'a'; kept 'an'".
Pure: no model, no tokenizer, no plotting.
"""

from __future__ import annotations

from typing import Callable

from engine.trace import StageTrace

LABELS = {
    "top_k": "top-k", "top_p": "top-p", "min_p": "min-p", "typical_p": "typical-p", "epsilon": "ε cutoff",
    "eta": "η cutoff", "top_a": "top-a", "top_h": "top-H", "top_n_sigma": "top-nσ",
    "repetition_penalty": "repetition penalty", "frequency_penalty": "frequency penalty",
    "presence_penalty": "presence penalty", "no_repeat_ngram": "no-repeat-n-gram", "constraints": "word constraints",
    "logit_bias": "logit bias", "smoothing": "smoothing",
}
KNOB = {"top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p", "epsilon": "epsilon_cutoff",
        "eta": "eta_cutoff", "top_a": "top_a", "top_h": "top_h", "top_n_sigma": "top_n_sigma",
        "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
        "presence_penalty": "presence_penalty", "no_repeat_ngram": "no_repeat_ngram_size",
        "smoothing": "smoothing_factor"}


def quoted(token: str) -> str:
    """A token as the chart shows it: quoted, with newlines and tabs visible."""
    return "'" + token.replace("\n", "\\n").replace("\t", "\\t") + "'"


def _names(tokens, limit: int = 3) -> str:
    names = [quoted(t.token) for t in tokens[:limit]]
    return ", ".join(names) + (", …" if len(tokens) > limit else "")


def _label(stage: StageTrace) -> str:
    label = LABELS.get(stage.name, stage.name.replace("_", " "))
    value = stage.params.get(KNOB.get(stage.name, ""))
    return f"{label} {value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else label


def _truncation(stage: StageTrace) -> str:
    if stage.mass_removed <= 0:
        return f"{_label(stage)}: removed nothing; {stage.kept} tokens left"
    removed = f" ({_names(stage.removed)})" if stage.removed else ""
    return f"{_label(stage)}: removed {stage.mass_removed:.1%} of the mass{removed}; {stage.kept} tokens left"


def _reshape(stage: StageTrace) -> str:
    return f"{_label(stage)}: moved {stage.tv_distance:.1%} of the mass"


def _top_n_sigma(stage: StageTrace) -> str:
    sigma, cut = stage.params.get("sigma"), stage.params.get("cutoff")
    where = f" (σ = {sigma:.2f}, logits below {cut:.2f} go)" if sigma is not None and cut is not None else ""
    return _truncation(stage) + where


def _temperature(stage: StageTrace) -> str:
    t = stage.params.get("temperature", 1.0)
    effect = "sharper" if t < 1 else "flatter" if t > 1 else "unchanged"
    return f"temperature {t:g}: logits ÷ {t:g}, {effect} (entropy {stage.entropy:.2f} nats)"


def _dynamic_temperature(stage: StageTrace) -> str:
    t, h = stage.params.get("T"), stage.params.get("normalized_entropy")
    if t is None:
        return "dynamic temperature"
    return f"dynamic temperature: T = {t:.2f} from normalised entropy {h:.2f} (entropy now {stage.entropy:.2f} nats)"


def _dry(stage: StageTrace) -> str:
    hits = stage.params.get("penalized") or []
    if not hits:
        return "DRY: no token would extend a repeated phrase"
    top = hits[0]
    more = f" (+{len(hits) - 1} more)" if len(hits) > 1 else ""
    return (f"DRY: {quoted(top['token'])} would extend the repeated phrase {quoted(top['phrase'])} "
            f"(length {top['length']}): −{top['penalty']:.2g} logits{more}")


def _xtc(stage: StageTrace) -> str:
    p, u = stage.params.get("xtc_probability"), stage.params.get("u")
    coin = f"u={u:.2f} < {p:g}" if u is not None else f"probability {p:g}"
    if not stage.params.get("fired"):
        return f"XTC did not fire (u={u:.2f} ≥ {p:g})" if u is not None else "XTC did not fire"
    if stage.params.get("kept_id") is None:
        return f"XTC fired ({coin}) but fewer than two tokens reach {stage.params.get('xtc_threshold'):g}: nothing removed"
    kept = next((t.token for t in stage.top if t.token_id == stage.params["kept_id"]), None)
    kept_text = f"; kept {quoted(kept)}" if kept is not None else ""
    return f"XTC fired ({coin}): removed {_names(stage.removed) or f'{stage.mass_removed:.1%} of the mass'}{kept_text}"


def _mirostat(stage: StageTrace) -> str:
    mu, kept = stage.params.get("mu"), stage.params.get("kept", stage.kept)
    if mu is None:
        return "mirostat"
    after = stage.params.get("mu_after")
    then = f"; after the pick μ = {after:.2f}" if after is not None else ""
    return f"mirostat: μ = {mu:.1f} → kept {kept} tokens{then}"


def _min_new_tokens(stage: StageTrace) -> str:
    n = stage.params.get("min_new_tokens")
    if stage.mass_removed > 0:
        return f"min new tokens {n}: EOS masked ({stage.mass_removed:.1%} of the mass)"
    return f"min new tokens {n}: nothing masked"


def _raw(stage: StageTrace) -> str:
    top = f"; most likely {quoted(stage.top[0].token)} {stage.top[0].prob:.1%}" if stage.top else ""
    return f"raw: the model's distribution, entropy {stage.entropy:.2f} nats{top}"


def _final(stage: StageTrace) -> str:
    return f"final: {stage.kept} tokens can be drawn, entropy {stage.entropy:.2f} nats"


NOTES: dict[str, Callable[[StageTrace], str]] = {
    "raw": _raw, "final": _final, "temperature": _temperature, "dynamic_temperature": _dynamic_temperature,
    "dry": _dry, "xtc": _xtc, "mirostat": _mirostat, "min_new_tokens": _min_new_tokens, "top_n_sigma": _top_n_sigma,
    **{name: _truncation for name in ("top_k", "top_p", "min_p", "typical_p", "epsilon", "eta", "top_a", "top_h",
                                      "constraints", "no_repeat_ngram")},
    **{name: _reshape for name in ("repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
                                   "smoothing")},
}


def stage_note(stage: StageTrace) -> str:
    """What ``stage`` did at this step, in one line."""
    return NOTES.get(stage.name, _reshape)(stage)
