"""The deployment's settings: every ``DP_*`` environment variable (and the platform's ``SPACE_ID`` /
``SPACES_ZERO_GPU``) in one table, ``SETTINGS``, read by one function per kind.

- ``flag``: ``1 / true / yes / on`` is on, ``0 / false / no / off`` is off (any case), unset or
  empty is the setting's default; anything else raises ``SettingsError`` naming the variable.
- ``text``, ``list`` (comma-separated, blanks and repeats dropped) and ``choice`` (one of the listed
  words): surrounding spaces are ignored; unset or empty is the default.
- ``int``: a whole number at or above the setting's minimum; ``seconds``: a number >= 0 (0: no limit).
- ``platform``: set by Hugging Face, not by the operator; read as "set" / "not set" and never refused.

Readers run at call time (tests and ``app.py``'s deployment defaults change the environment), and
each takes an optional ``environ`` mapping instead of ``os.environ``. ``check_environment`` reads
every setting once when the app starts, so a bad value refuses to start with one line instead of
starting and failing every run (``DP_MAX_BATCH=0`` used to start with concurrency 16, then every run
failed). Machine-dependent numeric defaults (``DP_MAX_BATCH``...) live with the code that uses them;
the table's ``default`` says what they are.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass
from typing import Mapping

Environ = Mapping[str, str]

# The public Hub copy of the embedded model (a Space cannot build the embedded model's package).
HUB_DEFAULT = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The one list of larger Hub models a GPU deployment offers (instruct models that fit any Space GPU
# in bf16): the default DP_MODELS on a GPU, locally (engine.backends.registry) and on a Space (app.py).
GPU_HUB_MODELS = (
    "HuggingFaceTB/SmolLM2-360M-Instruct",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen/Qwen2.5-1.5B-Instruct",
)

# engine.backends.local.QUANTIZATIONS, spelled out here so that reading the settings imports no torch (a test keeps them equal)
QUANTIZATION_CHOICES = ("none", "int8", "nf4", "rtn-g64", "gptq-g64", "awq-g64", "rtn-g32", "gptq-g32", "awq-g32",
                        "gptq-g64-code", "awq-g64-code")

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One environment variable. ``default``: the value an unset variable reads as (None where it
    depends on the machine or the deployment; ``shown`` then says what it is). ``minimum`` bounds an
    ``int``; ``choices`` a ``choice``."""

    name: str
    kind: str  # flag | text | list | choice | int | seconds | platform
    default: bool | str | int | float | None
    does: str
    shown: str = ""
    minimum: int | None = None
    choices: tuple[str, ...] = ()

    @property
    def default_text(self) -> str:
        """The default as docs/deployment.md's table shows it."""
        if self.shown:
            return self.shown
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        if self.default in (None, ""):
            return "unset"
        return f"`{self.default}`" if isinstance(self.default, str) else f"{self.default:g}"


