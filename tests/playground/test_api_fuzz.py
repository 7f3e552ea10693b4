"""Every named API endpoint of a real server on 127.0.0.1, driven through gradio_client with wrong
types and hostile strings. Each call must end in a clean error naming its argument (gradio_client's
AppError carrying the handler's message) or a result whose JSON is strict; never Gradio's generic
"upstream" error, never a file's content, never an unescaped HTML tag in a message.

The endpoints are listed from the client's own ``view_api()``, so a new endpoint is fuzzed too.
Bounded: a few values per parameter, tiny generations, a per-call time limit.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter

import pytest
from tests.helpers.api_fuzz import CALL_SECONDS, _raw  # noqa: F401
from tests.helpers.api import api_client

pytestmark = pytest.mark.slow

BIG = "x" * 100_000
HOSTILE_STRINGS = ["<a href=//evil.example>x</a>", "<img src=x onerror=alert(1)>", "<script>alert(1)</script>",
                   "\ud800", BIG, "/etc/passwd", "~/.ssh", "../../x.json"]
DEEP = {"a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}  # 41 deep
WRONG_TYPES = {"str": [5, ["x"], {"a": 1}, None, DEEP], "float": ["hot", [1], None, {"a": 1}],
               "int": ["5x", [1], None, {"a": 1}], "bool": ["yes", "no", [True], 0, None, {"a": 1}],
               "dict": ["{", [1], 5, "<b>x</b>", DEEP], "list": ["x", {"a": 1}, 5, True, [DEEP]]}
SECRETS = ("root:x:0:0", "BEGIN OPENSSH", "PRIVATE KEY")
TAG = re.compile(r"<\s*(a|img|script)\b", re.IGNORECASE)
NAMED = re.compile(r"^[^\n:]{1,80}: \S")
ONE_LINE = 300
SMALL_CONFIG = {"max_new_tokens": 2, "seed": 1}
# Cheap valid values for parameters whose defaults run long (every quantized variant, 32 uncached
# steps, five seeds): the fuzz is about the boundary, not about running each report in full.
CHEAP = {"max_new_tokens": 2, "seeds": 2, "variants": ["none"], "kinds": ["dynamic"], "residual_length": 2,
         "compare_baseline": False}


def _kind(parameter: dict) -> str:
    python_type = (parameter.get("python_type") or {}).get("type", "")
    for kind in ("str", "float", "int", "bool", "dict", "list"):
        if python_type.startswith(kind) or python_type.lower().startswith(kind):
            return kind
    return "dict" if "Dict" in python_type or "dict" in python_type else "str"


def _baseline(parameter: dict):
    """A valid, cheap value for a parameter (its default, a small config for JSON ones)."""
    name, kind = parameter.get("parameter_name") or "", _kind(parameter)
    if name in CHEAP:
        return CHEAP[name]
    if kind == "dict" or "config" in name:
        return dict(SMALL_CONFIG)
    if parameter.get("parameter_has_default"):
        return parameter.get("parameter_default")
    return {"str": "Hello", "float": 1.0, "int": 1, "bool": False, "list": []}.get(kind, "Hello")


def _cases(parameters: list[dict]):
    """(label, args) with one argument replaced at a time."""
    base = [_baseline(p) for p in parameters]
    for i, p in enumerate(parameters):
        for value in WRONG_TYPES[_kind(p)] + (HOSTILE_STRINGS if _kind(p) == "str" else HOSTILE_STRINGS[:3]):
            if p.get("parameter_has_default") and value is None is p.get("parameter_default"):
                continue  # its own default is no wrong type (variants=None: every quantized variant, minutes)
            args = list(base)
            args[i] = value
            yield f"{p.get('parameter_name')}={str(value)[:30]!r}", args


def _check_error(message: str, label: str) -> str | None:
    if "upstream" in message.lower() or not NAMED.match(message):
        return f"{label}: generic error {message[:160]!r}"
    if "\n" in message or len(message) > ONE_LINE:
        return f"{label}: not one short line ({len(message)} characters) {message[:160]!r}"
    if any(s in message for s in SECRETS):
        return f"{label}: file content in the message"
    if TAG.search(message):
        return f"{label}: unescaped HTML in the message {message[:160]!r}"
    return None


def _check_result(result, label: str) -> str | None:
    try:
        text = json.dumps(result, allow_nan=False, default=str)
    except ValueError:
        return f"{label}: result JSON is not strict (NaN/Infinity)"
    if any(s in text for s in SECRETS):
        return f"{label}: file content in the result"
    return None


def _slowest(seconds: Counter) -> str:
    """The endpoints that took longest, for the test's printout."""
    return "slowest: " + ", ".join(f"{name} {s:.1f} s" for name, s in seconds.most_common(8))


