"""Beam search over one KV cache, recording the whole search tree.

The beams are the rows of one batch: prefill the prompt once (batch of one), then every step feeds
the ``num_beams`` newest tokens as a ``[num_beams, 1]`` batch and reorders the cache rows to the
chosen parents (``KVCache.reorder``); nothing is ever recomputed.

Selection follows transformers 5.23 ``GenerationMixin._beam_search`` (do_sample=False) exactly:

* log-probs are ``log_softmax(logits)`` of the model, then the processors (repetition penalty,
  no-repeat-n-gram, ...) are applied to those log-probs; sampling-only stages (temperature, top-k,
  top-p, ...) are ignored, as in ``generate(do_sample=False)``. A beam's score is the sum of its
  processed log-probs.
* **Candidates considered** per step (and per group): the top ``K = max(2, 1 + n_eos) * B``
  continuations by cumulative score over all B beams x the whole vocabulary (B = beams in the group,
  n_eos = number of EOS ids; 2B for a model with one EOS id). Only these are recorded.
* Of the K, a candidate that hits a stop condition (EOS, a stop string, ``max_new_tokens``) cannot
  run on; the best B of the others become the next beams (``kept``), the rest are ``pruned``.
* A stopped candidate among the first B of the K enters the set of B finished hypotheses if its
  length-normalised score ``score / generated_length ** length_penalty`` (the length counts the EOS
  token) beats the worst one there (``finished``; else ``pruned``), unless early stopping has closed
  the set (``dropped``): with ``early_stopping=True`` once B hypotheses are finished; otherwise once
  the best running beam can no longer beat the worst finished one, judged at the current length
  (``False``) or, with ``"never"`` and a positive length penalty, at ``max_new_tokens``.
* The search ends when early stopping closes the set, or no candidate can run on. Beams still
  running when early stopping ends the search are marked ``dropped`` too.

Diverse (group) beam search (``num_beam_groups`` > 1) splits the beams into groups searched one
after another each step; a group's log-probs are lowered by ``diversity_penalty`` times the number
of times earlier groups chose the token at this step (Hamming diversity, Vijayakumar et al. 2016, as
transformers 4.x did; transformers 5 moved it to the Hub, so it has no in-library oracle). Each
group keeps its own finished set; the final hypotheses are all groups' merged by score.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from engine import sampling
from engine.cache import KVCache
from engine.config import SAMPLING_ONLY_STAGES, ConfigError, DecodingConfig, Knob
from engine.core import RunContext, StopCheck, check_prompt, checked
from engine.base.seam import Model
from engine.chain import Chain
from engine.stages import build_stage
from engine.base.strategy_spec import Exported, StrategySpec, register
from engine.trace import Event, StepTrace, Timing, Trace, from_dict

STATUSES = ("kept", "pruned", "finished", "dropped")
NEG = -1.0e9  # transformers' "impossible" score


# --- trace records ---------------------------------------------------------------------------
@dataclass
class BeamCandidate:
    """One continuation considered at a step. ``parent`` is the beam slot (row) it extends;
    ``beam`` the slot it occupies among the next step's beams (None unless it runs on)."""

    parent: int
    token_id: int
    token: str
    logprob: float  # processed log-prob: what the score adds (diversity penalty included)
    raw_logprob: float  # the unprocessed model's log-prob
    score: float  # cumulative: the parent's score + logprob
    normalized_score: float  # score / (step + 1) ** length_penalty
    status: str  # kept | pruned | finished | dropped
    beam: int | None = None
    group: int = 0
    finish_reason: str | None = None  # eos | stop_string | max_new_tokens, when it hit a stop


@dataclass
class BeamStep:
    """One search step: all candidates considered (group by group), best first within a group."""

    index: int
    candidates: list[BeamCandidate]
    entropy: list[float]  # raw-model entropy (nats) of each beam row's next-token distribution
    elapsed_ms: float = 0.0


