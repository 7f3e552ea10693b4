"""What if, on the Step-through view: move any stage knob (or the stage order) and the selected
step's stage chart is re-drawn at once from that step's raw logits, without generating again
(engine.explore). "Continue from here with these knobs" turns the what-if into a branch: the steps
before the selected one are the run's, the rest are generated under the new knobs.

Per-session state is one ``KeptLogits`` (one step's raw logits, [1, V] float32: bounded); it is
recomputed with one forward when the selected step (or the run, or the model) changes.

The knob change takes the shortest way there is (WHATIF_JS, in the page): no Gradio event reaches
the server. The page posts the knob values with the session's what-if key (a secret the view wrote
into a hidden box) to the app's own route ``/dp/whatif`` (``WhatIfRoute``: the stage chain over the
kept logits and the chart, ~20 ms on a CPU) and draws the figure into the step chart with one
``Plotly.react``: not through the chart's ``gr.Plot``, which follows every new value with
``Plotly.Plots.resize`` (a 100 ms timer and a second layout). When the route cannot answer (a model
not loaded yet, a ZeroGPU Space, where only Gradio's events hold the GPU) the page presses a hidden
button and the same what-if runs as a Gradio event (``on_knob``: the figure's JSON through a hidden
box, drawn by DRAW_JS). The view stamps every chart it sends the Plot (``charts.step.revised``), so the Plot
redraws the run's own step after a what-if even when that figure equals the last one it drew.
API: ``/explore_step`` (trace JSON, step, knobs -> that step's ``stages`` in trace-JSON format).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import html
import json
import logging
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import anyio
import gradio as gr
import torch
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine import decode, explore, runner
from engine.config import ConfigError, DecodingConfig
from engine.control import RunControl
from engine.models import LoadedModel
from engine.settings import env_flag
from engine.trace import Event, StageTrace, StepTrace, Trace, to_dict
from playground.charts import step as charts

from ..page_js import DRAW_JS, PREPARE_JS, ROUTE, WHATIF_JS
from ..events import zero_gpu, zero_gpu_active
from ..shared import Shared, UserError, error_html, page_width, parent_trace
from .presenter import step_chart

LOG = logging.getLogger(__name__)
WHATIF_CONCURRENCY = {"concurrency_id": "whatif", "concurrency_limit": 4}
MAX_BODY_BYTES = 64 * 1024  # the knob values of one panel are ~2 KB
ROUTE_SLOTS = 4  # what-ifs computed at once by the route (a recompute forward is the costly case)
PRESENTER_KNOBS = ("temperature",)  # what the presenter view's what-if may change
ROUTE_WAIT_S = 10.0  # a request waits this long for a slot, then the page is told to try again
# What-if key -> StepSession or LessonSession (weakly: the session's gr.State owns it; an expired session's key stops
# working with it). A key is a secret only its own page gets, like the page's owner token.
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
    """The StepSession of what-if ``key``, or None (unknown, expired, not a key)."""
    if not isinstance(key, str) or not 16 <= len(key) <= 64:
        return None
    with _SESSIONS_LOCK:
        return _SESSIONS.get(key)


@dataclass(frozen=True)
class KeptLogits:
    """One step's raw logits [1, V], keyed by what they depend on: the model and the step's context."""

    key: str
    logits: torch.Tensor


def context_key(model: str, quantization: str, trace: Trace, step: int) -> str:
    """A digest of (model, quantization, the token ids before ``step``): equal keys, equal raw logits."""
    ids = explore.step_context(trace, step)
    return hashlib.sha256(repr((model, quantization, ids)).encode()).hexdigest()


@torch.inference_mode()
def whatif_step(lm: LoadedModel, trace: Trace, step: int, knobs: dict, kept: KeptLogits | None,
                key: str) -> tuple[StepTrace, KeptLogits]:
    """Step ``step`` of ``trace`` re-processed under ``knobs``: its stages, and the token the new
    knobs would pick with the run's own draw u (engine.decode.whatif_step); and the kept logits."""
    if kept is None or kept.key != key:
        kept = KeptLogits(key, explore.raw_logits(lm, trace, step))
    return decode.whatif_step(lm, trace, step, knobs, kept.logits), kept


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


def pct(p: float) -> str:
    """A probability as a percentage that never reads 0.0% for a token that has some mass."""
    return f"{p:.1%}" if p >= 0.001 or p == 0 else f"{p:.1e}"


def is_greedy(knobs: dict, config: dict) -> bool:
    """Whether the what-if's knobs (over the run's ``config``) pick greedily."""
    return knobs.get("strategy", config.get("strategy")) == "greedy"


