"""Structured output: the ``grammar`` stage (a JSON schema, a regular expression or a GBNF grammar)
masks every token the grammar forbids, and ends the run when the grammar is complete.

The grammar is compiled for the model's tokenizer by LLGuidance (``llguidance``, the library behind
vLLM's ``guidance`` backend and llama.cpp's ``%llguidance`` grammars); the compile runs in a worker
thread with a time limit (``COMPILE_SECONDS``). Compiled grammars are cached per tokenizer, at most
``MAX_COMPILED`` of them (the tokenizers' own tables: ``MAX_TOKENIZERS``).

What a step costs. LLGuidance's fuel (``LIMITS``) counts its lexer's work and the Earley items a mask
pushes, not the completions an ambiguous grammar multiplies (each completed item scans the whole row
where it started), so its defaults let a 52-character grammar take seconds per mask. The stage
therefore (1) refuses at its compile a GBNF rule that derives itself with nothing around it (``x
::= x x`` with x able to match the empty text: infinitely ambiguous), (2) runs LLGuidance with its item
fuel tightened to where ambiguity trips it within a few tokens while every grammar we measured needs a
tenth of it, and (3) measures each step's matcher work (sync and mask) in CPU time and stops the run
with one line naming ``grammar`` past ``STEP_BUDGET_S`` at a step or ``RUN_BUDGET_S`` over the run
(``GrammarBudget``). The matcher's work runs in a small pool of threads (``MASK_WORKERS``; LLGuidance
drops the GIL while it computes a mask, not while it takes tokens): ``prepare`` starts the next
step's mask right after a pick, so the batched scheduler's next forward runs beside it, and a row
whose mask is late skips ticks while the others go on (engine/scheduler.py). A mask cannot be
interrupted: one past its budget ends its run at once, and its thread finishes it in the background.

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
import re
import shlex
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

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
# A grammar travels in presets (16 KiB, engine/presets.py) and share links (6,000 characters packed,
# engine/sharelink.py): 4,000 bytes of UTF-8 (no control characters but tab and newlines, so JSON
# escapes at most double it) fit both, whatever the characters: 4,000 emoji would be 16,000 bytes.
MAX_GRAMMAR_CHARS = 4_000
MAX_GRAMMAR_BYTES = 4_000
COMPILE_SECONDS = 10.0
MAX_COMPILED = 32  # compiled grammars kept (per tokenizer and text)
MAX_TOKENIZERS = 4  # LLGuidance's table of a tokenizer: ~1-2 s to build, so it is kept
MAX_CANDIDATES = 1_000  # step mode: the most top-N tokens checked byte by byte at a step
# LLGuidance's resource limits: its defaults but step_max_items (50,000 -> 5,000). The Earley items a
# mask may push: none of the grammars measured for issue #50 (the presets, llama.cpp's json.gbnf, a
# 30-field schema with anyOf and arrays, a 400-value enum, a 300-word alternation, C-like statements)
# needs over ~300 on 300-token random walks, while the 52-character ambiguous grammar of issue #50
# pushes 5,000 within ~7 tokens (masks of ~15 ms) but 50,000 only once its masks take seconds.
# Lexer fuel (~14k/ms) bounds a mask's lexing; the grammar's size and the lexer's states its memory.
LIMITS: dict[str, Any] = dict(max_items_in_row=2_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                              step_max_items=5_000, max_lexer_states=100_000, max_grammar_size=200_000)
# The CPU a grammar may take, whatever LLGuidance's fuel counts: per step (sync + mask) ~7x the
# slowest step of those grammars on a loaded 2-core machine (~7 ms), and per run ~2x the costliest
# of them over 1,024 tokens (~2.5 s: any JSON). CPU time, not wall time: waiting for a core on a
# busy machine is not the grammar's cost.
STEP_BUDGET_S = 0.05
RUN_BUDGET_S = 5.0
# Threads computing masks (LLGuidance drops the GIL there): two, so one slow mask does not hold up
# every other run's, and no more, so masks do not take the cores the forward runs on.
MASK_WORKERS = 2
POLL_S = 0.005  # how often a wait for a mask checks its budget
KEY = "grammar"  # the knob every message names
MESSAGE_CHARS = 280  # a message is one line of at most this many characters (playground/events.py)


class GrammarDeadEnd(NoTokensLeft):
    """A step where the grammar allows none of the tokens there are (a served model's top-N): the
    run ends there ("no_tokens_left"), and the message says why."""

    def __init__(self, step: int, candidates: int):
        self.step = step
        Exception.__init__(self, f"step {step}: the grammar allows none of the server's top {candidates} tokens (an "
                                 "allowed token outside them cannot be drawn); the run ends there")


class GrammarBudget(ConfigError):
    """The grammar's matcher went past its CPU budget (``STEP_BUDGET_S`` at a step, ``RUN_BUDGET_S``
    over the run): the run stops there. ``step``: the generated tokens before that step; ``scope``:
    "step" or "run"; ``seconds``: the CPU it had taken."""

    def __init__(self, step: int, scope: str, seconds: float):
        self.step, self.scope, self.seconds = step, scope, seconds
        if scope == "step":
            what = (f"its mask at step {step} took {seconds * 1000:,.0f} ms of CPU, over the "
                    f"{STEP_BUDGET_S * 1000:,.0f} ms budget per step")
        else:
            what = f"its masks took {seconds:.1f} s of CPU by step {step}, over the {RUN_BUDGET_S:g} s budget per run"
        super().__init__(KEY, f"{what} (an ambiguous grammar costs more at every token); the run stopped there")


def one_line(text: object, limit: int = 300) -> str:
    """A library's (multi-line) message as one line of at most ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def refusal(message: str) -> ConfigError:
    """ConfigError naming ``grammar`` whose whole message is one line within MESSAGE_CHARS."""
    return ConfigError(KEY, one_line(message, MESSAGE_CHARS - len(KEY) - 2))


