"""Compare: 2–6 lanes side by side, each a strategy and its knobs, on one prompt and one seed.

Lanes are a fixed pool of ``MAX_LANES`` columns, shown or hidden (robust in Gradio 6: every event
is wired once). A lane's settings are its strategy and ``key = value`` lines (the CLI's ``--set``
syntax); picking a preset fills both. Seed and max_new_tokens are shared by all lanes.

"Run all" runs the lanes one after another on the model, streaming each lane's text; then the
metrics table (engine.metrics), the per-step entropy chart and the first divergent step appear.
Clicking a token opens its step chart (the step-through view's chart). "Seed sweep" runs one lane
over several seeds and shows how different the outputs are.

Per-user state: ``CompareSession`` (the lanes' traces) in gr.State. API: ``/compare`` and
``/compare_sweep`` return trace JSON.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import gradio as gr

from engine import contrastive, decode, runner
from engine.config import KNOBS, ConfigError, DecodingConfig, parse_set_value
from engine.metrics import first_divergence, lane_metrics, mean_logprob, sweep_spread
from engine.models import LoadedModel, ModelLoadError, ModelRegistry
from engine.presets import PresetError, load_preset
from engine.trace import StepTrace, Trace, to_dict
from playground.charts import compare as charts
from playground.charts import step as step_charts

from ..knobs import CUSTOM, find_preset, preset_choices
from ..shared import Shared, UserError, config_or_error, error_html, status_html

MIN_LANES, MAX_LANES = 2, 6
MAX_SWEEP_SEEDS = 16
SHARED_KEYS = ("seed", "max_new_tokens")  # set once for all lanes, not per lane
STREAM_EVERY_S = 0.25
DEFAULT_PROMPT = "Once upon a time, in a small village by the sea,"
# Presets offered, in order, to each new lane (the first one not already in use).
LANE_PRESETS = ("greedy", "balanced", "contrastive-search", "min-p", "creative", "anti-repetition")
STEP_STRATEGIES = ("greedy", "sample")


# --- lane settings: pure functions -----------------------------------------------------------------


@dataclass(frozen=True)
class LaneSpec:
    """A lane's settings as the page holds them: preset label, strategy, ``key = value`` lines."""

    preset: str
    strategy: str
    knobs: str


def lane_name(i: int) -> str:
    return f"Lane {i + 1}"


def format_knobs(cfg: DecodingConfig) -> str:
    """The config's non-neutral knobs (strategy and shared keys left out) as ``key = value`` lines."""
    lines = []
    for key, value in cfg.to_dict(sparse=True).items():
        if key == "strategy" or key in SHARED_KEYS:
            continue
        if key == "stage_order":
            text = ", ".join(value)
        elif isinstance(value, bool):
            text = str(value).lower()
        elif isinstance(value, list):
            text = json.dumps(value, ensure_ascii=False)
        else:
            text = str(value)
        lines.append(f"{key} = {text}")
    return "\n".join(lines)


def parse_knobs(text: str, name: str) -> dict[str, Any]:
    """``key = value`` lines -> a config dict (types as the CLI's --set; the config validates)."""
    out: dict[str, Any] = {}
    for number, line in enumerate((text or "").splitlines(), start=1):
        if not line.strip() or line.strip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise UserError(f"{name}, line {number}: expected key = value, got {line.strip()[:60]!r}")
        if key in SHARED_KEYS:
            raise UserError(f"{name}: {key} is shared by all lanes; set it above the lanes")
        if key == "strategy":
            raise UserError(f"{name}: pick the strategy in the lane's strategy menu, not in its knobs")
        try:
            out[key] = parse_set_value(key, value)
        except ConfigError as exc:
            raise UserError(f"{name}: {exc}") from None
    return out


def lane_config(spec: LaneSpec, name: str, seed: Any, max_new_tokens: Any) -> DecodingConfig:
    """A lane's validated config; errors name the lane and the key."""
    values = {"strategy": spec.strategy, **parse_knobs(spec.knobs, name), "seed": _int(seed),
              "max_new_tokens": _int(max_new_tokens)}
    try:
        return config_or_error(values)
    except UserError as exc:
        raise UserError(f"{name}: {exc}") from None


