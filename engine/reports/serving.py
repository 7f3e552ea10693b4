"""Serving, seen from inside: what the batched scheduler did tick by tick, and what that means in
KV blocks (issue #41).

``ServingStats`` is the scheduler's flight recorder: one ``Tick`` per batched forward (rows, the
queue, each row's real length and the batch's padded width, the tokens prefilled and the time of
the prefill, the forward and the rows' step) and one ``RunRecord`` per run that ended (its time to
first token and time per output token, from the very StepTraces its user received). Two bounded
rings (``collections.deque``), one lock; recording a tick is one small record and an append
(``python -m bench.serving --overhead`` measures it against a tick), and nothing is summarised until someone
asks (``summarise``).

The arithmetic is exact and computed from the recorded lengths (no estimate):

- our batch: ``rows × width`` positions held (left padding included), ``bytes_per_position`` each;
- paged at block size B (vLLM's PagedAttention): ``Σ ceil(length / B)`` blocks, so at most B - 1
  positions of internal fragmentation per row and no padding;
- contiguous worst-case reservation (what the PagedAttention paper's figure 2 shows for earlier
  systems): each run reserves its prompt plus ``max_new_tokens`` positions the moment it starts.

Percentiles are nearest-rank (the same definition as bench/concurrency.py's ``percentile``).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

BLOCK_SIZE = 16  # vLLM's default block size on GPUs, and the PagedAttention paper's
TICKS_KEPT = 8192  # about 7 minutes of ticks at 20 per second
RUNS_KEPT = 2048
SOURCE_SCHEDULER = "measured: our scheduler"
SOURCE_COMPUTED = "computed from our scheduler's row lengths"


@dataclass(frozen=True, slots=True)
class Tick:
    """One batched decode forward of the scheduler and what came with it."""

    at: float  # wall clock (time.time()) when the tick ended
    rows: int  # rows in the decode forward
    queued: int  # runs waiting for a row after the tick
    prefilling: int  # runs whose long prompt is being prefilled chunk by chunk
    width: int  # positions of the left-padded batch (the longest row plus padding)
    lengths: tuple[int, ...]  # each row's real positions (prompt and generated tokens held)
    reserved: int  # Σ over rows of prompt + max_new_tokens: a contiguous worst-case reservation
    prefill_tokens: int  # prompt tokens fed in this tick (joiners and one chunk)
    prefill_saved: int  # prompt tokens of this tick's joiners not fed: same prompts and shared prefixes
    prefill_ms: float
    forward_ms: float  # the rows' one batched decode forward
    step_ms: float  # every row's chain, pick and StepTrace

    @property
    def ms(self) -> float:
        """What a running row waited between two of its tokens in this tick."""
        return self.prefill_ms + self.forward_ms + self.step_ms


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One run that ended, from the StepTraces its user received (``elapsed_ms``: since the run
    was submitted)."""

    at: float  # wall clock when it ended
    prompt_tokens: int
    tokens: int  # steps its user received
    ttft_ms: float | None  # the first step's elapsed_ms (queue and prefill included); None: no token
    tpot_ms: float | None  # (last - first elapsed_ms) / (tokens - 1); None below two tokens
    reason: str  # the last step's finish_reason, or why the run was dropped


@dataclass(frozen=True)
class Snapshot:
    """The rings' contents at ``taken_at`` (oldest first), restricted to a window."""

    taken_at: float
    since: float
    ticks: tuple[Tick, ...]
    runs: tuple[RunRecord, ...]
    bytes_per_position: int  # one cached position of one row: 2 × layers × kv_heads × head_dim × dtype bytes
    ticks_total: int  # ticks ever recorded (the ring keeps the last TICKS_KEPT)
    runs_total: int


class ServingStats:
    """The two rings, thread-safe: the scheduler's worker appends, any handler thread reads."""

    def __init__(self, bytes_per_position: int, ticks: int = TICKS_KEPT, runs: int = RUNS_KEPT):
        if ticks < 1 or runs < 1:
            raise ValueError(f"serving stats: ring sizes must be >= 1, got ticks={ticks}, runs={runs}")
        self.bytes_per_position = bytes_per_position
        self._lock = threading.Lock()
        self._ticks: collections.deque[Tick] = collections.deque(maxlen=ticks)
        self._runs: collections.deque[RunRecord] = collections.deque(maxlen=runs)
        self._ticks_total = self._runs_total = 0

    def add_tick(self, tick: Tick) -> None:
        with self._lock:
            self._ticks.append(tick)
            self._ticks_total += 1

    def add_run(self, run: RunRecord) -> None:
        with self._lock:
            self._runs.append(run)
            self._runs_total += 1

    def snapshot(self, window_s: float | None = None, now: float | None = None) -> Snapshot:
        """What the rings hold, the last ``window_s`` seconds only (None: all of it)."""
        now = time.time() if now is None else now
        with self._lock:
            ticks, runs = tuple(self._ticks), tuple(self._runs)
            totals = self._ticks_total, self._runs_total
        # the whole ring: the window starts at its oldest record
        since = now - window_s if window_s is not None else min([r.at for r in (ticks[:1] + runs[:1])], default=now)
        return Snapshot(now, since, tuple(t for t in ticks if t.at >= since), tuple(r for r in runs if r.at >= since),
                        self.bytes_per_position, *totals)