_SOURCE_LINE = re.compile(r"^\s*(\d+ \||\^+\s*$)")  # LLGuidance's echo of the grammar: "  2 | start: ..." and "  ^"
_AT = re.compile(r"^at \d+\(\d+\): ")


def reason(error: str, limit: int = 150) -> str:
    """What is wrong, from LLGuidance's error: its echo of our wrapper grammar (``%llguidance`` and
    ``start:`` lines, carets) and of the pattern dropped, a regex's own reason kept ("unclosed
    group"), at most ``limit`` characters."""
    lines = [line for line in str(error).splitlines() if line.strip() and not _SOURCE_LINE.match(line)]
    if not lines:
        return "LLGuidance gave no reason"
    first = _AT.sub("", lines[0].strip())
    regex_error = next((line.strip()[len("error: "):] for line in lines if line.strip().startswith("error: ")), None)
    if regex_error is not None:
        where = "a pattern in it: " if first.startswith("failed to compile JSON schema") else ""
        return one_line(where + regex_error, limit)
    first = first.replace("failed to compile JSON schema: ", "").replace("parser error: ", "")
    first = first.replace("Parser Error: ", "")
    return one_line(first.split(" <state>")[0], limit)


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


# --- reading a grammar's text ------------------------------------------------------------------------
_LARK = re.compile(r"(?m)^[ \t]*(%[A-Za-z]+|[A-Za-z_][\w.-]*[ \t]*:(?!:=))")  # a directive or a Lark rule "name:"
# What made LLGuidance's converter take a text as Lark, not GBNF (its ``is_lark_syntax``): a directive or
# a ``start:`` rule at a line's start.
_LARK_MARKER = re.compile(r"(?m)^[ \t]*(%[A-Za-z]+|start[ \t]*:(?!:=))")


def refuse_lark(text: str, pattern: re.Pattern = _LARK) -> None:
    """ConfigError naming ``grammar`` ("not GBNF") when ``text`` holds Lark syntax (``pattern``:
    ``name:`` rules and ``%`` directives; at validation only ``_LARK_MARKER``), which llama.cpp
    answers with a 400."""
    lark = pattern.search(text)
    if lark is not None:
        raise refusal(f"not GBNF: {lark.group(1).strip()!r} on line {text.count(chr(10), 0, lark.start()) + 1} is "
                      "Lark syntax, which llama.cpp refuses; write rules as name ::= ..., without % directives")