@dataclass
class BeamHypothesis:
    """A finished sequence. ``score`` equals generate()'s ``sequences_scores``."""

    token_ids: list[int]  # generated tokens, EOS included
    text: str
    sum_logprobs: float
    length: int  # generated length used for normalisation (= len(token_ids))
    score: float  # sum_logprobs / length ** length_penalty
    finish_reason: str
    path: list[int]  # the candidate index chosen at each step 0..length-1
    group: int = 0
    returned: bool = False  # among the num_return_sequences best


@dataclass
class BeamTrace:
    num_beams: int
    num_beam_groups: int
    length_penalty: float
    early_stopping: bool | str
    candidates_per_step: int  # K per group
    steps: list[BeamStep] = field(default_factory=list)
    hypotheses: list[BeamHypothesis] = field(default_factory=list)  # best first
    winner: int | None = None  # index into hypotheses
    ended_by: str = ""  # early_stopping | no_continuation | no_tokens_left

    @staticmethod
    def from_dict(data: dict) -> "BeamTrace":
        return from_dict(BeamTrace, data)


# --- search state -----------------------------------------------------------------------------
@dataclass
class _Finished:
    token_ids: list[int]
    path: list[int]
    sum_logprobs: float
    reason: str


@dataclass
class _Group:
    """The mutable state of one group of ``size`` beams (rows ``offset .. offset + size``)."""

    offset: int
    size: int
    scores: torch.Tensor  # [size] running beam scores, best first
    tokens: list[list[int]]  # generated tokens of each running beam
    paths: list[list[int]]  # candidate index at each step, per running beam
    fin_scores: torch.Tensor  # [size] normalised scores of the finished set (NEG = empty slot)
    fin: list[_Finished | None]
    open: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    ended: str = ""  # "" while searching, then early_stopping | no_continuation

    @classmethod
    def start(cls, offset: int, size: int, device: torch.device) -> "_Group":
        """A group's state on ``device`` (the logits', so a model on a GPU keeps its search there)."""
        scores = torch.zeros(size, device=device)
        scores[1:] = NEG  # all rows are the same prompt: only row 0 may propose at step 0
        return cls(offset, size, scores, [[] for _ in range(size)], [[] for _ in range(size)],
                   torch.full((size,), NEG, device=device), [None] * size)

    @property
    def done(self) -> bool:
        return bool(self.ended)

    def all_finished(self) -> bool:
        return all(f is not None for f in self.fin)


@dataclass(frozen=True)
class _Rules:
    keep: int  # K candidates per group
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int
    diversity_penalty: float


# --- one step ---------------------------------------------------------------------------------
def _top_candidates(group: _Group, log_probs: torch.Tensor, keep: int):
    """transformers' _get_top_k_continuations: the best ``keep`` of size x V by cumulative score."""
    vocab = log_probs.shape[-1]
    accumulated = (log_probs + group.scores[:, None]).reshape(1, -1)  # [1, size * V]
    scores, index = torch.topk(accumulated, k=keep)
    scores, index = scores[0], index[0]
    return scores, index // vocab, index % vocab, log_probs.reshape(-1)[index]


