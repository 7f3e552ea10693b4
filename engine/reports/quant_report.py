"""RTN vs GPTQ vs AWQ vs NF4 vs int8 on the embedded model (issue #40): held-out perplexity and
drift, and what each 4-bit method does to one layer.

``stream_comparison``: the float model and each variant read the held-out text shipped in the repo
(engine/assets/quant/heldout.txt, ``HELDOUT_TOKENS`` tokens) in one teacher-forced forward; per
variant: perplexity exp(mean −log p(next token)), mean KL(p_fp32 || p_variant) over the positions,
top-1 agreement with fp32, bits per weight, bytes on disk and in memory, load seconds.

``inside_layer``: one Linear of one decoder layer, its float weight W against each 4-bit method's
effective weight Ŵ (what multiplies the same input): per output channel the relative weight error
‖Ŵ_i − W_i‖ / ‖W_i‖ and the relative output error ‖(Ŵ_i − W_i) X‖ / ‖W_i X‖ on the held-out
text's inputs X of that layer (taken from the float model). AWQ multiplies the weight's input
channels by scales s and divides the norm before it by the same s (llm-compressor folds them), so
its effective weight is Ŵ = Q(W diag(s)) diag(1/s) and s = the float norm weight / AWQ's norm
weight; the report sets s beside the mean |activation| of each input channel on the calibration set.
"""

from __future__ import annotations

import functools
import json
import math
import threading
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from engine.base.seam import LendingModels, Model, WeightedModel, with_weights
from engine.backends.local import QUANTIZATIONS, ModelLoadError, ModelSpec, embedded_model_dir
from engine.backends.quant_methods import CALIBRATION_SETS, HELDOUT, RECIPE, WEIGHT_METHODS, checkpoint_meta
from engine.backends.registry import estimated_bytes, model_bytes, trim_heap
from engine.control import RunControl, RunStopped, check
from engine.core import last

HELDOUT_TOKENS = 1024
COMPARED = ("none", "int8", "nf4", "rtn-g64", "gptq-g64", "awq-g64", "rtn-g32", "gptq-g32", "awq-g32")
# Nominal storage of the bitsandbytes variants: int8 keeps one float32 scale per output row (SCB) and
# nf4 one float32 absmax per block of 64 weights (no double quantization here).
BNB_BITS = {"int8": "8 + 32 / in_features", "nf4": "4 + 32 / 64 = 4.5"}
METHOD = ("The float model and each variant read the held-out text (written for this project, not in any "
          "calibration set) in one teacher-forced forward. Perplexity: exp of the mean negative log-probability of "
          "each next token. KL: mean KL(p_fp32 || p_variant) over the positions, in nats. Top-1: share of positions "
          "where the variant's most likely token is fp32's.")


@dataclass
class HeldoutScore:
    variant: str  # none | int8 | nf4 | a WEIGHT_METHODS name
    about: str
    perplexity: float
    mean_kl: float  # vs fp32, nats
    top1_agreement: float  # vs fp32
    bits_per_weight: float  # of the quantized Linear weights, scales included
    disk_bytes: int  # checkpoint weight files (0: none; bitsandbytes quantizes at load)
    packed_bytes: int  # 4-bit weights + scales a 4-bit kernel would keep (0 where not applicable)
    memory_bytes: int  # in memory as loaded here
    load_s: float
    quantize_s: float  # deploy/quantize.py's time to make the checkpoint (0 where none)


@dataclass
class MethodComparison:
    model: str
    heldout_tokens: int
    requested: list[str]
    rows: list[HeldoutScore] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    method: str = METHOD
    stopped: str = ""

    def pending(self) -> list[str]:
        done = {r.variant for r in self.rows} | set(self.errors)
        return [v for v in self.requested if v not in done]

    def row(self, variant: str) -> HeldoutScore | None:
        return next((r for r in self.rows if r.variant == variant), None)


def heldout_ids(lm: Model, max_tokens: int = HELDOUT_TOKENS) -> list[int]:
    return lm.encode(HELDOUT.read_text(encoding="utf-8"))[:max_tokens]


@torch.inference_mode()
def next_token_logits(lm: Model, ids: Sequence[int]) -> torch.Tensor:
    """Logits [T − 1, V] (float32): row t predicts ids[t + 1]."""
    out = lm.model(input_ids=torch.tensor([list(ids)], device=lm.device), use_cache=False)
    return out.logits[0, :-1].float()


