"""A served model's answers, checked field by field before anything reads them (issue #34).

A server the operator lists may still send anything. Every value the backends
(``engine.backends.llamacpp``, ``engine.backends.openai``) take from an answer goes through a
``Schema``, which says what the field must be and raises ``RemoteError`` with one line naming the
server, the request and the field (``completion_probabilities[0].top_logprobs[3].id: expected a
token id in [0, 49152), got -1``) when it is not:

- **token ids**: ints (not bools, not floats) in ``[0, vocabulary)``;
- **log-probabilities**: finite numbers in ``[LOGPROB_FLOOR, 0]``, a rounding slack of ``PROB_SLACK``
  above 0 allowed and read as 0 (servers compute in float32: a certain token's log-probability may
  read 1e-7); llama-server writes a probability of 0 as ``null`` (its JSON has no -inf): ``nullable``
  reads that as -inf for its fields only. The floor keeps every later sum, product and ``exp`` of
  them finite (vLLM writes a -inf as -9999.0, the lowest a real server sends);
- **probabilities**: finite numbers in ``[0, 1]`` (the same slack above 1, read as 1); a top-N's
  probabilities together at most 1 (+ slack), no id twice in one top-N, and its most likely token
  at least ``TOP_FLOOR`` (the largest probability of a distribution over V <= ``MAX_CONTEXT``
  tokens is at least 1/V: a top-N all below that is no model's answer);
- **counts**: a top-N holds at most the N asked + 1 (vLLM adds the sampled token to its N);
  a list of tokens at most what was asked; texts at most ``MAX_PIECE_CHARS`` a token and
  ``MAX_TEXT_CHARS`` a text;
- **types**: objects, lists, strings and numbers where the API has them; a required field missing
  is named.

Non-finite numbers never get this far: ``engine.backends.client.strict_loads`` refuses NaN,
Infinity and ``1e999``. So nothing a server sends becomes a NaN or an infinity in a trace except
llama-server's ``null`` log-probability (a probability of 0, kept as -inf inside the engine and
written as its probability 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.backends.client import RemoteError

PROB_SLACK = 1e-4  # float32 rounding in a server's softmax (a sum of 100 float32 probabilities is off by ~1e-6)
VOCAB_BOUND = 262_144  # ids a server that does not report its vocabulary may send (Gemma 3's 262144 the largest)
MAX_PIECE_CHARS = 512  # one token's text (the longest tokens of real vocabularies are runs of ~256 characters)
MAX_TEXT_CHARS = 1 << 20  # a text the server makes (a chat template applied, a detokenized output)
MAX_CONTEXT = 1 << 24  # a context length or vocabulary size a server may report
LOGPROB_FLOOR = -1e4  # the lowest log-probability read (vLLM writes -inf as -9999.0; exp(-746) is 0 already)
TOP_FLOOR = -math.log(MAX_CONTEXT)  # a top-N's most likely token: p >= 1/V for any vocabulary a server may have
Entry = tuple[int, float, "str | None"]  # engine.backends.served.Entry


def shown(value: Any) -> str:
    """A value as an error line shows it: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "\u2026"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Schema:
    """The checks for one answer: ``where`` names the server and the request (as RemoteError
    lines do), ``vocab`` the ids it may use."""

    where: str
    vocab: int = VOCAB_BOUND

    def fail(self, field: str, why: str) -> RemoteError:
        return RemoteError(f"{self.where}: {field}: {why}")

    def obj(self, value: Any, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(field, f"expected an object, got {type(value).__name__}")
        return value

    def get(self, obj: Any, key: str, field: str = "") -> Any:
        """``obj[key]``, required (``field``: where ``obj`` is, for the line)."""
        name = f"{field}.{key}" if field else key
        if key not in self.obj(obj, field or "the answer"):
            raise self.fail(name, "missing")
        return obj[key]

    def array(self, value: Any, field: str, most: int) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(field, f"expected a list, got {type(value).__name__}")
        if len(value) > most:
            raise self.fail(field, f"{len(value):,} items, at most {most:,} expected")
        return value

    def token(self, value: Any, field: str) -> int:
        if not is_int(value) or not 0 <= value < self.vocab:
            raise self.fail(field, f"expected a token id in [0, {self.vocab}), got {shown(value)}")
        return value

    def tokens(self, value: Any, field: str, most: int) -> list[int]:
        return [self.token(t, f"{field}[{i}]") for i, t in enumerate(self.array(value, field, most))]

    def logprob(self, value: Any, field: str, nullable: bool = False) -> float:
        if value is None and nullable:
            return -math.inf
        if not is_number(value) or not math.isfinite(value) or value > PROB_SLACK:
            raise self.fail(field, f"expected a log-probability (a finite number <= 0), got {shown(value)}")
        if value < LOGPROB_FLOOR:
            raise self.fail(field, f"expected a log-probability of at least {LOGPROB_FLOOR:g} (a server writes a "
                                   f"probability 0 as -9999 or null), got {shown(value)}")
        return min(float(value), 0.0)

    def prob(self, value: Any, field: str) -> float:
        if not is_number(value) or not 0 <= value <= 1 + PROB_SLACK:
            raise self.fail(field, f"expected a probability in [0, 1], got {shown(value)}")
        return min(float(value), 1.0)

    def text(self, value: Any, field: str, most: int = MAX_TEXT_CHARS) -> str:
        if not isinstance(value, str):
            raise self.fail(field, f"expected a string, got {type(value).__name__}")
        if len(value) > most:
            raise self.fail(field, f"{len(value):,} characters, at most {most:,} expected")
        return value

    def count(self, value: Any, field: str, low: int = 1, high: int = MAX_CONTEXT) -> int:
        if not is_int(value) or not low <= value <= high:
            raise self.fail(field, f"expected an integer in [{low}, {high}], got {shown(value)}")
        return value

    def optional_text(self, value: Any, field: str, most: int = 64) -> str | None:
        """An optional string field: None when null or missing, else a string of at most ``most``."""
        return None if value is None else self.text(value, field, most)

    def top(self, entries: list[Entry], field: str, most: int) -> list[Entry]:
        """A whole top-N: at most ``most`` entries, no id twice, probabilities adding up to <= 1,
        the most likely at least TOP_FLOOR (each entry's log-probability checked already)."""
        if len(entries) > most:
            raise self.fail(field, f"{len(entries):,} entries, at most {most:,} expected (the top-N asked + 1)")
        seen: set[int] = set()
        for i, (token, _, _) in enumerate(entries):
            if token in seen:
                raise self.fail(f"{field}[{i}]", f"token {token} is listed twice")
            seen.add(token)
        total = math.fsum(math.exp(lp) for _, lp, _ in entries)
        if total > 1 + 10 * PROB_SLACK:
            raise self.fail(field, f"the probabilities add up to {total:.4g}, more than 1")
        best = max((lp for _, lp, _ in entries), default=0.0)
        if best < TOP_FLOOR:
            raise self.fail(field, f"its most likely token has log-probability {best:.6g}, below log 2^-24 = "
                                   f"{TOP_FLOOR:.4g}: no distribution over a vocabulary is that flat")
        return entries

    def timings(self, value: Any, field: str = "timings") -> dict[str, float]:
        """A server's timings object: its finite numbers only (at most 32, short names), so what
        reaches the trace is small and strict."""
        if value is None:
            return {}
        obj = self.obj(value, field)
        return {str(k)[:64]: v for k, v in list(obj.items())[:32]
                if is_number(v) and math.isfinite(v) and abs(v) < 1e15}