def _choose(group: _Group, log_probs: torch.Tensor, raw: torch.Tensor, step: int, rules: _Rules,
            stopper: StopCheck, first: int) -> list[BeamCandidate]:
    """Select the next beams and update the finished set; return the K candidates with statuses.
    ``first``: index of this group's first candidate in the step's candidate list."""
    scores, parents, tokens, logprobs = _top_candidates(group, log_probs, rules.keep)
    parent_l, token_l = parents.tolist(), tokens.tolist()
    reasons = [stopper.reason(group.tokens[p] + [t]) for p, t in zip(parent_l, token_l)]
    hits = torch.tensor([r is not None for r in reasons], device=scores.device)
    running = scores + hits.to(torch.float32) * NEG
    next_index = torch.topk(running.unsqueeze(0), k=group.size)[1][0]
    entered, closed = _update_finished(group, scores, hits, step, rules, parent_l, token_l, reasons, first)
    slot_of = {int(i): s for s, i in enumerate(next_index.tolist())}
    normalized = scores / ((step + 1) ** rules.length_penalty)
    raw_lp = raw[parents, tokens]
    candidates = []
    for i, (p, t) in enumerate(zip(parent_l, token_l)):
        if reasons[i] is None:
            status = "kept" if i in slot_of else "pruned"
        else:
            status = "finished" if i in entered else "dropped" if closed and i < group.size else "pruned"
        candidates.append(BeamCandidate(
            parent=group.offset + p, token_id=t, token=stopper.lm.token_text(t), logprob=float(logprobs[i]),
            raw_logprob=float(raw_lp[i]), score=float(scores[i]), normalized_score=float(normalized[i]),
            status=status, beam=group.offset + slot_of[i] if i in slot_of else None, finish_reason=reasons[i]))
    group.scores = running[next_index]
    group.tokens = [group.tokens[parent_l[i]] + [token_l[i]] for i in next_index.tolist()]
    group.paths = [group.paths[parent_l[i]] + [first + i] for i in next_index.tolist()]
    _update_open(group, step, rules, all(r is not None for r in reasons))
    if group.ended == "early_stopping":
        for c in candidates:  # the search stops here: the beams that would run on are abandoned
            if c.status == "kept":
                c.status = "dropped"
    return candidates


def _update_finished(group: _Group, scores: torch.Tensor, hits: torch.Tensor, step: int, rules: _Rules,
                     parents: list[int], tokens: list[int], reasons: list, first: int) -> tuple[set[int], bool]:
    """transformers' _update_finished_beams. Returns (candidates that entered the set, whether early
    stopping had closed the set to new entries)."""
    keep = scores.shape[0]
    just_finished = hits & (torch.arange(keep, device=scores.device) < group.size)
    full = group.all_finished() and rules.early_stopping is True
    closed = full or not group.open
    normalized = scores / ((step + 1) ** rules.length_penalty)
    normalized = normalized + float(full) * NEG
    normalized = normalized + float(not group.open) * NEG
    normalized = normalized + (~just_finished).to(torch.float32) * NEG
    merged = torch.cat((group.fin_scores, normalized))
    best = torch.topk(merged.unsqueeze(0), k=group.size)[1][0].tolist()
    was_finished = [f is not None for f in group.fin] + just_finished.tolist()
    fin, entered = [], set()
    for i in best:
        if i < group.size:
            fin.append(group.fin[i] if was_finished[i] else None)
        elif was_finished[i]:
            c = i - group.size
            entered.add(c)
            tokens_c = group.tokens[parents[c]] + [tokens[c]]
            path = group.paths[parents[c]] + [first + c]
            fin.append(_Finished(tokens_c, path, float(scores[c]), reasons[c]))
        else:
            fin.append(None)
    group.fin_scores, group.fin = merged[best], fin
    return entered, closed


def _update_open(group: _Group, step: int, rules: _Rules, no_continuation: bool) -> None:
    """transformers' _check_early_stop_heuristic and _beam_search_has_unfinished_sequences."""
    lp = rules.length_penalty
    length = rules.max_new_tokens if rules.early_stopping == "never" and lp > 0.0 else step + 1
    best_possible = group.scores[:1] / (length ** lp)
    device = group.fin_scores.device
    is_finished = torch.tensor([f is not None for f in group.fin], device=device)
    worst = torch.where(is_finished, torch.min(group.fin_scores), torch.tensor(NEG, device=device))
    group.open = group.open and bool(torch.any(best_possible > worst))
    full_and_eager = group.all_finished() and rules.early_stopping is True
    if no_continuation:
        group.ended = "no_continuation"
    elif not group.open or full_and_eager:
        group.ended = "early_stopping"


