"""What quantization and the KV cache change: distribution drift, memory and speed.

``stream_drift`` / ``quantization_report``: the fp32 model decodes greedily to get a reference
continuation; each variant (none | int8 | nf4 | a 4-bit checkpoint made here, engine.backends.quant_methods;
loaded through the registry) then reads the whole
reference sequence in ONE teacher-forced forward, and per position we compare its next-token
distribution q with the reference model's p: KL(p || q) in nats, total variation, whether q's
top-1 token is the reference token, and the reference token's probability under both. Each
variant also decodes greedily on its own, which gives its speed and where its text first leaves
the reference.

``kv_cache_report``: greedy with the KV cache (``decode.stream``) against the nanoGPT loop that
feeds the whole sequence again at every step, with the cache's measured size against the formula
2 × layers × kv_heads × head_dim × bytes per element. The uncached loop is quadratic in the
length, so the report is capped at MAX_UNCACHED_TOKENS tokens and says so.

``stream_kv_drift`` / ``kv_drift_report``: the same model with each KV cache kind (dynamic,
quantized-int8/int4, sliding-<N>; engine/cache/kv_quant.py) against the full-precision reference.
Teacher-forced: the kind's cache is fed the reference continuation token by token, and each
step's distribution is compared with the reference's (KL, TV, top-1 agreement). Free-running:
the kind decodes greedily on its own, which gives its speed, its memory over the run and the
first step where its text leaves the reference.

Every loop here calls ``control.check()`` once per forward (``control`` keyword). A report
stopped by its control (cancelled, or past its time limit) after its reference run is returned as
far as it got, with ``stopped`` saying why; stopped before that, ``RunStopped`` is raised.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from engine.base.seam import LendingModels, Model, WeightedModel, with_weights
from engine.cache import kv_quant
from engine.backends.local import BNB_QUANTIZATIONS, QUANTIZATIONS, ModelLoadError, ModelSpec
from engine.backends.registry import trim_heap
from engine.cache import KVCache
from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped, check
from engine.core import StopCheck, check_prompt, last, timing
from engine.reports.metrics import first_divergence
from engine.reports.quant_report import check_room, heldout_perplexity
from engine.strategies import decode
from engine.trace import StepTrace

REFERENCE = "none"  # the fp32 (unquantized) model is the yardstick


@dataclass
class PositionDrift:
    """One position of the reference continuation, read by a variant under teacher forcing."""

    index: int  # step in the reference continuation
    token_id: int  # the reference token at this step
    token: str
    kl: float  # KL(p_ref || p_variant), nats
    tv: float  # total variation distance, in [0, 1]
    top1_agrees: bool  # the variant's most likely token is the reference token
    top1_token_id: int  # the variant's most likely token
    top1_token: str
    ref_prob: float  # the reference token's probability under the reference model
    variant_prob: float  # ... and under the variant


@dataclass
class VariantDrift:
    """A variant: its footprint, its drift from the reference, and its own greedy run."""

    quantization: str  # none | int8 | nf4 | a 4-bit checkpoint (engine.backends.quant_methods)
    memory_bytes: int  # the loaded model's memory_bytes (weights and buffers, as computed with)
    load_s: float  # how long loading took (when it was first loaded)
    was_loaded: bool  # already in the registry before this report (no load time spent now)
    positions: list[PositionDrift]
    mean_kl: float
    max_kl: float
    mean_tv: float
    top1_agreement: float  # share of positions where top1_agrees
    tokens_per_s: float  # of its own greedy run
    text: str  # its own greedy continuation
    generated_token_ids: list[int]
    tokens: list[str]  # the text of each generated token
    first_divergence: int | None  # first step where its own run leaves the reference; None if never
    heldout_perplexity: float = 0.0  # on the held-out text shipped in the repo (engine.reports.quant_report)
    disk_bytes: int = 0  # a 4-bit checkpoint's files on disk (0: bitsandbytes quantizes at load)
    packed_bytes: int = 0  # its packed 4-bit weights and scales (what a 4-bit kernel would keep in memory)


@dataclass
class DriftReport:
    model: str
    prompt: str
    chat: bool
    device: str
    max_new_tokens: int
    prompt_token_ids: list[int]
    reference_token_ids: list[int]
    reference_tokens: list[str]
    reference_text: str
    requested: list[str]  # the variants asked for, in QUANTIZATIONS order
    variants: list[VariantDrift] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # variant -> why it could not be measured
    stopped: str = ""  # why the report ended before every variant was measured ("" when complete)

    def pending(self) -> list[str]:
        """Variants not yet measured (nor failed)."""
        done = {v.quantization for v in self.variants} | set(self.errors)
        return [q for q in self.requested if q not in done]


def normalise_variants(variants: Sequence[str]) -> list[str]:
    """Validated, de-duplicated, in QUANTIZATIONS order."""
    unknown = [v for v in variants if v not in QUANTIZATIONS]
    if unknown:
        raise ValueError(f"variants: expected some of {' | '.join(QUANTIZATIONS)}, got {unknown[0]!r}")
    chosen = [q for q in QUANTIZATIONS if q in variants]
    if not chosen:
        raise ValueError("variants: pick at least one of " + " | ".join(QUANTIZATIONS))
    return chosen


def greedy_config(max_new_tokens: int) -> DecodingConfig:
    """Greedy with a one-token trace (the drift is measured separately, over the whole vocabulary)."""
    return DecodingConfig(strategy="greedy", max_new_tokens=max_new_tokens, top_n=1)


@torch.inference_mode()
def teacher_forced_logits(lm: Model, prompt_ids: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """Next-token logits [T, V] (float32) for each of the T continuation tokens, from ONE forward
    over prompt + continuation[:-1]: row t is the distribution that picked continuation[t]."""
    ids = torch.tensor([list(prompt_ids) + list(continuation[:-1])], dtype=torch.long, device=lm.device)
    out = lm.model(input_ids=ids, use_cache=False, logits_to_keep=len(continuation))
    return out.logits[0].float()  # [T, V]


def compare_logits(ref_logits: torch.Tensor, var_logits: torch.Tensor, reference: Sequence[int],
                   token_text: Any) -> list[PositionDrift]:
    """Per-position drift of ``var_logits`` [T, V] from ``ref_logits`` [T, V] along ``reference``."""
    log_p = F.log_softmax(ref_logits, dim=-1)  # [T, V]
    log_q = F.log_softmax(var_logits, dim=-1)
    p, q = log_p.exp(), log_q.exp()
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).clamp_min(0.0)  # [T]
    tv = 0.5 * (p - q).abs().sum(-1)  # [T]
    top1 = q.argmax(-1)  # [T]
    ref = torch.tensor(list(reference), dtype=torch.long, device=p.device)
    ref_p = p.gather(-1, ref[:, None])[:, 0]
    var_p = q.gather(-1, ref[:, None])[:, 0]
    return [
        PositionDrift(index=t, token_id=int(ref[t]), token=token_text(int(ref[t])), kl=float(kl[t]), tv=float(tv[t]),
                      top1_agrees=bool(top1[t] == ref[t]), top1_token_id=int(top1[t]),
                      top1_token=token_text(int(top1[t])),
                      ref_prob=float(ref_p[t]), variant_prob=float(var_p[t]))
        for t in range(len(reference))
    ]


def measure_variant(ref_lm: WeightedModel, lm: WeightedModel, prompt_ids: Sequence[int], reference: Sequence[StepTrace],
                    ref_logits: torch.Tensor, own: Sequence[StepTrace], was_loaded: bool = False) -> VariantDrift:
    """A VariantDrift from the reference run's steps and logits, and the variant's own greedy steps."""
    ref_ids = [s.chosen_token_id for s in reference]
    positions = compare_logits(ref_logits, teacher_forced_logits(lm, prompt_ids, ref_ids), ref_ids, ref_lm.token_text)
    own_ids = [s.chosen_token_id for s in own]
    n = max(1, len(positions))
    return VariantDrift(
        quantization=lm.quantization, memory_bytes=lm.memory_bytes, load_s=lm.load_seconds, was_loaded=was_loaded,
        positions=positions, mean_kl=sum(p.kl for p in positions) / n,
        max_kl=max((p.kl for p in positions), default=0.0),
        mean_tv=sum(p.tv for p in positions) / n, top1_agreement=sum(p.top1_agrees for p in positions) / n,
        tokens_per_s=timing(own).tokens_per_s, text=lm.decode(own_ids), generated_token_ids=own_ids,
        tokens=[s.chosen_token for s in own], first_divergence=first_divergence([ref_ids, own_ids]),
        heldout_perplexity=heldout_perplexity(lm), disk_bytes=lm.disk_bytes, packed_bytes=lm.packed_bytes,
    )


def stream_drift(registry: LendingModels, source: str, prompt: str, chat: bool = False, max_new_tokens: int = 16,
                 variants: Sequence[str] = BNB_QUANTIZATIONS, *, control: RunControl | None = None
                 ) -> Iterator[DriftReport]:
    """Yield the report after the reference run, then again as each variant finishes (the same
    object each time, growing).

    ``registry``: a ModelRegistry (``get(spec)``, ``loaded()``, ``lend``, ``check_room``). A variant that
    cannot be loaded (e.g. bitsandbytes missing) is recorded in ``errors``; the reference failing raises.
    Each variant is lent for its measure and released after it (one in memory beside the reference);
    a report whose largest variant would not fit the memory budget is refused before the reference run.
    ``control`` is checked before every forward and every load: once it stops the run, the report
    is yielded a last time with ``stopped`` set (RunStopped is raised if the reference run was cut)."""
    requested = normalise_variants(variants)
    config = greedy_config(max_new_tokens)
    check(control)
    ref_lm = with_weights(registry.get(ModelSpec(source, REFERENCE)), "quantization")
    check_room(registry, ref_lm, [q for q in requested if q != REFERENCE], "the drift report")
    prompt_ids = ref_lm.encode(prompt, chat)
    reference = list(checked_stream(ref_lm, prompt_ids, config, None, control))
    ref_ids = [s.chosen_token_id for s in reference]
    ref_logits = teacher_forced_logits(ref_lm, prompt_ids, ref_ids)
    report = DriftReport(
        model=ref_lm.name, prompt=prompt, chat=chat, device=str(ref_lm.device), max_new_tokens=max_new_tokens,
        prompt_token_ids=list(prompt_ids), reference_token_ids=ref_ids,
        reference_tokens=[s.chosen_token for s in reference], reference_text=ref_lm.decode(ref_ids),
        requested=requested,
    )
    yield report

    def measured(lm: WeightedModel, quantization: str, was_loaded: bool) -> VariantDrift:
        own = reference if quantization == REFERENCE else list(checked_stream(lm, prompt_ids, config, None, control))
        check(control)  # before the variant's teacher-forced forward
        return measure_variant(ref_lm, lm, prompt_ids, reference, ref_logits, own, was_loaded)

    try:
        for quantization in requested:
            check(control)
            spec = ModelSpec(source, quantization)
            was_loaded = spec in registry.loaded()
            try:  # lent for its measure and released after it (a variant the registry keeps stays kept)
                row = registry.lend(spec, functools.partial(measured, quantization=quantization, was_loaded=was_loaded))
            except ModelLoadError as exc:
                report.errors[quantization] = str(exc)
            else:
                report.variants.append(row)
            yield report
    except RunStopped as exc:
        report.stopped = str(exc)
        yield report


def quantization_report(registry: LendingModels, source: str, prompt: str, chat: bool = False, max_new_tokens: int = 16,
                        variants: Sequence[str] = BNB_QUANTIZATIONS, *, control: RunControl | None = None) -> DriftReport:
    """The whole drift report (see ``stream_drift``); as far as it got when ``control`` stopped it. The
    heap its runs freed (the reference's logits and traces, after the variants' own) goes back to the
    system once the stream's frame is gone: an API call leaves only its report."""
    report = last(stream_drift(registry, source, prompt, chat, max_new_tokens, variants, control=control))
    trim_heap()
    return report


