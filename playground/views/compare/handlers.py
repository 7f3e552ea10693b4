"""The Compare page's handlers: lane reshaping (add / duplicate / remove), running every lane,
the token inspector and the seed sweep. All updates are ``{component: value}`` dicts."""

from __future__ import annotations

import dataclasses
import html
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Sequence

import gradio as gr

from engine.strategies import contrastive
from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.reports import lessons as engine_lessons
from engine.reports.lessons import Lesson
from engine.reports.metrics import lane_metrics, mean_logprob, sweep_spread
from playground.charts import compare as charts
from playground.charts import step as step_charts

from ...events import stop_button
from ...knobs import compact_knob_state
from ...shared import Shared, UserError, error_html, shown_pick, status_html, with_mode
from ...page_js import RUN_BUTTONS
from ...user_presets import CUSTOM, lane_configs, preset_choices
from ...stale import cleared
from .lanes import (
    DONE, FAILED, LANE_FIELDS, MAX_LANES, RUN_KNOBS, RUNNING, STOPPED, WAITING, CompareSession, LaneSpec, add_lane,
    default_spec, duplicate_lane, lane_config, lane_name, lane_served_words, remove_lane, spec_from_config,
    spec_from_preset, sweep_seeds,
)
from .layout import LaneWidgets, Page, summary_of
from .run import lane_models, run_lanes, run_sweep

RAW_ENTROPY = "raw model"


def specs_from(values: Sequence[Any], count: int) -> list[LaneSpec]:
    """The first ``count`` lanes' settings from the flat LANE_FIELDS x MAX_LANES values."""
    n = len(LANE_FIELDS)
    return [LaneSpec.from_values(values[n * i:n * i + n]) for i in range(count)]


def lane_updates(lane: LaneWidgets, i: int, spec: LaneSpec) -> dict:
    """``{control: update}`` showing ``spec`` in lane ``i``: values, header, greyed knobs."""
    out: dict[Any, Any] = {lane.preset: spec.preset, lane.strategy: spec.strategy, lane.more: spec.more,
           lane.header: charts.lane_header(lane_name(i), *summary_of(spec))}
    for name, control in lane.knobs.items():
        out[control] = gr.update(value=spec.knob(name), **compact_knob_state(name, spec.strategy))
    return out


def render_specs(page: Page, specs: Sequence[LaneSpec]) -> dict:
    """Show the first ``len(specs)`` lane columns with these settings; hide the rest."""
    out: dict = {}
    for i, lane in enumerate(page.lanes):
        if i < len(specs):
            out |= {lane.column: gr.update(visible=True)} | lane_updates(lane, i, specs[i])
        else:
            out[lane.column] = gr.update(visible=False)
    return out


def lane_status(lane: LaneWidgets, i: int, session: CompareSession) -> str:
    """Lane ``i``'s status line, drawn from its own phase, trace and error in ``session``."""
    error = session.errors[i] if i < len(session.errors) else ""
    if error:
        return error_html(f"{lane_name(i)}: {error}")
    trace = session.traces[i] if i < len(session.traces) else None
    on = session.on(i)  # said from the start: a served lane that made no token yet names its server too
    why = "at the time limit" if session.stopped == "time_limit" else ""
    return charts.lane_status(lane_name(i), trace, session.budget(i), session.phase(i),
                              html.escape(f" · {on}") if on else "", session.made(i), why)


