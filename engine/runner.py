"""The one way to run any strategy: ``stream`` yields typed ``Event``s as the run goes, the last one
carrying the assembled ``Trace``; ``run`` returns that Trace; ``branch`` continues a finished run
from any step (another token, or other knobs) through that same ``stream``, with ``prefix=`` (the
tokens kept) and ``force=`` (the token taken at the next step).

Every event has the same shape whatever the strategy (mlx-lm's ``stream_generate`` is the model):
the tokens it adds to the output (a StepTrace each), the strategy's own record (a beam step, a
speculative round, contrastive candidates, an MCTS position...) and, on the last event only, the
whole Trace. Views, the CLI, the API and the benchmarks all come through here, so every surface
emits the same trace JSON. The ``RunControl`` is checked between events, and strategies check it
inside long steps too, so a cancelled or timed-out run stops within one step.
"""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

from . import beam, contrastive, core, decode, mcts, medusa, remote, remote_beam, remote_speculative, speculative
from .config import DecodingConfig
from .control import RunControl, check
from .models import LoadedModel, ModelRegistry
from .sampling import NO_TOKENS_LEFT, NoTokensLeft
from .trace import Event, StageTrace, StepTrace, Trace


@dataclass(frozen=True)
class RunContext:
    """Everything a strategy's ``stream`` gets: the model, the prompt (text and encoded ids), the
    knobs, where drafters/amateurs load from, the run's control, whether to time a target-only
    baseline, the batched scheduler greedy/sampling runs may join, and for a continuation
    (``CONTINUABLE`` strategies only) the tokens it continues after and the token it is forced to."""

    lm: LoadedModel
    prompt: str
    ids: list[int]
    config: DecodingConfig
    chat: bool = False
    registry: ModelRegistry | None = None
    control: RunControl | None = None
    compare_baseline: bool = False
    scheduler: Any = None
    prefix: tuple[int, ...] = ()  # tokens already generated: the run continues after them
    force: int | None = None  # the token taken at the first new step instead of a pick
    resume: tuple[StageTrace, ...] | None = None  # the run's stage records at the step after prefix (same knobs)


class Strategy(Protocol):
    """A decoding strategy as the runner knows it: ``stream(ctx)`` yields Events, the last one
    holding the assembled Trace."""

    def __call__(self, ctx: RunContext) -> Iterator[Event]: ...


LOCAL = "local"  # the backend of a model loaded in this process (a LoadedModel)
# Backend -> strategy name (DecodingConfig.strategy) -> its stream; ``register`` adds one.
BACKEND_STREAMS: dict[str, dict[str, Strategy]] = {LOCAL: {}, **{b: {} for b in remote.BACKENDS}}
# Backend -> the strategies whose stream honours RunContext.prefix / .force (the others refuse them).
BACKEND_CONTINUABLE: dict[str, set[str]] = {b: set() for b in BACKEND_STREAMS}
STRATEGY_STREAMS = BACKEND_STREAMS[LOCAL]  # the local model's table
CONTINUABLE = BACKEND_CONTINUABLE[LOCAL]


def register(*names: str, continues: bool = False,
             backends: Sequence[str] = (LOCAL,)) -> Callable[[Strategy], Strategy]:
    """Decorator: ``fn(ctx) -> Iterator[Event]`` runs the strategies ``names`` on models of the
    ``backends`` (a remote model's ``backend``, else local); ``continues``: it can start after a
    ``prefix`` and take a forced token (see ``stream``)."""

    def add(fn: Strategy) -> Strategy:
        for backend in backends:
            for name in names:
                BACKEND_STREAMS[backend][name] = fn
                if continues:
                    BACKEND_CONTINUABLE[backend].add(name)
        return fn

    return add


def backend_of(lm: Any) -> str:
    """The backend a model runs on: a remote model says which (``RemoteModel.backend``); a model
    loaded here has none (local)."""
    return getattr(lm, "backend", LOCAL)