# ---------------------------------------------------------------------------------------- KV cache

# The uncached loop feeds the whole sequence at every step (quadratic), so reports cap their length.
MAX_UNCACHED_TOKENS = 256
MAX_KV_DRIFT_TOKENS = 256  # each kind decodes twice (teacher-forced and free-running)


@dataclass
class KVStep:
    index: int  # generated token number
    position: int  # sequence length the model read to produce it (prompt + tokens before it)
    cached_ms: float  # with the cache (step 0 includes the prefill)
    uncached_ms: float | None  # recomputing the whole sequence; None when the report stopped before this step


@dataclass
class KVReport:
    model: str
    quantization: str
    device: str
    dtype: str
    prompt: str
    chat: bool
    prompt_tokens: int
    generated_token_ids: list[int]
    uncached_token_ids: list[int]
    tokens_equal: bool  # the two loops picked the same tokens (they must, up to float ties)
    text: str
    cached_tokens_per_s: float
    uncached_tokens_per_s: float
    speedup: float  # cached / uncached tokens per second
    steps: list[KVStep]
    cache_positions: int  # positions the cache holds at the end (prompt + generated − 1)
    cache_bytes: int  # KVCache.nbytes() at the end
    bytes_per_token: float  # measured: cache_bytes / cache_positions
    formula_bytes_per_token: int  # 2 × layers × kv_heads × head_dim × bytes per element
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_element: int
    formula: str  # the formula with its numbers, for display
    note: str = ""  # e.g. the cap on the length, when it applied
    stopped: str = ""  # why the report ended early ("" when complete); speeds then cover the steps both loops ran


