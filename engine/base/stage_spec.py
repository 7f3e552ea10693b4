"""What a stage is made of: ``StageSpec`` and the registry ``STAGES`` every other module reads.

A stage lives in ONE file, its family module in ``engine/stages/`` (truncation, penalties,
temperature, constraints, stateful): its class, and right under it one ``register(StageSpec(...))``
saying everything else about it: its knobs, its place in the default order, whether greedy ignores
it, when it is active, how to build it from a config, whether rows may share one call, the words the
step chart says about it, and its names in transformers, text-generation-webui and llama.cpp.
``config`` derives the stage order, the stage names, the sampling-only set, the stage knobs and
``active_stages`` from ``STAGES``; ``engine.stages.build_stage`` and ``chain``'s row sharing,
``interop``'s exports, the step chart's notes (``playground/charts/stage_notes.py``) and the knob
panel (``playground/knobs.py``) read the specs.

On the base floor (docs/architecture.md): no torch here and no engine import but the knobs and
``engine.numbers``; ``config`` reads ``STAGES`` when it validates, and the stage families register
into it. ``STAGES`` fills when ``engine.stages`` is imported, which importing anything under
``engine`` does (``engine/__init__.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from engine.base.knobs import MAX_BIAS_ENTRIES, MAX_STRING_LEN, ConfigError, Knob  # noqa: F401  (the families' names)
from engine.numbers import percent

if TYPE_CHECKING:  # annotations only: config and trace are on a floor above
    from engine.config import DecodingConfig
    from engine.trace import StageTrace


@dataclass(frozen=True)
class BuildContext:
    """What building a stage may need besides the config: the prompt's length (penalties count
    generated tokens only), the tokenizer (words -> ids), the EOS ids, and the run's seeded
    generator (for stages that draw)."""

    prompt_length: int = 0
    tokenizer: Any = None
    eos_token_ids: Sequence[int] = ()
    generator: Any = None  # torch.Generator | None


@dataclass(frozen=True)
class ExportView:
    """What an export callable sees besides the config: the knobs that change the run (in
    ``config.KNOBS`` order), whether the export is greedy (greedy decoding, or a strategy the tool
    lacks, exported as greedy), and the active stages in the user's order."""

    keys: Sequence[str]
    greedy: bool
    order: Sequence[str]


# An export callable: (config, view) -> its lines / flags, its (knob, reason) notes, or a caveat.
Lines = Callable[["DecodingConfig", ExportView], list[str]]
Reasons = Callable[["DecodingConfig", ExportView], list[tuple[str, str]]]
Caveat = Callable[["DecodingConfig", ExportView], "str | None"]


@dataclass(frozen=True)
class Export:
    """How a stage maps onto one other tool (``engine/interop.py`` writes the files).

    ``sampler``: the tool's name for it (text-generation-webui's ``sampler_priority`` name,
    llama.cpp's ``--samplers`` name); None when the tool has no such sampler. Stages with the same
    llama.cpp sampler are one sampler there (the three penalties). ``knobs``: text-generation-webui
    knobs of the same name (written ``name: value``, times ``scale``). ``flag``: llama.cpp's flag
    for the main knob. ``lines``: any further lines (webui) or flags (llama.cpp). ``unmapped``: why
    the tool cannot carry it (a text: every knob of the stage that is in use; or a callable giving
    (knob, reason) pairs). ``caveat``: a difference in behaviour worth knowing when it is in use
    (a text, or a callable that may say nothing)."""

    sampler: str | None = None
    knobs: tuple[str, ...] = ()
    scale: float = 1.0
    flag: str | None = None
    lines: Lines | None = None
    unmapped: str | Reasons = ""
    caveat: str | Caveat = ""


@dataclass(frozen=True)
class Interop:
    """A stage's names elsewhere: ``transformers`` (the logits processor doing the same, None when
    the stage is ours), ``webui`` (text-generation-webui) and ``llama`` (llama.cpp).
    ``export_all_knobs``: while the stage is active every one of its knobs is exported, neutral or
    not (XTC's threshold 0.1 is part of what XTC does); otherwise only the non-neutral ones."""

    transformers: str | None = None
    webui: Export = Export()
    llama: Export = Export()
    export_all_knobs: bool = False


# What step mode (our chain over a served model's top-N, engine.backends.remote) cannot do exactly,
# in words: a stage's ``served.step_caveats`` name the ones that touch it (measured against
# llama.cpp's own samplers in tests/remote/test_remote_llamacpp.py: temperature, top-k, min-p, XTC, DRY and
# typical after a top-k agree exactly).
STEP_TAIL = ("top-p, typical, eta, top-H, mirostat and the cutoffs weigh the top-N renormalised (the tail mass is "
             "left out)")