def whatif_headline(changed: StepTrace, greedy: bool) -> str:
    """What the what-if would pick, in a few words (the chart's title)."""
    token = html.escape(charts.readable(changed.chosen_token))
    if greedy:
        return f"greedy would choose {token} (p = {pct(changed.chosen_prob)})"
    if changed.draw is not None:
        return f"the run's u = {changed.draw:.3f} would choose {token} (p = {pct(changed.chosen_prob)})"
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
        return (f"The run's draw u = {changed.draw:.3f} would fall in “{token}”'s slice [{changed.draw_low:.4f}, "
                f"{changed.draw_high:.4f}) of the new sorted cumulative distribution, so it would be chosen "
                f"(p = {pct(changed.chosen_prob)}; raw model {pct(changed.raw_prob)}).{versus}")
    how = "you picked it" if original.forced else "a greedy pick"
    return (f"This step has no draw to replay ({how}): sampling would draw from these "
            f"{charts.tokens_word(changed.stages[-1].kept)}, where the run's “{token}” has p = {pct(changed.chosen_prob)}.")


def whatif_explain(original: StepTrace, changed: StepTrace, knobs: dict, config: dict) -> str:
    """The explanation under the chart for the what-if: the stages under the new knobs and what
    they would pick, headed by the knobs that differ (the run's own knobs: the run's own explanation)."""
    what = knob_diff(knobs, config)
    if what == OWN_KNOBS:
        return charts.explain_step(original)
    return (f"**What if** ({html.escape(what)}): "
            + charts.explain_step(changed, pick=whatif_pick(original, changed, is_greedy(knobs, config))))


def whatif_figure(chart: Any, trace: Trace, at: int, changed: StepTrace, knobs: dict, width: float | None) -> Any:
    """``chart(changed, width)`` titled with what the what-if would choose and what the run chose
    (the run's own knobs: the run's own step and title), stamped with its step (the page draws it
    only while that step is shown)."""
    original = trace.steps[at]
    if knob_diff(knobs, trace.config) == OWN_KNOBS:
        fig = chart(original, width)
    else:
        fig = chart(changed, width)
        fig.layout.title.text = (f"step {at}: what if, {whatif_headline(changed, is_greedy(knobs, trace.config))}"
                                 f"<br><sup>the run chose {html.escape(charts.readable(original.chosen_token))} "
                                 f"(p = {pct(original.chosen_prob)}) · one probability axis for all stages</sup>")
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
        parts.append(f"most likely now {html.escape(repr(charts.readable(top.token)))} ({top.prob:.1%})")
    parts.append(f"the run's token {html.escape(repr(charts.readable(original.chosen_token)))} "
                 + (f"{chosen:.1%}" if chosen is not None else "outside the top tokens"))
    return "; ".join(parts) + "."


def continue_events(shared: Shared, lm: LoadedModel, parent: Trace, at: int, config: DecodingConfig,
                    control: RunControl) -> Iterator[Event]:
    """``parent``'s steps before ``at`` unchanged, then steps ``at``... generated under ``config``:
    the runner's own continuation (``runner.branch`` with no forced token, the app's batched
    scheduler), with its guards and stop rules; the last event holds the Trace (``branch_of`` =
    ``at``, ``config`` = the new one)."""
    if config.strategy not in ("greedy", "sample"):
        raise UserError(f"strategy: only greedy and sampling continue from a step, got {config.strategy!r}")
    return runner.branch(lm, parent, at, None, config=config, control=control, scheduler=shared.scheduler_for(lm))


def explore_api(shared: Shared, trace: dict | str, step: int, knobs: dict | None = None, model: str = "embedded",
                quantization: str = "none", *, control: RunControl) -> list[dict]:
    """Step ``step`` of ``trace`` (a greedy or sampling trace JSON, e.g. from /step_trace)
    re-processed under ``knobs`` (knob values over the trace's own config); returns that step's
    ``stages`` list in trace-JSON format. With no knobs it reproduces the trace's own stages."""

    lm = shared.lm(model, quantization)
    parsed = parent_trace(shared, lm, trace, "trace")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ConfigError("step", f"expected an integer, got {step!r:.40}")
    control.check()
    with torch.inference_mode():
        stages: list[StageTrace] = explore.explore_step(lm, parsed, step, knobs)
    return to_dict(stages)


