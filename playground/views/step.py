"""Step through: type a prompt, generate token by token, click any token to see why it was chosen,
branch from any step with another token.

Per-user state is one ``StepSession`` in gr.State: the runs (original and branches) and the KV
cache of the last run, so a branch rewinds the cache instead of rebuilding it.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import gradio as gr

from engine import decode
from engine.cache import KVCache
from engine.config import ConfigError, DecodingConfig
from engine.presets import PresetError, load_preset
from engine.trace import Trace
from playground.charts import step as charts

from ..knobs import STAGE_KNOBS, KnobPanel
from ..shared import OutputSet, Shared, UserError, error_html, gpu_task, guarded, status_html

STREAM_EVERY_S = 0.25  # throttle UI updates while streaming
RUN_KNOBS = ("seed", "max_new_tokens", "top_n", "stop")
DEFAULT_PROMPT = "Write a haiku about the sea."


@dataclass
class StepSession:
    runs: list[Trace] = field(default_factory=list)
    current: int = 0
    cache: KVCache | None = None
    model_key: tuple[str, str] = ("", "")

    def trace(self) -> Trace | None:
        return self.runs[self.current] if self.runs else None


def _run_label(i: int, trace: Trace) -> str:
    if trace.branch_of is None:
        return f"#{i} original"
    return f"#{i} branch at step {trace.branch_of}: {charts.readable(trace.steps[trace.branch_of].chosen_token)!s}"


@dataclass
class Outputs(OutputSet):
    """Component handles the handlers update, in one fixed order."""

    text: Any
    step: Any
    explain: Any
    chart: Any
    alternatives: Any
    runs: Any
    compare: Any
    over_run: Any
    summary: Any
    status: Any
    download: Any


def render(session: StepSession, selected: int | None, colour_by: str, status: str = "", full: bool = True) -> list:
    """All outputs for the session's current run with step ``selected`` in view."""
    trace = session.trace()
    if trace is None or not trace.steps:
        return [[], gr.update(), "", None, gr.update(choices=[]), gr.update(), "", None, "", status, gr.update()]
    last = len(trace.steps) - 1
    sel = last if selected is None else max(0, min(int(selected), last))
    step = trace.steps[sel]
    highlights = charts.token_highlights(trace.steps, colour_by)
    runs = gr.update(choices=[(_run_label(i, t), i) for i, t in enumerate(session.runs)], value=session.current)
    if not full:
        return [highlights, gr.update(maximum=max(1, last), value=sel), gr.update(), gr.update(), gr.update(), runs,
                gr.update(), gr.update(), charts.summary_markdown(trace), status, gr.update()]
    return [
        highlights,
        gr.update(maximum=max(1, last), value=sel),
        charts.explain_step(step),
        charts.stage_chart(step),
        gr.update(choices=charts.alternatives(step), value=None),
        runs,
        compare_markdown(session),
        charts.run_chart(trace.steps, sel),
        charts.summary_markdown(trace),
        status,
        gr.update(value=_trace_file(trace)),
    ]


def compare_markdown(session: StepSession) -> str:
    trace = session.trace()
    if trace is None or trace.branch_of is None:
        return ""
    parent = session.runs[0]
    k = trace.branch_of
    shared = "".join(s.chosen_token for s in trace.steps[:k])
    return (f"**Shared prefix** ({k} tokens): {shared!s}\n\n"
            f"**Original** continued with {charts.readable(parent.steps[k].chosen_token)!r}: "
            f"{''.join(s.chosen_token for s in parent.steps[k:])}\n\n"
            f"**This branch** took {charts.readable(trace.steps[k].chosen_token)!r}: "
            f"{''.join(s.chosen_token for s in trace.steps[k:])}")


def _trace_file(trace: Trace) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="trace-", delete=False, encoding="utf-8") as fh:
        fh.write(trace.to_json(indent=1))
        return fh.name


