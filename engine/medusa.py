"""Medusa decoding: extra heads on the target's last hidden state propose the next few tokens, and
the target verifies all of them in ONE forward with the speculative module's exact rules.

Heads (Medusa-1): head k (k = 1..K) maps the final, normalised hidden state h_j [H] at position j
to ``h + SiLU(W_k h + b_k)`` and reads it out with the base model's own LM head, predicting the
token k + 1 positions ahead (the base head predicts the next one). Each head adds H² + H
parameters; W_k starts at zero, so an untrained head equals the base head.

Round (the candidates are a single chain, each head's top-1; no tree attention): the cache holds
the sequence minus its last token t, and the heads have read h at t's position. Feed
[t, d_1, ..., d_K] in one forward; position i's logits test d_{i+1} exactly as a speculative
round tests a draft (greedy: accept while d equals the target's argmax; sampling: accept with
probability p(d), the draft being a point mass q, else resample from normalise(max(0, p - q)));
the target's token at the first rejection (or the bonus after all K) ends the round. The hidden
state at that last accepted position feeds the heads for the next round, and the cache is cropped
back past the rejected drafts, never recomputed. So every round emits 1 + accepted tokens for one
target forward, and greedy Medusa equals target greedy token for token.

``stream`` yields an Event per round (record: a ``MedusaRound``, a SpecRound plus the heads'
top candidates); the last event holds the Trace, with ``rounds`` and
``summary["tokens_per_target_forward"]`` as speculative traces have them.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from . import speculative
from .config import ConfigError, DecodingConfig
from .control import RunControl, check
from .core import check_prompt
from .models import LoadedModel
from .speculative import Draft, SpecRound
from .trace import Event, TokenProb, Trace, from_dict

ASSETS = Path(__file__).resolve().parent / "assets"
CANDIDATES_SHOWN = 3  # per head, in the record (the chain itself uses the top-1)


# --- the heads ------------------------------------------------------------------------------------
class MedusaHeads(nn.Module):
    """K residual blocks over the hidden size H: ``h + SiLU(W_k h + b_k)``."""

    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden, hidden))  # [K, H_out, H_in]
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden))  # [K, H]

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., K, H]: each head's hidden state, to be read out by the LM head."""
        z = torch.einsum("...i,koi->...ko", hidden, self.weight) + self.bias
        return hidden.unsqueeze(-2) + nn.functional.silu(z)