def direct_enabled() -> bool:
    """Whether the page's knob changes go to the route (env ``DP_WHATIF_ROUTE``, default on; 0:
    every what-if is a Gradio event, e.g. behind a proxy that passes only Gradio's own paths)."""
    return env_flag("DP_WHATIF_ROUTE")


class RouteError(ValueError):
    """A malformed route request (not the page's): HTTP 400 with the message."""


@dataclass
class WhatIfRoute:
    """``POST /dp/whatif``: one knob change of one page, answered without Gradio's event path.

    Body (JSON object): ``key`` (the session's what-if key), ``step`` (the selected step),
    ``model`` and ``quantization`` (the pickers), ``width`` (the page's, px, or null) and
    ``values`` (the knob panel's values in its inputs' order). Answer: ``{"figure": <plotly
    figure titled with what the new knobs would pick>, "note": <markdown>, "explain": <markdown:
    the explanation under the chart, for the new knobs>}``; ``{"figure": null, "note": <error html>}`` for bad knob values
    or an expired session; ``{"fallback": true}`` when only a Gradio event can answer (the model
    is not loaded, or this is a ZeroGPU Space and the step's logits must be recomputed); HTTP 400
    with ``{"error": ...}`` for a body that is not such an object. Every answer is strict JSON."""

    shared: Shared
    panel: Any  # the view's KnobPanel
    direct: bool = dataclasses.field(default_factory=lambda: direct_enabled())  # False: always the fallback
    slots: threading.BoundedSemaphore = dataclasses.field(
        default_factory=lambda: threading.BoundedSemaphore(ROUTE_SLOTS))

    def answer(self, body: bytes) -> dict:
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
        try:
            knobs = self.panel.values(*values)
            lm, key, kept = self.model_for(request, session, trace, at)
            if lm is None or (not kept and zero_gpu_active()):  # ZeroGPU: only Gradio's events get the GPU
                return {"fallback": True}
            changed = self.redraw(session, lm, trace, at, knobs, key, "knob")
        except (UserError, ConfigError, ValueError) as exc:
            return {"figure": None, "note": error_html(str(exc))}
        return changed if isinstance(changed, dict) else figure_answer(
            charts.fitted_stage_chart, changed, request, at, trace, knobs)

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
            lm, key, kept = self.model_for(request, session, trace, at)
            if lm is None or (not kept and zero_gpu_active()):
                return {"figure": None, "note": error_html("what if: not available here; use Step through's knobs")}
            changed = self.redraw(session, lm, trace, at, knobs, key, "slider")
        except (UserError, ConfigError, ValueError) as exc:
            return {"figure": None, "note": error_html(str(exc))}

        return changed if isinstance(changed, dict) else figure_answer(step_chart, changed, request, at, trace, knobs)

    def redraw(self, session: Any, lm: LoadedModel, trace: Trace, at: int, knobs: dict, key: str,
               control: str) -> StepTrace | dict:
        """Step ``at`` under ``knobs`` from the session's kept logits (one forward when it holds
        another step's), in one of the route's slots; the answer itself when none frees up in time."""
        if not self.slots.acquire(timeout=ROUTE_WAIT_S):
            return {"figure": None, "note": error_html(f"what if: the server is busy; move the {control} again")}
        try:
            changed, _ = whatif_step(lm, trace, at, knobs, kept_for(session, lm, trace, at, key), key)
        finally:
            self.slots.release()
        return changed

    def prepare(self, request: dict) -> dict:
        """``{"prepare": true, key, step, model, quantization}`` (the page sends it when a step is
        selected): keep that step's raw logits now, so the first knob change needs no forward. Only
        when a slot is free at once: under load the first change pays the forward instead."""
        found = self.selected(request)
        if isinstance(found, dict) or not (self.direct or request.get("view") == "presenter"):
            return {"prepared": False}
        session, trace, at = found
        try:
            lm, key, kept = self.model_for(request, session, trace, at)
        except UserError:
            return {"prepared": False}
        if kept:
            return {"prepared": True}
        if lm is None or zero_gpu_active() or not self.slots.acquire(blocking=False):
            return {"prepared": False}
        try:
            kept_for(session, lm, trace, at, key)
        finally:
            self.slots.release()
        return {"prepared": True}

    def model_for(self, request: dict, session: Any, trace: Trace, at: int) -> tuple[LoadedModel | None, str, bool]:
        """The model the request names if it is loaded (None if not; UserError if the policy refuses
        it: a route never loads one), the kept-logits key of step ``at`` under it, and whether the
        session keeps that step's logits already (else redrawing it needs a forward)."""
        model, quant = request.get("model"), request.get("quantization")
        key = context_key(model, quant, trace, at)
        return self.shared.loaded_lm(model, quant), key, session.kept is not None and session.kept.key == key

    @staticmethod
    def selected(request: dict) -> tuple[Any, Trace, int] | dict:
        """(session, its current trace, the selected step clamped to it) of a request, or the answer
        when there is nothing to draw (an expired key, no run, a strategy without stages)."""
        session = session_of(request.get("key"))
        if session is None:
            return {"figure": None, "note": error_html("what if: this page's runs have expired; generate again")}
        trace = session.whatif_trace()
        if trace is None or not trace.steps or trace.strategy not in ("greedy", "sample"):
            return {"figure": None, "note": None}  # nothing to draw
        step = request.get("step")
        number = isinstance(step, (int, float)) and not isinstance(step, bool)
        return session, trace, max(0, min(int(step), len(trace.steps) - 1)) if number else 0


