"""Beam search over one-token requests to a remote model (issue #29), vLLM's own method
(``LLM.beam_search`` / ``EngineClient.beam_search``), recorded as the local beam search's records
(``engine.strategies.beam``: BeamStep, BeamCandidate, BeamHypothesis, BeamTrace) so the Beam view draws its tree.

Per step, each running beam asks the server for one token's top ``2 x num_beams`` log-probabilities
(one request per beam; the server's prefix cache re-reads only the new token). Each of those tokens
extends the beam (cumulative log-probability += its log-probability): an EOS token completes it,
the others compete, and the ``num_beams`` best by score run on. After ``max_new_tokens`` steps the
running beams complete too, and all completed ones are ranked by score. vLLM's score is
``cumulative log-probability / sequence_length ** length_penalty`` with the sequence length the
prompt's plus the generated tokens' (an EOS not counted). There is no early stopping: every step runs.
The log-probabilities are the server's raw ones; our stages are not applied (as in vLLM).

Records differ from the local search's in what vLLM does differently: ``candidates_per_step`` is
the top-N per beam (2 x num_beams), a hypothesis' ``length`` is the length its score divides by
(prompt included), ``normalized_score`` is that score, and no candidate is ``dropped``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from engine.strategies import beam as local_beam
from engine.strategies.beam import BeamCandidate, BeamHypothesis, BeamStep, BeamTrace
from engine.config import DecodingConfig
from engine.core import check_prompt, checked
from engine.backends.served import RemoteLabel, RemoteModel
from engine.base.strategy_spec import serve
from engine.trace import Event

APPROXIMATIONS = [
    "vLLM's beam search: each beam extends with its top 2 x num_beams tokens only, one request per beam and step",
    "scores are raw log-probabilities (our stages are not applied) over the sequence length with the prompt, "
    "as vLLM normalises; no early stopping: every step runs",
    "row entropies are over the top-N only",
    "that score divides by the prompt's length too and leaves a final EOS out, so a beam that ends at once "
    "(a lone EOS) can win where a local beam search would not; vLLM ranks the same way",
]


@dataclass
class _Beam:
    """A running or completed beam: its generated tokens, the candidate index chosen at each step,
    its cumulative log-probability."""

    tokens: list[int]
    path: list[int]
    cum_logprob: float
    finish_reason: str | None = None


def sequence_length(prompt_length: int, tokens: Sequence[int], eos: Sequence[int]) -> int:
    """The length vLLM's score divides by: the prompt's and the generated tokens, an EOS last not
    counted (a hypothesis' ``length``; the tokens it generated are ``len(token_ids)``)."""
    return prompt_length + len(tokens) - (1 if tokens and tokens[-1] in eos else 0)


def score(cum_logprob: float, prompt_length: int, tokens: Sequence[int], eos: Sequence[int],
          length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: the cumulative log-probability over the whole sequence's
    length (``sequence_length``) to the power ``length_penalty``."""
    return cum_logprob / (max(sequence_length(prompt_length, tokens, eos), 1) ** length_penalty)


def check(config: DecodingConfig) -> None:
    """ValueError naming the knob a remote beam search cannot run."""
    if config.num_beam_groups != 1:
        raise ValueError(f"num_beam_groups: {config.num_beam_groups} groups (diverse beam search) do not run on a "
                         "remote model; use 1")


def stream(model: RemoteModel, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, *,
           chat: bool = False) -> Iterator[Event]:
    """An Event per search step (record: its BeamStep), then one holding the Trace (``beam``: the
    BeamTrace; ``extra["remote"]``: the label)."""
    check_prompt(prompt_ids)
    check(config)
    start, width, eos = time.perf_counter(), config.num_beams, model.eos_token_ids
    top_n = 2 * width
    trace = BeamTrace(width, 1, config.length_penalty, config.early_stopping, top_n)
    running, completed = [_Beam([], [], 0.0)], []
    for index in range(config.max_new_tokens):
        last = index == config.max_new_tokens - 1
        record, running, done = _step(model, list(prompt_ids), running, index, top_n, width, config, last)
        completed += done
        record.elapsed_ms = (time.perf_counter() - start) * 1000
        trace.steps.append(record)
        yield Event(record=record)
        if not running:
            break
    _finish(model, trace, completed, len(prompt_ids), config)
    out = local_beam.assemble(model, prompt, prompt_ids, config, trace, chat)
    out.extra["remote"] = RemoteLabel(model.backend, model.url, "step", top_n, APPROXIMATIONS,
                                      requests=sum(len({c.parent for c in s.candidates}) for s in trace.steps)).to_json()
    yield Event(trace=out)


def _step(model: RemoteModel, prompt_ids: list[int], running: list[_Beam], index: int, top_n: int, width: int,
          config: DecodingConfig, last: bool) -> tuple[BeamStep, list[_Beam], list[_Beam]]:
    """One step: every running beam (slot b) extends with its top-N; returns the record, the next
    running beams (slot order = the record's ``beam``) and the beams completed at this step."""
    eos, prompt_length = model.eos_token_ids, len(prompt_ids)
    candidates: list[BeamCandidate] = []
    extended: list[_Beam] = []
    entropies: list[float] = []
    for slot, beam in enumerate(running):
        top = model.api.next_top(prompt_ids + beam.tokens, top_n)
        model.learn_pieces(top)
        entropies.append(-sum(math.exp(lp) * lp for _, lp, _ in top if math.isfinite(lp)))
        for token, logprob, _ in top:
            tokens = beam.tokens + [token]
            cum = beam.cum_logprob + logprob
            normalized = score(cum, prompt_length, tokens, eos, config.length_penalty)
            extended.append(_Beam(tokens, beam.path + [len(candidates)], cum))
            candidates.append(BeamCandidate(slot, token, model.token_text(token), logprob, logprob, cum, normalized,
                                            "pruned"))
    going = [i for i, c in enumerate(candidates) if c.token_id not in eos]
    going.sort(key=lambda i: -candidates[i].normalized_score)  # stable: ties keep the request order
    kept = going[:width]
    done = []
    for i, c in enumerate(candidates):
        if c.token_id in eos:
            c.status, c.finish_reason, extended[i].finish_reason = "finished", "eos", "eos"
            done.append(extended[i])
    for slot, i in enumerate(kept):
        c = candidates[i]
        if last:  # the budget is spent: a beam that would run on completes here
            c.status, c.finish_reason, extended[i].finish_reason = "finished", "max_new_tokens", "max_new_tokens"
            done.append(extended[i])
        else:
            c.status, c.beam = "kept", slot
    running = [] if last else [extended[i] for i in kept]
    return BeamStep(index, candidates, entropies), running, done


def _finish(model: RemoteModel, trace: BeamTrace, completed: list[_Beam], prompt_length: int,
            config: DecodingConfig) -> None:
    """Every completed beam as a hypothesis, best score first (vLLM returns the first num_beams)."""
    scored = sorted(((score(b.cum_logprob, prompt_length, b.tokens, model.eos_token_ids, config.length_penalty), b)
                     for b in completed), key=lambda x: -x[0])
    trace.hypotheses = [
        BeamHypothesis(token_ids=b.tokens, text=model.decode(b.tokens), sum_logprobs=b.cum_logprob,
                       length=sequence_length(prompt_length, b.tokens, model.eos_token_ids), score=s,
                       finish_reason=b.finish_reason or "max_new_tokens", path=b.path,
                       returned=rank < config.num_return_sequences)
        for rank, (s, b) in enumerate(scored)]
    trace.winner = 0 if trace.hypotheses else None
    trace.ended_by = "no_continuation"


def run(ctx: Any) -> Iterator[Event]:
    """Beam search on a served model (``engine.runner.stream``)."""
    yield from checked(stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat), ctx.control)


serve("beam", run)
