"""Contrastive search (Su et al. 2022) and contrastive decoding (Li et al. 2023).

**Contrastive search** (``penalty_alpha`` = α, ``top_k`` = k). Among the k most probable tokens v
(after the penalty/constraint stages; sampling stages do not apply, as in transformers), pick

    argmax_v  (1 − α) · p(v) − α · max_j cos(h_v, h_j)

where h_v is the last-layer hidden state the model produces *for* candidate v and h_j those of every
earlier token (prompt included). Getting h_v needs one forward per candidate, so the k candidates
run as one batch of one-token continuations over the KV cache: the cache is expanded to k identical
rows (``DynamicCache.batch_repeat_interleave``), the batch [k, 1] is fed, and only the chosen row is
kept (``batch_select_indices``). The chosen row's logits are the next step's logits, so each step
costs exactly one forward of k rows.

**Contrastive decoding** (``cd_alpha`` = α, ``amateur``). With the expert's distribution after the
penalty/constraint stages p_E and the amateur's raw distribution p_A, the plausible set is
{v : p_E(v) ≥ α · max p_E} and the score there is log p_E(v) − log p_A(v) (−inf elsewhere).
Greedy (``cfg.is_greedy``, i.e. temperature 0): the best score wins. Otherwise the scores are
treated as logits: the sampling stages (temperature, top-k, top-p, ...) run on them and the pick is
a seeded draw from their softmax. The amateur is a quantized copy of the expert (``self-int8`` /
``self-nf4``) or ``model:<dir>`` with the same tokenizer.

Both strategies yield an ``Event`` per token as they go (``stream``: its StepTrace and its record,
a ``SearchStep`` / ``ContrastStep``); the last Event holds the Trace, whose ``extra[strategy]``
holds those records.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from engine import core, sampling
from engine.base.seam import Model
from engine.cache import KVCache
from engine.config import SAMPLING_ONLY_STAGES, ConfigError, DecodingConfig, Knob, check_drafter
from engine.core import RunContext, StopCheck, assemble, check_prompt, checked, make_generator
from engine.backends.local import ModelLoadError
from engine.backends.registry import SELF_VARIANTS, ModelRegistry, check_same_tokenizer, resolve_variant
from engine.chain import Chain, Traced
from engine.stages import build_stage
from engine.base.strategy_spec import Exported, StrategySpec, register
from engine.trace import Event, StageTrace, TokenProb, Trace, from_dict

# Contrastive search feeds top_k candidates as one batch: bound it so a large top_k cannot blow up
# memory (the paper and transformers' examples use k = 4..10).
MAX_SEARCH_CANDIDATES = 64
STRATEGIES = ("contrastive_search", "contrastive_decoding")


@dataclass
class SearchCandidate:
    """One of contrastive search's top-k candidates at a step."""

    token_id: int
    token: str
    prob: float  # under the model's distribution after the penalty/constraint stages
    penalty: float  # degeneration penalty: max cosine similarity with the context's hidden states
    score: float | None  # (1 - alpha) * prob - alpha * penalty; None if masked (p = 0, never picked)


@dataclass
class SearchStep:
    index: int
    alpha: float
    chosen_token_id: int
    candidates: list[SearchCandidate]  # in order of probability, highest first


@dataclass
class ContrastCandidate:
    """One token's scores at a contrastive-decoding step (log-probs in nats)."""

    token_id: int
    token: str
    expert_logprob: float
    amateur_logprob: float
    score: float | None  # expert - amateur; None outside the plausible set
    plausible: bool


@dataclass
class ContrastStep:
    index: int
    alpha: float
    plausible: int  # size of the plausible set
    threshold_prob: float  # alpha * max p_expert
    chosen_token_id: int
    candidates: list[ContrastCandidate]  # best scores first, then the expert's and amateur's favourites


# --- shared pieces -------------------------------------------------------------------------------


def processor_chain(config: DecodingConfig, prompt_length: int, lm: Model) -> Chain:
    """The penalty and constraint stages of the config, in the user's order (no sampling stages)."""
    names = [n for n in config.active_stages() if n not in SAMPLING_ONLY_STAGES]
    return Chain([build_stage(n, config, prompt_length, lm.tokenizer, lm.eos_token_ids) for n in names])


def sampling_chain(config: DecodingConfig, lm: Model) -> Chain:
    """The sampling stages of the config (empty when greedy)."""
    names = [n for n in config.active_stages() if n in SAMPLING_ONLY_STAGES]
    return Chain([build_stage(n, config, 0, lm.tokenizer, lm.eos_token_ids) for n in names])


# --- contrastive search --------------------------------------------------------------------------


