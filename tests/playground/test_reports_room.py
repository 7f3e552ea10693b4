"""Issue #27: the quantization and KV cache reports obey the run's control. Cancelled (Stop, a
cancelled API job) or past the time limit, they stop before the next forward, and what they had
measured comes back marked ``stopped`` (cut before their reference run, they raise RunStopped).

Engine and view handlers on the tiny model, counting forwards; then the two API endpoints of a
real server (gradio_client), cancelled after their first forwards: no forward follows.
"""

from __future__ import annotations


import pytest

from engine.reports import drift
from engine.control import RunControl, RunStopped
from playground.shared import Shared
from playground.views import quantization as view
from tests.helpers.drift import OneModelRegistry
from tests.helpers.common import forwards_after_stop
from tests.helpers.api import api_client

PROMPT = "Once upon a time, in a small village by the sea,"


class StopAfter:
    """Counts the model's forwards; after ``n`` of them it cancels ``control`` (``how="cancel"``)
    or moves its start back past its deadline (``how="time_limit"``)."""

    def __init__(self, lm, control: RunControl, n: int, how: str = "cancel"):
        self.control, self.n, self.how, self.count = control, n, how, 0
        self.handle = lm.model.register_forward_hook(self.seen)

    def seen(self, *_):
        self.count += 1
        if self.count == self.n:
            if self.how == "cancel":
                self.control.cancel()
            else:
                self.control.started -= 3600

    def __enter__(self) -> "StopAfter":
        return self

    def __exit__(self, *_) -> None:
        self.handle.remove()


def forwards_of(lm, run) -> int:
    with StopAfter(lm, RunControl(), 10**9) as counter:
        run()
    return counter.count


@pytest.fixture
def kv_length(tiny_lm) -> int:
    """How many tokens the tiny model's greedy KV report generates for PROMPT (it may stop at EOS)."""
    length = len(drift.kv_cache_report(tiny_lm, PROMPT, False, 24).generated_token_ids)
    assert length >= 6, "the tiny model ends too early for these tests"
    return length


@pytest.mark.parametrize("how", ["cancel", "time_limit"])
def test_kv_report_stopped_in_its_uncached_loop_returns_the_steps_both_loops_ran(tiny_lm, kv_length, how):
    control = RunControl(deadline_s=60)
    at = 1 + kv_length + 3  # the warm-up forward, the cached loop, then 3 uncached steps
    with StopAfter(tiny_lm, control, at, how) as counter:
        report = drift.kv_cache_report(tiny_lm, PROMPT, False, 24, control=control)
    assert counter.count == at  # no forward after the stop
    assert report.stopped.startswith("stopped: ") and "after 3 of" in report.stopped
    assert ("cancelled" if how == "cancel" else "time limit") in report.stopped
    assert len(report.uncached_token_ids) == 3 and len(report.steps) == kv_length
    assert [s.uncached_ms is None for s in report.steps] == [False] * 3 + [True] * (kv_length - 3)
    assert report.uncached_tokens_per_s > 0 and report.tokens_equal  # over the 3 steps both ran


@pytest.mark.parametrize("at", [1, 2, 5])
def test_kv_report_stopped_in_its_cached_loop_raises_at_once(tiny_lm, kv_length, at):
    control = RunControl()
    with StopAfter(tiny_lm, control, at) as counter, pytest.raises(RunStopped, match="cancelled"):
        drift.kv_cache_report(tiny_lm, PROMPT, False, 24, control=control)
    assert counter.count == at


def test_drift_report_stopped_during_the_reference_raises_and_after_it_is_partial(tiny_lm):
    registry = OneModelRegistry(tiny_lm)
    drift.quantization_report(registry, "tiny", PROMPT, False, 12, ["none"])  # the held-out perplexity, once per model
    whole = forwards_of(tiny_lm, lambda: drift.quantization_report(registry, "tiny", PROMPT, False, 12, ["none"]))
    assert whole >= 4
    control = RunControl()
    with StopAfter(tiny_lm, control, 3) as counter, pytest.raises(RunStopped):
        drift.quantization_report(registry, "tiny", PROMPT, False, 12, ["none"], control=control)
    assert counter.count == 3
    control = RunControl(deadline_s=60)
    with StopAfter(tiny_lm, control, whole - 1, "time_limit") as counter:  # the reference's teacher-forced forward
        report = drift.quantization_report(registry, "tiny", PROMPT, False, 12, ["none"], control=control)
    assert counter.count == whole - 1
    assert "time limit" in report.stopped and report.variants == [] and report.pending() == ["none"]
    assert report.reference_token_ids  # the reference run is kept