def kv_geometry(lm: Model) -> tuple[int, int, int, int]:
    """(layers, kv_heads, head_dim, bytes per element) from the model config and compute dtype."""
    geo = kv_quant.geometry(lm.model.config, lm.dtype)
    return geo.layers, geo.kv_heads, geo.head_dim, geo.bytes_per_element


def uncached_steps(lm: Model, prompt_ids: Sequence[int], config: DecodingConfig, *,
                   control: RunControl | None = None) -> Iterator[tuple[int, float]]:
    """The nanoGPT loop: feed the WHOLE sequence at every step, take the argmax. Yields each
    generated id and the milliseconds its step took; ``control`` is checked before every forward."""
    stopper = StopCheck(lm, config)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=lm.device)  # [1, S]
    generated: list[int] = []
    while True:
        check(control)
        start = time.perf_counter()
        with torch.inference_mode():
            logits = lm.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1, :]  # [1, V]
        token = int(logits.argmax(-1))
        generated.append(token)
        yield token, (time.perf_counter() - start) * 1000
        if stopper.reason(generated) is not None:
            return
        ids = torch.cat([ids, torch.tensor([[token]], device=lm.device)], dim=1)  # [1, S + 1]


def checked_stream(lm: Model, prompt_ids: Sequence[int], config: DecodingConfig, cache: KVCache | None,
                   control: RunControl | None) -> Iterator[StepTrace]:
    """``decode.stream`` with ``control`` checked before each forward (``cache``: None, a fresh one)."""
    check(control)
    for step in decode.stream(lm, prompt_ids, config, cache=cache):
        yield step
        check(control)