def stream_run(shared: Shared, session: StepSession, lm, prompt: str, prompt_ids: list[int], config: DecodingConfig,
               chat: bool, colour_by: str, parent: Trace | None = None, at: int | None = None,
               token: int | None = None) -> Iterator[list]:
    """Run (or branch) and yield throttled UI updates; the final yield has every chart."""
    cache = session.cache or KVCache(lm.model)
    session.cache = cache
    steps = []
    source = (decode.branch(lm, parent, at, token, cache=cache) if parent is not None
              else decode.stream(lm, prompt_ids, config, cache=cache))
    session.runs.append(decode.assemble(lm, prompt, prompt_ids, config, [], chat, branch_of=at))
    session.current = len(session.runs) - 1
    last_yield = 0.0
    for step in source:
        steps.append(step)
        if time.perf_counter() - last_yield >= STREAM_EVERY_S:
            session.runs[-1] = decode.assemble(lm, prompt, prompt_ids, config, steps, chat, branch_of=at)
            last_yield = time.perf_counter()
            yield render(session, None, colour_by, status_html(f"generating… {len(steps)} / {config.max_new_tokens} tokens"), full=False) + [session]
    session.runs[-1] = decode.assemble(lm, prompt, prompt_ids, config, steps, chat, branch_of=at)
    done = f"done: {len(steps)} tokens, stopped by {session.runs[-1].stop_reason}. Click any token to inspect it."
    yield render(session, at if at is not None else 0, colour_by, status_html(done)) + [session]


def _error_outputs(message: str, session: StepSession | None) -> list:
    return [gr.update()] * 9 + [error_html(message), gr.update(), session]


def build_tab(shared: Shared) -> None:
    session = gr.State(None, time_to_live=3600)
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            prompt = gr.Textbox(DEFAULT_PROMPT, lines=4, label="Prompt", elem_id="step-prompt")
            chat = gr.Checkbox(True, label="Chat template", info="Wrap the prompt in the model's chat template (instruct models).",
                               elem_id="step-chat")
            panel = KnobPanel(shared, RUN_KNOBS + STAGE_KNOBS, ["sample", "greedy"], preset="balanced", prefix="step-")
            with gr.Row():
                generate = gr.Button("Generate", variant="primary", elem_id="step-generate")
                stop = gr.Button("Stop", variant="stop", elem_id="step-stop")
            status = gr.HTML("", elem_id="step-status")
        with gr.Column(scale=2, min_width=480):
            colour_by = gr.Radio(["probability", "surprisal"], value="probability", label="Colour tokens by", elem_id="step-colour")
            text = gr.HighlightedText(label="Generated text: click a token to inspect its step", combine_adjacent=False,
                                      show_legend=False, show_inline_category=False, interactive=False, elem_id="step-text")
            step_slider = gr.Slider(0, 1, value=0, step=1, label="Step", elem_id="step-index")
            explain = gr.Markdown(elem_id="step-explain")
            chart = gr.Plot(label="Distribution after each stage", elem_id="step-chart")
            with gr.Row():
                alternatives = gr.Dropdown([], label="Branch: pick another token at this step", scale=3, elem_id="step-alt")
                branch_btn = gr.Button("Branch from here", scale=1, elem_id="step-branch")
            runs = gr.Radio([], label="Runs", elem_id="step-runs")
            compare = gr.Markdown(elem_id="step-compare")
            over_run = gr.Plot(label="Entropy and surprisal over the run", elem_id="step-over-run")
            summary = gr.Markdown(elem_id="step-summary")
            download = gr.DownloadButton("Download trace JSON", elem_id="step-download")
    out = Outputs(text, step_slider, explain, chart, alternatives, runs, compare, over_run, summary, status, download)
    panel.wire()
    shared.extra["step"] = {"panel": panel, "prompt": prompt, "chat": chat}
    _wire(shared, panel, session, prompt, chat, colour_by, generate, stop, branch_btn, out)


