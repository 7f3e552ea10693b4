"""Which models a page may use and the process's loaded models: ``ModelPolicy`` (the operator's
allow-list, served models included), ``ModelRegistry`` (loaded and connected models, least recently
used evicted) and the variants of a loaded model (drafters, amateurs).
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from engine.backends import quant_methods
from engine.backends.local import (EMBEDDED, LoadedModel, ModelLoadError, ModelSpec, Progress, load_model)
from engine.backends.remote import connect_spec
from engine.backends.served import BACKENDS, RemoteSpec, allowed_remote_models
from engine.config import ConfigError, check_text
from engine.settings import GPU_HUB_MODELS, env_flag, env_list, env_text, public_mode

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


_REGISTRIES: "weakref.WeakSet[ModelRegistry]" = weakref.WeakSet()


def _fresh_locks_after_fork() -> None:
    """In a forked child (ZeroGPU runs each request in one) only the forking thread exists: a lock
    another thread held at the fork would stay held forever, so the child gets fresh ones."""
    for registry in list(_REGISTRIES):
        registry._lock = threading.Lock()


class ModelRegistry:
    """The loaded models of this process (the only process-wide mutable state), least recently
    used evicted past ``capacity``. Thread-safe; a model is loaded once however many users ask.

    ``policy``: when set (the web app), every ``get`` checks the source against it first, so a
    ``model:<x>`` drafter or amateur named in a config or a share link is refused like a model.
    The registry holds the only strong references it creates: an evicted model is freed as soon as
    no running request uses it. Long-lived holders (sessions, drafters) keep a ``handle`` or a
    ``weakref.ref`` instead of the LoadedModel itself."""

    def __init__(self, capacity: int = 3, policy: ModelPolicy | None = None):
        self.capacity = capacity
        self.policy = policy
        self._models: dict[ModelSpec, LoadedModel] = {}
        self._lock = threading.Lock()
        _REGISTRIES.add(self)

    def get(self, spec: ModelSpec, progress: Progress | None = None, *, key: str = "model") -> LoadedModel:
        """The model of ``spec``, loaded on first use; a served model (``llamacpp:``/``openai:``,
        engine.backends) is connected to once, outside the lock (a slow server holds up no other
        model), and a failed connection (RemoteError, one line) is not kept."""
        if self.policy is not None:
            self.policy.check(spec.source, key)
        connected = connect_remote(spec) if is_remote_source(spec.source) and self.peek(spec) is None else None
        with self._lock:
            lm = self._models.pop(spec, None) or connected
            if lm is None:
                lm = load_model(spec, progress)
            self._models[spec] = lm  # most recent last
            while len(self._models) > self.capacity:
                self._models.pop(next(iter(self._models)))
            return lm

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


def variant_spec(lm: LoadedModel, name: str, key: str) -> ModelSpec:
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


def check_same_tokenizer(target: LoadedModel, other: LoadedModel, key: str, label: str | None = None) -> None:
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


def resolve_variant(lm: LoadedModel, name: str, registry: ModelRegistry, key: str) -> LoadedModel:
    """The model a ``self-int8 | self-nf4 | model:<x>`` value names, loaded through ``registry`` (so
    its allow-list applies, errors naming ``key``) on ``lm``'s device and dtype, and checked to share
    ``lm``'s tokenizer. Raises ConfigError (bad name, other tokenizer) or ModelLoadError."""
    other = registry.get(variant_spec(lm, name, key), key=key)
    check_same_tokenizer(lm, other, key, name)
    return other


os.register_at_fork(after_in_child=_fresh_locks_after_fork)
