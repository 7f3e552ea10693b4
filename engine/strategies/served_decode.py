"""Greedy and sampling on a served model (issue #29): the streams ``runner.stream`` runs when the model
is served (llama.cpp's ``llama-server`` or an OpenAI-compatible server: engine/backends/remote.py
connects them and answers the requests; the strategies are here, beside the local ones).

One implementation of the modes, two small API classes for the requests (``LlamaCppApi``,
``OpenAIApi``: tokenize, detokenize, chat ids, ``next_top`` = the raw top-N after some ids,
``generate`` = fast mode's streamed answer). Both modes end in an ordinary engine ``Trace``, run
through ``engine.runner.stream`` (the registry is keyed by ``RemoteModel.backend``;
``RemoteModel.mode`` picks the mode):

- **step mode** (``stream_step``, the default): one request per token (one token generated, top-N
  log-probabilities; the server's prefix cache re-reads only the new token). The raw top-N become
  logits (log p inside the top-N, -inf outside); our own stage chain and our own seeded draw
  (``engine.core.RunState``, the local engine's loop body) pick the token, the records and the draw
  made on the N ids (``entries_row``: what lies outside adds nothing; the same numbers to the order of
  a sum, at a fraction of the CPU of the whole vocabulary). Exact up to the
  truncation to the top-N, which the trace labels (the tail mass per step). By default
  (``DP_STEP_VERIFY_TOKENS``, issue #38) a request asks the server's greedy continuation, several
  tokens each with the raw top-N at its position, and our chain verifies it position by position
  (``stream_verified``): the same tokens, draws and records as one request per token, in fewer
  requests; the trace's ``extra["remote"]["verified"]`` says how many of its tokens were the server's.
  A vLLM listed with ``draws=1`` (our logits processor, deploy/vllm_plugin/dp_draws.py) drafts a sampled
  run with our chain and our generator instead of its argmax (``server_draws``): nearly every position
  is then the server's, and still verified here.
- **fast mode**: one streamed request for the whole text (Server-Sent Events: a step is shown as
  its token arrives); the server's sampler picks (its own random generator: the same seed gives a
  different text than ours). Each step shows the server's top-N (llama.cpp: final and, from a
  second request with the same seed after the stream, raw; OpenAI: its ``logprobs``).

``RemoteModel`` quacks like ``engine.backends.local.LoadedModel`` where the decoding loop needs it
(tokenizer, EOS ids, vocabulary size, token text, decode). A server's answer is untrusted input
(issue #34): every request has one deadline (its own, cut to the run's time limit) and is closed
by the run's cancel (``engine.backends.client``); every answer is bounded in size and checked field
by field (``engine.backends.schema``); a server that is down, slow, redirects or answers something
out of range raises ``RemoteError`` with one line naming the URL (and the field). Fast mode reads
at most ``max_new_tokens`` tokens, whatever the server streams.

Which of our knobs a server's sampler cannot express is listed per fast-mode run (``unmapped``),
with the knobs that map with a difference (``caveats``); llama.cpp's ``samplers`` list follows our
stage order.
"""

from __future__ import annotations

import base64
import json
import math
import time
from contextlib import closing
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import torch

from engine.backends.client import RemoteError
from engine.backends.remote import top_logits
from engine.backends.served import STEP_TOP_N, Entry, FastAnswer, FastToken, RemoteLabel, RemoteModel, entries_row
from engine.config import DecodingConfig
from engine.core import RunState, assemble, checked
from engine.sampling import NoTokensLeft
from engine.settings import SettingsError, env_int
from engine.stages import STAGES
from engine.trace import Event, StageTrace, StepTrace, TokenProb, Trace

STRATEGIES = ("greedy", "sample")  # what a remote model runs so far


def check_strategy(config: DecodingConfig) -> None:
    if config.strategy not in STRATEGIES:
        raise ValueError(f"strategy: {config.strategy!r} does not run on a remote model yet; "
                         f"use {' or '.join(STRATEGIES)}")


