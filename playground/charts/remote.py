"""A served model's run in words (issue #29): which server, which mode, and every approximation
its trace labels (``extra["remote"]``, engine.backends). Step through, Speculative and Beam show it
under their runs."""

from __future__ import annotations

import html

from engine.numbers import percent
from engine.trace import Trace


def remote_markdown(trace: Trace | None) -> str:
    """A served model's run (``extra["remote"]``, engine.backends): which server, which mode, and
    every approximation the trace labels, on one line; "" for a model loaded here (or no run)."""
    remote = trace.extra.get("remote") if trace is not None else None
    if not remote:
        return ""
    notes = [*remote.get("approximations", []),
             *(f"{n['key']} {n['reason']}" for n in [*remote.get("unmapped", []), *remote.get("caveats", [])])]
    line = (f"**Remote model** {remote['backend']}:{remote['url']}, {remote['mode']} mode (its top {remote['top_n']} "
            f"per step). **Approximations:** " + html.escape("; ".join(notes) or "none", quote=False) + ".")
    line += verified_sentence(remote.get("verified"))
    spec = remote.get("server_speculative")
    if spec:  # llama-server drafting on its own (-md / --spec-type): its timings' counts
        line += (f" **llama-server's own speculative decoding:** drafted {spec['drafted']}, accepted "
                 f"{spec['accepted']} ({percent(spec['acceptance_rate'])}).")
    return line


def verified_sentence(verified: dict | None) -> str:
    """Step mode verifying the server's continuations (engine.backends.remote.Verified's label) in one
    sentence from its counts; "" when the run asked one token per request (or made no step)."""
    if not verified or not verified.get("steps"):
        return ""
    steps, accepted, requests = verified["steps"], verified["accepted"], verified["requests"]
    drafts = "the server's drafts of our own draws, made with our chain and our seeded generator" \
        if verified.get("drafts") == "our draws" else "the server's own greedy continuation"
    return (f" **Verified continuations:** {accepted} of {steps} tokens were {drafts} "
            f"({percent(accepted / steps)} accepted) and {steps - accepted} ours where our chain picked another; "
            f"{requests} request{'s' if requests != 1 else ''} instead of {steps}, the same tokens as one "
            f"request per token ({verified['drafted'] - steps} drafted tokens dropped).")
