"""Export a preset to other tools: a text-generation-webui preset (YAML) and llama.cpp flags.

Each export returns the text plus, knob by knob, what did not map (and why) and what mapped with a
behaviour difference worth knowing. Only knobs that change the run are considered: neutral values
and knobs of other strategies (e.g. num_beams under sampling) are left out, and greedy decoding
drops the sampling-only stages exactly as the engine does.

The YAML is written by hand: numbers, booleans and a fixed list of sampler names only, so no user
text ever lands in a value.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from .config import KNOBS, SAMPLING_ONLY_STAGES, DecodingConfig
from .presets import Preset

# Knobs that only matter under one strategy.
STRATEGY_KNOBS = {
    "beam": ("num_beams", "length_penalty", "early_stopping", "num_return_sequences", "num_beam_groups",
             "diversity_penalty"),
    "speculative": ("drafter", "num_draft_tokens", "ngram_size", "adaptive_k"),
    "contrastive_search": ("penalty_alpha",),
    "contrastive_decoding": ("cd_alpha", "amateur"),
}
STAGE_KNOB = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p",
    "epsilon": "epsilon_cutoff", "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "no_repeat_ngram": "no_repeat_ngram_size",
    "dry": "dry_multiplier", "xtc": "xtc_probability", "top_n_sigma": "top_n_sigma", "dynamic_temperature": "dynatemp_range",
    "smoothing": "smoothing_factor", "mirostat": "mirostat", "eta": "eta_cutoff", "top_a": "top_a", "top_h": "top_h",
    "logit_bias": "logit_bias", "min_new_tokens": "min_new_tokens",
}
# Stages added for parity with llama.cpp / text-generation-webui: every knob of such a stage is exported
# while the stage is on, neutral or not (xtc_threshold 0.1 is part of what XTC does).
PARITY_STAGES = ("dry", "xtc", "top_n_sigma", "dynamic_temperature", "smoothing", "mirostat", "eta", "top_a",
                 "top_h", "logit_bias", "min_new_tokens")
# Settings a strategy runs on even at their neutral value.
STRATEGY_IN_USE = {
    "beam": ("num_beams",),
    "speculative": ("drafter", "num_draft_tokens"),
    "contrastive_search": ("penalty_alpha",),
    "contrastive_decoding": ("cd_alpha", "amateur"),
}
PENALTY_STAGES = ("repetition_penalty", "frequency_penalty", "presence_penalty")
TRACE_ONLY = "a playground trace setting; it does not change the text"


@dataclass(frozen=True)
class Note:
    key: str
    reason: str


@dataclass(frozen=True)
class InteropExport:
    """``text``: the file or flags. ``unmapped``: knobs the target's format cannot express.
    ``caveats``: knobs that mapped, with a difference in behaviour worth knowing."""

    target: str
    text: str
    unmapped: tuple[Note, ...]
    caveats: tuple[Note, ...]


def effective_knobs(config: DecodingConfig) -> list[str]:
    """Knobs that change this run, in KNOBS order: non-neutral ones, minus those of other
    strategies (and sampling-only ones under greedy), plus the settings the strategy itself runs on
    even at their neutral value (e.g. penalty_alpha 0.6 for contrastive search)."""
    inert = {k for strategy, keys in STRATEGY_KNOBS.items() if strategy != config.strategy for k in keys}
    if config.is_greedy:
        inert |= {k.name for k in KNOBS.values() if k.stage in SAMPLING_ONLY_STAGES}
    active = set(config.active_stages())
    inert |= {k.name for k in KNOBS.values() if k.stage in PARITY_STAGES and k.stage not in active}
    if config.strategy == "speculative" and config.drafter != "ngram":
        inert.add("ngram_size")
    in_use = set(STRATEGY_IN_USE.get(config.strategy, ()))
    in_use |= {k.name for k in KNOBS.values() if k.stage in PARITY_STAGES and k.stage in active}
    if config.strategy == "speculative" and config.drafter == "ngram":
        in_use.add("ngram_size")
    out = []
    for name, knob in KNOBS.items():
        value = getattr(config, name)
        value = list(value) if knob.kind == "str_list" else value
        if name not in inert and (value != knob.neutral or name in in_use):
            out.append(name)
    return out


def number(value: float | int | bool) -> str:
    """A number as YAML 1.1 and C's strtof both read it (``1.0e-05``, not ``1e-05``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = repr(float(value))
    if "e" in text and "." not in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return text


