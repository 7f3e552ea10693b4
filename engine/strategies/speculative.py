"""Speculative decoding: a drafter proposes K tokens, the target scores all of them in ONE forward,
and a rejection rule keeps the output distributed exactly as sampling from the target alone.

Per drafted token x, with q the drafter's and p the target's distribution at that position (both
shaped by the same stage chain: penalties, temperature, top-k, ...):

- sampling: accept x with probability min(1, p(x) / q(x)); at the first rejection sample from
  normalise(max(0, p - q)) and end the round; if all K are accepted, sample a bonus token from p.
- greedy (``config.is_greedy``): accept while x equals the target's argmax; the first mismatch is
  replaced by the argmax; if all K match, the target's next argmax is the bonus token.

Drafters: ``model:<id or dir>`` (a separate model with the same vocabulary), ``self-int8`` /
``self-nf4`` (a bitsandbytes copy of the target's own weights) and ``ngram`` (prompt lookup: copy
what followed the last n tokens earlier in the text; a point mass q, no model).

Caches: the target's cache holds the sequence minus its last token; each round feeds that token
plus the K drafts (K + 1 positions of logits), then both caches are rewound past what was rejected
(``KVCache.rewind`` = ``DynamicCache.crop``), never rebuilt.

``rounds`` yields one ``SpecRound`` per round; ``stream`` wraps each in an ``Event`` (the live UI)
and ends with the whole ``Trace`` (``assemble``: rounds in ``Trace.rounds``, one ``StepTrace`` per
generated token in ``Trace.steps``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from engine import core, sampling

from engine.strategies import decode
from engine.cache import KVCache
from engine.config import KNOBS, ConfigError, DecodingConfig, Knob, check_drafter
from engine.control import RunControl, check
from engine.cache.kv_quant import SELF_KV_DRAFTERS
from engine.base.measures import common_prefix
from engine.base.seam import Cache, Model
from engine.backends.registry import SELF_VARIANTS, ModelRegistry, resolve_variant
from engine.chain import Chain, Traced
from engine.core import RunContext, checked
from engine.base.strategy_spec import StrategySpec, register
from engine.trace import Event, StepTrace, TokenProb, Trace, from_dict


# --- records ----------------------------------------------------------------------------------
@dataclass
class ExtraToken:
    """The token the target adds at the end of a round: ``resampled`` from the residual
    normalise(max(0, p - q)) after a rejection, or the ``bonus`` from p when all drafts passed.
    ``prob``: its probability in the distribution it was drawn from (``top``: that distribution's
    top-N); ``p``: its probability under the target."""

    kind: str  # "resampled" | "bonus"
    token_id: int
    token: str
    prob: float
    p: float
    top: list[TokenProb]
    draw: float | None = None


@dataclass
class DraftToken:
    """One drafted token and its acceptance test. ``u`` is the uniform draw compared with
    ``accept_prob`` (None in greedy mode, where accept_prob is 1 on a match and 0 otherwise)."""

    position: int  # within the round
    token_id: int
    token: str
    q: float
    p: float
    accept_prob: float
    u: float | None
    accepted: bool
    q_top: list[TokenProb]
    p_top: list[TokenProb]
    resampled: ExtraToken | None = None  # set on the rejected token


@dataclass
class SpecRound:
    """One draft-then-verify round. ``start``: generated tokens before the round; ``emitted``: the
    tokens the round added (accepted drafts, then the resampled or bonus token, cut at a stop).
    ``steps`` carries the emitted tokens' StepTraces while streaming; ``assemble`` moves them to
    ``Trace.steps`` (so JSON rounds do not repeat them)."""

    index: int
    start: int
    k: int  # drafts asked for (the drafter may return fewer)
    drafted: list[DraftToken]
    num_accepted: int
    bonus: ExtraToken | None
    emitted_token_ids: list[int]
    emitted_text: str
    draft_ms: float
    verify_ms: float  # the target's forward over the K + 1 positions
    elapsed_ms: float
    finish_reason: str | None = None
    steps: list[StepTrace] = field(default_factory=list)
    capture_ms: float = 0.0  # acceptance tests, trace capture, emitting (after the forward)
    prefill_ms: float = 0.0  # the target's prompt prefill, on the first round only

    @property
    def extra(self) -> ExtraToken | None:
        rejected = [d for d in self.drafted if d.resampled is not None]
        return rejected[0].resampled if rejected else self.bonus


def rounds_of(trace: Trace) -> list[SpecRound]:
    """The trace's rounds as SpecRound records (a trace read back from JSON holds dicts)."""
    return from_dict(list[SpecRound], trace.rounds or [])


