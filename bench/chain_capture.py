"""The batched step's capture (``core.advance_rows``: the stage chain's records, the pick, the
StepTraces) for 16 rows of the embedded model's real next-token logits, today's path against the
path before its exact wins, interleaved in one process on one torch thread. Checks that both give
the same tokens and stage records (floats within 1e-6), then prints steps per CPU-second and the ratio.

    python -m bench.chain_capture [--rows 16] [--repeats 5]

Then step mode's capture (issue #38): each row as a served model's step (its top-100 log-probabilities),
one ``RunState.advance`` per row as each user's run makes it, on the top-100's ids (``advance(values,
ids)``, as ``served.entries_row`` gives them) against the same rows over the whole vocabulary (-inf
elsewhere) with every draw over V (the path before: ``sampling.COMPACT_MOST`` = 0).

The old path is today's code with the replaced parts put back: ``chain.entropy_varentropy_rows``' entropy as
``torch.special.entr(p).sum(-1)`` (entr is a scalar loop on CPU) and every draw's race over the whole
vocabulary (``sampling.COMPACT_MOST`` = 0: V exponentials from ``exponential_``, not the race on a
truncated row's nonzero entries).
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


def old_entropy_rows(probs: torch.Tensor, varentropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The entropy as it was (entr's scalar loop), with today's varentropy beside it (the records compare equal)."""
    entropy = torch.special.entr(probs).sum(dim=-1)
    if not varentropy:
        return entropy, None
    return entropy, (probs * (probs.clamp(min=torch.finfo(torch.float32).tiny).log() + entropy[:, None]).square()).sum(-1)


@contextmanager
def old_path():
    """The capture as it was before the exact wins (the replaced parts put back)."""
    saved = chain.entropy_varentropy_rows, sampling.COMPACT_MOST
    chain.entropy_varentropy_rows, sampling.COMPACT_MOST = old_entropy_rows, 0
    try:
        yield
    finally:
        chain.entropy_varentropy_rows, sampling.COMPACT_MOST = saved


def row_logits(lm, rows: int) -> tuple[list[list[int]], torch.Tensor]:
    """``rows`` distinct prompts and their next-token logits [rows, V] (one left-padded forward)."""
    prompts = [lm.encode(prompt_for(u), chat=False) for u in range(rows)]
    width = max(map(len, prompts))
    ids = torch.tensor([[p[0]] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return prompts, KVCache(lm.model).forward(ids, mask=mask).logits[:, -1, :].float()


def same_steps(a: list, b: list, draw_tol: float = 1e-9) -> None:
    """The two paths' StepTraces agree: tokens exactly, every stage record's floats within 1e-6, the
    draws within ``draw_tol`` (1e-6 where the probabilities are summed in another order)."""
    for x, y in zip(a, b, strict=True):
        assert x.chosen_token_id == y.chosen_token_id, (x.chosen_token_id, y.chosen_token_id)
        for f in ("chosen_prob", "raw_prob", "entropy", "raw_entropy"):
            assert abs(getattr(x, f) - getattr(y, f)) <= 1e-6, f
        assert x.draw is None or abs(x.draw - y.draw) <= draw_tol
        for s, t in zip(x.stages, y.stages, strict=True):
            assert (s.name, s.kept, [p.token_id for p in s.top]) == (t.name, t.kept, [p.token_id for p in t.top])
            assert abs(s.entropy - t.entropy) <= 1e-6 and abs(s.mass_removed - t.mass_removed) <= 1e-6 \
                and abs(s.tv_distance - t.tv_distance) <= 1e-6


def step_rows(logits: torch.Tensor, top: int = 100) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each row as step mode builds it from a server's top-``top`` (``served.entries_row``): the
    log-probabilities at the ids [1, top] and the ids (ascending); and over the vocabulary [1, V], -inf
    elsewhere (``served.entries_logits``, the path before)."""
    out = []
    for row in torch.log_softmax(logits, dim=-1):
        ids = torch.sort(torch.topk(row, top).indices).values
        built = torch.full((1, row.shape[0]), float("-inf"))
        built[0, ids] = row[ids]
        out.append((row[ids][None], ids, built))
    return out


@contextmanager
def over_vocabulary():
    """Step mode's capture before the support: the records and every draw over V."""
    saved = sampling.COMPACT_MOST
    sampling.COMPACT_MOST = 0
    try:
        yield
    finally:
        sampling.COMPACT_MOST = saved


def timed(step, fresh, repeats: int, before_step=None) -> dict[str, list[float]]:
    """Steps/s of ``step(states)`` on today's path and the old one (``step`` under ``old_path``, or
    ``before_step``), alternating, each on states built by ``fresh()`` outside the clock (a step moves
    its states' generators and ids). The clock is the process's CPU time (one torch thread): on a
    loaded machine wall time mostly measures the other processes."""
    rates: dict[str, list[float]] = {"capture, today": [], "capture, before": []}
    for i in range(repeats + 1):  # the first round warms up
        for name in rates:
            states = fresh()
            old = name == "capture, before"
            with old_path() if old and before_step is None else nullcontext():
                start = time.process_time()
                (before_step if old and before_step is not None else step)(states)
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
        rows = step_rows(logits)
        for name, config in CONFIGS.items():
            def fresh() -> list[RunState]:
                return [RunState(lm, ids, config) for ids in prompts]

            def today(states: list[RunState]) -> list:
                return [s.advance(values, ids) for s, (values, ids, _) in zip(states, rows)]

            def before(states: list[RunState]) -> list:
                with over_vocabulary():
                    return [s.advance(row) for s, (_, _, row) in zip(states, rows)]

            same_steps(today(fresh()), before(fresh()), draw_tol=1e-6)
            rates = timed(today, fresh, args.repeats, before)
            report(f"{name}: step mode, one step of each of {args.rows} users on a served model's top-100 "
                   "(rate = steps per CPU-second)", rates, baseline="capture, before")
        print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