STEP_SPREAD = "top-nσ's σ and dynamic temperature's entropy are over the top-N, not the whole vocabulary"
STEP_REPETITION = ("the repetition penalty (divide positive logits, multiply negative ones) sees log-probabilities, "
                   "all negative, not the model's logits")
STEP_LIFT = "penalties and biases cannot lift a token from outside the top-N"


@dataclass(frozen=True)
class Served:
    """How a served model runs the stage (engine.backends).

    ``llamacpp(config, context)``: the llama-server ``/completion`` fields that carry its knobs
    (every one sent, neutral or not, so no server default leaks in; ``context``: the server's
    context length, its window for "the whole context"); None when llama.cpp has no field for it.
    ``openai(config)``: its knobs as OpenAI-compatible sampling fields (vLLM's ``SamplingParams``
    names); None when the API has none. ``openai_llamacpp(config)``: its fields on llama-server's own
    OpenAI-compatible endpoint (``/v1``), where they differ from vLLM's (llama-server reads its own
    ``/completion`` names there: the grammar's ``grammar`` / ``json_schema``, not vLLM's
    ``structured_outputs``); None: ``openai``'s. ``refused(config, server)``: (knob, reason) for
    what a server (``"llamacpp"``: llama-server, either endpoint; ``"vllm"``) cannot take of the
    stage though it has fields for it (llama.cpp takes no regular expression). ``step_caveats``:
    what step mode cannot do exactly for it (``STEP_*``)."""

    llamacpp: Callable[["DecodingConfig", int], dict[str, Any]] | None = None
    openai: Callable[["DecodingConfig"], dict[str, Any]] | None = None
    step_caveats: tuple[str, ...] = ()
    openai_llamacpp: Callable[["DecodingConfig"], dict[str, Any]] | None = None
    refused: Callable[["DecodingConfig", str], list[tuple[str, str]]] | None = None

    def refusals(self, config: "DecodingConfig", server: str) -> list[tuple[str, str]]:
        """``refused(config, server)``, or none."""
        return list(self.refused(config, server)) if self.refused is not None else []


def same_fields(*knobs: str, **renamed: str) -> Callable[..., dict[str, Any]]:
    """A ``Served.llamacpp`` / ``Served.openai`` that sends each knob as it is: under its own name
    (``knobs``) or under another (``renamed``: ``field=knob``)."""
    pairs = [(k, k) for k in knobs] + [(knob, name) for name, knob in renamed.items()]
    return lambda config, *context: {name: getattr(config, knob) for knob, name in pairs}


@dataclass(frozen=True)
class StageSpec:
    """Everything about one stage except its arithmetic (its ``Stage`` class).

    ``order``: its place in the default stage order (smaller first; the built-in stages are 10
    apart). ``knobs``: the config keys it owns (``knobs[0]`` is its main knob; ``register`` sets
    each knob's ``stage``). ``sampling_only``: greedy decoding ignores it. ``active(config)``: it
    changes the distribution (default: its main knob is not neutral). ``build(config, ctx)``: the
    ``Stage``. ``check(config)``: ConfigError naming the knob when its knobs do not fit together
    (the grammar's text read as its kind says), called at validation. ``shareable``: its output row depends only on that row's logits and on params fixed
    at construction (no ids, no state, no draws), so rows with equal params share one call.
    ``label``: its short name in sentences, followed by the main knob's value when ``label_value``.
    ``note(trace)``: one line on what it did at a step (default: the mass it moved or removed).
    ``heading(trace)``: the stage and its knobs in words, for a panel title. ``group``: the knob
    panel's accordion for its knobs (a key of ``playground.knobs.GROUP_TITLES``; None: no
    sampler group). ``interop``: its names in other tools; ``served``: how a served model runs it
    (its llama.cpp and OpenAI request fields, step mode's caveats). ``oracle``: the tests that check
    it against its reference
    (``tests/test_x.py::test_name``, space-separated)."""

    name: str
    order: int
    knobs: tuple[Knob, ...]
    build: Callable[["DecodingConfig", BuildContext], Any]
    check: Callable[["DecodingConfig"], None] | None = None
    active: Callable[["DecodingConfig"], bool] | None = None
    sampling_only: bool = False
    shareable: bool = False
    label: str = ""
    label_value: bool = True
    note: Callable[["StageTrace"], str] | None = None
    heading: Callable[["StageTrace"], str] | None = None
    group: str | None = None
    interop: Interop = Interop()
    served: Served = Served()
    oracle: str = ""

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.knobs:
            raise ValueError(f"stage {self.name!r}: a name that is an identifier and at least one knob")
        for knob in self.knobs:
            if knob.stage not in (None, self.name):
                raise ValueError(f"stage {self.name!r}: knob {knob.name!r} belongs to stage {knob.stage!r}")
        object.__setattr__(self, "knobs", tuple(k if k.stage else dataclasses.replace(k, stage=self.name)
                                                for k in self.knobs))

    @property
    def main_knob(self) -> Knob:
        return self.knobs[0]

    def is_active(self, config: "DecodingConfig") -> bool:
        if self.active is not None:
            return bool(self.active(config))
        return getattr(config, self.main_knob.name) != self.main_knob.neutral

    @property
    def text_label(self) -> str:
        return self.label or self.name.replace("_", " ")


