"""Structured output: the ``grammar`` stage (a JSON schema, a regular expression or a GBNF grammar)
masks every token the grammar forbids, and ends the run when the grammar is complete.

The grammar is compiled for the model's tokenizer by LLGuidance (``llguidance``, the library behind
vLLM's ``guidance`` backend and llama.cpp's ``%llguidance`` grammars): its lexer and parser work
lazily under fuel limits (``LIMITS``), so a hostile grammar costs a bounded amount per step and
cannot hang a worker; the compile itself runs in a worker thread with a time limit
(``COMPILE_SECONDS``). Compiled grammars are cached per tokenizer, at most ``MAX_COMPILED`` of
them (the tokenizers' own tables: ``MAX_TOKENIZERS``).

The matcher's state is a function of the tokens generated so far (``input_ids`` after the prompt),
so the stage derives it from them at every call: its matcher is rolled back to the tokens it shares
with the ids it is given and fed the rest. A what-if at step k, a branch and a resumed run therefore
mask exactly as the run did at that step, with nothing to carry in the trace; rows of a beam each
get their own prefix. A generated token the grammar refuses (a branch forced off it) puts the row
"off the grammar" from there: nothing is masked after it, and the records say so.

A model loaded here masks its whole vocabulary (the tokenizer's tokens as LLGuidance sees them);
a served model in step mode has only its top-N with finite logits, and the stage checks each of
them byte by byte against the grammar (``BYTES``): an allowed token outside the top-N cannot be
drawn, and a step where none of them is allowed ends the run, said (``GrammarDeadEnd``).

Its records per step (row 0): ``allowed`` (tokens the grammar allows), ``complete`` (the text is a
whole string of the grammar: the end of text is allowed), ``ended`` (only the end of text is left),
``off_grammar_at`` (the step whose forced token left the grammar), ``wanted_id`` / ``wanted_p`` (the
most likely token before the mask, when the grammar forbids it) and ``log_allowed_mass`` (ln of the
mass the grammar allows; summed over a run it is the grammar's cost, ``grammar_cost``).
"""

from __future__ import annotations

import json
import math
import shlex
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import llguidance
import llguidance.hf
from llguidance import gbnf_to_lark
import numpy as np
import torch

from engine.sampling import NoTokensLeft
from engine.stages.base import Stage
from engine.stages.spec import (BuildContext, ConfigError, Export, Interop, Knob, Served, StageSpec, quoted, register,
                                token_names)

if TYPE_CHECKING:
    from engine.config import DecodingConfig
    from engine.trace import StageTrace, StepTrace

KINDS = ("json_schema", "regex", "gbnf")
KIND_WORDS = {"json_schema": "JSON schema", "regex": "regular expression", "gbnf": "GBNF grammar"}
MAX_GRAMMAR_CHARS = 4_000  # a grammar travels in presets (16 KiB) and share links (6,000 characters packed)
COMPILE_SECONDS = 10.0
MAX_COMPILED = 32  # compiled grammars kept (per tokenizer and text)
MAX_TOKENIZERS = 4  # LLGuidance's table of a tokenizer: ~1-2 s to build, so it is kept
MAX_CANDIDATES = 1_000  # step mode: the most top-N tokens checked byte by byte at a step
# LLGuidance's resource limits (its defaults, tightened): per-step lexer fuel ~14k/ms and Earley items
# ~20k/ms bound a mask's time; the grammar's size and the lexer's states bound its memory.
LIMITS = dict(max_items_in_row=2_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=100_000, max_grammar_size=200_000)
KEY = "grammar"  # the knob every message names


class GrammarDeadEnd(NoTokensLeft):
    """A step where the grammar allows none of the tokens there are (a served model's top-N): the
    run ends there ("no_tokens_left"), and the message says why."""

    def __init__(self, step: int, candidates: int):
        self.step = step
        Exception.__init__(self, f"step {step}: the grammar allows none of the server's top {candidates} tokens (an "
                                 "allowed token outside them cannot be drawn); the run ends there")


