"""Lessons: short guided tours of one decoding idea each, stored as data (``presets/lessons/*.json``).

A lesson names the view it opens, the prompt, one preset (or 2-6 lanes for the Compare view),
which step to select first, 2-5 short steps of text, and optionally a ``check``: the outcome the
lesson teaches, stated so a machine can verify it on the real model (the tests run every lesson's
check on the embedded model; the UI shows the same sentence after the run).

Format (strict; unknown keys are refused)::

    {"version": 1, "id": "temperature", "title": "...", "view": "compare",
     "prompt": "...", "chat": true, "lanes": [<preset JSON>, ...] | "preset": <preset JSON>,
     "select_step": "max_entropy" | "min_entropy" | <int>, "steps": ["...", ...],
     "check": {"kind": "<one of CHECKS>", ...}, "models": ["", "vllm", "fast:llamacpp", ...]}

``models`` (optional, one per run): where each run goes: "" the page's model, ``vllm`` / ``llamacpp`` the
first OpenAI-compatible / llama.cpp server the operator lists (DP_REMOTE_MODELS; a page user never
names one), ``fast:<role>`` that server in fast mode (its own sampler). A lesson whose servers are not
listed is not offered (``available_lessons``). The lessons that need servers live in
``presets/lessons/served/``, apart from the built-in ones every model runs.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from engine import explore
from engine.reports import metrics
from engine.config import check_text
from engine.reports.drift import kv_cache_report, quantization_report
from engine.reports.kv_arith import shown
from engine.numbers import percent
from engine.reports.quant_report import compare_methods
from engine.backends.local import ModelSpec
from engine.backends.registry import ModelRegistry
from engine.backends.served import ModelPick, RemoteLabel
from engine.base.seam import Capabilities, Model, Models
from engine.reports.runs import Runs
from engine.presets import MAX_PRESET_BYTES, Preset, PresetError, loads_strict, parse_preset
from engine.trace import Trace

LESSONS_DIR = Path(__file__).resolve().parents[2] / "presets" / "lessons"
SERVED_DIR = LESSONS_DIR / "served"  # lessons whose runs go to the operator's servers (``models``)
ROLES = {"vllm": "openai", "llamacpp": "llamacpp"}  # a lesson's server role -> the backend it is listed as
LESSON_VERSION = 1
VIEWS = ("step", "compare", "beam", "speculative", "quantization", "inside")
LESSON_KEYS = ("version", "id", "title", "view", "prompt", "chat", "preset", "lanes", "select_step", "steps", "check",
               "models")
MAX_STEP_CHARS = 600
MAX_PROMPT_CHARS = 2000


class LessonError(ValueError):
    """A lesson file is invalid; the message names the key."""


@dataclass(frozen=True)
class Lesson:
    id: str
    title: str
    view: str
    prompt: str
    chat: bool
    runs: tuple[Preset, ...]  # one for single-run views, 2-6 lanes for Compare
    steps: tuple[str, ...]
    select_step: str | int = "max_entropy"
    check: dict[str, Any] | None = None
    models: tuple[str, ...] = ()  # per run: "" (the page's model), a server role, or fast:<role>; () all ""

    def to_dict(self) -> dict[str, Any]:
        """The ``/lessons`` JSON: ``preset`` is the first run's preset object; ``lanes`` all of them;
        ``models`` when runs go to servers."""
        out = {"id": self.id, "title": self.title, "view": self.view, "prompt": self.prompt, "chat": self.chat,
               "preset": self.runs[0].to_dict(), "steps": list(self.steps), "select_step": self.select_step,
               "check": self.check}
        if self.view == "compare":
            out["lanes"] = [p.to_dict() for p in self.runs]
        if self.models:
            out["models"] = list(self.models)
        return out

    @property
    def roles(self) -> set[str]:
        """The server roles its runs need (``vllm``, ``llamacpp``)."""
        return {ModelPick.parse(m).source for m in self.models if m}

    def to_file_dict(self) -> dict[str, Any]:
        """The lesson file's JSON (what ``parse_lesson`` reads back into an equal Lesson)."""
        return {"version": LESSON_VERSION, **self.to_dict()}


@dataclass(frozen=True)
class Outcome:
    """What a lesson's check found: ``ok`` and the sentence the UI shows, with the figures behind it."""

    ok: bool
    summary: str
    figures: Mapping[str, float | None]  # None: not measured (a z-score over too few tokens)
    report: Any = field(default=None, compare=False)  # a check's own measurement (KV / drift report), for its chart


# --- parsing -----------------------------------------------------------------------------------
def _text(data: dict, key: str, limit: int) -> str:
    value = data.get(key)
    try:
        value = check_text(key, value, max_len=limit)
    except ValueError as exc:
        raise LessonError(str(exc)) from None
    if not value.strip():
        raise LessonError(f"{key}: empty")
    return value


def _preset(value: Any, key: str) -> Preset:
    try:
        return parse_preset(value)
    except PresetError as exc:
        raise LessonError(f"{key}: {exc}") from None


