"""Truncation stages: they keep a set of tokens and remove the rest (-inf): top-k, top-p, min-p,
typical, epsilon, top-nσ, eta, top-a, top-H."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from transformers.generation import logits_process as tlp

from engine.stages.spec import (Export, Interop, Knob, StageSpec, param,
                                register, truncation_note)
from engine.stages.spec import STEP_SPREAD, STEP_TAIL, Served, same_fields
from engine.stages.base import Stage, Wrapped, require, softmax

if TYPE_CHECKING:
    from engine.trace import StageTrace


class TopK(Wrapped):
    name = "top_k"

    def __init__(self, top_k: int):
        require(isinstance(top_k, int) and top_k > 0, "top_k", top_k, "integers >= 1")
        super().__init__(tlp.TopKLogitsWarper(top_k=top_k), top_k=top_k)


register(StageSpec(
    "top_k", order=130, sampling_only=True, shareable=True, group="truncation", label="top-k",
    knobs=(Knob("top_k", "int", 0, 0, 100_000, doc="Keep the k most probable tokens. 0 = disabled.", step=1,
                widget="number"),),
    build=lambda c, ctx: TopK(c.top_k),
    note=truncation_note,
    heading=lambda s: f"top-k: keep the top {param(s, 'top_k')}",
    interop=Interop("TopKLogitsWarper", webui=Export("top_k", knobs=("top_k",)), llama=Export("top_k", flag="--top-k")),
    oracle="tests/engine/test_processors.py::test_stage_equals_transformers_processor",
    served=Served(same_fields("top_k"), lambda c: {"top_k": c.top_k or -1})  # OpenAI's "off" is -1, ours 0,
))


class TopP(Wrapped):
    """transformers' ``TopPLogitsWarper``, without its full sort of the vocabulary where the answer
    is certain from the top candidates (``top_p_fast``): the same tensor, bit for bit."""

    name = "top_p"

    def __init__(self, top_p: float):
        require(0 < top_p <= 1, "top_p", top_p, "(0, 1]")
        super().__init__(tlp.TopPLogitsWarper(top_p=top_p), top_p=top_p)

    def apply(self, input_ids, logits):
        return top_p_fast(input_ids, logits, self.knobs["top_p"], self._processor), {}


register(StageSpec(
    "top_p", order=140, sampling_only=True, shareable=True, group="truncation", label="top-p",
    knobs=(Knob("top_p", "float", 1.0, 0.0, 1.0, low_open=True, doc="Keep the smallest set whose mass reaches p. "
                "1 = disabled.", step=0.01),),
    build=lambda c, ctx: TopP(c.top_p),
    note=truncation_note,
    heading=lambda s: f"top-p: keep the top {param(s, 'top_p')} of the mass",
    interop=Interop("TopPLogitsWarper", webui=Export("top_p", knobs=("top_p",)), llama=Export("top_p", flag="--top-p")),
    oracle="tests/engine/test_processors.py::test_stage_equals_transformers_processor "
           "tests/engine/test_processors.py::test_top_p_fast_path_equals_transformers_bit_for_bit",
    served=Served(same_fields("top_p"), same_fields("top_p"), step_caveats=(STEP_TAIL,)),
))


TOP_P_FLOOR = 1e-6  # the fast path sorts only the tokens at least this likely


def top_p_fast(input_ids: torch.Tensor, logits: torch.Tensor, top_p: float, oracle: Callable,
               floor: float = TOP_P_FLOOR) -> torch.Tensor:
    """``oracle(input_ids, logits)`` (transformers' top-p: sort the whole row ascending, remove the
    tokens whose float32 cumulative probability is <= 1 - top_p, keep at least one) computed by
    sorting only the row's tokens of probability >= ``floor`` where that gives the same answer
    (on the embedded model a row has a few to a few hundred such tokens: 3x faster on 4 rows).

    A token is kept iff the probability of the tokens above it is < top_p. In float64 over the
    candidates that boundary is exact, and every token below ``floor`` is below the first removed
    token, so removed too (when every candidate is kept, the first token below the floor has all
    of their mass above it). transformers' float32 cumsum over V sorted values can be off by at
    most about V * 2^-24 * (its running sum there) (first-order bound of a sum in any order; the
    softmax's normaliser, a sum too, scales every probability by at most as much). A row takes
    this path only when both tokens beside the boundary are further than twice that bound from
    top_p and are not tied (a tie's order is the sort's choice); other rows (NaN, +inf, all -inf,
    top_p near 1) go to ``oracle``, and so does everything off the CPU. Shapes: logits [B, V] ->
    [B, V], a new tensor."""
    vocab = logits.shape[-1]
    if top_p >= 0.999 or logits.dtype != torch.float32 or logits.device.type != "cpu":
        return oracle(input_ids, logits)  # a GPU sorts [B, V] in well under a millisecond; row loops sync
    probs = torch.softmax(logits.double(), dim=-1)  # [B, V]
    out = torch.full_like(logits, -float("inf"))
    slow: list[int] = []
    bad = (torch.isnan(logits) | (logits == float("inf"))).any(dim=-1).tolist()
    for b in range(logits.shape[0]):
        index = (probs[b] >= floor).nonzero().squeeze(1) if not bad[b] else None
        if index is None or len(index) == 0 or len(index) > vocab // 2:  # a flat row: sorting it all is as cheap
            slow.append(b)
            continue
        top, order = torch.sort(probs[b, index], descending=True)
        above = top.cumsum(dim=0) - top  # mass strictly above each candidate
        n_keep = int((above < top_p).sum())
        kept = index[order[:n_keep]]
        above_last = float(above[n_keep - 1])
        if n_keep < len(index):  # the first removed token is a candidate
            above_out = float(above[n_keep])
            tied = bool(logits[b, kept[-1]] == logits[b, index[order[n_keep]]])
        else:  # every candidate kept: the first token below the floor has all their mass above it
            above_out, tied = float(top.sum()), False  # (strictly less likely, so never tied)
        bound = 2 * (vocab * 2.0 ** -24 * (1 - above_last) + 1e-6)  # |float32 cumsum - exact|, doubled
        if top_p - above_last <= bound or above_out - top_p <= bound or tied:
            slow.append(b)
            continue
        out[b, kept] = logits[b, kept]
    if slow:
        rows = torch.tensor(slow, device=logits.device)
        out[rows] = oracle(input_ids, logits[rows])  # top-p ignores the ids
    return out


class MinP(Wrapped):
    name = "min_p"

    def __init__(self, min_p: float):
        require(0 <= min_p <= 1, "min_p", min_p, "[0, 1]")
        super().__init__(tlp.MinPLogitsWarper(min_p=min_p), min_p=min_p)


register(StageSpec(
    "min_p", order=150, sampling_only=True, shareable=True, group="truncation", label="min-p",
    knobs=(Knob("min_p", "float", 0.0, 0.0, 1.0, doc="Drop tokens below min_p x the top probability. 0 = disabled.",
                step=0.01),),
    build=lambda c, ctx: MinP(c.min_p),
    note=truncation_note,
    heading=lambda s: f"min-p: drop p below {param(s, 'min_p')} × the top p",
    interop=Interop("MinPLogitsWarper", webui=Export("min_p", knobs=("min_p",)), llama=Export("min_p", flag="--min-p")),
    oracle="tests/engine/test_processors.py::test_stage_equals_transformers_processor",
    served=Served(same_fields("min_p"), same_fields("min_p")),
))


class TypicalP(Wrapped):
    name = "typical_p"

    def __init__(self, typical_p: float):
        require(0 < typical_p < 1, "typical_p", typical_p, "(0, 1)")
        super().__init__(tlp.TypicalLogitsWarper(mass=typical_p), typical_p=typical_p)


register(StageSpec(
    "typical_p", order=160, sampling_only=True, shareable=True, group="truncation", label="typical-p",
    knobs=(Knob("typical_p", "float", 1.0, 0.0, 1.0, low_open=True, doc="Locally typical sampling mass. 1 = disabled.",
                step=0.01),),
    build=lambda c, ctx: TypicalP(c.typical_p),
    note=truncation_note,
    heading=lambda s: f"typical-p: keep {param(s, 'typical_p')} of the mass nearest typical",
    interop=Interop("TypicalLogitsWarper", webui=Export("typical_p", knobs=("typical_p",)),
                    llama=Export("typ_p", flag="--typical")),
    oracle="tests/engine/test_processors.py::test_stage_equals_transformers_processor",
    served=Served(same_fields("typical_p"), step_caveats=(STEP_TAIL,)),
))


class Cutoff(Wrapped):
    """A transformers warper whose one knob (``knob``) is a cutoff in (0, 1) it takes as ``epsilon``."""

    knob: str
    warper: Callable[..., Any]

    def __init__(self, cutoff: float):
        require(0 < cutoff < 1, self.knob, cutoff, "(0, 1)")
        super().__init__(self.warper(epsilon=cutoff), **{self.knob: cutoff})


class Epsilon(Cutoff):
    """Epsilon sampling: transformers' EpsilonLogitsWarper, drop p < ε."""

    name, knob, warper = "epsilon", "epsilon_cutoff", tlp.EpsilonLogitsWarper


register(StageSpec(
    "epsilon", order=170, sampling_only=True, shareable=True, group="truncation", label="ε cutoff",
    knobs=(Knob("epsilon_cutoff", "float", 0.0, 0.0, 0.999, doc="Drop tokens with probability below epsilon. "
                "0 = disabled.", step=0.0001),),
    build=lambda c, ctx: Epsilon(c.epsilon_cutoff),
    note=truncation_note,
    heading=lambda s: f"ε-cutoff: drop p below {param(s, 'epsilon_cutoff')}",
    interop=Interop("EpsilonLogitsWarper", webui=Export("epsilon_cutoff", knobs=("epsilon_cutoff",), scale=10_000),
                    llama=Export(unmapped="llama.cpp has no absolute probability cutoff; --min-p is the nearest "
                                          "(relative) one")),
    oracle="tests/engine/test_processors.py::test_stage_equals_transformers_processor",
    served=Served(step_caveats=(STEP_TAIL,)),
))


class TopNSigma(Stage):
    """Top-nσ (llama.cpp's top-n-sigma): keep logits >= max - n·σ, σ the population standard
    deviation of the finite logits. Scaling logits by 1/T scales max and σ alike, so the kept set
    does not depend on temperature. Its diagnostics: σ and the cutoff (row 0)."""

    name = "top_n_sigma"

    def __init__(self, top_n_sigma: float):
        require(top_n_sigma > 0, "top_n_sigma", top_n_sigma, "(0, 10] for a stage")
        super().__init__(top_n_sigma=top_n_sigma)

    def apply(self, input_ids, logits):
        finite = torch.isfinite(logits)
        count = finite.sum(-1, keepdim=True).clamp(min=1)
        values = logits.float().masked_fill(~finite, 0.0)
        mean = values.sum(-1, keepdim=True) / count
        sigma = (((values - mean) ** 2).masked_fill(~finite, 0.0).sum(-1, keepdim=True) / count).sqrt()  # [B, 1]
        top = logits.float().masked_fill(~finite, float("-inf")).max(-1, keepdim=True).values
        cut = top - self.knobs["top_n_sigma"] * sigma
        return logits.masked_fill(logits < cut, float("-inf")), {"sigma": float(sigma[0]), "cutoff": float(cut[0])}


def _top_n_sigma_note(stage: StageTrace) -> str:
    sigma, cut = stage.params.get("sigma"), stage.params.get("cutoff")
    where = f" (σ = {sigma:.2f}, logits below {cut:.2f} go)" if sigma is not None and cut is not None else ""
    return truncation_note(stage) + where


register(StageSpec(
    "top_n_sigma", order=120, sampling_only=True, group="truncation", label="top-nσ",
    knobs=(Knob("top_n_sigma", "float", 0.0, 0.0, 10.0, doc="Keep logits within n standard deviations of the top "
                "logit. 0 = disabled.", step=0.05),),
    build=lambda c, ctx: TopNSigma(c.top_n_sigma),
    note=_top_n_sigma_note,
    heading=lambda s: f"top-nσ: keep logits within {param(s, 'top_n_sigma')}σ of the top",
    interop=Interop(webui=Export("top_n_sigma", knobs=("top_n_sigma",)),
                    llama=Export("top_n_sigma", flag="--top-nsigma"), export_all_knobs=True),
    oracle="tests/engine/test_samplers.py::test_top_n_sigma_by_hand",
    served=Served(same_fields("top_n_sigma"), step_caveats=(STEP_SPREAD,)),
))


class Eta(Cutoff):
    """Eta sampling: transformers' EtaLogitsWarper, eta = min(ε, sqrt(ε)·exp(-H))."""

    name, knob, warper = "eta", "eta_cutoff", tlp.EtaLogitsWarper


register(StageSpec(
    "eta", order=180, sampling_only=True, shareable=True, group="truncation", label="η cutoff",
    knobs=(Knob("eta_cutoff", "float", 0.0, 0.0, 0.999, doc="Eta sampling: drop p < min(eta, sqrt(eta) x "
                "exp(-entropy)). 0 = disabled.", step=0.0001),),
    build=lambda c, ctx: Eta(c.eta_cutoff),
    note=truncation_note,
    heading=lambda s: f"η-cutoff: drop p below {param(s, 'eta_cutoff')} (entropy-scaled)",
    interop=Interop("EtaLogitsWarper", webui=Export("eta_cutoff", knobs=("eta_cutoff",), scale=10_000),
                    llama=Export(unmapped="llama.cpp has no eta sampler"), export_all_knobs=True),
    oracle="tests/engine/test_samplers.py::test_wrapped_stage_equals_transformers",
    served=Served(step_caveats=(STEP_TAIL,)),
))


class TopA(Stage):
    """Top-a (text-generation-webui's TopALogitsWarper): drop tokens with p < a · p_max²."""

    name = "top_a"

    def __init__(self, top_a: float):
        require(0 < top_a <= 1, "top_a", top_a, "(0, 1] for a stage")
        super().__init__(top_a=top_a)

    def apply(self, input_ids, logits):
        probs = softmax(logits)
        p_max = probs.max(-1, keepdim=True).values
        return logits.masked_fill(probs < p_max * p_max * self.knobs["top_a"], float("-inf")), {}


register(StageSpec(
    "top_a", order=200, sampling_only=True, shareable=True, group="truncation", label="top-a",
    knobs=(Knob("top_a", "float", 0.0, 0.0, 1.0, doc="Top-a: drop p < a x p_max^2. 0 = disabled.", step=0.01),),
    build=lambda c, ctx: TopA(c.top_a),
    note=truncation_note,
    heading=lambda s: f"top-a: drop p below {param(s, 'top_a')} × top p²",
    interop=Interop(webui=Export("top_a", knobs=("top_a",)), llama=Export(unmapped="llama.cpp has no top-a sampler"),
                    export_all_knobs=True),
    oracle="tests/engine/test_samplers.py::test_top_a_by_hand",
    served=Served(step_caveats=(STEP_TAIL,)),
))


class TopH(Wrapped):
    """Top-H: transformers' TopHLogitsWarper (among the top 100 tokens, keep adding tokens while
    their entropy terms stay within top_h x the entropy)."""

    name = "top_h"

    def __init__(self, top_h: float):
        require(0 < top_h <= 1, "top_h", top_h, "(0, 1]")
        super().__init__(tlp.TopHLogitsWarper(top_h=top_h), top_h=top_h)


register(StageSpec(
    "top_h", order=190, sampling_only=True, group="truncation", label="top-H",
    knobs=(Knob("top_h", "float", 0.0, 0.0, 1.0, doc="Top-H: keep top tokens until their entropy exceeds top_h x "
                "the entropy. 0 = disabled.", step=0.01),),
    build=lambda c, ctx: TopH(c.top_h),
    note=truncation_note,
    heading=lambda s: f"top-H: keep entropy within {param(s, 'top_h')} of the whole",
    interop=Interop("TopHLogitsWarper", webui=Export(unmapped="text-generation-webui has no top-H sampler"),
                    llama=Export(unmapped="llama.cpp has no top-H sampler"), export_all_knobs=True),
    oracle="tests/engine/test_samplers.py::test_wrapped_stage_equals_transformers",
    served=Served(step_caveats=(STEP_TAIL,)),
))
