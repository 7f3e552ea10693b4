"""What every decoding strategy shares: prompt validation, stop rules, the seeded generator, the
pick policy, the StepTrace builder, trace assembly and one greedy/sampling run's per-step state.

The strategies (decode, the batched scheduler, beam, speculative, contrastive, MCTS, Medusa) import
these so each of them reads like its algorithm. ``advance_rows`` is THE greedy/sampling loop body:
the scheduler steps its rows with it and ``decode.stream`` with ``RunState.advance``, its one-row
case, so a batched run equals a solo run by construction (stage chain, pick, stateful stages, stop
rules). Likewise ``pick`` is the one-row case of ``pick_rows``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, TypeVar

import torch

from engine import sampling
from engine.cache import KVCache
from engine.config import DecodingConfig
from engine.control import RunControl, check
from engine.base.measures import common_prefix, mean_logprob, perplexity
from engine.base.seam import Model
from engine.chain import Chain, Traced, traced_rows
from engine.trace import StageTrace, StepTrace, Timing, Trace


@dataclass(frozen=True)
class RunContext:
    """Everything a strategy's ``stream`` gets (``engine.runner.stream`` builds it from a
    RunRequest): the model, the prompt (text and encoded ids), the knobs, where drafters and
    amateurs load from (a ModelRegistry), the run's control, whether to time a target-only
    baseline, the batched scheduler greedy/sampling runs may join, and for a continuation (a
    strategy whose spec ``continues``) the tokens it continues after, the token it is forced to
    and the stage records to resume from."""

    lm: Model  # loaded here or served (engine.base.seam): asked its capabilities, never its class
    prompt: str
    ids: list[int]
    config: DecodingConfig
    chat: bool = False
    registry: Any = None  # engine.backends.registry.ModelRegistry
    control: RunControl | None = None
    compare_baseline: bool = False
    scheduler: Any = None
    prefix: tuple[int, ...] = ()  # tokens already generated: the run continues after them
    force: int | None = None  # the token taken at the first new step instead of a pick
    resume: tuple[StageTrace, ...] | None = None  # the run's stage records at the step after prefix (same knobs)


T = TypeVar("T")


def checked(source: Iterator[T], control: RunControl | None) -> Iterator[T]:
    """Items of ``source``, checking ``control`` before each one is computed (a cancelled or
    timed-out run stops within one step). A stopped run closes ``source`` at once (a served
    model's streamed request then ends on the server too)."""
    with closing_stream(source):
        while True:
            check(control)
            try:
                item = next(source)
            except StopIteration:
                return
            yield item


@contextlib.contextmanager
def closing_stream(source: Iterator[T]) -> Iterator[Iterator[T]]:
    """``source``, closed on leaving the block when it can be (a generator: every stream is one; a
    served model's streamed request then ends on the server too)."""
    try:
        yield source
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def check_prompt(prompt_ids: Sequence[int]) -> None:
    """ValueError naming ``prompt`` when the prompt tokenised to nothing (no position to predict from)."""
    if not len(prompt_ids):
        raise ValueError("prompt: empty after tokenisation; type at least one character")


def make_generator(config: DecodingConfig, device: torch.device) -> torch.Generator:
    """The run's own generator, seeded with ``config.seed`` (on the GPU when the model is there, as
    generate() draws; on the CPU otherwise)."""
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    return torch.Generator(device=gen_device).manual_seed(config.seed)


@dataclass
class StopCheck:
    """EOS, stop strings and the token budget. ``text`` is the generated text cut before a stop
    string (stop strings are not part of the returned text, as in OpenAI's API)."""

    lm: Model
    config: DecodingConfig

    def reason(self, generated: Sequence[int]) -> str | None:
        if generated and generated[-1] in self.lm.eos_token_ids:
            return "eos"
        if self.config.stop and self._stop_index(self.lm.decode(list(generated))) is not None:
            return "stop_string"
        if len(generated) >= self.config.max_new_tokens:
            return "max_new_tokens"
        return None

    def _stop_index(self, text: str) -> int | None:
        hits = [text.find(s) for s in self.config.stop if s in text]
        return min(hits) if hits else None

    def text(self, generated: Sequence[int]) -> str:
        text = self.lm.decode(list(generated))
        cut = self._stop_index(text) if self.config.stop else None
        return text if cut is None else text[:cut]


# --- the pick policy ---------------------------------------------------------------------------------
def pick(final: Traced | torch.Tensor, generator: torch.Generator | None, force: int | None = None, *,
         step: int | None = None) -> sampling.Pick:
    """The token of one step from the final distribution (a ``Traced``, or final logits [1, V]):
    the one-row case of ``pick_rows``, whose NoTokensLeft(step) it raises."""
    chosen = pick_rows([final], [generator], [force], [step])[0]
    if isinstance(chosen, Exception):
        raise chosen
    return chosen


def _final_only(logits: torch.Tensor) -> Traced:
    """Final logits [1, V] as a record with no stage (``pick_rows``)."""
    probs = torch.softmax(logits[0].float(), dim=-1)
    return Traced(logits, [], probs, probs)


def pick_rows(finals: Sequence[Traced | torch.Tensor], generators: Sequence[torch.Generator | None],
              forces: Sequence[int | None], steps: Sequence[int | None]) -> list[sampling.Pick | Exception]:
    """The pick policy for R rows (row i: ``finals[i]``, a ``Traced`` or final logits [1, V], with
    ``generators[i]``), the no-token check, argmax and draws computed on [R, V]:

    - ``forces[i]``: that token (a branch); a sampling run's generator still skips one step's draws,
      so the steps after it draw what an unforced run would;
    - no token left (every logit masked, NaN): NoTokensLeft(steps[i]), returned as that row's result;
    - no generator (greedy): the argmax (ties: the lowest id, as ``sampling.greedy``);
    - else a seeded draw from the final probabilities (``sampling.sample_rows``, which equals
      ``sampling.sample_probs`` row by row).

    A ``Traced`` made on a support (``Traced.support``: a served model's top-N) is picked on its n ids
    (argmax, ``sampling.sample_at``): the same token, p and draw as over [V]."""
    traced = [f if isinstance(f, Traced) else _final_only(f) for f in finals]
    # the final probabilities as Chain.traced and generate() compute them: [V], or [n] on a support
    probs = [t.final for t in traced]
    vocab = [t.vocab_size or t.logits.shape[-1] for t in traced]  # each row's V (the draws it takes)
    out: list[sampling.Pick | Exception | None] = [None] * len(finals)
    for i, token in enumerate(forces):
        if token is not None:
            generator = generators[i]
            if generator is not None:
                sampling.skip_draws(generator, 1, vocab[i], probs[i].device)
            out[i] = sampling.Pick(token, traced[i].prob(probs[i], token))
    free = [i for i, token in enumerate(forces) if token is None]
    if not free:
        return every(out)
    dense = [i for i in free if traced[i].support is None]
    has = dict(zip(dense, sampling.rows_with_tokens(torch.cat([traced[i].logits for i in dense])) if dense else []))
    has |= {i: sampling.rows_with_tokens(traced[i].final_logits())[0] for i in free if traced[i].support is not None}
    for i in (i for i in free if not has[i]):
        out[i] = sampling.NoTokensLeft(steps[i])
    greedy = [i for i in dense if has[i] and generators[i] is None]
    drawn = [i for i in dense if has[i] and generators[i] is not None]
    if greedy:
        tokens = torch.argmax(torch.cat([traced[i].logits for i in greedy]), dim=-1).tolist()
        for i, token in zip(greedy, tokens):
            out[i] = sampling.Pick(token, float(probs[i][token]))
    if drawn:
        drawing = [g for i in drawn if (g := generators[i]) is not None]
        picks = sampling.sample_rows(torch.stack([probs[i] for i in drawn]), drawing)
        for i, chosen in zip(drawn, picks):
            out[i] = chosen
    for i in (i for i in free if has[i]):  # a row on its support: the same, on n
        support, generator = traced[i].support, generators[i]
        if support is None:
            continue
        if generator is None:  # argmax over n in id order: the lowest id of a tie, as over V
            at = int(torch.argmax(traced[i].final_logits()[0]))
            out[i] = sampling.Pick(int(support[at]), float(probs[i][at]))
        else:
            out[i] = sampling.sample_at(probs[i], support, vocab[i], generator)
    return every(out)


def last(reports: Iterator[T]) -> T:
    """The last of a report's stream of updates (each stream yields at least one)."""
    final: T | None = None
    for final in reports:
        pass
    if final is None:
        raise RuntimeError("the report's stream yielded nothing")
    return final


def every(items: list[T | None]) -> list[T]:
    """``items`` once each one is set (a row left without its result is a bug: RuntimeError)."""
    done = [item for item in items if item is not None]
    if len(done) != len(items):
        raise RuntimeError("a row was left without its result")
    return done


def draw_at(probs: torch.Tensor, u: float) -> sampling.Pick:
    """The token a uniform draw ``u`` lands on under the inverse-CDF view of ``probs`` [V] (tokens
    sorted by probability, highest first, ties by lower id, as ``sampling.sample_probs`` orders
    them): the first token whose cumulative mass exceeds u, with its interval [low, high)."""
    sorted_probs, order = torch.sort(probs.double(), descending=True, stable=True)  # [V]
    cumulative = sorted_probs.cumsum(0)
    alive = int((sorted_probs > 0).sum())
    if alive == 0:
        raise sampling.NoTokensLeft()
    at = int(torch.searchsorted(cumulative, torch.tensor([u], dtype=cumulative.dtype, device=cumulative.device),
                                right=True)[0])
    at = min(at, alive - 1)  # u past the total by rounding: the last token with any mass
    prob, high = float(sorted_probs[at]), float(cumulative[at])
    return sampling.Pick(int(order[at]), prob, u, high - prob, high)


def step_trace(lm: Model, traced: Traced, chosen: sampling.Pick, index: int, elapsed_ms: float, *,
               forced: bool = False, finish_reason: str | None = None) -> StepTrace:
    """The StepTrace of token ``chosen`` picked from ``traced`` (its stages: raw first, final last;
    a stage between them whose top-N misses the token records the token's p there)."""
    token, stages = chosen.token_id, list(traced.stages)
    for i, probs in enumerate(traced.between, start=1):
        if i < len(stages) - 1 and not any(t.token_id == token for t in stages[i].top):
            stages[i] = dataclasses.replace(stages[i], chosen_prob=traced.prob(probs, token))
    return StepTrace(
        index=index, chosen_token_id=token, chosen_token=lm.token_text(token), chosen_prob=chosen.prob,
        raw_prob=traced.prob(traced.raw, token), draw=chosen.draw, draw_low=chosen.low, draw_high=chosen.high,
        entropy=stages[-1].entropy, raw_entropy=stages[0].entropy, stages=stages, elapsed_ms=elapsed_ms,
        forced=forced, finish_reason=finish_reason,
    )


# --- one greedy / sampling run -----------------------------------------------------------------------
class RunState:
    """One greedy or sampling run's per-step state: its stage chain (built with its generator, so
    XTC draws from it), stop rules, token row [1, T] and generated tokens (``prefix`` included).

    The caller owns the model forwards: it feeds ``sequence`` (the prefill, ``prefill``), then after
    every step the step's token, and hands the next-token logits to ``advance``. With a ``prefix`` (a
    branch), a stateless chain only skips the generator's draws; a stateful one (mirostat's μ, XTC's
    coin) either takes the state the run recorded at the branch step (``resume``: that step's stage
    records, valid only under the run's own knobs; the draws before it are skipped) or must see the
    prefix positions' logits first: ``needs_replay``, then ``replay(rows)``."""

    def __init__(self, lm: Model, prompt_ids: Sequence[int], config: DecodingConfig, *,
                 prefix: Sequence[int] = (), force: int | None = None, resume: Sequence[StageTrace] | None = None):
        check_prompt(prompt_ids)
        self.start = time.perf_counter()
        self.lm, self.config, self.force = lm, config, force
        self.prompt_length = len(prompt_ids)
        self.generator = None if config.is_greedy else make_generator(config, lm.device)
        self.chain = Chain.from_config(config, len(prompt_ids), lm.tokenizer, lm.eos_token_ids, generator=self.generator)
        self.stopper = StopCheck(lm, config)
        self.sequence = list(prompt_ids) + list(prefix)  # what the prefill feeds
        self.ids = torch.tensor([self.sequence], dtype=torch.long, device=lm.device)  # [1, T] for penalties
        self.generated = list(prefix)
        if resume is not None and not self.chain.resumable(resume):
            resume = None  # the records lack a carried state (an older or edited trace): replay instead
        self.needs_replay = bool(prefix) and self.chain.stateful and resume is None
        if prefix and self.chain.stateful and resume is not None:  # the run's own state at this step
            for _ in prefix:  # each step's draws in the run's order: the stages' (XTC's coin), then the pick's
                self.chain.skip()
                if self.generator is not None:
                    sampling.skip_draws(self.generator, 1, lm.vocab_size, lm.device)
            self.chain.resume(resume)
        elif self.generator is not None and prefix and not self.needs_replay:
            sampling.skip_draws(self.generator, len(prefix), lm.vocab_size, lm.device)

    def prefill(self, cache: KVCache) -> torch.Tensor:
        """Bring ``cache`` (one row) to ``sequence`` and return the next-token logits [1, V]: one
        forward over what the cache lacks (``KVCache.sync``: a cache left by an earlier run of the
        same prompt is rewound to the shared prefix, not rebuilt). A branch whose chain is stateful
        also needs its prefix positions' logits: the cache is rewound to the shared part of the
        prompt minus its last token, the forward returns every position after it, ``replay`` walks them."""
        if not self.needs_replay:
            return cache.sync(self.sequence)
        start = self.prompt_length - 1  # the position whose logits picked prefix[0]
        common = common_prefix(cache.tokens, self.sequence[:start])
        cache.rewind(cache.length - common)
        feed = torch.tensor([self.sequence[common:]], dtype=torch.long)
        rows = cache.forward(feed, all_logits=True).logits[0, start - common:].float()  # [len(prefix) + 1, V]
        self.replay(rows[:-1])
        return rows[-1:]

    def replay(self, rows: torch.Tensor) -> None:
        """Bring the chain and the generator to where the run stood after its prefix: ``rows``
        [len(prefix), V] are the logits that picked each prefix token (positions prompt_length - 1
        onwards). Position by position the chain is applied (XTC draws its coin as the run did),
        the generator skips the pick's draws, and the prefix token is observed (mirostat's μ moves)."""
        prefix = self.generated
        if rows.shape[0] != len(prefix):
            raise ValueError(f"replay: expected {len(prefix)} rows of logits, got {rows.shape[0]}")
        for i, token in enumerate(prefix):
            ids = self.ids[:, :self.prompt_length + i]
            self.chain(ids, rows[i:i + 1].float())
            if self.generator is not None:
                sampling.skip_draws(self.generator, 1, self.lm.vocab_size, self.lm.device)
            self.chain.observe(ids, token)
        self.needs_replay = False

    def advance(self, logits: torch.Tensor, support: torch.Tensor | None = None) -> StepTrace:
        """One step: logits [1, V] after the last token -> the chain, the pick, the stateful stages'
        update, the stop rules -> the StepTrace of the token picked (``finish_reason`` set on the last).
        ``support``: ids [n], ascending, outside which every logit is -inf (a served model's top-N);
        ``logits`` may then be [1, n], the logits at those ids: the records and the pick are made on
        those (``chain.traced_rows``). The one-row case of ``advance_rows``, whose exception for the row
        it raises."""
        step = advance_rows([self], [logits], None if support is None else [support])[0]
        if isinstance(step, Exception):
            raise step
        return step

    def finish(self, traced: Traced, chosen: sampling.Pick) -> StepTrace:
        """The rest of a step (``advance_rows``) once its token is picked: the stateful stages'
        update, the stop rules, the token row -> the StepTrace."""
        self.chain.observe(self.ids, chosen.token_id)
        self.chain.annotate(traced.stages)
        self.generated.append(chosen.token_id)
        reason = self.stopper.reason(self.generated)
        step = step_trace(self.lm, traced, chosen, len(self.generated) - 1, (time.perf_counter() - self.start) * 1000,
                          forced=self.force is not None, finish_reason=reason)
        self.force = None
        self.ids = torch.cat([self.ids, torch.tensor([[chosen.token_id]], device=self.ids.device)], dim=1)
        return step

    @property
    def last_token(self) -> int:
        return int(self.ids[0, -1])


def advance_rows(states: Sequence[RunState], logits: torch.Tensor | Sequence[torch.Tensor],
                 supports: Sequence[torch.Tensor | None] | None = None) -> list[StepTrace | Exception]:
    """The greedy/sampling step of many runs at once (``RunState.advance`` is its one-row case): row b
    of ``logits`` [B, V] is ``states[b]``'s. Each run gets the StepTrace it would get stepped alone
    (same tokens, draws from its own generator, floats to rounding), or the exception its step
    raised. The stage statistics, the argmax and the draws' intervals are computed on [R, V]
    (``chain.traced_rows``, ``pick_rows``) instead of row by row."""
    if any(s.needs_replay for s in states):
        raise RuntimeError("replay: a stateful chain with a prefix must replay the prefix first")
    traced = traced_rows([s.chain for s in states], [s.ids for s in states], logits,
                         [s.config.top_n for s in states], states[0].lm.token_text, supports, states[0].lm.vocab_size)
    ok = [(b, t) for b, t in enumerate(traced) if not isinstance(t, Exception)]
    picks = pick_rows([t for _, t in ok], [states[b].generator for b, _ in ok], [states[b].force for b, _ in ok],
                      [len(states[b].generated) for b, _ in ok])
    # the failed rows keep their exception
    out: list[StepTrace | Exception | None] = [t if isinstance(t, Exception) else None for t in traced]
    for (b, row), chosen in zip(ok, picks):
        try:
            out[b] = chosen if isinstance(chosen, Exception) else states[b].finish(row, chosen)
        except Exception as exc:  # noqa: BLE001 (one run's failure ends that run only)
            out[b] = exc
    return every(out)


# --- trace assembly ----------------------------------------------------------------------------------
def timing(steps: Sequence[StepTrace]) -> Timing:
    """Time to first token, tokens/s and total, from the steps' ``elapsed_ms``."""
    if not steps:
        return Timing(0.0, 0.0, 0.0)
    total = steps[-1].elapsed_ms
    return Timing(ttft_ms=steps[0].elapsed_ms, tokens_per_s=len(steps) / (total / 1000) if total > 0 else 0.0, total_ms=total)


def run_summary(steps: Sequence[StepTrace]) -> dict:
    """Mean log-prob (under the final, processed distribution and the raw model), perplexity of the
    raw model along the text, and mean entropy (``engine.reports.metrics`` computes them)."""
    if not steps:
        return {"tokens": 0}
    raw = [s.raw_prob for s in steps]
    return {
        "tokens": len(steps),
        "mean_logprob": mean_logprob([s.chosen_prob for s in steps]),
        "mean_raw_logprob": mean_logprob(raw),
        "perplexity": perplexity(raw),
        "mean_entropy": sum(s.entropy for s in steps) / len(steps),
    }


def assemble(lm: Model, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig,
             steps: list[StepTrace], chat: bool, branch_of: int | None = None) -> Trace:
    """A Trace from collected steps (also used while streaming, for partial traces)."""
    generated = [s.chosen_token_id for s in steps]
    total_ms = steps[-1].elapsed_ms if steps else 0.0
    return Trace(
        model=lm.name, strategy=config.strategy, config=config.to_dict(sparse=True), prompt=prompt,
        prompt_token_ids=list(prompt_ids), text=StopCheck(lm, config).text(generated),
        generated_token_ids=generated, stop_reason=(steps[-1].finish_reason or "") if steps else "",
        steps=steps, timing=timing(steps), chat=chat, quantization=lm.quantization, device=str(lm.device),
        branch_of=branch_of, summary=run_summary(steps) | {"total_ms": total_ms},
    )