def figure_answer(chart: Any, changed: StepTrace, request: dict, at: int, trace: Trace, knobs: dict) -> dict:
    """The route's answer: ``chart(changed, width)`` titled with the what-if's pick (stamped with
    its step: the page draws it only while that step is shown), the what-if note and explanation."""

    original = trace.steps[at]
    fig = whatif_figure(chart, trace, at, changed, knobs, page_width(request.get("width")))
    return {"figure": RawJSON(fig.to_json()), "note": whatif_note(original, changed, knobs, trace.config),
            "explain": whatif_explain(original, changed, knobs, trace.config)}


# One session's kept logits are computed once even when a prepare and a knob change overlap.
_KEPT_LOCKS = tuple(threading.Lock() for _ in range(16))


def kept_lock(session: Any) -> threading.Lock:
    """The lock every reader and writer of ``session.kept`` holds (the route, prepare, the fallback)."""
    return _KEPT_LOCKS[hash(session.whatif_key) % len(_KEPT_LOCKS)]


def kept_for(session: Any, lm: LoadedModel, trace: Trace, step: int, key: str) -> KeptLogits:
    """The session's kept logits for ``key`` (step ``step`` of ``trace``), computed with one forward
    if it holds other ones; a concurrent request for the same session waits for that forward."""
    with kept_lock(session):
        kept = session.kept
        if kept is None or kept.key != key:
            with torch.inference_mode():
                kept = session.kept = KeptLogits(key, explore.raw_logits(lm, trace, step))
        return kept


class RawJSON(str):
    """JSON text already strict (plotly's ``to_json`` writes NaN as null), placed as is by ``dumps``."""


def dumps(payload: dict) -> str:
    """Strict JSON of a route answer (ValueError on NaN), RawJSON values spliced in as they are."""
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


# The route of each app: Gradio builds the web app at launch, so the route finds its WhatIfRoute
# through the app's Blocks.
_ROUTES: "weakref.WeakKeyDictionary[Any, WhatIfRoute]" = weakref.WeakKeyDictionary()


def serve(demo: gr.Blocks, route: WhatIfRoute) -> None:
    """Answer ``ROUTE`` for ``demo`` with ``route`` (the app passes ``routes()`` to its web app)."""
    _ROUTES[demo] = route


def _json(payload: dict, status: int = 200) -> Response:
    return Response(dumps(payload), status_code=status, media_type="application/json",
                    headers={"Cache-Control": "no-store"})


async def whatif_endpoint(request: Request) -> Response:
    """``ROUTE``: the body read up to MAX_BODY_BYTES, answered in a worker thread."""
    get_blocks = getattr(request.app, "get_blocks", None)
    route = _ROUTES.get(get_blocks()) if get_blocks is not None else None
    if route is None:
        return _json({"error": "what if: this app has no Step-through view"}, 404)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return _json({"error": f"body: over {MAX_BODY_BYTES:,} bytes"}, 413)
    try:
        payload = await anyio.to_thread.run_sync(route.answer, bytes(body))
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