def capped(max_new_tokens: int, cap: int, why: str) -> tuple[int, str]:
    """(the length to run, a note saying so when the cap applied)."""
    if max_new_tokens <= cap:
        return max_new_tokens, ""
    return cap, f"capped at {cap} of the {max_new_tokens} tokens asked: {why}"


def kv_cache_report(lm: Model, prompt: str, chat: bool = False, max_new_tokens: int = 32, *,
                    control: RunControl | None = None) -> KVReport:
    """Greedy with the KV cache (``decode.stream``, trace capture included) vs without it.
    ``control`` is checked before every forward of both loops; stopped during the uncached loop, the
    report covers the steps both loops ran and says so in ``stopped`` (earlier, RunStopped is raised)."""
    n, note = capped(max_new_tokens, MAX_UNCACHED_TOKENS, "the uncached loop is quadratic in the length")
    config = greedy_config(n)
    prompt_ids = lm.encode(prompt, chat)
    check_prompt(prompt_ids)
    check(control)
    with torch.inference_mode():  # one throw-away forward, so neither loop pays first-call costs
        lm.model(input_ids=torch.tensor([prompt_ids], device=lm.device), use_cache=False, logits_to_keep=1)
    cache = KVCache(lm.model)
    cached = list(checked_stream(lm, prompt_ids, config, cache, control))
    uncached_ids, uncached_ms, stopped = [], [], ""
    try:
        for token, ms in uncached_steps(lm, prompt_ids, config, control=control):
            uncached_ids.append(token)
            uncached_ms.append(ms)
    except RunStopped as exc:
        stopped = f"{exc} during the uncached loop, after {len(uncached_ids)} of {len(cached)} tokens"
    cached_ms = [b - a for a, b in zip([0.0] + [s.elapsed_ms for s in cached], [s.elapsed_ms for s in cached])]
    layers, kv_heads, head_dim, width = kv_geometry(lm)
    formula = 2 * layers * kv_heads * head_dim * width
    both = len(uncached_ms)  # steps both loops ran: the speeds compare like with like
    cached_rate = timing(cached).tokens_per_s if not stopped else _rate(both, cached_ms[:both])
    uncached_rate = _rate(both, uncached_ms)
    ids = [s.chosen_token_id for s in cached]
    return KVReport(
        model=lm.name, quantization=lm.quantization, device=str(lm.device), dtype=str(lm.dtype).removeprefix("torch."),
        prompt=prompt, chat=chat, prompt_tokens=len(prompt_ids), generated_token_ids=ids,
        uncached_token_ids=uncached_ids,
        tokens_equal=ids[:both] == uncached_ids, text=lm.decode(ids), cached_tokens_per_s=cached_rate,
        uncached_tokens_per_s=uncached_rate, speedup=cached_rate / uncached_rate if uncached_rate else 0.0,
        steps=[KVStep(i, len(prompt_ids) + i, c, uncached_ms[i] if i < both else None) for i, c in enumerate(cached_ms)],
        cache_positions=cache.length, cache_bytes=cache.nbytes(),
        bytes_per_token=cache.nbytes() / cache.length if cache.length else 0.0, formula_bytes_per_token=formula,
        layers=layers, kv_heads=kv_heads, head_dim=head_dim, bytes_per_element=width,
        formula=(f"2 × {layers} layers × {kv_heads} kv heads × {head_dim} head dim × {width} bytes "
                 f"= {formula:,} bytes"), note=note, stopped=stopped,
    )