def _diversity(log_probs: torch.Tensor, chosen: list[int], penalty: float) -> torch.Tensor:
    """Hamming diversity: lower each token by penalty x times earlier groups chose it this step."""
    if not chosen or penalty == 0.0:
        return log_probs
    counts = torch.bincount(torch.tensor(chosen, device=log_probs.device), minlength=log_probs.shape[-1])
    counts = counts.to(log_probs.dtype)
    return log_probs - penalty * counts


# --- the search -------------------------------------------------------------------------------
def _chain(lm: Model, config: DecodingConfig, prompt_length: int) -> Chain:
    """The processors generate(do_sample=False) would apply: sampling-only stages are left out."""
    names = [n for n in config.active_stages() if n not in SAMPLING_ONLY_STAGES]
    return Chain([build_stage(n, config, prompt_length, lm.tokenizer, lm.eos_token_ids) for n in names])


def candidates_per_step(lm: Model, config: DecodingConfig) -> int:
    """K: candidates considered per step and group, as transformers: max(2, 1 + n_eos) x group size."""
    return max(2, 1 + len(lm.eos_token_ids)) * (config.num_beams // config.num_beam_groups)


def _rules(lm: Model, config: DecodingConfig) -> _Rules:
    return _Rules(candidates_per_step(lm, config), config.length_penalty, config.early_stopping,
                  config.max_new_tokens, config.diversity_penalty)


def _row_entropy(raw: torch.Tensor) -> list[float]:
    """Entropy (nats) of each row of log-probs [B, V]."""
    return (-(raw.exp() * raw).nan_to_num().sum(dim=-1)).tolist()


def stream(lm: Model, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, *,
           chat: bool = False) -> Iterator[Event]:
    """An Event per search step as it is decided (record: its BeamStep; no steps: the output is
    only known at the end), then one holding the Trace (its ``beam``: the whole BeamTrace)."""
    check_prompt(prompt_ids)
    if config.num_return_sequences > config.num_beams:
        raise ValueError(f"num_return_sequences: {config.num_return_sequences} exceeds num_beams={config.num_beams}")
    start = time.perf_counter()
    rules, stopper = _rules(lm, config), StopCheck(lm, config)
    size = config.num_beams // config.num_beam_groups
    groups = [_Group.start(g * size, size, lm.device) for g in range(config.num_beam_groups)]
    chain = _chain(lm, config, len(prompt_ids))
    prompt_row = torch.tensor([list(prompt_ids)], dtype=torch.long, device=lm.device)  # [1, S]
    cache = KVCache(lm.model)
    logits = cache.forward(prompt_row).logits[:, -1, :].float().expand(config.num_beams, -1)  # [B, V]
    ids = prompt_row.expand(config.num_beams, -1)  # [B, S]: what each cache row holds
    trace = BeamTrace(config.num_beams, config.num_beam_groups, config.length_penalty, config.early_stopping,
                      rules.keep)
    no_tokens_left = False
    for step in range(config.max_new_tokens):
        try:
            record, index, feed = _search_step(groups, logits, chain, ids, step, rules, stopper)
        except sampling.NoTokensLeft:  # every candidate masked: end with the hypotheses so far
            no_tokens_left = True
            break
        record.elapsed_ms = (time.perf_counter() - start) * 1000
        trace.steps.append(record)
        yield Event(record=record)
        if all(g.done for g in groups):
            break
        cache.reorder(index if step > 0 else torch.zeros_like(index))  # step 0: the cache has one row
        ids = torch.cat([ids[index], feed], dim=1)
        logits = cache.forward(feed).logits[:, -1, :].float()
    _finish(trace, groups, config, lm)
    if no_tokens_left:
        trace.ended_by = sampling.NO_TOKENS_LEFT
    yield Event(trace=assemble(lm, prompt, prompt_ids, config, trace, chat))


def _search_step(groups: list[_Group], logits: torch.Tensor, chain: Chain, ids: torch.Tensor, step: int,
                 rules: _Rules, stopper: StopCheck) -> tuple[BeamStep, torch.Tensor, torch.Tensor]:
    """One step for every group, given each row's logits [B, V] and sequence ids [B, S]. Returns the
    record, the cache row index [B] and the next input [B, 1] (finished groups' rows idle along)."""
    raw = torch.log_softmax(logits, dim=-1)  # [B, V]
    processed = chain(ids, raw) if chain.stages else raw
    candidates: list[BeamCandidate] = []
    chosen: list[int] = []  # tokens picked by earlier groups at this step
    index, feed = list(range(ids.shape[0])), ids[:, -1].tolist()
    for n, g in enumerate(groups):
        if g.done:
            continue
        rows_g = slice(g.offset, g.offset + g.size)
        group_lp = _diversity(processed[rows_g], chosen, rules.diversity_penalty)
        sampling.ensure_tokens(group_lp.reshape(1, -1), step)  # some beam of the group must go on
        new = _choose(g, group_lp, raw[rows_g], step, rules, stopper, len(candidates))
        for c in new:
            c.group = n
        candidates.extend(new)
        for c in new:
            if c.beam is not None:
                index[c.beam], feed[c.beam] = c.parent, c.token_id
        chosen.extend(t[-1] for t in g.tokens)
    record = BeamStep(step, candidates, _row_entropy(raw))
    return (record, torch.tensor(index, device=ids.device),
            torch.tensor(feed, dtype=torch.long, device=ids.device).unsqueeze(1))


def _finish(trace: BeamTrace, groups: list[_Group], config: DecodingConfig, lm: Model) -> None:
    """Collect every group's finished hypotheses, best first."""
    found = []
    for n, g in enumerate(groups):
        for score, fin in zip(g.fin_scores.tolist(), g.fin):
            if fin is not None:
                found.append((score, n, fin))
    found.sort(key=lambda x: -x[0])  # stable: within a group, transformers' slot order
    trace.hypotheses = [
        BeamHypothesis(token_ids=f.token_ids, text=lm.decode(f.token_ids), sum_logprobs=f.sum_logprobs,
                       length=len(f.token_ids), score=s, finish_reason=f.reason, path=f.path, group=n,
                       returned=rank < config.num_return_sequences)
        for rank, (s, n, f) in enumerate(found)
    ]
    trace.winner = 0 if trace.hypotheses else None
    trace.ended_by = "early_stopping" if any(g.ended == "early_stopping" for g in groups) else "no_continuation"


def _stop_reason(beam: BeamTrace, winner: BeamHypothesis | None) -> str:
    if beam.ended_by == sampling.NO_TOKENS_LEFT and winner is None:
        return sampling.NO_TOKENS_LEFT
    return winner.finish_reason if winner else "max_new_tokens"


def lineage(beam: BeamTrace, step: int, index: int) -> list[int]:
    """Candidate indices from step 0 to candidate ``index`` of ``step`` (its path through the tree)."""
    path = [index]
    for t in range(step, 0, -1):
        parent_slot = beam.steps[t].candidates[path[-1]].parent
        path.append(next(i for i, c in enumerate(beam.steps[t - 1].candidates) if c.beam == parent_slot))
    return path[::-1]


def lineage_tokens(beam: BeamTrace, step: int, index: int) -> list[int]:
    """The generated tokens of candidate ``index`` of ``step`` (its own token last)."""
    return [beam.steps[t].candidates[i].token_id for t, i in enumerate(lineage(beam, step, index))]


# --- whole runs -------------------------------------------------------------------------------
def winner_steps(beam: BeamTrace) -> list[StepTrace]:
    """StepTraces along the winning path (no per-stage records: beam search has no sampling stages)."""
    if beam.winner is None:
        return []
    hyp = beam.hypotheses[beam.winner]
    out = []
    for t, ci in enumerate(hyp.path):
        step = beam.steps[t]
        c = step.candidates[ci]
        h = step.entropy[c.parent]
        out.append(StepTrace(
            index=t, chosen_token_id=c.token_id, chosen_token=c.token, chosen_prob=_exp(c.logprob),
            raw_prob=_exp(c.raw_logprob), draw=None, draw_low=None, draw_high=None, entropy=h, raw_entropy=h,
            stages=[], elapsed_ms=step.elapsed_ms, finish_reason=hyp.finish_reason if t == len(hyp.path) - 1 else None))
    return out


def _exp(x: float) -> float:
    import math

    return math.exp(x) if x > -745 else 0.0


def assemble(lm: Model, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, beam: BeamTrace,
             chat: bool) -> Trace:
    """A Trace whose text / generated_token_ids are the winning hypothesis."""
    steps = winner_steps(beam)
    winner = beam.hypotheses[beam.winner] if beam.winner is not None else None
    generated = list(winner.token_ids) if winner else []
    total = beam.steps[-1].elapsed_ms if beam.steps else 0.0
    timing = Timing(ttft_ms=beam.steps[0].elapsed_ms if beam.steps else 0.0,
                    tokens_per_s=len(beam.steps) / (total / 1000) if total > 0 else 0.0, total_ms=total)
    summary = {"tokens": len(generated), "search_steps": len(beam.steps), "total_ms": total,
               "hypotheses": len(beam.hypotheses), "ended_by": beam.ended_by}
    if winner:
        summary |= {"score": winner.score, "sum_logprobs": winner.sum_logprobs}
    return Trace(
        model=lm.name, strategy=config.strategy, config=config.to_dict(sparse=True), prompt=prompt,
        prompt_token_ids=list(prompt_ids), text=StopCheck(lm, config).text(generated), generated_token_ids=generated,
        stop_reason=_stop_reason(beam, winner), steps=steps, timing=timing, chat=chat,
        quantization=lm.quantization, device=str(lm.device), beam=beam, summary=summary,
    )


# --- the strategy -------------------------------------------------------------------------------------
def run(ctx: RunContext) -> Iterator[Event]:
    """Beam search on a model loaded here (``engine.runner.stream``)."""
    yield from checked(stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat), ctx.control)