@dataclass
class WhatIfPanel:
    """The what-if row under the step chart: a note and the Continue button, plus the hidden
    what-if key (WHATIF_JS), the fallback button and the box its figure's JSON goes through (DRAW_JS)."""

    note: gr.Markdown
    continue_btn: gr.Button
    figure: gr.Textbox
    key: gr.Textbox
    fallback: gr.Button
    route: WhatIfRoute | None = None

    @classmethod
    def build(cls) -> "WhatIfPanel":
        with gr.Row(elem_id="step-whatif"):
            note = gr.Markdown("*What if:* select a step, then move any knob on the left: the chart re-draws "
                               "that step under the new knobs, without generating again.", elem_id="step-whatif-note")
            button = gr.Button("Continue from here with these knobs", scale=0, min_width=200,
                               elem_id="step-whatif-continue")
        hidden = {"show_label": False, "container": False, "elem_classes": ["dp-hidden"]}
        figure = gr.Textbox("", elem_id="step-whatif-figure", **hidden)
        key = gr.Textbox("", elem_id="step-whatif-key", **hidden)
        fallback = gr.Button("what if", elem_id="step-whatif-fallback", elem_classes=["dp-hidden"])
        return cls(note, button, figure, key, fallback)

    def wire(self, shared: Shared, view: Any, out: Any, colour_by: gr.Radio, stream_run: Any, own: Any,
             request_cls: Any) -> None:
        """Every stage knob and the stage order re-draw the selected step (UI only, no generation):
        in the page through the route (WHATIF_JS), else through the hidden fallback button's event;
        Continue is a model event that streams the new branch into the view."""
        panel = view.panel
        # The stage order's hidden box is written by the page's sortable list, which Gradio does not
        # see as the box's input event: its change (any new value) is the trigger there.
        triggers = [c.change if c is panel.stage_order else c.input for c in panel.inputs]
    
        self.route = WhatIfRoute(shared, panel)
        gr.on(triggers, None, [self.key, self.note, out.explain, out.step, shared.model, shared.quantization, view.width,
                               *panel.inputs], [self.note, out.explain], js=WHATIF_JS, api_visibility="private",
              trigger_mode="always_last", show_progress="hidden", queue=False)
        out.chart.change(None, [self.key, out.step, shared.model, shared.quantization], None, js=PREPARE_JS,
                         api_visibility="private", trigger_mode="always_last", show_progress="hidden", queue=False)

        def on_knob(state, owner, step, model, quant, width, *values) -> dict:
            state = own(state, owner)
            trace = state.trace() if state is not None else None
            if trace is None or not trace.steps or trace.strategy not in ("greedy", "sample"):
                return {self.note: gr.skip(), self.figure: ""}  # nothing to draw
            at = max(0, min(int(step or 0), len(trace.steps) - 1))
            try:
                knobs = panel.values(*values)
                lm = shared.lm(model, quant)
                with kept_lock(state):  # the route may be computing this session's kept logits
                    changed, state.kept = whatif_step(lm, trace, at, knobs, state.kept,
                                                      context_key(model, quant, trace, at))
            except (UserError, ConfigError, ValueError) as exc:
                return {self.note: error_html(str(exc)), self.figure: ""}
            original = trace.steps[at]
            # DRAW_JS draws it only while that step is selected
            fig = whatif_figure(charts.fitted_stage_chart, trace, at, changed, knobs, page_width(width))
            return {self.figure: fig.to_json(), self.note: whatif_note(original, changed, knobs, trace.config),
                    out.explain: whatif_explain(original, changed, knobs, trace.config)}

        inputs = [out.session, out.owner, out.step, shared.model, shared.quantization, view.width, *panel.inputs]
        gr.on([self.fallback.click], zero_gpu(on_knob), inputs, [self.figure, self.note, out.explain],
              api_visibility="private",
              trigger_mode="always_last", show_progress="hidden", **WHATIF_CONCURRENCY).success(
            None, [self.figure], None, js=DRAW_JS, queue=False, show_progress="hidden", api_visibility="private")

        def on_continue(model, quant, colour, state, owner, step, width, *values,
                        control: RunControl) -> Iterator[dict]:
            state = own(state, owner)
            if state is None or state.trace() is None or not state.trace().steps:
                raise UserError("continue: generate a run first")
            parent = state.trace()
            at = max(0, min(int(step or 0), len(parent.steps) - 1))
            config = panel.config(*values)
            lm = shared.lm(model, quant)
            req = request_cls(lm, parent.prompt, parent.prompt_token_ids, config, parent.chat, colour)
            events = continue_events(shared, lm, parent, at, config, control)
            yield from stream_run(out, shared, state, req, control, branch=(parent, at, None), events=events,
                                  width=page_width(width))

        shared.events.on([self.continue_btn.click], on_continue,
                         [shared.model, shared.quantization, colour_by, out.session, out.owner, out.step, view.width,
                          *panel.inputs],
                         out.all(), on_error=lambda message: {out.status: error_html(message)}, what="continue")
        shared.events.api(functools.partial(explore_api, shared), "explore_step", what="what-if")