def gbnf_rules(text: str) -> dict[str, Any]:
    """The rules of a GBNF grammar (llama.cpp's syntax), by name, as LLGuidance's converter parses
    them (``gbnf_to_lark.RuleNode``); ConfigError naming ``grammar`` when it is not GBNF (Lark's
    ``name:`` rules or ``%`` directives: llama.cpp refuses them) or does not parse."""
    refuse_lark(text)
    try:
        rules = gbnf_to_lark.GrammarParser().parse(text)
        if "root" not in rules:
            raise ValueError("no rule named root (llama.cpp starts there)")
        for name, node in _references(rules):
            if name not in rules:
                raise ValueError(f"rule {name!r} (used in {node!r}) is not defined")
    except Exception as exc:  # noqa: BLE001 (its parser raises bare exceptions of several kinds)
        raise refusal(f"this GBNF grammar does not parse: {one_line(exc, 160)}") from None
    return rules


def _children(node: Any) -> list[Any]:
    return list(node.children()) if node is not None else []


def _references(rules: dict[str, Any]) -> list[tuple[str, str]]:
    """(referenced rule, the rule that uses it) for every rule reference."""
    found = []
    for name, rule in rules.items():
        stack = _children(rule)
        while stack:
            node = stack.pop()
            if isinstance(node, gbnf_to_lark.RuleRefNode):
                found.append((node.name, name))
            stack.extend(_children(node))
    return found


def _nullable(node: Any, empty: set[str]) -> bool:
    """Whether ``node`` can match the empty text, given the rules known to (``empty``)."""
    if isinstance(node, gbnf_to_lark.LiteralNode):
        return node.value == ""
    if isinstance(node, gbnf_to_lark.RuleRefNode):
        return node.name in empty
    if isinstance(node, gbnf_to_lark.SequenceNode):
        return all(_nullable(n, empty) for n in node.nodes)
    if isinstance(node, gbnf_to_lark.AlternativeNode):
        return any(_nullable(n, empty) for n in node.alternatives)
    if isinstance(node, gbnf_to_lark.RepetitionNode):
        return node.min_times == 0 or _nullable(node.node, empty)
    return False  # a character class or "."


def _alone(node: Any, empty: set[str]) -> set[str]:
    """The rules ``node`` can derive alone: everything around them matching the empty text."""
    if isinstance(node, gbnf_to_lark.RuleRefNode):
        return {node.name}
    if isinstance(node, gbnf_to_lark.SequenceNode):
        found: set[str] = set()
        for i, part in enumerate(node.nodes):
            if all(_nullable(n, empty) for j, n in enumerate(node.nodes) if j != i):
                found |= _alone(part, empty)
        return found
    if isinstance(node, gbnf_to_lark.AlternativeNode):
        return set().union(*(_alone(n, empty) for n in node.alternatives))
    if isinstance(node, gbnf_to_lark.RepetitionNode):
        once = (node.min_times <= 1 or _nullable(node.node, empty)) and node.max_times != 0
        return _alone(node.node, empty) if once else set()
    return set()


def self_deriving_rule(rules: dict[str, Any]) -> list[str] | None:
    """A cycle of rules each deriving the next alone, back to the first (``x ::= x x`` with x able
    to match the empty text derives x from x): the grammar is infinitely ambiguous, and an Earley
    parser's masks cost more at every token. None when there is none."""
    empty: set[str] = set()
    while True:
        more = {name for name, rule in rules.items() if name not in empty and _nullable(rule.alternatives, empty)}
        if not more:
            break
        empty |= more
    edges = {name: _alone(rule.alternatives, empty) for name, rule in rules.items()}
    for start in rules:
        path, seen, stack = {start: [start]}, {start}, [start]
        while stack:
            name = stack.pop()
            for nxt in sorted(edges.get(name, ())):
                if nxt == start:
                    return path[name] + [start]
                if nxt not in seen and nxt in rules:
                    seen.add(nxt)
                    path[nxt] = path[name] + [nxt]
                    stack.append(nxt)
    return None