# --- the arithmetic ------------------------------------------------------------------------------------
def blocks(length: int, block: int = BLOCK_SIZE) -> int:
    """KV blocks of ``block`` positions one sequence of ``length`` positions needs."""
    return -(-length // block)


@dataclass(frozen=True)
class KVLayout:
    """Positions the same rows hold three ways (multiply by bytes_per_position for bytes)."""

    rows: int
    used: int  # Σ real lengths: what any exact cache must hold
    padded: int  # our left-padded batch: rows × width
    paged: int  # block × Σ ceil(length / block)
    reserved: int  # contiguous worst-case reservation: Σ (prompt + max_new_tokens)
    block: int
    bytes_per_position: int

    @property
    def paged_blocks(self) -> int:
        return self.paged // self.block

    def waste(self, held: int) -> float:
        """The share of ``held`` positions that hold no token (0 when nothing is held)."""
        return (held - self.used) / held if held else 0.0


def kv_layout(lengths: Sequence[int], width: int, reserved: int, bytes_per_position: int,
              block: int = BLOCK_SIZE) -> KVLayout:
    """The three layouts of rows with real ``lengths`` in a batch ``width`` positions wide."""
    if block < 1:
        raise ValueError(f"block: expected a block size >= 1, got {block!r}")
    used = sum(lengths)
    return KVLayout(rows=len(lengths), used=used, padded=len(lengths) * width,
                    paged=block * sum(blocks(n, block) for n in lengths), reserved=max(reserved, used), block=block,
                    bytes_per_position=bytes_per_position)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list (bench/concurrency.py's)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(round(q / 100 * len(ordered) + 0.5))))
    return ordered[rank - 1]


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, p50, p95 and max of ``values`` (None where there are none)."""
    if not values:
        return {"count": 0, "p50": None, "p95": None, "max": None}
    return {"count": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95), "max": max(values)}


# --- what the view shows -----------------------------------------------------------------------------
@dataclass
class ServingSummary:
    """A snapshot summarised: what the Serving view draws and ``bench`` prints."""

    taken_at: float
    since: float
    ticks: int
    runs: int
    mean_rows: float
    max_rows: int
    max_queued: int
    tokens_per_s: float  # rows stepped per second of the ticks' own time: the decode rate while there was work
    ttft_ms: dict
    tpot_ms: dict
    tick_ms_by_rows: dict[int, dict]  # rows -> spread of the tick's ms (prefill + forward + step)
    forward_ms_by_rows: dict[int, dict]
    peak: KVLayout | None  # the layouts at the tick holding the most positions
    kv_bytes_now: int  # the batch's bytes at the window's last tick
    series: dict = field(default_factory=dict)  # per tick: rows, queue, KV bytes three ways; per run: TTFT, TPOT


def summarise(snap: Snapshot, block: int = BLOCK_SIZE) -> ServingSummary:
    """The window's figures (exact, from the recorded ticks and runs)."""
    ticks, runs = snap.ticks, snap.runs
    ttft = [r.ttft_ms for r in runs if r.tokens and r.ttft_ms is not None]  # a run with a token has its time
    tpot = [r.tpot_ms for r in runs if r.tpot_ms is not None]
    by_rows: dict[int, list[Tick]] = collections.defaultdict(list)
    for t in ticks:
        by_rows[t.rows].append(t)
    peak_tick = max(ticks, key=lambda t: t.rows * t.width, default=None)
    peak = kv_layout(peak_tick.lengths, peak_tick.width, peak_tick.reserved, snap.bytes_per_position,
                     block) if peak_tick else None
    busy_s = sum(t.ms for t in ticks) / 1000
    return ServingSummary(
        taken_at=snap.taken_at, since=snap.since, ticks=len(ticks), runs=len(runs),
        mean_rows=sum(t.rows for t in ticks) / len(ticks) if ticks else 0.0,
        max_rows=max((t.rows for t in ticks), default=0), max_queued=max((t.queued for t in ticks), default=0),
        tokens_per_s=sum(t.rows for t in ticks) / busy_s if busy_s > 0 else 0.0, ttft_ms=spread(ttft), tpot_ms=spread(tpot),
        tick_ms_by_rows={n: spread([t.ms for t in group]) for n, group in sorted(by_rows.items())},
        forward_ms_by_rows={n: spread([t.forward_ms for t in group]) for n, group in sorted(by_rows.items())},
        peak=peak, kv_bytes_now=ticks[-1].rows * ticks[-1].width * snap.bytes_per_position if ticks else 0,
        series={"at": [t.at for t in ticks], "rows": [t.rows for t in ticks], "queued": [t.queued for t in ticks],
                "prefilling": [t.prefilling for t in ticks],
                "kv_bytes": [t.rows * t.width * snap.bytes_per_position for t in ticks],
                "paged_bytes": [block * sum(blocks(n, block) for n in t.lengths) * snap.bytes_per_position
                                for t in ticks],
                "reserved_bytes": [max(t.reserved, sum(t.lengths)) * snap.bytes_per_position for t in ticks],
                "run_at": [r.at for r in runs if r.tokens], "ttft_ms": [r.ttft_ms for r in runs if r.tokens],
                "tpot_ms": [r.tpot_ms for r in runs if r.tokens]})


def utc(at: float) -> str:
    """``at`` (time.time()) as HH:MM:SS UTC, the way every figure says when it was measured."""
    return time.strftime("%H:%M:%S", time.gmtime(at)) + " UTC"


def finite(value: float | None) -> float | None:
    """``value`` if it is a finite number, else None (the app's JSON is strict)."""
    return value if value is not None and math.isfinite(value) else None