def active_order(config: DecodingConfig) -> list[str]:
    """The active stages in the user's order (sampling-only ones dropped under greedy)."""
    return list(config.active_stages())


def _greedy_like(config: DecodingConfig) -> bool:
    """Strategies other tools lack are exported as greedy decoding, their nearest relative."""
    return config.is_greedy or config.strategy in ("beam", "contrastive_search", "contrastive_decoding")


def _common_unmapped(config: DecodingConfig, keys: list[str], tool: str) -> list[Note]:
    out = []
    if "top_n" in keys:
        out.append(Note("top_n", TRACE_ONLY))
    for key in ("allowed_words", "banned_words"):
        if key in keys:
            out.append(Note(key, f"{tool} bans tokens by id, not by word; there is no word list to carry over"))
    if config.strategy == "contrastive_decoding":
        out.append(Note("strategy", f"contrastive decoding (expert vs amateur) has no {tool} equivalent; "
                                    "exported as greedy"))
        out += [Note(k, "contrastive decoding only") for k in ("cd_alpha", "amateur") if k in keys]
    if config.strategy == "beam":
        out.append(Note("strategy", f"{tool} has no beam search setting here; exported as greedy decoding"))
        out += [Note(k, "a beam-search setting") for k in STRATEGY_KNOBS["beam"] if k in keys]
    if _greedy_like(config) and not config.is_greedy:
        dropped = [k for k in keys if KNOBS[k].stage in SAMPLING_ONLY_STAGES and k != "top_k"]
        out += [Note(k, "dropped: exported as greedy decoding") for k in dropped]
    return out


# --- text-generation-webui -------------------------------------------------------------------------
# Its sampler_priority names; ours map onto the first ten. The rest are kept, in its default order,
# so the list stays complete.
TGW_PRIORITY = (
    "repetition_penalty", "presence_penalty", "frequency_penalty", "dry", "temperature", "dynamic_temperature",
    "quadratic_sampling", "top_n_sigma", "top_k", "top_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "tfs",
    "top_a", "min_p", "mirostat", "xtc", "encoder_repetition_penalty", "no_repeat_ngram",
)
TGW_STAGE = {
    "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "no_repeat_ngram": "no_repeat_ngram", "temperature": "temperature",
    "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p", "epsilon": "epsilon_cutoff",
    "dry": "dry", "dynamic_temperature": "dynamic_temperature", "smoothing": "quadratic_sampling",
    "top_n_sigma": "top_n_sigma", "eta": "eta_cutoff", "top_a": "top_a", "mirostat": "mirostat", "xtc": "xtc",
}
TGW_KNOBS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "repetition_penalty",
             "frequency_penalty", "presence_penalty", "no_repeat_ngram_size", "penalty_alpha",
             "dry_multiplier", "dry_base", "dry_allowed_length", "xtc_threshold", "xtc_probability", "top_n_sigma",
             "smoothing_factor", "smoothing_curve", "eta_cutoff", "top_a")
TGW_RENAMED = {"mirostat": "mirostat_mode", "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta"}
TGW_UNMAPPED = {
    "top_h": "text-generation-webui has no top-H sampler",
    "logit_bias": "not part of a text-generation-webui preset; send it in the API request's logit_bias field (token ids)",
    "min_new_tokens": "not part of a text-generation-webui preset",
    "dry_penalty_last_n": "text-generation-webui scans repetition_penalty_range tokens for DRY (shared with the "
                          "repetition penalty); it has no DRY-only range",
}
TGW_DRY_BREAKERS = ["\n", ":", "\"", "*"]  # its default, the same as ours
TGW_NOT_IN_PRESET = {
    "seed": "not part of a text-generation-webui preset; set 'Seed' in the Parameters tab",
    "max_new_tokens": "not part of a text-generation-webui preset; set 'max_new_tokens' in the Parameters tab",
    "stop": "not part of a text-generation-webui preset; use 'Custom stopping strings' in the Parameters tab",
}