def check_gbnf(text: str) -> None:
    """ConfigError naming ``grammar`` in one line for a GBNF grammar we refuse before compiling it:
    not GBNF or not parsing (``gbnf_rules``), an empty alternative in ``root`` (the whole output
    could be empty: write "" if that is meant; in other rules it is llama.cpp's empty text, as in
    its ``ws ::= | " "``), or a rule deriving itself alone (``self_deriving_rule``)."""
    rules = gbnf_rules(text)
    root = rules["root"].alternatives
    if any(isinstance(alt, gbnf_to_lark.SequenceNode) and not alt.nodes for alt in getattr(root, "alternatives", [])):
        raise refusal('rule root has an empty alternative (nothing after a "|" or "::="), so the whole output could '
                      'be empty; remove the "|", or write "" if the empty text is meant')
    cycle = self_deriving_rule(rules)
    if cycle:
        raise refusal(f"rule {cycle[0]} derives itself with nothing around it ({' -> '.join(cycle)}, the rest able to "
                      "match the empty text): the grammar is infinitely ambiguous and its masks cost more at every "
                      "token; make it unambiguous, e.g. x ::= [a-z]+")


def parse_schema(text: str) -> dict:
    """A JSON schema's text as a JSON object (strict: no NaN, no duplicate keys: ConfigError naming
    the first one)."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def unique(pairs: list[tuple[str, Any]]) -> dict:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise refusal(f"the JSON schema has the key {json.dumps(key, ensure_ascii=False)[:60]} twice in one "
                              "object; JSON readers keep only one of them: write it once")
            seen[key] = value
        return seen

    try:
        schema = json.loads(text, parse_constant=refuse, object_pairs_hook=unique)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise refusal(f"the JSON schema is not valid JSON: {one_line(exc, 160)}") from None
    if not isinstance(schema, dict):
        raise refusal(f"a JSON schema is a JSON object, got a JSON {type(schema).__name__}")
    return schema


def check_syntax(kind: str, text: str) -> None:
    """Before a compile, the checks of a GBNF grammar's rules (``check_gbnf``); nothing for the other
    kinds (a JSON schema's JSON is read by ``parse_schema``)."""
    if kind == "gbnf":
        check_gbnf(text)


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
    does not parse (a schema that is not JSON, a GBNF rule that is not defined: ``check_syntax``)."""
    if kind not in KINDS:
        raise ConfigError("grammar_kind", f"expected one of {' | '.join(KINDS)}, got {kind!r:.40}")
    if not text.strip():
        raise ConfigError(KEY, "empty; give a JSON schema, a regular expression or a GBNF grammar")
    check_syntax(kind, text)
    if kind == "json_schema":
        schema = json.dumps(parse_schema(text), ensure_ascii=False)
        return llguidance.LLMatcher.grammar_from_lark(f"{NO_FORCING}\nstart: %json {schema}")
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_lark(f"{NO_FORCING}\nstart: /{llguidance.regex_to_lark(text)}/")
    try:
        lark = gbnf_to_lark.gbnf_to_lark(text)
    except Exception as exc:  # noqa: BLE001 (its parser raises bare exceptions of several kinds)
        raise refusal(f"this {KIND_WORDS[kind]} does not parse: {one_line(exc, 160)}") from None
    lark = lark.removeprefix("%llguidance {}")
    return llguidance.LLMatcher.grammar_from_lark(f"{NO_FORCING}\n{lark}")


def new_matcher(table: Any, source: str) -> Any:
    """An LLMatcher of ``source`` under ``LIMITS`` (its errors terse: no parser state in them)."""
    return llguidance.LLMatcher(table, source, log_level=0,
                                limits=llguidance.LLParserLimits(**LIMITS, verbose_errors=False))


def _compile(kind: str, text: str, table: Any, bytes_only: bool) -> Compiled:
    source = grammar_source(kind, text)
    matcher = new_matcher(table, source)
    what = KIND_WORDS[kind]
    if matcher.is_error():
        raise refusal(f"this {what} does not compile: {reason(matcher.get_error())}")
    allowed = unpack(matcher.compute_bitmask(), table.vocab_size)  # the first mask: also warms the lexer
    if matcher.is_error() and matcher.get_error().startswith("NoExtensionBias"):  # no byte can start it
        raise refusal(f"this {what} matches nothing: no token can start it")
    if matcher.is_error():
        raise refusal(f"this {what} went past its resource limits at the first token: {reason(matcher.get_error())}")
    allowed[table.eos_token] = False
    if not bool(allowed.any()):
        words = "matches only the empty text" if matcher.is_accepting() else "matches nothing"
        raise refusal(f"this {what} {words}: no token can start it")
    return Compiled(kind, text, matcher, table.vocab_size, table.eos_token, bytes_only, table)
def compile_grammar(kind: str, text: str, tokenizer: Any) -> Compiled:
    """``text`` of ``kind`` compiled for ``tokenizer`` (cached; in a worker thread with a time limit
    of COMPILE_SECONDS). Every failure is a ConfigError naming ``grammar`` in one line: a schema that
    does not compile, a regular expression that matches nothing, a grammar no token can start, one
    too large to compile in time."""
    check_syntax(kind, text)  # a GBNF grammar we refuse is refused before the tokenizer's table is built
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


# --- the matcher's work, off the caller's thread ------------------------------------------------------
def thread_cpu_clock() -> Callable[[], float]:
    """A clock of the calling thread's CPU time that any thread can read (Linux's per-thread CPU
    clock); where there is none, the wall clock (which also counts waiting for a core)."""
    try:
        clock = time.pthread_getcpuclockid(threading.get_ident())
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return time.perf_counter
    return lambda: time.clock_gettime(clock)


@dataclass
class _Cursor:
    """A matcher and the generated tokens it has taken (``sync`` moves it to any prefix of them).
    ``units_of(token)``: what the matcher is fed for a token (None: it cannot be fed)."""

    matcher: Any
    units_of: Callable[[int], list[int] | None]
    fed: list[int]  # the generated tokens the matcher has taken, in order
    units: list[int]  # how many of the matcher's tokens each of them was (bytes: its length)
    off: tuple[int, int] | None = None  # (position, token) of the first generated token it refused
    mask: bytes | None = None  # the mask computed at the matcher's present state (after ``fed``), if any

    def sync(self, generated: Sequence[int]) -> int | None:
        """Bring the matcher to the state after ``generated`` (rolled back to what it shares with
        the tokens it took, then fed the rest). Returns the position of the first token the grammar
        refuses (the row is off the grammar from there), else None."""
        shared = 0
        for a, b in zip(self.fed, generated):
            if a != b:
                break
            shared += 1
        if shared < len(self.fed):
            self.matcher.rollback(sum(self.units[shared:]))
            del self.fed[shared:], self.units[shared:]
            self.off, self.mask = None, None
        if self.off is not None:
            at, token = self.off
            if len(generated) > at and generated[at] == token:
                return at
            self.off = None
        for at in range(len(self.fed), len(generated)):
            units = self.units_of(int(generated[at]))
            if not units or not (self._masked_in(units) or self.matcher.validate_tokens(units) == len(units)):
                self.off = (at, int(generated[at]))
                return at
            self.mask = None
            self.matcher.consume_tokens(units)
            self.fed.append(int(generated[at]))
            self.units.append(len(units))
        return None

    def _masked_in(self, units: list[int]) -> bool:
        """Whether the mask at this state allows the one token ``units`` (then it need not be
        validated again: LLGuidance holds the GIL while it validates or takes a token)."""
        if self.mask is None or len(units) != 1 or units[0] >= 8 * len(self.mask):
            return False
        return bool(self.mask[units[0] // 8] >> (units[0] % 8) & 1)


@dataclass(frozen=True)
class _Found:
    """The matcher after some generated tokens: ``off`` (the first one it refused, or None), the
    mask's bits (None: not computed: off the grammar, or a byte-level stage), LLGuidance's error
    ("" when none), whether only the end is left (``stopped``) and whether the text is whole."""

    off: int | None
    bitmask: bytes | None = None
    error: str = ""
    stopped: bool = False
    accepting: bool = False


def _find(cursor: _Cursor, generated: tuple[int, ...], with_mask: bool) -> _Found:
    off = cursor.sync(generated)
    if off is not None:
        return _Found(off)
    bitmask = cursor.matcher.compute_bitmask() if with_mask else None  # drops the GIL while it computes
    cursor.mask = bitmask
    matcher = cursor.matcher
    return _Found(None, bitmask, matcher.get_error() if matcher.is_error() else "", matcher.is_stopped(),
                  matcher.is_accepting())


_masks = ThreadPoolExecutor(max_workers=MASK_WORKERS, thread_name_prefix="dp-grammar-mask")


class _Job:
    """One step's matcher work (``_find``) in the mask pool; ``cpu()`` reads the CPU seconds it has
    taken so far from its thread's clock (0 while it waits for a thread)."""

    def __init__(self, cursor: _Cursor, generated: tuple[int, ...], with_mask: bool):
        self.generated = generated
        self.spent: float | None = None  # its CPU seconds, once done
        self._clock: tuple[Callable[[], float], float] | None = None
        self.future: Future = _masks.submit(self._run, cursor, with_mask)

    def _run(self, cursor: _Cursor, with_mask: bool) -> _Found:
        clock = thread_cpu_clock()
        self._clock = (clock, clock())
        try:
            return _find(cursor, self.generated, with_mask)
        finally:
            self.spent = clock() - self._clock[1]

    def cpu(self) -> float:
        if self.spent is not None:
            return self.spent
        started = self._clock
        return 0.0 if started is None else started[0]() - started[1]