def _int(value: Any) -> Any:
    """Number inputs send floats; a whole float becomes an int (anything else is left to validation)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def spec_from_preset(choice: str, user_presets: Sequence[dict] | None = None) -> LaneSpec | None:
    preset = find_preset(choice, user_presets)
    if preset is None:
        return None
    return LaneSpec(choice, preset.config.strategy, format_knobs(preset.config))


def default_spec(used: Sequence[LaneSpec]) -> LaneSpec:
    """The first of LANE_PRESETS no lane uses yet (the first one if all are used)."""
    taken = {s.preset for s in used}
    choice = next((p for p in LANE_PRESETS if p not in taken), LANE_PRESETS[0])
    return spec_from_preset(choice)


def add_lane(specs: Sequence[Any], new: Any) -> list:
    if len(specs) >= MAX_LANES:
        raise UserError(f"lanes: at most {MAX_LANES}; remove one first")
    return [*specs, new]


def duplicate_lane(specs: Sequence[Any], i: int, copy: Any = None) -> list:
    """Insert a copy of lane i right after it (``copy`` replaces the copied value, e.g. None for results)."""
    if len(specs) >= MAX_LANES:
        raise UserError(f"lanes: at most {MAX_LANES}; remove one first")
    return [*specs[:i + 1], specs[i] if copy is None else copy, *specs[i + 1:]]


def remove_lane(specs: Sequence[Any], i: int) -> list:
    if len(specs) <= MIN_LANES:
        raise UserError(f"lanes: at least {MIN_LANES} to compare")
    return [*specs[:i], *specs[i + 1:]]


# --- running lanes -----------------------------------------------------------------------------------


def step_source(lm: LoadedModel, prompt_ids: list[int], config: DecodingConfig,
                registry: ModelRegistry) -> Iterator[tuple[StepTrace, Any]] | None:
    """(StepTrace, record or None) as each token is produced; None for beam search (it only knows
    its winner at the end)."""
    if config.strategy in STEP_STRATEGIES:
        return ((step, None) for step in decode.stream(lm, prompt_ids, config))
    if config.strategy in contrastive.STRATEGIES:
        return contrastive.stream(lm, prompt_ids, config, registry=registry)
    if config.strategy == "speculative":
        speculative = runner.strategy_module("speculative")
        drafter = speculative.make_drafter(lm, config, registry)
        return ((step, None) for r in speculative.stream(lm, prompt_ids, config, drafter) for step in r.steps)
    return None


def stream_lane(lm: LoadedModel, prompt: str, prompt_ids: list[int], config: DecodingConfig, chat: bool,
                registry: ModelRegistry) -> Iterator[Trace]:
    """Partial traces while the lane runs (throttled), then the whole trace."""
    source = step_source(lm, prompt_ids, config, registry)
    if source is None:
        yield runner.run(lm, prompt, config, chat=chat, registry=registry)
        return
    steps, records, last = [], [], time.perf_counter()
    for step, record in source:
        steps.append(step)
        records.append(record)
        if time.perf_counter() - last >= STREAM_EVERY_S:
            last = time.perf_counter()
            yield decode.assemble(lm, prompt, prompt_ids, config, steps, chat)
    trace = decode.assemble(lm, prompt, prompt_ids, config, steps, chat)
    if config.strategy in contrastive.STRATEGIES:
        trace.extra[config.strategy] = records
    yield trace


@dataclass
class CompareSession:
    """The last run: lane names, their traces (None: not run or failed) and errors."""

    traces: list[Trace | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    max_new_tokens: int = 0

    def done(self) -> list[tuple[str, Trace]]:
        return [(lane_name(i), t) for i, t in enumerate(self.traces) if t is not None and t.steps]

    def divergence(self) -> int | None:
        finished = [t for _, t in self.done()]
        return first_divergence([t.generated_token_ids for t in finished]) if len(finished) >= 2 else None


def run_lanes(shared: Shared, lm: LoadedModel, prompt: str, prompt_ids: list[int], configs: list[DecodingConfig],
              chat: bool, session: CompareSession) -> Iterator[int]:
    """Run every lane in turn, updating ``session``; yields the running lane's index on each update.
    A failing lane records its error and the others still run."""
    for i, config in enumerate(configs):
        try:
            for trace in stream_lane(lm, prompt, prompt_ids, config, chat, shared.registry):
                session.traces[i] = trace
                yield i
        except (UserError, ValueError, ModelLoadError, runner.StrategyUnavailable) as exc:
            session.errors[i] = str(exc)
        except Exception as exc:  # one lane's model failure must not stop the others
            session.errors[i] = f"{type(exc).__name__}: {exc}"
        yield i


def compare_payload(prompt: str, configs: Sequence[DecodingConfig], session: CompareSession) -> dict:
    """The API answer: every lane's trace JSON, the metrics rows and the divergence step."""
    lanes = []
    for i, (config, trace) in enumerate(zip(configs, session.traces)):
        lanes.append({"name": lane_name(i), "config": config.to_dict(sparse=True), "error": session.errors[i] or None,
                      "trace": json.loads(trace.to_json()) if trace else None})
    metrics = [lane_metrics(t, name) for name, t in session.done()]
    return {"prompt": prompt, "seed": configs[0].seed if configs else 0, "lanes": lanes,
            "metrics": [to_dict(m) for m in metrics], "divergence": session.divergence()}


