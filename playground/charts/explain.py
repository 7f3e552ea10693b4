"""The sentences beside a step's stage chart, generated from the same numbers the chart draws
(issue #35): each stage's top bar, removed mass and moved mass as its panel's subtitle says them,
the chosen token's p as the chart's title and bars say it, the draw u and its slice as the draw
panel shows them, every number written by engine.numbers.

Where the numbers come from matters (``Source``): a model loaded here and a served model in step
mode run our own chain and draw (every stage recorded); in fast mode the server sampled, so only
its top-N before (raw) and after its sampler (final) are known, no stage between them and no u.
No gradio, no plotting.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from engine.numbers import decimal, interval, percent
from engine.stages import grammar_facts
from engine.trace import StageTrace, StepTrace, TokenProb

from .stage_notes import stage_label, stage_note
from .tokens import render as readable

MOVED = 1e-6  # total variation below this is float noise: the stage changed nothing
SHARPENED = 0.005  # the top token's p moved at least this much: "sharpened" / "flattened"


def tokens_word(n: int) -> str:
    """"1 token", "2 tokens", "49,152 tokens"."""
    return f"{n:,} token" + ("" if n == 1 else "s")


@dataclass(frozen=True)
class Source:
    """Where a step's numbers come from (``source_of``): ``mode`` "local" (a model loaded here),
    "step" (a served model's top ``top_n``, our chain and draw over them; ``tail``: this step's raw
    mass outside them when recorded) or "fast" (the server's own sampler picked; each stage is only
    its top ``top_n``; ``sampled``: its knobs draw rather than take the most probable token)."""

    mode: str = "local"
    top_n: int | None = None
    tail: float | None = None
    sampled: bool = False

    @property
    def fast(self) -> bool:
        return self.mode == "fast"


LOCAL = Source()


def source_of(trace: Any, index: int) -> Source:
    """Step ``index`` of ``trace``'s Source, from its label ``extra["remote"]`` (engine.remote);
    LOCAL for a model loaded here (or no trace)."""
    remote = (getattr(trace, "extra", None) or {}).get("remote") or {}
    if not remote:
        return LOCAL
    top_n = remote.get("top_n") if isinstance(remote.get("top_n"), int) else None
    tails = remote.get("tail_mass") or []
    i = index - (len(trace.steps) - len(tails))  # a branch's label covers only its new steps
    tail = tails[i] if 0 <= i < len(tails) and isinstance(tails[i], (int, float)) else None
    sampled = (trace.config or {}).get("strategy") != "greedy"
    return Source(str(remote.get("mode", "step")), top_n, tail, sampled)


def stage_moved(stage: StageTrace) -> bool:
    """Whether a stage that removed nothing still moved mass (its panel says "moved …")."""
    return stage.mass_removed <= 0 and stage.tv_distance > MOVED


def explain_step(step: StepTrace, pick: str | None = None, source: Source = LOCAL) -> str:
    """One or two plain sentences about what the stages did at this step and how its token was
    picked (``pick``: the sentence about the pick instead of the run's, a what-if's), then a line
    per stage. ``source``: where the numbers come from (fast mode: the server's sampler)."""
    if source.fast:
        return _fast_head(step, source) + (pick or _fast_pick(step, source))
    raw = step.stages[0] if step.stages else None
    parts = []
    prev_top = raw.top[0] if raw is not None and raw.top else None
    for stage in step.stages[1:-1]:
        top = stage.top[0] if stage.top else None
        parts.append(_stage_sentence(stage, prev_top))
        prev_top = top
    head = ("; ".join(parts) + ". ") if parts else "No stage changed the raw distribution. "
    notes = "".join(f"\n- {html.escape(stage_note(stage), quote=False)}" for stage in step.stages[1:-1])
    grammar = grammar_sentence(step)
    return (head[0].upper() + head[1:] + (pick or _run_pick(step)) + (f" {grammar}" if grammar else "")
            + (f"\n\nStage by stage:{notes}" if notes else ""))


def grammar_sentence(step: StepTrace) -> str:
    """What the grammar did to the step's pick, from its records (``engine.stages.grammar_facts``):
    the model's favourite it forbade, how many tokens it allowed and the mass it removed, and the
    chosen token's p before and after the mask; "" without a grammar stage."""
    facts = grammar_facts(step)
    if facts is None:
        return ""
    if facts.off_grammar_at is not None:
        return f"The grammar masked nothing: a forced token left it at step {facts.off_grammar_at}."
    chosen = readable(step.chosen_token)
    if facts.ended:
        return f"The grammar was complete: only the end of text “{chosen}” was allowed."
    wanted = f"The model wanted “{readable(facts.wanted[0])}” ({percent(facts.wanted[1])}), which the grammar forbids; " \
        if facts.wanted else "The model's favourite was allowed; "
    prob = (lambda p: "not recorded" if p is None else percent(p))
    return (f"{wanted}the grammar allowed {tokens_word(facts.allowed)} and removed {percent(facts.forbidden_mass)} of "
            f"the mass, so “{chosen}” went from p = {prob(facts.chosen_before)} before the mask to "
            f"{prob(facts.chosen_after)} after it.")


def _stage_sentence(stage: StageTrace, prev_top: TokenProb | None) -> str:
    """What one stage did, in the numbers its panel shows (subtitle: kept, removed or moved mass;
    bars: its top token against the previous panel's)."""
    label = stage_label(stage)
    top = stage.top[0] if stage.top else None
    if stage.mass_removed > 0:
        return f"{label} kept {tokens_word(stage.kept)} and removed {percent(stage.mass_removed)} of the mass"
    if top is not None and prev_top is not None and top.token_id == prev_top.token_id \
            and abs(top.prob - prev_top.prob) > SHARPENED:
        verb = "sharpened" if top.prob > prev_top.prob else "flattened"
        return f"{label} {verb} the top token “{readable(top.token)}” from {percent(prev_top.prob)} to {percent(top.prob)}"
    if stage_moved(stage):
        return f"{label} moved {percent(stage.tv_distance)} of the probability mass"
    return f"{label} changed nothing here"


def _run_pick(step: StepTrace) -> str:
    """The sentence about how our own run picked the step's token."""
    chosen = readable(step.chosen_token)
    if step.forced:
        return f"You picked “{chosen}” (p = {percent(step.chosen_prob)} after all stages)."
    if step.draw is None:
        return (f"Greedy took the most probable token “{chosen}” (p = {percent(step.chosen_prob)}; "
                f"raw model {percent(step.raw_prob)}).")
    return (f"The draw u = {decimal(step.draw)} fell in “{chosen}”'s slice {interval(step.draw_low, step.draw_high)} "
            f"of the sorted cumulative distribution, so it was chosen (p = {percent(step.chosen_prob)}; "
            f"raw model {percent(step.raw_prob)}).")


def _stage_named(step: StepTrace, name: str) -> StageTrace | None:
    return next((s for s in step.stages if s.name == name), None)


def _top_n(stage: StageTrace, source: Source) -> int:
    return source.top_n or len(stage.top)


def _fast_head(step: StepTrace, source: Source) -> str:
    """Fast mode: what the server's sampler did, from the two panels it sent (raw, final)."""
    raw, final = _stage_named(step, "raw"), _stage_named(step, "final")
    if raw is None and final is None:
        return "The server sent no probabilities for this token. "
    if final is None or not final.top:
        if raw is None:  # (a final panel without tokens, and no raw one)
            return "The server sent no probabilities for this token. "
        return (f"Only the raw model's top {_top_n(raw, source)} are known here (the server's log-probabilities); "
                "the server's sampler ran on its side, unseen. ")
    kept = (f"it kept {tokens_word(final.kept)}" if final.kept < _top_n(final, source)
            else f"only its top {_top_n(final, source)} are known")
    if raw is None or not raw.top:
        return f"Only the server's top {_top_n(final, source)} after its sampler are known here; {kept}. "
    r0, f0 = raw.top[0], final.top[0]
    if r0.token_id != f0.token_id:
        return (f"The server's sampler made “{readable(f0.token)}” the most probable token ({percent(f0.prob)}) "
                f"instead of the raw model's “{readable(r0.token)}” ({percent(r0.prob)}); {kept}. ")
    verb = "sharpened" if f0.prob > r0.prob else "flattened"
    if abs(f0.prob - r0.prob) <= SHARPENED:
        return f"The server's sampler left the most probable token “{readable(f0.token)}” at {percent(f0.prob)}; {kept}. "
    return (f"The server's sampler {verb} the most probable token “{readable(f0.token)}” from {percent(r0.prob)} "
            f"to {percent(f0.prob)}; {kept}. ")


def _fast_pick(step: StepTrace, source: Source) -> str:
    """Fast mode: the server picked; which token, against its most probable one, with the p the
    chart shows (after its sampler; the raw model's, "unknown" outside the raw top-N)."""
    chosen = readable(step.chosen_token)
    final = _stage_named(step, "final") or _stage_named(step, "raw")
    where = "after its sampler" if _stage_named(step, "final") is not None else "raw model"
    raw_p = ("" if where == "raw model" else
             f"; raw model {percent(step.raw_prob)}" if step.raw_prob == step.raw_prob
             else f"; raw model unknown, outside its top {source.top_n or '?'}")
    p = f"p = {percent(step.chosen_prob)} {where}{raw_p}"
    how = "sampled" if source.sampled else "took"
    draw = " It draws with its own generator, so no u is known." if source.sampled else ""
    if final is None or not final.top:
        return f"The server {how} “{chosen}” ({p}).{draw}"
    top = final.top[0]
    if top.token_id == step.chosen_token_id:
        return f"The server {how} “{chosen}”, its most probable token ({p}).{draw}"
    if not source.sampled:
        how = "picked"
    return (f"The server {how} “{chosen}” ({p}), not its most probable token “{readable(top.token)}” "
            f"({percent(top.prob)}).{draw}")