# --- the stage ------------------------------------------------------------------------------------------
class Grammar(Stage):
    """Mask the tokens ``compiled`` forbids after the tokens generated so far (``input_ids`` after
    the first ``prompt_length``), row by row; the end of text (``eos_token_ids``) is allowed exactly
    when the grammar is complete, and is all that is left once nothing can follow. ``tokenizer``:
    for a byte-level grammar (a served model), each candidate token's text.

    The matcher's work of a call runs in the mask pool (``prepare`` may start it earlier) and is
    charged to the stage's budgets: GrammarBudget once a step or the run goes past them (in flight
    too: the call does not wait for the rest of a mask past its budget)."""

    name = "grammar"

    def __init__(self, compiled: Compiled, prompt_length: int = 0, eos_token_ids: Sequence[int] = (),
                 tokenizer: Any = None):
        super().__init__(grammar_kind=compiled.kind)  # the text stays in the run's config, not on every step
        self.compiled, self.prompt_length, self.tokenizer = compiled, int(prompt_length), tokenizer
        self.eos = sorted({int(e) for e in eos_token_ids})
        self._texts: dict[int, list[int] | None] = {}  # byte mode: a token's bytes (None: not known exactly)
        self.reset()

    def clone(self) -> "Grammar":
        twin = Grammar(self.compiled, self.prompt_length, self.eos, self.tokenizer)
        twin._texts = self._texts
        return twin

    def reset(self) -> None:
        super().reset()
        self._cursor = _Cursor(self.compiled.template.deep_copy(), self._token_units, [], [])
        self._job: _Job | None = None  # the matcher's work in flight (it owns the cursor meanwhile)
        self.spent = 0.0  # CPU seconds its matcher has taken (RUN_BUDGET_S)
        self._over: GrammarBudget | None = None  # once past a budget, every call says so

    def _token_units(self, token: int) -> list[int] | None:
        """What the matcher is fed for ``token``: itself, or (byte mode) its bytes (None when its
        text is not known exactly: part of a character, shown as U+FFFD)."""
        if not self.compiled.bytes_only:
            return [token]
        if token not in self._texts:
            text = self.tokenizer.decode([token]) if self.tokenizer is not None else "\ufffd"
            self._texts[token] = None if "\ufffd" in text or not text else list(text.encode("utf-8"))
        return self._texts[token]

    # --- the matcher's work -------------------------------------------------------------------------------
    def prepare(self, input_ids: torch.Tensor) -> None:
        """Start the mask after ``input_ids`` [1, S] in the mask pool (the batched scheduler calls
        this after each pick, so the mask is computed beside the next forward)."""
        if self.compiled.bytes_only or self._job is not None or self._over is not None:
            return
        self._job = _Job(self._cursor, tuple(input_ids[0, self.prompt_length:].tolist()), True)

    def ready(self) -> bool:
        """Whether a call would not wait: no mask in flight, or it is done, or past its budget."""
        job = self._job
        return job is None or job.future.done() or self._past_budget(job) is not None

    def _past_budget(self, job: _Job) -> GrammarBudget | None:
        cpu = job.cpu()
        if cpu > STEP_BUDGET_S:
            return GrammarBudget(len(job.generated), "step", cpu)
        if self.spent + cpu > RUN_BUDGET_S:
            return GrammarBudget(len(job.generated), "run", self.spent + cpu)
        return None

    def _wait(self, job: _Job) -> _Found:
        """``job``'s result once done, charged to the budgets; GrammarBudget (and the stage stays
        past it) as soon as it goes past one, done or not."""
        while True:
            try:
                found = job.future.result(timeout=POLL_S)
                break
            except FutureTimeout:
                over = self._past_budget(job)
                if over is not None:
                    self._over = over
                    raise over from None
        self._job = None
        over = self._past_budget(job)
        self.spent += job.cpu()
        if over is not None:
            self._over = over
            raise over
        return found

    def _found(self, generated: tuple[int, ...]) -> _Found:
        """The matcher after ``generated``: the job prepared for it, or one started now."""
        if self._over is not None:
            raise self._over
        job = self._job
        if job is not None and job.generated != generated:
            self._wait(job)  # the cursor is the job's until it is done
            job = None
        if job is None:
            job = self._job = _Job(self._cursor, generated, not self.compiled.bytes_only)
        return self._wait(job)

    def _allowed(self, logits_row: torch.Tensor, found: _Found, generated: int) -> torch.Tensor:
        """The tokens [V] the grammar allows next (``found``: the matcher synced), the end of text
        included when the grammar is complete."""
        vocab = logits_row.shape[-1]
        allowed = torch.zeros(vocab, dtype=torch.bool)
        if self.compiled.bytes_only:
            self._check_candidates(logits_row, allowed, generated)
        else:
            if found.bitmask is None:  # a job computes the mask unless bytes_only (_Job)
                raise RuntimeError("grammar: the matcher computed no mask")
            mask = unpack(found.bitmask, self.compiled.vocab)[:vocab]
            allowed[: mask.shape[0]] = mask
            if self.compiled.eos < vocab:
                allowed[self.compiled.eos] = False
        if found.error:
            raise refusal(f"the grammar went past LLGuidance's resource limits after {generated} generated tokens "
                          f"(an ambiguous grammar's parse grows at every token): {reason(found.error)}")
        if found.stopped:
            allowed[:] = False
        for e in self.eos:
            if e < vocab:
                allowed[e] = found.accepting
        return allowed.to(logits_row.device)

    def _check_candidates(self, logits_row: torch.Tensor, allowed: torch.Tensor, generated: int) -> None:
        """Byte mode: each finite token of ``logits_row`` checked against the synced matcher, in
        this thread (a served model's top-N), its CPU charged to the budgets."""
        start = time.thread_time()
        matcher = self._cursor.matcher
        for token in torch.isfinite(logits_row).nonzero().flatten().tolist()[:MAX_CANDIDATES]:
            units = None if token in self.eos else self._token_units(token)
            allowed[token] = units is not None and len(units) > 0 and matcher.validate_tokens(units) == len(units)
        cpu = time.thread_time() - start
        self.spent += cpu
        if cpu > STEP_BUDGET_S or self.spent > RUN_BUDGET_S:
            self._over = GrammarBudget(generated, "step" if cpu > STEP_BUDGET_S else "run",
                                       cpu if cpu > STEP_BUDGET_S else self.spent)
            raise self._over

    # --- a call ---------------------------------------------------------------------------------------------
    def apply(self, input_ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        out = logits.clone()
        found_row0: dict[str, Any] = {}
        for b in range(logits.shape[0]):
            generated = tuple(input_ids[b, self.prompt_length:].tolist()) if input_ids is not None else ()
            found = self._found(generated)
            if found.off is not None:  # a forced token left the grammar: nothing to mask after it
                row = {"allowed": int(torch.isfinite(logits[b]).sum()), "complete": False, "ended": False,
                       "off_grammar_at": found.off, "wanted_id": None, "wanted_p": None, "log_allowed_mass": 0.0}
            else:
                allowed = self._allowed(logits[b], found, len(generated))
                row = self._facts(logits[b], allowed, len(generated), found)
                out[b] = self._masked(logits[b], allowed)
            if b == 0:
                found_row0 = row
        return out, found_row0

    def _masked(self, logits_row: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``logits_row`` [V] with the forbidden tokens at -inf. When only the end of text is
        allowed and every one of its ids was already masked (a served model's top-N without it),
        the first gets logit 0: the grammar is complete, and the end is the only way on."""
        out = logits_row.masked_fill(~allowed, float("-inf"))
        ends = [e for e in self.eos if e < out.shape[0] and bool(allowed[e])]
        if ends and int(allowed.sum()) == len(ends) and not bool(torch.isfinite(out[ends]).any()):
            out[ends[0]] = 0.0
        return out

    def _facts(self, logits_row: torch.Tensor, allowed: torch.Tensor, step: int, found: _Found) -> dict[str, Any]:
        """The call's records for one row (see the module docstring); GrammarDeadEnd when a
        byte-level step allows none of its candidates."""
        count = int(allowed.sum())
        if count == 0 and self.compiled.bytes_only:  # a model loaded here: the pick says "no tokens left"
            raise GrammarDeadEnd(step, int(torch.isfinite(logits_row).sum()))
        logp = torch.log_softmax(logits_row.double(), dim=-1)  # [V]
        finite = torch.isfinite(logp) & allowed
        log_allowed = float(torch.logsumexp(logp[finite], dim=0)) if bool(finite.any()) else None
        top = int(torch.argmax(logp))
        wanted = not bool(allowed[top]) and math.isfinite(float(logp[top]))
        return {"allowed": count, "complete": found.accepting, "ended": found.stopped,
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
    kind = KIND_WORDS.get(stage.params.get("grammar_kind") or "", "structured output")
    return f"grammar ({kind}): forbidden tokens masked"


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


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # control characters but tab, newline, CR


def _check_text(key: str, value: str) -> str:
    """The grammar knob's text: not only whitespace, at most MAX_GRAMMAR_BYTES as UTF-8, no control
    characters but tab and newlines (so that any grammar accepted fits a preset and a share link)."""
    if value and not value.strip():
        raise ConfigError(key, "only whitespace; give a grammar, or leave it empty for none")
    size = len(value.encode("utf-8"))
    if size > MAX_GRAMMAR_BYTES:
        raise ConfigError(key, f"{size:,} bytes as UTF-8 is over the {MAX_GRAMMAR_BYTES:,}-byte limit (a grammar "
                               "travels in presets and share links); make it shorter")
    control = _CONTROL.search(value)
    if control:
        raise ConfigError(key, f"a control character (U+{ord(control.group()):04X}) at character {control.start()}; "
                               "write it as an escape (\\x01 in a regex or GBNF, \\u0001 in JSON)")
    return value


def _check_config(config: "DecodingConfig") -> None:
    """At validation, a GBNF grammar that LLGuidance would read as Lark (``_LARK_MARKER``): "not
    GBNF", so no preset carries it to llama.cpp, which answers 400. The rest of its checks
    (``check_gbnf``) come at its compile: a config may hold a grammar it never runs."""
    if config.grammar and config.grammar_kind == "gbnf":
        refuse_lark(config.grammar, _LARK_MARKER)


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
    check=_check_config,
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
    oracle="tests/engine/test_grammar.py::test_mask_equals_the_languages_prefixes_by_hand "
           "tests/engine/test_grammar.py::test_every_output_validates_at_every_seed "
           "tests/remote/test_grammar_remote.py::test_greedy_json_schema_equals_llama_servers",
))