def api_lane_config(lane: Any, seed: int, max_new_tokens: int, name: str) -> DecodingConfig:
    """An API lane ``{"preset": name?, "config": {...}?}`` -> its config with the shared seed and budget."""
    if not isinstance(lane, dict) or set(lane) - {"preset", "config"}:
        raise UserError(f"{name}: expected an object with 'preset' and/or 'config', got {str(lane)[:80]!r}")
    try:
        base = load_preset(lane["preset"]).config.to_dict(sparse=True) if lane.get("preset") else {}
    except PresetError as exc:
        raise UserError(f"{name}: {exc}") from None
    extra = lane.get("config") or {}
    if not isinstance(extra, dict):
        raise UserError(f"{name}: config must be an object of knobs")
    try:
        return config_or_error(base | extra | {"seed": seed, "max_new_tokens": max_new_tokens})
    except UserError as exc:
        raise UserError(f"{name}: {exc}") from None


def compare(shared: Shared, prompt: str, lanes: list, seed: int = 0, max_new_tokens: int = 32, chat: bool = False,
            model: str = "embedded", quantization: str = "none") -> dict:
    """API: run 2–6 lanes on one prompt with one seed; every lane's trace JSON, metrics, divergence."""
    try:
        if not isinstance(lanes, list) or not MIN_LANES <= len(lanes) <= MAX_LANES:
            raise UserError(f"lanes: expected a list of {MIN_LANES} to {MAX_LANES} lanes, got {str(lanes)[:80]!r}")
        configs = [api_lane_config(lane, seed, max_new_tokens, lane_name(i)) for i, lane in enumerate(lanes)]
        lm = shared.lm(model, quantization)
        prompt_ids = shared.encode_prompt(lm, prompt, chat)
    except UserError as exc:
        raise gr.Error(str(exc)) from None
    session = CompareSession([None] * len(configs), [""] * len(configs), max_new_tokens)
    for _ in run_lanes(shared, lm, prompt, prompt_ids, configs, chat, session):
        pass
    return compare_payload(prompt, configs, session)


def sweep_seeds(seed: int, count: Any) -> list[int]:
    count = _int(count)
    if not isinstance(count, int) or not 2 <= count <= MAX_SWEEP_SEEDS:
        raise UserError(f"seeds: expected an integer in [2, {MAX_SWEEP_SEEDS}], got {count!r}")
    top = int(KNOBS["seed"].high)
    return [(seed + k) % (top + 1) for k in range(count)]