def _rate(tokens: int, ms: Sequence[float]) -> float:
    """Tokens per second over steps that took ``ms`` milliseconds in all."""
    return tokens / (sum(ms) / 1000) if sum(ms) > 0 else 0.0


# ------------------------------------------------------------------------------ KV cache kinds' drift

KV_DRIFT_METHOD = (
    "Teacher-forced: each cache kind is fed the full-precision run's tokens one by one, and its next-token "
    "distribution at every step is compared with the full-precision one (KL(p_ref || p_kind) in nats, total "
    "variation, top-1 agreement). Free-running: each kind decodes greedily on its own; its first divergence is "
    "the first step where its tokens leave the full-precision run's, and its speed and memory come from that run."
)


@dataclass
class KVKindDrift:
    """One KV cache kind: its drift (teacher-forced), its own greedy run (free-running), its bytes."""

    kind: str  # dynamic | quantized-int8 | quantized-int4 | sliding-<N>
    residual_length: int  # quantized kinds: positions kept unquantized
    positions: list[PositionDrift]  # teacher-forced, one per reference token
    mean_kl: float
    max_kl: float
    mean_tv: float
    top1_agreement: float
    generated_token_ids: list[int]  # free-running
    text: str
    first_divergence: int | None  # free-running vs the reference; None if it never leaves it
    tokens_per_s: float  # free-running, trace capture included
    memory_bytes: list[int]  # cache bytes when each free-running token was picked
    memory_positions: list[int]  # positions the cache stood for then (prompt + tokens before)
    cache_positions: int  # at the end of the teacher-forced pass: prompt + reference − 1
    stored_positions: int  # of those, held (a sliding window drops the oldest)
    quantized_positions: int  # of those, quantized (the rest is the full-precision residual)
    cache_bytes: int  # measured from the cache's tensors (packed integers, scales, zeros)
    formula_bytes: int  # the layout's formula for the same positions
    bytes_per_token: float  # measured: cache_bytes / cache_positions
    formula_bytes_per_token: float  # per position in the kind's long-term layout
    formula: str


@dataclass
class KVDriftReport:
    model: str
    prompt: str
    chat: bool
    device: str
    dtype: str
    max_new_tokens: int  # tokens run (after the cap)
    prompt_token_ids: list[int]
    reference_token_ids: list[int]  # greedy with the full-precision dynamic cache
    reference_tokens: list[str]
    reference_text: str
    requested: list[str]
    kinds: list[KVKindDrift] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # kind -> why it could not be measured
    method: str = KV_DRIFT_METHOD
    note: str = ""  # the cap, when it applied
    stopped: str = ""  # why the report ended before every kind was measured ("" when complete)


@torch.inference_mode()
def teacher_forced_cached_logits(lm: Model, prompt_ids: Sequence[int], continuation: Sequence[int],
                                 cache: KVCache, control: RunControl | None = None) -> torch.Tensor:
    """Next-token logits [T, V] (float32) through ``cache``: prefill the prompt, then feed the
    continuation one token per forward (as decoding does); row t picked continuation[t]."""
    check(control)
    rows = [cache.sync(list(prompt_ids))]
    for token in continuation[:-1]:
        check(control)
        rows.append(cache.step([token]))
    return torch.cat(rows)  # [T, V]