def heldout_perplexity(lm: WeightedModel) -> float:
    """The model's perplexity on the held-out text, computed once per loaded model."""
    if "heldout_perplexity" not in lm.measures:
        ids = heldout_ids(lm)
        logits = next_token_logits(lm, ids)
        target = torch.tensor(ids[1:], device=logits.device)[:, None]  # [T − 1, 1]
        nll = torch.cat([-F.log_softmax(logits[rows], dim=-1).gather(-1, target[rows])[:, 0]
                         for rows in row_blocks(len(target))])
        lm.measures["heldout_perplexity"] = math.exp(float(nll.mean()))
    return lm.measures["heldout_perplexity"]


# Rows of [T, V] scored at once: each float32 temporary stays at SCORE_ROWS × V (25 MB for the embedded model)
# instead of T × V (178 MB for the held-out text, five of them at once: ~0.9 GB of peak RSS per variant).
SCORE_ROWS = 128


def row_blocks(n: int) -> list[slice]:
    return [slice(start, min(start + SCORE_ROWS, n)) for start in range(0, n, SCORE_ROWS)]


def score(ref_logits: torch.Tensor, logits: torch.Tensor, ids: Sequence[int]) -> tuple[float, float, float]:
    """(perplexity of ``logits`` on ids[1:], mean KL(ref || logits), top-1 agreement with ref); each row
    is scored on its own, SCORE_ROWS at a time."""
    target = torch.tensor(list(ids[1:]), device=logits.device)[:, None]  # [T − 1, 1]
    nll, kl, top1 = [], [], []
    for rows in row_blocks(len(target)):
        log_q = F.log_softmax(logits[rows], dim=-1)
        log_p = F.log_softmax(ref_logits[rows], dim=-1)
        nll.append(-log_q.gather(-1, target[rows])[:, 0])
        kl.append(F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).clamp_min(0.0))
        top1.append((logits[rows].argmax(-1) == ref_logits[rows].argmax(-1)).float())
    return (math.exp(float(torch.cat(nll).mean())), float(torch.cat(kl).mean()), float(torch.cat(top1).mean()))


def bits_per_weight(lm: WeightedModel, variant: str) -> float:
    """Storage bits of each quantized Linear weight, scales included (32 for the float model)."""
    if variant in WEIGHT_METHODS:
        weights = sum(m.weight.numel() for n, m in lm.model.named_modules()
                      if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))
        return 8 * lm.packed_bytes / max(weights, 1)
    if variant == "nf4":
        return 4 + 32 / 64
    if variant == "int8":
        return 8 + 32 / lm.model.config.hidden_size
    return 32.0


def measure(ref_logits: torch.Tensor, lm: WeightedModel, ids: Sequence[int], variant: str) -> HeldoutScore:
    ppl, kl, top1 = score(ref_logits, next_token_logits(lm, ids), ids)
    method = WEIGHT_METHODS.get(variant)
    meta = checkpoint_meta(embedded_model_dir(), variant) if method else {}
    about = method.about if method else {"none": "float32, the reference", "int8": "bitsandbytes LLM.int8 (8-bit)",
                                         "nf4": "bitsandbytes NF4 (4-bit, block 64)"}[variant]
    return HeldoutScore(variant, about, ppl, kl, top1, bits_per_weight(lm, variant), lm.disk_bytes, lm.packed_bytes,
                        lm.memory_bytes, lm.load_seconds, float(meta.get("seconds", 0.0)))


def normalise(variants: Sequence[str] | None) -> list[str]:
    """The variants asked for, validated, in COMPARED order (then the other checkpoints); "none" first always."""

    chosen = list(COMPARED) if variants is None else list(variants)
    unknown = [v for v in chosen if v not in QUANTIZATIONS]
    if unknown:
        raise ValueError(f"variants: expected some of {' | '.join(QUANTIZATIONS)}, got {unknown[0]!r}")
    return ["none"] + [q for q in QUANTIZATIONS if q in chosen and q != "none"]


# Each variant's row, measured once per process (the held-out text and the checkpoints do not change
# while it runs; a re-made checkpoint has another quantize.json): a room of 30 asking for the
# comparison, or the Quantization view after the API, waits for one measurement, not thirty.
_SCORES: dict[tuple[str, str, str], HeldoutScore] = {}
_SCORES_LOCK = threading.Lock()