def run_sweep(shared: Shared, lm: LoadedModel, prompt: str, prompt_ids: list[int], config: DecodingConfig,
              seeds: Sequence[int], chat: bool) -> Iterator[list[Trace]]:
    """One lane over several seeds; yields the finished traces after each seed."""
    traces: list[Trace] = []
    for seed in seeds:
        cfg = config.replace(seed=seed)
        *_, trace = stream_lane(lm, prompt, prompt_ids, cfg, chat, shared.registry)
        traces.append(trace)
        yield traces


def sweep_payload(seeds: Sequence[int], traces: Sequence[Trace]) -> dict:
    spread = sweep_spread([t.generated_token_ids for t in traces])
    return {"seeds": list(seeds), "spread": to_dict(spread), "texts": [t.text for t in traces],
            "traces": [json.loads(t.to_json()) for t in traces]}


def compare_sweep(shared: Shared, prompt: str, lane: dict, seeds: int = 5, seed: int = 0, max_new_tokens: int = 32,
                  chat: bool = False, model: str = "embedded", quantization: str = "none") -> dict:
    """API: one lane over ``seeds`` consecutive seeds from ``seed``; the spread and every trace."""
    try:
        config = api_lane_config(lane, seed, max_new_tokens, "lane")
        seed_list = sweep_seeds(seed, seeds)
        lm = shared.lm(model, quantization)
        prompt_ids = shared.encode_prompt(lm, prompt, chat)
        *_, traces = run_sweep(shared, lm, prompt, prompt_ids, config, seed_list, chat)
    except (UserError, ValueError, ModelLoadError) as exc:
        raise gr.Error(str(exc)) from None
    return sweep_payload(seed_list, traces)


# --- the page ----------------------------------------------------------------------------------------


@dataclass
class LaneWidgets:
    column: Any
    preset: Any
    strategy: Any
    knobs: Any
    duplicate: Any
    remove: Any
    status: Any
    text: Any


@dataclass
class Page:
    """Component handles, grouped as the handlers read and update them."""

    prompt: Any
    seed: Any
    max_new_tokens: Any
    chat: Any
    run: Any
    add: Any
    stop: Any
    status: Any
    lanes: list[LaneWidgets]
    divergence: Any
    metrics: Any
    entropy_kind: Any
    entropy: Any
    inspect: dict[str, Any]
    sweep: dict[str, Any]
    count: Any
    session: Any

    @property
    def lane_values(self) -> list:
        return [c for lane in self.lanes for c in (lane.preset, lane.strategy, lane.knobs)]

    @property
    def spec_outputs(self) -> list:
        return [c for lane in self.lanes for c in (lane.column, lane.preset, lane.strategy, lane.knobs)]

    @property
    def result_outputs(self) -> list:
        lanes = [c for lane in self.lanes for c in (lane.status, lane.text)]
        return lanes + [self.divergence, self.metrics, self.entropy, self.inspect["lane"], self.sweep["lane"]]


def specs_from(values: Sequence[Any], count: int) -> list[LaneSpec]:
    """The first ``count`` lanes' settings from the flat (preset, strategy, knobs) x MAX_LANES values."""
    return [LaneSpec(*values[3 * i:3 * i + 3]) for i in range(count)]


def render_specs(specs: Sequence[LaneSpec]) -> list:
    out: list = []
    for i in range(MAX_LANES):
        if i < len(specs):
            out += [gr.update(visible=True), specs[i].preset, specs[i].strategy, specs[i].knobs]
        else:
            out += [gr.update(visible=False), gr.update(), gr.update(), gr.update()]
    return out