def measure_kind(lm: Model, prompt_ids: Sequence[int], ref_ids: Sequence[int], ref_logits: torch.Tensor,
                 kind: str, residual_length: int, control: RunControl | None = None) -> KVKindDrift:
    """Drift, own greedy run and bytes of one cache kind against the reference run."""
    config = greedy_config(len(ref_ids)).replace(kv_cache=kind, kv_residual_length=residual_length)
    cache = KVCache(lm.model, kind, residual_length)
    own, memory, held = [], [], []
    for step in checked_stream(lm, prompt_ids, config, cache, control):
        own.append(step)
        memory.append(cache.nbytes())
        held.append(cache.length)
    forced = KVCache(lm.model, kind, residual_length)
    positions = compare_logits(ref_logits, teacher_forced_cached_logits(lm, prompt_ids, ref_ids, forced, control),
                               ref_ids, lm.token_text)
    counts = kv_quant.cache_bytes(forced.cache)
    geo = kv_quant.geometry(lm.model.config, lm.dtype)
    own_ids = [s.chosen_token_id for s in own]
    n = max(1, len(positions))
    return KVKindDrift(
        kind=kind, residual_length=residual_length, positions=positions,
        mean_kl=sum(p.kl for p in positions) / n, max_kl=max((p.kl for p in positions), default=0.0),
        mean_tv=sum(p.tv for p in positions) / n, top1_agreement=sum(p.top1_agrees for p in positions) / n,
        generated_token_ids=own_ids, text=lm.decode(own_ids), first_divergence=first_divergence([list(ref_ids), own_ids]),
        tokens_per_s=timing(own).tokens_per_s, memory_bytes=memory, memory_positions=held,
        cache_positions=counts.positions, stored_positions=counts.stored_positions,
        quantized_positions=counts.quantized_positions, cache_bytes=counts.total,
        formula_bytes=kv_quant.expected_bytes(geo, kind, counts), bytes_per_token=counts.per_position,
        formula_bytes_per_token=kv_quant.formula_bytes_per_token(geo, kind), formula=kv_quant.formula_text(geo, kind),
    )


def stream_kv_drift(lm: Model, prompt: str, chat: bool = False, max_new_tokens: int = 32,
                    kinds: Sequence[str] = ("dynamic", "quantized-int8", "quantized-int4"), residual_length: int = 32,
                    *, control: RunControl | None = None) -> Iterator[KVDriftReport]:
    """Yield the report after the reference run, then again as each kind finishes (the same object,
    growing). A kind that cannot be built for this model is recorded in ``errors``."""
    requested = [kv_quant.parse_kind(k).name for k in dict.fromkeys(kinds)]
    n, note = capped(max_new_tokens, MAX_KV_DRIFT_TOKENS, "every kind decodes the continuation twice")
    prompt_ids = lm.encode(prompt, chat)
    check_prompt(prompt_ids)
    reference = list(checked_stream(lm, prompt_ids, greedy_config(n), KVCache(lm.model), control))
    ref_ids = [s.chosen_token_id for s in reference]
    check(control)
    ref_logits = teacher_forced_logits(lm, prompt_ids, ref_ids)  # one forward, no cache: the yardstick
    report = KVDriftReport(
        model=lm.name, prompt=prompt, chat=chat, device=str(lm.device), dtype=str(lm.dtype).removeprefix("torch."),
        max_new_tokens=n, prompt_token_ids=list(prompt_ids), reference_token_ids=ref_ids,
        reference_tokens=[s.chosen_token for s in reference], reference_text=lm.decode(ref_ids),
        requested=requested, note=note,
    )
    yield report
    try:
        for kind in requested:
            try:
                report.kinds.append(measure_kind(lm, prompt_ids, ref_ids, ref_logits, kind, residual_length, control))
            except (ValueError, ImportError) as exc:
                report.errors[kind] = str(exc)
            yield report
    except RunStopped as exc:
        report.stopped = str(exc)
        yield report


def kv_drift_report(lm: Model, prompt: str, chat: bool = False, max_new_tokens: int = 32,
                    kinds: Sequence[str] = ("dynamic", "quantized-int8", "quantized-int4"), residual_length: int = 32,
                    *, control: RunControl | None = None) -> KVDriftReport:
    """The whole KV drift report (see ``stream_kv_drift``)."""
    return last(stream_kv_drift(lm, prompt, chat, max_new_tokens, kinds, residual_length, control=control))
