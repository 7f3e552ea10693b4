"""Greedy and sampling: prefill once, then one token per forward through the KV cache.

``stream`` yields one StepTrace per generated token (so the UI streams); ``run`` collects a whole
Trace. Branching continues a finished run from any step with another token: the cache is synced
(rewound to the shared prefix), never rebuilt, and the generator is advanced to where it was.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from engine.strategies import served_decode
from engine import explore, sampling
from engine.base.seam import Model
from engine.cache import KVCache
from engine.config import DecodingConfig
from engine.core import RunContext, RunState, assemble, checked, draw_at, pick, step_trace
from engine.sampling import NoTokensLeft
from engine.base.strategy_spec import StrategySpec, register
from engine.trace import Event, StageTrace, StepTrace, Trace


def stream(lm: Model, prompt_ids: Sequence[int], config: DecodingConfig, *,
           prefix: Sequence[int] = (), force: int | None = None, cache: KVCache | None = None,
           resume: Sequence[StageTrace] | None = None) -> Iterator[StepTrace]:
    """Yield a StepTrace per generated token until EOS, a stop string or max_new_tokens.

    ``prefix``: tokens already generated (a branch continues after them); ``force``: the token to
    take at the first new step instead of sampling. ``cache`` may be a cache left by an earlier run
    of the same prompt: it is rewound to the shared prefix, not rebuilt. ``resume``: the stage
    records the run made at the step after ``prefix`` (same knobs), so a stateful chain takes its
    state from them instead of replaying the prefix (``RunState``)."""
    state = RunState(lm, prompt_ids, config, prefix=prefix, force=force, resume=resume)
    cache = cache or KVCache(lm.model, config.kv_cache, config.kv_residual_length)
    logits = state.prefill(cache)  # one forward over what the cache lacks (a stateful branch: replayed)
    while True:
        step = state.advance(logits)
        yield step
        if step.finish_reason is not None:
            return
        logits = cache.step([step.chosen_token_id])


def run(lm: Model, prompt: str, config: DecodingConfig, *, chat: bool = False,
        cache: KVCache | None = None) -> Trace:
    """Greedy or sampling run to completion."""
    prompt_ids = lm.encode(prompt, chat)
    steps = list(stream(lm, prompt_ids, config, cache=cache))
    return assemble(lm, prompt, prompt_ids, config, steps, chat)


def branch(lm: Model, parent: Trace, at_step: int, token_id: int, *, cache: KVCache | None = None) -> Iterator[StepTrace]:
    """Continue ``parent`` from step ``at_step`` with ``token_id`` instead of what it chose.
    Yields the parent's steps before ``at_step`` unchanged, then the new ones."""
    if not 0 <= at_step < len(parent.steps):
        raise ValueError(f"at_step: {at_step} is out of range; the run has {len(parent.steps)} steps")
    if not 0 <= token_id < lm.vocab_size:
        raise ValueError(f"token_id: {token_id} is out of range; vocabulary has {lm.vocab_size} tokens")
    config = DecodingConfig.from_dict(parent.config)
    yield from parent.steps[:at_step]
    prefix = parent.generated_token_ids[:at_step]
    yield from stream(lm, parent.prompt_token_ids, config, prefix=prefix, force=token_id, cache=cache)


@torch.inference_mode()
def whatif_step(lm: Model, trace: Trace, step: int, knobs: dict | None, logits: torch.Tensor) -> StepTrace:
    """Step ``step`` of ``trace`` re-processed under ``knobs`` (over the trace's config) from the
    step's raw ``logits`` [1, V]: the new chain's stages, and the token the new knobs would pick
    there with the run's own randomness. Greedy knobs: the argmax. Sampling knobs: where the run's
    draw u lands in the new distribution (inverse CDF). A step without a draw (a greedy or forced
    pick) has no randomness to replay: it keeps the run's token, at its new probability.
    ValueError when the knobs leave no token to pick."""
    config = explore.explore_config(trace, knobs)
    ids = torch.tensor([explore.step_context(trace, step)], dtype=torch.long, device=lm.device)  # [1, S]
    chain = explore.step_chain(lm, trace, step, config)  # stateful stages as the run had them at this step
    traced = chain.traced(ids, logits.float(), config.top_n, lm.token_text)
    run = trace.steps[step]
    if not sampling.has_tokens(traced.logits):
        raise ValueError("what if: these knobs leave no token to pick")
    if config.is_greedy:
        chosen = pick(traced, None)  # the argmax, as the run's own pick
    elif run.draw is not None:
        chosen = draw_at(traced.final_probs, run.draw)
    else:
        chosen = sampling.Pick(run.chosen_token_id, float(traced.final_probs[run.chosen_token_id]))
    return step_trace(lm, traced, chosen, run.index, run.elapsed_ms, forced=run.forced and chosen.draw is None
                      and not config.is_greedy)


# --- the strategies ------------------------------------------------------------------------------------
def batched(config: DecodingConfig, scheduler: Any) -> Any:
    """The scheduler a greedy/sampling run may join, or None: its batch rows are plain
    full-precision caches, so a run with another KV cache kind decodes on its own."""
    return scheduler if scheduler is not None and config.kv_cache == "dynamic" else None


def stepwise(ctx: RunContext) -> Iterator[Event]:
    """Greedy and sampling on a model loaded here: its own forwards (``stream``) or rows of the
    batched scheduler, an Event per token, then the Trace."""
    scheduler = batched(ctx.config, ctx.scheduler)
    source = (scheduler.stream(ctx.ids, ctx.config, prefix=ctx.prefix, force=ctx.force, control=ctx.control,
                               resume=ctx.resume)
              if scheduler is not None
              else stream(ctx.lm, ctx.ids, ctx.config, prefix=ctx.prefix, force=ctx.force, resume=ctx.resume))
    steps, ended = [], False
    try:
        for step in checked(source, ctx.control):
            steps.append(step)
            yield Event(steps=[step])
    except NoTokensLeft:  # a step with nothing left to pick ends the run, saying why
        ended = True
    trace = assemble(ctx.lm, ctx.prompt, ctx.ids, ctx.config, steps, ctx.chat)
    if ended:
        trace.end_with_no_tokens_left()
    yield Event(trace=trace)


for _name, _doc in (("greedy", "The most probable token at every step."),
                    ("sample", "A seeded draw from the final distribution at every step.")):
    register(StrategySpec(_name, stepwise, continues=True, doc=_doc, served=served_decode.stepwise, served_continues=True))