def to_textgen_webui(preset: Preset) -> InteropExport:
    """A text-generation-webui preset (``user_data/presets/<name>.yaml``)."""
    config = preset.config
    keys = effective_knobs(config)
    lines = [f"# {_comment(preset.name)}: exported from Decoding Playground", f"# {_comment(preset.description)}"]
    if _greedy_like(config) and config.strategy != "contrastive_search":
        lines += ["do_sample: false", "top_k: 1"]
    if config.strategy == "contrastive_search":
        lines.append("do_sample: false")
    for key in TGW_KNOBS:
        if key in keys and not (key == "top_k" and _greedy_like(config) and config.strategy != "contrastive_search"):
            scaled = key in ("epsilon_cutoff", "eta_cutoff")  # its unit: 1e-4
            value = getattr(config, key) * 10_000 if scaled else getattr(config, key)
            lines.append(f"{key}: {number(value)}")
    lines += _tgw_parity_lines(config, keys)
    if "repetition_penalty" in keys:
        lines.append("repetition_penalty_range: 0")  # 0 = the whole context, as transformers does
    ours = [TGW_STAGE[s] for s in active_order(config) if s in TGW_STAGE]
    reorder = ours != sorted(ours, key=TGW_PRIORITY.index)
    if reorder:
        lines.append("sampler_priority: |-")
        lines += [f"  {name}" for name in ours + [n for n in TGW_PRIORITY if n not in ours]]
    unmapped = _common_unmapped(config, keys, "text-generation-webui")
    unmapped += [Note(k, reason) for k, reason in TGW_NOT_IN_PRESET.items() if k in keys]
    unmapped += [Note(k, reason) for k, reason in TGW_UNMAPPED.items() if k in keys
                 and not (k == "dry_penalty_last_n" and config.dry_penalty_last_n == -1)]
    if config.strategy == "speculative":
        unmapped += [Note(k, "speculative decoding is set up when loading the model in text-generation-webui (a draft "
                             "model, or prompt_lookup_num_tokens); the preset keeps the sampling settings, which give "
                             "the same distribution") for k in STRATEGY_KNOBS["speculative"] if k in keys]
    caveats = _tgw_caveats(config, keys, reorder)
    return InteropExport("text-generation-webui", "\n".join(lines) + "\n", tuple(unmapped), tuple(caveats))


def _tgw_parity_lines(config: DecodingConfig, keys: list[str]) -> list[str]:
    """DRY breakers, dynamic temperature and mirostat, whose names or shapes differ there."""
    lines = []
    if "dry_sequence_breakers" in keys and list(config.dry_sequence_breakers) != TGW_DRY_BREAKERS:
        # user text: JSON (ASCII, escaped) inside a single-quoted YAML scalar, so it stays one value
        text = json.dumps(list(config.dry_sequence_breakers), ensure_ascii=True).replace("'", "''")
        lines.append(f"dry_sequence_breakers: '{text}'")
    if "dynatemp_range" in keys:
        low, high = max(0.0, config.temperature - config.dynatemp_range), config.temperature + config.dynatemp_range
        lines += ["dynamic_temperature: true", f"dynatemp_low: {number(low)}", f"dynatemp_high: {number(high)}",
                  f"dynatemp_exponent: {number(config.dynatemp_exponent)}"]
    lines += [f"{TGW_RENAMED[k]}: {number(getattr(config, k))}" for k in TGW_RENAMED if k in keys]
    return lines


def _tgw_caveats(config: DecodingConfig, keys: list[str], reorder: bool) -> list[Note]:
    out = []
    if config.mirostat == 1 and "mirostat" in keys:
        out.append(Note("mirostat", "text-generation-webui's Transformers loader runs mirostat 2 only; "
                                    "mode 1 needs its llama.cpp loader"))
    if config.strategy == "contrastive_search":
        out.append(Note("penalty_alpha", "contrastive search works with the Transformers loader only"))
    if {"frequency_penalty", "presence_penalty"} & set(keys):
        out.append(Note("frequency_penalty" if "frequency_penalty" in keys else "presence_penalty",
                        "text-generation-webui counts prompt tokens too; the playground counts generated tokens only"))
    if reorder:
        out.append(Note("stage_order", "sampler_priority sets the order for loaders that honour it; "
                                       "others use their own"))
    return out


def _comment(text: str) -> str:
    """One line of text, safe in a YAML comment."""
    return " ".join(text.split())[:200]