def head_logits(heads: MedusaHeads, lm_head: nn.Module, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
    """[..., H] -> [..., K, V]: all heads read out in ONE matmul with the base LM head (on CPU
    the LM head's weight read dominates, so reading it once for every head matters)."""
    states = heads(hidden)
    if num_heads is not None:
        states = states[..., :num_heads, :]
    return lm_head(states).float()  # the heads share the model's dtype (load_heads)


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
    save_file(tensors, str(path), metadata={k: str(v) for k, v in meta.items()})
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_suffix(".sha256").write_text(f"{digest}  {path.name}\n")
    return digest


def load_heads(lm: LoadedModel, path: Path | None = None) -> MedusaHeads:
    """The trained heads for ``lm`` (checksum verified), in the model's dtype and device."""
    path = path or heads_path(lm.name)
    if not path.is_file():
        raise ConfigError("strategy", f"medusa: no trained heads for {lm.name} (expected {path.name}); "
                                      f"train them with python -m engine.medusa_train --model <source>")
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
    heads = MedusaHeads(hidden, weight.shape[0])
    with torch.no_grad():
        heads.weight.copy_(weight.float())
        heads.bias.copy_(bias.float())
    return heads.to(device=lm.device, dtype=lm.dtype).eval().requires_grad_(False)


# --- records ----------------------------------------------------------------------------------
@dataclass
class HeadProposal:
    """Head k's proposal for the token k + 1 after the round's first position: its top candidates
    (after the stage chain) and the one put in the chain (its top-1)."""

    head: int  # 1-based
    token_id: int
    token: str
    candidates: list[TokenProb]


@dataclass
class MedusaRound(SpecRound):
    """A speculative round whose drafts came from the heads (``drafted[i]`` tests head i + 1's
    token); ``proposals`` keeps each head's top candidates for the view."""

    proposals: list[HeadProposal] = field(default_factory=list)


def rounds_of(trace: Trace) -> list[MedusaRound]:
    """The trace's rounds as MedusaRound records (a trace read back from JSON holds dicts)."""
    return [r if isinstance(r, MedusaRound) else from_dict(MedusaRound, r) for r in trace.rounds or []]


# --- the loop ---------------------------------------------------------------------------------
@dataclass
class _HeadsName:
    """What speculative's summary asks of a drafter: a name and its own forwards (none)."""

    name: str
    forwards: int = 0


class _MedusaVerifier(speculative._Verifier):
    """speculative's verifier (same acceptance, residual, bonus and emit code) with drafts from
    the heads and the verify forward also returning the final hidden states."""

    def __init__(self, lm: LoadedModel, prompt_ids: Sequence[int], config: DecodingConfig, heads: MedusaHeads):
        super().__init__(lm, prompt_ids, config, _HeadsName(f"medusa ({config.medusa_heads} heads)"), None)
        self.heads = heads
        self.lm_head = lm.model.get_output_embeddings()
        self.hidden: torch.Tensor | None = None  # [H] at the position that produced the last token

    def propose(self, k: int) -> list[HeadProposal]:
        """Each head's top-1 after the stage chain, as a chain: head i sees the drafts before it."""
        if self.hidden is None or k <= 0:
            return []
        with torch.inference_mode():
            logits = head_logits(self.heads, self.lm_head, self.hidden, k)  # [k, V]
        tokens: list[int] = []
        proposals = []
        for i in range(k):
            ids = torch.tensor([self.sequence + tokens], dtype=torch.long, device=self.lm.device)
            probs = torch.softmax(self.chain(ids, logits[i: i + 1])[0], dim=-1)  # [V]
            candidates = speculative.top_tokens(probs, CANDIDATES_SHOWN, self.lm.token_text)
            tokens.append(candidates[0].token_id)
            proposals.append(HeadProposal(i + 1, candidates[0].token_id, candidates[0].token, candidates))
        return proposals

    def medusa_round(self, index: int) -> MedusaRound:
        remaining = self.config.max_new_tokens - len(self.generated)
        t0 = time.perf_counter()
        proposals = self.propose(min(self.config.medusa_heads, self.heads.num_heads, remaining - 1))
        tokens = speculative.cut_at_eos(Draft([p.token_id for p in proposals]), self.lm.eos_token_ids).tokens
        proposals = proposals[: len(tokens)]
        t1 = time.perf_counter()
        fed = torch.tensor([[self.sequence[-1], *tokens]], dtype=torch.long)
        out = self.cache.forward(fed, all_logits=True, output_hidden_states=True)
        logits = out.logits[0].float()  # [K+1, V]
        t2 = time.perf_counter()
        drafted, emitted, bonus = self._accept(Draft(tokens), logits)  # q: a point mass on each draft
        accepted = sum(d.accepted for d in drafted)
        self.hidden = out.hidden_states[-1][0, accepted]  # [H]: the position that chose the round's last token
        start = len(self.generated)
        steps, reason = self._emit(emitted)
        t3 = time.perf_counter()
        self.cache.rewind(self.cache.length - (len(self.sequence) - 1))  # drop the rejected drafts
        ids = self.generated[start:]
        return MedusaRound(
            index=index, start=start, k=len(tokens), drafted=drafted, num_accepted=accepted, bonus=bonus,
            emitted_token_ids=ids, emitted_text=self.lm.decode(ids), draft_ms=(t1 - t0) * 1000,
            verify_ms=(t2 - t1) * 1000, elapsed_ms=self.elapsed_ms(), finish_reason=reason, steps=steps,
            capture_ms=(t3 - t2) * 1000, prefill_ms=self.prefill_ms if index == 0 else 0.0, proposals=proposals,
        )


def rounds(lm: LoadedModel, prompt_ids: Sequence[int], config: DecodingConfig, heads: MedusaHeads,
           control: RunControl | None = None) -> Iterator[MedusaRound]:
    """Yield MedusaRounds until EOS, a stop string or max_new_tokens (``control`` checked per forward)."""
    check_prompt(prompt_ids)
    verifier = _MedusaVerifier(lm, prompt_ids, config, heads)
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


def assemble(lm: LoadedModel, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig,
             collected: Sequence[MedusaRound], chat: bool) -> Trace:
    """The Trace: steps in ``steps``, rounds (without their steps) in ``rounds``, speculative's
    summary (``tokens_per_target_forward``...) plus the heads' per-head acceptance."""
    trace = speculative.assemble(lm, prompt, prompt_ids, config, collected,
                                 _HeadsName(f"medusa ({config.medusa_heads} heads)"), chat)
    trace.summary |= {"heads": config.medusa_heads, "head_acceptance": head_acceptance(collected)}
    return trace


def head_acceptance(collected: Sequence[SpecRound]) -> list[float]:
    """Per head k, the share of rounds in which head k's token was proposed and accepted."""
    width = max((len(r.drafted) for r in collected), default=0)
    out = []
    for k in range(width):
        tested = [r.drafted[k] for r in collected if len(r.drafted) > k]
        out.append(sum(d.accepted for d in tested) / len(tested))
    return out


def stream(lm: LoadedModel, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, *, chat: bool = False,
           control: RunControl | None = None, heads: MedusaHeads | None = None,
           compare_baseline: bool = False) -> Iterator[Event]:
    """One Event per round (steps: its tokens; record: the MedusaRound); the last holds the Trace.
    ``heads``: default the trained heads of ``lm`` (engine/assets). ``compare_baseline`` also
    times target-only decoding of the same knobs in this process (summary ``speedup``)."""
    heads = heads if heads is not None else load_heads(lm)
    collected = []
    for medusa_round in rounds(lm, prompt_ids, config, heads, control):
        collected.append(medusa_round)
        yield Event(steps=list(medusa_round.steps), record=medusa_round)
    trace = assemble(lm, prompt, prompt_ids, config, collected, chat)
    if compare_baseline:
        trace.summary |= speculative.compare_with_baseline(lm, prompt, config, trace, chat, control=control)
    yield Event(trace=trace)


def run(lm: LoadedModel, prompt: str, prompt_ids: Sequence[int] | None, config: DecodingConfig, *, chat: bool = False,
        control: RunControl | None = None, heads: MedusaHeads | None = None, compare_baseline: bool = False) -> Trace:
    """``stream`` collected: the whole Trace."""
    ids = list(prompt_ids) if prompt_ids is not None else lm.encode(prompt, chat)
    for event in stream(lm, prompt, ids, config, chat=chat, control=control, heads=heads,
                        compare_baseline=compare_baseline):
        if event.trace is not None:
            return event.trace
    raise RuntimeError("medusa: the stream ended without a trace")
