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
    "logit_bias": "logit bias", "smoothing": "smoothing", "temperature": "temperature",
    "dynamic_temperature": "dynamic temperature", "dry": "DRY", "xtc": "XTC", "mirostat": "Mirostat",
    "min_new_tokens": "min new tokens", "contrast": "contrast (expert − amateur)",
}
KNOB = {"top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p", "epsilon": "epsilon_cutoff",
        "eta": "eta_cutoff", "top_a": "top_a", "top_h": "top_h", "top_n_sigma": "top_n_sigma",
        "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
        "presence_penalty": "presence_penalty", "no_repeat_ngram": "no_repeat_ngram_size",
        "smoothing": "smoothing_factor", "temperature": "temperature", "dry": "dry_multiplier",
        "min_new_tokens": "min_new_tokens"}


def quoted(token: str) -> str:
    """A token as the chart shows it: quoted, with newlines and tabs visible."""
    return "'" + token.replace("\n", "\\n").replace("\t", "\\t") + "'"


def _names(tokens, limit: int = 3) -> str:
    names = [quoted(t.token) for t in tokens[:limit]]
    return ", ".join(names) + (", …" if len(tokens) > limit else "")


def stage_label(stage: StageTrace) -> str:
    """The stage's short name and main knob, e.g. "top-k 50" (for sentences)."""
    label = LABELS.get(stage.name, stage.name.replace("_", " "))
    value = stage.params.get(KNOB.get(stage.name, ""))
    return f"{label} {value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else label


def _truncation(stage: StageTrace) -> str:
    if stage.mass_removed <= 0:
        return f"{stage_label(stage)}: removed nothing; {stage.kept} tokens left"
    removed = f" ({_names(stage.removed)})" if stage.removed else ""
    return f"{stage_label(stage)}: removed {stage.mass_removed:.1%} of the mass{removed}; {stage.kept} tokens left"


def _reshape(stage: StageTrace) -> str:
    return f"{stage_label(stage)}: moved {stage.tv_distance:.1%} of the mass"


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


# --- Panel titles: each stage and its knobs in words (never a dump of its parameter values) ---

def _num(value, fmt: str = "g") -> str:
    """A knob's value for a title ("?" when the trace lacks it, never "None")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "?"
    return format(value, fmt)


def _p(stage: StageTrace, key: str) -> str:
    return _num(stage.params.get(key))


def _xtc_heading(stage: StageTrace) -> str:
    return (f"XTC: drop top tokens above p={_num(stage.params.get('xtc_threshold'), '.2f')} "
            f"with probability {_num(stage.params.get('xtc_probability'), '.1f')}")


def _mirostat_heading(stage: StageTrace) -> str:
    version = stage.params.get("mirostat")
    mu = stage.params.get("mu")
    name = f"Mirostat v{version}" if version in (1, 2) else "Mirostat"
    return (f"{name}: target surprise {_num(stage.params.get('mirostat_tau'), '.1f')}"
            + (f", mu {_num(mu, '.1f')}" if mu is not None else ""))


def _dry_heading(stage: StageTrace) -> str:
    return (f"DRY: repeats over {_p(stage, 'dry_allowed_length')} tokens cost "
            f"{_p(stage, 'dry_multiplier')}·{_p(stage, 'dry_base')}^n")


def _dynatemp_heading(stage: StageTrace) -> str:
    t, r = stage.params.get("temperature"), stage.params.get("dynatemp_range")
    return f"dynamic temperature {_num(t)} ± {_num(r)}" + (f": T={_num(stage.params['T'], '.2f')}"
                                                          if isinstance(stage.params.get("T"), float) else "")


def _constraints_heading(stage: StageTrace) -> str:
    allowed, banned = stage.params.get("allowed_words") or [], stage.params.get("banned_words") or []
    parts = ([f"only {len(allowed)} word" + ("" if len(allowed) == 1 else "s")] if allowed else []) + \
            ([f"ban {len(banned)} word" + ("" if len(banned) == 1 else "s")] if banned else [])
    return "constraints: " + (", ".join(parts) or "none")


def _logit_bias_heading(stage: StageTrace) -> str:
    n = len(stage.params.get("logit_bias") or {})
    return f"logit bias on {n} word" + ("" if n == 1 else "s")


HEADINGS: dict[str, Callable[[StageTrace], str]] = {
    "raw": lambda s: "raw model",
    "final": lambda s: "final",
    "temperature": lambda s: f"temperature: logits ÷ {_p(s, 'temperature')}",
    "top_k": lambda s: f"top-k: keep the top {_p(s, 'top_k')}",
    "top_p": lambda s: f"top-p: keep the top {_p(s, 'top_p')} of the mass",
    "min_p": lambda s: f"min-p: drop p below {_p(s, 'min_p')} × the top p",
    "typical_p": lambda s: f"typical-p: keep {_p(s, 'typical_p')} of the mass nearest typical",
    "epsilon": lambda s: f"ε-cutoff: drop p below {_p(s, 'epsilon_cutoff')}",
    "eta": lambda s: f"η-cutoff: drop p below {_p(s, 'eta_cutoff')} (entropy-scaled)",
    "top_h": lambda s: f"top-H: keep entropy within {_p(s, 'top_h')} of the whole",
    "top_a": lambda s: f"top-a: drop p below {_p(s, 'top_a')} × top p²",
    "top_n_sigma": lambda s: f"top-nσ: keep logits within {_p(s, 'top_n_sigma')}σ of the top",
    "repetition_penalty": lambda s: f"repetition penalty: seen tokens ÷ {_p(s, 'repetition_penalty')}",
    "frequency_penalty": lambda s: f"frequency penalty: −{_p(s, 'frequency_penalty')} per repeat",
    "presence_penalty": lambda s: f"presence penalty: −{_p(s, 'presence_penalty')} once seen",
    "no_repeat_ngram": lambda s: f"no repeated {_p(s, 'no_repeat_ngram_size')}-grams",
    "min_new_tokens": lambda s: f"min new tokens: no end before {_p(s, 'min_new_tokens')}",
    "smoothing": lambda s: f"smoothing: factor {_p(s, 'smoothing_factor')}, curve {_p(s, 'smoothing_curve')}",
    "contrast": lambda s: f"contrast (expert − amateur), plausible: p ≥ {_num(s.params.get('cd_alpha'))} × top",
    "dynamic_temperature": _dynatemp_heading, "dry": _dry_heading, "xtc": _xtc_heading,
    "mirostat": _mirostat_heading, "constraints": _constraints_heading, "logit_bias": _logit_bias_heading,
}


def stage_heading(stage: StageTrace) -> str:
    """The stage and its knobs in words, for a panel title, e.g. "XTC: drop top tokens above
    p=0.10 with probability 1.0" (an unknown stage: its name, spaced)."""
    heading = HEADINGS.get(stage.name)
    return heading(stage) if heading else stage.name.replace("_", " ")