SETTINGS = (
    # Who may load what.
    Setting("DP_PUBLIC", "flag", False, "public mode: only the allow-listed models load, local models never, "
            "and `app.py` sets the public limits", shown="off (always on when `SPACE_ID` is set)"),
    Setting("DP_MODEL", "text", "", "the model the page starts with (always allowed): `embedded`, a directory "
            "or a Hub id; also `app.py --model`",
            shown=f"`embedded` (`{HUB_DEFAULT}` where the embedded model is not installed)"),
    Setting("DP_MODELS", "list", "", "models the page and API may load (besides `DP_MODEL`)",
            shown="`embedded`, plus the GPU list on a GPU; in public mode the embedded model where "
                  f"installed, `{HUB_DEFAULT}`, plus the GPU list on a GPU"),
    Setting("DP_ALLOW_LOCAL_MODELS", "flag", False, "the page and API may load any directory or Hub id "
            "(ignored in public mode)"),
    Setting("DP_REMOTE_MODELS", "list", "", "remote models the operator allows, `backend:url` each "
            "(`llamacpp:http://127.0.0.1:8080`, `openai:http://host:8000/v1#vocab=V&eos=A+B`, `&top=N`, `&draws=1` "
            "for a vLLM with our logits processor, `&tokenizer=embedded` for one serving the embedded model: "
            "docs/remote.md); never typed by a page user"),
    Setting("DP_QUANTIZATION", "choice", "none", "the default model's quantization at start; "
            "also `app.py --quantization`", choices=QUANTIZATION_CHOICES),
    Setting("DP_DTYPE", "choice", "auto", "the models' dtype; `auto`: float32 on CPU, bfloat16/float16 on a GPU",
            choices=("auto", "float32", "bfloat16", "float16")),
    # Limits.
    Setting("DP_MAX_BATCH", "int", None, "greedy/sampling runs stepped together in one batched forward",
            shown="16 on CPU, 32 on GPU", minimum=1),
    Setting("DP_MAX_QUEUE", "int", 256, "runs waiting for a batch row (a Compare lane is a run)",
            shown="256 (128 in public mode)", minimum=0),
    Setting("DP_PREFILL_CHUNK", "int", 256, "prompt tokens prefilled per tick for a longer prompt, between the "
            "batch's decode forwards (0: one forward)", minimum=0),
    Setting("DP_PRESENTER_SHARE", "int", 4, "while a presenter's lesson run is in the batch, the room's rows are "
            "forwarded every this many ticks (the presenter's every tick; 1: the room's every tick too)", minimum=1),
    Setting("DP_CONCURRENCY", "int", None, "model events running at once", shown="= `DP_MAX_BATCH`", minimum=1),
    Setting("DP_SERVED_CONCURRENCY", "int", 16, "runs on served models (DP_REMOTE_MODELS) at once, besides "
            "`DP_CONCURRENCY`: a slow server never holds the local model's slots; one more is refused in one line",
            minimum=1),
    Setting("DP_STEP_VERIFY_TOKENS", "int", 32, "step mode on a served model: most tokens of the server's "
            "greedy continuation asked per request, streamed and verified by our chain as they arrive (the same "
            "tokens and trace as one request per token; at most 64; greedy with no stage asks them at once, any "
            "other run 4 first, then "
            "twice what the last request kept, at most 8); 0: one request per token", minimum=0),
    Setting("DP_QUEUE_SIZE", "int", 64, "requests waiting in Gradio's queue", shown="64 (100 in public mode)",
            minimum=1),
    Setting("DP_MODEL_MEMORY_MB", "int", 0, "megabytes (10^6 bytes) the loaded models may keep together: the page's "
            "models, their quantized variants, drafters and amateurs, and a report's variants while it runs (it releases "
            "them); past it the least recently used model is evicted, and a load that cannot fit is refused in one line "
            "(0: no limit)", shown="0: no limit (6000 in public mode)", minimum=0),
    Setting("DP_SESSIONS", "int", 500, "browser/API sessions whose state the server keeps", minimum=1),
    Setting("DP_RUNS_PER_SESSION", "int", 3, "model requests one page or API client may have in flight",
            minimum=1),
    Setting("DP_REQUEST_SECONDS", "seconds", 120.0, "time limit of one request (0: none); it stops with its "
            "partial trace", shown="120 (60 in public mode)"),
    Setting("DP_GPU_SECONDS", "int", 120, "ZeroGPU booking per request, in seconds", shown="120 (60 in public mode)",
            minimum=1),
    # Features and files.
    Setting("DP_EXAMPLES", "flag", True, "example runs at startup for a first screen that already teaches "
            "(always off on ZeroGPU)"),
    Setting("DP_WHATIF_ROUTE", "flag", True, "the page's what-if goes to `POST /dp/whatif`; off: through "
            "Gradio's events only (a proxy that passes only Gradio's own paths)"),
    Setting("DP_DOWNLOAD_DIR", "text", "", "where the private download folder is made", shown="the system temp folder"),
    Setting("DP_BROWSER_SECRET", "text", "decoding-playground-presets-v1", "the key the browser encrypts stored "
            "presets with"),
    Setting("DECODING_PLAYGROUND_CACHE", "text", "", "where the embedded model's safetensors conversion, the "
            "llama-server build and the vLLM environment are kept",
            shown="`~/.cache/decoding-playground`"),
    Setting("QUANTIZE_VENV", "text", "", "the llm-compressor environment deploy/quantize.sh makes the 4-bit "
            "checkpoints with (the Lessons' maker reuses one already installed)",
            shown="`llmcompressor-0.14` in the cache folder"),
    # Set by Hugging Face.
    Setting("SPACE_ID", "platform", None, "a Hugging Face Space: public mode, listen on 0.0.0.0", shown="unset"),
    Setting("SPACES_ZERO_GPU", "platform", None, "a ZeroGPU Space: model events run under `spaces.GPU`, no "
            "startup examples", shown="unset"),
)
BY_NAME = {s.name: s for s in SETTINGS}
# name -> smallest allowed value (read by the tests and docs/deployment.md's table).
INTEGER_SETTINGS = {s.name: s.minimum or 0 for s in SETTINGS if s.kind == "int"}  # no minimum: 0
SECONDS_SETTINGS = {s.name for s in SETTINGS if s.kind == "seconds"}