def render_results(page: Page, session: CompareSession, count: int, raw: bool) -> dict:
    """Every shown lane's status and text, and (unless the run is under way) the lane pickers,
    the divergence, metrics and entropy chart. A run's updates carry no more than they change:
    every update costs the browser a redraw of what it carries."""
    running = session.running
    at = None if running else session.divergence()
    out: dict = {}
    for i, lane in enumerate(page.lanes[:count]):
        trace = session.traces[i] if i < len(session.traces) else None
        error = session.errors[i] if i < len(session.errors) else ""
        out[lane.status] = lane_status(lane, i, session)
        out[lane.text] = charts.lane_highlights(trace.steps, None if error else at) if trace else []
    if running:
        return out
    names = [lane_name(i) for i in range(count)]
    out |= {page.inspect.lane: gr.update(choices=names), page.sweep.lane: gr.update(choices=names)}
    done = session.done()
    finished = [t for _, t in done]
    rows = charts.metrics_rows([lane_metrics(t, n) for n, t in done], [t.strategy for t in finished])
    figure = charts.entropy_chart([n for n, _ in done], [t.steps for t in finished], at, raw,
                                  [charts.picks_greedily(t) for t in finished]) if done else None
    names = [n for n, _ in done]
    said = (charts.divergence_markdown(names, finished, at), charts.same_text_note(names, finished),
            charts.served_modes_note(names, finished))
    return out | {page.divergence: "\n\n".join(s for s in said if s),
                  page.metrics: rows, page.entropy: figure}


def render_inspect(page: Page, session: CompareSession | None, lane: str | None, step: Any) -> dict:
    """Lane picker, step slider, explanation and stage chart for one lane's step."""
    panel = page.inspect
    traces = dict(session.done()) if session else {}
    trace = traces.get(lane or "")
    if trace is None:
        message = f"{lane} has no output." if traces else "Run the lanes, then click a token."
        return {panel.explain: message, panel.chart: None}
    last = len(trace.steps) - 1
    index = max(0, min(int(step or 0), last))
    chosen = trace.steps[index]
    if chosen.stages:
        source = step_charts.source_of(trace, index)
        explain, figure = step_charts.explain_step(chosen, source=source), charts.inspect_chart(chosen, source=source)
    else:
        explain, figure = f"{trace.strategy} keeps no per-stage record of its tokens; see its own tab.", None
    records = contrastive.records(trace) if trace.strategy in contrastive.STRATEGIES else []
    if index < len(records):
        explain += "\n\n" + charts.record_markdown(records[index])
    return {panel.lane: gr.update(value=lane), panel.step: gr.update(maximum=max(1, last), value=index),
            panel.explain: explain, panel.chart: figure}


def reshape(page: Page, op: str, i: int, count: int, session: CompareSession | None, kind: str,
            values: Sequence[Any]) -> dict:
    """Add a lane, or duplicate / remove lane ``i``; results and model picks (the lanes' models,
    when ``values`` carries them after the settings) move with their lanes."""
    specs = specs_from(values, count)
    models = list(values[len(LANE_FIELDS) * MAX_LANES:])
    # A copy: a run still under way keeps writing its own session, never this page's reshaped one.
    session = dataclasses.replace(session) if session else CompareSession()
    phases = [session.phase(k) for k in range(count)]
    rows = list(zip(specs, (session.traces + [None] * count)[:count], (session.errors + [""] * count)[:count],
                    (models + [""] * count)[:count], phases, [session.made(k) for k in range(count)],
                    [session.budget(k) for k in range(count)], [session.on(k) for k in range(count)]))
    try:
        if op == "add":
            rows = add_lane(rows, (default_spec(specs), None, "", "", WAITING, 0, 0, ""))
        elif op == "duplicate":
            rows = duplicate_lane(rows, i)
        else:
            rows = remove_lane(rows, i)
    except UserError as exc:
        return {page.status: error_html(str(exc))}
    specs, session.traces, session.errors = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    session.phases, session.progress, session.budgets = [r[4] for r in rows], [r[5] for r in rows], [r[6] for r in rows]
    session.served = [r[7] for r in rows]
    moved = {lane.model: row[3] for lane, row in zip(page.lanes, rows)} if models else {}
    return ({page.count: len(rows), page.status: "", page.session: session} | render_specs(page, specs)
            | render_results(page, session, len(rows), kind == RAW_ENTROPY) | moved)


