"""The Compare endpoints: ``/compare`` (2–6 lanes on one prompt and seed) and ``/compare_sweep``
(one lane over several seeds). Both return trace JSON (the CLI's objects, rounds and all)."""

from __future__ import annotations

import functools
from typing import Any, Sequence

from engine.config import DecodingConfig
from engine.control import RunControl
from engine.reports.metrics import lane_metrics, sweep_spread
from engine.backends.local import QUANTIZATIONS
from engine.presets import PresetError, load_preset
from engine.trace import Trace, to_dict

from ...shared import Shared, UserError, config_or_error
from .lanes import MAX_LANES, MIN_LANES, CompareSession, lane_name, sweep_seeds
from .run import lane_models, run_lanes, run_sweep


def api_lane_config(lane: Any, seed: int, max_new_tokens: int, name: str) -> DecodingConfig:
    """An API lane ``{"preset": name?, "config": {...}?, "model": source?, "quantization": variant?}``
    -> its config with the shared seed and budget (``model`` and ``quantization``: the lane's own
    model and weight variant, read by ``compare``)."""
    if not isinstance(lane, dict) or set(lane) - {"preset", "config", "model", "quantization"}:
        raise UserError(f"{name}: expected an object with 'preset', 'config', 'model' and/or 'quantization', "
                        f"got {str(lane)[:80]!r}")
    if "quantization" in lane and lane["quantization"] not in QUANTIZATIONS:
        raise UserError(f"{name}: quantization: expected one of {' | '.join(QUANTIZATIONS)}, "
                        f"got {str(lane['quantization'])[:60]!r}")
    try:
        base = load_preset(lane["preset"]).config.to_dict(sparse=True) if lane.get("preset") else {}
    except PresetError as exc:
        raise UserError(f"{name}: {exc}") from None
    extra = lane.get("config") or {}
    if not isinstance(extra, dict):
        raise UserError(f"{name}: config must be an object of knobs")
    try:
        return config_or_error(base | extra | {"seed": seed, "max_new_tokens": max_new_tokens})
    except UserError as exc:
        raise UserError(f"{name}: {exc}") from None


def compare_payload(prompt: str, configs: Sequence[DecodingConfig], session: CompareSession) -> dict:
    """The API answer: every lane's trace JSON, the metrics rows and the divergence step."""
    lanes = []
    for i, (config, trace) in enumerate(zip(configs, session.traces)):
        lanes.append({"name": lane_name(i), "config": config.to_dict(sparse=True), "error": session.errors[i] or None,
                      "trace": trace.to_dict() if trace else None})
    metrics = [lane_metrics(t, name) for name, t in session.done()]
    return {"prompt": prompt, "seed": configs[0].seed if configs else 0, "lanes": lanes,
            "metrics": [to_dict(m) for m in metrics], "divergence": session.divergence()}


def sweep_payload(seeds: Sequence[int], traces: Sequence[Trace]) -> dict:
    spread = sweep_spread([t.generated_token_ids for t in traces])
    return {"seeds": list(seeds), "spread": to_dict(spread), "texts": [t.text for t in traces],
            "traces": [t.to_dict() for t in traces]}


def compare(shared: Shared, prompt: str, lanes: list, seed: int = 0, max_new_tokens: int = 32, chat: bool = False,
            model: str = "embedded", quantization: str = "none", *, control: RunControl) -> dict:
    """Run 2-6 lanes on one prompt with one seed. Each lane: {"preset": built-in name, "config": {knobs},
    "model": a model the page offers, e.g. a llama.cpp server the operator lists, "quantization": a
    weight variant, e.g. gptq-g64 beside awq-g64} (all optional; no model or quantization: ``model``'s
    and ``quantization``'s). Returns every lane's trace JSON, the metrics rows and the first divergent step."""
    if not isinstance(lanes, list) or not MIN_LANES <= len(lanes) <= MAX_LANES:
        raise UserError(f"lanes: expected a list of {MIN_LANES} to {MAX_LANES} lanes, got {str(lanes)[:80]!r}")
    configs = [api_lane_config(lane, seed, max_new_tokens, lane_name(i)) for i, lane in enumerate(lanes)]
    picks = [(lane_name(i), lane.get("model") or "", lane.get("quantization") or "") for i, lane in enumerate(lanes)]
    models = lane_models(shared, picks, model, quantization, prompt, chat)
    session = CompareSession([None] * len(configs), [""] * len(configs), max_new_tokens)
    for _ in run_lanes(shared, models, prompt, configs, chat, session, control):
        pass
    return compare_payload(prompt, configs, session)


def compare_sweep(shared: Shared, prompt: str, lane: dict, seeds: int = 5, seed: int = 0, max_new_tokens: int = 32,
                  chat: bool = False, model: str = "embedded", quantization: str = "none", *,
                  control: RunControl) -> dict:
    """Run one lane over ``seeds`` consecutive seeds from ``seed``: the spread and every trace."""
    config = api_lane_config(lane, seed, max_new_tokens, "lane")
    seed_list = sweep_seeds(seed, seeds)
    lm = shared.lm(model, quantization)
    prompt_ids = shared.encode_prompt(lm, prompt, chat)
    *_, traces = run_sweep(shared, lm, prompt, prompt_ids, config, seed_list, chat, control)
    return sweep_payload(seed_list, traces)


def wire_api(shared: Shared) -> None:
    shared.events.api(functools.partial(compare, shared), "compare")
    shared.events.api(functools.partial(compare_sweep, shared), "compare_sweep")