def one_line(text: str, limit: int = 300) -> str:
    """A library's (multi-line) message as one line of at most ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


# --- LLGuidance's view of a tokenizer ---------------------------------------------------------------
class _Bytes:
    """A tokenizer of the 256 bytes and an end token (id 256), for a served model whose vocabulary
    we do not have: its top-N tokens are checked byte by byte (``BYTES``)."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


_lock = threading.Lock()
_tokenizers: OrderedDict[int, tuple[Any, Any]] = OrderedDict()  # id(tokenizer) -> (weakref to it, LLTokenizer)
_bytes_tokenizer: list[Any] = []


def byte_level(tokenizer: Any) -> bool:
    """Whether the stage checks tokens byte by byte: a tokenizer without a vocabulary LLGuidance can
    read (a served model's, engine.backends.served.RemoteTokenizer), not a Hugging Face fast one."""
    return not hasattr(tokenizer, "backend_tokenizer")


def llg_tokenizer(tokenizer: Any) -> Any:
    """LLGuidance's table of ``tokenizer`` (built once per tokenizer object, at most MAX_TOKENIZERS
    kept), or the byte tokenizer for one it cannot read (``byte_level``)."""
    with _lock:
        if byte_level(tokenizer):
            if not _bytes_tokenizer:
                _bytes_tokenizer.append(llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes())))
            return _bytes_tokenizer[0]
        found = _tokenizers.get(id(tokenizer))
        if found is not None and found[0]() is tokenizer:
            _tokenizers.move_to_end(id(tokenizer))
            return found[1]
    try:
        table = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    except (ValueError, TypeError) as exc:
        raise ConfigError(KEY, f"this model's tokenizer cannot be read for a grammar ({one_line(exc, 120)})") from None
    with _lock:
        _tokenizers[id(tokenizer)] = (weakref.ref(tokenizer), table)
        while len(_tokenizers) > MAX_TOKENIZERS:
            _tokenizers.popitem(last=False)
    return table


# --- compiling ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Compiled:
    """A grammar compiled for a tokenizer: ``template`` is a matcher at the start (never fed; each
    stage deep-copies it), ``vocab`` the tokenizer's vocabulary size, ``eos`` its end token,
    ``table`` LLGuidance's table it was compiled for (held, so the cache's key, its id, stays its)."""

    kind: str
    text: str
    template: Any  # llguidance.LLMatcher
    vocab: int
    eos: int
    bytes_only: bool
    table: Any = None


_compiled: OrderedDict[tuple, Compiled] = OrderedDict()
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dp-grammar")


# Every tokenization of a grammar's strings is allowed, as vLLM's xgrammar and llama.cpp's GBNF
# sampler allow them: LLGuidance by default lets only the canonical token through where the grammar
# forces its bytes ("forcing"), which would hide the model's own choice there and make the tokens'
# language differ from the servers' (and from the distortion view's enumeration).
NO_FORCING = '%llguidance {"no_forcing": true}'


def grammar_source(kind: str, text: str) -> str:
    """LLGuidance's grammar (Lark) for ``text`` of ``kind``; ConfigError naming ``grammar`` when it
    does not parse (a schema that is not JSON, a GBNF rule that is not defined)."""
    if kind not in KINDS:
        raise ConfigError("grammar_kind", f"expected one of {' | '.join(KINDS)}, got {kind!r:.40}")
    if not text.strip():
        raise ConfigError(KEY, "empty; give a JSON schema, a regular expression or a GBNF grammar")
    if kind == "json_schema":
        schema = json.dumps(parse_schema(text), ensure_ascii=False)
        return llguidance.LLMatcher.grammar_from_lark(f"{NO_FORCING}\nstart: %json {schema}")
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_lark(f"{NO_FORCING}\nstart: /{llguidance.regex_to_lark(text)}/")
    try:
        lark = gbnf_to_lark.any_to_lark(text)
    except Exception as exc:  # noqa: BLE001 (its parser raises bare exceptions of several kinds)
        raise ConfigError(KEY, f"this {KIND_WORDS[kind]} does not parse: {one_line(exc)}") from None
    lark = lark.removeprefix("%llguidance {}")
    return llguidance.LLMatcher.grammar_from_lark(f"{NO_FORCING}\n{lark}")


