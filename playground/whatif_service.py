"""The what-if, as one service: a selected step re-processed under new knobs from that step's raw
logits, without generating again, and drawn as the view's stage chart.

``WhatIfService`` (one per app: ``playground.app.build_app`` makes it and serves it) owns the three
parts: each session's kept logits (``KeptLogits``: one step's raw logits, [1, V] float32, read and
written only here, under the session's lock), the computation (engine.strategies.decode.whatif_step over them)
and the answer (the chart titled with what the new knobs would pick, the note, the explanation).

One transport from the page: ``POST /dp/whatif`` (``ROUTE``; the page's script posts the knob
values with the session's what-if key, a secret only its own page gets, and draws the figure with
one ``Plotly.react``: page_js.WHATIF_JS, PRESENTER_JS). When the route cannot answer the Step view's
knob change (the model is not loaded yet, a ZeroGPU Space where only Gradio's events hold the GPU,
or ``DP_WHATIF_ROUTE=0`` behind a proxy that passes only Gradio's paths) it says ``{"fallback":
true}`` and the page runs the same service call as a Gradio event (``step_answer`` with
``load=True``); its answer is drawn by the same page code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import json
import logging
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import anyio
import gradio as gr
import torch
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.base.seam import Model
from engine.strategies import decode
from engine import explore
from engine.config import ConfigError, DecodingConfig
from engine.numbers import decimal, interval, percent
from engine.settings import env_flag
from engine.trace import StepTrace, Trace
from playground.charts import step as charts
from playground.charts.presenter import step_chart

from .events import zero_gpu_active
from .page_js import ROUTE
from .shared import Shared, UserError, error_html, page_width

LOG = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024  # the knob values of one panel are ~2 KB
ROUTE_SLOTS = 4  # what-ifs computed at once by the route (a recompute forward is the costly case)
ROUTE_WAIT_S = 10.0  # a request waits this long for a slot, then the page is told to try again
PRESENTER_KNOBS = ("temperature",)  # what the presenter view's what-if may change
KEPT_LOCKS = 16  # locks striped over the sessions' what-if keys (a session in gr.State holds no lock)
STAGE_STRATEGIES = ("greedy", "sample")  # the strategies whose steps have stage panels to redraw

# What-if key -> StepSession or LessonSession (weakly: the session's gr.State owns it; an expired
# session's key stops working with it). Process-wide because sessions are made in every handler and
# come back unpickled from ZeroGPU's workers; the keys are secrets, like the page's owner token.
_SESSIONS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_SESSIONS_LOCK = threading.Lock()


def register(session: Any, key: str = "") -> str:
    """A new what-if key for ``session`` (a StepSession or LessonSession), or ``key`` again for a
    session unpickled from another process (ZeroGPU's workers return the sessions they made)."""
    key = key or secrets.token_urlsafe(24)
    with _SESSIONS_LOCK:
        _SESSIONS[key] = session
    return key


class Registered:
    """Mixin of the sessions the route finds by key: a copy made by unpickling (a ZeroGPU worker's
    result) is registered under its key in this process too."""

    whatif_key: str

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.whatif_key:
            register(self, self.whatif_key)


def session_of(key: Any) -> Any:
    """The session of what-if ``key``, or None (unknown, expired, not a key)."""
    if not isinstance(key, str) or not 16 <= len(key) <= 64:
        return None
    with _SESSIONS_LOCK:
        return _SESSIONS.get(key)


@dataclass(frozen=True)
class KeptLogits:
    """One step's raw logits [1, V], keyed by what they depend on: the model and the step's context."""

    key: str
    logits: torch.Tensor


def context_key(model: Any, quantization: Any, trace: Trace, step: int) -> str:
    """A digest of (model, quantization, the token ids before ``step``): equal keys, equal raw logits
    (``model`` and ``quantization`` as the page sent them)."""
    ids = explore.step_context(trace, step)
    return hashlib.sha256(repr((model, quantization, ids)).encode()).hexdigest()


@torch.inference_mode()
def keep(lm: Model, trace: Trace, step: int, kept: KeptLogits | None, key: str) -> KeptLogits:
    """``kept`` if its key is ``key``, else step ``step``'s raw logits, recomputed with one forward."""
    return kept if kept is not None and kept.key == key else KeptLogits(key, explore.raw_logits(lm, trace, step))


@torch.inference_mode()
def whatif_step(lm: Model, trace: Trace, step: int, knobs: dict, kept: KeptLogits | None,
                key: str) -> tuple[StepTrace, KeptLogits]:
    """Step ``step`` of ``trace`` re-processed under ``knobs``: its stages, and the token the new
    knobs would pick with the run's own draw u (engine.strategies.decode.whatif_step); and the kept logits
    (``keep``)."""
    kept = keep(lm, trace, step, kept, key)
    return decode.whatif_step(lm, trace, step, knobs, kept.logits), kept


# --- the answer's words and chart ---------------------------------------------------------------
OWN_KNOBS = "the run's own knobs"


def knob_diff(knobs: dict, config: dict) -> str:
    """"temperature = 2.5, top_k = 0": the knobs that differ from the run's ``config`` (or "the
    run's own knobs"); the seed and the token budget do not change a step."""
    try:
        full = DecodingConfig.from_dict(config).to_dict()  # a sparse trace config leaves defaults out
    except ConfigError:
        full = dict(config)
    plain = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
    diff = {k: ("reordered" if k == "stage_order" else v) for k, v in knobs.items()
            if plain(full.get(k, v)) != plain(v) and k not in ("max_new_tokens", "seed")}
    return ", ".join(f"{k} = {v}" for k, v in diff.items()) or OWN_KNOBS


pct = percent  # a probability as the whole page writes it (engine.numbers: never 0.0% for some mass)


def is_greedy(knobs: dict, config: dict) -> bool:
    """Whether the what-if's knobs (over the run's ``config``) pick greedily."""
    return knobs.get("strategy", config.get("strategy")) == "greedy"


def whatif_headline(changed: StepTrace, greedy: bool) -> str:
    """What the what-if would pick, in a few words (the chart's title)."""
    token = html.escape(charts.readable(changed.chosen_token))
    if greedy:
        return f"greedy would choose {token} (p = {pct(changed.chosen_prob)})"
    if changed.draw is not None:
        return f"the run's u = {decimal(changed.draw)} would choose {token} (p = {pct(changed.chosen_prob)})"
    return f"sampling would draw; the run's {token} has p = {pct(changed.chosen_prob)}"


def whatif_pick(original: StepTrace, changed: StepTrace, greedy: bool) -> str:
    """The explanation's sentence about the what-if's pick (``greedy``: the what-if's knobs are greedy)."""
    token, run = charts.readable(changed.chosen_token), charts.readable(original.chosen_token)
    versus = (f" The run chose “{run}” (p = {pct(original.chosen_prob)})." if changed.chosen_token_id != original.chosen_token_id
              else " The run chose it too.")
    if greedy:
        return (f"Greedy would take the most probable token “{token}” (p = {pct(changed.chosen_prob)}; raw model "
                f"{pct(changed.raw_prob)}).{versus}")
    if changed.draw is not None:
        return (f"The run's draw u = {decimal(changed.draw)} would fall in “{token}”'s slice "
                f"{interval(changed.draw_low, changed.draw_high)} of the new sorted cumulative distribution, so it would be chosen "
                f"(p = {pct(changed.chosen_prob)}; raw model {pct(changed.raw_prob)}).{versus}")
    how = "you picked it" if original.forced else "a greedy pick"
    return (f"This step has no draw to replay ({how}): sampling would draw from these "
            f"{charts.tokens_word(changed.stages[-1].kept)}, where the run's “{token}” has p = {pct(changed.chosen_prob)}.")


def whatif_explain(original: StepTrace, changed: StepTrace, knobs: dict, config: dict,
                   source: charts.Source = charts.LOCAL) -> str:
    """The explanation under the chart for the what-if: the stages under the new knobs and what
    they would pick, headed by the knobs that differ (the run's own knobs: the run's own explanation)."""
    what = knob_diff(knobs, config)
    if what == OWN_KNOBS:
        return charts.explain_step(original, source=source)
    return (f"**What if** ({html.escape(what)}): "
            + charts.explain_step(changed, pick=whatif_pick(original, changed, is_greedy(knobs, config))))


def stage_axis_spans(fig: Any, panels: int) -> list[tuple[float, float] | None]:
    """The probability axis of each of the first ``panels`` panels (x, x2, x3...: the stage panels;
    the draw's panel follows them) as the figure sets it: its range, or None where plotly picks
    the range itself from that panel's bars (autorange)."""
    spans = []
    for i in range(panels):
        axis = fig.layout[f"xaxis{i + 1 if i else ''}"]
        rng = axis.range if axis is not None else None
        spans.append((float(rng[0]), float(rng[1])) if rng is not None and axis.autorange in (None, False) else None)
    return spans


def axis_note(fig: Any, panels: int) -> str:
    """What the probability axes of ``fig``'s ``panels`` stage panels are, read from the figure:
    one shared axis (every panel set to the same range, named) or each panel on its own scale."""
    spans = stage_axis_spans(fig, panels)
    first = spans[0] if spans else None
    if first is not None and all(s == first for s in spans):
        low, high = first
        return f"one probability axis for all stages, {'0' if low == 0 else pct(low)} to {pct(high)}"
    return "each panel on its own scale"  # the words of the run's own chart (charts.step.stage_chart)


def whatif_figure(chart: Callable, trace: Trace, at: int, changed: StepTrace, knobs: dict, width: float | None) -> Any:
    """``chart(changed, width)`` titled with what the what-if would choose and what the run chose
    (the run's own knobs: the run's own step and title), stamped with its step (the page draws it
    only while that step is shown)."""
    original = trace.steps[at]
    if knob_diff(knobs, trace.config) == OWN_KNOBS:
        fig = chart(original, width, charts.source_of(trace, at))
    else:
        fig = chart(changed, width)
        fig.layout.title.text = (f"step {at}: what if, {whatif_headline(changed, is_greedy(knobs, trace.config))}"
                                 f"<br><sup>the run chose {html.escape(charts.readable(original.chosen_token))} "
                                 f"(p = {pct(original.chosen_prob)}) · {axis_note(fig, len(changed.stages))}</sup>")
    fig.layout.meta = {**fig.layout.meta, "step": at}
    return fig


def whatif_note(original: StepTrace, changed: StepTrace, knobs: dict, config: dict) -> str:
    """One line: which knobs differ from the run's, how many tokens survive, the top token now."""
    final = changed.stages[-1]
    top = final.top[0] if final.top else None
    chosen = next((t.prob for t in final.top if t.token_id == original.chosen_token_id), None)
    what = knob_diff(knobs, config)
    parts = [f"**What if** ({html.escape(what)}): {charts.tokens_word(final.kept)} survive"]
    if top is not None:
        parts.append(f"most likely now {html.escape(repr(charts.readable(top.token)))} ({percent(top.prob)})")
    parts.append(f"the run's token {html.escape(repr(charts.readable(original.chosen_token)))} "
                 + (percent(chosen) if chosen is not None else "outside the top tokens"))
    return "; ".join(parts) + "."


def remote_note(trace: Trace, at: int) -> str:
    """What a served model's what-if is computed over (engine.explore.raw_logits); "" for a model
    loaded here."""
    if not trace.extra.get("remote"):
        return ""
    tail = charts.step_tail(trace, at)
    if tail is not None:
        return f" Over the server's top {tail[0]} at this step, as the run was (the tail, {percent(tail[1])}, left out)."
    return " Over the server's top-N at this step (asked again: the run itself did not use our stages here)."


class RawJSON(str):
    """JSON text already strict (plotly's ``to_json`` writes NaN as null), placed as is by ``dumps``."""


def figure_answer(chart: Callable, changed: StepTrace, width: Any, at: int, trace: Trace, knobs: dict) -> dict:
    """The service's answer: ``chart(changed, width)`` titled with the what-if's pick (stamped with
    its step: the page draws it only while that step is shown), the what-if note and explanation."""
    original = trace.steps[at]
    fig = whatif_figure(chart, trace, at, changed, knobs, page_width(width))
    note = whatif_note(original, changed, knobs, trace.config) + remote_note(trace, at)
    return {"figure": RawJSON(fig.to_json()), "note": note,
            "explain": whatif_explain(original, changed, knobs, trace.config, charts.source_of(trace, at))}


def direct_enabled() -> bool:
    """Whether the page's knob changes go to the route (env ``DP_WHATIF_ROUTE``, default on; 0:
    every what-if is a Gradio event, e.g. behind a proxy that passes only Gradio's own paths)."""
    return env_flag("DP_WHATIF_ROUTE")


class RouteError(ValueError):
    """A malformed route request (not the page's): HTTP 400 with the message."""


@dataclass
class WhatIfService:
    """The app's what-if: every page's knob changes (Step through) and temperature slider (the
    presenter view). ``answer`` is the route's whole protocol; ``step_answer`` is the computation
    both transports share.

    Route body (JSON object): ``key`` (the session's what-if key), ``step`` (the selected step),
    ``model`` and ``quantization`` (the pickers), ``width`` (the page's, px, or null) and
    ``values`` (the Step view's knob panel values in its inputs' order); or ``view: "presenter"``
    with ``knobs: {"temperature": t}``; or ``prepare: true`` (keep the step's logits now). Answer:
    ``{"figure": <plotly figure>, "note": <markdown>, "explain": <markdown>}``; ``{"figure": null,
    "note": <error html>}`` for bad knob values or an expired session; ``{"fallback": true}`` when
    only a Gradio event can answer; ``RouteError`` (HTTP 400) for a body that is not such an object."""

    shared: Shared
    panel: Any = None  # the Step view's KnobPanel (use_panel): the route's ``values`` are its inputs'
    direct: bool = dataclasses.field(default_factory=direct_enabled)  # False: always the fallback
    slots: threading.BoundedSemaphore = dataclasses.field(
        default_factory=lambda: threading.BoundedSemaphore(ROUTE_SLOTS))
    locks: tuple[threading.Lock, ...] = dataclasses.field(
        default_factory=lambda: tuple(threading.Lock() for _ in range(KEPT_LOCKS)))

    def use_panel(self, panel: Any) -> None:
        """The Step view's knob panel, whose values the page posts (set once, when the view is built)."""
        self.panel = panel

    # --- the kept logits: read and written only here ----------------------------------------------
    def kept_lock(self, session: Any) -> threading.Lock:
        """The lock every reader and writer of ``session.kept`` holds (route, prepare, fallback)."""
        return self.locks[hash(session.whatif_key) % len(self.locks)]

    def kept_for(self, session: Any, lm: Model, trace: Trace, step: int, key: str) -> KeptLogits:
        """The session's kept logits for ``key`` (step ``step`` of ``trace``), computed with one
        forward if it holds other ones; a concurrent request for the same session waits for it."""
        with self.kept_lock(session):
            session.kept = keep(lm, trace, step, session.kept, key)
            return session.kept

    @staticmethod
    def holds(session: Any, key: str) -> bool:
        """Whether ``session`` keeps the logits of ``key`` already."""
        return session.kept is not None and session.kept.key == key

    def compute(self, session: Any, lm: Model, trace: Trace, at: int, knobs: dict, key: str) -> StepTrace:
        """Step ``at`` of ``trace`` under ``knobs`` from the session's kept logits, under its lock
        (a served model's: the server's top-N at the step, engine.explore.raw_logits)."""
        with self.kept_lock(session):
            changed, session.kept = whatif_step(lm, trace, at, knobs, session.kept, key)
        return changed

    # --- the one computation both transports share ------------------------------------------------
    def step_answer(self, session: Any, trace: Trace, at: int, model: Any, quant: Any, width: Any,
                    values: list, *, load: bool) -> dict:
        """The Step view's knob change: step ``at`` under the panel's ``values``, answered (a note
        for bad values). ``load``: the Gradio event's call, which may load the model; the route's
        (False) answers ``{"fallback": True}`` when only such an event can (model not loaded, ZeroGPU)."""
        try:
            knobs = self.panel.values(*values)
            key = context_key(model, quant, trace, at)
            changed: StepTrace | dict
            if load:
                changed = self.compute(session, self.shared.lm(model, quant), trace, at, knobs, key)
            else:
                lm = self.shared.loaded_lm(model, quant)
                if lm is None or (not self.holds(session, key) and zero_gpu_active()):
                    return {"fallback": True}  # ZeroGPU: only Gradio's events get the GPU
                changed = self.in_slot(session, lm, trace, at, knobs, key, "knob")
        except ValueError as exc:  # UserError, ConfigError: the page's values
            return {"figure": None, "note": error_html(str(exc))}
        return changed if isinstance(changed, dict) else figure_answer(
            charts.fitted_stage_chart, changed, width, at, trace, knobs)

    def in_slot(self, session: Any, lm: Model, trace: Trace, at: int, knobs: dict, key: str,
                control: str) -> StepTrace | dict:
        """``compute`` in one of the route's slots; the answer itself when none frees up in time."""
        if not self.slots.acquire(timeout=ROUTE_WAIT_S):
            return {"figure": None, "note": error_html(f"what if: the server is busy; move the {control} again")}
        try:
            return self.compute(session, lm, trace, at, knobs, key)
        finally:
            self.slots.release()

    # --- the route's protocol ---------------------------------------------------------------------
    def answer(self, body: bytes) -> dict:
        """The route's answer to ``body`` (see the class)."""
        request = parse_body(body)
        if request.get("prepare") is True:
            return self.prepare(request)
        if request.get("view") == "presenter":
            return self.presenter(request)
        if not self.direct:
            return {"fallback": True}
        values = request.get("values")
        if not isinstance(values, list) or len(values) != len(self.panel.inputs):
            raise RouteError(f"values: expected a list of {len(self.panel.inputs)} knob values")
        found = self.selected(request)
        if isinstance(found, dict):
            return found
        session, trace, at = found
        return self.step_answer(session, trace, at, request.get("model"), request.get("quantization"),
                                request.get("width"), values, load=False)

    def presenter(self, request: dict) -> dict:
        """``{"view": "presenter", key, step, model, quantization, width, "knobs": {"temperature": t}}``:
        the lesson's step at that temperature, projector-sized (a greedy run's step is shown as
        sampling would see it). No fallback: a ZeroGPU Space or an unloaded model gets a note."""
        knobs = request.get("knobs")
        if not isinstance(knobs, dict) or set(knobs) - set(PRESENTER_KNOBS):
            raise RouteError(f"knobs: expected an object with only {', '.join(PRESENTER_KNOBS)}")
        found = self.selected(request)
        if isinstance(found, dict):
            return found
        session, trace, at = found
        if trace.strategy == "greedy":
            knobs = {**knobs, "strategy": "sample"}
        try:
            model, quant = request.get("model"), request.get("quantization")
            key = context_key(model, quant, trace, at)
            lm = self.shared.loaded_lm(model, quant)
            if lm is None or (not self.holds(session, key) and zero_gpu_active()):
                return {"figure": None, "note": error_html("what if: not available here; use Step through's knobs")}
            changed = self.in_slot(session, lm, trace, at, knobs, key, "slider")
        except ValueError as exc:
            return {"figure": None, "note": error_html(str(exc))}
        return changed if isinstance(changed, dict) else figure_answer(
            step_chart, changed, request.get("width"), at, trace, knobs)

    def prepare(self, request: dict) -> dict:
        """``{"prepare": true, key, step, model, quantization}`` (the page sends it when a step is
        selected): keep that step's raw logits now, so the first knob change needs no forward. Only
        when a slot is free at once: under load the first change pays the forward instead."""
        found = self.selected(request)
        if isinstance(found, dict) or not (self.direct or request.get("view") == "presenter"):
            return {"prepared": False}
        session, trace, at = found
        model, quant = request.get("model"), request.get("quantization")
        try:
            key = context_key(model, quant, trace, at)
            lm = self.shared.loaded_lm(model, quant)
        except UserError:
            return {"prepared": False}
        if self.holds(session, key):
            return {"prepared": True}
        if lm is None or zero_gpu_active() or not self.slots.acquire(blocking=False):
            return {"prepared": False}
        try:
            self.kept_for(session, lm, trace, at, key)
        finally:
            self.slots.release()
        return {"prepared": True}

    @staticmethod
    def selected(request: dict) -> tuple[Any, Trace, int] | dict:
        """(session, its current trace, the selected step clamped to it) of a request, or the answer
        when there is nothing to draw (an expired key, no run, a strategy without stages)."""
        session = session_of(request.get("key"))
        if session is None:
            return {"figure": None, "note": error_html("what if: this page's runs have expired; generate again")}
        trace = session.whatif_trace()
        if trace is None or not trace.steps or trace.strategy not in STAGE_STRATEGIES:
            return {"figure": None, "note": None}  # nothing to draw
        step = request.get("step")
        if isinstance(step, (int, float)) and not isinstance(step, bool):
            return session, trace, max(0, min(int(step), len(trace.steps) - 1))
        return session, trace, 0


def dumps(payload: dict) -> str:
    """Strict JSON of an answer (ValueError on NaN), RawJSON values spliced in as they are."""
    raw = {k: v for k, v in payload.items() if isinstance(v, RawJSON)}
    text = json.dumps({k: (None if k in raw else v) for k, v in payload.items()}, allow_nan=False)
    for name, value in raw.items():
        text = text.replace(json.dumps(name) + ": null", json.dumps(name) + ": " + value, 1)
    return text


def parse_body(body: bytes) -> dict:
    """The request body as a JSON object (strict: NaN and Infinity are refused), else RouteError."""
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not allowed")

    try:
        request = json.loads(body.decode("utf-8"), parse_constant=no_constants)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RouteError(f"body: not valid JSON ({str(exc)[:80]})") from None
    except RecursionError:  # deeper than the JSON parser goes: the page never sends that
        raise RouteError("body: JSON nested too deeply") from None
    if not isinstance(request, dict):
        raise RouteError(f"body: expected a JSON object, got a JSON {type(request).__name__}")
    return request


# --- the transport: ROUTE on the app's web server -------------------------------------------------
# Gradio builds the web app at launch, so the route finds its app's service through the app's Blocks.
_SERVICES: "weakref.WeakKeyDictionary[gr.Blocks, WhatIfService]" = weakref.WeakKeyDictionary()


def serve(demo: gr.Blocks, service: WhatIfService) -> None:
    """Answer ``ROUTE`` for ``demo`` with ``service`` (the app passes ``routes()`` to its web app)."""
    _SERVICES[demo] = service


def service_of(demo: gr.Blocks) -> WhatIfService | None:
    """The service ``demo`` serves (None: an app without Step through)."""
    return _SERVICES.get(demo)


def services() -> list[WhatIfService]:
    """Every app's service in this process (tests and the bench switch their ``direct``)."""
    return list(_SERVICES.values())


def _json(payload: dict, status: int = 200) -> Response:
    return Response(dumps(payload), status_code=status, media_type="application/json",
                    headers={"Cache-Control": "no-store"})


async def whatif_endpoint(request: Request) -> Response:
    """``ROUTE``: the body read up to MAX_BODY_BYTES, answered in a worker thread."""
    get_blocks = getattr(request.app, "get_blocks", None)
    service = service_of(get_blocks()) if get_blocks is not None else None
    if service is None:
        return _json({"error": "what if: this app has no Step-through view"}, 404)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return _json({"error": f"body: over {MAX_BODY_BYTES:,} bytes"}, 413)
    try:
        payload = await anyio.to_thread.run_sync(service.answer, bytes(body))
    except RouteError as exc:
        return _json({"error": str(exc)}, 400)
    except Exception as exc:  # a bug, not the page's: logged, and the page gets a note instead of a 500
        LOG.exception("what-if route failed")
        return _json({"figure": None, "note": error_html(f"what if failed: {type(exc).__name__}")})
    try:
        return _json(payload)
    except ValueError:  # a NaN in the figure: refuse rather than emit non-strict JSON
        return _json({"figure": None, "note": error_html("what if: the chart could not be drawn")})


def routes() -> list[Route]:
    """The web app's own routes (given to Gradio's FastAPI app at launch: playground.app.launch_kwargs)."""
    return [Route(ROUTE, whatif_endpoint, methods=["POST"])]