def stream_step(model: RemoteModel, prompt_ids: Sequence[int], config: DecodingConfig, *,
                top_n: int = STEP_TOP_N, tails: list[float] | None = None, prefix: Sequence[int] = (),
                force: int | None = None) -> Iterator[StepTrace]:
    """Step mode: a StepTrace per token, each from one request (``tails`` collects each step's
    tail mass). ``prefix`` / ``force`` continue a run as ``decode.stream`` does: the kept tokens
    are just a longer prompt to the server (a stateful chain first replays their positions, one
    request each)."""
    check_strategy(config)
    state = RunState(model, prompt_ids, config, prefix=prefix, force=force)
    if state.needs_replay:
        start = len(prompt_ids)
        state.replay(torch.cat([top_logits(model, state.sequence[:start + i], top_n)[0] for i in range(len(prefix))]))
    while True:
        values, ids, tail = entries_row(model, model.api.next_top(state.ids[0].tolist(), top_n))
        if tails is not None:
            tails.append(tail)
        step = state.advance(values, ids)
        yield step
        if step.finish_reason is not None:
            return


# --- step mode, verifying the server's continuation (issue #38) -----------------------------------
# DP_STEP_VERIFY_TOKENS' default: a greedy run with no stage asks this many at once (the server's greedy
# continuation is then our pick at every position), any other run 4 first, then twice as many, at most 8
# (bench/step_verify.py --verify K, bench/room.py --strategy greedy measure them; docs/performance.md)
VERIFY_TOKENS = 32


# a run whose picks may part from the server's greedy token (a draw, a stage): its first request's count,
# and its most per request (a disagreement closes the stream: what the server made past it in the meantime
# was made for nothing)
FIRST_ASK, PARTING_MOST = 4, 8


MAX_VERIFY_TOKENS = 64  # a continuation's most tokens (llamacpp.MAX_CHUNK_TOKENS: the schema's bound)


def verify_tokens(model: RemoteModel) -> int:
    """Tokens of the server's continuation one step-mode request asks (0: one request per token):
    the model's own ``verify`` if set, else ``DP_STEP_VERIFY_TOKENS`` (default VERIFY_TOKENS)."""
    if model.verify is not None:
        return model.verify
    value = env_int("DP_STEP_VERIFY_TOKENS", VERIFY_TOKENS)
    if value > MAX_VERIFY_TOKENS:
        raise SettingsError(f"DP_STEP_VERIFY_TOKENS: expected an integer from 0 to {MAX_VERIFY_TOKENS}, got {value}")
    return value


# the stages deploy/vllm_plugin/dp_draws.py runs (transformers' warpers, as engine.stages builds them)
SERVER_DRAW_STAGES = ("temperature", "top_k", "top_p", "min_p", "typical_p")


OUR_DRAWS = "our draws"  # Verified.drafts when the server drafts with our chain and generator


@dataclass
class Verified:
    """What verifying a run's continuations did: ``tokens`` asked per request, the ``requests``
    made, the tokens of their streams read (``drafted``: a stream closed at a disagreement is read
    no further), and per step whether our pick was the server's own token (``server``: accepted) or
    ours (the first disagreement of its request)."""

    tokens: int
    first: int = FIRST_ASK  # the first request's count (at most ``tokens``)
    drafts: str = "greedy"  # the server's argmax, or OUR_DRAWS: its drafts of our chain's draws (server_draws)
    requests: int = 0
    drafted: int = 0
    server: list[bool] = field(default_factory=list)
    asked: list[int] = field(default_factory=list)  # each request's count (``next_count``)
    gave: list[int] = field(default_factory=list)  # the steps each request gave

    def next_count(self) -> int:
        """The next request's count, at most ``tokens``: the first asks ``first``; after a
        continuation kept whole, twice as many; after a disagreement, twice the steps that request
        gave. A chain that often disagrees (sampling at a high temperature) asks few and wastes few
        server forwards; a greedy-ish one soon asks ``tokens``. The count shapes the requests only,
        never the steps (``stream_verified``)."""
        if not self.asked:
            return max(1, min(self.tokens, self.first))
        last, gave = self.asked[-1], self.gave[-1]
        return max(1, min(self.tokens, 2 * (last if gave >= last else gave)))

    def label(self) -> dict[str, Any]:
        """``extra["remote"]["verified"]`` (strict JSON: no acceptance without a step)."""
        accepted = sum(self.server)
        return {"tokens": self.tokens, "first": self.first, "drafts": self.drafts, "requests": self.requests,
                "asked": list(self.asked),
                "drafted": self.drafted, "steps": len(self.server), "accepted": accepted,
                "acceptance": accepted / len(self.server) if self.server else None,
                "server_token": list(self.server)}


