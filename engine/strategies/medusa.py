"""Medusa decoding: extra heads on the target's last hidden state propose the next few tokens, and
the target verifies a tree of them in ONE forward, keeping its own output distribution exactly.

Heads (Medusa-1): head k (k = 1..K) maps the final, normalised hidden state h_j [H] at position j
to ``h + SiLU(W_k h + b_k)`` and reads it out with the base model's own LM head, predicting the
token k + 1 positions ahead (the base head predicts the next one). Each head adds H² + H
parameters; W_k starts at zero, so an untrained head equals the base head.

Round: the cache holds the sequence minus its last token t (the root), and the heads have read h
at the position that chose t. The tree (``build_tree``, the Medusa paper's sparse tree chosen per
round): the best ``TreeShape.nodes`` paths by product of head probabilities, a depth-d node being
one of head d's top ``width`` candidates. One forward feeds [t, nodes...] with a 4D mask (each
node sees the cache, the root, its ancestors and itself) and position ids cache length + depth.
The walk (``walk``) starts at the root: the target's distribution p at a node tests its children
(greedy: the child equal to p's argmax; sampling: speculative's accept/resample rule applied to
the children one by one, exact: see ``test_children``); it descends into an accepted child, else
ends with the target's own token (the residual draw, or the bonus at a leaf). The cache keeps the
root and the accepted nodes' keys/values, moved to sit in sequence (``keep_rows``), and drops the
rest: never recomputed. ``CHAIN`` (width 1) is the single chain of each head's top-1.

So every round emits 1 + accepted tokens for one target forward, and greedy Medusa equals target
greedy token for token. The hidden state at the last accepted node feeds the heads next round.

``stream`` yields an Event per round (record: a ``MedusaRound``, a SpecRound plus the heads'
candidates, the tree and its accepted path); the last event holds the Trace, with ``rounds`` and
``summary["tokens_per_target_forward"]`` as speculative traces have them.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine import sampling
from engine.base.seam import Model
from engine.cache import KVCache
from engine.strategies import speculative
from engine.config import ConfigError, DecodingConfig, Knob
from engine.control import RunControl, check
from engine.core import RunContext, check_prompt
from engine.chain import Traced
from engine.strategies.speculative import DraftToken, ExtraToken, SpecRound
from engine.base.strategy_spec import StrategySpec, register
from engine.trace import Event, TokenProb, Trace, from_dict

ASSETS = Path(__file__).resolve().parents[1] / "assets"  # engine/assets
CANDIDATES_SHOWN = 3  # per head, in the record (at least; the tree may use more)


# --- the heads ------------------------------------------------------------------------------------
class MedusaHeads(nn.Module):
    """K residual blocks over the hidden size H: ``h + SiLU(W_k h + b_k)``. ``vocab`` (optional,
    [V'] token ids): the shortlist the heads read out and may propose (the tokens of the model's
    own training text); empty: the whole vocabulary."""

    vocab: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, hidden: int, num_heads: int, vocab: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden, hidden))  # [K, H_out, H_in]
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden))  # [K, H]
        self.register_buffer("vocab", torch.empty(0, dtype=torch.long) if vocab is None else vocab.long(),
                             persistent=False)
        self._rows: tuple[int, torch.Tensor] | None = None  # (LM-head weight id, its shortlist rows)

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., K, H]: each head's hidden state, to be read out by the LM head."""
        z = torch.einsum("...i,koi->...ko", hidden, self.weight) + self.bias
        return hidden.unsqueeze(-2) + nn.functional.silu(z)

    def readout_rows(self, lm_head: nn.Linear) -> torch.Tensor:
        """The LM head's weight rows of the shortlist [V', H] (copied once per LM head: a
        contiguous slice is what makes the read-out cheap)."""
        weight = lm_head.weight
        if self._rows is None or self._rows[0] != id(weight):
            with torch.inference_mode(False):  # a normal tensor: training saves it for backward
                self._rows = (id(weight), weight.detach()[self.vocab.to(weight.device)].contiguous())
        return self._rows[1]


def head_logits(heads: MedusaHeads, lm_head: nn.Linear, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
    """[..., H] -> [..., K, V]: all heads read out in ONE matmul with the base LM head (on CPU
    the LM head's weight read dominates, so reading it once for every head matters). With a
    shortlist only its V' rows are read (6x fewer for the embedded model's heads); every other
    token gets -inf, so the heads never propose it (verification is unchanged)."""
    states = heads(hidden)
    if num_heads is not None:
        states = states[..., :num_heads, :]
    if not len(heads.vocab):
        return lm_head(states).float()  # the heads share the model's dtype (load_heads)
    short = shortlist_logits(heads, lm_head, states)  # [..., K, V']
    vocab_size = lm_head.weight.shape[0]
    full = torch.full((*short.shape[:-1], vocab_size), float("-inf"), device=short.device)
    full[..., heads.vocab.to(short.device)] = short
    return full


def shortlist_logits(heads: MedusaHeads, lm_head: nn.Linear, states: torch.Tensor) -> torch.Tensor:
    """Head states [..., K, H] read out over the shortlist only: [..., K, V'] (float32)."""
    rows = heads.readout_rows(lm_head)
    flat = states.reshape(-1, states.shape[-1])
    # rows @ x.T: on CPU's BLAS this is several times faster than x @ rows.T for a few rows
    return (rows @ flat.T).T.reshape(*states.shape[:-1], rows.shape[0]).float()


def slug(model_name: str) -> str:
    """A file-name form of a model name: ``SmolLM2-135M-Instruct`` -> ``smollm2-135m-instruct``."""
    return re.sub(r"[^a-z0-9]+", "-", model_name.lower()).strip("-")


def heads_path(model_name: str) -> Path:
    return ASSETS / f"medusa-{slug(model_name)}.safetensors"


def save_heads(heads: MedusaHeads, path: Path, meta: dict) -> str:
    """Write the heads as float16 safetensors (with ``meta`` as string metadata) and a ``.sha256``
    file beside it. Returns the hex digest."""
    tensors = {"weight": heads.weight.detach().to(torch.float16).contiguous(),
               "bias": heads.bias.detach().to(torch.float16).contiguous()}
    if len(heads.vocab):
        tensors["vocab"] = heads.vocab.detach().to(torch.int32).cpu().contiguous()
    save_file(tensors, str(path), metadata={k: str(v) for k, v in meta.items()})
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_suffix(".sha256").write_text(f"{digest}  {path.name}\n")
    return digest


def load_heads(lm: Model, path: Path | None = None) -> MedusaHeads:
    """The trained heads for ``lm`` (checksum verified), in the model's dtype and device."""
    path = path or heads_path(lm.name)
    if not path.is_file():
        raise ConfigError("strategy", f"medusa: no trained heads for {lm.name} (expected {path.name}); "
                                      f"train them with python -m engine.strategies.medusa_train --model <source>")
    sums = path.with_suffix(".sha256")
    if sums.is_file():
        expected = sums.read_text().split()[0]
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != expected:
            raise ConfigError("strategy", f"medusa: {path.name} does not match its checksum; retrain or restore it")
    tensors = load_file(str(path))
    weight, bias = tensors["weight"], tensors["bias"]
    hidden = int(lm.model.config.hidden_size)
    if weight.shape[1:] != (hidden, hidden):
        raise ConfigError("strategy", f"medusa: {path.name} is for hidden size {weight.shape[1]}, {lm.name} has {hidden}")
    vocab = tensors.get("vocab")
    if vocab is not None and (vocab.dim() != 1 or int(vocab.min()) < 0 or int(vocab.max()) >= lm.vocab_size):
        raise ConfigError("strategy", f"medusa: {path.name} has a shortlist outside {lm.name}'s vocabulary")
    heads = MedusaHeads(hidden, weight.shape[0], vocab)
    with torch.no_grad():
        heads.weight.copy_(weight.float())
        heads.bias.copy_(bias.float())
    return heads.to(device=lm.device, dtype=lm.dtype).eval().requires_grad_(False)


def readout(lm_head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head (no bias) over a tree's few rows: [T, H] hidden -> [T, V]. A head whose product is
    packed for oneDNN (the loader's PackedLinear, CPU float32) runs as itself: on the 2-core AMD EPYC
    13 rows take 13.8 ms so against 66 ms as weight @ hidden.T, whose MKL sgemm takes a slow path
    there. Any other head is computed as weight @ hidden.T, which on plain BLAS reads 4-7 rows out
    2-3x faster than nn.Linear (and equals it to float rounding)."""
    if callable(getattr(lm_head, "packed_weight", None)):
        return lm_head(hidden)
    return (lm_head.weight @ hidden.T).T


# --- records ----------------------------------------------------------------------------------
@dataclass
class HeadProposal:
    """Head k's proposal for the token k + 1 after the round's first position: its top candidates
    (after the stage chain) and its top-1."""

    head: int  # 1-based
    token_id: int
    token: str
    candidates: list[TokenProb]


@dataclass
class TreeNode:
    """One node of the round's candidate tree: head ``depth``'s ``rank``-th candidate placed under
    node ``parent`` (-1: the round's first token, the root). ``index`` is the node's place in the
    verify forward (row ``index + 1``; row 0 is the root). ``score``: the product of the head
    probabilities along its path. ``status``: accepted (on the emitted path), rejected (tested
    against the target and refused) or untested (under a node that was never reached)."""

    index: int
    parent: int
    depth: int  # 1-based: the head that proposed it
    rank: int  # 0: the head's top-1
    token_id: int
    token: str
    score: float
    status: str = "untested"


@dataclass(frozen=True)
class TreeShape:
    """Which candidates one round verifies: the best ``nodes`` paths by product of head
    probabilities over each head's top ``width``, leaving out paths whose product is below
    ``min_score`` (a dynamic tree: big where the heads are sure, small where they are not).
    ``width=1`` is the single chain of top-1s."""

    width: int
    nodes: int
    min_score: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.width <= 8:
            raise ConfigError("medusa_tree", f"width {self.width} must be in [1, 8]")
        if not 1 <= self.nodes <= 64:
            raise ConfigError("medusa_tree", f"nodes {self.nodes} must be in [1, 64]")
        if not 0.0 <= self.min_score < 1.0:
            raise ConfigError("medusa_tree", f"min_score {self.min_score} must be in [0, 1)")


CHAIN = TreeShape(width=1, nodes=4)  # each head's top-1, one after another
# Default: a small sparse tree. Measured with the shipped heads on the embedded model (bench/medusa.py,
# 3 prompts, greedy): in float32 on a 2-core CPU, tokens per target forward 1.43 chain, 1.60 (3x6),
# 1.69 (4x10), 1.80 (6x32) at 0.80x, 0.85x, 0.84x, 0.67x target-only: each extra position costs
# compute there, so the tree stays small. In bfloat16 on a CPU with AMX (DP_DTYPE=bfloat16), as on a
# GPU, extra positions are nearly free: 4x10 1.38x, 6x32 1.88 tokens per forward at 1.23x; pick them
# with the medusa_tree_* knobs (medusa_tree_min_score: the dynamic tree).
TREE = TreeShape(width=3, nodes=6)


def shape_of(config: DecodingConfig) -> TreeShape:
    """The tree the config asks for (knobs ``medusa_tree_width`` / ``medusa_tree_nodes``; defaults: TREE).
    Width 1 is the chain of top-1s, at most one node per head."""
    if config.medusa_tree_width == 1:
        return TreeShape(width=1, nodes=min(config.medusa_tree_nodes, config.medusa_heads),
                         min_score=config.medusa_tree_min_score)
    return TreeShape(width=config.medusa_tree_width, nodes=config.medusa_tree_nodes,
                     min_score=config.medusa_tree_min_score)


@dataclass
class MedusaRound(SpecRound):
    """A speculative round whose drafts came from the heads. ``drafted[d]`` is the test at depth
    d + 1 along the walked path (the accepted node, or the last candidate refused there);
    ``proposals`` keeps each head's top candidates, ``tree`` the verified nodes and ``path`` the
    indices of the accepted ones (root to leaf)."""

    proposals: list[HeadProposal] = field(default_factory=list)
    tree: list[TreeNode] = field(default_factory=list)
    path: list[int] = field(default_factory=list)


def rounds_of(trace: Trace) -> list[MedusaRound]:
    """The trace's rounds as MedusaRound records (a trace read back from JSON holds dicts)."""
    return from_dict(list[MedusaRound], trace.rounds or [])


# --- the tree ---------------------------------------------------------------------------------------
def build_tree(proposals: Sequence[HeadProposal], shape: TreeShape, eos_ids: Sequence[int]) -> list[TreeNode]:
    """The best ``shape.nodes`` paths by product of head probabilities, best-first (a child's score
    never exceeds its parent's, so parents always come first: tree order), none scoring below
    ``shape.min_score`` (best-first, so the first such ends the tree; it may be empty: the round
    then verifies the root alone). Candidates with zero probability (masked by the stage chain)
    and children of an end-of-sequence token are skipped."""
    counter = itertools.count()
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, tie-break, parent, depth, rank)

    def push(parent: int, depth: int, score: float) -> None:
        for rank, cand in enumerate(proposals[depth - 1].candidates[: shape.width]):
            if cand.prob > 0:
                heapq.heappush(heap, (-score * cand.prob, next(counter), parent, depth, rank))

    nodes: list[TreeNode] = []
    if proposals:
        push(-1, 1, 1.0)
    while heap and len(nodes) < shape.nodes:
        neg, _, parent, depth, rank = heapq.heappop(heap)
        if -neg < shape.min_score:
            break
        cand = proposals[depth - 1].candidates[rank]
        nodes.append(TreeNode(len(nodes), parent, depth, rank, cand.token_id, cand.token, -neg))
        if depth < len(proposals) and cand.token_id not in eos_ids:
            push(len(nodes) - 1, depth + 1, -neg)
    return nodes


def tree_attention_mask(tree: Sequence[TreeNode], cached: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, T, cached + T] additive mask (0: attend, dtype min: masked), T = 1 + len(tree): every
    row sees the cache; row 0 (the root) sees itself; a node's row sees the root, its ancestors and
    itself, never its siblings or cousins."""
    size = len(tree) + 1
    allowed = torch.zeros(size, size, dtype=torch.bool)
    allowed[:, 0] = True
    for node in tree:  # tree order: the parent's row is complete before the child copies it
        row = node.index + 1
        allowed[row] = allowed[node.parent + 1]
        allowed[row, row] = True
    allowed = torch.cat([torch.ones(size, cached, dtype=torch.bool), allowed], dim=1)
    mask = torch.zeros(size, cached + size, dtype=dtype)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@torch.inference_mode()
def keep_rows(cache, start: int, rows: Sequence[int]) -> None:
    """Keep positions [0, start) and then start + rows (increasing) of every layer of a
    DynamicCache; drop the rest. The verified tree's accepted path becomes a plain sequence: its
    keys and values were computed at its own positions, seeing only its own ancestors."""
    index = torch.tensor(rows, dtype=torch.long) + start
    for layer in cache.layers:
        index = index.to(layer.keys.device)
        layer.keys[..., start: start + len(rows), :] = layer.keys[..., index, :]  # the gather copies first
        layer.values[..., start: start + len(rows), :] = layer.values[..., index, :]
    drop = cache.get_seq_length() - start - len(rows)
    if drop:
        cache.crop(-drop)


# --- the loop ---------------------------------------------------------------------------------
@dataclass
class _HeadsName:
    """The heads as speculative's verifier and summary see a drafter (``speculative.Drafter``): a name
    and their own forwards (none). They draft through ``_MedusaVerifier.propose``, never these."""

    name: str
    forwards: int = 0

    def draft(self, sequence: list[int], k: int, ctx: speculative.DraftContext) -> speculative.Draft:
        raise NotImplementedError("Medusa's heads propose in _MedusaVerifier.propose")

    def rewind_to(self, sequence: list[int]) -> None:
        raise NotImplementedError("Medusa's heads keep no cache of their own")


def heads_name(config: DecodingConfig, shape: TreeShape) -> str:
    kind = "chain" if shape.width == 1 else f"tree of {shape.nodes}"
    kind += f", paths >= {shape.min_score:g}" if shape.min_score else ""
    return f"medusa ({config.medusa_heads} heads, {kind})"


class _MedusaVerifier(speculative._Verifier):
    """speculative's verifier (same trace capture, bonus and emit code) with candidates from the
    heads, verified as a tree in one forward that also returns the final hidden states."""

    def __init__(self, lm: Model, prompt_ids: Sequence[int], config: DecodingConfig, heads: MedusaHeads,
                 shape: TreeShape = TREE):
        self.kv = KVCache(lm.model)  # the target's own cache: the tree's forward feeds it directly
        super().__init__(lm, prompt_ids, config, _HeadsName(heads_name(config, shape)), self.kv)
        self.heads, self.shape = heads, shape
        self.lm_head = lm.model.get_output_embeddings()
        self.hidden: torch.Tensor | None = None  # [H] at the position that produced the last token
        # Llama's logits are exactly lm_head(final hidden): read them out ourselves (``readout``)
        self.plain_readout = type(lm.model).__name__ == "LlamaForCausalLM" and hasattr(lm.model, "model")

    def propose(self, k: int) -> list[HeadProposal]:
        """Each head's top candidates after the stage chain; head i sees the top-1s before it."""
        if self.hidden is None or k <= 0:
            return []
        with torch.inference_mode():
            logits = head_logits(self.heads, self.lm_head, self.hidden, k)  # [k, V]
        tokens: list[int] = []
        proposals = []
        for i in range(k):
            ids = torch.tensor([self.sequence + tokens], dtype=torch.long, device=self.lm.device)
            probs = torch.softmax(self.chain(ids, logits[i: i + 1])[0], dim=-1)  # [V]
            candidates = speculative.top_tokens(probs, max(self.shape.width, CANDIDATES_SHOWN), self.lm.token_text)
            tokens.append(candidates[0].token_id)
            proposals.append(HeadProposal(i + 1, candidates[0].token_id, candidates[0].token, candidates))
        return proposals

    def verify(self, tree: Sequence[TreeNode]) -> tuple[torch.Tensor, torch.Tensor]:
        """ONE target forward over the root and the tree: logits [T, V] and final hidden states
        [T, H], row 0 the root, row i + 1 node i. Positions: cache length + depth."""
        cached = self.cache.length
        fed = torch.tensor([[self.sequence[-1], *(n.token_id for n in tree)]], dtype=torch.long, device=self.lm.device)
        positions = cached + torch.tensor([[0, *(n.depth for n in tree)]], dtype=torch.long, device=self.lm.device)
        mask = tree_attention_mask(tree, cached, self.lm.dtype).to(self.lm.device)
        kwargs = dict(input_ids=fed, attention_mask=mask, position_ids=positions, past_key_values=self.kv.cache,
                      use_cache=True)
        with torch.inference_mode():
            if self.plain_readout:
                hidden = self.lm.model.model(**kwargs).last_hidden_state[0]  # [T, H], after the final norm
                logits = readout(self.lm_head, hidden)
            else:
                out = self.lm.model(**kwargs, logits_to_keep=0, output_hidden_states=True)
                logits, hidden = out.logits[0], out.hidden_states[-1][0]
        self.cache.forwards += 1
        return logits.float(), hidden

    def walk(self, tree: list[TreeNode], logits: torch.Tensor
             ) -> tuple[list[DraftToken], list[tuple[int, Traced]], ExtraToken | None, list[int]]:
        """From the root down: test the node's children against the target's distribution there
        (``test_children``); descend into the accepted one, else end with the target's token (a
        leaf: the bonus). Returns the per-depth records, the emitted (token, traced) pairs, the
        bonus, and the accepted node indices."""
        drafted: list[DraftToken] = []
        emitted: list[tuple[int, Traced]] = []
        path: list[int] = []
        at = -1
        while True:
            history = self.sequence + [tree[i].token_id for i in path]
            ids = torch.tensor([history], dtype=torch.long, device=self.lm.device)
            traced = self.chain.traced(ids, logits[at + 1: at + 2], self.config.top_n, self.lm.token_text)
            sampling.ensure_tokens(traced.logits)
            children = [n for n in tree if n.parent == at]
            if not children:
                bonus = self._extra("bonus", traced)
                emitted.append((bonus.token_id, traced))
                return drafted, emitted, bonus, path
            record, child = self.test_children(len(drafted), children, traced)
            drafted.append(record)
            if child is None:
                assert record.resampled is not None  # every child refused: the target's token was drawn
                emitted.append((record.resampled.token_id, traced))
                return drafted, emitted, None, path
            emitted.append((child.token_id, traced))
            path.append(child.index)
            at = child.index

    def test_children(self, depth: int, children: list[TreeNode], traced: Traced) -> tuple[DraftToken, TreeNode | None]:
        """Test a node's children (each a point-mass draft) against the target's p there.
        Greedy: the child equal to the target's argmax, if any. Sampling: children in rank order,
        each accepted with probability r(x), where r starts as p and after each refusal becomes
        normalise(max(0, r - onehot(x))) (speculative's residual with q a point mass); after the
        last refusal the target's token is drawn from r. Every token's total probability is then
        exactly p(x) (the chain, one child, is speculative's rule as it is)."""
        p = traced.final_probs  # [V]
        if self.generator is None:
            best = sampling.greedy(traced.logits).token_id  # as decode's greedy pick
            for child in children:
                child.status = "accepted" if child.token_id == best else "rejected"
            match = next((c for c in children if c.token_id == best), None)
            found = match is not None
            return self._draft_record(depth, match or children[0], traced, float(found), None, found, p), match
        residual = p
        for child in children:
            accept_prob = float(residual[child.token_id])
            u = float(torch.rand(1, generator=self.generator, device=self.generator.device))
            child.status = "accepted" if u < accept_prob else "rejected"
            if u < accept_prob:
                return self._draft_record(depth, child, traced, accept_prob, u, True, residual), child
            point = torch.nn.functional.one_hot(torch.tensor(child.token_id), p.shape[0]).to(p.device, p.dtype)
            residual = speculative.residual_distribution(residual, point)
        return self._draft_record(depth, children[-1], traced, accept_prob, u, False, residual), None

    def _draft_record(self, depth: int, node: TreeNode, traced: Traced, accept_prob: float, u: float | None,
                      accepted: bool, residual: torch.Tensor) -> DraftToken:
        """The DraftToken of ``node`` (q: a point mass on it); a refusal draws the target's token
        from ``residual`` (greedy: the argmax of p)."""
        x, top_n, p = node.token_id, self.config.top_n, traced.final_probs
        record = DraftToken(
            position=depth, token_id=x, token=node.token, q=1.0, p=float(p[x]), accept_prob=accept_prob, u=u,
            accepted=accepted, q_top=[TokenProb(x, node.token, 1.0)],
            p_top=speculative.top_tokens(p, top_n, self.lm.token_text),
        )
        if not accepted:
            record.resampled = self._extra("resampled", traced, residual)
        return record

    def medusa_round(self, index: int) -> MedusaRound:
        remaining = self.config.max_new_tokens - len(self.generated)
        t0 = time.perf_counter()
        proposals = self.propose(min(self.config.medusa_heads, self.heads.num_heads, remaining - 1))
        tree = build_tree(proposals, self.shape, self.lm.eos_token_ids)
        t1 = time.perf_counter()
        cached = self.cache.length
        logits, hidden = self.verify(tree)  # [T, V], [T, H]
        t2 = time.perf_counter()
        drafted, emitted, bonus, path = self.walk(tree, logits)
        self.hidden = hidden[path[-1] + 1 if path else 0]  # the position that chose the round's last token
        start = len(self.generated)
        steps, reason = self._emit(emitted)
        t3 = time.perf_counter()
        kept = len(self.sequence) - 1 - cached  # the root and the accepted nodes emitted before a stop
        keep_rows(self.kv.cache, cached, [0, *(i + 1 for i in path)][:kept])
        self.cache.tokens = list(self.sequence[:-1])
        ids = self.generated[start:]
        return MedusaRound(
            index=index, start=start, k=len(tree), drafted=drafted, num_accepted=len(path), bonus=bonus,
            emitted_token_ids=ids, emitted_text=self.lm.decode(ids), draft_ms=(t1 - t0) * 1000,
            verify_ms=(t2 - t1) * 1000, elapsed_ms=self.elapsed_ms(), finish_reason=reason, steps=steps,
            capture_ms=(t3 - t2) * 1000, prefill_ms=self.prefill_ms if index == 0 else 0.0, proposals=proposals,
            tree=tree, path=path,
        )


def rounds(lm: Model, prompt_ids: Sequence[int], config: DecodingConfig, heads: MedusaHeads,
           control: RunControl | None = None, shape: TreeShape | None = None) -> Iterator[MedusaRound]:
    """Yield MedusaRounds until EOS, a stop string or max_new_tokens (``control`` checked per forward).
    ``shape``: default the config's tree (``shape_of``)."""
    check_prompt(prompt_ids)
    verifier = _MedusaVerifier(lm, prompt_ids, config, heads, shape if shape is not None else shape_of(config))
    index = 0
    while True:
        check(control)
        medusa_round = verifier.medusa_round(index)
        paused = time.perf_counter()
        yield medusa_round
        verifier.paused_s += time.perf_counter() - paused  # a UI drawing the round is not Medusa's time
        if medusa_round.finish_reason is not None:
            return
        index += 1


def assemble(lm: Model, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig,
             collected: Sequence[MedusaRound], chat: bool, shape: TreeShape = TREE) -> Trace:
    """The Trace: steps in ``steps``, rounds (without their steps) in ``rounds``, speculative's
    summary (``tokens_per_target_forward``...) plus the heads' per-head acceptance."""
    trace = speculative.assemble(lm, prompt, prompt_ids, config, collected, _HeadsName(heads_name(config, shape)), chat)
    trace.summary |= {"heads": config.medusa_heads, "head_acceptance": head_acceptance(collected),
                      "tree_width": shape.width, "tree_nodes": shape.nodes, "tree_min_score": shape.min_score,
                      "mean_tree_nodes": statistics.fmean(len(r.tree) for r in collected) if collected else 0.0}
    return trace


def head_acceptance(collected: Sequence[SpecRound]) -> list[float]:
    """Per depth k, the share of rounds that tested depth k in which a head-k candidate was accepted."""
    width = max((len(r.drafted) for r in collected), default=0)
    out = []
    for k in range(width):
        tested = [r.drafted[k] for r in collected if len(r.drafted) > k]
        out.append(sum(d.accepted for d in tested) / len(tested))
    return out


def stream(lm: Model, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, *, chat: bool = False,
           control: RunControl | None = None, heads: MedusaHeads | None = None,
           compare_baseline: bool = False, shape: TreeShape | None = None) -> Iterator[Event]:
    """One Event per round (steps: its tokens; record: the MedusaRound); the last holds the Trace.
    ``heads``: default the trained heads of ``lm`` (engine/assets); ``shape``: the verified tree
    (``CHAIN`` for each head's top-1; default: the config's ``medusa_tree_*`` knobs). ``compare_baseline`` also times target-only decoding of the
    same knobs in this process (summary ``speedup``). A step with nothing left to pick ends the run
    (stop_reason "no_tokens_left")."""
    heads = heads if heads is not None else load_heads(lm)
    shape = shape if shape is not None else shape_of(config)
    collected, ended = [], False
    try:
        for medusa_round in rounds(lm, prompt_ids, config, heads, control, shape):
            collected.append(medusa_round)
            yield Event(steps=list(medusa_round.steps), record=medusa_round)
    except sampling.NoTokensLeft:  # as speculative's stream: the run ends, saying why
        ended = True
    trace = assemble(lm, prompt, prompt_ids, config, collected, chat, shape)
    if ended:
        trace.end_with_no_tokens_left()
    if compare_baseline:
        trace.summary |= speculative.compare_with_baseline(lm, prompt, config, trace, chat, control=control)
    yield Event(trace=trace)


# --- the strategy -------------------------------------------------------------------------------------
def run(ctx: RunContext) -> Iterator[Event]:
    """Medusa on a model loaded here (``engine.runner.stream``; it checks the control every round)."""
    yield from stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat, control=ctx.control,
                      compare_baseline=ctx.compare_baseline)


register(StrategySpec(
    "medusa", run, records={"rounds": list[MedusaRound]}, needs=("hidden_states",),
    needs_why="needs the model's hidden states for its heads",
    doc="Extra heads propose the next tokens; the target verifies a tree of them in one forward.",
    knobs=(
        Knob("medusa_heads", "int", 3, 1, 4, doc="Medusa: heads whose candidates are verified per forward (the tree's "
             "depth).", step=1),
        Knob("medusa_tree_width", "int", 3, 1, 8, doc="Medusa: candidates per head in the verified tree (1 = the chain "
             "of each head's top-1).", step=1),
        Knob("medusa_tree_nodes", "int", 6, 1, 64, doc="Medusa: tree nodes verified in one forward (the best paths by "
             "product of head probabilities).", step=1),
        Knob("medusa_tree_min_score", "float", 0.0, 0.0, 0.5, doc="Medusa: dynamic tree: verify only candidates whose "
             "path probability (product of head probabilities) is at least this; 0 = always the full tree.",
             step=0.005),
    )))
