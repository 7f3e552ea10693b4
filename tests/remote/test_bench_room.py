"""bench.room's side-by-side run (issue #38): its arguments are checked in one line, its ratios are
the table's own numbers, and a run through a real app process against a real llama-server measures
the app's and the server's CPU per token in each mode."""

from __future__ import annotations

import os
import tempfile

import pytest

from bench.room import EngineRow, parse_list, ratio_lines


def row(engine: str, mode: str, users: int, tokens: int, wall_s: float) -> EngineRow:
    return EngineRow(engine, mode, users, tokens, wall_s, None, None, [], [])


@pytest.mark.parametrize("name,text,allowed,says", [
    ("--engines", "local,foo", ("local", "llamacpp", "vllm"),
     "--engines: expected some of local, llamacpp, vllm, got 'local,foo'"),
    ("--engines", "", ("local",), "--engines: expected some of local, got ''"),
    ("--users-list", "1,99", None, "--users-list: expected counts from 1 to 64, got '1,99'"),
    ("--users-list", "1,x", None, "--users-list: expected counts like 1,16, got '1,x'"),
])
def test_a_bad_list_is_one_line_naming_its_argument(name, text, allowed, says):
    with pytest.raises(SystemExit) as info:
        parse_list(name, text, allowed)
    assert str(info.value) == says
    assert parse_list("--users-list", " 1, 16 ") == [1, 16]
    assert parse_list("--engines", "vllm,local", ("local", "vllm")) == ["vllm", "local"]


def test_the_ratios_are_the_tables_own_numbers():
    rows = [row("local", "step", 1, 32, 1.0), row("vLLM's own API", "its sampler", 1, 32, 0.5),
            row("local", "step", 16, 512, 8.0), row("vLLM's own API", "its sampler", 16, 512, 1.6),
            row("vllm", "step", 16, 512, 16.0), row("vllm", "fast", 16, 512, 4.0)]
    assert [r.tokens_per_s for r in rows] == [32.0, 64.0, 64.0, 320.0, 32.0, 128.0]
    assert ratio_lines(rows) == ["1 user(s): local engine (full traces) / vLLM's own API = 0.50x",
                                 "16 user(s): local engine (full traces) / vLLM's own API = 0.20x",
                                 "16 user(s): vllm step mode / fast mode = 0.25x"]
    assert row("local", "step", 1, 30, 1.5).cells() == "| local | step | 1 | 20.0 | – | – | – | – |"


@pytest.mark.remote
@pytest.mark.slow
def test_the_app_in_its_own_process_on_llama_server_step_and_fast(llama_server):
    """The same room run on the embedded model and on the real llama-server in both modes, through
    ``python app.py`` in its own process: every user gets its tokens, and the CPU columns are the
    app's process and the server's (step mode asks the server once per token: more server CPU per
    token than fast mode's one streamed request)."""
    import psutil

    from bench.concurrency import app_clients
    from bench.room import app_process, engine_row
    from bench.step_verify import server_processes

    pick = f"llamacpp:{llama_server}"
    app, url = app_process(pick, os.path.join(tempfile.gettempdir(), "test-bench-room-app.log"))
    try:
        clients, processes = app_clients(url, 2), [psutil.Process(app.pid)]
        server = server_processes(llama_server)
        assert server, "the llama-server's process is found by its port"
        rows = [engine_row(url, "local", "embedded", "step", 2, 6, clients, processes, [], 300),
                engine_row(url, "llamacpp", pick, "step", 2, 6, clients, processes, server, 300),
                engine_row(url, "llamacpp", pick, "fast", 2, 6, clients, processes, server, 300)]
    finally:
        app.terminate()
        app.wait(30)
    for r in rows:
        assert r.tokens == 12 and r.wall_s > 0 and r.app_cpu_s > 0 and len(r.ttft) == len(r.tpot) == 2, r
    local, step, fast = rows
    assert local.server_cpu_s is None and step.server_cpu_s > 0 and fast.server_cpu_s > 0
    assert f"| llamacpp | fast | 2 | {fast.tokens_per_s:.1f} |" in fast.cells()
    says = f"2 user(s): llamacpp step mode / fast mode = {step.tokens_per_s / fast.tokens_per_s:.2f}x"
    assert ratio_lines(rows) == [says]
