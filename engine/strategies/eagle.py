"""EAGLE decoding: a draft head reads the target's own features (eagle_head) and grows a draft tree
where it is confident (EAGLE-2); the target verifies the tree in ONE forward, keeping its own
output distribution exactly.

Round: the target's cache holds the sequence minus its last token t (the root); the head's own
cache holds the same positions, fed the pairs (target features at i, token i + 1). Drafting
(``grow``): the head's state at the last position gives the depth-1 candidates (its top ``topk``);
each of the ``eagle_depth`` - 1 further levels feeds the ``topk`` best frontier nodes by
cumulative draft probability (the product along the path) to the head at once, with a tree mask
over its cache (a node sees the context, its ancestors and itself) and the parent's draft state
as its feature, and takes each one's top ``topk`` children. Of every candidate made, the best
``eagle_tokens`` by cumulative probability form the verified tree (ancestor-closed: a child never
outscores its parent). The head's tree positions are dropped after the round.

Verification, the walk and the cache are Medusa's (``medusa._MedusaVerifier``): one forward over
[t, nodes...] with ``medusa.tree_attention_mask``, the walk testing a node's children against the
target's distribution after the whole stage chain (greedy: its argmax; sampling: the point-mass
residual rule, which is EAGLE's own multi-candidate rule with q = 1 and exact for any
deterministically chosen candidates, see ``medusa._MedusaVerifier.test_children``), and
``medusa.keep_rows`` keeping the accepted path's keys and values. The same forward returns the
target's low / middle / high features of the root and the accepted nodes: the head's next input.

``stream`` yields an Event per round (record: an ``EagleRound``, a SpecRound plus the tree, its
accepted path and the depth where the target refused); the last holds the Trace.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from transformers import DynamicCache

from engine import sampling
from engine.base.seam import Model
from engine.base.strategy_spec import StrategySpec, register
from engine.cache import KVCache
from engine.config import DecodingConfig, Knob
from engine.control import RunControl, check
from engine.core import RunContext, check_prompt
from engine.strategies import medusa, speculative
from engine.strategies.eagle_head import EagleHead, load_head
from engine.strategies.medusa import TreeNode, keep_rows, readout, tree_attention_mask
from engine.strategies.speculative import SpecRound
from engine.trace import Event, Trace, from_dict


@dataclass(frozen=True)
class Budget:
    """The dynamic tree's size: ``tokens`` nodes verified at most, grown ``depth`` levels deep,
    ``topk`` children per expanded node and ``topk`` nodes expanded per level."""

    tokens: int = 12
    depth: int = 5
    topk: int = 4


def budget_of(config: DecodingConfig) -> Budget:
    return Budget(config.eagle_tokens, config.eagle_depth, config.eagle_topk)


@dataclass
class EagleRound(SpecRound):
    """A speculative round whose drafts came from the EAGLE head. ``tree``: the verified nodes
    (``score``: cumulative draft probability; ``status``: accepted / rejected / untested), ``path``
    the accepted ones (root to leaf), ``refused_at`` the depth where the target refused every
    child (0: the walk reached a leaf and took the bonus)."""

    tree: list[TreeNode] = field(default_factory=list)
    path: list[int] = field(default_factory=list)
    refused_at: int = 0


def rounds_of(trace: Trace) -> list[EagleRound]:
    """The trace's rounds as EagleRound records (a trace read back from JSON holds dicts)."""
    return from_dict(list[EagleRound], trace.rounds or [])


def head_name(budget: Budget) -> str:
    return f"eagle (tree of {budget.tokens}, depth {budget.depth}, top-{budget.topk})"


@dataclass
class _Candidate:
    """A drafted node before it is chosen: its parent (a candidate index, -1: the root), depth,
    rank among its siblings, target token id, log cumulative draft probability, and (once fed to
    the head) its draft state and its slot in the head's cache."""

    parent: int
    depth: int
    rank: int
    token_id: int
    logscore: float
    state: torch.Tensor | None = None
    slot: int = -1


def fed_state(candidate: _Candidate) -> torch.Tensor:
    """A candidate's draft state, once it was fed to the head (RuntimeError before)."""
    if candidate.state is None:
        raise RuntimeError("eagle: a candidate read before the head was fed it")
    return candidate.state