def render_results(session: CompareSession, count: int, raw: bool, running: int | None = None) -> list:
    """Every lane's status and text, then divergence, metrics, entropy chart and the lane pickers.
    While a lane is running the charts are left as they are."""
    at = session.divergence() if running is None else None
    out: list = []
    for i in range(MAX_LANES):
        trace = session.traces[i] if i < len(session.traces) else None
        error = session.errors[i] if i < len(session.errors) else ""
        if i >= count:
            out += [gr.update(), gr.update()]
        elif error:
            out += [error_html(f"{lane_name(i)}: {error}"), charts.lane_highlights(trace.steps) if trace else []]
        else:
            status = charts.lane_status(lane_name(i), trace, session.max_new_tokens, running == i)
            out += [status, charts.lane_highlights(trace.steps, at) if trace else []]
    names = [lane_name(i) for i in range(count)]
    if running is not None:
        return out + [gr.update()] * 3 + [gr.update(choices=names), gr.update(choices=names)]
    done = session.done()
    finished = [t for _, t in done]
    rows = charts.metrics_rows([lane_metrics(t, n) for n, t in done], [t.strategy for t in finished])
    figure = charts.entropy_chart([n for n, _ in done], [t.steps for t in finished], at, raw) if done else None
    return out + [charts.divergence_markdown([n for n, _ in done], finished, at), rows, figure,
                  gr.update(choices=names), gr.update(choices=names)]


def _lane_column(i: int, spec: LaneSpec | None) -> LaneWidgets:
    spec = spec or default_spec([])
    with gr.Column(visible=i < MIN_LANES, min_width=280, elem_id=f"cmp-lane-{i}", elem_classes=["cmp-lane"]) as column:
        gr.Markdown(f"### {lane_name(i)}")
        preset = gr.Dropdown(preset_choices([]), value=spec.preset, label="Preset", elem_id=f"cmp-lane-{i}-preset")
        strategy = gr.Dropdown(list(runner.STRATEGY_MODULES), value=spec.strategy, label="Strategy",
                               elem_id=f"cmp-lane-{i}-strategy")
        knobs = gr.Textbox(spec.knobs, lines=3, max_lines=12, label="Knobs (key = value per line)",
                           elem_id=f"cmp-lane-{i}-knobs")
        with gr.Row():
            duplicate = gr.Button("Duplicate", size="sm", elem_id=f"cmp-lane-{i}-duplicate")
            remove = gr.Button("Remove", size="sm", elem_id=f"cmp-lane-{i}-remove")
        status = gr.HTML("", elem_id=f"cmp-lane-{i}-status")
        text = gr.HighlightedText(label="Output (click a token to open its step)", combine_adjacent=False,
                                  show_legend=False, show_inline_category=False, interactive=False,
                                  elem_id=f"cmp-lane-{i}-text")
    return LaneWidgets(column, preset, strategy, knobs, duplicate, remove, status, text)


def _inspect_panel() -> dict[str, Any]:
    with gr.Accordion("Inspect a token", open=True):
        with gr.Row():
            lane = gr.Dropdown([lane_name(i) for i in range(MIN_LANES)], value=lane_name(0), label="Lane",
                               elem_id="cmp-inspect-lane", scale=1)
            step = gr.Slider(0, 1, value=0, step=1, label="Step", elem_id="cmp-inspect-step", scale=3)
        explain = gr.Markdown(elem_id="cmp-inspect-explain")
        chart = gr.Plot(label="Distribution after each stage", elem_id="cmp-inspect-chart")
    return {"lane": lane, "step": step, "explain": explain, "chart": chart}


def _sweep_panel() -> dict[str, Any]:
    with gr.Accordion("Seed sweep: how random is a lane?", open=False):
        with gr.Row():
            lane = gr.Dropdown([lane_name(i) for i in range(MIN_LANES)], value=lane_name(1), label="Lane",
                               elem_id="cmp-sweep-lane")
            seeds = gr.Slider(2, MAX_SWEEP_SEEDS, value=5, step=1, label="Seeds (from the shared seed on)",
                              elem_id="cmp-sweep-seeds")
            run = gr.Button("Run seed sweep", elem_id="cmp-sweep-run")
        status = gr.HTML("", elem_id="cmp-sweep-status")
        summary = gr.Markdown(elem_id="cmp-sweep-summary")
        table = gr.Dataframe(headers=charts.SWEEP_HEADERS, value=[], interactive=False, wrap=True,
                             elem_id="cmp-sweep-table")
    return {"lane": lane, "seeds": seeds, "run": run, "status": status, "summary": summary, "table": table}