def check_knobs(config: DecodingConfig) -> None:
    if config.num_return_sequences > config.num_beams:
        raise ConfigError("num_return_sequences", f"{config.num_return_sequences} exceeds num_beams={config.num_beams}")
    if config.num_beams % config.num_beam_groups != 0:
        raise ConfigError("num_beam_groups", f"{config.num_beam_groups} does not divide num_beams={config.num_beams}")


EARLY_STOPPING_CHOICES = (True, False, "never")  # transformers' early_stopping

register(StrategySpec(
    "beam", run, check=check_knobs, records={"beam": BeamTrace}, in_use=("num_beams",), exported_as="greedy",
    exports={tool: Exported("{tool} has no beam search setting here; exported as greedy decoding",
                            "a beam-search setting") for tool in ("webui", "llama")},
    doc="Keep the num_beams best partial sequences by summed log-probability; the whole search tree is recorded.",
    knobs=(
        Knob("num_beams", "int", 1, 1, 8, doc="Beams kept per step.", step=1),
        Knob("length_penalty", "float", 1.0, -5.0, 5.0, doc="Score = sum logprob / length^alpha. 1 = neutral.", step=0.1),
        Knob("early_stopping", "choice", False, choices=EARLY_STOPPING_CHOICES,
             doc="As transformers: true, false (heuristic) or never."),
        Knob("num_return_sequences", "int", 1, 1, 8, doc="Finished hypotheses returned (at most num_beams).", step=1),
        Knob("num_beam_groups", "int", 1, 1, 8, doc="Diverse beam search groups (must divide num_beams).", step=1),
        Knob("diversity_penalty", "float", 0.0, 0.0, 10.0,
             doc="Penalty for tokens picked by earlier groups at the same step.", step=0.1),
    )))