def _runs(data: dict, view: str) -> tuple[Preset, ...]:
    if view == "compare":
        lanes = data.get("lanes")
        if not isinstance(lanes, list) or not 2 <= len(lanes) <= 6:
            raise LessonError("lanes: the compare view needs a list of 2 to 6 preset objects")
        return tuple(_preset(lane, f"lanes[{i}]") for i, lane in enumerate(lanes))
    if "lanes" in data:
        raise LessonError(f"lanes: only the compare view has lanes; this lesson opens {view!r}")
    return (_preset(data.get("preset"), "preset"),)


def _steps(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not 2 <= len(value) <= 5:
        raise LessonError("steps: expected a list of 2 to 5 short texts")
    return tuple(_text({"steps": s}, "steps", MAX_STEP_CHARS) for s in value)


def _select_step(value: Any) -> str | int:
    if value in ("max_entropy", "min_entropy"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1024:
        return value
    raise LessonError(f"select_step: expected max_entropy | min_entropy | a step number, got {value!r:.40}")


def parse_lesson(data: Any) -> Lesson:
    """Validate a decoded JSON value into a Lesson (never raises anything but LessonError)."""
    if not isinstance(data, dict):
        raise LessonError(f"lesson: expected a JSON object, got {type(data).__name__}")
    unknown = [k for k in data if k not in LESSON_KEYS]
    if unknown:
        raise LessonError(f"{str(unknown[0])[:40]}: unknown key; allowed keys: {', '.join(LESSON_KEYS)}")
    if data.get("version") != LESSON_VERSION:
        raise LessonError(f"version: expected {LESSON_VERSION}")
    lesson_id = _text(data, "id", 40)
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", lesson_id):
        raise LessonError(f"id: expected lowercase letters, digits and dashes, got {lesson_id!r}")
    view = data.get("view")
    if view not in VIEWS:
        raise LessonError(f"view: expected one of {' | '.join(VIEWS)}, got {str(view)[:40]!r}")
    chat = data.get("chat", True)
    if not isinstance(chat, bool):
        raise LessonError(f"chat: expected true or false, got {chat!r:.40}")
    title, prompt = _text(data, "title", 120), _text(data, "prompt", MAX_PROMPT_CHARS)
    runs = _runs(data, view)
    models = _models(data.get("models"), len(runs))
    return Lesson(id=lesson_id, title=title, view=view, prompt=prompt, chat=chat, runs=runs,
                  steps=_steps(data.get("steps")), select_step=_select_step(data.get("select_step", "max_entropy")),
                  check=_check(data.get("check"), runs, models), models=models)


def _models(value: Any, count: int) -> tuple[str, ...]:
    """A lesson's ``models``: absent, or one of "" | <role> | fast:<role> per run."""
    if value is None:
        return ()
    allowed = ["", *ROLES, *(ModelPick(r, "fast").value for r in ROLES)]
    if not isinstance(value, list) or len(value) != count or not all(isinstance(m, str) and m in allowed for m in value):
        raise LessonError(f"models: expected one of {' | '.join(repr(a) for a in allowed)} per run ({count}), "
                          f"got {shown(value)}")
    return tuple(value)


# Each check's optional fields: (default, lowest, highest), whole numbers. ``lanes`` (truncation_shapes)
# names the run indexes of the top-k and top-p lanes.
CHECK_FIELDS: dict[str, dict[str, tuple[int, int, int]]] = {
    "sampling_varies": {}, "entropy_rises": {}, "beam_beats_greedy": {}, "speculative_exact": {},
    "truncation_shapes": {},
    "less_repetition": {"n": (4, 1, 16), "min_tokens": (0, 0, 1024)},
    "kv_cache_same": {"max_new_tokens": (24, 1, 256)},
    "quantization_order": {"max_new_tokens": (12, 1, 64)},
    "grammar_distortion": {"seeds": (8, 1, 32)},
    "gptq_vs_awq": {},
    "engines_agree": {},
    "lens_forms": {"step": (0, 0, 1023)},
    "watermark_washes_out": {"share": (50, 1, 100)},
    "features_beat_tokens": {},
}
ENGINE_RUNS = ("", "vllm", "llamacpp")  # engines_agree: runs 0-2, greedy, on our engine, vLLM and llama.cpp
# What a check reads from the lesson's runs: how many it compares, or which strategy run 0 must be.
CHECK_RUNS = {"sampling_varies": 2, "entropy_rises": 2, "truncation_shapes": 2, "less_repetition": 2,
              "features_beat_tokens": 2}
FEATURE_RUNS = ("medusa", "eagle")  # features_beat_tokens: runs 0-1, greedy
CHECK_STRATEGY = {"beam_beats_greedy": "beam", "speculative_exact": "speculative", "grammar_distortion": "sample",
                  "watermark_washes_out": "sample"}


def _whole(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise LessonError(f"{key}: expected a whole number from {low} to {high}, got {shown(value)}")
    return value


def _check(check: Any, runs: Sequence[Preset], models: Sequence[str] = ()) -> dict[str, Any] | None:
    """A lesson's ``check`` validated against its kind and its runs: every message names the field
    (``check.<key>``) and echoes at most ~200 characters of what it refuses."""
    if check is None:
        return None
    if not isinstance(check, dict):
        raise LessonError(f"check: expected an object with a kind, got {shown(check)}")
    kind = check.get("kind")
    if not isinstance(kind, str) or kind not in CHECKS:
        raise LessonError(f"check.kind: expected one of {' | '.join(CHECKS)}, got {str(kind)[:40]!r}")  # a kind is a short name: 40 characters show it
    allowed = ("kind", *CHECK_FIELDS[kind], *(("lanes",) if kind == "truncation_shapes" else ()))
    unknown = [k for k in check if k not in allowed]
    if unknown:
        raise LessonError(f"check.{str(unknown[0])[:40]}: unknown key for {kind}; allowed keys: {', '.join(allowed)}")
    for key, (_, low, high) in CHECK_FIELDS[kind].items():
        if key in check:
            _whole(f"check.{key}", check[key], low, high)
    if len(runs) < CHECK_RUNS.get(kind, 1):
        raise LessonError(f"check.kind: {kind} compares {CHECK_RUNS[kind]} or more runs; this lesson has {len(runs)}")
    strategy = CHECK_STRATEGY.get(kind)
    if strategy is not None and runs[0].config.strategy != strategy:
        raise LessonError(f"check.kind: {kind} needs a {strategy} run; this lesson runs {runs[0].config.strategy}")
    if kind == "truncation_shapes":
        _lanes(check.get("lanes", {}), len(runs))
    if kind == "engines_agree" and (tuple(models[:3]) != ENGINE_RUNS or
                                    any(not p.config.is_greedy for p in runs[:3])):
        raise LessonError(f"check.kind: engines_agree compares greedy runs on {', '.join(map(repr, ENGINE_RUNS))} "
                          "first (models)")
    if kind == "features_beat_tokens" and (tuple(p.config.strategy for p in runs[:2]) != FEATURE_RUNS or
                                           any(not p.config.is_greedy for p in runs[:2])):
        raise LessonError("check.kind: features_beat_tokens compares a greedy medusa run, then a greedy eagle run")
    return dict(check)


def _lanes(lanes: Any, count: int) -> None:
    if not isinstance(lanes, dict):
        raise LessonError(f"check.lanes: expected an object {{\"top_k\": run, \"top_p\": run}}, got {shown(lanes)}")
    unknown = [k for k in lanes if k not in ("top_k", "top_p")]
    if unknown:
        raise LessonError(f"check.lanes.{str(unknown[0])[:40]}: unknown key; allowed keys: top_k, top_p")
    for key in ("top_k", "top_p"):
        if key in lanes:
            _whole(f"check.lanes.{key}", lanes[key], 0, count - 1)


def check_field(check: dict[str, Any], key: str) -> int:
    """A validated check's field, or its default."""
    return check.get(key, CHECK_FIELDS[check["kind"]][key][0])


def parse_lesson_json(text: str | bytes) -> Lesson:
    try:
        data = loads_strict(text, "lesson", MAX_PRESET_BYTES * 8)
    except PresetError as exc:
        raise LessonError(str(exc)) from None
    return parse_lesson(data)


@lru_cache(maxsize=1)
def _builtin() -> tuple[Lesson, ...]:
    return tuple(parse_lesson_json(p.read_bytes()) for p in sorted(LESSONS_DIR.glob("*.json")))


def builtin_lessons() -> dict[str, Lesson]:
    """The shipped lessons by id, in file-name order (the files are numbered for that order)."""
    return {lesson.id: lesson for lesson in _builtin()}


@lru_cache(maxsize=1)
def _served() -> tuple[Lesson, ...]:
    return tuple(parse_lesson_json(p.read_bytes()) for p in sorted(SERVED_DIR.glob("*.json")))


def served_lessons() -> dict[str, Lesson]:
    """The shipped lessons whose runs go to the operator's servers, by id."""
    return {lesson.id: lesson for lesson in _served()}


def listed_roles(environ: Any = None, offered: Sequence[str] | None = None) -> dict[str, str]:
    """Each server role the operator's list fills: the first listed server of its backend
    (``{"vllm": "openai:http://...#vocab=...", "llamacpp": "llamacpp:http://..."}``). ``offered``: the
    app's allowed sources (its model policy's, fixed when it started); else DP_REMOTE_MODELS."""
    from engine.backends.registry import is_remote_source
    from engine.backends.served import RemoteSpec, allowed_remote_models

    specs = allowed_remote_models(environ) if offered is None else \
        [RemoteSpec.parse(s) for s in offered if is_remote_source(s)]
    found: dict[str, str] = {}
    for spec in specs:
        for role, backend in ROLES.items():
            if spec.backend == backend:
                found.setdefault(role, str(spec))
    return found


def available_lessons(environ: Any = None, offered: Sequence[str] | None = None) -> dict[str, Lesson]:
    """The built-in lessons, then the served ones whose servers the operator lists."""
    roles = listed_roles(environ, offered)
    return builtin_lessons() | {k: v for k, v in served_lessons().items() if v.roles <= set(roles)}


def run_sources(lesson: Lesson, page_model: str, environ: Any = None, offered: Sequence[str] | None = None
                ) -> list[str]:
    """The model source of each run: ``page_model`` or the listed server of its role (``fast:`` kept
    in front: that server in fast mode). LessonError naming the role when it is not listed."""
    roles = listed_roles(environ, offered)
    out = []
    for model in lesson.models or ("",) * len(lesson.runs):
        pick = ModelPick.parse(model)
        if pick.source and pick.source not in roles:
            raise LessonError(f"models: this lesson needs a {pick.source} server the operator lists in "
                              "DP_REMOTE_MODELS")
        out.append(ModelPick(roles[pick.source], pick.mode).value if pick.source else page_model)
    return out


def run_model(registry: Models, source: str, lm: Model) -> Model:
    """The model a run's source names: ``lm`` itself, or the listed server (fast mode after ``fast:``)."""
    if source == getattr(lm, "source", lm.name):
        return lm
    pick = ModelPick.parse(source)
    served = registry.get(ModelSpec(pick.source))
    return served.with_mode("fast") if pick.mode == "fast" else served


# --- running and checking --------------------------------------------------------------------
def run_lesson(lm: Model, lesson: Lesson, registry: Models | None = None,
               environ: Any = None, *, runs: Runs) -> list[Trace]:
    """Every run of the lesson (its lanes, or its one preset) on ``lm``, or on the server its
    ``models`` name, through ``runs`` (``engine.runner.RUNS``)."""
    registry = registry or ModelRegistry()
    sources = run_sources(lesson, getattr(lm, "source", lm.name), environ)
    return [runs.run(run_model(registry, source, lm), lesson.prompt, p.config, chat=lesson.chat, registry=registry)
            for p, source in zip(lesson.runs, sources)]


def selected_step(trace: Trace, select: str | int) -> int:
    """The step a lesson opens on: the most (or least) uncertain step under the raw model, or a number."""
    if not trace.steps:
        return 0
    if isinstance(select, int):
        return min(select, len(trace.steps) - 1)
    key = (lambda i: trace.steps[i].raw_entropy)
    pick = max if select == "max_entropy" else min
    return pick(range(len(trace.steps)), key=key)


def taught_run(lesson: Lesson) -> int | None:
    """The run whose chart shows what the lesson's check is about, where the check names one: a
    truncation_shapes check's top-p lane (its few tokens at the peaked step, its many at the flat
    one: the adaptive rule the lesson teaches); a features_beat_tokens check's EAGLE run (run 1, its
    rounds); None for every other check (the view picks)."""
    check = lesson.check or {}
    if check.get("kind") == "truncation_shapes":
        return check.get("lanes", {}).get("top_p", 1)  # validated by _lanes: a run index
    if check.get("kind") == "features_beat_tokens":
        return 1  # validated by _check: the EAGLE run
    return None


def evaluate(lm: Model, lesson: Lesson, traces: Sequence[Trace], registry: Models | None = None, *,
             runs: Runs) -> Outcome:
    """Run the lesson's check over its traces (a check that runs more goes through ``runs``:
    ``engine.runner.RUNS``)."""
    if lesson.check is None:
        return Outcome(True, "", {})
    kind = lesson.check["kind"]
    return CHECKS[kind](lm, lesson, list(traces), registry or ModelRegistry(), runs)


def _label(p: Preset) -> str:
    return p.name


def _sampling_varies(lm, lesson, traces, registry, runs) -> Outcome:
    """Lane 0 is greedy: running it again gives the same text. Sampled lanes differ from each other."""
    again = runs.run(lm, lesson.prompt, lesson.runs[0].config, chat=lesson.chat)
    sampled = {tuple(t.generated_token_ids) for t in traces[1:]}
    ok = again.generated_token_ids == traces[0].generated_token_ids and len(sampled) == len(traces) - 1
    return Outcome(ok, "Greedy gives the same text every time; each seed of sampling gives a different one.",
                   {"distinct_sampled_texts": float(len(sampled))})


def _entropy_rises(lm, lesson, traces, registry, runs) -> Outcome:
    """At the first step (same context for every lane) the final entropy grows lane by lane. A greedy
    lane (T = 0) puts all its mass on one token: entropy 0, whatever its trace's unused stages say."""
    h = [0.0 if p.config.is_greedy else t.steps[0].entropy for p, t in zip(lesson.runs, traces)]
    ok = all(a < b for a, b in zip(h, h[1:]))
    text = " < ".join(f"{_label(p)}: {x:.2f}" for p, x in zip(lesson.runs, h))
    return Outcome(ok, f"Entropy of the first token's final distribution (nats) rises with temperature: {text}.",
                   {f"entropy_{i}": x for i, x in enumerate(h)})


def _truncation_shapes(lm, lesson, traces, registry, runs) -> Outcome:
    """On lane 0's run, re-process its most peaked and its flattest step under every lane's knobs:
    top-p adapts (keeps few tokens where the model is sure, many where it is not), top-k does not."""
    trace = traces[0]
    peaked, flat = selected_step(trace, "min_entropy"), selected_step(trace, "max_entropy")
    kept = {}
    for i, p in enumerate(lesson.runs):
        knobs = p.config.to_dict(sparse=True)
        for name, step in (("peaked", peaked), ("flat", flat)):
            kept[f"{name}_{i}"] = float(explore.explore_step(lm, trace, step, knobs)[-1].kept)
    by = lesson.check.get("lanes", {})  # run indexes, validated by _lanes
    k, p_ = by.get("top_k", 0), by.get("top_p", 1)
    ok = kept[f"peaked_{p_}"] < kept[f"peaked_{k}"] and kept[f"flat_{p_}"] > kept[f"peaked_{p_}"] \
        and kept[f"flat_{k}"] == kept[f"peaked_{k}"]
    return Outcome(ok, f"top-k keeps {kept[f'peaked_{k}']:.0f} tokens at the peaked step and {kept[f'flat_{k}']:.0f} at "
                       f"the flat one; top-p keeps {kept[f'peaked_{p_}']:.0f} and {kept[f'flat_{p_}']:.0f}.", kept)


def _less_repetition(lm, lesson, traces, registry, runs) -> Outcome:
    """Lane 0 repeats itself (share of repeated 4-grams); every other lane repeats less."""
    n, least = check_field(lesson.check, "n"), check_field(lesson.check, "min_tokens")
    rep = [metrics.rep_n(t.generated_token_ids, n) for t in traces]
    lengths = [len(t.generated_token_ids) for t in traces]
    # A run that stopped early (EOS after a few tokens) has no room to repeat: it proves nothing.
    ok = rep[0] > 0 and all(r < rep[0] for r in rep[1:]) and min(lengths) >= least
    text = ", ".join(f"{_label(p)} {percent(r)} of {k} tokens" for p, r, k in zip(lesson.runs, rep, lengths))
    short = f" (the check needs {least} tokens from every run)" if min(lengths) < least else ""
    return Outcome(ok, f"Repeated {n}-grams: {text}{short}.",
                   {f"rep_{i}": r for i, r in enumerate(rep)} | {f"tokens_{i}": float(k) for i, k in enumerate(lengths)})


def _sequence_score(trace: Trace, alpha: float) -> float:
    logp = sum(math.log(max(s.raw_prob, 1e-45)) for s in trace.steps)
    return logp / max(1, len(trace.steps)) ** alpha


def _beam_beats_greedy(lm, lesson, traces, registry, runs) -> Outcome:
    """The beam winner's score (sum of log-probs / length^alpha) is at least greedy's under the same rule."""
    config = lesson.runs[0].config
    greedy = runs.run(lm, lesson.prompt, config.replace(strategy="greedy", num_beams=1), chat=lesson.chat)
    beam_trace = traces[0]
    winner = beam_trace.beam.hypotheses[beam_trace.beam.winner]
    greedy_score = _sequence_score(greedy, config.length_penalty)
    ok = winner.score >= greedy_score - 1e-6
    return Outcome(ok, f"Beam search (n = {config.num_beams}) finds a sequence scoring {winner.score:.3f}; "
                       f"greedy's scores {greedy_score:.3f}.", {"beam_score": winner.score, "greedy_score": greedy_score})


def _speculative_exact(lm, lesson, traces, registry, runs) -> Outcome:
    """Greedy speculative decoding gives exactly the target's greedy text, with fewer target forwards."""
    config = lesson.runs[0].config
    target = runs.run(lm, lesson.prompt, config.replace(strategy="greedy"), chat=lesson.chat)
    spec = traces[0]
    rate = spec.summary.get("acceptance_rate", 0.0)
    per_forward = spec.summary.get("tokens_per_target_forward", 0.0)
    ok = spec.generated_token_ids == target.generated_token_ids and rate > 0 and per_forward > 1
    return Outcome(ok, f"Same text as the target alone; {percent(rate)} of drafts accepted, "
                       f"{per_forward:.2f} tokens per target forward.",
                   {"acceptance_rate": rate, "tokens_per_target_forward": per_forward})


def _grammar_distortion(lm, lesson, traces, registry, runs) -> Outcome:
    """Masked decoding never leaves the grammar: the lesson's run and a sweep of seeds all write one of
    its strings. What it costs: the exact distribution of masked decoding over the strings differs from
    the model's own distribution conditioned on the grammar (engine.reports.distortion), both exact and
    summing to 1."""
    from engine.reports.distortion import distortion_report

    config = lesson.runs[0].config
    report = distortion_report(lm, lesson.prompt, config, lesson.chat, prompt_ids=traces[0].prompt_token_ids)
    texts = {s.text for s in report.strings}
    sweep = [traces[0], *_seed_sweep(lm, lesson, config, traces[0].prompt_token_ids, check_field(lesson.check, "seeds"),
                                     runs)]
    valid = sum(t.text in texts and t.stop_reason == "eos" for t in sweep)
    sums = (sum(s.exact for s in report.strings), sum(s.masked for s in report.strings))
    ok = valid == len(sweep) and abs(sums[0] - 1) < 1e-6 and abs(sums[1] - 1) < 1e-3 and report.total_variation > 0.05
    top = max(report.strings, key=lambda s: s.masked)
    return Outcome(ok, f"All {len(sweep)} sampled runs wrote one of the grammar's {len(texts)} strings. Masked decoding "
                       f"picks {top.text!r} {top.masked:.0%} of the time; the model conditioned on the grammar would "
                       f"pick it {top.exact:.0%} (total variation {report.total_variation:.2f}). Unconstrained, the "
                       f"model writes one of these strings and stops with probability {report.allowed_mass:.1e}.",
                   {"valid_runs": float(valid), "runs": float(len(sweep)), "total_variation": report.total_variation,
                    "allowed_mass": report.allowed_mass, "exact_sum": sums[0], "masked_sum": sums[1]}, report)


def _seed_sweep(lm, lesson, config, prompt_ids: Sequence[int], seeds: int, runs: Runs) -> list[Trace]:
    """The lesson's run again at seeds config.seed + 1 .. + seeds - 1, all at once: their steps share one
    batched forward (a scheduler of their own, ``runs.scheduler``; each trace equals the run alone)."""
    if seeds < 2:
        return []
    scheduler = runs.scheduler(lm)
    try:
        with ThreadPoolExecutor(seeds - 1, thread_name_prefix="dp-lesson-sweep") as pool:
            return list(pool.map(lambda i: runs.run(lm, lesson.prompt, config.replace(seed=config.seed + i),
                                                    chat=lesson.chat, prompt_ids=prompt_ids, scheduler=scheduler),
                                 range(1, seeds)))
    finally:
        scheduler.close()


def _kv_cache_same(lm, lesson, traces, registry, runs) -> Outcome:
    """Cached and recomputed decoding pick the same tokens; the cache feeds one token per step where
    recomputing feeds the whole sequence (O(n) vs O(n²) tokens through the model)."""

    n = check_field(lesson.check, "max_new_tokens")
    report = kv_cache_report(lm, lesson.prompt, lesson.chat, n)
    prompt = report.prompt_tokens
    uncached_tokens = sum(prompt + i for i in range(len(report.generated_token_ids)))
    cached_tokens = prompt + len(report.generated_token_ids) - 1
    return Outcome(report.tokens_equal, f"Same {len(report.generated_token_ids)} tokens either way; the model read "
                                        f"{cached_tokens} tokens with the cache and {uncached_tokens} without.",
                   {"cached_tokens": float(cached_tokens), "uncached_tokens": float(uncached_tokens)}, report)


def _quantization_order(lm, lesson, traces, registry, runs) -> Outcome:
    """nf4 (4-bit) moves the distribution further from full precision than int8 (mean KL)."""

    report = quantization_report(registry, lm.source, lesson.prompt, lesson.chat,
                                 check_field(lesson.check, "max_new_tokens"), ("int8", "nf4"))
    kl = {v.quantization: v.mean_kl for v in report.variants}
    ok = "int8" in kl and "nf4" in kl and kl["int8"] < kl["nf4"]
    return Outcome(ok, f"Mean KL from full precision: int8 {kl.get('int8', math.nan):.3f}, nf4 {kl.get('nf4', math.nan):.3f} nats.",
                   {f"kl_{k}": v for k, v in kl.items()}, report)


GPTQ_VS_AWQ = ("rtn-g64", "gptq-g64", "awq-g64", "gptq-g64-code", "awq-g64-code")


def _gptq_vs_awq(lm, lesson, traces, registry, runs) -> Outcome:
    """On the held-out text (group 64): AWQ beats round-to-nearest on perplexity and KL from fp32,
    and the calibration set matters: calibrated on code instead of prose, GPTQ (which fits its
    calibration inputs) drifts further from fp32 on held-out prose; AWQ's move is reported."""
    report = compare_methods(registry, lm.source, GPTQ_VS_AWQ)
    if report.errors:
        variant, message = next(iter(report.errors.items()))
        return Outcome(False, f"{variant}: {message}", {}, report)
    row = {r.variant: r for r in report.rows}
    rtn, gptq, awq = row["rtn-g64"], row["gptq-g64"], row["awq-g64"]

    def versus(r) -> str:
        return f"{r.perplexity:.1f} (KL {r.mean_kl:.3f}, {(r.perplexity - rtn.perplexity) / rtn.perplexity:+.0%} vs RTN)"

    moved = {m: row[f"{m}-g64-code"].mean_kl - row[f"{m}-g64"].mean_kl for m in ("gptq", "awq")}
    ok = awq.perplexity < rtn.perplexity and awq.mean_kl < rtn.mean_kl and moved["gptq"] > 0
    summary = (f"Held-out perplexity, 4-bit group 64: fp32 {row['none'].perplexity:.1f}; RTN {rtn.perplexity:.1f} "
               f"(KL {rtn.mean_kl:.3f}); GPTQ {versus(gptq)}; AWQ {versus(awq)}. Calibrated on code instead of prose, "
               f"the KL from fp32 moves by {moved['gptq']:+.3f} (GPTQ) and {moved['awq']:+.3f} (AWQ) nats.")
    figures = {f"ppl_{r.variant}": r.perplexity for r in report.rows} | {f"kl_{r.variant}": r.mean_kl for r in report.rows}
    return Outcome(ok, summary, figures, report)


# The checks that need the model itself, not what a served model's API gives (engine.backends):
# kind -> why, for the one line a remote run shows instead. Every other check runs on a served model
# too (its re-processed steps are step mode's, over the server's top-N: explore.raw_logits).
NEEDS_MODEL = {
    "kv_cache_same": "it decodes with and without the model's own KV cache",
    "quantization_order": "it loads the model's weights quantized",
    "gptq_vs_awq": "it loads the model's 4-bit checkpoints made here",
    "beam_beats_greedy": "a served beam search scores by vLLM's rule (the prompt's length counts), not the lesson's",
    "grammar_distortion": "it walks every token prefix of the grammar with the model's whole distribution",
    "lens_forms": "it reads every layer's hidden state",
    "features_beat_tokens": "its draft heads read the model's own hidden states",
}
# The capability each of them needs (engine.base.seam.Capabilities)
CHECK_NEEDS = {"kv_cache_same": "kv_cache", "quantization_order": "weights", "gptq_vs_awq": "weights",
               "beam_beats_greedy": "full_logits", "grammar_distortion": "full_logits", "lens_forms": "hidden_states",
               "features_beat_tokens": "hidden_states"}


def check_unavailable(kind: str | None, capabilities: Capabilities) -> str | None:
    """Why a model with ``capabilities`` cannot run the check ``kind`` (NEEDS_MODEL's words), or None."""
    need = CHECK_NEEDS.get(kind or "")
    return NEEDS_MODEL[kind or ""] if need is not None and not capabilities.has(need) else None

def _raw_top(trace: Trace, i: int) -> dict[int, float]:
    """Step ``i``'s raw top tokens and their log p under the model's whole vocabulary (a step-mode run
    on a server renormalised them over the server's top-N: its tail mass is put back)."""
    label = RemoteLabel.of(trace)
    tails = (label.tail_mass if label is not None else None) or []
    keep = 1.0 - (tails[i] if i < len(tails) else 0.0)
    raw = trace.steps[i].stages[0]
    return {t.token_id: math.log(t.prob * keep) for t in raw.top if t.prob > 0}


def _apart(ours: Trace, theirs: Trace, positions: int) -> float:
    """The largest |log p difference| of a token both raw top lists hold, over the first ``positions``
    steps (where both runs read the same context)."""
    gaps = [abs(a[t] - b[t]) for i in range(min(positions, len(ours.steps), len(theirs.steps)))
            for a, b in [(_raw_top(ours, i), _raw_top(theirs, i))] for t in a.keys() & b.keys()]
    return max(gaps, default=0.0)


def _engines_agree(lm, lesson, traces, registry, runs) -> Outcome:
    """Runs 0-2: greedy on our engine, vLLM and llama.cpp (the same model: our float32 folder is the
    Q4_1 GGUF dequantized; vLLM serves that folder, llama.cpp the GGUF, computing on its 4-bit blocks
    with each activation rounded to 8 bits, Q8_1, for the products). vLLM picks our tokens with
    log-probabilities within 1e-3; llama.cpp's quantized arithmetic moves them further (and may part).
    Seeded runs after them: texts compared."""
    ours, vllm, llama = (t.generated_token_ids for t in traces[:3])
    agree = metrics.common_prefix(ours, vllm)
    parts = metrics.first_divergence([ours, llama])
    d_vllm = _apart(traces[0], traces[1], agree + 1)  # the step after the last shared token still reads ours
    d_llama = _apart(traces[0], traces[2], len(ours) if parts is None else parts + 1)
    ok = ours == vllm and d_vllm < 1e-3 and d_llama > d_vllm
    text = (f"Our engine and vLLM (the same float32 weights) pick the same {agree} of {len(ours)} tokens, their "
            f"log-probabilities at most {d_vllm:.1e} apart; llama.cpp, multiplying the Q4_1 blocks by activations "
            f"rounded to 8 bits, moves them up to {d_llama:.2f} apart")
    text += ", yet it picks the same tokens here." if parts is None else (
        f" and it parts at token {parts + 1}: {_piece(traces[2], parts)!r} where ours picks {_piece(traces[0], parts)!r}.")
    seeded = traces[3:]
    if seeded:
        texts = {tuple(t.generated_token_ids) for t in seeded}
        text += (f" With the same seed and knobs, the {len(seeded)} sampled runs give {len(texts)} different "
                 f"text{'s' if len(texts) != 1 else ''}: a server in fast mode draws with its own generator.")
    return Outcome(ok, text, {"same_tokens_vllm": float(agree), "logprob_apart_vllm": d_vllm,
                              "logprob_apart_llamacpp": d_llama, "parts_at_llamacpp": float(-1 if parts is None else parts)})


def _piece(trace: Trace, i: int) -> str:
    return trace.steps[i].chosen_token if i < len(trace.steps) else "(the end)"


def _lens_forms(lm, lesson, traces, registry, runs) -> Outcome:
    """The logit lens at the check's step: the token the model picks is not what the embeddings or
    the first half of the layers read out (outside their top 10); it becomes the most likely token
    only in the second half of the network and stays so to the last layer."""
    from engine.reports.lens import trace_lens

    found = trace_lens(lm, traces[0], min(check_field(lesson.check, "step"), len(traces[0].steps) - 1))
    half = found.layers[-1].layer / 2
    early = min(x.chosen_rank for x in found.layers if x.layer < half)  # its best rank in the first half
    ok = found.first_top1 is not None and found.first_top1 > half and early > 10 and found.last_matches_logits
    return Outcome(ok, found.sentence(), {"first_top1": float(-1 if found.first_top1 is None else found.first_top1),
                                          "layers": float(found.layers[-1].layer), "best_early_rank": float(early)})


def _watermark_washes_out(lm, lesson, traces, registry, runs) -> Outcome:
    """The run's watermark is detected (z above the paper's 4); the same run without it is not; and
    replacing the check's share of the tokens (an edit that keeps the length) takes it back under 4."""
    from engine.reports import watermark as wm

    config, ids = lesson.runs[0].config, traces[0].generated_token_ids
    key = wm.WatermarkKey.of(config)
    planted = wm.detect(ids, lm.vocab_size, key)
    plain = runs.run(lm, lesson.prompt, config.replace(watermark_delta=0.0), chat=lesson.chat)
    unmarked = wm.detect(plain.generated_token_ids, lm.vocab_size, key)
    share = check_field(lesson.check, "share") / 100
    washed = wm.detect(wm.replaced(ids, share, lm.vocab_size, config.seed), lm.vocab_size, key)
    ok = planted.detected and not unmarked.detected and not washed.detected and config.watermark_delta > 0
    return Outcome(ok, f"Watermarked: z = {planted.z:.1f} over {planted.scored} tokens ({planted.green_fraction:.0%} "
                       f"green, chance {key.gamma:.0%}); the same prompt without it: z = {unmarked.z:.1f}; with "
                       f"{share:.0%} of the tokens replaced: z = {washed.z:.1f} (the threshold is {planted.threshold:g}).",
                   {"z_planted": planted.z, "z_unmarked": unmarked.z, "z_washed": washed.z})


def _features_beat_tokens(lm, lesson, traces, registry, runs) -> Outcome:
    """Runs 0-1: greedy Medusa (heads predicting tokens from the last hidden state) and greedy EAGLE
    (a head predicting the next features from the target's own): EAGLE keeps at least as many tokens
    per target forward, and both write the target's own greedy text."""
    target = runs.run(lm, lesson.prompt, lesson.runs[0].config.replace(strategy="greedy"), chat=lesson.chat)
    medusa, eagle = traces[0], traces[1]
    per = {name: t.summary.get("tokens_per_target_forward", 0.0) for name, t in (("medusa", medusa), ("eagle", eagle))}
    same = {name: t.generated_token_ids == target.generated_token_ids for name, t in (("medusa", medusa), ("eagle", eagle))}
    ok = all(same.values()) and per["eagle"] >= per["medusa"]
    texts = "both wrote" if all(same.values()) else "not both wrote"
    return Outcome(ok, f"EAGLE kept {per['eagle']:.2f} tokens per target forward, Medusa {per['medusa']:.2f}; "
                       f"{texts} the target's own greedy text ({len(target.generated_token_ids)} tokens).",
                   {"eagle_tokens_per_forward": per["eagle"], "medusa_tokens_per_forward": per["medusa"],
                    "same_tokens_eagle": float(same["eagle"]), "same_tokens_medusa": float(same["medusa"])})


CHECKS: dict[str, Callable[..., Outcome]] = {
    "sampling_varies": _sampling_varies,
    "entropy_rises": _entropy_rises,
    "truncation_shapes": _truncation_shapes,
    "less_repetition": _less_repetition,
    "beam_beats_greedy": _beam_beats_greedy,
    "speculative_exact": _speculative_exact,
    "kv_cache_same": _kv_cache_same,
    "quantization_order": _quantization_order,
    "grammar_distortion": _grammar_distortion,
    "gptq_vs_awq": _gptq_vs_awq,
    "engines_agree": _engines_agree,
    "lens_forms": _lens_forms,
    "watermark_washes_out": _watermark_washes_out,
    "features_beat_tokens": _features_beat_tokens,
}

__all__ = ["CHECK_NEEDS", "NEEDS_MODEL", "Lesson", "LessonError", "Outcome", "available_lessons", "builtin_lessons",
           "check_unavailable", "evaluate", "parse_lesson", "parse_lesson_json", "run_lesson", "run_sources",
           "selected_step", "served_lessons", "taught_run"]