def verify_plan(config: DecodingConfig, tokens: int, drafted: bool = False) -> Verified:
    """A verified run's record, its counts set: greedy with no stage picks the raw argmax, which is the
    server's greedy token (up to a tie within the top-N's rounding), and a run whose drafts the server
    makes with our chain and draws (``drafted``: ``server_draws``) is our pick at nearly every position,
    so each asks ``tokens`` (the setting) at once; any other run asks FIRST_ASK first and at most
    PARTING_MOST per request, doubling while kept (``Verified.next_count``)."""
    if drafted:
        return Verified(tokens, tokens, OUR_DRAWS)
    if config.strategy == "greedy" and not config.active_stages():
        return Verified(tokens, tokens)
    most = min(tokens, PARTING_MOST)
    return Verified(most, min(most, FIRST_ASK))


def ours_to_draw(model: RemoteModel, config: DecodingConfig, force: int | None) -> bool:
    """True when the server drafts this run with our chain and draws (``server_draws``): it has our logits
    processor (``RemoteSpec.draws``), the run samples, starts with a draw (no forced token) and every
    stage is one the processor runs (SERVER_DRAW_STAGES)."""
    return model.capabilities.our_draws and not config.is_greedy and force is None \
        and set(config.active_stages()) <= set(SERVER_DRAW_STAGES)


def server_draws(model: RemoteModel, state: RunState, top_n: int) -> dict[str, Any] | None:
    """The ``vllm_xargs`` that make a server with our logits processor draft this run's next positions
    with our chain and our generator from where it stands (its state now), or None where
    ``ours_to_draw`` says no (a greedy run: the server's argmax is our pick already). Only the drafts
    change: every position is still verified here."""
    config = state.config
    if state.generator is None or not ours_to_draw(model, config, state.force):
        return None
    chain = [[name, getattr(config, name)] for name in config.active_stages()]
    return {"dp_state": base64.b64encode(state.generator.get_state().numpy().tobytes()).decode("ascii"),
            "dp_chain": json.dumps(chain), "dp_top": top_n}