def stream(lm: LoadedModel, prompt: str, config: DecodingConfig, *, chat: bool = False,
           prompt_ids: Sequence[int] | None = None, registry: ModelRegistry | None = None,
           control: RunControl | None = None, compare_baseline: bool = False,
           scheduler: Any = None, prefix: Sequence[int] = (), force: int | None = None,
           resume: Sequence[StageTrace] | None = None) -> Iterator[Event]:
    """Run ``config.strategy`` on ``prompt`` and yield Events; the last one holds the Trace.

    ``prompt_ids``: the prompt already encoded (with ``chat`` applied), else it is encoded here.
    ``registry``: where drafters and amateurs (``self-int8``, ``model:<x>``) are loaded from.
    ``control``: checked once per step; raises ``RunStopped`` when cancelled or past its limit.
    ``compare_baseline``: speculative and Medusa, also time a target-only run (summary ``speedup``).
    ``scheduler``: greedy/sampling runs go through this batched scheduler (shared forwards with
    other users' runs) instead of a forward of their own.
    ``prefix``: tokens already generated; the run continues after them (its steps and trace hold
    only the new tokens, indexed from ``len(prefix)``). ``force``: the token taken at the first new
    step instead of a pick. Greedy and sampling only (``CONTINUABLE``); ValueError otherwise.
    ``resume``: the stage records the continued run made at the step after ``prefix``, under these
    same knobs: stateful stages (mirostat's μ) take their state from them and the draws before are
    skipped, instead of replaying the prefix positions (``core.RunState``).

    The stream is looked up by the model's backend (``backend_of``) and the strategy: a remote
    model (``engine.remote``) runs its backend's streams, and a strategy its backend lacks is one
    ValueError naming both."""
    backend = backend_of(lm)
    table = BACKEND_STREAMS[backend]
    strategy = table.get(config.strategy)
    if strategy is None:  # DecodingConfig validates the name, so this is a strategy without a runner yet
        raise ValueError(f"strategy: {config.strategy!r} does not run on the {backend} backend; "
                         f"it runs {', '.join(sorted(table))}")
    prefix = tuple(prefix)
    _check_continuation(lm, config.strategy, prefix, force)
    ids = list(prompt_ids) if prompt_ids is not None else lm.encode(prompt, chat)
    yield from strategy(RunContext(lm, prompt, ids, config, chat, registry or ModelRegistry(), control,
                                   compare_baseline, scheduler, prefix, force,
                                   tuple(resume) if resume is not None else None))


def _check_continuation(lm: LoadedModel, strategy: str, prefix: tuple[int, ...], force: int | None) -> None:
    """ValueError naming the argument when ``prefix`` / ``force`` are given to a strategy that
    cannot continue, or hold a token outside the vocabulary."""
    continuable = BACKEND_CONTINUABLE[backend_of(lm)]
    for name, given in (("prefix", bool(prefix)), ("force", force is not None)):
        if given and strategy not in continuable:
            raise ValueError(f"{name}: only {' and '.join(sorted(continuable))} runs continue from a step, "
                             f"not {strategy!r}")
    tokens = [("prefix", t) for t in prefix] + ([("force", force)] if force is not None else [])
    for name, token in tokens:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < lm.vocab_size:
            raise ValueError(f"{name}: token {token!r} is out of range; the vocabulary has {lm.vocab_size} tokens")


def collect(events: Iterable[Event]) -> Trace:
    """The Trace of a stream of Events (its last event's)."""
    for event in events:
        if event.trace is not None:
            return event.trace
    raise RuntimeError("stream ended without a trace")


def run(lm: LoadedModel, prompt: str, config: DecodingConfig, *, chat: bool = False,
        prompt_ids: Sequence[int] | None = None, registry: ModelRegistry | None = None,
        control: RunControl | None = None, compare_baseline: bool = False, scheduler: Any = None) -> Trace:
    """The whole run: ``stream`` collected, returning its Trace."""
    return collect(stream(lm, prompt, config, chat=chat, prompt_ids=prompt_ids, registry=registry, control=control,
                          compare_baseline=compare_baseline, scheduler=scheduler))


def branch(lm: LoadedModel, parent: Trace, at_step: int, token_id: int | None, *, config: DecodingConfig | None = None,
           control: RunControl | None = None, scheduler: Any = None) -> Iterator[Event]:
    """Continue ``parent`` (a greedy or sampling trace) from step ``at_step``: with ``token_id``
    forced there (a branch), or with ``token_id`` None, drawn under ``config`` (default the parent's
    knobs: "continue from here with these knobs"). The first event replays the parent's steps
    before ``at_step`` unchanged; the new steps follow (``stream`` with ``prefix`` = the kept
    tokens, ``force`` = ``token_id``; under the parent's own knobs, ``resume`` = its records at
    ``at_step``, so stateful stages go on from the state it recorded, with no replay); the last
    event holds the new Trace (``branch_of`` = ``at_step``, its ``config`` the one it ran under)."""
    continuable = BACKEND_CONTINUABLE[backend_of(lm)]
    if parent.strategy not in continuable:
        raise ValueError(f"branch: only greedy and sampling runs can be branched, this one is {parent.strategy!r}")
    if not isinstance(at_step, int) or isinstance(at_step, bool) or not 0 <= at_step < len(parent.steps):
        raise ValueError(f"at_step: {at_step!r} is out of range; the run has {len(parent.steps)} steps")
    if token_id is not None and (not isinstance(token_id, int) or isinstance(token_id, bool)
                                 or not 0 <= token_id < lm.vocab_size):
        raise ValueError(f"token_id: {token_id!r} is out of range; the vocabulary has {lm.vocab_size} tokens")
    own = DecodingConfig.from_dict(parent.config)
    config = config if config is not None else own
    if config.strategy not in continuable:
        raise ValueError(f"strategy: only greedy and sampling continue from a step, got {config.strategy!r}")
    return _branch_events(lm, parent, at_step, token_id, config, config == own, control, scheduler)