# --- the rules (pure; the exactness test drives these same functions) -------------------------
def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)), elementwise. q(x) > 0 because x was drawn from q."""
    return torch.clamp(p_x / q_x, max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)) over the last dim [..., V]. Where p <= q everywhere (only by
    rounding, since then nothing is ever rejected) it falls back to p."""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(1e-30), p)


def prompt_lookup(tokens: Sequence[int], ngram_size: int, k: int) -> list[int]:
    """N-gram drafting: find an earlier occurrence of the last n tokens (n = ngram_size down to 1)
    and return up to k tokens that followed it. Prefers the latest occurrence with k tokens after
    it, else the earliest (the longest continuation). [] when nothing matches."""
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    seq = torch.tensor(list(tokens), dtype=torch.long)
    for n in range(min(ngram_size, length - 1), 0, -1):
        windows = seq[: length - 1].unfold(0, n, 1)  # [length - n, n]; every window has a successor
        hits = (windows == seq[length - n:]).all(dim=1).nonzero().flatten().tolist()
        if not hits:
            continue
        full = [j for j in hits if length - (j + n) >= k]
        j = full[-1] if full else hits[0]
        return list(tokens[j + n: j + n + k])
    return []


def align_vocab(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or pad (with -inf) a drafter's logits [..., V_d] to the target's width [..., width]."""
    have = logits.shape[-1]
    if have == width:
        return logits
    if have > width:
        return logits[..., :width]
    pad = torch.full((*logits.shape[:-1], width - have), float("-inf"), dtype=logits.dtype, device=logits.device)
    return torch.cat([logits, pad], dim=-1)


def top_tokens(probs: torch.Tensor, n: int, token_text) -> list[TokenProb]:
    """The n most probable tokens of a distribution [V], leaving out zero-probability ones (a
    point mass or a greedy p has one entry; topk would pad it with arbitrary ids)."""
    values, ids = torch.topk(probs, min(n, probs.shape[-1]))
    return [TokenProb(int(i), token_text(int(i)), float(v)) for i, v in zip(ids.tolist(), values.tolist()) if v > 0]


# --- drafters ---------------------------------------------------------------------------------
class DrafterError(ValueError):
    """A drafter cannot be used with this target; the message says why."""


@dataclass
class Draft:
    """Drafted tokens and, per token, the draft distribution q [V] it was drawn from (None for a
    point mass: the n-gram drafter)."""

    tokens: list[int]
    q: list[torch.Tensor] | None = None


@dataclass
class DraftContext:
    chain: Chain
    generator: torch.Generator | None  # None: greedy
    vocab_size: int  # the target's logit width


class Drafter(Protocol):
    name: str

    @property
    def forwards(self) -> int: ...  # the drafter's model calls so far

    def draft(self, sequence: list[int], k: int, ctx: DraftContext) -> Draft: ...

    def rewind_to(self, sequence: list[int]) -> None: ...


class NgramDrafter:
    """Prompt-lookup drafting from the prompt and the text so far; no model, q is a point mass."""

    def __init__(self, ngram_size: int):
        if not 1 <= ngram_size <= KNOBS["ngram_size"].high:
            raise DrafterError(f"ngram_size: {ngram_size} is out of range; allowed {KNOBS['ngram_size'].range_text()}")
        self.name = f"ngram (n={ngram_size})"
        self.ngram_size = ngram_size
        self.forwards = 0

    def draft(self, sequence: list[int], k: int, ctx: DraftContext) -> Draft:
        return Draft(prompt_lookup(sequence, self.ngram_size, k))

    def rewind_to(self, sequence: list[int]) -> None:
        pass


class ModelDrafter:
    """A draft model with its own KV cache. It drafts autoregressively with the target's stage
    chain (greedy argmax, or a seeded sample from q)."""

    def __init__(self, lm: Model, name: str | None = None, cache: Cache | None = None):
        self.lm = lm
        self.name = name or lm.name
        self.cache = cache or lm.cache()

    @property
    def forwards(self) -> int:
        return self.cache.forwards

    def draft(self, sequence: list[int], k: int, ctx: DraftContext) -> Draft:
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        if k <= 0:
            return Draft(tokens, qs)
        logits = self.cache.sync(sequence)  # [1, V_d]; feeds only what the cache lacks
        for i in range(k):
            ids = torch.tensor([sequence + tokens], dtype=torch.long, device=self.lm.device)
            final = ctx.chain(ids, align_vocab(logits.float(), ctx.vocab_size))  # [1, V]
            pick = core.pick(final, ctx.generator)
            tokens.append(pick.token_id)
            qs.append(torch.softmax(final[0], dim=-1))
            if i < k - 1:
                logits = self.cache.step([pick.token_id])
        return Draft(tokens, qs)

    def rewind_to(self, sequence: list[int]) -> None:
        """Drop cached positions that are not a prefix of ``sequence`` (the rejected drafts)."""
        self.cache.rewind(self.cache.length - common_prefix(self.cache.tokens, sequence))


def make_drafter(lm: Model, config: DecodingConfig, registry: ModelRegistry) -> Drafter:
    """The drafter named by ``config.drafter`` (loads draft models through the registry)."""
    if config.drafter == "ngram":
        return NgramDrafter(config.ngram_size)
    if config.drafter in SELF_KV_DRAFTERS:  # QuantSpec: the target itself, reading a quantized KV cache
        kind = SELF_KV_DRAFTERS[config.drafter]
        return ModelDrafter(lm, f"{lm.name} ({kind} KV)", KVCache(lm.model, kind, config.kv_residual_length))
    try:
        draft = resolve_variant(lm, config.drafter, registry, "drafter")
    except ConfigError as exc:
        raise DrafterError(str(exc)) from None
    if config.drafter.startswith("self-"):
        return ModelDrafter(draft, f"{lm.name} ({config.drafter.removeprefix('self-')})")
    return ModelDrafter(draft)


# --- the loop ---------------------------------------------------------------------------------
class _Verifier:
    """Runs rounds for one prompt: holds the target cache, the sequence and the stage chain."""

    def __init__(self, lm: Model, prompt_ids: Sequence[int], config: DecodingConfig, drafter: Drafter,
                 cache: Cache | None):
        self.lm, self.config, self.drafter = lm, config, drafter
        self.cache = cache or lm.cache()
        self.chain = Chain.from_config(config, len(prompt_ids), lm.tokenizer, lm.eos_token_ids)
        self.generator = None if config.is_greedy else core.make_generator(config, lm.device)
        self.ctx = DraftContext(self.chain, self.generator, lm.vocab_size)
        self.stopper = core.StopCheck(lm, config)
        self.sequence = list(prompt_ids)
        self.generated: list[int] = []
        self.start = time.perf_counter()
        # seconds the caller spent between our yields (a UI rendering a round): not ours to count,
        # else total_ms (and the speed-up) would charge the UI's drawing to speculative decoding
        self.paused_s = 0.0
        if len(self.sequence) > 1:  # the cache holds all but the last token
            self.cache.sync(self.sequence[:-1])
        self.prefill_ms = self.elapsed_ms()

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start - self.paused_s) * 1000

    def round(self, index: int, k: int) -> SpecRound:
        remaining = self.config.max_new_tokens - len(self.generated)
        t0 = time.perf_counter()
        draft = cut_at_eos(self.drafter.draft(self.sequence, min(k, remaining - 1), self.ctx), self.lm.eos_token_ids)
        t1 = time.perf_counter()
        fed = [self.sequence[-1], *draft.tokens]
        logits = self.cache.forward(torch.tensor([fed], dtype=torch.long), all_logits=True).logits[0].float()  # [K+1, V]
        t2 = time.perf_counter()
        drafted, emitted, bonus = self._accept(draft, logits)
        start = len(self.generated)
        steps, reason = self._emit(emitted)
        t3 = time.perf_counter()
        self.cache.rewind(self.cache.length - (len(self.sequence) - 1))
        self.drafter.rewind_to(self.sequence[:-1])
        ids = self.generated[start:]
        return SpecRound(
            index=index, start=start, k=k, drafted=drafted, num_accepted=sum(d.accepted for d in drafted),
            bonus=bonus, emitted_token_ids=ids, emitted_text=self.lm.decode(ids), draft_ms=(t1 - t0) * 1000,
            verify_ms=(t2 - t1) * 1000, elapsed_ms=self.elapsed_ms(), finish_reason=reason, steps=steps,
            capture_ms=(t3 - t2) * 1000, prefill_ms=self.prefill_ms if index == 0 else 0.0,
        )

    def _accept(self, draft: Draft, logits: torch.Tensor) -> tuple[list[DraftToken], list[tuple[int, Traced]], ExtraToken | None]:
        """Test the drafts left to right (position i sees the sequence plus drafts before i).
        Returns the records, the emitted (token, its position's traced target distribution)
        pairs, and the bonus token if every draft passed."""
        drafted: list[DraftToken] = []
        emitted: list[tuple[int, Traced]] = []
        base = self.sequence + draft.tokens
        for i in range(len(draft.tokens) + 1):
            ids = torch.tensor([base[: len(self.sequence) + i]], dtype=torch.long, device=self.lm.device)
            traced = self.chain.traced(ids, logits[i: i + 1], self.config.top_n, self.lm.token_text)
            sampling.ensure_tokens(traced.logits)
            if i == len(draft.tokens):
                bonus = self._extra("bonus", traced)
                emitted.append((bonus.token_id, traced))
                return drafted, emitted, bonus
            record = self._test(i, draft.tokens[i], traced, draft.q[i] if draft.q else None)
            drafted.append(record)
            if record.accepted:
                emitted.append((record.token_id, traced))
                continue
            assert record.resampled is not None  # _test sets it on a rejected token
            emitted.append((record.resampled.token_id, traced))
            return drafted, emitted, None
        raise AssertionError("unreachable: the loop returns at the bonus position")

    def _test(self, position: int, x: int, traced: Traced, q: torch.Tensor | None) -> DraftToken:
        """The acceptance test of draft token x against the target's traced distribution p, with
        the drafter's q [V] (None: a point mass on x)."""
        p = traced.final_probs  # [V]
        q_row = q if q is not None else torch.nn.functional.one_hot(torch.tensor(x), p.shape[0]).to(p.device, p.dtype)
        if self.generator is None:  # greedy: accept while the draft is the target's argmax
            best = sampling.greedy(traced.logits).token_id  # as decode's greedy pick
            accept_prob, u, accepted = float(best == x), None, best == x
        else:
            accept_prob = float(acceptance_probability(p[x], q_row[x]))
            u = float(torch.rand(1, generator=self.generator, device=self.generator.device))
            accepted = u < accept_prob
        top_n = self.config.top_n
        record = DraftToken(
            position=position, token_id=x, token=self.lm.token_text(x), q=float(q_row[x]), p=float(p[x]),
            accept_prob=accept_prob, u=u, accepted=accepted, q_top=top_tokens(q_row, top_n, self.lm.token_text),
            p_top=top_tokens(p, top_n, self.lm.token_text),
        )
        if not accepted:
            residual = p if self.generator is None else residual_distribution(p, q_row)
            record.resampled = self._extra("resampled", traced, residual)
        return record

    def _extra(self, kind: str, traced: Traced, dist: torch.Tensor | None = None) -> ExtraToken:
        """Draw the round's last token from ``dist`` [V] (default: the target's p; greedy: the
        argmax of p, as decode picks it)."""
        p = traced.final_probs
        dist = p if dist is None else dist
        pick = core.pick(traced, None) if self.generator is None else sampling.sample_probs(dist, self.generator)
        return ExtraToken(kind, pick.token_id, self.lm.token_text(pick.token_id), float(dist[pick.token_id]),
                          float(p[pick.token_id]), top_tokens(dist, self.config.top_n, self.lm.token_text), pick.draw)

    def _emit(self, emitted: list[tuple[int, Traced]]) -> tuple[list[StepTrace], str | None]:
        """Append the round's tokens one by one, stopping at EOS / a stop string / the budget."""
        steps = []
        for token, traced in emitted:
            self.generated.append(token)
            self.sequence.append(token)
            reason = self.stopper.reason(self.generated)
            chosen = sampling.Pick(token, float(traced.final_probs[token]))  # the draw is the round's, not this step's
            steps.append(core.step_trace(self.lm, traced, chosen, len(self.generated) - 1, self.elapsed_ms(),
                                         finish_reason=reason))
            if reason is not None:
                return steps, reason
        return steps, None


def cut_at_eos(draft: Draft, eos_ids: Sequence[int]) -> Draft:
    """The draft up to and including its first end-of-sequence token: a draft after EOS can never
    be emitted (an accepted EOS ends the run), so testing it would only inflate the counts."""
    cut = next((i + 1 for i, t in enumerate(draft.tokens) if t in eos_ids), len(draft.tokens))
    if cut == len(draft.tokens):
        return draft
    return Draft(draft.tokens[:cut], draft.q[:cut] if draft.q is not None else None)


def next_k(k: int, num_drafted: int, num_accepted: int) -> int:
    """Adaptive K (transformers' heuristic): +2 after a round that drafted and accepted all K
    tokens, -1 after a rejection; unchanged when the drafter or the budget gave fewer than K."""
    if num_accepted < num_drafted:
        return max(1, k - 1)
    if num_drafted == k:
        return min(int(KNOBS["num_draft_tokens"].high), k + 2)
    return k


def rounds(lm: Model, prompt_ids: Sequence[int], config: DecodingConfig, drafter: Drafter, *,
           cache: Cache | None = None) -> Iterator[SpecRound]:
    """Yield one SpecRound per draft-then-verify round until EOS, a stop string or max_new_tokens."""
    core.check_prompt(prompt_ids)
    verifier = _Verifier(lm, prompt_ids, config, drafter, cache)
    k, index = config.num_draft_tokens, 0
    while True:
        spec_round = verifier.round(index, k)
        paused = time.perf_counter()
        yield spec_round
        verifier.paused_s += time.perf_counter() - paused
        if spec_round.finish_reason is not None:
            return
        if config.adaptive_k:
            k = next_k(k, len(spec_round.drafted), spec_round.num_accepted)
        index += 1


def stream(lm: Model, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, *, chat: bool = False,
           registry: ModelRegistry | None = None, drafter: Drafter | None = None, control: RunControl | None = None,
           compare_baseline: bool = False) -> Iterator[Event]:
    """One Event per round (steps: its tokens; record: the SpecRound); the last holds the Trace
    (``assemble``). ``drafter``: default the one ``config.drafter`` names, loaded through
    ``registry``. A step with nothing left to pick ends the run (stop_reason "no_tokens_left").
    ``compare_baseline`` also times a target-only run of the same knobs in this process (summary
    ``baseline_ms``, ``speedup``), checking ``control`` per step."""
    drafter = drafter if drafter is not None else make_drafter(lm, config, registry or ModelRegistry())
    collected, ended = [], False
    try:
        for spec_round in rounds(lm, prompt_ids, config, drafter):
            collected.append(spec_round)
            yield Event(steps=list(spec_round.steps), record=spec_round)
    except sampling.NoTokensLeft:
        ended = True
    trace = assemble(lm, prompt, prompt_ids, config, collected, drafter, chat)
    if ended:
        trace.end_with_no_tokens_left()
    if compare_baseline:
        trace.summary |= compare_with_baseline(lm, prompt, config, trace, chat, control=control)
    yield Event(trace=trace)


def summarize(rounds: Sequence[SpecRound], steps: Sequence[StepTrace], drafter: Drafter, prefill_forwards: int) -> dict:
    """Acceptance rate, tokens per target forward and forwards saved (a target-only run makes one
    forward per generated token, the prefill included)."""
    drafted = sum(len(r.drafted) for r in rounds)
    accepted = sum(r.num_accepted for r in rounds)
    tokens = len(steps)
    target_forwards = prefill_forwards + len(rounds)
    return core.run_summary(steps) | {
        "drafter": drafter.name,
        "rounds": len(rounds),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": accepted / len(rounds) if rounds else 0.0,
        "tokens_per_target_forward": tokens / len(rounds) if rounds else 0.0,
        "target_forwards": target_forwards,
        "target_forwards_saved": tokens - target_forwards,
        "draft_forwards": drafter.forwards,
    } | time_breakdown(rounds)


def time_breakdown(rounds: Sequence[SpecRound]) -> dict:
    """Where the run's time went, in ms: prefill + draft + verify (target forwards) + capture
    (acceptance tests, trace capture) + other (the rest: rewinds, stop checks) = total."""
    parts = {name: sum(getattr(r, name) for r in rounds) for name in ("prefill_ms", "draft_ms", "verify_ms", "capture_ms")}
    total = rounds[-1].elapsed_ms if rounds else 0.0
    return parts | {"other_ms": max(0.0, total - sum(parts.values())), "total_ms": total}


def assemble(lm: Model, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig,
             rounds: Sequence[SpecRound], drafter: Drafter, chat: bool) -> Trace:
    """A Trace from streamed rounds: steps gathered into Trace.steps, rounds without them."""
    steps = [s for r in rounds for s in r.steps]
    trace = core.assemble(lm, prompt, prompt_ids, config, steps, chat)
    trace.rounds = [dataclasses.replace(r, steps=[]) for r in rounds]
    trace.summary = summarize(rounds, steps, drafter, int(len(prompt_ids) > 1))
    return trace


def baseline_config(config: DecodingConfig) -> DecodingConfig:
    """The same knobs decoded by the target alone."""
    return config.replace(strategy="greedy" if config.is_greedy else "sample")


def compare_with_baseline(lm: Model, prompt: str, config: DecodingConfig, trace: Trace, chat: bool,
                          control: RunControl | None = None, *,
                          steps: Callable[[list[int], DecodingConfig], Iterator[StepTrace]] | None = None) -> dict:
    """Time a target-only run of the same knobs (checking ``control`` per step). ``steps``: the
    target-only decoding loop, ``(prompt_ids, config) -> StepTraces``; default ``decode.stream`` on
    ``lm`` in this process (a served target passes its step mode, and then the first difference is
    located without the rounding check, which needs the model's logits)."""
    base_config = baseline_config(config)
    prompt_ids = list(trace.prompt_token_ids)
    local = steps is None
    source = decode.stream(lm, prompt_ids, base_config) if steps is None else steps(prompt_ids, base_config)
    collected = []
    try:
        for step in source:
            collected.append(step)
            check(control)
    except sampling.NoTokensLeft:  # the target alone ran out of tokens: its run ends there, as the run did
        pass
    base = core.assemble(lm, prompt, prompt_ids, base_config, collected, chat)
    spec_ms = trace.summary.get("total_ms", 0.0)
    base_ms = base.timing.total_ms
    got, expected = trace.generated_token_ids, base.generated_token_ids
    difference: dict[str, Any] = {}
    if config.is_greedy:
        difference = first_difference(lm, prompt_ids, got, expected) if local else \
            {"baseline_first_difference": None if got == expected else common_prefix(got, expected)}
    return {
        "baseline_ms": base_ms,
        "baseline_tokens": len(expected),
        "baseline_tokens_per_s": base.timing.tokens_per_s,
        "baseline_same_tokens": got == expected,
        **difference,
        # per generated token, so runs that stop at different lengths (sampling) compare fairly
        "speedup": _per_token(base_ms, base) / _per_token(spec_ms, trace) if spec_ms > 0 and base_ms > 0 else math.nan,
    }


def first_difference(lm: Model, prompt_ids: Sequence[int], got: Sequence[int], expected: Sequence[int]) -> dict:
    """Where a greedy run (``got``) first leaves target-only greedy (``expected``), and whether the
    target's logits of the two tokens there lie within two rounding steps of the model's dtype (an
    uncached recompute of the shared prefix): ``baseline_first_difference`` (None: equal) and
    ``baseline_rounding_tie``. A forward of several positions rounds differently from a forward
    of one, so in bfloat16 a tie of the target's two best tokens may break either way; in
    float32 the steps are ~1e-7 and any difference is a defect."""
    got, expected = list(got), list(expected)
    if got == expected:
        return {"baseline_first_difference": None, "baseline_rounding_tie": False}
    n = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    if n >= min(len(got), len(expected)):  # one stopped where the other went on: no tie to blame
        return {"baseline_first_difference": n, "baseline_rounding_tie": False}
    with torch.inference_mode():
        ids = torch.tensor([[*prompt_ids, *expected[:n]]], dtype=torch.long, device=lm.device)
        logits = lm.model(input_ids=ids).logits[0, -1].float()
    a, b = float(logits[got[n]]), float(logits[expected[n]])
    step = torch.finfo(lm.dtype).eps * max(abs(a), abs(b))
    return {"baseline_first_difference": n, "baseline_rounding_tie": abs(a - b) <= 2 * step}


def _per_token(ms: float, trace: Trace) -> float:
    return ms / max(1, len(trace.generated_token_ids))


# --- the strategy -------------------------------------------------------------------------------------
def run(ctx: RunContext) -> Iterator[Event]:
    """Speculative decoding on a model loaded here (``engine.runner.stream``)."""
    yield from checked(stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat, registry=ctx.registry,
                              control=ctx.control, compare_baseline=ctx.compare_baseline), ctx.control)


# The drafters of a model loaded here: a quantized copy of the target (bitsandbytes, a 4-bit checkpoint made
# here, a quantized KV cache), prompt lookup, plus "model:<id or dir>"
DRAFTER_CHOICES = ("self-int8", "self-nf4", "ngram", "self-kv8", "self-kv4") + SELF_VARIANTS[2:]

register(StrategySpec(
    "speculative", run, records={"rounds": list[SpecRound]}, in_use=("drafter", "num_draft_tokens"),
    doc="A drafter proposes K tokens, the target scores them in one forward; the output keeps the "
        "target's distribution exactly.",
    knobs=(
        Knob("drafter", "str", "self-int8", check=lambda key, value: check_drafter(key, value, DRAFTER_CHOICES),
             doc="self-int8 | self-nf4 | ngram | self-kv8 | self-kv4 | self-<4-bit checkpoint: rtn-g64, gptq-g64, "
                 "awq-g64, ...> | model:<id or dir>; for a served target: ngram or model:<a server the operator lists>."),
        Knob("num_draft_tokens", "int", 4, 1, 16, doc="Tokens drafted per round (K).", step=1),
        Knob("ngram_size", "int", 3, 1, 8, doc="n-gram drafter: match length for prompt lookup.", step=1),
        Knob("adaptive_k", "bool", False, doc="Grow or shrink K with the running acceptance rate."),
    )))
