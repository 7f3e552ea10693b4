"""Which models a page may use and the process's loaded models: ``ModelPolicy`` (the operator's
allow-list, served models included), ``ModelRegistry`` (loaded and connected models, least recently
used evicted, their bytes bounded by ``DP_MODEL_MEMORY_MB``) and the variants of a loaded model
(drafters, amateurs).
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from engine.backends import quant_methods
from engine.backends.local import (EMBEDDED, LoadedModel, ModelLoadError, ModelSpec, Progress, load_model,
                                   resolve_device, resolve_dtype)
from engine.backends.remote import connect_spec
from engine.base.seam import Model, Models
from engine.backends.served import BACKENDS, RemoteSpec, allowed_remote_models
from engine.config import ConfigError, check_text
from engine.settings import GPU_HUB_MODELS, env_flag, env_int, env_list, env_text, public_mode

T = TypeVar("T")

@dataclass(frozen=True)
class ModelPolicy:
    """Which model sources the web page and the API may load (the CLI is unrestricted).

    ``allowed``: exact sources always allowed. ``allow_local``: the operator's flag; then any local
    directory or Hub id is allowed too (never in public mode). Messages never say whether a path
    exists: a refused source gets the same answer whatever it names."""

    allowed: tuple[str, ...] = (EMBEDDED,)
    public: bool = False
    allow_local: bool = False

    def check(self, source: Any, key: str = "model") -> str:
        """``source`` if this policy allows it, else ModelLoadError naming ``key``. A ``model:<x>``
        drafter or amateur value is checked as ``<x>``."""
        try:
            source = check_text(key, source, max_len=500)
        except ConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        name = source[len("model:"):] if source.startswith("model:") else source
        if is_remote_source(name):  # a server: only from the operator's list, never loaded as a drafter or amateur
            if source.startswith("model:"):  # (a served target's drafter is engine.strategies.remote_speculative's, not loaded)
                raise ModelLoadError(f"{key}: {REMOTE_VARIANT}, got {name[:60]!r}")
            if name in self.allowed:
                return source
            hint = "" if self.public else " (the operator lists servers in DP_REMOTE_MODELS)"
            raise ModelLoadError(f"{key}: {name[:60]!r} is not a remote model offered here{hint}")
        if name in self.allowed or (self.allow_local and not self.public and name.strip()):
            return source
        shown = name if len(name) <= 60 else name[:57] + "..."
        hint = "" if self.public else " (the operator can allow more with DP_MODELS or DP_ALLOW_LOCAL_MODELS=1)"
        raise ModelLoadError(f"{key}: {shown!r} is not offered here; allowed: {', '.join(self.allowed)}{hint}")

    def with_models(self, *sources: str) -> "ModelPolicy":
        """This policy with more allowed sources (the app's own default model, for instance)."""
        extra = tuple(s for s in sources if s and s not in self.allowed)
        return ModelPolicy(self.allowed + extra, self.public, self.allow_local)


def is_remote_source(source: str) -> bool:
    """Whether ``source`` names a served model (``llamacpp:...``, ``openai:...``; engine.backends)."""
    return source.startswith(tuple(f"{b}:" for b in BACKENDS))


def model_policy() -> ModelPolicy:
    """The policy from the environment: ``DP_PUBLIC=1`` (automatic when ``SPACE_ID`` is set),
    ``DP_MODELS`` (comma-separated allow-list; default: the embedded model, plus
    settings.GPU_HUB_MODELS when a CUDA GPU is present), ``DP_ALLOW_LOCAL_MODELS=1`` (ignored in public
    mode), ``DP_REMOTE_MODELS`` (served models, engine.backends.served.allowed_remote_models). ``DP_MODEL``, the
    operator's default model, is always allowed."""

    public = public_mode()
    listed = env_list("DP_MODELS")
    if listed:
        allowed = listed
    else:
        allowed = (EMBEDDED, *GPU_HUB_MODELS) if torch.cuda.is_available() else (EMBEDDED,)
    default = env_text("DP_MODEL")
    policy = ModelPolicy(allowed, public=public, allow_local=env_flag("DP_ALLOW_LOCAL_MODELS") and not public)
    policy = policy.with_models(*(str(spec) for spec in allowed_remote_models()))
    return policy.with_models(default) if default else policy


# --- memory: the bytes the loaded models keep ---------------------------------------------------------
MB = 1_000_000
MEMORY_SETTING = "DP_MODEL_MEMORY_MB"
# Public mode's default: a 16 GB machine (a free CPU Space) holds the app itself (about 1 GB with no model),
# DP_SESSIONS' pages (at most 0.75 GB), the runs' caches and a loading model's transient copy beside it.
PUBLIC_MODEL_MEMORY_MB = 6000
ROOM_WAIT_S = 20.0  # a load waits this long for running requests to free the memory it needs, then is refused


def model_memory_budget() -> int:
    """Bytes the loaded models may keep together: ``DP_MODEL_MEMORY_MB`` × 10^6 (default
    PUBLIC_MODEL_MEMORY_MB in public mode; 0, no limit, otherwise)."""
    return env_int(MEMORY_SETTING, PUBLIC_MODEL_MEMORY_MB if public_mode() else 0) * MB


def model_bytes(lm: Any) -> int:
    """What a loaded model keeps: its weights and buffers as computed with, and oneDNN's packed copies of
    its float32 Linear weights (a served model keeps none here)."""
    return int(getattr(lm, "memory_bytes", 0) or 0) + int(getattr(lm, "kernel_bytes", 0) or 0)


def estimated_bytes(float_lm: Any, quantization: str) -> int:
    """What ``quantization`` of ``float_lm``'s model (a loaded float model: its weights are read here; same
    device and dtype) will keep,
    from its parameter counts: a 4-bit checkpoint is dequantized at load (the float model's bytes);
    int8 keeps a byte and nf4 half a byte (plus a float32 absmax per 64) per Linear weight, one float32
    scale per row; embeddings and norms stay in the float dtype, and the float output layer is packed
    again where the float model's layers were."""
    if quantization == "none" or quant_methods.is_checkpoint_variant(quantization):
        return model_bytes(float_lm)
    head = float_lm.model.get_output_embeddings()
    linears = [m for m in float_lm.model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    weights, rows = sum(m.weight.numel() for m in linears), sum(m.weight.shape[0] for m in linears)
    per_weight = {"int8": 1.0, "nf4": 0.5 + 4 / 64}[quantization]
    packed_head = head.weight.numel() * 4 if float_lm.kernel_bytes and head is not None else 0
    rest = float_lm.memory_bytes - weights * float_lm.dtype.itemsize
    return int(rest + weights * per_weight + 4 * rows + packed_head)


def megabytes(n: int) -> str:
    return f"{n / MB:,.0f} MB"


def trim_heap() -> None:
    """Give freed heap memory back to the system: glibc keeps a freed model's smaller tensors in its
    arenas (an int8 variant of the embedded model left ~250 MB of RSS behind without this)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


_REGISTRIES: "weakref.WeakSet[ModelRegistry]" = weakref.WeakSet()


def _fresh_locks_after_fork() -> None:
    """In a forked child (ZeroGPU runs each request in one) only the forking thread exists: a lock
    another thread held at the fork would stay held forever, so the child gets fresh ones."""
    for registry in list(_REGISTRIES):
        registry._lock = threading.Lock()
        registry._room = threading.Condition(registry._lock)


@dataclass(frozen=True)
class _Loaded:
    """A model this registry loaded, held weakly: its bytes count while anything keeps it alive."""

    ref: "weakref.ref[Any]"
    spec: ModelSpec
    nbytes: int


class ModelRegistry:
    """The loaded models of this process (the only process-wide mutable state), least recently
    used evicted past ``capacity`` models or past ``memory_bytes`` bytes (``model_bytes`` of every
    model it loaded that is still alive: kept here, lent to a report, or evicted but still running a
    request; default ``model_memory_budget()``, 0: no limit). A load that would pass the budget evicts
    first; one that cannot fit is refused in one line (ModelLoadError naming DP_MODEL_MEMORY_MB).
    Thread-safe; a model is loaded once however many users ask.

    ``policy``: when set (the web app), every ``get`` checks the source against it first, so a
    ``model:<x>`` drafter or amateur named in a config or a share link is refused like a model.
    The registry holds the only strong references it creates: an evicted model is freed as soon as
    no running request uses it. Long-lived holders (sessions, drafters) keep a ``handle`` or a
    ``weakref.ref`` instead of the LoadedModel itself."""

    def __init__(self, capacity: int = 3, policy: ModelPolicy | None = None, memory_bytes: int | None = None):
        self.capacity = capacity
        self.policy = policy
        self.memory_bytes = model_memory_budget() if memory_bytes is None else memory_bytes
        self._models: dict[ModelSpec, LoadedModel] = {}
        self._alive: dict[int, _Loaded] = {}  # id(model) -> the model held weakly, and its bytes
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # loads waiting for memory; notified when a lent model goes
        _REGISTRIES.add(self)

    def get(self, spec: ModelSpec, progress: Progress | None = None, *, key: str = "model") -> LoadedModel:
        """The model of ``spec``, loaded on first use and kept; a served model (``llamacpp:``/``openai:``,
        engine.backends) is connected to once, outside the lock (a slow server holds up no other
        model), and a failed connection (RemoteError, one line) is not kept."""
        return self._get(spec, progress, key, keep=True)

    def lend(self, spec: ModelSpec, use: Callable[[LoadedModel], T], *, key: str = "model") -> T:
        """``use(model)`` on the model of ``spec``, which is not kept: a model this registry keeps is
        lent as it is; any other is loaded for ``use`` alone (counted in the budget while it lives)
        and released when ``use`` returns, its memory given back to the system. A report's variants
        go this way, so no report leaves a model behind."""
        kept = self.peek(spec) is not None
        lm = self._get(spec, None, key, keep=False)
        try:
            return use(lm)
        finally:
            if not kept:
                del lm  # freed now unless another request uses it too (a load short of room collects cycles)
                trim_heap()
                with self._room:
                    self._room.notify_all()

    def check_room(self, need: int, what: str, key: str = "model") -> None:
        """ModelLoadError naming ``key`` when ``need`` bytes (what a report keeps at once: its model and
        the largest variant it loads) are more than the budget: refused before anything is built."""
        if self.memory_bytes and need > self.memory_bytes:
            raise ModelLoadError(f"{key}: {what} needs about {megabytes(need)} of models in memory at once, more than "
                                 f"the {megabytes(self.memory_bytes)} this server allows "
                                 f"({MEMORY_SETTING}; the operator can raise it)")

    def held_bytes(self) -> int:
        """Bytes of the models this registry loaded that are still alive (kept, lent, or still in use)."""
        with self._lock:
            return self._held()

    def handle(self, spec: ModelSpec) -> "ModelHandle":
        """A small object a session can keep for hours: ``handle.get()`` re-resolves the model
        through this registry (reloading it if it was evicted) and never pins it in memory."""
        return ModelHandle(self, spec)

    def loaded(self) -> list[ModelSpec]:
        with self._lock:
            return list(self._models)

    def peek(self, spec: ModelSpec) -> LoadedModel | None:
        """The model of ``spec`` if it is loaded, else None (never loads, never reorders)."""
        with self._lock:
            return self._models.get(spec)

    # --- inside: ``_get`` takes the lock; the methods after it run with the lock held -----------------
    def _get(self, spec: ModelSpec, progress: Progress | None, key: str, keep: bool) -> LoadedModel:
        if self.policy is not None:
            self.policy.check(spec.source, key)
        connected = connect_remote(spec) if is_remote_source(spec.source) and self.peek(spec) is None else None
        with self._lock:
            kept = self._models.pop(spec, None)
            lm = kept or connected or self._still_alive(spec)  # an evicted or lent model in use: no second copy
            if lm is None:
                lm = self._load(spec, progress, key)
            if keep or kept is not None:
                self._models.pop(spec, None)
                self._models[spec] = lm  # most recent last
                self._evict(spec)
            return lm

    def _load(self, spec: ModelSpec, progress: Progress | None, key: str) -> LoadedModel:
        """Load ``spec`` after making room for it (its bytes estimated from its float model when that is
        alive); a model that turns out not to fit is dropped and refused."""
        self._held()  # forgets the models freed since: without a budget nothing else would
        need = self._estimate(spec)
        if need is not None:
            self._make_room(need, spec, key)
            waited = self._models.get(spec) or self._still_alive(spec)  # loaded by another request meanwhile
            if waited is not None:
                return waited
        lm = load_model(spec, progress)
        trim_heap()  # a load's temporaries (bitsandbytes quantizes from the float weights) leave heap behind
        nbytes = model_bytes(lm)
        if need is None and self.memory_bytes:
            try:
                self._make_room(nbytes, spec, key)
            except ModelLoadError:
                del lm
                trim_heap()
                raise
        self._alive[id(lm)] = _Loaded(weakref.ref(lm), spec, nbytes)
        return lm

    def _held(self) -> int:
        for ident in [i for i, entry in self._alive.items() if entry.ref() is None]:
            del self._alive[ident]
        return sum(entry.nbytes for entry in self._alive.values())

    def _still_alive(self, spec: ModelSpec) -> LoadedModel | None:
        """A model this registry loaded for ``spec`` (or for the same model on the same device and dtype:
        ``self-int8``'s spec names them, the page's ``int8`` says ``auto``) that something still uses."""
        where = _placed(spec)
        for entry in list(self._alive.values()):
            lm = entry.ref()
            if lm is not None and (entry.spec == spec or (
                    where is not None and (lm.source, lm.quantization, lm.device, lm.dtype) == where)):
                return lm
        return None

    def _estimate(self, spec: ModelSpec) -> int | None:
        """``spec``'s bytes from its float model when that is alive (same source, device, dtype), else None."""
        where = _placed(ModelSpec(spec.source, "none", spec.device, spec.dtype))
        if not self.memory_bytes or where is None:
            return None
        for entry in list(self._alive.values()):
            lm = entry.ref()
            if lm is not None and (lm.source, lm.quantization, lm.device, lm.dtype) == where:
                return estimated_bytes(lm, spec.quantization)
        return None

    def _evict(self, newest: ModelSpec) -> None:
        """Drop the least recently used models past the count, then past the budget (never ``newest``)."""
        evicted = 0
        while len(self._models) > self.capacity:
            self._models.pop(next(iter(self._models)))
            evicted += 1
        while self.memory_bytes and self._held() > self.memory_bytes and len(self._models) > 1:
            self._models.pop(next(s for s in self._models if s != newest))
            evicted += 1
        if evicted:
            trim_heap()

    def _make_room(self, need: int, spec: ModelSpec, key: str) -> None:
        """Evict until ``need`` more bytes fit the budget; wait up to ROOM_WAIT_S for running requests to
        free what they hold (the lock is released meanwhile); then ModelLoadError, one line."""
        if not self.memory_bytes:
            return
        what = f"{spec.source[:60]!r}" + ("" if spec.quantization == "none" else f" as {spec.quantization}")
        if need > self.memory_bytes:
            raise ModelLoadError(f"{key}: {what} needs about {megabytes(need)} in memory, more than the "
                                 f"{megabytes(self.memory_bytes)} this server allows its models "
                                 f"({MEMORY_SETTING}; the operator can raise it)")
        deadline = time.monotonic() + ROOM_WAIT_S
        collected = False
        while self._held() + need > self.memory_bytes:
            evictable = [s for s in self._models if s != spec]
            if evictable:
                self._models.pop(evictable[0])
                trim_heap()
                continue
            if not collected:  # a model in a reference cycle is freed only by the collector
                gc.collect()
                trim_heap()
                collected = True
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise ModelLoadError(f"{key}: {what} needs about {megabytes(need)} in memory, and running requests "
                                     f"hold {megabytes(self._held())} of the {megabytes(self.memory_bytes)} this "
                                     f"server allows its models ({MEMORY_SETTING}); try again when they end")
            self._room.wait(min(left, 0.5))  # a lent model's release notifies at once


def _placed(spec: ModelSpec) -> tuple[str, str, torch.device, torch.dtype] | None:
    """(source, quantization, device, dtype) of the model ``spec`` loads, ``auto`` resolved; None for a
    served model or a device or dtype that load_model will refuse (in its own words)."""
    if is_remote_source(spec.source):
        return None
    try:
        device = resolve_device(spec.device)
        return spec.source, spec.quantization, device, resolve_dtype(spec.dtype, device)
    except ModelLoadError:
        return None


def connect_remote(spec: ModelSpec) -> Any:
    """The RemoteModel a served model's spec names (engine.backends.remote.connect_spec; its source was
    checked by the caller's policy)."""
    return connect_spec(RemoteSpec.parse(spec.source))


@dataclass(frozen=True)
class ModelHandle:
    """A registry and a spec: what a session keeps instead of a LoadedModel."""

    registry: ModelRegistry
    spec: ModelSpec

    def get(self, progress: Progress | None = None) -> LoadedModel:
        return self.registry.get(self.spec, progress)


# --- variants of a loaded model: drafters and amateurs --------------------------------------------------
SELF_VARIANTS = ("self-int8", "self-nf4") + tuple(f"self-{name}" for name in quant_methods.WEIGHT_METHODS)
REMOTE_VARIANT = "a remote model cannot be a drafter or amateur of a model loaded here (it drafts only for a remote target)"


def variant_spec(lm: Model, name: str, key: str) -> ModelSpec:
    """The ModelSpec of ``self-int8 | self-nf4 | self-<checkpoint variant> | model:<id or dir>`` on ``lm``'s device and dtype
    (so a drafter and an amateur of one target share a registry entry). ConfigError naming ``key``
    for any other name."""
    if name in SELF_VARIANTS:
        source, quantization = lm.source, name.removeprefix("self-")
    elif isinstance(name, str) and name.startswith("model:") and name != "model:":
        source, quantization = name.removeprefix("model:"), "none"
        if is_remote_source(source):  # the registry would connect to it: a server has no weights to draft with here
            raise ConfigError(key, f"{REMOTE_VARIANT}, got {source[:60]!r}")
    else:
        raise ConfigError(key, f"expected {' | '.join(SELF_VARIANTS)} | model:<id or dir>, got {name!r}")
    dtype = str(lm.dtype).removeprefix("torch.")
    return ModelSpec(source, quantization, device=str(lm.device),
                     dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "auto")


def check_same_tokenizer(target: Model, other: Model, key: str, label: str | None = None) -> None:
    """ConfigError naming ``key`` unless ``other``'s token ids mean what ``target``'s mean: the
    same vocabulary, and an output layer scoring every token of it."""
    label = label or other.name
    if target.tokenizer is not other.tokenizer:
        tv, ov = target.tokenizer.get_vocab(), other.tokenizer.get_vocab()
        if tv != ov:
            differing = sorted(set(tv.items()) ^ set(ov.items()), key=lambda kv: kv[1])[:3]
            raise ConfigError(key, (
                f"{label!r} ({other.name}) uses a different tokenizer than {target.name!r} (a different vocabulary: "
                f"{len(ov)} vs {len(tv)} tokens; first differences {differing}); the {key} must share its tokenizer"))
    if other.vocab_size < len(target.tokenizer):
        raise ConfigError(key, (
            f"{label!r} ({other.name}) scores {other.vocab_size} tokens but the tokenizer has {len(target.tokenizer)}; "
            f"the {key} must score every token of {target.name!r}'s vocabulary"))


def resolve_variant(lm: Model, name: str, registry: Models, key: str) -> Model:
    """The model a ``self-int8 | self-nf4 | model:<x>`` value names, loaded through ``registry`` (so
    its allow-list applies, errors naming ``key``) on ``lm``'s device and dtype, and checked to share
    ``lm``'s tokenizer. Raises ConfigError (bad name, other tokenizer) or ModelLoadError."""
    other = registry.get(variant_spec(lm, name, key), key=key)
    check_same_tokenizer(lm, other, key, name)
    return other


os.register_at_fork(after_in_child=_fresh_locks_after_fork)