CLIENTS = 4  # parallel sessions: most calls are quick refusals, so they overlap well


def _call(client, api_name: str, args: list, label: str) -> str | None:
    try:
        result = client.submit(*args, api_name=api_name).result(timeout=CALL_SECONDS)
    except Exception as exc:  # AppError (the handler's message) or a client-side refusal
        return _check_error(str(exc), label)
    return _check_result(result, label)


def test_every_endpoint_fails_cleanly_or_answers_strictly(live_app):
    from concurrent.futures import ThreadPoolExecutor


    clients = [api_client(live_app) for _ in range(CLIENTS)]
    endpoints = clients[0].view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert endpoints, "the app exposes no named endpoint"
    cases = [(api_name, f"{api_name} {label}", args) for api_name, info in sorted(endpoints.items())
             for label, args in _cases(info.get("parameters", []))]
    start = time.monotonic()
    # each client works through its own share of the cases, one call at a time (one session each)
    shares = [cases[i::CLIENTS] for i in range(CLIENTS)]

    seconds = [Counter() for _ in range(CLIENTS)]  # each client's seconds per endpoint (the print says where)

    def work(i: int) -> list[str]:
        found = []
        for api_name, label, args in shares[i]:
            began = time.monotonic()
            if problem := _call(clients[i], api_name, args, label):
                found.append(problem)
            seconds[i][api_name] += time.monotonic() - began
        return found

    with ThreadPoolExecutor(CLIENTS) as pool:
        problems = [p for found in pool.map(work, range(CLIENTS)) for p in found]
    print(f"{len(cases)} calls over {len(endpoints)} endpoints in {time.monotonic() - start:.0f} s; "
          + _slowest(sum(seconds, Counter())))
    assert not problems, f"{len(problems)} of {len(cases)} calls misbehaved:\n" + "\n".join(problems[:80])


def _named_error(kind, data, label: str, argument: str | None) -> str | None:
    message = data.get("error") if isinstance(data, dict) else None
    if kind != "error" or not isinstance(message, str):
        return f"{label}: expected a named error, got {kind} {str(data)[:120]!r}"
    if argument is not None and not message.startswith(f"{argument}: "):
        return f"{label}: the message does not name {argument}: {message[:160]!r}"
    return _check_error(message, label)


def test_every_endpoint_refuses_raw_calls_cleanly(live_app):
    """Raw HTTP: no arguments at all (a missing required argument is named, defaults are taken as
    gradio_client takes them), and NaN / a huge string / deep nesting in each argument. Every answer
    parses as strict JSON (no NaN echoed back)."""

    endpoints = api_client(live_app).view_api(print_info=False, return_format="dict")["named_endpoints"]
    problems, seconds = [], Counter()
    for api_name, info in sorted(endpoints.items()):
        began = time.monotonic()
        params = info.get("parameters", [])
        required = [p["parameter_name"] for p in params if not p.get("parameter_has_default")]
        if required:
            problems.append(_named_error(*_raw(live_app, api_name, '{"data": []}'), f"{api_name} no args", required[0]))
        base = [json.dumps(_baseline(p)) for p in params]
        for i, p in enumerate(params):
            for value in ("NaN", "Infinity", json.dumps("x" * 100_000), "[" * 60 + "]" * 60):
                args = list(base)
                args[i] = value
                label = f"{api_name} {p['parameter_name']}={value[:12]}"
                kind, data = _raw(live_app, api_name, '{"data": [' + ", ".join(args) + "]}")
                if kind == "complete":
                    continue  # an accepted value: its answer parsed as strict JSON above
                problems.append(_named_error(kind, data, label, None))
        seconds[api_name] = time.monotonic() - began
    print(_slowest(seconds))
    problems = [p for p in problems if p]
    assert not problems, f"{len(problems)} raw calls misbehaved:\n" + "\n".join(problems[:60])