def stream_verified(model: RemoteModel, prompt_ids: Sequence[int], config: DecodingConfig, verified: Verified, *,
                    top_n: int = STEP_TOP_N, tails: list[float] | None = None, prefix: Sequence[int] = (),
                    force: int | None = None) -> Iterator[StepTrace]:
    """Step mode at fewer requests: each request asks the server's greedy continuation (at most
    ``verified.tokens`` tokens, the raw top-N at each position, ``api.continuation``; its drafts of our
    draws where ``verified.drafts`` is OUR_DRAWS), streamed; our
    chain and draw run on each position as it arrives, exactly as ``stream_step`` would run them (the
    same RunState), and the continuation is kept while our pick is the server's token, so the first
    token is shown as soon as the server made it. At the first position where it is not, ours is
    taken, the stream is closed (the server stops) and the next request continues from our token:
    the positions after it were conditioned on a token we did not pick, so they are never read (no
    chain, no draw). The tokens, draws and stage records are one-request-per-token step mode's."""
    check_strategy(config)
    state = RunState(model, prompt_ids, config, prefix=prefix, force=force)
    if state.needs_replay:  # a stateful branch: its prefix positions, one request each (as stream_step)
        start = len(prompt_ids)
        state.replay(torch.cat([top_logits(model, state.sequence[:start + i], top_n)[0] for i in range(len(prefix))]))
    while True:
        ids = state.ids[0].tolist()
        count = max(1, min(verified.next_count(), config.max_new_tokens - len(state.generated),
                           model.context - len(ids)))
        verified.requests += 1
        verified.asked.append(count)
        verified.gave.append(0)
        draws = server_draws(model, state, top_n) if verified.drafts == OUR_DRAWS else None
        with closing(model.api.continuation(ids, count, top_n, **({"draws": draws} if draws else {}))) as drafted:
            for token, top in drafted:
                verified.drafted += 1
                values, support, tail = entries_row(model, top)
                if tails is not None:
                    tails.append(tail)
                step = state.advance(values, support)
                verified.server.append(step.chosen_token_id == token)
                verified.gave[-1] += 1
                yield step
                if step.finish_reason is not None:
                    return
                if step.chosen_token_id != token:
                    break
        if not verified.gave[-1]:
            raise RemoteError(f"{model.client.server} {model.url}: a continuation of {count} tokens was asked "
                              "and the answer held none")


def step_approximations(config: DecodingConfig, top_n: int) -> list[str]:
    """What step mode cannot do exactly for ``config``, in words (the trace carries them)."""
    caveats = dict.fromkeys(text for name in config.active_stages() for text in STAGES[name].served.step_caveats)
    return [f"the raw distribution is the server's top {top_n}, renormalised; the tail mass (1 - their sum) is "
            "recorded per step and no token outside them can be picked", *caveats]


def stream(model: RemoteModel, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, *,
           chat: bool = False, prefix: Sequence[int] = (), force: int | None = None) -> Iterator[Event]:
    """What ``engine.runner.stream`` runs for a remote model: an Event per token, then one holding
    the Trace (labelled: ``extra["remote"]``), in the model's ``mode``. Fast mode cannot continue
    from a step (the server samples the whole text): ``prefix`` / ``force`` raise ValueError."""
    if not model.capabilities.our_chain:  # fast mode: the server's sampler picks
        if prefix or force is not None:
            raise ValueError(f"{'prefix' if prefix else 'force'}: a fast-mode run of {model.url} cannot continue "
                             "from a step (the server samples); use step mode")
        yield from _stream_fast(model, prompt, prompt_ids, config, chat)
        return
    tails: list[float] = []
    steps: list[StepTrace] = []
    ended: NoTokensLeft | None = None
    k = verify_tokens(model)
    verified = verify_plan(config, k, ours_to_draw(model, config, force)) if k > 0 else None
    stepped = stream_verified(model, prompt_ids, config, verified, top_n=model.top_n, tails=tails, prefix=prefix,
                              force=force) if verified is not None \
        else stream_step(model, prompt_ids, config, top_n=model.top_n, tails=tails, prefix=prefix, force=force)
    try:
        for step in stepped:
            steps.append(step)
            yield Event(steps=[step])
    except NoTokensLeft as exc:  # a step with nothing left to pick ends the run, saying why
        ended = exc
    trace = assemble(model, prompt, prompt_ids, config, steps, chat)
    approximations = step_approximations(config, model.top_n)
    if ended is not None:
        trace.end_with_no_tokens_left()
        if type(ended) is not NoTokensLeft:  # a stage said why (the grammar: none of the top-N allowed)
            approximations.append(str(ended))
    label = _label(model, "step", model.top_n, approximations)
    label.tail_mass = tails
    label.verified = verified.label() if verified is not None else None
    trace.extra["remote"] = label.to_json()
    yield Event(trace=trace)


def _collect(events: Iterator[Event]) -> Trace:
    return next(e.trace for e in events if e.trace is not None)