# --- the registry ------------------------------------------------------------------------------------
STAGES: dict[str, StageSpec] = {}  # in the default order (by ``order``; ties: registration order)
_registered: list[StageSpec] = []  # in registration order (ties of ``order`` keep it)
_listeners: list[Callable[[], None]] = []


def register(spec: StageSpec) -> StageSpec:
    """Add a stage (a name or knob already taken raises ValueError). Modules that derive tables
    from ``STAGES`` (``config``) recompute them."""
    if spec.name in STAGES:
        raise ValueError(f"stage {spec.name!r} is registered twice")
    taken = {k.name for s in _registered for k in s.knobs}
    clash = [k.name for k in spec.knobs if k.name in taken]
    if clash:
        raise ValueError(f"stage {spec.name!r}: knob {clash[0]!r} belongs to another stage")
    _registered.append(spec)
    _changed()
    return spec


def unregister(name: str) -> None:
    """Remove a stage (tests that register a toy stage clean up with this)."""
    _registered[:] = [s for s in _registered if s.name != name]
    _changed()


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` after every register / unregister (and now)."""
    _listeners.append(listener)
    listener()


def _changed() -> None:
    ordered = sorted(enumerate(_registered), key=lambda item: (item[1].order, item[0]))
    STAGES.clear()
    STAGES.update((s.name, s) for _, s in ordered)
    for listener in _listeners:
        listener()


def declared() -> tuple[StageSpec, ...]:
    """The specs in the default stage order (``order``; ties: registration order), which is the order
    of their knobs in ``config.KNOBS``, the exports and the knob panel's groups: it does not depend
    on which family module declares a stage."""
    return tuple(STAGES.values())


# --- the words of a stage's note (the step chart) ---------------------------------------------------
def quoted(token: str) -> str:
    """A token as the chart shows it: quoted, with newlines and tabs visible."""
    return "'" + token.replace("\n", "\\n").replace("\t", "\\t") + "'"


def token_names(tokens: Sequence[Any], limit: int = 3) -> str:
    """The first ``limit`` tokens (TokenProb), quoted, comma-separated."""
    names = [quoted(t.token) for t in tokens[:limit]]
    return ", ".join(names) + (", …" if len(tokens) > limit else "")


def stage_label(stage: "StageTrace") -> str:
    """The stage's short name and main knob, e.g. "top-k 50" (for sentences)."""
    spec = STAGES.get(stage.name)
    if spec is None:
        return stage.name.replace("_", " ")
    value = stage.params.get(spec.main_knob.name) if spec.label_value else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{spec.text_label} {value:g}"
    return spec.text_label


def truncation_note(stage: "StageTrace") -> str:
    """A stage that removes tokens: the mass it removed (and which of the top tokens)."""
    if stage.mass_removed <= 0:
        return f"{stage_label(stage)}: removed nothing; {stage.kept} tokens left"
    removed = f" ({token_names(stage.removed)})" if stage.removed else ""
    return f"{stage_label(stage)}: removed {percent(stage.mass_removed)} of the mass{removed}; {stage.kept} tokens left"


def reshape_note(stage: "StageTrace") -> str:
    """A stage that moves mass without removing tokens: how much it moved."""
    return f"{stage_label(stage)}: moved {percent(stage.tv_distance)} of the mass"


def title_number(value: Any, fmt: str = "g") -> str:
    """A knob's value for a title ("?" when the trace lacks it, never "None")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "?"
    return format(value, fmt)


def param(stage: "StageTrace", key: str, fmt: str = "g") -> str:
    """``stage.params[key]`` for a title."""
    return title_number(stage.params.get(key), fmt)


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