def draft_mask(rows_ancestors: Sequence[Sequence[int]], context: int, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, R, context + slots] additive mask for R rows fed after ``slots`` - R tree slots: every
    row sees the context and the slots listed as its ancestors (itself included)."""
    allowed = torch.zeros(len(rows_ancestors), context + slots, dtype=torch.bool)
    allowed[:, :context] = True
    for row, ancestors in enumerate(rows_ancestors):
        allowed[row, [context + a for a in ancestors]] = True
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class _EagleVerifier(medusa._MedusaVerifier):
    """Medusa's tree verifier with candidates from the EAGLE head and the target's features kept."""

    def __init__(self, lm: Model, prompt_ids: Sequence[int], config: DecodingConfig, head: EagleHead,
                 budget: Budget):
        kv = KVCache(lm.model)
        t0 = time.perf_counter()
        prefix = list(prompt_ids[:-1])
        features = None
        if prefix:  # the prompt's prefill, returning the features the head starts from
            out = kv.forward(torch.tensor([prefix], dtype=torch.long), output_hidden_states=True)
            features = self.features(out.hidden_states, head)
        speculative._Verifier.__init__(self, lm, prompt_ids, config, medusa._HeadsName(head_name(budget)), kv)
        self.start = t0  # the prefill above is the run's
        self.prefill_ms = self.elapsed_ms()
        self.kv = kv  # (Medusa's heads and tree shape are not read: eagle_round grows its own tree)
        self.lm_head = lm.model.get_output_embeddings()
        self.plain_readout = type(lm.model).__name__ == "LlamaForCausalLM" and hasattr(lm.model, "model")
        self.head, self.budget = head, budget
        self.draft_cache = DynamicCache()
        self.head_len = 0  # positions the head's cache holds
        self.pending = features  # [P, 3H]: target features of positions head_len.. not yet fed to the head

    @staticmethod
    def features(hidden_states: Sequence[torch.Tensor], head: EagleHead) -> torch.Tensor:
        """[T, 3H]: the target's low, middle and high hidden states of one row."""
        return torch.cat([hidden_states[i][0] for i in head.head.layers], dim=-1)

    def feed_context(self) -> torch.Tensor | None:
        """Feed the pending (feature, next token) pairs to the head; its state at the last one."""
        if self.pending is None or not len(self.pending):
            return None
        count = len(self.pending)
        tokens = torch.tensor([self.sequence[self.head_len + 1: self.head_len + 1 + count]], device=self.lm.device)
        positions = torch.arange(self.head_len, self.head_len + count, device=self.lm.device)[None]
        causal = [list(range(i + 1)) for i in range(count)]
        mask = draft_mask(causal, self.head_len, count, self.lm.dtype).to(self.lm.device)
        states = self.head(tokens, self.head.fuse(self.pending)[None], positions, mask, self.draft_cache)
        self.head_len += count
        self.pending = None
        return states[0, -1]

    def children(self, parents: list[int], candidates: list[_Candidate], states: torch.Tensor,
                 depth: int) -> list[_Candidate]:
        """Each parent's (a candidate index, -1: the root) top ``topk`` next tokens after its draft
        state (``states`` [P, H], one read-out for all), scored along the path; parent by parent."""
        logp = torch.log_softmax(self.head.logits(states), dim=-1)
        top = torch.topk(logp, min(self.budget.topk, logp.shape[-1]))
        made = []
        for parent, values, indices in zip(parents, top.values.tolist(), top.indices.tolist()):
            base = candidates[parent].logscore if parent >= 0 else 0.0
            made += [_Candidate(parent, depth, rank, int(self.head.d2t[i]), base + v)
                     for rank, (v, i) in enumerate(zip(values, indices))]
        return made

    def grow(self, max_depth: int) -> list[TreeNode]:
        """EAGLE-2's dynamic tree (module docstring), in tree order (parents first)."""
        state = self.feed_context()
        if state is None or max_depth <= 0 or self.budget.tokens <= 0:
            return []
        eos = set(self.lm.eos_token_ids)
        pool = self.children([-1], [], state[None], 1)
        frontier = list(range(len(pool)))
        slots: list[int] = []  # pool index of each tree slot in the head's cache
        for depth in range(2, max_depth + 1):
            frontier = sorted((c for c in frontier if pool[c].token_id not in eos),
                              key=lambda c: -pool[c].logscore)[: self.budget.topk]
            if not frontier:
                break
            self.feed_frontier(pool, frontier, slots, state, depth)
            made = self.children(frontier, pool, torch.stack([fed_state(pool[c]) for c in frontier]), depth)
            frontier = list(range(len(pool), len(pool) + len(made)))
            pool.extend(made)
        extra = self.draft_cache.get_seq_length() - self.head_len
        if extra:
            self.draft_cache.crop(-extra)  # the tree's slots
        return self.chosen(pool)

    def feed_frontier(self, pool: list[_Candidate], frontier: list[int], slots: list[int], root_state: torch.Tensor,
                      depth: int) -> None:
        """Feed the frontier nodes to the head at once (feature: the parent's draft state)."""
        first = len(slots)
        ancestors = []
        for offset, c in enumerate(frontier):
            chain, at = [first + offset], pool[c].parent
            while at >= 0:
                chain.append(pool[at].slot)
                at = pool[at].parent
            ancestors.append(chain)
            pool[c].slot = first + offset
        slots.extend(frontier)
        feats = torch.stack([fed_state(pool[pool[c].parent]) if pool[c].parent >= 0 else root_state for c in frontier])
        tokens = torch.tensor([[pool[c].token_id for c in frontier]], device=self.lm.device)
        positions = torch.full((1, len(frontier)), self.head_len + depth - 2, device=self.lm.device)
        mask = draft_mask(ancestors, self.head_len, len(slots), self.lm.dtype).to(self.lm.device)
        states = self.head(tokens, feats[None], positions, mask, self.draft_cache)[0]
        for c, s in zip(frontier, states):
            pool[c].state = s

    def chosen(self, pool: list[_Candidate]) -> list[TreeNode]:
        """The best ``tokens`` candidates by cumulative probability (ties: the earlier made, so a
        parent comes before its child), as TreeNodes in tree order."""
        best = sorted(range(len(pool)), key=lambda c: (-pool[c].logscore, c))[: self.budget.tokens]
        order = sorted(best, key=lambda c: (pool[c].depth, c))
        index = {c: i for i, c in enumerate(order)}
        return [TreeNode(i, index[pool[c].parent] if pool[c].parent >= 0 else -1, pool[c].depth, pool[c].rank,
                         pool[c].token_id, self.lm.token_text(pool[c].token_id), math.exp(pool[c].logscore))
                for i, c in enumerate(order)]

    def verify(self, tree: Sequence[TreeNode]) -> tuple[torch.Tensor, torch.Tensor]:
        """ONE target forward over the root and the tree: logits [T, V] and the target's features
        [T, 3H] (row 0 the root, row i + 1 node i)."""
        cached = self.cache.length
        fed = torch.tensor([[self.sequence[-1], *(n.token_id for n in tree)]], dtype=torch.long, device=self.lm.device)
        positions = cached + torch.tensor([[0, *(n.depth for n in tree)]], dtype=torch.long, device=self.lm.device)
        mask = tree_attention_mask(tree, cached, self.lm.dtype).to(self.lm.device)
        kwargs = dict(input_ids=fed, attention_mask=mask, position_ids=positions, past_key_values=self.kv.cache,
                      use_cache=True, output_hidden_states=True)
        with torch.inference_mode():
            if self.plain_readout:
                out = self.lm.model.model(**kwargs)
                logits = readout(self.lm_head, out.last_hidden_state[0])
            else:
                out = self.lm.model(**kwargs, logits_to_keep=0)
                logits = out.logits[0]
        self.cache.forwards += 1
        return logits.float(), self.features(out.hidden_states, self.head)

    def eagle_round(self, index: int) -> EagleRound:
        remaining = self.config.max_new_tokens - len(self.generated)
        t0 = time.perf_counter()
        with torch.inference_mode():
            tree = self.grow(min(self.budget.depth, remaining - 1))
        t1 = time.perf_counter()
        cached = self.cache.length
        logits, features = self.verify(tree)
        t2 = time.perf_counter()
        drafted, emitted, bonus, path = self.walk(tree, logits)
        start = len(self.generated)
        steps, reason = self._emit(emitted)
        t3 = time.perf_counter()
        kept = len(self.sequence) - 1 - cached  # the root and the accepted nodes emitted before a stop
        rows = [0, *(i + 1 for i in path)][:kept]
        keep_rows(self.kv.cache, cached, rows)
        self.cache.tokens = list(self.sequence[:-1])
        self.pending = features[rows]
        ids = self.generated[start:]
        refused = 0 if bonus is not None else len(path) + 1
        return EagleRound(
            index=index, start=start, k=len(tree), drafted=drafted, num_accepted=len(path), bonus=bonus,
            emitted_token_ids=ids, emitted_text=self.lm.decode(ids), draft_ms=(t1 - t0) * 1000,
            verify_ms=(t2 - t1) * 1000, elapsed_ms=self.elapsed_ms(), finish_reason=reason, steps=steps,
            capture_ms=(t3 - t2) * 1000, prefill_ms=self.prefill_ms if index == 0 else 0.0, tree=tree, path=path,
            refused_at=refused,
        )