def run_step(model: RemoteModel, prompt: str, config: DecodingConfig, *, chat: bool = False,
             top_n: int = STEP_TOP_N) -> Trace:
    """A whole step-mode run as a Trace, labelled (``extra["remote"]``)."""
    stepper = model.with_mode("step", top_n)
    return _collect(stream(stepper, prompt, stepper.encode(prompt, chat), config, chat=chat))


def _label(model: RemoteModel, mode: str, top_n: int, approximations: list[str],
           notes: dict[str, list[dict[str, str]]] | None = None) -> RemoteLabel:
    """``extra["remote"]``'s record; ``notes``: in fast mode, the knobs the server's sampler did not run
    as ours (step mode runs our own chain: nothing unmapped)."""
    notes = notes or {}
    return RemoteLabel(model.backend, model.url, mode, top_n, approximations, list(notes.get("unmapped", [])),
                       list(notes.get("caveats", [])))


# --- fast mode -------------------------------------------------------------------------------------
def _stage(name: str, entries: list[Entry], text: Callable[[int], str]) -> StageTrace:
    """A stage record from the server's top-N, each token's text as sent, else ``text(id)`` (vLLM
    sends ids only); entropy over the top-N only. ``kept``: the non-zero
    tokens of that top-N, what is known (the raw model's count over the whole vocabulary is not
    what a fast-mode chart may claim: only N are known; after the sampler, fewer than N is exact)."""
    probs = [math.exp(lp) if math.isfinite(lp) else 0.0 for _, lp, _ in entries]
    # an empty piece is a special token's (llama-server's /v1 sends EOS as ""): its text is the tokenizer's
    top = [TokenProb(token, piece or text(token), p) for (token, _, piece), p in zip(entries, probs)]
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    return StageTrace(name, sum(1 for p in probs if p > 0), 0.0, entropy, 0.0, top)


def run_fast(model: RemoteModel, prompt: str, config: DecodingConfig, *, chat: bool = False,
             raw: bool = True) -> Trace:
    """Fast mode: the server generates the whole text in one streamed request (its top-N per
    token, raw and final as the backend gives them; ``raw``: llama.cpp, a second request for the
    raw top-N)."""
    fast = model.with_mode("fast")
    return _collect(_stream_fast(fast, prompt, fast.encode(prompt, chat), config, chat, raw=raw))


def _stream_fast(model: RemoteModel, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, chat: bool,
                 raw: bool = True) -> Iterator[Event]:
    """Fast mode's Events: one streamed request (``api.generate``), an Event per token as it
    arrives (its ``elapsed_ms`` since the request began), then the labelled Trace. llama.cpp's raw
    top-N come from a second request after the stream: the Events show the final stage only,
    the Trace's steps raw and final."""
    check_strategy(config)
    start = time.perf_counter()
    steps: list[StepTrace] = []
    answer: FastAnswer | None = None
    with closing(model.api.generate(prompt_ids, config, raw)) as generated:  # a Stop closes the request
        for item in generated:
            if isinstance(item, FastAnswer):
                answer = item
                continue
            if len(steps) >= config.max_new_tokens:  # the API stops there; never more, whatever it yields
                raise RemoteError(f"{model.client.server} {model.url}: more than max_new_tokens "
                                  f"({config.max_new_tokens}) tokens")
            step = _fast_step(model, len(steps), item, (time.perf_counter() - start) * 1000)
            steps.append(step)
            yield Event(steps=[step])
    assert answer is not None, "api.generate ends with its FastAnswer"
    if answer.final:
        steps = [_with_final(model, step, p, top) if not step.stages else step
                 for step, (p, top) in zip(steps, answer.final)] + steps[len(answer.final):]
    if answer.raw:
        steps = [_with_raw(model, step, top) for step, top in zip(steps, answer.raw)] + steps[len(answer.raw):]
    if steps:
        steps[-1] = replace(steps[-1], finish_reason=answer.finish_reason)
    trace = assemble(model, prompt, prompt_ids, config, steps, chat)
    approximations = list(answer.approximations)
    outside = sum(1 for s in steps if math.isnan(s.raw_prob))
    if outside and answer.raw:
        approximations.append(f"{outside} of the {len(steps)} tokens lie outside the raw top {config.top_n}, so their "
                              "raw p is unknown and so are the raw mean log-prob and perplexity")
    label = _label(model, "fast", config.top_n, approximations, answer.notes)
    label.timings, label.streamed = answer.timings, True
    label.server_speculative = server_speculative(answer.timings).get("server_speculative")
    trace.extra["remote"] = label.to_json()
    yield Event(trace=trace)


