"""Export a preset to other tools: a text-generation-webui preset (YAML) and llama.cpp flags.

Each export returns the text plus, knob by knob, what did not map (and why) and what mapped with a
behaviour difference worth knowing. Only knobs that change the run are considered: neutral values
and knobs of other strategies (e.g. num_beams under sampling) are left out, and greedy decoding
drops the sampling-only stages exactly as the engine does.

The YAML is written by hand: numbers, booleans and a fixed list of sampler names only, so no user
text ever lands in a value.

What each stage is called there, which of its knobs carry over, and why the others do not, is in
the stage's spec (``StageSpec.interop``, engine/stages/); this module holds the tools' own
rules (strategies, run knobs, their sampler lists) and writes the files.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from engine.config import KNOBS, STRATEGIES, DecodingConfig
from engine.presets import Preset
from engine.stages import STAGES, Export, ExportView, StageSpec, number

__all__ = ["InteropExport", "Note", "effective_knobs", "number", "to_llama_cpp", "to_textgen_webui"]

# Knobs that only matter under one strategy.
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


def _spec_of_knob(name: str) -> StageSpec | None:
    stage = KNOBS[name].stage
    return STAGES.get(stage) if stage is not None else None


def effective_knobs(config: DecodingConfig) -> list[str]:
    """Knobs that change this run, in KNOBS order: non-neutral ones, minus those of other
    strategies (and sampling-only ones under greedy), plus the settings the strategy itself runs on
    even at their neutral value (e.g. penalty_alpha 0.6 for contrastive search). A stage whose spec
    says ``export_all_knobs`` brings every knob while it is active and none while it is not."""
    # a strategy's knobs are inert under another strategy; its ``in_use`` ones run even at neutral
    inert = {k.name for name, spec in STRATEGIES.items() if name != config.strategy for k in spec.knobs}
    in_use = set(STRATEGIES[config.strategy].in_use)
    active = set(config.active_stages())
    for name, spec in STAGES.items():
        knobs = {k.name for k in spec.knobs}
        if config.is_greedy and spec.sampling_only:
            inert |= knobs
        if spec.interop.export_all_knobs:
            (in_use if name in active else inert).update(knobs)
    if config.strategy == "speculative":
        (in_use if config.drafter == "ngram" else inert).add("ngram_size")
    out = []
    for name, knob in KNOBS.items():
        value = getattr(config, name)
        value = list(value) if knob.kind == "str_list" else value
        if name not in inert and (value != knob.neutral or name in in_use):
            out.append(name)
    return out


def active_order(config: DecodingConfig) -> list[str]:
    """The active stages in the user's order (sampling-only ones dropped under greedy)."""
    return list(config.active_stages())


def _greedy_like(config: DecodingConfig) -> bool:
    """Strategies other tools lack are exported as greedy decoding, their nearest relative (their
    spec's ``exported_as``)."""
    return config.is_greedy or STRATEGIES[config.strategy].exported_as == "greedy"


def _view(config: DecodingConfig, keys: list[str]) -> ExportView:
    return ExportView(tuple(keys), _greedy_like(config), tuple(active_order(config)))


def _in_use(spec: StageSpec, keys: list[str]) -> list[str]:
    """The stage's knobs among the exported ones."""
    return [k.name for k in spec.knobs if k.name in keys]


def _stage_unmapped(config: DecodingConfig, keys: list[str], tool: str) -> list[Note]:
    """What the stages in use cannot carry to ``tool`` ("webui" | "llama"), from their specs, in
    KNOBS order."""
    view, out = _view(config, keys), []
    for spec in STAGES.values():
        export: Export = getattr(spec.interop, tool)
        used, unmapped = _in_use(spec, keys), export.unmapped
        if not used or not unmapped:
            continue
        if isinstance(unmapped, str):
            out += [Note(k, unmapped) for k in used]
        else:
            out += [Note(k, reason) for k, reason in unmapped(config, view)]
    position = {k: i for i, k in enumerate(KNOBS)}
    return sorted(out, key=lambda n: position.get(n.key, len(position)))


def _stage_caveats(config: DecodingConfig, keys: list[str], tool: str) -> list[Note]:
    """The stages' caveats for ``tool``: each text once, under the first knob in use that has it."""
    view, out, seen = _view(config, keys), [], set()
    for spec in STAGES.values():
        export: Export = getattr(spec.interop, tool)
        used = _in_use(spec, keys)
        if not used or not export.caveat:
            continue
        reason = export.caveat(config, view) if callable(export.caveat) else export.caveat
        if reason and reason not in seen:
            seen.add(reason)
            out.append(Note(used[0], reason))
    return out