def degeneration_penalty(context: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """max_j cos(candidate_i, context_j): context [S, H], candidates [k, H] -> [k]."""
    ctx = context / context.norm(dim=-1, keepdim=True)
    cand = candidates / candidates.norm(dim=-1, keepdim=True)
    return (cand @ ctx.T).max(dim=-1).values


def search_scores(probs: torch.Tensor, penalty: torch.Tensor, alpha: float) -> torch.Tensor:
    """(1 - alpha) * p - alpha * penalty, [k]; candidates with p = 0 (masked) can never win."""
    score = (1.0 - alpha) * probs - alpha * penalty
    return score.masked_fill(probs <= 0, float("-inf"))


def _check_search(config: DecodingConfig, vocab_size: int) -> int:
    if config.top_k < 2 or config.top_k > MAX_SEARCH_CANDIDATES:
        raise ConfigError("top_k", f"contrastive search runs top_k candidates as one batch; allowed "
                                   f"[2, {MAX_SEARCH_CANDIDATES}], got {config.top_k}")
    return min(config.top_k, vocab_size)


def _expand_and_feed(cache: KVCache, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed each candidate [k] as a one-token continuation of the (batch-1) cache, as one batch.
    Leaves the cache with k rows. Returns (logits [k, V] float32, last hidden states [k, H])."""
    cache.cache.batch_repeat_interleave(candidates.shape[0])
    out = cache.forward(candidates[:, None], output_hidden_states=True)
    return out.logits[:, -1, :].float(), out.hidden_states[-1][:, -1, :].float()


def _keep_row(cache: KVCache, row: int, token_id: int) -> None:
    """Back to batch 1: keep the chosen candidate's row (the cache now holds its token)."""
    cache.cache.batch_select_indices(torch.tensor([row], device=cache.device))
    cache.tokens.append(token_id)


def stream_search(lm: Model, prompt_ids: Sequence[int], config: DecodingConfig) -> Iterator[Event]:
    """Contrastive search, one Event (steps: [its StepTrace], record: its SearchStep) per token."""
    check_prompt(prompt_ids)
    k = _check_search(config, lm.vocab_size)
    start = time.perf_counter()
    cache, chain, stopper = KVCache(lm.model), processor_chain(config, len(prompt_ids), lm), StopCheck(lm, config)
    out = cache.forward(torch.tensor([list(prompt_ids)]), output_hidden_states=True)  # prefill
    context = out.hidden_states[-1][0].float()  # [S, H]
    logits = out.logits[:, -1, :].float()  # [1, V]
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=lm.device)
    generated: list[int] = []
    while True:
        traced = chain.traced(ids, logits, config.top_n, lm.token_text)
        sampling.ensure_tokens(traced.logits, len(generated))
        top_probs, top_ids = torch.topk(traced.final_probs, k)  # [k], highest first
        cand_logits, cand_hidden = _expand_and_feed(cache, top_ids)
        penalty = degeneration_penalty(context, cand_hidden)
        score = search_scores(top_probs, penalty, config.penalty_alpha)
        row = int(torch.argmax(score))
        token = int(top_ids[row])
        _keep_row(cache, row, token)
        generated.append(token)
        reason = stopper.reason(generated)
        pick = sampling.Pick(token, float(top_probs[row]))
        step = core.step_trace(lm, traced, pick, len(generated) - 1, (time.perf_counter() - start) * 1000,
                               finish_reason=reason)
        yield Event(steps=[step], record=SearchStep(step.index, config.penalty_alpha, token, [
            SearchCandidate(int(i), lm.token_text(int(i)), float(p), float(d), float(s) if math.isfinite(s) else None)
            for i, p, d, s in zip(top_ids.tolist(), top_probs.tolist(), penalty.tolist(), score.tolist())]))
        if reason is not None:
            return
        context = torch.cat([context, cand_hidden[row:row + 1]], dim=0)
        logits = cand_logits[row:row + 1]
        ids = torch.cat([ids, torch.tensor([[token]], device=lm.device)], dim=1)


# --- contrastive decoding ------------------------------------------------------------------------


def resolve_amateur(lm: Model, config: DecodingConfig, registry: ModelRegistry) -> Model:
    """The amateur model for ``config.amateur`` on the expert's device and dtype; refuses one whose
    tokenizer differs from the expert's."""
    try:
        return resolve_variant(lm, config.amateur, registry, "amateur")
    except ModelLoadError as exc:
        raise ConfigError("amateur", f"could not load {config.amateur!r}: {exc}") from None


def contrast_scores(expert_logits: torch.Tensor, amateur_logits: torch.Tensor, alpha: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [1, V] -> (scores [1, V] with -inf outside the plausible set, plausible mask [1, V],
    expert log-probs, amateur log-probs). Plausible: p_E(v) >= alpha * max p_E."""
    expert_lp = torch.log_softmax(expert_logits.float(), dim=-1)
    amateur_lp = torch.log_softmax(amateur_logits.float(), dim=-1)
    cutoff = expert_lp.max(dim=-1, keepdim=True).values + (math.log(alpha) if alpha > 0 else float("-inf"))
    plausible = (expert_lp >= cutoff) & torch.isfinite(expert_lp)
    scores = (expert_lp - amateur_lp).masked_fill(~plausible, float("-inf"))
    return scores, plausible, expert_lp, amateur_lp


def _common_vocab(expert_logits: torch.Tensor, amateur_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two models with one tokenizer may pad their output layers differently: compare the shared ids."""
    v = min(expert_logits.shape[-1], amateur_logits.shape[-1])
    return expert_logits[:, :v], amateur_logits[:, :v].to(expert_logits.device)


def contrast_stage(scores: torch.Tensor, plausible: torch.Tensor, expert_lp: torch.Tensor, alpha: float,
                   top_n: int, lm: Model, amateur_name: str) -> StageTrace:
    """The 'contrast' panel: softmax of the scores over the plausible set, as a stage record."""
    probs = torch.softmax(scores[0], dim=-1)
    expert_p = expert_lp[0].exp()
    top_p, top_i = torch.topk(probs, min(top_n, probs.shape[0]))
    return StageTrace(
        name="contrast", kept=int(plausible.sum()), mass_removed=float(expert_p[~plausible[0]].sum()),
        entropy=float(torch.special.entr(probs).sum()), tv_distance=float(0.5 * (probs - expert_p).abs().sum()),
        top=[TokenProb(int(i), lm.token_text(int(i)), float(p)) for i, p in zip(top_i.tolist(), top_p.tolist())],
        params={"cd_alpha": alpha, "amateur": amateur_name},
    )


def contrast_record(index: int, chosen: int, scores: torch.Tensor, plausible: torch.Tensor, expert_lp: torch.Tensor,
                    amateur_lp: torch.Tensor, alpha: float, top_n: int, lm: Model) -> ContrastStep:
    """The best-scoring plausible tokens, plus the expert's and the amateur's favourite."""
    count = int(plausible.sum())
    best = torch.topk(scores[0], min(top_n, count)).indices.tolist()
    ids = list(dict.fromkeys(best + [int(expert_lp[0].argmax()), int(amateur_lp[0].argmax())]))
    candidates = [ContrastCandidate(
        i, lm.token_text(i), float(expert_lp[0, i]), float(amateur_lp[0, i]),
        float(scores[0, i]) if bool(plausible[0, i]) else None, bool(plausible[0, i])) for i in ids]
    threshold = alpha * float(expert_lp[0].max().exp())
    return ContrastStep(index, alpha, count, threshold, chosen, candidates)


def stream_contrast(expert: Model, amateur: Model, prompt_ids: Sequence[int], config: DecodingConfig,
                    amateur_name: str | None = None) -> Iterator[Event]:
    """Contrastive decoding, one Event (steps: [its StepTrace], record: its ContrastStep) per token.
    Both models keep their own KV cache and take one forward per token."""
    check_prompt(prompt_ids)
    start, label = time.perf_counter(), amateur_name or amateur.name
    expert_cache, amateur_cache = KVCache(expert.model), KVCache(amateur.model)
    chain, warpers = processor_chain(config, len(prompt_ids), expert), sampling_chain(config, expert)
    generator = None if config.is_greedy else make_generator(config, expert.device)
    stopper, ids = StopCheck(expert, config), torch.tensor([list(prompt_ids)], device=expert.device)
    generated: list[int] = []
    logits, amateur_logits = expert_cache.step(prompt_ids), amateur_cache.step(prompt_ids)  # prefill both
    while True:
        logits, amateur_logits = _common_vocab(logits, amateur_logits)
        processed, stages = chain.traced(ids, logits, config.top_n, expert.token_text)
        scores, plausible, expert_lp, amateur_lp = contrast_scores(processed, amateur_logits, config.cd_alpha)
        final, warped = warpers.traced(ids, scores, config.top_n, expert.token_text)
        contrast = contrast_stage(scores, plausible, expert_lp, config.cd_alpha, config.top_n, expert, label)
        stages = stages[:-1] + [contrast] + warped[1:]  # raw, processors, contrast, sampling stages, final
        traced = Traced(final, stages, torch.softmax(logits[0].float(), dim=-1), torch.softmax(final[0].float(), dim=-1))
        pick = core.pick(traced, generator, step=len(generated))
        generated.append(pick.token_id)
        reason = stopper.reason(generated)
        step = core.step_trace(expert, traced, pick, len(generated) - 1, (time.perf_counter() - start) * 1000,
                               finish_reason=reason)
        yield Event(steps=[step], record=contrast_record(step.index, pick.token_id, scores, plausible, expert_lp,
                                                         amateur_lp, config.cd_alpha, config.top_n, expert))
        if reason is not None:
            return
        ids = torch.cat([ids, torch.tensor([[pick.token_id]], device=expert.device)], dim=1)
        logits, amateur_logits = expert_cache.step([pick.token_id]), amateur_cache.step([pick.token_id])


# --- entry points --------------------------------------------------------------------------------


def stream(lm: Model, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, *, chat: bool = False,
           registry: ModelRegistry | None = None, amateur: Model | None = None) -> Iterator[Event]:
    """An Event per token for either strategy; the last holds the Trace (``extra[config.strategy]``:
    the per-step records; contrastive decoding, ``extra["amateur"]``: the amateur's name). The
    amateur loads through ``registry`` unless ``amateur`` is given. A step with nothing left to
    pick ends the run (stop_reason "no_tokens_left")."""
    if config.strategy == "contrastive_search":
        source, label = stream_search(lm, prompt_ids, config), None
    elif config.strategy == "contrastive_decoding":
        if amateur is None:
            amateur, label = resolve_amateur(lm, config, registry or ModelRegistry()), config.amateur
        else:
            check_same_tokenizer(lm, amateur, "amateur")
            label = amateur.name
        source = stream_contrast(lm, amateur, prompt_ids, config, label)
    else:
        raise ConfigError("strategy", f"engine.strategies.contrastive runs {' | '.join(STRATEGIES)}, got {config.strategy!r}")
    steps, collected, ended = [], [], False
    try:
        for event in source:
            steps += event.steps
            collected.append(event.record)
            yield event
    except sampling.NoTokensLeft:
        ended = True
    trace = assemble(lm, prompt, prompt_ids, config, steps, chat)
    if ended:
        trace.end_with_no_tokens_left()
    trace.extra[config.strategy] = collected
    if label is not None:
        trace.extra["amateur"] = label
    yield Event(trace=trace)


def records(trace: Trace) -> list[SearchStep] | list[ContrastStep]:
    """The per-step records of a contrastive trace, rebuilt as dataclasses after a JSON round trip."""
    data = trace.extra.get(trace.strategy, [])
    if trace.strategy == "contrastive_search":
        return from_dict(list[SearchStep], data)
    return from_dict(list[ContrastStep], data)


# --- the strategies -----------------------------------------------------------------------------------
def run(ctx: RunContext) -> Iterator[Event]:
    """Contrastive search or decoding on a model loaded here (``engine.runner.stream``)."""
    yield from checked(stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat, registry=ctx.registry),
                       ctx.control)


def check_search(config: DecodingConfig) -> None:
    if config.top_k < 2:
        raise ConfigError("top_k", f"contrastive search needs top_k >= 2 candidates, got {config.top_k}")


register(StrategySpec(
    "contrastive_search", run, check=check_search, records={"contrastive_search": list[SearchStep]},
    in_use=("penalty_alpha",), exported_as="greedy", needs=("hidden_states",),
    exports={"llama": Exported("llama.cpp has no contrastive search; exported as greedy decoding",
                               "a contrastive-search setting", also=("top_k",))},
    doc="Among the top-k tokens, the most probable one least similar to the text so far (hidden states).",
    knobs=(Knob("penalty_alpha", "float", 0.6, 0.0, 1.0, doc="Contrastive search: weight of the degeneration penalty.",
                step=0.05),)))
register(StrategySpec(
    "contrastive_decoding", run, records={"contrastive_decoding": list[ContrastStep]},
    in_use=("cd_alpha", "amateur"), exported_as="greedy", needs=("full_logits",),
    exports={tool: Exported("contrastive decoding (expert vs amateur) has no {tool} equivalent; exported as greedy",
                            "contrastive decoding only") for tool in ("webui", "llama")},
    needs_why="needs full logits of the expert and the amateur",
    doc="The token the expert likes much more than a weaker amateur does, among the expert's plausible ones.",
    knobs=(
        Knob("cd_alpha", "float", 0.1, 0.0, 1.0, doc="Contrastive decoding: plausibility cutoff alpha x max p_expert.",
             step=0.01),
        Knob("amateur", "str", "self-nf4", check=lambda key, value: check_drafter(key, value, SELF_VARIANTS),
             doc="Contrastive decoding amateur: self-int8 | self-nf4 | self-<4-bit checkpoint> | model:<id or dir>."),
    )))