def server_speculative(timings: dict[str, Any]) -> dict[str, Any]:
    """llama-server's own speculative decoding in a fast-mode answer (a server started with a draft
    model, ``-md``, or ``--spec-type ngram-*``): ``{"server_speculative": {"drafted", "accepted",
    "acceptance_rate"}}`` from its ``timings.draft_n`` / ``draft_n_accepted``; {} when it did not draft,
    or when they are not counts of drafts and of the accepted among them (``Schema.timings`` kept finite
    numbers only: nothing else holds them in range)."""
    try:
        drafted, accepted = int(timings["draft_n"]), int(timings["draft_n_accepted"])
    except (KeyError, TypeError, ValueError):
        return {}
    if drafted <= 0 or not 0 <= accepted <= drafted:
        return {}
    return {"server_speculative": {"drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted}}


def _fast_step(model: RemoteModel, index: int, token: FastToken, elapsed_ms: float) -> StepTrace:
    """A streamed token as a step: its stages are the top-N the backend sent (raw, final)."""
    if not 0 <= token.token < model.vocab_size:
        raise RemoteError(f"{model.client.server} {model.url}: token {token.token} is outside the "
                          f"vocabulary of {model.vocab_size} (vocab_size)")
    stages = []
    for name, entries in (("raw", token.raw), ("final", token.final)):
        if entries is not None:
            model.learn_pieces(entries)
            stages.append(_stage(name, entries, model.token_text))
    raw_prob = _prob_of(token.token, token.raw) if token.raw is not None else math.nan
    if math.isnan(raw_prob) and token.raw_prob is not None:
        raw_prob = token.raw_prob  # outside the top-N: vLLM sends the pick's own as an N+1st entry
    elif token.final is None and token.raw is not None and math.isfinite(token.prob):
        raw_prob = token.prob  # an OpenAI-compatible server's: the pick's own log-prob is of the top-N's kind
    return StepTrace(index, token.token, model.token_text(token.token), token.prob, raw_prob, None, None, None,
                     stages[-1].entropy if stages else math.nan, stages[0].entropy if stages else math.nan,
                     stages, elapsed_ms=elapsed_ms)


def _with_final(model: RemoteModel, step: StepTrace, prob: float, final: list[Entry]) -> StepTrace:
    """``step`` (streamed without probabilities) with its p and final top-N from a whole request."""
    model.learn_pieces(final)
    stage = _stage("final", final, model.token_text)
    return replace(step, chosen_prob=prob, stages=[stage], entropy=stage.entropy, raw_entropy=stage.entropy)


def _with_raw(model: RemoteModel, step: StepTrace, raw: list[Entry]) -> StepTrace:
    """``step`` with the raw top-N of a later request as its first stage."""
    model.learn_pieces(raw)
    stage = _stage("raw", raw, model.token_text)
    return replace(step, stages=[stage, *step.stages], raw_prob=_prob_of(step.chosen_token_id, raw),
                   raw_entropy=stage.entropy)


def _prob_of(token: int, entries: list[Entry]) -> float:
    """``token``'s probability in a top-N; NaN outside it (unknown: below the N-th, not 0)."""
    return next((math.exp(lp) for t, lp, _ in entries if t == token), math.nan)


def stepwise(ctx: Any) -> Iterator[Event]:
    """Greedy and sampling on a served model (``engine.core.RunContext``): ``stream`` in the
    model's mode, checking the run's control before each request."""
    yield from checked(stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat, prefix=ctx.prefix,
                              force=ctx.force), ctx.control)

