"""What if: re-process one generated step under other knobs, without generating again.

A step's *raw* logits depend only on the tokens before it, never on the knobs, so moving a knob
for step k needs no new generation: take step k's raw logits (kept by the caller, or recomputed
with one forward over the prompt and the k tokens before it) and run the stage chain of the new
config over them. With the trace's own knobs this reproduces the trace's own stages for that step.

Stateful stages (mirostat's μ, XTC's draw) are not replayed: each step's stage records carry the
state the stage used (StageTrace.state), loaded into the new chain's stage of the same name. A
stage the run did not have starts fresh (mirostat at μ = 2τ); an XTC the run did not have draws
its coin from a generator seeded by the run's seed and the step, so a what-if is repeatable.

On a served model (engine.backends) the raw logits are the server's top-N at the step (one request),
as step mode read them: a what-if there is exact up to the same truncation as the run.

Shapes: logits [1, V] float32; ids [1, S].
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engine.backends.served import STEP_TOP_N, RemoteLabel
from engine.base.seam import Cache, Model
from engine.config import ConfigError, DecodingConfig
from engine.chain import Chain
from engine.trace import StageTrace, Trace


def step_context(trace: Trace, step: int) -> list[int]:
    """The token ids the model saw before step ``step``: the prompt and the first ``step`` tokens."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < len(trace.steps):
        raise ConfigError("step", f"{step!r} is out of range; the run has {len(trace.steps)} steps")
    return list(trace.prompt_token_ids) + list(trace.generated_token_ids[:step])


def raw_logits(lm: Model, trace: Trace, step: int, cache: Cache | None = None) -> torch.Tensor:
    """Step ``step``'s raw next-token logits [1, V] (``Model.next_logits``): on a model loaded here one
    forward over what ``cache`` lacks of the step's context (a fresh cache costs one prefill of it); on
    a served model the server's top-N there, one request, as step mode reads it (log p inside the
    top-N, -inf outside; N: the run's own in step mode, so its own knobs give its own stages back)."""
    label = RemoteLabel.of(trace)
    top_n = int(label.top_n) if label is not None and label.mode == "step" else STEP_TOP_N
    return lm.next_logits(step_context(trace, step), top_n=top_n, cache=cache)


def explore_config(trace: Trace, knobs: Any) -> DecodingConfig:
    """The trace's config with ``knobs`` (a dict of knob values) applied on top, validated."""
    if knobs is None:
        knobs = {}
    if not isinstance(knobs, dict):
        raise ConfigError("knobs", f"expected a JSON object of knob values, got {type(knobs).__name__}")
    return DecodingConfig.from_dict(dict(trace.config) | knobs)


def explore_step(lm: Model, trace: Trace, step: int, knobs: Any = None, *,
                 logits: torch.Tensor | None = None, cache: Cache | None = None) -> list[StageTrace]:
    """Step ``step`` of ``trace`` re-processed under ``knobs``: its stage records (raw, each active
    stage in the new order, final), in the trace JSON's ``stages`` format.

    ``logits``: the step's raw logits if the caller kept them, else they are recomputed through
    ``cache`` (see ``raw_logits``)."""
    config = explore_config(trace, knobs)
    context = step_context(trace, step)
    if logits is None:
        logits = raw_logits(lm, trace, step, cache)
    ids = torch.tensor([context], dtype=torch.long, device=lm.device)
    chain = step_chain(lm, trace, step, config)
    return chain.traced(ids, logits.float(), config.top_n, lm.token_text).stages


def step_chain(lm: Model, trace: Trace, step: int, config: DecodingConfig) -> Chain:
    """``config``'s stage chain as it stood at step ``step`` of ``trace``: the stateful stages hold
    the state the run recorded there (mirostat's μ, XTC's draw), so the run's own knobs reproduce
    the step exactly; a stage the run lacked draws from ``whatif_generator``."""
    chain = Chain.from_config(config, len(trace.prompt_token_ids), lm.tokenizer, lm.eos_token_ids,
                              generator=whatif_generator(config, step, lm.device))
    chain.load_states(trace.steps[step].stages)
    return chain


def whatif_generator(config: DecodingConfig, step: int, device: Any = "cpu") -> torch.Generator:
    """The draws of a stage the run did not record (an XTC added by the what-if): seeded by the
    run's seed and the step, so the same what-if gives the same answer."""
    return torch.Generator(device=device).manual_seed(config.seed * 1_000_003 + step)


def stages_match(a: Sequence[StageTrace], b: Sequence[StageTrace], tol: float = 1e-4) -> bool:
    """Same stage names, kept counts and top tokens, probabilities within ``tol``."""
    if [s.name for s in a] != [s.name for s in b]:
        return False
    for x, y in zip(a, b):
        if x.kept != y.kept or [t.token_id for t in x.top] != [t.token_id for t in y.top]:
            return False
        if any(abs(p.prob - q.prob) > tol for p, q in zip(x.top, y.top)):
            return False
    return True
