"""The logit lens for one step of a run (issue #54; nostalgebraist 2020): the next-token
distribution read out at every layer, by applying the model's final norm and LM head to that
layer's residual stream at the step's position.

One forward of the step's prefix (the prompt and the tokens generated before the step, no cache)
with ``output_hidden_states``; only the last position of each layer is kept, and only for the step
asked about, never for a whole run. Read-out ``l`` (0 = the embeddings, L = the last layer) is
``softmax(head(norm(h_l)))``. transformers hands ``hidden_states[-1]`` out *after* the final norm
(it is tied to ``last_hidden_state``), so the last layer's residual is taken at the norm's input (a
forward pre-hook) instead: the norm is applied once to every layer, and read-out L is the model's
own logits, bit for bit (``last_matches_logits``; tests/engine/test_inside.py checks it and the trace's
raw stage). A served model has no hidden states: ``require_lens`` says so in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from engine.chain import entropy_rows
from engine.config import ConfigError
from engine.control import RunControl, check
from engine.trace import TokenProb, Trace

NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm")  # the final norm in transformers' models
MAX_LENS_TOP = 20


@dataclass
class LensLayer:
    layer: int  # 0: the embeddings; L: after the last decoder layer
    entropy: float  # nats, over the whole vocabulary
    chosen_rank: int  # 1 = the most likely token at this layer
    chosen_prob: float
    top: list[TokenProb]


@dataclass
class LogitLens:
    """Every layer's read-out at one step. ``first_in_top``: the first layer at which the chosen
    token is among the top ``top_k`` (None: never); ``stays_in_top``: the first from which it stays
    there to the last layer; ``first_top1``: the first from which it stays the most likely token.
    ``raw_max_diff``:
    the largest |p| difference between the last read-out and the trace's raw stage over that
    stage's top tokens (None without a trace)."""

    model: str
    step: int
    position: int  # tokens before the step (prompt + generated), the read position is position - 1
    chosen_token_id: int
    chosen_token: str
    top_k: int
    layers: list[LensLayer] = field(default_factory=list)
    first_in_top: int | None = None
    stays_in_top: int | None = None
    first_top1: int | None = None
    last_matches_logits: bool = False
    raw_max_diff: float | None = None

    def sentence(self) -> str:
        """What the chart shows, in one sentence from the same numbers."""
        last = self.layers[-1]
        token = repr(self.chosen_token)
        if self.first_in_top is None:
            where = f"never enters the top {self.top_k}"
        elif self.stays_in_top == self.first_in_top:
            where = f"enters the top {self.top_k} at layer {self.first_in_top} of {last.layer} and stays"
        else:
            stays = "" if self.stays_in_top is None else f", for good from layer {self.stays_in_top}"
            where = f"first enters the top {self.top_k} at layer {self.first_in_top} of {last.layer}{stays}"
        top1 = "" if self.first_top1 is None else f"; it is the most likely token from layer {self.first_top1}"
        return (f"Step {self.step}: {token} {where}{top1}; at the last layer its rank is {last.chosen_rank} "
                f"(p {last.chosen_prob:.3f}); the read-out's entropy is {self.layers[0].entropy:.2f} nats at "
                f"the embeddings and {last.entropy:.2f} at the last layer.")


def require_lens(lm: Any) -> None:
    """ConfigError naming ``model`` when ``lm`` has no hidden states to read (a served model: its
    API hands out a top-N per position), asked of its capabilities, never of its class."""
    if not lm.capabilities.hidden_states:
        raise ConfigError("model", "logit lens: not available for a served model (it needs every layer's hidden "
                                   "state, which a server's API does not hand out)")