def _score_key(source: str, variant: str) -> tuple[str, str, str]:
    made = checkpoint_meta(embedded_model_dir(), variant) if variant in WEIGHT_METHODS else {}
    return source, variant, json.dumps(made, sort_keys=True)


def _cached(key: tuple[str, str, str]) -> HeldoutScore | None:
    with _SCORES_LOCK:
        return _SCORES.get(key)


def check_room(registry: LendingModels, ref: Model, variants: Sequence[str], what: str, key: str = "variants") -> None:
    """Refuse (ModelLoadError naming ``key``, one line naming the budget) a report whose float model and
    largest variant, loaded one at a time beside it, would pass the registry's memory budget."""
    if variants:
        largest = max(estimated_bytes(ref, v) for v in variants)
        registry.check_room(model_bytes(ref) + largest, what, key=key)


def stream_comparison(registry: LendingModels, source: str, variants: Sequence[str] | None = None, *,
                      control: RunControl | None = None) -> Iterator[MethodComparison]:
    """Yield the comparison after the float model, then as each variant is measured (the same
    object, growing). A variant that cannot be loaded goes to ``errors`` (one line). A variant
    measured before in this process is not measured again (``_SCORES``). Each variant is lent by the
    registry for its measure and released after it: at most one is in memory beside the float model,
    and a comparison whose largest variant would not fit the memory budget is refused first."""
    requested = normalise(variants)
    check(control)
    ref = with_weights(registry.get(ModelSpec(source, "none")), "quantization")
    check_room(registry, ref, [v for v in requested[1:] if _cached(_score_key(source, v)) is None],
               "the methods' comparison")
    ids = heldout_ids(ref)
    reference: list[torch.Tensor] = []  # the float model's logits, computed when a variant needs them

    def measured(lm: WeightedModel, variant: str, key: tuple[str, str, str]) -> HeldoutScore:
        check(control)
        if not reference:
            reference.append(next_token_logits(ref, ids))
        row = measure(reference[0], lm, ids, variant)
        with _SCORES_LOCK:
            return _SCORES.setdefault(key, row)

    key = _score_key(source, "none")
    report = MethodComparison(ref.name, len(ids), requested, [_cached(key) or measured(ref, "none", key)])
    yield report
    try:
        for variant in requested[1:]:
            check(control)
            key = _score_key(source, variant)
            try:
                row = _cached(key) or registry.lend(ModelSpec(source, variant),
                                                    functools.partial(measured, variant=variant, key=key))
            except ModelLoadError as exc:
                report.errors[variant] = str(exc)
            else:
                report.rows.append(row)
            yield report
    except RunStopped as exc:
        report.stopped = str(exc)
        yield report


def compare_methods(registry: LendingModels, source: str, variants: Sequence[str] | None = None, *,
                    control: RunControl | None = None) -> MethodComparison:
    """The whole comparison (``stream_comparison``), the heap it freed given back (``drift.quantization_report``)."""
    report = last(stream_comparison(registry, source, variants, control=control))
    trim_heap()
    return report


# --- inside one layer ------------------------------------------------------------------------------
LAYER_MODULES = {"q_proj": ("self_attn.q_proj", "input_layernorm"), "gate_proj": ("mlp.gate_proj", "post_attention_layernorm")}
INSIDE_METHODS = ("rtn", "gptq", "awq")


@dataclass
class InsideLayer:
    """One Linear of one layer under RTN, GPTQ and AWQ (same group size)."""

    layer: int
    module: str  # q_proj | gate_proj
    group_size: int
    methods: list[str]  # checkpoint names, e.g. rtn-g64
    weight_error: dict[str, list[float]]  # per output channel, relative
    output_error: dict[str, list[float]]  # per output channel, relative, on held-out inputs
    mean_weight_error: dict[str, float]
    mean_output_error: dict[str, float]
    activation_mean_abs: list[float]  # per input channel, calibration set, float model
    awq_scales: list[float]  # per input channel (float norm weight / AWQ norm weight)
    scale_activation_correlation: float  # Spearman rank correlation of the two above
    input_tokens: int