def build_tab(shared: Shared) -> None:
    starts = [spec_from_preset(p) for p in LANE_PRESETS[:MIN_LANES]]
    with gr.Row():
        prompt = gr.Textbox(DEFAULT_PROMPT, lines=3, label="Prompt (shared by all lanes)", elem_id="cmp-prompt",
                            scale=3)
        with gr.Column(scale=1, min_width=240):
            seed = gr.Number(0, precision=0, label="Seed (shared)", minimum=0, maximum=KNOBS["seed"].high,
                             elem_id="cmp-seed")
            max_new = gr.Slider(1, 256, value=32, step=1, label="max_new_tokens (shared)", elem_id="cmp-max-new-tokens",
                                info=KNOBS["max_new_tokens"].doc)
            chat = gr.Checkbox(False, label="Chat template", elem_id="cmp-chat")
    with gr.Row():
        run = gr.Button("Run all lanes", variant="primary", elem_id="cmp-run")
        add = gr.Button("Add lane", elem_id="cmp-add")
        stop = gr.Button("Stop", variant="stop", elem_id="cmp-stop")
    status = gr.HTML("", elem_id="cmp-status")
    with gr.Row(equal_height=False):
        lanes = [_lane_column(i, starts[i] if i < len(starts) else None) for i in range(MAX_LANES)]
    divergence = gr.Markdown(elem_id="cmp-divergence")
    metrics = gr.Dataframe(headers=charts.METRIC_HEADERS, value=[], interactive=False, wrap=True, elem_id="cmp-metrics",
                           label="Per-lane metrics (log-prob and perplexity under the unprocessed model)")
    entropy_kind = gr.Radio(["picked-from distribution", "raw model"], value="picked-from distribution",
                            label="Entropy of", elem_id="cmp-entropy-kind")
    entropy = gr.Plot(label="Entropy per step", elem_id="cmp-entropy")
    page = Page(prompt, seed, max_new, chat, run, add, stop, status, lanes, divergence, metrics, entropy_kind, entropy,
                _inspect_panel(), _sweep_panel(), gr.State(MIN_LANES), gr.State(None, time_to_live=3600))
    _wire_lanes(shared, page)
    _wire_run(shared, page)
    _wire_inspect(page)
    _wire_sweep(shared, page)
    _wire_api(shared)


def _raw(kind: str) -> bool:
    return kind == "raw model"


def _wire_lanes(shared: Shared, page: Page) -> None:
    """Preset pickers fill their lane; add / duplicate / remove reshape the lanes (and their results)."""
    for lane in page.lanes:
        lane.preset.input(_fill_lane, [lane.preset, shared.user_presets], [lane.strategy, lane.knobs],
                          api_visibility="private", queue=False)
        for edited in (lane.strategy, lane.knobs):  # a hand edit: the lane no longer is the preset
            edited.input(lambda: CUSTOM, None, [lane.preset], api_visibility="private", queue=False)
    shape_inputs = [page.count, page.session, page.entropy_kind, *page.lane_values]
    shape_outputs = [page.count, page.status, *page.spec_outputs, *page.result_outputs, page.session]
    local = {"api_visibility": "private", "queue": False}
    page.add.click(_reshape("add", 0), shape_inputs, shape_outputs, **local)
    for i, lane in enumerate(page.lanes):
        lane.duplicate.click(_reshape("duplicate", i), shape_inputs, shape_outputs, **local)
        lane.remove.click(_reshape("remove", i), shape_inputs, shape_outputs, **local)
    shared.user_presets.change(
        lambda stored, *current: [gr.update(choices=preset_choices(stored), value=c) for c in current],
        [shared.user_presets, *[lane.preset for lane in page.lanes]], [lane.preset for lane in page.lanes],
        api_visibility="private", queue=False)