def wire_lanes(shared: Shared, page: Page) -> None:
    """Preset pickers fill their lane; any edit rewrites the lane's header (and a hand edit marks
    the lane custom); the strategy greys the knobs it ignores; add / duplicate / remove reshape
    the lanes (and their results)."""
    local: dict[str, Any] = {"api_visibility": "private", "queue": False}
    for i, lane in enumerate(page.lanes):
        lane.preset.input(lambda *values, i=i, lane=lane: fill_lane(lane, i, values[:-1], values[-1]),
                          [*lane.controls, shared.user_presets], lane.controls + [lane.header], **local)
        # A hand edit of a knob: the lane no longer is the preset (a preset keeps the seed and budget).
        edits = [c.input for name, c in zip(LANE_FIELDS[1:], lane.controls[1:]) if name not in RUN_KNOBS]
        gr.on(edits, lambda: CUSTOM, None, [lane.preset], **local)
        gr.on([c.change for c in lane.controls[1:]],
              lambda *values, i=i: charts.lane_header(lane_name(i), *summary_of(LaneSpec.from_values(values))),
              lane.controls, [lane.header], **local)
        lane.strategy.change(lambda strategy, lane=lane: {c: gr.update(**compact_knob_state(n, strategy))
                                                          for n, c in lane.knobs.items()},
                             [lane.strategy], list(lane.knobs.values()), **local)
        # the lane's model box and mode radio make its pick; a pick set otherwise (a link, a lesson, a moved
        # lane) is shown in them
        gr.on([lane.source.input, lane.mode.input], on_lane_pick, [lane.source, lane.mode], [lane.model], **local)
        lane.model.change(shown_pick, [lane.model], [lane.source, lane.mode], **local)
    inputs = [page.count, page.session, page.entropy_kind, *page.lane_values, *page.lane_models]
    outputs = [page.count, page.status, *page.spec_outputs, *page.result_outputs, page.session, *page.lane_models]
    ops = [(page.add, "add", 0)] + [(b, op, i) for i, lane in enumerate(page.lanes)
                                    for b, op in ((lane.duplicate, "duplicate"), (lane.remove, "remove"))]
    for button, op, i in ops:
        button.click(lambda count, session, kind, *values, op=op, i=i: reshape(page, op, i, count, session, kind, values),
                     inputs, outputs, **local)
    shared.user_presets.change(
        lambda stored, *current: {lane.preset: gr.update(choices=preset_choices(stored), value=c)
                                  for lane, c in zip(page.lanes, current)},
        [shared.user_presets, *[lane.preset for lane in page.lanes]], [lane.preset for lane in page.lanes], **local)


def on_lane_pick(source: Any, mode: Any) -> str:
    """A lane's pick (engine.backends.served.ModelPick's value) of its model box and its mode radio,
    as Step through makes its own (``shared.with_mode``); "" is the header's model."""
    return with_mode(source, mode) if source else ""


def fill_lane(lane: LaneWidgets, i: int, values: Sequence[Any], stored: list | None) -> dict:
    """The picked preset (``values[0]``) shown in lane ``i``, keeping its seed and max_new_tokens."""
    current = LaneSpec.from_values(values)
    spec = spec_from_preset(current.preset, stored, keep=current)
    return {} if spec is None else lane_updates(lane, i, spec)


def open_lesson(page: Page, prompt: str, chat: bool, configs: Sequence[tuple[DecodingConfig, str]],
                models: Sequence[str] = ()) -> dict:
    """Updates filling the page with a lesson's prompt and lanes (config, preset label each) and each
    lane's model pick (``models``: "" the header's model, a listed server, ``fast:<server>``; none:
    every lane on the header's); the previous run's results are cleared."""
    specs = [spec_from_config(cfg, label) for cfg, label in configs[:MAX_LANES]]
    session = CompareSession([None] * len(specs), [""] * len(specs), budgets=[c.max_new_tokens for c, _ in configs])
    picks = list(models[:MAX_LANES]) + [""] * (MAX_LANES - len(models[:MAX_LANES]))
    return ({page.prompt: prompt, page.chat: chat, page.count: len(specs), page.session: session, page.status: ""}
            | render_specs(page, specs) | render_results(page, session, len(specs), False)
            | dict(zip(page.lane_models, picks)))


