"""The one way to run any strategy: ``stream(RunRequest(...))`` yields typed ``Event``s as the run
goes, the last one carrying the assembled ``Trace``; ``run`` returns that Trace; ``branch``
continues a finished run from any step (another token, or other knobs) through that same
``stream``, with ``prefix=`` (the tokens kept) and ``force=`` (the token taken at the next step).

Every event has the same shape whatever the strategy (mlx-lm's ``stream_generate`` is the model):
the tokens it adds to the output (a StepTrace each), the strategy's own record (a beam step, a
speculative round, contrastive candidates, an MCTS position...) and, on the last event only, the
whole Trace. Views, the CLI, the API and the benchmarks all come through here, so every surface
emits the same trace JSON. The strategy's stream is looked up in its spec
(``engine.base.strategy_spec.STRATEGIES``: ``stream`` on a model loaded here, ``served`` on a served
one); the ``RunControl`` is checked between events, and strategies check it inside long steps too,
so a cancelled or timed-out run stops within one step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

from engine import core
from engine.backends.registry import ModelRegistry
from engine.base.seam import Model, Models
from engine.config import DecodingConfig
from engine.control import RunControl, under
from engine.core import RunContext
from engine.sampling import NO_TOKENS_LEFT
from engine.scheduler import Scheduler
from engine.base.strategy_spec import STRATEGIES, StrategySpec
from engine.trace import Event, StageTrace, StepTrace, Trace



@dataclass(frozen=True)
class RunRequest:
    """A run, as a caller asks for it.

    ``lm``: the model (loaded here or served). ``prompt``: the text; ``chat``: with the model's chat
    template. ``config``: the strategy and every knob. ``prompt_ids``: the prompt already encoded
    (with ``chat`` applied), else it is encoded here. ``registry``: where drafters and amateurs
    (``self-int8``, ``model:<x>``) are loaded from. ``control``: checked once per step; raises
    ``RunStopped`` when cancelled or past its limit. ``compare_baseline``: speculative and Medusa
    also time a target-only run (summary ``speedup``). ``scheduler``: greedy/sampling runs go
    through this batched scheduler (shared forwards with other users' runs) instead of a forward
    of their own. ``prefix``: tokens already generated; the run continues after them (its steps and
    trace hold only the new tokens, indexed from ``len(prefix)``). ``force``: the token taken at the
    first new step instead of a pick. ``resume``: the stage records the continued run made at the
    step after ``prefix``, under these same knobs: stateful stages (mirostat's μ) take their state
    from them and the draws before are skipped, instead of replaying the prefix positions
    (``core.RunState``). ``prefix`` / ``force`` / ``resume``: only strategies whose spec
    ``continues`` on that model (ValueError otherwise)."""

    lm: Model
    prompt: str
    config: DecodingConfig
    chat: bool = False
    prompt_ids: Sequence[int] | None = None
    registry: Models | None = None
    control: RunControl | None = None
    compare_baseline: bool = False
    scheduler: Any = None
    prefix: Sequence[int] = ()
    force: int | None = None
    resume: Sequence[StageTrace] | None = None


def backend_of(lm: Model) -> str:
    """The backend a model runs on ("local", "llamacpp", "openai": ``Model.backend``)."""
    return lm.backend


def is_served(lm: Model) -> bool:
    """Whether ``lm`` runs behind a server's API (not ``capabilities.in_process``): its strategies
    are the specs' ``served`` streams."""
    return not lm.capabilities.in_process


def runs_on(lm: Model) -> list[str]:
    """The strategies ``lm`` runs, in registration order."""
    return [name for name, spec in STRATEGIES.items() if _stream_of(spec, lm) is not None]


def continues_on(lm: Model) -> list[str]:
    """The strategies that continue from a step on ``lm`` (branching, "continue from here")."""
    served = is_served(lm)
    return [name for name, spec in STRATEGIES.items()
            if _stream_of(spec, lm) is not None and (spec.served_continues if served else spec.continues)]


def _stream_of(spec: StrategySpec, lm: Model) -> Any:
    return spec.served if is_served(lm) else spec.stream


def stream(request: RunRequest) -> Iterator[Event]:
    """Run ``request.config.strategy`` on ``request.prompt`` and yield Events; the last one holds
    the Trace. The stream is its spec's (``stream`` on a model loaded here, ``served`` on a served
    one); a strategy the model's backend lacks is one ValueError naming both. Each event is
    computed with ``request.control`` active (``engine.control.under``): a served model's requests
    take their deadline from it, and its cancel closes them."""
    yield from under(request.control, _events(request))


def _events(r: RunRequest) -> Iterator[Event]:
    """``stream``'s events, once the control is active."""
    spec = STRATEGIES.get(r.config.strategy)
    fn = _stream_of(spec, r.lm) if spec is not None else None
    if fn is None:  # DecodingConfig validates the name, so this is a strategy without a stream on this backend
        raise ValueError(f"strategy: {r.config.strategy!r} does not run on the {backend_of(r.lm)} backend; "
                         f"it runs {', '.join(sorted(runs_on(r.lm)))}")
    prefix = tuple(r.prefix)
    _check_continuation(r.lm, r.config.strategy, prefix, r.force)
    ids = list(r.prompt_ids) if r.prompt_ids is not None else r.lm.encode(r.prompt, r.chat)
    yield from fn(RunContext(r.lm, r.prompt, ids, r.config, r.chat, r.registry or ModelRegistry(), r.control,
                             r.compare_baseline, r.scheduler, prefix, r.force,
                             tuple(r.resume) if r.resume is not None else None))


def _check_continuation(lm: Model, strategy: str, prefix: tuple[int, ...], force: int | None) -> None:
    """ValueError naming the argument when ``prefix`` / ``force`` are given to a strategy that
    cannot continue, or hold a token outside the vocabulary."""
    continuable = continues_on(lm)
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


def run(request: RunRequest) -> Trace:
    """The whole run: ``stream`` collected, returning its Trace."""
    return collect(stream(request))


def branch(lm: Model, parent: Trace, at_step: int, token_id: int | None, *, config: DecodingConfig | None = None,
           control: RunControl | None = None, scheduler: Any = None) -> Iterator[Event]:
    """Continue ``parent`` (a greedy or sampling trace) from step ``at_step``: with ``token_id``
    forced there (a branch), or with ``token_id`` None, drawn under ``config`` (default the parent's
    knobs: "continue from here with these knobs"). The first event replays the parent's steps
    before ``at_step`` unchanged; the new steps follow (``stream`` with ``prefix`` = the kept
    tokens, ``force`` = ``token_id``; under the parent's own knobs, ``resume`` = its records at
    ``at_step``, so stateful stages go on from the state it recorded, with no replay); the last
    event holds the new Trace (``branch_of`` = ``at_step``, its ``config`` the one it ran under)."""
    continuable = continues_on(lm)
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


def _branch_events(lm: Model, parent: Trace, at_step: int, token_id: int | None, config: DecodingConfig,
                   own_knobs: bool, control: RunControl | None, scheduler: Any) -> Iterator[Event]:
    """``branch``'s events once its arguments are checked (``branch`` raises at the call, not at
    the first event, so a caller can refuse before it draws anything)."""
    kept = list(parent.steps[:at_step])
    if kept:
        yield Event(steps=kept)
    for event in stream(RunRequest(lm, parent.prompt, config, chat=parent.chat, prompt_ids=parent.prompt_token_ids,
                                   control=control, scheduler=scheduler, prefix=parent.generated_token_ids[:at_step],
                                   force=token_id, resume=parent.steps[at_step].stages if own_knobs else None)):
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


def partial_trace(lm: Model, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig,
                  steps: list[StepTrace], chat: bool, branch_of: int | None = None) -> Trace:
    """A Trace of the steps streamed so far (what a view draws while the run goes on)."""
    return core.assemble(lm, prompt, prompt_ids, config, steps, chat, branch_of=branch_of)


class EngineRuns:
    """``engine.reports.runs.Runs`` filled by this module and ``engine.scheduler``: how the reports,
    which import no orchestrator, run strategies and open a private scheduler."""

    def run(self, lm: Model, prompt: str, config: DecodingConfig, *, chat: bool = False,
            prompt_ids: Sequence[int] | None = None, registry: Models | None = None,
            scheduler: Any = None) -> Trace:
        return run(RunRequest(lm, prompt, config, chat=chat, prompt_ids=prompt_ids, registry=registry,
                              scheduler=scheduler))

    def scheduler(self, lm: Model, *, max_batch: int | None = None, max_queue: int | None = None,
                  prefill_chunk: int | None = None, share_prefix: bool = True) -> Scheduler:
        return Scheduler(lm, max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                         share_prefix=share_prefix)


RUNS = EngineRuns()