def _fill_lane(choice: str, stored: list | None) -> list:
    spec = spec_from_preset(choice, stored)
    return [gr.update(), gr.update()] if spec is None else [spec.strategy, spec.knobs]


def _reshape(op: str, i: int):
    """A handler that adds a lane, or duplicates / removes lane ``i``; results move with their lanes."""

    def handler(count: int, session: CompareSession | None, kind: str, *values: Any) -> list:
        specs = specs_from(values, count)
        session = session or CompareSession()
        traces = (session.traces + [None] * count)[:count]
        errors = (session.errors + [""] * count)[:count]
        rows = list(zip(specs, traces, errors))
        try:
            if op == "add":
                rows = add_lane(rows, (default_spec(specs), None, ""))
            elif op == "duplicate":
                rows = duplicate_lane(rows, i)
            else:
                rows = remove_lane(rows, i)
        except UserError as exc:
            return [count, error_html(str(exc))] + [gr.update()] * (len(values) // 3 * 4) + \
                render_results(session, count, _raw(kind)) + [session]
        specs, session.traces, session.errors = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
        return [len(rows), ""] + render_specs(specs) + render_results(session, len(rows), _raw(kind)) + [session]

    return handler


def _wire_run(shared: Shared, page: Page) -> None:
    inputs = [page.prompt, page.seed, page.max_new_tokens, page.chat, shared.model, shared.quantization, page.count,
              page.entropy_kind, *page.lane_values]
    outputs = [page.status, *page.result_outputs, page.session]

    def on_run(prompt: str, seed: Any, max_new: Any, chat: bool, model: str, quant: str, count: int, kind: str,
               *values: Any) -> Iterator[list]:
        names = [lane_name(i) for i in range(count)]
        try:
            configs = [lane_config(spec, names[i], seed, max_new) for i, spec in enumerate(specs_from(values, count))]
            lm = shared.lm(model, quant)
            prompt_ids = shared.encode_prompt(lm, prompt, chat)
        except UserError as exc:
            yield [error_html(str(exc))] + [gr.update()] * (len(outputs) - 1)
            return
        session = CompareSession([None] * count, [""] * count, configs[0].max_new_tokens)
        note = status_html(f"running {count} lanes one after another…")
        yield [note] + render_results(session, count, _raw(kind), 0) + [session]
        for i in run_lanes(shared, lm, prompt, prompt_ids, configs, chat, session):
            note = status_html(f"running {names[i]} of {count}…")
            yield [note] + render_results(session, count, _raw(kind), i) + [session]
        failed = sum(1 for e in session.errors if e)
        done = f"done: {count - failed} of {count} lanes ran" + (f"; {failed} failed (see the lane)" if failed else "")
        note = status_html(done + ". Click any token to open its step.")
        yield [note] + render_results(session, count, _raw(kind)) + [session]

    run_event = page.run.click(on_run, inputs, outputs, api_visibility="private", **shared.model_event)
    submit_event = page.prompt.submit(on_run, inputs, outputs, api_visibility="private", **shared.model_event)
    page.stop.click(lambda: status_html("stopped"), None, [page.status], cancels=[run_event, submit_event], queue=False)
    page.entropy_kind.change(
        lambda session, count, kind: render_results(session or CompareSession(), count, _raw(kind)),
        [page.session, page.count, page.entropy_kind], page.result_outputs, api_visibility="private", queue=False)


def render_inspect(session: CompareSession | None, lane: str | None, step: Any) -> list:
    """Lane picker, step slider, explanation and stage chart for one lane's step."""
    traces = dict(session.done()) if session else {}
    trace = traces.get(lane or "")
    if trace is None:
        message = f"{lane} has no output." if traces else "Run the lanes, then click a token."
        return [gr.update(), gr.update(), message, None]
    last = len(trace.steps) - 1
    index = max(0, min(int(step or 0), last))
    chosen = trace.steps[index]
    if chosen.stages:
        explain, figure = step_charts.explain_step(chosen), step_charts.stage_chart(chosen)
    else:
        explain, figure = f"{trace.strategy} keeps no per-stage record of its tokens; see its own tab.", None
    records = contrastive.records(trace) if trace.strategy in contrastive.STRATEGIES else []
    if index < len(records):
        explain += "\n\n" + charts.record_markdown(records[index])
    return [gr.update(value=lane), gr.update(maximum=max(1, last), value=index), explain, figure]


def _wire_inspect(page: Page) -> None:
    panel = page.inspect
    outputs = [panel["lane"], panel["step"], panel["explain"], panel["chart"]]
    for i, lane in enumerate(page.lanes):
        def on_select(session: CompareSession | None, evt: gr.SelectData, i: int = i) -> list:
            index = evt.index if isinstance(evt.index, int) else evt.index[0]
            at = session.divergence() if session else None
            return render_inspect(session, lane_name(i), charts.clicked_step(int(index), at))

        lane.text.select(on_select, [page.session], outputs, api_visibility="private", queue=False)
    for trigger in (panel["lane"].input, panel["step"].release):
        trigger(render_inspect, [page.session, panel["lane"], panel["step"]], outputs, api_visibility="private",
                queue=False)


def _wire_sweep(shared: Shared, page: Page) -> None:
    panel = page.sweep
    inputs = [page.prompt, page.seed, page.max_new_tokens, page.chat, shared.model, shared.quantization, page.count,
              panel["lane"], panel["seeds"], *page.lane_values]
    outputs = [panel["status"], panel["summary"], panel["table"]]

    def on_sweep(prompt: str, seed: Any, max_new: Any, chat: bool, model: str, quant: str, count: int, lane: str,
                 seeds: Any, *values: Any) -> Iterator[list]:
        try:
            names = [lane_name(i) for i in range(count)]
            if lane not in names:
                raise UserError(f"seed sweep: pick one of {', '.join(names)}")
            config = lane_config(specs_from(values, count)[names.index(lane)], lane, seed, max_new)
            seed_list = sweep_seeds(config.seed, seeds)
            lm = shared.lm(model, quant)
            prompt_ids = shared.encode_prompt(lm, prompt, chat)
            for traces in run_sweep(shared, lm, prompt, prompt_ids, config, seed_list, chat):
                yield [status_html(f"{lane}: seed {len(traces)} of {len(seed_list)} done…"), gr.update(), gr.update()]
        except (UserError, ValueError, ModelLoadError) as exc:
            yield [error_html(str(exc)), gr.update(), gr.update()]
            return
        spread = sweep_spread([t.generated_token_ids for t in traces])
        rows = charts.sweep_rows(seed_list, traces, [mean_logprob([s.raw_prob for s in t.steps]) for t in traces])
        yield [status_html("done"), charts.sweep_markdown(lane, seed_list, spread), rows]

    sweep_event = panel["run"].click(on_sweep, inputs, outputs, api_visibility="private", **shared.model_event)
    page.stop.click(None, None, None, cancels=[sweep_event], queue=False)


def _wire_api(shared: Shared) -> None:
    def compare_api(prompt: str, lanes: list, seed: int = 0, max_new_tokens: int = 32, chat: bool = False,
                    model: str = "embedded", quantization: str = "none") -> dict:
        """Run 2-6 lanes on one prompt with one seed. Each lane: {"preset": built-in name, "config": {knobs}}
        (both optional). Returns every lane's trace JSON, the metrics rows and the first divergent step."""
        return compare(shared, prompt, lanes, seed, max_new_tokens, chat, model, quantization)

    def compare_sweep_api(prompt: str, lane: dict, seeds: int = 5, seed: int = 0, max_new_tokens: int = 32,
                          chat: bool = False, model: str = "embedded", quantization: str = "none") -> dict:
        """Run one lane over ``seeds`` consecutive seeds from ``seed``: the spread and every trace."""
        return compare_sweep(shared, prompt, lane, seeds, seed, max_new_tokens, chat, model, quantization)

    gr.api(compare_api, api_name="compare", **shared.model_event)
    gr.api(compare_sweep_api, api_name="compare_sweep", **shared.model_event)