def lesson_outputs(page: Page) -> list:
    """The components ``open_lesson`` updates."""
    return [page.prompt, page.chat, page.count, page.session, page.status, *page.spec_outputs, *page.result_outputs,
            *page.lane_models]


@dataclass(frozen=True)
class CompareLessons:
    """The Compare page as a LessonTarget (shared.LessonTarget): a lesson's prompt, chat and every
    run as a lane, each lane's model pick the server its ``models`` names (through the operator's list)."""

    page: Page
    name: ClassVar[str] = "compare"

    def lesson_outputs(self) -> list:
        return lesson_outputs(self.page)

    def lesson_updates(self, lesson: Lesson, stored: Any, allowed: Sequence[str] | None) -> tuple[dict, str]:
        sources = engine_lessons.run_sources(lesson, "", offered=allowed) if lesson.models else ()
        return (open_lesson(self.page, lesson.prompt, lesson.chat, lane_configs(lesson, stored), sources),
                RUN_BUTTONS[self.name])


def run_all(shared: Shared, page: Page, prompt: str, chat: bool, model: str, quant: str, count: int, kind: str,
            values: Sequence[Any], control: RunControl) -> Iterator[dict]:
    """Run the first ``count`` lanes (their settings: the flat ``values``, then every lane's model
    pick) at once, streaming every lane's status and text, then the divergence, metrics and
    entropy chart. A Stop or the time limit ends the run at once: every unfinished lane says
    stopped with its tokens so far, and the results of the tokens made are drawn."""
    names = [lane_name(i) for i in range(count)]
    configs = [lane_config(spec, names[i]) for i, spec in enumerate(specs_from(values, count))]
    picks = list(values[len(LANE_FIELDS) * MAX_LANES:]) + [""] * count
    models = lane_models(shared, list(zip(names, picks)), model, quant, prompt, chat)
    session = CompareSession([None] * count, [""] * count, configs[0].max_new_tokens,
                             [c.max_new_tokens for c in configs], [RUNNING] * count,
                             served=[lane_served_words(m.lm) for m in models])
    raw = kind == RAW_ENTROPY
    note = status_html(f"running {count} lanes at once…")
    # The previous run's divergence, table, chart and inspected step go at once (a Stop keeps only this run's).
    yield ({page.status: note, page.session: session} | render_results(page, session, count, raw)
           | previous_run_cleared(page))
    fresh = changed_only()
    try:
        for _ in run_lanes(shared, models, prompt, configs, chat, session, control):
            if update := fresh({page.status: status_html(run_note(session, count))}
                               | render_results(page, session, count, raw)):
                yield update
    except RunStopped as stopped:
        early = sum(1 for i in range(count) if session.phase(i) == STOPPED)
        said = f"{stopped} ({early} of {count} lanes stopped early; each keeps the tokens it had made)."
        yield {page.status: status_html(said + " Click any token to open its step.")} | render_results(
            page, session, count, raw)
        return
    failed = sum(1 for e in session.errors if e)
    done = f"done: {count - failed} of {count} lanes ran" + (f"; {failed} failed (see the lane)" if failed else "")
    yield {page.status: status_html(done + ". Click any token to open its step.")} | render_results(
        page, session, count, raw)


def changed_only() -> Callable[[dict], dict]:
    """A filter for a run's updates: each keeps only the components whose value differs from what
    the filter passed last (a finished lane's text is not sent again at every redraw)."""
    sent: dict = {}

    def fresh(update: dict) -> dict:
        out = {c: v for c, v in update.items() if not (c in sent and type(v) in (str, list) and sent[c] == v)}
        sent.update(out)
        return out

    return fresh


def run_note(session: CompareSession, count: int) -> str:
    """The page's line while lanes run: how many are done, running and failed, from their phases."""
    phases = [session.phase(i) for i in range(count)]
    parts = [f"{phases.count(p)} {word}" for p, word in ((DONE, "done"), (RUNNING, "running"), (FAILED, "failed"))
             if phases.count(p)]
    return f"running {count} lanes at once: " + ", ".join(parts) + "…"