def test_kv_kinds_report_stopped_in_its_second_kind_keeps_the_first(tiny_lm):
    kinds = ["dynamic", "sliding-4"]
    whole = forwards_of(tiny_lm, lambda: drift.kv_drift_report(tiny_lm, PROMPT, False, 8, kinds, 2))
    per_kind = 2 * (whole - 1) // 5  # L + 1 for the reference (run, one forward), then 2L per kind (run, forced pass)
    control = RunControl()
    at = whole - per_kind + 2  # two forwards into the second kind
    with StopAfter(tiny_lm, control, at) as counter:
        report = drift.kv_drift_report(tiny_lm, PROMPT, False, 8, kinds, 2, control=control)
    assert counter.count == at
    assert [k.kind for k in report.kinds] == ["dynamic"] and "cancelled" in report.stopped


@pytest.fixture
def shared(tiny_lm, monkeypatch) -> Shared:
    s = Shared(registry=OneModelRegistry(tiny_lm), model=None, quantization=None, user_presets=None)
    monkeypatch.setattr(s, "lm", lambda model, quantization: tiny_lm)
    return s


def test_kv_view_handler_passes_its_control_and_shows_a_partial_report(tiny_lm, shared, kv_length):
    out = view.KVOutputs("status", "summary", "chart")
    control = RunControl(deadline_s=60)
    at = 1 + kv_length + 2
    with StopAfter(tiny_lm, control, at, "time_limit") as counter:
        updates = list(view.kv_updates(out, shared, view.Measure(PROMPT, False, 24, "embedded", "none"), control))
    assert counter.count == at
    first, last = updates[0], updates[-1]
    assert first["summary"] == "" and first["chart"] is None  # the previous report is gone at once
    assert "time limit" in last["status"] and "partial report" in last["status"]
    assert "Partial report" in last["summary"] and "the 2 tokens both loops ran" in last["summary"]


def test_drift_view_handler_stops_and_shows_what_it_measured(tiny_lm, shared):
    out = view.DriftOutputs("status", "table", "kl", "texts", "download")
    measure = view.Measure(PROMPT, False, 8, "embedded")
    whole = forwards_of(tiny_lm, lambda: list(view.drift_updates(out, shared, measure, ["none"], RunControl())))
    control = RunControl()
    with StopAfter(tiny_lm, control, whole - 1) as counter:
        updates = list(view.drift_updates(out, shared, view.Measure(PROMPT, False, 8, "embedded"), ["none"], control))
    assert counter.count == whole - 1
    assert updates[0]["table"] == [] and updates[0]["kl"] is None and updates[0]["texts"] == ""
    assert updates[0]["download"] is None
    last = updates[-1]
    assert "cancelled" in last["status"] and "partial report: 0 of 1 variant(s) measured" in last["status"]
    assert last["download"].endswith(".json")  # the partial report, marked stopped


def test_kinds_view_handler_clears_first_and_marks_a_stopped_report(tiny_lm, shared):
    out = view.KindOutputs("status", "table", "memory", "per_token", "drift", "download")
    args = (out, shared, view.Measure(PROMPT, False, 6, "embedded", "none"), ["dynamic", "quantized-int8"], 16, 2)
    whole = forwards_of(tiny_lm, lambda: list(view.kinds_updates(*args, RunControl())))
    control = RunControl()
    with StopAfter(tiny_lm, control, whole - 2) as counter:
        updates = list(view.kinds_updates(*args, control))
    assert counter.count == whole - 2
    assert {k: updates[0][k] for k in ("table", "memory", "per_token", "drift", "download")} == {
        "table": [], "memory": None, "per_token": None, "drift": None, "download": None}
    assert "partial report: 1 of 2 kinds measured" in updates[-1]["status"]
    assert [r[0] for r in updates[-1]["table"]["value"]] == ["dynamic"]


# --- a real server: a cancelled API job stops its report ------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("api_name, args", [
    ("/kv_cache_report", [PROMPT, False, 256, "embedded", "none"]),
    ("/quantization_report", [PROMPT, False, 128, ["none"], "embedded"]),
])
def test_a_cancelled_report_job_stops_its_forwards(live_app, live_forwards, api_name, args):

    client = api_client(live_app)
    job = client.submit(*args, api_name=api_name)
    at_cancel, after, last = forwards_after_stop(live_forwards, job.cancel, settle_s=1.75)
    assert after - at_cancel <= 2, f"{api_name}: {after - at_cancel} forwards after the cancel"
    assert last == after, f"{api_name} ran on in the background"
