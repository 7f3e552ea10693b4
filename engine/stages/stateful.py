"""Stateful stages: XTC (it draws from the run's generator) and mirostat (μ carried across steps).
Their state follows llama.cpp's sampler API: ``accept`` / ``reset`` / ``clone`` / ``state`` /
``load_state`` (``engine.stages.base.Stage``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from engine.stages.spec import (ConfigError, Export, Interop, Knob, StageSpec, number, param,
                                quoted, register, title_number, token_names)
from engine.stages.spec import STEP_TAIL, Served, same_fields
from engine.numbers import decimal, percent
from engine.stages.base import Stage, require, softmax

if TYPE_CHECKING:
    from engine.config import DecodingConfig
    from engine.trace import StageTrace


class Xtc(Stage):
    """XTC, "exclude top choices" (llama.cpp's xtc): with probability ``xtc_probability``, every
    token with p >= threshold is removed except the least likely of them (nothing happens when
    fewer than two reach it). The coin is u ~ U(0, 1) from the run's generator, drawn only when
    0 < probability < 1 (once per call, whatever the logits, so a replay stays aligned); the
    stage fires when u < probability. Its diagnostics: u, whether it fired, and the token kept."""

    name = "xtc"
    stateful = True  # it draws

    def __init__(self, xtc_threshold: float, xtc_probability: float, generator: torch.Generator | None = None):
        require(0 <= xtc_threshold <= 0.5, "xtc_threshold", xtc_threshold, "[0, 0.5] for a stage (above 0.5 disables)")
        require(0 < xtc_probability <= 1, "xtc_probability", xtc_probability, "(0, 1] for a stage")
        super().__init__(xtc_threshold=xtc_threshold, xtc_probability=xtc_probability)
        self.generator = generator
        self._loaded_u: float | None = None  # load_state's draw: every call uses it instead of drawing
        self._u: float | None = None  # the last call's draw

    def coin(self) -> float | None:
        """The call's draw u: the loaded one (``load_state``), else one from the run's generator;
        None when the probability is 1 (nothing to draw)."""
        probability = self.knobs["xtc_probability"]
        if probability >= 1:
            return None
        if self._loaded_u is not None:
            return self._loaded_u
        if self.generator is None:
            raise ConfigError("xtc_probability", f"{probability!r} in (0, 1) draws from the run's generator; "
                                                 "none was given (Chain.from_config(..., generator=...))")
        return float(torch.rand((), generator=self.generator, device=self.generator.device))

    def state(self) -> dict[str, Any]:
        return {"u": self._u}

    def load_state(self, state: dict[str, Any]) -> None:
        u = state.get("u")
        if u is not None:
            require(isinstance(u, (int, float)) and not isinstance(u, bool) and 0 <= u < 1, "xtc.u", u, "[0, 1)")
            self._loaded_u = float(u)

    def reset(self) -> None:
        super().reset()
        self._loaded_u = self._u = None

    def skip(self) -> None:
        self.coin()  # the one draw a call makes (none at probability 1)

    def apply(self, input_ids, logits):
        u = self._u = self.coin()
        fired = u is None or u < self.knobs["xtc_probability"]
        out, kept = logits.clone(), None
        if fired:
            probs = softmax(logits)
            # the tokens still alive at or above the threshold (a masked token is never a "top choice":
            # with threshold 0 it would otherwise be the least likely one kept, leaving nothing)
            top = (probs >= self.knobs["xtc_threshold"]) & (probs > 0)  # [B, V]
            # the least likely top choice survives (ties: the highest id, an arbitrary but fixed rule),
            # as llama.cpp keeps the last candidate above the threshold
            least = torch.where(top, probs, torch.full_like(probs, 2.0))
            keep_idx = (least == least.min(dim=-1, keepdim=True).values).int().cumsum(-1).argmax(-1)  # [B]
            remove = top & (top.sum(-1, keepdim=True) >= 2)
            remove[torch.arange(out.shape[0]), keep_idx] = False
            out = out.masked_fill(remove, float("-inf"))
            kept = int(keep_idx[0]) if bool(top[0].sum() >= 2) else None
        return out, {"u": u, "fired": fired, "kept_id": kept}


def _xtc_note(stage: StageTrace) -> str:
    p, u = stage.params.get("xtc_probability"), stage.params.get("u")
    coin = f"u={decimal(u, 2)} < {p:g}" if u is not None else f"probability {p:g}"
    if not stage.params.get("fired"):
        return f"XTC did not fire (u={decimal(u, 2)} ≥ {p:g})" if u is not None else "XTC did not fire"
    if stage.params.get("kept_id") is None:
        threshold = stage.params.get("xtc_threshold")
        return f"XTC fired ({coin}) but fewer than two tokens reach {threshold:g}: nothing removed"
    kept = next((t.token for t in stage.top if t.token_id == stage.params["kept_id"]), None)
    kept_text = f"; kept {quoted(kept)}" if kept is not None else ""
    removed = token_names(stage.removed) or f"{percent(stage.mass_removed)} of the mass"
    return f"XTC fired ({coin}): removed {removed}{kept_text}"


register(StageSpec(
    "xtc", order=210, sampling_only=True, group="adaptive", label="XTC", label_value=False,
    knobs=(Knob("xtc_threshold", "float", 0.1, 0.0, 1.0, doc="XTC: tokens at or above this probability are top "
                "choices. Above 0.5 = disabled.", step=0.01),
           Knob("xtc_probability", "float", 0.0, 0.0, 1.0, doc="XTC: chance per step of removing every top choice "
                "but the least likely. 0 = disabled.", step=0.01)),
    active=lambda c: c.xtc_probability > 0 and c.xtc_threshold <= 0.5,
    build=lambda c, ctx: Xtc(c.xtc_threshold, c.xtc_probability, ctx.generator),
    note=_xtc_note,
    heading=lambda s: (f"XTC: drop top tokens above p={param(s, 'xtc_threshold', '.2f')} "
                       f"with probability {param(s, 'xtc_probability', '.1f')}"),
    interop=Interop(webui=Export("xtc", knobs=("xtc_threshold", "xtc_probability")),
                    llama=Export("xtc", lines=lambda c, x: [f"--xtc-probability {number(c.xtc_probability)}",
                                                            f"--xtc-threshold {number(c.xtc_threshold)}"]),
                    export_all_knobs=True),
    oracle="tests/engine/test_samplers.py::test_xtc_removes_top_choices_but_the_least_likely "
           "tests/engine/test_samplers.py::test_xtc_fires_with_its_probability",
    served=Served(same_fields("xtc_probability", "xtc_threshold")),
))


class Mirostat(Stage):
    """Mirostat v1 and v2 (llama.cpp's mirostat / mirostat-v2), μ starting at 2τ.

    v2: drop tokens whose surprise -log2 p exceeds μ (the top token always stays).
    v1: estimate the Zipf exponent ŝ from the top m = 100 tokens, then keep the top
    k = ((ε̂·2^μ) / (1 - N^-ε̂))^(1/ŝ) tokens, ε̂ = ŝ - 1, N the vocabulary size.
    After the pick, ``accept`` updates μ ← μ - η·(-log2 p(token) - τ), p the token's probability
    in the truncated distribution this stage produced (llama.cpp samples right after mirostat;
    here it is the last stage by default). Its diagnostics: μ before and the tokens kept; ``accept``
    returns μ after and the surprise."""

    name = "mirostat"
    stateful = True
    carries = True  # μ
    M = 100

    def __init__(self, mirostat: int, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1):
        require(mirostat in (1, 2), "mirostat", mirostat, "1 | 2 for a stage (0 = disabled)")
        require(mirostat_tau >= 0, "mirostat_tau", mirostat_tau, "[0, 20]")
        require(0 <= mirostat_eta <= 1, "mirostat_eta", mirostat_eta, "[0, 1]")
        super().__init__(mirostat=mirostat, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta)
        self.mu = 2.0 * mirostat_tau
        self._mu_used = self.mu  # μ of the last call (accept moves self.mu after it)
        self._probs: tuple[torch.Tensor, torch.Tensor] | None = None  # (before, after) of row 0, [V]

    def _keep_count(self, probs: torch.Tensor, alive: int) -> int:
        """How many of the sorted probabilities [V] (descending) to keep."""
        if self.knobs["mirostat"] == 2:
            return max(1, int((-torch.log2(probs[:alive]) <= self.mu).sum()))
        m = min(self.M - 1, alive - 1)
        i = torch.arange(m, dtype=torch.float64)
        t = torch.log((i + 2) / (i + 1))
        b = torch.log(probs[:m].double() / probs[1:m + 1].double())
        s_hat = float((t * b).sum() / (t * t).sum()) if m > 0 else float("nan")
        eps = s_hat - 1
        k = ((eps * 2.0 ** self.mu) / (1 - probs.shape[0] ** -eps)) ** (1 / s_hat) if m > 0 else float("nan")
        if not isinstance(k, float) or not math.isfinite(k):  # degenerate estimate: keep what is alive
            return alive
        return min(max(int(k), 1), alive)

    def apply(self, input_ids, logits):
        probs = softmax(logits)
        sorted_p, order = torch.sort(probs[0], descending=True)
        keep = self._keep_count(sorted_p, int((sorted_p > 0).sum()))
        mask = torch.ones_like(probs[0], dtype=torch.bool)
        mask[order[:keep]] = False
        out = logits.masked_fill(mask, float("-inf"))  # B = 1: mirostat keeps one μ per run
        self._probs = (probs[0], softmax(out)[0])
        self._mu_used = self.mu
        return out, {"mu": self.mu, "kept": keep, "mu_after": None}

    def state(self) -> dict[str, Any]:
        return {"mu": self._mu_used}

    def load_state(self, state: dict[str, Any]) -> None:
        mu = state.get("mu")
        if mu is not None:
            require(isinstance(mu, (int, float)) and not isinstance(mu, bool) and math.isfinite(mu),
                     "mirostat.mu", mu, "a finite number")
            self.mu = self._mu_used = float(mu)

    def resume(self, state: dict[str, Any]) -> None:
        self.load_state(state)  # μ before the step: what the run had carried there

    def accept(self, input_ids, token_id: int) -> dict[str, Any]:
        if self._probs is None:
            return {}
        before, after = self._probs
        p = float(after[token_id]) if float(after[token_id]) > 0 else float(before[token_id])  # a forced token
        surprise = -math.log2(p) if p > 0 else 64.0  # cap: a token of probability 0 only comes forced
        self.mu = self.mu - self.knobs["mirostat_eta"] * (surprise - self.knobs["mirostat_tau"])
        self._probs = None
        learnt = {"mu_after": self.mu, "surprise": surprise}
        self._last = {**self._last, **learnt}
        return learnt

    def reset(self) -> None:
        super().reset()
        self.mu = self._mu_used = 2.0 * self.knobs["mirostat_tau"]
        self._probs = None


def _mirostat_note(stage: StageTrace) -> str:
    mu, kept = stage.params.get("mu"), stage.params.get("kept", stage.kept)
    if mu is None:
        return "mirostat"
    after = stage.params.get("mu_after")
    then = f"; after the pick μ = {after:.2f}" if after is not None else ""
    return f"mirostat: μ = {mu:.1f} → kept {kept} tokens{then}"


def _mirostat_heading(stage: StageTrace) -> str:
    version, mu = stage.params.get("mirostat"), stage.params.get("mu")
    name = f"Mirostat v{version}" if version in (1, 2) else "Mirostat"
    return (f"{name}: target surprise {param(stage, 'mirostat_tau', '.1f')}"
            + (f", mu {title_number(mu, '.1f')}" if mu is not None else ""))


def _mirostat_webui_caveat(c: DecodingConfig, view: Any) -> str | None:
    if c.mirostat != 1:
        return None
    return "text-generation-webui's Transformers loader runs mirostat 2 only; mode 1 needs its llama.cpp loader"


def _mirostat_llama_caveat(c: DecodingConfig, view: Any) -> str | None:
    if view.greedy or len(view.order) < 2:
        return None
    return "with --mirostat, llama.cpp ignores --samplers and keeps only temperature"


register(StageSpec(
    "mirostat", order=220, sampling_only=True, group="adaptive", label="Mirostat", label_value=False,
    knobs=(Knob("mirostat", "int", 0, 0, 2, doc="Mirostat version: adaptive truncation aiming at a target surprise. "
                "0 = disabled.", step=1),
           Knob("mirostat_tau", "float", 5.0, 0.0, 20.0, doc="Mirostat: target surprise in bits.", step=0.1),
           Knob("mirostat_eta", "float", 0.1, 0.0, 1.0, doc="Mirostat: learning rate of mu.", step=0.01)),
    build=lambda c, ctx: Mirostat(c.mirostat, c.mirostat_tau, c.mirostat_eta),
    note=_mirostat_note,
    heading=_mirostat_heading,
    # llama.cpp's mirostat is no --samplers entry: it replaces the chain, keeping temperature only
    interop=Interop(webui=Export("mirostat", caveat=_mirostat_webui_caveat, lines=lambda c, x: [
                        f"mirostat_mode: {number(c.mirostat)}", f"mirostat_tau: {number(c.mirostat_tau)}",
                        f"mirostat_eta: {number(c.mirostat_eta)}"]),
                    llama=Export(caveat=_mirostat_llama_caveat, lines=lambda c, x: [
                        f"--mirostat {c.mirostat}", f"--mirostat-lr {number(c.mirostat_eta)}",
                        f"--mirostat-ent {number(c.mirostat_tau)}"]),
                    export_all_knobs=True),
    oracle="tests/engine/test_samplers.py::test_mirostat_v2_truncates_by_surprise_and_updates_mu "
           "tests/engine/test_samplers.py::test_mirostat_v1_keeps_k_from_the_zipf_estimate",
    served=Served(lambda c, context: {"mirostat": 0 if c.is_greedy else c.mirostat, "mirostat_tau": c.mirostat_tau,
                                     "mirostat_eta": c.mirostat_eta}, step_caveats=(STEP_TAIL,)),
))