def _wire(shared: Shared, panel: KnobPanel, session, prompt, chat, colour_by, generate, stop, branch_btn, out: Outputs) -> None:
    outputs = out.all() + [session]

    @gpu_task
    def on_generate(prompt_text, chat_on, model, quant, colour, state, *values):
        state = state or StepSession()
        try:
            config, lm, prompt_ids = shared.prepare(panel, values, model, quant, prompt_text, chat_on)
        except UserError as exc:
            yield _error_outputs(str(exc), state)
            return
        if state.model_key != (model, quant):
            state = StepSession(model_key=(model, quant))
        state.runs, state.current = [], 0
        yield from _guarded(stream_run(shared, state, lm, prompt_text, prompt_ids, config, chat_on, colour), state)

    @gpu_task
    def on_branch(model, quant, colour, state, at, token):
        if state is None or state.trace() is None:
            yield _error_outputs("branch: generate a run first", state)
            return
        if token is None:
            yield _error_outputs("branch: pick a token from the list first", state)
            return
        parent = state.trace()
        lm = shared.lm(model, quant)
        config = DecodingConfig.from_dict(parent.config)
        yield from _guarded(stream_run(shared, state, lm, parent.prompt, parent.prompt_token_ids, config, parent.chat,
                                       colour, parent=parent, at=int(at), token=int(token)), state)

    gen_inputs = [prompt, chat, shared.model, shared.quantization, colour_by, session, *panel.inputs]
    gen_event = generate.click(on_generate, gen_inputs, outputs, api_visibility="private", **shared.model_event)
    submit_event = prompt.submit(on_generate, gen_inputs, outputs, api_visibility="private", **shared.model_event)
    branch_event = branch_btn.click(on_branch, [shared.model, shared.quantization, colour_by, session, out.step, out.alternatives],
                                    outputs, api_visibility="private", **shared.model_event)
    stop.click(lambda: status_html("stopped"), None, [out.status], cancels=[gen_event, submit_event, branch_event], queue=False)

    def on_select(state, colour, evt: gr.SelectData):
        return render(state or StepSession(), evt.index if isinstance(evt.index, int) else evt.index[0], colour) + [state]

    out.text.select(on_select, [session, colour_by], outputs, api_visibility="private", queue=False)
    out.step.release(lambda s, i, c: render(s or StepSession(), i, c) + [s], [session, out.step, colour_by], outputs,
                     api_visibility="private", queue=False)
    colour_by.change(lambda s, i, c: render(s or StepSession(), i, c) + [s], [session, out.step, colour_by], outputs,
                     api_visibility="private", queue=False)

    def on_pick_run(state, index, colour):
        if state is None or index is None or not 0 <= int(index) < len(state.runs):
            return [gr.update()] * len(outputs)
        state.current = int(index)
        return render(state, state.trace().branch_of or 0, colour) + [state]

    out.runs.input(on_pick_run, [session, out.runs, colour_by], outputs, api_visibility="private", queue=False)

    def step_trace_api(prompt: str, config: dict | None = None, preset: str = "", chat: bool = False,
                       model: str = "embedded", quantization: str = "none") -> dict:
        """Run greedy or sampling on the prompt and return the trace JSON (same as the CLI's --json).
        ``preset``: a built-in preset name; ``config``: knobs overriding it."""
        return step_trace(shared, prompt, config, preset, chat, model, quantization)

    gr.api(step_trace_api, api_name="step_trace", **shared.model_event)


def _guarded(updates: Iterator[list], state: StepSession) -> Iterator[list]:
    return guarded(updates, lambda message: _error_outputs(message, state), "generation")


def step_trace(shared: Shared, prompt: str, config: dict | None = None, preset: str = "", chat: bool = False,
               model: str = "embedded", quantization: str = "none") -> dict:
    """API: run greedy/sampling and return the trace JSON (the CLI's ``--json`` object).
    ``preset`` names a built-in preset; ``config`` holds knobs that override it."""
    try:
        base = load_preset(preset).config.to_dict(sparse=True) if preset else {"strategy": "sample"}
        cfg = DecodingConfig.from_dict(base | dict(config or {}))
        if cfg.strategy not in ("greedy", "sample"):
            raise ConfigError("strategy", f"the step_trace endpoint runs greedy | sample, got {cfg.strategy!r}")
        lm = shared.lm(model, quantization)
        prompt_ids = shared.encode_prompt(lm, prompt, chat)
    except (ConfigError, PresetError, UserError) as exc:
        raise gr.Error(str(exc)) from None
    steps = list(decode.stream(lm, prompt_ids, cfg))
    return json.loads(decode.assemble(lm, prompt, prompt_ids, cfg, steps, chat).to_json())