def parse_schema(text: str) -> dict:
    """A JSON schema's text as a JSON object (strict: no NaN, no duplicate keys kept silently)."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        schema = json.loads(text, parse_constant=refuse)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(KEY, f"the JSON schema is not valid JSON: {one_line(exc, 160)}") from None
    if not isinstance(schema, dict):
        raise ConfigError(KEY, f"a JSON schema is a JSON object, got a JSON {type(schema).__name__}")
    return schema


def _compile(kind: str, text: str, table: Any, bytes_only: bool) -> Compiled:
    source = grammar_source(kind, text)
    matcher = llguidance.LLMatcher(table, source, log_level=0, limits=llguidance.LLParserLimits(**LIMITS))
    if matcher.is_error():
        raise ConfigError(KEY, f"this {KIND_WORDS[kind]} does not compile: {one_line(matcher.get_error())}")
    allowed = unpack(matcher.compute_bitmask(), table.vocab_size)  # the first mask: also warms the lexer
    if matcher.is_error() and matcher.get_error().startswith("NoExtensionBias"):  # no byte can start it
        raise ConfigError(KEY, f"this {KIND_WORDS[kind]} matches nothing: no token can start it")
    if matcher.is_error():
        raise ConfigError(KEY, f"this {KIND_WORDS[kind]} went past its resource limits at the first token: "
                               f"{one_line(matcher.get_error())}")
    allowed[table.eos_token] = False
    if not bool(allowed.any()):
        what = "matches only the empty text" if matcher.is_accepting() else "matches nothing"
        raise ConfigError(KEY, f"this {KIND_WORDS[kind]} {what}: no token can start it")
    return Compiled(kind, text, matcher, table.vocab_size, table.eos_token, bytes_only, table)


def compile_grammar(kind: str, text: str, tokenizer: Any) -> Compiled:
    """``text`` of ``kind`` compiled for ``tokenizer`` (cached; in a worker thread with a time limit
    of COMPILE_SECONDS). Every failure is a ConfigError naming ``grammar`` in one line: a schema that
    does not compile, a regular expression that matches nothing, a grammar no token can start, one
    too large to compile in time."""
    table = llg_tokenizer(tokenizer)
    key = (id(table), kind, text)
    with _lock:
        found = _compiled.get(key)
        if found is not None:
            _compiled.move_to_end(key)
            return found
    future = _pool.submit(_compile, kind, text, table, byte_level(tokenizer))
    try:
        compiled = future.result(timeout=COMPILE_SECONDS)
    except FutureTimeout:
        raise ConfigError(KEY, f"this {KIND_WORDS.get(kind, 'grammar')} did not compile within {COMPILE_SECONDS:g} s; "
                               "make it smaller") from None
    with _lock:
        _compiled[key] = compiled
        while len(_compiled) > MAX_COMPILED:
            _compiled.popitem(last=False)
    return compiled


def unpack(bitmask: bytes, vocab: int) -> torch.Tensor:
    """LLGuidance's bitmask (bit i of byte i // 8 = token i allowed) as a bool tensor [vocab]."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:vocab]
    return torch.from_numpy(bits.astype(bool))