def _branch_events(lm: LoadedModel, parent: Trace, at_step: int, token_id: int | None, config: DecodingConfig,
                   own_knobs: bool, control: RunControl | None, scheduler: Any) -> Iterator[Event]:
    """``branch``'s events once its arguments are checked (``branch`` raises at the call, not at
    the first event, so a caller can refuse before it draws anything)."""
    kept = list(parent.steps[:at_step])
    if kept:
        yield Event(steps=kept)
    for event in stream(lm, parent.prompt, config, chat=parent.chat, prompt_ids=parent.prompt_token_ids,
                        control=control, scheduler=scheduler, prefix=parent.generated_token_ids[:at_step],
                        force=token_id, resume=parent.steps[at_step].stages if own_knobs else None):
        if event.trace is None:
            yield event
            continue
        # the continuation's trace, with the kept steps before it
        trace = core.assemble(lm, parent.prompt, parent.prompt_token_ids, config, kept + event.trace.steps,
                              parent.chat, branch_of=at_step)
        trace.extra = dict(event.trace.extra)  # e.g. a remote run's label (its lists cover the new steps)
        if event.trace.stop_reason == NO_TOKENS_LEFT:
            trace.end_with_no_tokens_left()
        yield Event(trace=trace)


def partial_trace(lm: LoadedModel, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig,
                  steps: list[StepTrace], chat: bool, branch_of: int | None = None) -> Trace:
    """A Trace of the steps streamed so far (what a view draws while the run goes on)."""
    return core.assemble(lm, prompt, prompt_ids, config, steps, chat, branch_of=branch_of)


# --- one adapter per strategy family ----------------------------------------------------------------
def _checked(source: Iterator, control: RunControl | None) -> Iterator:
    """Items of ``source``, checking ``control`` before each one is computed. A stopped run closes
    ``source`` at once (a served model's streamed request then ends on the server too)."""
    with closing(source):  # type: ignore[type-var]
        while True:
            check(control)
            try:
                item = next(source)
            except StopIteration:
                return
            yield item


def batched(config: DecodingConfig, scheduler: Any) -> Any:
    """The scheduler a greedy/sampling run may join, or None: its batch rows are plain
    full-precision caches, so a run with another KV cache kind decodes on its own."""
    return scheduler if scheduler is not None and config.kv_cache == "dynamic" else None


@register("greedy", "sample", continues=True)
def _stepwise(ctx: RunContext) -> Iterator[Event]:
    lm, prompt, ids, config, chat, control = ctx.lm, ctx.prompt, ctx.ids, ctx.config, ctx.chat, ctx.control
    scheduler = batched(config, ctx.scheduler)
    source = (scheduler.stream(ids, config, prefix=ctx.prefix, force=ctx.force, control=control, resume=ctx.resume)
              if scheduler is not None
              else decode.stream(lm, ids, config, prefix=ctx.prefix, force=ctx.force, resume=ctx.resume))
    steps, ended = [], False
    try:
        for step in _checked(source, control):
            steps.append(step)
            yield Event(steps=[step])
    except NoTokensLeft:  # a step with nothing left to pick ends the run, saying why
        ended = True
    trace = core.assemble(lm, prompt, ids, config, steps, chat)
    if ended:
        trace.end_with_no_tokens_left()
    yield Event(trace=trace)


@register("beam")
def _beam(ctx: RunContext) -> Iterator[Event]:
    yield from _checked(beam.stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat), ctx.control)


@register("speculative")
def _speculative(ctx: RunContext) -> Iterator[Event]:
    yield from _checked(speculative.stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat,
                                           registry=ctx.registry, control=ctx.control,
                                           compare_baseline=ctx.compare_baseline), ctx.control)


@register("contrastive_search", "contrastive_decoding")
def _contrastive(ctx: RunContext) -> Iterator[Event]:
    yield from _checked(contrastive.stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat,
                                           registry=ctx.registry), ctx.control)


@register("mcts")
def _mcts(ctx: RunContext) -> Iterator[Event]:
    yield from mcts.stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat, control=ctx.control)


@register("medusa")
def _medusa(ctx: RunContext) -> Iterator[Event]:
    yield from medusa.stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat, control=ctx.control,
                             compare_baseline=ctx.compare_baseline)


@register(*remote.STRATEGIES, continues=True, backends=remote.BACKENDS)
def _remote(ctx: RunContext) -> Iterator[Event]:
    yield from _checked(remote.stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat,  # type: ignore[arg-type]
                                      prefix=ctx.prefix, force=ctx.force), ctx.control)


@register("beam", backends=remote.BACKENDS)
def _remote_beam(ctx: RunContext) -> Iterator[Event]:
    search = remote_beam.stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat)  # type: ignore[arg-type]
    yield from _checked(search, ctx.control)


@register("speculative", backends=remote.BACKENDS)
def _remote_speculative(ctx: RunContext) -> Iterator[Event]:
    rounds = remote_speculative.stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat,  # type: ignore[arg-type]
                                       registry=ctx.registry, control=ctx.control,
                                       compare_baseline=ctx.compare_baseline)
    yield from _checked(rounds, ctx.control)