def previous_run_cleared(page: Page) -> dict:
    """The results only a finished run draws, and the inspected step, emptied."""
    inspect = page.inspect
    return {page.divergence: "", page.metrics: None, page.entropy: None, inspect.explain: "", inspect.chart: None}


def wire_run(shared: Shared, page: Page) -> Any:
    """Run every lane (one model event); returns the event for the Stop button."""
    def on_run(prompt: str, chat: bool, model: str, quant: str, count: int, kind: str, *values: Any,
               control: RunControl) -> Iterator[dict]:
        return run_all(shared, page, prompt, chat, model, quant, count, kind, values, control)

    inputs = [page.prompt, page.chat, shared.model, shared.quantization, page.count, page.entropy_kind,
              *page.lane_values, *page.lane_models]
    event = shared.events.on([page.run.click, page.prompt.submit], on_run, inputs,
                             [page.status, *page.run_outputs, page.session],
                             on_error=cleared(page.status, page.run_outputs))
    page.entropy_kind.change(
        lambda session, count, kind: render_results(page, session or CompareSession(), count, kind == RAW_ENTROPY),
        [page.session, page.count, page.entropy_kind], page.result_outputs, api_visibility="private", queue=False)
    return event


def wire_inspect(page: Page) -> None:
    panel = page.inspect
    outputs = [panel.lane, panel.step, panel.explain, panel.chart]
    local: dict[str, Any] = {"api_visibility": "private", "queue": False}
    for i, lane in enumerate(page.lanes):
        def on_select(session: CompareSession | None, evt: gr.SelectData, i: int = i) -> dict:
            index = evt.index if isinstance(evt.index, int) else evt.index[0]
            at = session.divergence() if session else None
            return render_inspect(page, session, lane_name(i), charts.clicked_step(int(index), at))

        lane.text.select(on_select, [page.session], outputs, **local)
    for trigger in (panel.lane.input, panel.step.release):
        trigger(lambda session, lane, step: render_inspect(page, session, lane, step),
                [page.session, panel.lane, panel.step], outputs, **local)


def wire_sweep(shared: Shared, page: Page) -> Any:
    """The seed sweep (one model event); returns the event for the Stop button."""
    panel = page.sweep

    def on_sweep(prompt: str, chat: bool, model: str, quant: str, count: int, lane: str, seeds: Any, *values: Any,
                 control: RunControl) -> Iterator[dict]:
        names = [lane_name(i) for i in range(count)]
        if lane not in names:
            raise UserError(f"seed sweep: pick one of {', '.join(names)}")
        index = names.index(lane)
        config = lane_config(specs_from(values, count)[index], lane)
        seed_list = sweep_seeds(config.seed, seeds)
        pick = (list(values[len(LANE_FIELDS) * MAX_LANES:]) + [""] * MAX_LANES)[index]
        on = lane_models(shared, [(lane, pick)], model, quant, prompt, chat)[0]  # the lane's own model
        for traces in run_sweep(shared, on.lm, prompt, on.prompt_ids, config, seed_list, chat, control):
            yield {panel.status: status_html(f"{lane}: seed {len(traces)} of {len(seed_list)} finished…")}
        spread = sweep_spread([t.generated_token_ids for t in traces])
        rows = charts.sweep_rows(seed_list, traces, [mean_logprob([s.raw_prob for s in t.steps]) for t in traces])
        yield {panel.status: status_html("done"), panel.summary: charts.sweep_markdown(lane, seed_list, spread),
               panel.table: rows}

    inputs = [page.prompt, page.chat, shared.model, shared.quantization, page.count, panel.lane, panel.seeds,
              *page.lane_values, *page.lane_models]
    return shared.events.on([panel.run.click], on_sweep, inputs, [panel.status, panel.summary, panel.table],
                            on_error=cleared(panel.status, [panel.summary, panel.table]))


def wire(shared: Shared, page: Page) -> None:
    wire_lanes(shared, page)
    wire_inspect(page)
    stop_button(page.stop, page.status, [wire_run(shared, page), wire_sweep(shared, page)], status_html("stopped"),
                run_says=True)  # the run's own last word says stopped, with each lane's tokens