def rounds(lm: Model, prompt_ids: Sequence[int], config: DecodingConfig, head: EagleHead,
           control: RunControl | None = None, budget: Budget | None = None) -> Iterator[EagleRound]:
    """Yield EagleRounds until EOS, a stop string or max_new_tokens (``control`` checked per round)."""
    check_prompt(prompt_ids)
    verifier = _EagleVerifier(lm, prompt_ids, config, head, budget or budget_of(config))
    index = 0
    while True:
        check(control)
        eagle_round = verifier.eagle_round(index)
        paused = time.perf_counter()
        yield eagle_round
        verifier.paused_s += time.perf_counter() - paused  # a UI drawing the round is not EAGLE's time
        if eagle_round.finish_reason is not None:
            return
        index += 1


def stream(lm: Model, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, *, chat: bool = False,
           control: RunControl | None = None, head: EagleHead | None = None, compare_baseline: bool = False,
           budget: Budget | None = None) -> Iterator[Event]:
    """One Event per round (steps: its tokens; record: the EagleRound); the last holds the Trace.
    ``head``: default the trained head of ``lm`` (engine/assets); ``budget``: default the config's
    ``eagle_*`` knobs. ``compare_baseline`` also times target-only decoding (summary ``speedup``)."""
    head = head if head is not None else load_head(lm)
    budget = budget or budget_of(config)
    collected, ended = [], False
    try:
        for eagle_round in rounds(lm, prompt_ids, config, head, control, budget):
            collected.append(eagle_round)
            yield Event(steps=list(eagle_round.steps), record=eagle_round)
    except sampling.NoTokensLeft:  # as speculative's stream: the run ends, saying why
        ended = True
    trace = speculative.assemble(lm, prompt, prompt_ids, config, collected, medusa._HeadsName(head_name(budget)), chat)
    trace.summary |= {"eagle_tokens": budget.tokens, "eagle_depth": budget.depth, "eagle_topk": budget.topk,
                      "mean_tree_nodes": statistics.fmean(len(r.tree) for r in collected) if collected else 0.0,
                      "depth_acceptance": medusa.head_acceptance(collected)}
    if ended:
        trace.end_with_no_tokens_left()
    if compare_baseline:
        trace.summary |= speculative.compare_with_baseline(lm, prompt, config, trace, chat, control=control)
    yield Event(trace=trace)


def run(ctx: RunContext) -> Iterator[Event]:
    """EAGLE on a model loaded here (``engine.runner.stream``)."""
    yield from stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat, control=ctx.control,
                      compare_baseline=ctx.compare_baseline)


register(StrategySpec(
    "eagle", run, records={"rounds": list[EagleRound]}, needs=("hidden_states",),
    needs_why="needs the model's hidden states for its draft head",
    doc="A draft head reads the target's features and grows a tree where it is sure; one forward verifies it.",
    knobs=(
        Knob("eagle_tokens", "int", 12, 1, 64, doc="EAGLE: draft-tree nodes verified in one forward (the best by "
             "cumulative draft probability).", step=1),
        Knob("eagle_depth", "int", 5, 1, 10, doc="EAGLE: levels the draft tree grows (its deepest path).", step=1),
        Knob("eagle_topk", "int", 4, 1, 10, doc="EAGLE: children per expanded node, and nodes expanded per level.",
             step=1),
    )))