def _common_unmapped(config: DecodingConfig, keys: list[str], tool: str, key: str) -> list[Note]:
    out = []
    if "top_n" in keys:
        out.append(Note("top_n", TRACE_ONLY))
    out += _stage_unmapped(config, keys, key)
    strategy = STRATEGIES[config.strategy]
    exported = strategy.exports.get(key)  # a strategy the tool lacks: its spec says what the export says
    if exported is not None:
        out.append(Note("strategy", exported.note.format(tool=tool)))
        names = [k.name for k in strategy.knobs] + list(exported.also)
        out += [Note(k, exported.knob_note) for k in names if k in keys]
    if _greedy_like(config) and not config.is_greedy:
        dropped = [k for k in keys if (spec := _spec_of_knob(k)) is not None and spec.sampling_only and k != "top_k"]
        out += [Note(k, "dropped: exported as greedy decoding") for k in dropped]
    return out


# --- text-generation-webui -------------------------------------------------------------------------
# Its sampler_priority names, in its default order (each stage's spec names its own). Names we have
# no stage for are kept, so the list stays complete.
TGW_PRIORITY = (
    "repetition_penalty", "presence_penalty", "frequency_penalty", "dry", "temperature", "dynamic_temperature",
    "quadratic_sampling", "top_n_sigma", "top_k", "top_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "tfs",
    "top_a", "min_p", "mirostat", "xtc", "encoder_repetition_penalty", "no_repeat_ngram",
)
TGW_STRATEGY_KNOBS = ("penalty_alpha",)  # written under the same name (each stage's are in its spec)
TGW_NOT_IN_PRESET = {
    "seed": "not part of a text-generation-webui preset; set 'Seed' in the Parameters tab",
    "max_new_tokens": "not part of a text-generation-webui preset; set 'max_new_tokens' in the Parameters tab",
    "stop": "not part of a text-generation-webui preset; use 'Custom stopping strings' in the Parameters tab",
}


def to_textgen_webui(preset: Preset) -> InteropExport:
    """A text-generation-webui preset (``user_data/presets/<name>.yaml``)."""
    config = preset.config
    keys = effective_knobs(config)
    view = _view(config, keys)
    lines = [f"# {_comment(preset.name)}: exported from Decoding Playground", f"# {_comment(preset.description)}"]
    greedy_export = _greedy_like(config) and config.strategy != "contrastive_search"
    if greedy_export:
        lines += ["do_sample: false", "top_k: 1"]
    if config.strategy == "contrastive_search":
        lines.append("do_sample: false")
    for key in keys:
        spec = _spec_of_knob(key)
        if key == "top_k" and greedy_export:
            continue
        if spec is not None and key in spec.interop.webui.knobs:
            scale = spec.interop.webui.scale  # e.g. its epsilon_cutoff is in units of 1e-4
            lines.append(f"{key}: {number(getattr(config, key) * scale if scale != 1 else getattr(config, key))}")
        elif key in TGW_STRATEGY_KNOBS:
            lines.append(f"{key}: {number(getattr(config, key))}")
    for spec in STAGES.values():
        if spec.interop.webui.lines is not None and _in_use(spec, keys):
            lines += spec.interop.webui.lines(config, view)
    ours = [STAGES[s].interop.webui.sampler for s in view.order if STAGES[s].interop.webui.sampler]
    reorder = ours != sorted(ours, key=lambda n: TGW_PRIORITY.index(n) if n in TGW_PRIORITY else len(TGW_PRIORITY))
    if reorder:
        lines.append("sampler_priority: |-")
        lines += [f"  {name}" for name in ours + [n for n in TGW_PRIORITY if n not in ours]]
    unmapped = _common_unmapped(config, keys, "text-generation-webui", "webui")
    unmapped += [Note(k, reason) for k, reason in TGW_NOT_IN_PRESET.items() if k in keys]
    if config.strategy == "speculative":
        speculative = [k.name for k in STRATEGIES["speculative"].knobs]
        unmapped += [Note(k, "speculative decoding is set up when loading the model in text-generation-webui (a draft "
                             "model, or prompt_lookup_num_tokens); the preset keeps the sampling settings, which give "
                             "the same distribution") for k in speculative if k in keys]
    caveats = _stage_caveats(config, keys, "webui")
    if config.strategy == "contrastive_search":
        caveats.append(Note("penalty_alpha", "contrastive search works with the Transformers loader only"))
    if reorder:
        caveats.append(Note("stage_order", "sampler_priority sets the order for loaders that honour it; "
                                           "others use their own"))
    return InteropExport("text-generation-webui", "\n".join(lines) + "\n", tuple(unmapped), tuple(caveats))


def _comment(text: str) -> str:
    """One line of text, safe in a YAML comment."""
    return " ".join(text.split())[:200]