# --- llama.cpp -------------------------------------------------------------------------------------
# Our stage -> (llama.cpp sampler name, flag). The three penalties are one llama.cpp sampler.
LLAMA_SAMPLER = {"temperature": ("temperature", "--temp"), "top_k": ("top_k", "--top-k"), "top_p": ("top_p", "--top-p"),
                 "min_p": ("min_p", "--min-p"), "typical_p": ("typ_p", "--typical")}
LLAMA_PENALTY_FLAGS = {"repetition_penalty": "--repeat-penalty", "frequency_penalty": "--frequency-penalty",
                       "presence_penalty": "--presence-penalty"}
LLAMA_UNMAPPED = {
    "no_repeat_ngram_size": "llama.cpp has no n-gram ban (its DRY sampler penalises repeats instead of banning them)",
    "epsilon_cutoff": "llama.cpp has no absolute probability cutoff; --min-p is the nearest (relative) one",
    "eta_cutoff": "llama.cpp has no eta sampler",
    "top_a": "llama.cpp has no top-a sampler",
    "top_h": "llama.cpp has no top-H sampler",
    "smoothing_factor": "llama.cpp has no quadratic (smoothing) sampler",
    "smoothing_curve": "llama.cpp has no quadratic (smoothing) sampler",
    "min_new_tokens": "llama.cpp has no minimum-length setting",
}
LLAMA_SAMPLER.update({"dry": ("dry", None), "top_n_sigma": ("top_n_sigma", "--top-nsigma"), "xtc": ("xtc", None),
                      "dynamic_temperature": ("temperature", None)})
LLAMA_DRY_BREAKERS = ["\n", ":", "\"", "*"]  # its default, the same as ours


def to_llama_cpp(preset: Preset) -> InteropExport:
    """llama.cpp command-line flags (``llama-cli`` / ``llama-completion`` / ``llama-server``):
    ``--samplers`` lists the active stages in the preset's order, then one flag per value."""
    config = preset.config
    keys = effective_knobs(config)
    greedy = _greedy_like(config)
    chain, flags = _llama_chain(config, greedy)
    flags = [f'--samplers "{";".join(chain)}"'] + flags
    if not greedy:
        flags.append(f"--seed {config.seed}")
    flags.append(f"--n-predict {config.max_new_tokens}")
    flags += [f"--reverse-prompt {shlex.quote(s)}" for s in config.stop]
    unmapped = _common_unmapped(config, keys, "llama.cpp")
    unmapped += [Note(k, reason) for k, reason in LLAMA_UNMAPPED.items() if k in keys]
    if any(not k.isdigit() for k in config.logit_bias) and "logit_bias" in keys:
        unmapped.append(Note("logit_bias", "llama.cpp biases token ids only; the words were left out"))
    if config.strategy == "contrastive_search":
        unmapped.append(Note("strategy", "llama.cpp has no contrastive search; exported as greedy decoding"))
        unmapped += [Note(k, "a contrastive-search setting") for k in ("penalty_alpha", "top_k") if k in keys]
    if config.strategy == "speculative":
        spec_flags, spec_notes = _llama_speculative(config)
        flags += spec_flags
        unmapped += spec_notes
    return InteropExport("llama.cpp", " ".join(flags), tuple(unmapped), tuple(_llama_caveats(config, keys, greedy)))


