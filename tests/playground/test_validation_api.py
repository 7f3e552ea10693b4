"""The API boundary, driven as a client does (gradio_client and raw HTTP against the real server on
127.0.0.1): booleans are exactly true/false for every endpoint (NaN, "no", 0 are refused naming the
argument, never echoed as "chat": NaN or read as true), arguments of the wrong JSON type or nested
too deeply get one line naming the argument, every answer is strict JSON, and the what-if route
answers a too-deep body with HTTP 400."""

from __future__ import annotations

import json

import httpx
import pytest
from tests.helpers.validation_api import post_job  # noqa: F401
from tests.helpers.api import api_client

pytestmark = pytest.mark.slow

ONE_LINE = 300
SMALL = {"max_new_tokens": 2, "seed": 1}
CHEAP = {"max_new_tokens": 2, "seeds": 2, "variants": ["none"], "kinds": ["dynamic"], "residual_length": 2,
         "compare_baseline": False, "lanes": [{"preset": "greedy"}, {"preset": "balanced"}], "lane": {"preset": "greedy"}}


def strict(text: str):
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def endpoints(live_app):

    return api_client(live_app).view_api(print_info=False, return_format="dict")["named_endpoints"]


def _baseline(p: dict):
    name = p.get("parameter_name") or ""
    if name in CHEAP:
        return CHEAP[name]
    if "config" in name:
        return dict(SMALL)
    if p.get("parameter_has_default"):
        return p.get("parameter_default")
    return {"prompt": "Hi", "preset_json": "{}", "view": "step", "parent": "{}", "trace": "{}"}.get(name, "Hi")


def raw_call(base: str, api_name: str, body: str) -> tuple[str, object]:
    """POST a raw JSON body (NaN allowed, as some clients write it) and read the event stream:
    ("complete", data) or ("error", message)."""
    res = post_job(base, api_name, body)
    if res.status_code != 200:
        return "http", f"{res.status_code} {res.text[:200]}"
    event_id = res.json()["event_id"]
    text = httpx.get(f"{base}/gradio_api/call{api_name}/{event_id}", timeout=180).text
    kind, data = None, None
    for line in text.splitlines():
        if line.startswith("event: "):
            kind = line[7:].strip()
        elif line.startswith("data: ") and kind in ("complete", "error"):
            data = strict(line[6:])
    if kind == "error":
        return "error", (data or {}).get("error") if isinstance(data, dict) else data
    return kind, data


def _args_json(args: list, i: int, value_json: str) -> str:
    parts = [json.dumps(a) for a in args]
    parts[i] = value_json
    return '{"data": [' + ", ".join(parts) + "]}"


def _bool_params(endpoints):
    for api_name, info in sorted(endpoints.items()):
        params = info.get("parameters", [])
        for i, p in enumerate(params):
            if (p.get("python_type") or {}).get("type", "").startswith("bool"):
                yield api_name, params, i


@pytest.mark.parametrize("value_json, shown", [("NaN", "nan"), ('"no"', "'no'"), ("0", "0"), ('"true"', "'true'")])
def test_booleans_are_strict_on_every_endpoint(live_app, endpoints, value_json, shown):
    found = list(_bool_params(endpoints))
    names = {api for api, _, _ in found}
    assert {"/step_trace", "/beam_trace", "/speculative_trace", "/medusa_trace", "/compare"} <= names
    for api_name, params, i in found:
        base = [_baseline(p) for p in params]
        kind, message = raw_call(live_app, api_name, _args_json(base, i, value_json))
        arg = params[i]["parameter_name"]
        assert kind == "error", (api_name, arg, kind, str(message)[:200])
        assert isinstance(message, str) and message.startswith(f"{arg}: expected true or false"), (api_name, message)
        assert shown in message and "\n" not in message and len(message) < ONE_LINE


def test_true_and_false_still_run_and_answers_are_strict(live_app):
    for chat in (False, True):
        kind, data = raw_call(live_app, "/step_trace", json.dumps({"data": ["Hi", SMALL, "", chat, "embedded", "none"]}))
        assert kind == "complete", data
        assert data[0]["chat"] is chat  # strict() above refused any NaN/Infinity in the stream


@pytest.mark.parametrize("api_name, args, arg, fragment", [
    ("/kv_calculator", [["Llama-2-7B"]], "architecture_name", "expected text"),
    ("/kv_calculator", [{"a": 1}], "architecture_name", "expected text"),
    ("/quantization_report", ["Hi", False, 2, True], "variants", "expected a list"),
    ("/kv_cache_kinds_report", ["Hi", False, 2, "dynamic"], "kinds", "expected a list"),
    ("/explore_step", [json.loads("[" * 200 + "]" * 200), 0], "trace", "nested more than"),
    ("/branch", [{"a": json.loads("[" * 200 + "]" * 200)}, 0, 1], "parent", "nested more than"),
    ("/branch", ["[" * 50_000, 0, 1], "parent", "nested too deeply"),
    ("/step_trace", ["Hi", json.loads("[" * 100 + "]" * 100)], "config", "nested more than"),
    ("/step_trace", ["Hi", [1, 2]], "config", "expected a JSON object"),
    ("/compare", ["Hi", json.loads("[" * 100 + "]" * 100)], "lanes", "nested more than"),
    ("/share_link", ["step", "Hi", "{}", 1, "no"], "chat", "expected true or false"),
])
def test_wrong_types_and_deep_nesting_name_the_argument(live_app, api_name, args, arg, fragment):

    with pytest.raises(Exception) as err:
        api_client(live_app).predict(*args, api_name=api_name)
    message = str(err.value)
    assert message.startswith(f"{arg}: ") and fragment in message, message[:300]
    assert "\n" not in message and len(message) < ONE_LINE


def test_forged_long_trace_is_refused_at_once(live_app):
    import time


    client = api_client(live_app)
    trace = client.predict("Hi", SMALL, "", False, api_name="/step_trace")
    trace["generated_token_ids"] = [5] * 8000
    start = time.monotonic()
    for api_name, args in (("/branch", [trace, 0, 5]), ("/explore_step", [trace, 0])):
        arg = "parent" if api_name == "/branch" else "trace"
        with pytest.raises(Exception) as err:
            client.predict(*args, api_name=api_name)
        assert str(err.value).startswith(f"{arg}: generated_token_ids: 8,000 items is over the 1,024-item limit")
    assert time.monotonic() - start < 10


def test_whatif_route_answers_400_to_deep_json(live_app):
    from playground import whatif_service

    for body in ("[" * 30_000, '{"a":' * 10_000):
        res = httpx.post(live_app + whatif_service.ROUTE, content=body, timeout=60)
        assert res.status_code == 400, res.text[:200]
        error = strict(res.text)["error"]
        assert error.startswith("body: ") and "\n" not in error and len(error) < ONE_LINE