class SettingsError(ValueError):
    """An environment variable holds a value the app cannot run with."""


def _setting(name: str, kind: str) -> Setting:
    setting = BY_NAME.get(name)
    if setting is None or setting.kind != kind:
        raise KeyError(f"{name} is not a {kind} setting in engine.settings.SETTINGS")
    return setting


def _text(name: str, environ: Environ | None) -> str:
    return (os.environ if environ is None else environ).get(name, "").strip()


def env_flag(name: str, environ: Environ | None = None) -> bool:
    """The on/off setting ``name``: 1/true/yes/on or 0/false/no/off (any case); unset or empty: its default."""
    default = bool(_setting(name, "flag").default)
    text = _text(name, environ).lower()
    if not text:
        return default
    if text in TRUE_WORDS or text in FALSE_WORDS:
        return text in TRUE_WORDS
    raise SettingsError(f"{name}: expected 1/true/yes/on or 0/false/no/off, got {text[:40]!r}")


def env_text(name: str, environ: Environ | None = None) -> str:
    """The text setting ``name``, stripped; unset or empty: its default."""
    return _text(name, environ) or str(_setting(name, "text").default)


def env_list(name: str, environ: Environ | None = None) -> tuple[str, ...]:
    """The comma-separated setting ``name``: its items stripped, blanks and repeats dropped, in order."""
    _setting(name, "list")
    items = (item.strip() for item in _text(name, environ).split(","))
    return tuple(dict.fromkeys(item for item in items if item))


def env_choice(name: str, environ: Environ | None = None) -> str:
    """The setting ``name``, one of its choices; unset or empty: its default."""
    setting = _setting(name, "choice")
    text = _text(name, environ)
    if not text:
        return str(setting.default)
    if text not in setting.choices:
        raise SettingsError(f"{name}: expected {' | '.join(setting.choices)}, got {text[:40]!r}")
    return text


def env_int(name: str, default: int, minimum: int | None = None, environ: Environ | None = None) -> int:
    """The integer setting ``name`` (unset or empty: ``default``). ``minimum`` defaults to the
    setting's entry in SETTINGS."""
    minimum = INTEGER_SETTINGS.get(name, 0) if minimum is None else minimum
    text = _text(name, environ)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise SettingsError(f"{name}: expected an integer >= {minimum}, got {text[:40]!r}") from None
    if value < minimum:
        raise SettingsError(f"{name}: expected an integer >= {minimum}, got {value}")
    return value


def env_seconds(name: str, default: float, environ: Environ | None = None) -> float:
    """A time limit in seconds (unset or empty: ``default``; 0 means none)."""
    text = _text(name, environ)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise SettingsError(f"{name}: expected a number of seconds >= 0, got {text[:40]!r}") from None
    if not value >= 0 or value == float("inf"):  # NaN fails the comparison
        raise SettingsError(f"{name}: expected a number of seconds >= 0, got {text[:40]!r}")
    return value


def on_space(environ: Environ | None = None) -> bool:
    """Whether this runs on a Hugging Face Space (``SPACE_ID`` set)."""
    return bool(_text("SPACE_ID", environ))


def zero_gpu_space(environ: Environ | None = None) -> bool:
    """Whether the platform says this is ZeroGPU (``SPACES_ZERO_GPU`` set, and not 0/false/no/off).
    The platform's value is never refused."""
    return _text("SPACES_ZERO_GPU", environ).lower() not in (*FALSE_WORDS, "")


def public_mode(environ: Environ | None = None) -> bool:
    """Public mode: ``DP_PUBLIC`` on, or any Hugging Face Space (``SPACE_ID`` set)."""
    return env_flag("DP_PUBLIC", environ) or on_space(environ)


READERS = {"flag": env_flag, "text": env_text, "list": env_list, "choice": env_choice}


def check_environment(environ: Environ | None = None) -> None:
    """Read every setting once; the first bad one raises SettingsError (one line)."""
    for setting in SETTINGS:
        if setting.kind == "int":
            env_int(setting.name, 0, environ=environ)
        elif setting.kind == "seconds":
            env_seconds(setting.name, 0.0, environ=environ)
        elif setting.kind in READERS:
            READERS[setting.kind](setting.name, environ)


def cache_root() -> Path:
    """Where slow one-off work is cached, outside the repo: the converted model, llama-server, vLLM's
    environment, the 4-bit checkpoints (env ``DECODING_PLAYGROUND_CACHE``, default
    ~/.cache/decoding-playground)."""
    return Path(env_text("DECODING_PLAYGROUND_CACHE") or Path.home() / ".cache" / "decoding-playground")