def _llama_chain(config: DecodingConfig, greedy: bool) -> tuple[list[str], list[str]]:
    """Sampler names in order and their value flags. Greedy: the non-sampling stages, then top-k 1."""
    chain: list[str] = []
    flags: list[str] = []
    for stage in active_order(config):
        if stage in PENALTY_STAGES and "penalties" not in chain:
            chain.append("penalties")
            flags += [f"{flag} {number(getattr(config, knob))}" for knob, flag in LLAMA_PENALTY_FLAGS.items()
                      if getattr(config, knob) != KNOBS[knob].neutral]
            flags.append("--repeat-last-n -1")  # -1 = the whole context, as transformers' repetition penalty
        elif stage in LLAMA_SAMPLER and not (greedy and stage in SAMPLING_ONLY_STAGES):
            name, flag = LLAMA_SAMPLER[stage]
            chain.append(name)
            flags += [f"{flag} {number(getattr(config, STAGE_KNOB[stage]))}"] if flag else _llama_stage_flags(config, stage)
        elif stage == "logit_bias":
            flags += [f"--logit-bias {k}{'+' if b >= 0 else '-'}{number(abs(b))}" for k, b in config.logit_bias.items()
                      if k.isdigit()]
    if config.mirostat and not greedy:  # llama.cpp's mirostat replaces the chain, keeping temperature only
        flags += [f"--mirostat {config.mirostat}", f"--mirostat-lr {number(config.mirostat_eta)}",
                  f"--mirostat-ent {number(config.mirostat_tau)}"]
    if greedy:
        chain.append("top_k")
        flags.append("--top-k 1")
    elif not chain:
        chain.append("temperature")  # an empty --samplers is not accepted; T = 1 changes nothing
        flags.append("--temp 1.0")
    return chain, flags


def _llama_stage_flags(config: DecodingConfig, stage: str) -> list[str]:
    if stage == "dry":
        flags = [f"--dry-multiplier {number(config.dry_multiplier)}", f"--dry-base {number(config.dry_base)}",
                 f"--dry-allowed-length {config.dry_allowed_length}",
                 f"--dry-penalty-last-n {config.dry_penalty_last_n}"]
        breakers = list(config.dry_sequence_breakers)
        if breakers != LLAMA_DRY_BREAKERS:
            flags += [f"--dry-sequence-breaker {shlex.quote(b)}" for b in breakers] or ["--dry-sequence-breaker none"]
        return flags
    if stage == "xtc":
        return [f"--xtc-probability {number(config.xtc_probability)}", f"--xtc-threshold {number(config.xtc_threshold)}"]
    # dynamic temperature: llama.cpp's temperature sampler with a range (temp-ext)
    return [f"--temp {number(config.temperature)}", f"--dynatemp-range {number(config.dynatemp_range)}",
            f"--dynatemp-exp {number(config.dynatemp_exponent)}"]


def _llama_speculative(config: DecodingConfig) -> tuple[list[str], list[Note]]:
    k = config.num_draft_tokens
    notes = [Note("adaptive_k", "llama.cpp drafts up to --draft-max tokens; it has no acceptance-driven K")] \
        if config.adaptive_k else []
    if config.drafter == "ngram":
        return [f"--spec-type ngram-simple --spec-ngram-size-n {config.ngram_size} "
                f"--spec-ngram-size-m {k} --draft-max {k}"], notes
    if config.drafter.startswith("model:"):
        what = f"a GGUF of {config.drafter.removeprefix('model:')}"
    else:  # self-int8 / self-nf4: a quantized copy of the target itself
        what = f"a {'Q8_0' if config.drafter == 'self-int8' else 'Q4_0'} GGUF of the same model"
    notes.append(Note("drafter", f"llama.cpp takes the draft model as a separate file: add -md FILE with {what}"))
    return [f"--draft-max {k}"], notes


def _llama_caveats(config: DecodingConfig, keys: list[str], greedy: bool) -> list[Note]:
    out = []
    if not greedy:
        out.append(Note("seed", "llama.cpp has its own random generator: the same seed gives a different text"))
    if {"frequency_penalty", "presence_penalty"} & set(keys):
        out.append(Note("frequency_penalty" if "frequency_penalty" in keys else "presence_penalty",
                        "llama.cpp counts prompt tokens too (--repeat-last-n -1: the whole context); "
                        "the playground counts generated tokens only"))
    order = active_order(config)
    penalties = [i for i, s in enumerate(order) if s in PENALTY_STAGES]
    if penalties and penalties[-1] - penalties[0] + 1 != len(penalties):
        out.append(Note("stage_order", "llama.cpp applies the three penalties together, at the first one's place"))
    if config.stop:
        out.append(Note("stop", "--reverse-prompt is llama-cli/llama-completion's flag; for llama-server, "
                                "send the strings in the request's \"stop\" field"))
    if config.strategy == "speculative":
        out.append(Note("strategy", "the speculative-decoding flags are llama-server's"))
    if config.mirostat and not greedy and len(order) > 1:
        out.append(Note("mirostat", "with --mirostat, llama.cpp ignores --samplers and keeps only temperature"))
    return out