def final_norm(model: Any) -> torch.nn.Module:
    """The model's final norm (before the LM head); ConfigError when none of ``NORM_NAMES`` is found."""
    base = getattr(model, "base_model", model)
    for name in NORM_NAMES:
        module = getattr(base, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise ConfigError("model", f"logit lens: no final norm found on {type(base).__name__} "
                               f"(looked for {', '.join(NORM_NAMES)})")


@torch.inference_mode()
def layer_logits(lm: Any, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(read-outs [L + 1, V] float32 at the last position of ``ids``, the model's own logits [V]
    there), from one forward with ``output_hidden_states``."""
    model = lm.model
    norm, head = final_norm(model), model.get_output_embeddings()
    captured: dict[str, torch.Tensor] = {}

    def keep_input(module: Any, args: tuple) -> None:  # the last layer's residual, before the final norm
        captured["last"] = args[0]

    hook = norm.register_forward_pre_hook(keep_input)
    try:
        out = model(input_ids=torch.tensor([list(ids)], device=lm.device), use_cache=False,
                    output_hidden_states=True, logits_to_keep=1)
    finally:
        hook.remove()
    states = [h[:, -1:] for h in out.hidden_states[:-1]]  # [1, 1, H] each: the embeddings, layers 1..L-1
    last = norm(captured["last"])[:, -1:]  # the norm on the whole sequence, as the model ran it
    rows = [head(norm(s)) for s in states] + [head(last)]
    return torch.cat(rows, dim=1)[0].float(), out.logits[0, -1].float()


def check_step(trace: Trace, step: Any) -> int:
    """``step`` as an index into ``trace.steps``; ConfigError naming ``step`` otherwise."""
    n = len(trace.steps)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < n:
        raise ConfigError("step", f"expected a step number in [0, {n - 1}], got {step!r:.40}" if n else
                          "this trace has no steps")
    return step


def check_top_k(top_k: Any) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_LENS_TOP:
        raise ConfigError("top_k", f"expected an integer in [1, {MAX_LENS_TOP}], got {top_k!r:.40}")
    return top_k


def logit_lens(lm: Any, prompt_ids: Sequence[int], generated_ids: Sequence[int], step: int, top_k: int = 10, *,
               control: RunControl | None = None) -> LogitLens:
    """The read-out of every layer at the position that picked ``generated_ids[step]`` (the token
    the lens follows)."""
    return _lens(lm, prompt_ids, generated_ids, step, top_k, control)[0]


def _lens(lm: Any, prompt_ids: Sequence[int], generated_ids: Sequence[int], step: int, top_k: int,
          control: RunControl | None) -> tuple[LogitLens, torch.Tensor]:
    """``logit_lens`` and the last read-out's probabilities [V]."""
    require_lens(lm)
    top_k = check_top_k(top_k)
    prefix = [*prompt_ids, *generated_ids[:step]]
    chosen = int(generated_ids[step])
    check(control)
    reads, logits = layer_logits(lm, prefix)
    check(control)
    probs = torch.softmax(reads, dim=-1)  # [L + 1, V]
    entropy = entropy_rows(probs).tolist()
    chosen_p = probs[:, chosen]
    ranks = ((probs > chosen_p[:, None]).sum(-1) + 1).tolist()  # 1-based; ties rank the token first
    values, ids = torch.topk(probs, top_k, dim=-1)
    lens = LogitLens(getattr(lm, "name", ""), step, len(prefix), chosen, lm.token_text(chosen), top_k,
                     last_matches_logits=bool(torch.equal(reads[-1], logits)))
    for layer, (row_ids, row_p) in enumerate(zip(ids.tolist(), values.tolist())):
        lens.layers.append(LensLayer(layer, entropy[layer], ranks[layer], float(chosen_p[layer]),
                                     [TokenProb(t, lm.token_text(t), p) for t, p in zip(row_ids, row_p)]))
    lens.first_in_top = next((layer for layer, rank in enumerate(ranks) if rank <= top_k), None)
    lens.stays_in_top = _first_from(ranks, top_k)
    lens.first_top1 = _first_from(ranks, 1)
    return lens, probs[-1]


def _first_from(ranks: list[int], k: int) -> int | None:
    """The first layer from which every rank is <= k (None when the last is not)."""
    first = None
    for layer, rank in enumerate(ranks):
        if rank <= k:
            first = layer if first is None else first
        else:
            first = None
    return first


def trace_lens(lm: Any, trace: Trace, step: Any, top_k: int = 10, *, control: RunControl | None = None) -> LogitLens:
    """``logit_lens`` at step ``step`` of ``trace`` (its prompt and generated ids), with the last
    read-out compared to that step's recorded raw stage (``raw_max_diff``, over its top tokens)."""
    step = check_step(trace, step)
    lens, last = _lens(lm, trace.prompt_token_ids, trace.generated_token_ids, step, top_k, control)
    stages = trace.steps[step].stages
    if stages and stages[0].top:
        lens.raw_max_diff = max(abs(float(last[t.token_id]) - t.prob) for t in stages[0].top)
    return lens
