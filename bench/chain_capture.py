"""The batched step's capture (``core.advance_rows``: the stage chain's records, the pick, the
StepTraces) for 16 rows of the embedded model's real next-token logits, today's path against the
path before its exact wins, interleaved in one process on one torch thread. Checks that both give
the same tokens and stage records (floats within 1e-6), then prints steps per CPU-second and the ratio.

    python -m bench.chain_capture [--rows 16] [--repeats 5]

The old path is today's code with the replaced helpers put back: ``chain.entropy_rows`` as
``torch.special.entr(p).sum(-1)`` (entr is a scalar loop on CPU) and ``sampling.mass_before`` as
``masked_fill(~before).double().sum(-1)`` (a float64 copy of [R, V]).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager, nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import report  # noqa: E402
from bench.concurrency import prompt_for  # noqa: E402
from engine import chain, sampling  # noqa: E402
from engine.backends.local import ModelSpec, load_model  # noqa: E402
from engine.cache import KVCache  # noqa: E402
from engine.config import DecodingConfig  # noqa: E402
from engine.core import RunState, advance_rows  # noqa: E402

CONFIGS = {
    "greedy": DecodingConfig(strategy="greedy", max_new_tokens=32),
    "sample T0.8 k50 p0.9": DecodingConfig(strategy="sample", seed=0, temperature=0.8, top_k=50, top_p=0.9,
                                           max_new_tokens=32),
}


def old_entropy_rows(probs: torch.Tensor) -> torch.Tensor:
    return torch.special.entr(probs).sum(dim=-1)


def old_mass_before(probs: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    return probs.masked_fill(~before, 0.0).double().sum(dim=-1)


@contextmanager
def old_path():
    """The capture as it was before the exact wins (the replaced helpers put back)."""
    saved = chain.entropy_rows, sampling.mass_before
    chain.entropy_rows, sampling.mass_before = old_entropy_rows, old_mass_before
    try:
        yield
    finally:
        chain.entropy_rows, sampling.mass_before = saved


def row_logits(lm, rows: int) -> tuple[list[list[int]], torch.Tensor]:
    """``rows`` distinct prompts and their next-token logits [rows, V] (one left-padded forward)."""
    prompts = [lm.encode(prompt_for(u), chat=False) for u in range(rows)]
    width = max(map(len, prompts))
    ids = torch.tensor([[p[0]] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return prompts, KVCache(lm.model).forward(ids, mask=mask).logits[:, -1, :].float()


def same_steps(a: list, b: list) -> None:
    """The two paths' StepTraces agree: tokens exactly, every stage record's floats within 1e-6."""
    for x, y in zip(a, b, strict=True):
        assert x.chosen_token_id == y.chosen_token_id, (x.chosen_token_id, y.chosen_token_id)
        for f in ("chosen_prob", "raw_prob", "entropy", "raw_entropy"):
            assert abs(getattr(x, f) - getattr(y, f)) <= 1e-6, f
        assert x.draw is None or abs(x.draw - y.draw) <= 1e-9
        for s, t in zip(x.stages, y.stages, strict=True):
            assert (s.name, s.kept, [p.token_id for p in s.top]) == (t.name, t.kept, [p.token_id for p in t.top])
            assert abs(s.entropy - t.entropy) <= 1e-6 and abs(s.mass_removed - t.mass_removed) <= 1e-6 \
                and abs(s.tv_distance - t.tv_distance) <= 1e-6


def timed(step, fresh, repeats: int) -> dict[str, list[float]]:
    """Steps/s of ``step(states)`` on today's path and the old one, alternating, each on states
    built by ``fresh()`` outside the clock (a step moves its states' generators and ids). The
    clock is the process's CPU time (one torch thread): on a loaded machine wall time mostly
    measures the other processes."""
    rates: dict[str, list[float]] = {"capture, today": [], "capture, before": []}
    for i in range(repeats + 1):  # the first round warms up
        for name in rates:
            states = fresh()
            with old_path() if name == "capture, before" else nullcontext():
                start = time.process_time()
                step(states)
                elapsed = time.process_time() - start
            if i:
                rates[name].append(1 / elapsed)
    return rates


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    lm = load_model(ModelSpec("embedded"))
    with torch.inference_mode():
        prompts, logits = row_logits(lm, args.rows)
        print(f"model {lm.name}, {args.rows} rows, vocabulary {logits.shape[1]}, torch threads 1, "
              f"load average {os.getloadavg()[0]:.1f}")
        for name, config in CONFIGS.items():
            def fresh() -> list[RunState]:
                return [RunState(lm, ids, config) for ids in prompts]
            with old_path():
                before = advance_rows(fresh(), logits)
            same_steps(advance_rows(fresh(), logits), before)
            rates = timed(lambda states: advance_rows(states, logits), fresh, args.repeats)
            report(f"{name}: one batched step of {args.rows} rows (rate = steps per CPU-second)", rates, baseline="capture, before")
        print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