# --- llama.cpp -------------------------------------------------------------------------------------
# Each stage's llama.cpp sampler, flag and reasons are in its spec (``StageSpec.interop.llama``).
# Views of them for other modules (engine/backends/llamacpp.py): our stage -> (llama.cpp sampler name, flag for
# its main knob); the knobs llama.cpp has no sampler for -> why; the stages that are its one
# "penalties" sampler.
LLAMA_SAMPLER = {name: (s.interop.llama.sampler, s.interop.llama.flag) for name, s in STAGES.items()
                 if s.interop.llama.sampler}
LLAMA_UNMAPPED = {k.name: s.interop.llama.unmapped for s in STAGES.values() if s.name != "constraints"
                  and isinstance(s.interop.llama.unmapped, str) and s.interop.llama.unmapped for k in s.knobs}
PENALTY_STAGES = tuple(name for name, s in STAGES.items() if s.interop.llama.sampler == "penalties")


def to_llama_cpp(preset: Preset) -> InteropExport:
    """llama.cpp command-line flags (``llama-cli`` / ``llama-completion`` / ``llama-server``):
    ``--samplers`` lists the active stages in the preset's order, then one flag per value."""
    config = preset.config
    keys = effective_knobs(config)
    greedy = _greedy_like(config)
    chain, flags = _llama_chain(config, _view(config, keys))
    flags = [f'--samplers "{";".join(chain)}"'] + flags
    if not greedy:
        flags.append(f"--seed {config.seed}")
    flags.append(f"--n-predict {config.max_new_tokens}")
    flags += [f"--reverse-prompt {shlex.quote(s)}" for s in config.stop]
    unmapped = _common_unmapped(config, keys, "llama.cpp", "llama")
    if config.strategy == "speculative":
        spec_flags, spec_notes = _llama_speculative(config)
        flags += spec_flags
        unmapped += spec_notes
    return InteropExport("llama.cpp", " ".join(flags), tuple(unmapped), tuple(_llama_caveats(config, keys, greedy)))


def _llama_order(view: ExportView) -> list[str]:
    """The active stages llama.cpp runs, in the user's order (greedy: no sampling-only ones)."""
    return [s for s in view.order if not (view.greedy and STAGES[s].sampling_only)]


def _llama_chain(config: DecodingConfig, view: ExportView) -> tuple[list[str], list[str]]:
    """Sampler names in order and their value flags. Greedy: the non-sampling stages, then top-k 1.
    Stages that are one llama.cpp sampler (the three penalties) give it at the first one's place,
    with the flags of all of them; a stage with no sampler (logit bias, mirostat) gives its flags."""
    chain: list[str] = []
    flags: list[str] = []
    order = _llama_order(view)
    for stage in order:
        sampler = STAGES[stage].interop.llama.sampler
        if sampler is not None and sampler in chain:
            continue  # its flags came with the first stage of its sampler
        if sampler is not None:
            chain.append(sampler)
        members = [s for s in STAGES if s in order and STAGES[s].interop.llama.sampler == sampler] \
            if sampler is not None else [stage]
        flags += _llama_flags(config, members, view)
    if view.greedy:
        chain.append("top_k")
        flags.append("--top-k 1")
    elif not chain:
        chain.append("temperature")  # an empty --samplers is not accepted; T = 1 changes nothing
        flags.append("--temp 1.0")
    return chain, flags


def _llama_flags(config: DecodingConfig, stages: list[str], view: ExportView) -> list[str]:
    """The flags of ``stages`` (one llama.cpp sampler, or one stage): each main knob's flag, then
    their further flags, each once."""
    exports = [(STAGES[s], STAGES[s].interop.llama) for s in stages]
    flags = [f"{e.flag} {number(getattr(config, spec.main_knob.name))}" for spec, e in exports if e.flag]
    for _, e in exports:
        flags += [f for f in (e.lines(config, view) if e.lines else []) if f not in flags]
    return flags


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
    out += _stage_caveats(config, keys, "llama")
    order = _llama_order(_view(config, keys))
    for sampler in dict.fromkeys(STAGES[s].interop.llama.sampler for s in order):
        places = [i for i, s in enumerate(order) if sampler is not None and STAGES[s].interop.llama.sampler == sampler]
        if places and places[-1] - places[0] + 1 != len(places):
            out.append(Note("stage_order", f"llama.cpp applies {', '.join(order[i] for i in places)} together "
                                           f"(its one {sampler} sampler), at the first one's place"))
    if config.stop:
        out.append(Note("stop", "--reverse-prompt is llama-cli/llama-completion's flag; for llama-server, "
                                "send the strings in the request's \"stop\" field"))
    if config.strategy == "speculative":
        out.append(Note("strategy", "the speculative-decoding flags are llama-server's"))
    return out