@torch.inference_mode()
def layer_inputs(lm: Model, path: str, ids: Sequence[int]) -> torch.Tensor:
    """The inputs [T, in] that the module at ``path`` receives when the model reads ``ids``."""
    module = lm.model.get_submodule(path)
    seen: list[torch.Tensor] = []
    hook = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0][0].float().clone()))
    try:
        lm.model(input_ids=torch.tensor([list(ids)], device=lm.device), use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    return seen[0]


def calibration_ids(lm: Model, name: str = "prose", max_tokens: int = 128) -> list[list[int]]:
    text = CALIBRATION_SETS[name].read_text(encoding="utf-8")
    samples = [s.strip() for s in text.split("\n=====\n") if s.strip()]
    return [lm.encode(s)[: min(max_tokens, RECIPE["max_tokens"])] for s in samples]


def effective_weight(ref: Model, lm: Model, path: str, norm: str, method: str) -> torch.Tensor:
    """The weight that multiplies the float model's input: AWQ's scales folded back out."""
    weight = lm.model.get_submodule(path).weight.float()
    if method != "awq":
        return weight
    return weight / awq_scales(ref, lm, norm)[None, :]


def awq_scales(ref: Model, awq: Model, norm_path: str) -> torch.Tensor:
    """s per input channel: the float norm weight / AWQ's (AWQ divided the norm by s)."""
    return ref.model.get_submodule(norm_path).weight.float() / awq.model.get_submodule(norm_path).weight.float()


def rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().float(), b.argsort().argsort().float()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-12))


def channel_errors(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative weight error and relative output error on inputs ``x`` [T, in], per output channel."""
    delta = w_hat - w  # [out, in]
    weight_error = delta.norm(dim=1) / w.norm(dim=1).clamp_min(1e-12)
    output_error = (x @ delta.T).norm(dim=0) / (x @ w.T).norm(dim=0).clamp_min(1e-12)  # [out]
    return weight_error, output_error


@torch.inference_mode()  # the float weights are Parameters; no autograd record is wanted
def inside_layer(registry: LendingModels, source: str, layer: int = 15, module: str = "q_proj", group_size: int = 64, *,
                 control: RunControl | None = None) -> InsideLayer:
    """RTN, GPTQ and AWQ on one Linear (see the module docstring); ValueError naming a bad argument."""
    if module not in LAYER_MODULES:
        raise ValueError(f"module: expected {' | '.join(LAYER_MODULES)}, got {module!r}")
    if group_size not in (64, 32):
        raise ValueError(f"group_size: expected 64 or 32, got {group_size!r}")
    ref = with_weights(registry.get(ModelSpec(source, "none")), "quantization")
    layers = ref.model.config.num_hidden_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
        raise ValueError(f"layer: expected a whole number in [0, {layers - 1}], got {layer!r}")
    sub, norm = LAYER_MODULES[module]
    path, norm_path = f"model.layers.{layer}.{sub}", f"model.layers.{layer}.{norm}"
    names = [f"{m}-g{group_size}" for m in INSIDE_METHODS]
    check_room(registry, ref, names, "the inside-one-layer report", key="model")
    check(control)
    x = layer_inputs(ref, path, heldout_ids(ref))
    seen = []
    for ids in calibration_ids(ref):
        check(control)  # one forward per calibration sample: a time limit or a Stop lands between them
        seen.append(layer_inputs(ref, path, ids))
    activations = torch.cat(seen).abs().mean(0)
    w = ref.model.get_submodule(path).weight.float()
    weight_error, output_error, scales = {}, {}, None

    def errors(lm: Model, method: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per-channel errors (and AWQ's scales) of one variant: new tensors, none of them the variant's."""
        we, oe = channel_errors(w, effective_weight(ref, lm, path, norm_path, method), x)
        return we, oe, awq_scales(ref, lm, norm_path) if method == "awq" else None

    for method, name in zip(INSIDE_METHODS, names):
        check(control)  # each variant is lent for its errors and released: one in memory at a time
        we, oe, found = registry.lend(ModelSpec(source, name), functools.partial(errors, method=method))
        weight_error[name], output_error[name] = we.tolist(), oe.tolist()
        scales = found if found is not None else scales
    if scales is None:  # INSIDE_METHODS holds AWQ, whose scales are measured
        raise ValueError("inside one layer: AWQ's scales were not measured")
    return InsideLayer(layer, module, group_size, names, weight_error, output_error,
                       {k: sum(v) / len(v) for k, v in weight_error.items()},
                       {k: sum(v) / len(v) for k, v in output_error.items()},
                       activations.tolist(), scales.tolist(), rank_correlation(scales, activations), x.shape[0])