# --- the stage ------------------------------------------------------------------------------------------
class Grammar(Stage):
    """Mask the tokens ``compiled`` forbids after the tokens generated so far (``input_ids`` after
    the first ``prompt_length``), row by row; the end of text (``eos_token_ids``) is allowed exactly
    when the grammar is complete, and is all that is left once nothing can follow. ``tokenizer``:
    for a byte-level grammar (a served model), each candidate token's text."""

    name = "grammar"

    def __init__(self, compiled: Compiled, prompt_length: int = 0, eos_token_ids: Sequence[int] = (),
                 tokenizer: Any = None):
        super().__init__(grammar_kind=compiled.kind)  # the text stays in the run's config, not on every step
        self.compiled, self.prompt_length, self.tokenizer = compiled, int(prompt_length), tokenizer
        self.eos = sorted({int(e) for e in eos_token_ids})
        self._matcher = compiled.template.deep_copy()
        self._fed: list[int] = []  # the generated tokens the matcher has taken, in order
        self._units: list[int] = []  # how many of the matcher's tokens each of them was (bytes: its length)
        self._off: tuple[int, int] | None = None  # (position, token) of the first generated token it refused
        self._texts: dict[int, list[int] | None] = {}  # byte mode: a token's bytes (None: not known exactly)

    def clone(self) -> "Grammar":
        twin = Grammar(self.compiled, self.prompt_length, self.eos, self.tokenizer)
        twin._texts = self._texts
        return twin

    def reset(self) -> None:
        super().reset()
        self._matcher, self._fed, self._units, self._off = self.compiled.template.deep_copy(), [], [], None

    # --- the matcher at a prefix ------------------------------------------------------------------------
    def _token_units(self, token: int) -> list[int] | None:
        """What the matcher is fed for ``token``: itself, or (byte mode) its bytes (None when its
        text is not known exactly: part of a character, shown as U+FFFD)."""
        if not self.compiled.bytes_only:
            return [token]
        if token not in self._texts:
            text = self.tokenizer.decode([token]) if self.tokenizer is not None else "\ufffd"
            self._texts[token] = None if "\ufffd" in text or not text else list(text.encode("utf-8"))
        return self._texts[token]

    def sync(self, generated: Sequence[int]) -> int | None:
        """Bring the matcher to the state after ``generated`` (rolled back to what it shares with
        the tokens it took, then fed the rest). Returns the position of the first token the grammar
        refuses (the row is off the grammar from there), else None."""
        shared = 0
        for a, b in zip(self._fed, generated):
            if a != b:
                break
            shared += 1
        if shared < len(self._fed):
            self._matcher.rollback(sum(self._units[shared:]))
            del self._fed[shared:], self._units[shared:]
            self._off = None
        if self._off is not None:
            at, token = self._off
            if len(generated) > at and generated[at] == token:
                return at
            self._off = None
        for at in range(len(self._fed), len(generated)):
            units = self._token_units(int(generated[at]))
            if not units or self._matcher.validate_tokens(units) != len(units):
                self._off = (at, int(generated[at]))
                return at
            self._matcher.consume_tokens(units)
            self._fed.append(int(generated[at]))
            self._units.append(len(units))
        return None

    def _allowed(self, logits_row: torch.Tensor) -> torch.Tensor:
        """The tokens [V] the grammar allows next (the matcher synced), the end of text included
        when the grammar is complete."""
        vocab = logits_row.shape[-1]
        allowed = torch.zeros(vocab, dtype=torch.bool)
        if self.compiled.bytes_only:
            candidates = torch.isfinite(logits_row).nonzero().flatten().tolist()[:MAX_CANDIDATES]
            for token in candidates:
                units = None if token in self.eos else self._token_units(token)
                allowed[token] = bool(units) and self._matcher.validate_tokens(units) == len(units)
        else:
            mask = unpack(self._matcher.compute_bitmask(), self.compiled.vocab)[:vocab]
            allowed[: mask.shape[0]] = mask
            if self.compiled.eos < vocab:
                allowed[self.compiled.eos] = False
        if self._matcher.is_error():
            raise ConfigError(KEY, f"the grammar went past its resource limits after {len(self._fed)} generated "
                                   f"tokens: {one_line(self._matcher.get_error())}")
        if self._matcher.is_stopped():
            allowed[:] = False
        accepting = self._matcher.is_accepting()
        for e in self.eos:
            if e < vocab:
                allowed[e] = accepting
        return allowed.to(logits_row.device)

    # --- a call ---------------------------------------------------------------------------------------------
    def apply(self, input_ids, logits):
        out = logits.clone()
        found: dict[str, Any] = {}
        for b in range(logits.shape[0]):
            generated = input_ids[b, self.prompt_length:].tolist() if input_ids is not None else []
            off = self.sync(generated)
            if off is not None:  # a forced token left the grammar: nothing to mask after it
                row = {"allowed": int(torch.isfinite(logits[b]).sum()), "complete": False, "ended": False,
                       "off_grammar_at": off, "wanted_id": None, "wanted_p": None, "log_allowed_mass": 0.0}
            else:
                allowed = self._allowed(logits[b])
                row = self._facts(logits[b], allowed, len(generated))
                out[b] = self._masked(logits[b], allowed)
            if b == 0:
                found = row
        return out, found

    def _masked(self, logits_row: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``logits_row`` [V] with the forbidden tokens at -inf. When only the end of text is
        allowed and every one of its ids was already masked (a served model's top-N without it),
        the first gets logit 0: the grammar is complete, and the end is the only way on."""
        out = logits_row.masked_fill(~allowed, float("-inf"))
        ends = [e for e in self.eos if e < out.shape[0] and bool(allowed[e])]
        if ends and int(allowed.sum()) == len(ends) and not bool(torch.isfinite(out[ends]).any()):
            out[ends[0]] = 0.0
        return out

    def _facts(self, logits_row: torch.Tensor, allowed: torch.Tensor, step: int) -> dict[str, Any]:
        """The call's records for one row (see the module docstring); GrammarDeadEnd when a
        byte-level step allows none of its candidates."""
        count = int(allowed.sum())
        ended = self._matcher.is_stopped()
        if count == 0 and self.compiled.bytes_only:  # a model loaded here: the pick says "no tokens left"
            raise GrammarDeadEnd(step, int(torch.isfinite(logits_row).sum()))
        logp = torch.log_softmax(logits_row.double(), dim=-1)  # [V]
        finite = torch.isfinite(logp) & allowed
        log_allowed = float(torch.logsumexp(logp[finite], dim=0)) if bool(finite.any()) else None
        top = int(torch.argmax(logp))
        wanted = not bool(allowed[top]) and math.isfinite(float(logp[top]))
        return {"allowed": count, "complete": bool(self._matcher.is_accepting()), "ended": bool(ended),
                "off_grammar_at": None, "wanted_id": top if wanted else None,
                "wanted_p": math.exp(float(logp[top])) if wanted else None,
                "log_allowed_mass": min(0.0, log_allowed) if log_allowed is not None and math.isfinite(log_allowed)
                else None}


def _build(config: "DecodingConfig", ctx: BuildContext) -> Grammar:
    if ctx.tokenizer is None:
        raise ConfigError(KEY, "a grammar needs the model's tokenizer")
    compiled = compile_grammar(config.grammar_kind, config.grammar, ctx.tokenizer)
    return Grammar(compiled, ctx.prompt_length, ctx.eos_token_ids, ctx.tokenizer)


# --- what the room reads ------------------------------------------------------------------------------
def _wanted(stage: "StageTrace") -> tuple[str, float] | None:
    """(text, p) of the most likely token before the mask, when the grammar forbade it."""
    token_id, p = stage.params.get("wanted_id"), stage.params.get("wanted_p")
    if token_id is None or not isinstance(p, (int, float)):
        return None
    text = next((t.token for t in stage.removed if t.token_id == token_id), f"token {token_id}")
    return text, float(p)


def _note(stage: "StageTrace") -> str:
    params = stage.params
    if params.get("off_grammar_at") is not None:
        return (f"grammar: off the grammar since step {params['off_grammar_at']} (a forced token it does not allow); "
                "nothing masked")
    if params.get("ended"):
        return "grammar: complete; only the end of text is allowed"
    allowed = params.get("allowed")
    allowed = allowed if isinstance(allowed, int) and not isinstance(allowed, bool) else stage.kept
    wanted = _wanted(stage)
    parts = [f"the model wanted {quoted(wanted[0])} at {wanted[1]:.0%}"] if wanted else []
    if allowed <= 3 and stage.top:
        parts.append(f"the grammar allows only {token_names(stage.top)}")
    else:
        parts.append(f"the grammar allows {allowed:,} tokens")
    if stage.mass_removed > 0:
        parts.append(f"{stage.mass_removed:.1%} of the mass was on tokens it forbids")
    else:
        parts.append("nothing the model wanted was forbidden")
    if params.get("complete"):
        parts.append("the text is complete here: it may end")
    return "grammar: " + "; ".join(parts)


def _heading(stage: "StageTrace") -> str:
    return f"grammar ({KIND_WORDS.get(stage.params.get('grammar_kind'), 'structured output')}): forbidden tokens masked"


@dataclass(frozen=True)
class GrammarFacts:
    """What the grammar did at one step, for the room: how many tokens it allowed, the mass the
    model had put on the others, the token the model wanted most when forbidden (text, p), the
    chosen token's probability before and after the mask (None where the trace does not hold it),
    and the records' flags and ln(allowed mass)."""

    allowed: int
    forbidden_mass: float
    wanted: tuple[str, float] | None
    chosen_before: float | None
    chosen_after: float | None
    complete: bool
    ended: bool
    off_grammar_at: int | None
    log_allowed_mass: float | None


def _prob_at(step: "StepTrace", index: int) -> float | None:
    """The chosen token's probability after ``step.stages[index]`` (raw: the step's raw_prob)."""
    stage = step.stages[index]
    hit = next((t.prob for t in stage.top if t.token_id == step.chosen_token_id), None)
    if hit is not None:
        return hit
    return step.raw_prob if index == 0 else stage.chosen_prob


def grammar_facts(step: "StepTrace") -> GrammarFacts | None:
    """The grammar stage's facts at ``step`` (None when the step has no grammar stage)."""
    index = next((i for i, s in enumerate(step.stages) if s.name == "grammar"), None)
    if index is None or index == 0:
        return None
    stage, params = step.stages[index], step.stages[index].params
    allowed = params.get("allowed")
    log_mass = params.get("log_allowed_mass")
    return GrammarFacts(
        allowed=allowed if isinstance(allowed, int) and not isinstance(allowed, bool) else stage.kept,
        forbidden_mass=stage.mass_removed, wanted=_wanted(stage), chosen_before=_prob_at(step, index - 1),
        chosen_after=_prob_at(step, index), complete=bool(params.get("complete")), ended=bool(params.get("ended")),
        off_grammar_at=params.get("off_grammar_at"),
        log_allowed_mass=float(log_mass) if isinstance(log_mass, (int, float)) else None)


def grammar_cost(steps: Sequence["StepTrace"]) -> float | None:
    """The grammar's cost over a run: the sum over steps of ln(the mass it allowed), in nats (<= 0;
    masked decoding multiplied the text's probability by exp(-cost) over the unmasked chain's).
    None when no step has a grammar stage."""
    found = [f.log_allowed_mass for f in (grammar_facts(s) for s in steps) if f is not None]
    if not found:
        return None
    return sum(x for x in found if x is not None)


# --- other tools --------------------------------------------------------------------------------------
def yaml_quoted(text: str) -> str:
    """``text`` as a YAML double-quoted scalar (YAML 1.1 and 1.2 read it back exactly): quotes,
    backslashes and every character YAML would not keep as itself (controls, line separators, BOM,
    surrogates) escaped."""
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    out = []
    for ch in text:
        code = ord(ch)
        if ch in escapes:
            out.append(escapes[ch])
        elif code < 0x20 or 0x7F <= code < 0xA0 or code in (0x2028, 0x2029, 0xFEFF, 0xFFFE, 0xFFFF) \
                or 0xD800 <= code < 0xE000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def compact_schema(text: str) -> str:
    """A JSON schema's text on one line (as written when it is not JSON: the tool will say why)."""
    try:
        return json.dumps(parse_schema(text), separators=(",", ":"), ensure_ascii=False)
    except ConfigError:
        return " ".join(text.split())


def _llama_lines(c: "DecodingConfig", view: Any) -> list[str]:
    if c.grammar_kind == "json_schema":
        return [f"--json-schema {shlex.quote(compact_schema(c.grammar))}"]
    return [f"--grammar {shlex.quote(c.grammar)}"] if c.grammar_kind == "gbnf" else []


NO_REGEX = ("takes a GBNF grammar or a JSON schema, not a regular expression: write the pattern as a GBNF rule "
            "(root ::= ...)")


def _llama_unmapped(c: "DecodingConfig", view: Any) -> list[tuple[str, str]]:
    return [(KEY, f"llama.cpp {NO_REGEX}")] if c.grammar_kind == "regex" else []


def _webui_lines(c: "DecodingConfig", view: Any) -> list[str]:
    return [f"grammar_string: {yaml_quoted(c.grammar)}"] if c.grammar_kind == "gbnf" else []


def _webui_unmapped(c: "DecodingConfig", view: Any) -> list[tuple[str, str]]:
    if c.grammar_kind == "json_schema":
        return [(KEY, "text-generation-webui takes a GBNF grammar (grammar_string), not a JSON schema: convert it with "
                      "llama.cpp's json_schema_to_grammar.py")]
    if c.grammar_kind == "regex":
        return [(KEY, f"text-generation-webui {NO_REGEX}")]
    return []


def _webui_caveat(c: "DecodingConfig", view: Any) -> str | None:
    if c.grammar_kind != "gbnf":
        return None
    return ("text-generation-webui applies grammar_string from a preset to API requests that name it; its Parameters "
            "tab does not load it from a preset: paste the grammar into its Grammar box")


# Fast mode: the grammar in a server's own request, so its implementation constrains.
VLLM_FIELDS = {"json_schema": "json", "regex": "regex", "gbnf": "grammar"}  # vLLM's structured_outputs keys
STEP_CAVEAT = ("the grammar is checked on the server's top-N only, byte by byte: an allowed token outside them cannot be "
               "drawn, a token that is part of a character counts as forbidden, and a step where none is allowed "
               "ends the run")


def server_fields(config: "DecodingConfig", server: str) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The request fields that make a server constrain its own decoding to ``config``'s grammar, and
    (knob, reason) for what it cannot take. ``server``: "llamacpp" (llama-server, native or its /v1:
    ``grammar`` / ``json_schema``) or "vllm" (``structured_outputs``). None without a grammar."""
    if "grammar" not in config.active_stages():
        return {}, []
    kind, text = config.grammar_kind, config.grammar
    value: Any = parse_schema(text) if kind == "json_schema" else text
    if server == "vllm":
        return {"structured_outputs": {VLLM_FIELDS[kind]: value}}, []
    if kind == "regex":
        return {}, [(KEY, f"llama.cpp {NO_REGEX}; the server ran unconstrained")]
    return {"json_schema" if kind == "json_schema" else "grammar": value}, []


def _check_text(key: str, value: str) -> str:
    if value and not value.strip():
        raise ConfigError(key, "only whitespace; give a grammar, or leave it empty for none")
    return value


register(StageSpec(
    "grammar", order=15, group="structured", label="grammar", label_value=False,
    knobs=(Knob("grammar", "text", "", 0, MAX_GRAMMAR_CHARS, check=_check_text,
                doc="Structured output: the output must match this grammar (a JSON schema, a regular expression or "
                    "a GBNF grammar, as grammar_kind says); tokens it forbids are masked at every step, and the run "
                    "ends when it is complete. Empty = off."),
           Knob("grammar_kind", "choice", "json_schema", choices=KINDS,
                doc="What the grammar is: json_schema (a JSON schema), regex (a regular expression the whole output "
                    "matches) or gbnf (llama.cpp's GBNF, its rule root).")),
    build=_build,
    note=_note,
    heading=_heading,
    interop=Interop(webui=Export(lines=_webui_lines, unmapped=_webui_unmapped, caveat=_webui_caveat),
                    llama=Export(lines=_llama_lines, unmapped=_llama_unmapped), export_all_knobs=True),
    # fast mode: the server's own grammar constrains (llama-server: json_schema / grammar on /completion and its
    # /v1; vLLM: structured_outputs); step mode: our mask over the server's top-N (STEP_CAVEAT)
    served=Served(llamacpp=lambda c, context: server_fields(c, "llamacpp")[0],
                  openai=lambda c: server_fields(c, "vllm")[0],
                  openai_llamacpp=lambda c: server_fields(c, "llamacpp")[0],
                  refused=lambda c, server: server_fields(c, server)[1],
                  step_caveats=(STEP_CAVEAT,)),
    oracle="tests/test_grammar.py::test_mask_equals_the_languages_prefixes_by_hand "
           "tests/test_grammar.py::test_every_output_validates_at_every_seed "
           "tests/test_grammar_remote.py::test_greedy_json_schema_equals_llama_servers",
))
