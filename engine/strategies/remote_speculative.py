"""Speculative decoding on a remote target (issue #29): engine.strategies.speculative's own rounds (the same
drafters, acceptance tests, residual draws and records), with the target's cache its own
(``RemoteModel.cache()``, an ``engine.backends.served.RemoteCache``): feeding K + 1 tokens returns the
target's top-N at each of those positions from the server instead of a forward.

- Scoring: vLLM scores the K drafts in ONE request (``prompt_logprobs``: each drafted token's
  log-probability is exact, in or out of the top-N); llama-server's endpoints have no prompt
  log-probabilities, so each position is one request (its prefix cache re-reads one token).
- Drafters: ``ngram`` (prompt lookup, no model), or ``model:<remote spec>``: a draft endpoint the
  operator lists (``DP_REMOTE_MODELS``), drafting in step mode with the target's chain over its top-N.
  ``self-*`` drafters need the target's weights: refused in one line.
- Exact: greedy verification (the top-1), p(x) of each drafted token on vLLM. Approximate (labelled
  in ``extra["remote"]``): p and q are over the top-N (renormalised, as step mode), so the residual
  normalise(max(0, p - q)) only holds tokens of the top-N lists.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from engine.strategies import speculative
from engine.config import DecodingConfig
from engine.control import RunControl
from engine.backends.registry import ModelRegistry
from engine.backends.local import ModelSpec
from engine.backends.served import RemoteLabel, RemoteModel, RemoteSpec, allowed_remote_models
from engine.strategies.served_decode import stream_step
from engine.sampling import NoTokensLeft
from engine.core import checked
from engine.base.strategy_spec import serve
from engine.trace import Event

APPROXIMATIONS = [
    "the target's p and the draft's q are over the server's top-N, renormalised (as step mode): the residual "
    "normalise(max(0, p - q)) and the bonus token come from the top-N only",
]


def drafter(target: RemoteModel, config: DecodingConfig, registry: ModelRegistry, environ: Any = None
            ) -> speculative.Drafter:
    """The drafter ``config.drafter`` names for a remote target (see the module doc); a listed
    server is connected to through ``registry`` (the app's keeps the connection across runs)."""
    if config.drafter == "ngram":
        return speculative.NgramDrafter(config.ngram_size)
    allowed = allowed_remote_models(environ)
    name = config.drafter.removeprefix("model:")
    try:
        spec = RemoteSpec.parse(name, "drafter")
    except ValueError:
        spec = None
    if spec is None or str(spec) not in {str(a) for a in allowed}:
        raise ValueError(f"drafter: {config.drafter!r} does not run with a remote target; use ngram or "
                         "model:<a remote model the operator lists in DP_REMOTE_MODELS>")
    draft = registry.get(ModelSpec(str(spec), "none"), key="drafter").with_mode("step", target.top_n)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"drafter: {name} has {draft.vocab_size} tokens, the target {target.vocab_size}")
    return speculative.ModelDrafter(draft, str(spec), draft.cache())


def stream(target: RemoteModel, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, *,
           chat: bool = False, registry: ModelRegistry | None = None, control: RunControl | None = None,
           compare_baseline: bool = False) -> Iterator[Event]:
    """One Event per round (steps: its tokens; record: its SpecRound), then one holding the Trace
    (``speculative.assemble``, labelled ``extra["remote"]``). ``compare_baseline``: also time the
    target alone in step mode, one request per token (summary ``baseline_ms``, ``speedup``),
    checking ``control`` per token."""
    draft = drafter(target, config, registry or ModelRegistry())
    cache = target.cache()
    collected, ended = [], False
    try:
        for spec_round in speculative.rounds(target, prompt_ids, config, draft, cache=cache):
            collected.append(spec_round)
            yield Event(steps=list(spec_round.steps), record=spec_round)
    except NoTokensLeft:
        ended = True
    trace = speculative.assemble(target, prompt, prompt_ids, config, collected, draft, chat)
    if ended:
        trace.end_with_no_tokens_left()
    scoring = "prompt_logprobs (one request per round)" if target.capabilities.prompt_logprobs \
        else "one request per position"
    trace.extra["remote"] = RemoteLabel(target.backend, target.url, "step", target.top_n,
                                        APPROXIMATIONS + [f"the target scores the drafts by {scoring}"],
                                        scoring_calls=cache.forwards).to_json()
    if compare_baseline:
        stepper = target.with_mode("step")
        trace.summary |= speculative.compare_with_baseline(
            target, prompt, config, trace, chat, control,
            steps=lambda ids, base: stream_step(stepper, ids, base, top_n=stepper.top_n))
    yield Event(trace=trace)


def run(ctx: Any) -> Iterator[Event]:
    """Speculative decoding with a served target (``engine.runner.stream``)."""
    yield from checked(stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat, registry=ctx.registry,
                              control=ctx.control, compare_baseline=ctx.compare_baseline), ctx.control)


serve("speculative", run)
