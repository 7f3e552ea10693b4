"""The batched scheduler: many users' greedy and sampling runs advance together, one forward per tick.

Small models are dispatch-bound: one forward over 16 sequences costs little more than one over a
single sequence. So a ``Scheduler`` per loaded model keeps every active run as one row of a batched
KV cache (an ``engine.cache.KVCache`` with left-padded rows, the class a solo run uses) and, each
tick (continuous batching: runs join and leave at any tick):

1. drops rows whose run was cancelled, timed out or whose consumer went away;
2. prefills the joiners, shortest prompts first, in groups of similar length (one forward per
   group, left-padded like the batch; ``length_groups``), merges their KV into the batch and hands
   out each group's first tokens at once (runs that arrived meanwhile join the same way, up to
   ``max_batch``; runs with the same prompt are prefilled once and get copies of its KV rows, and
   joiners whose prompts begin alike feed that shared prefix once: ``shared_prefix``), so a
   newcomer never waits for the running rows' forward nor for a long prompt. A prompt longer than
   ``prefill_chunk`` tokens is prefilled in chunks instead, one chunk per tick between the decode
   forwards (chunked prefill), so the running rows keep getting tokens while it is read;
3. runs ONE forward of the next token of every row (left padding, attention mask [B, L], per-row
   position ids; a running sequence is never prefilled again);
4. steps every row with its own stage chain, pick (its own ``torch.Generator``) and stop rules:
   ``core.advance_rows``, the loop body whose one-row case (``RunState.advance``) ``decode.stream``
   runs, with the stage statistics, argmax and draw intervals computed on [B, V]; each
   StepTrace goes to its run's stream. Finished rows leave; left padding shared by all is trimmed.

A stage may compute ahead, off this thread (``Stage.prepare`` / ``ready``: the grammar's mask, in
its own pool, engine/stages/grammar.py): after each pick the row's stages start their next step's
work, which runs beside the next forward. A row whose stages are not ready when its logits come
keeps them and skips ticks ("parked"): its position in each forward meanwhile is masked out (a hole
no attention reads, no position counts), and it steps with its kept logits at the first tick its
stages are ready, so its trace is the same; the other rows never wait for it. When every row is
parked the worker waits ``PARK_POLL_S`` instead of forwarding.

Every run's StepTraces equal ``decode.stream(lm, prompt_ids, config, prefix=, force=)``'s: the same
tokens and stage top lists, probabilities within float tolerance (a batched matmul may round
differently from a batch of one; ~1e-6 in float32). Nothing of one run reaches another: each row
has its own token row, chain, generator and KV row, and attention never crosses rows.

Limits (environment variables, read when the scheduler is created):

- ``DP_MAX_BATCH``: rows stepped in one forward (default 16 on CPU, 32 on GPU). Runs past it wait.
- ``DP_MAX_QUEUE``: runs that may wait for a row (default 256). Past it ``stream`` raises
  ``SchedulerFull``.
- ``DP_PREFILL_CHUNK``: prompt tokens prefilled per tick for a long prompt (default 256; 0: a prompt
  is prefilled in one forward whatever its length).
- ``DP_PRESENTER_SHARE``: while a presenter's run is in the batch, the room's rows are forwarded
  every this many ticks (default 4; 1: every tick). See "A presenter's rows" below.

A presenter's rows (``RunControl.priority``, issue #52): a presenter's run jumps the queue, may take
the row kept for it (``presenter_rows``), and is a row of a second, small batch with its own KV
cache (``_front``), forwarded every tick before the room's. While that batch holds a row, the room's
batch is forwarded only every ``presenter_share``-th tick, so the presenter's token costs a forward
of its own few rows plus a share of the room's, not the room's whole forward every time. The room
keeps going (it still gets a forward every ``presenter_share`` ticks, and every tick once the
presenter's runs end); a row that skips a tick is only later, never different: its state, generator
and KV row wait unchanged, as a parked row's do.

Every tick and every run that ends is recorded in ``serving`` (engine.reports.serving.ServingStats:
two bounded rings) for the Serving view: rows, queue, row lengths, prefill, forward and step times,
each run's time to first token and per output token.

One worker thread per scheduler, started when a run arrives and ended when none is left (so an idle
scheduler holds no thread and, through a weak reference, does not keep its model alive). A new worker
waits ``GATHER_S`` (20 ms) first, so runs sent together share its first prefill. Errors in
the worker go to the affected runs' streams as exceptions; the worker carries on with the others.
Models whose cache is not a plain full-attention ``DynamicCache`` (sliding-window layers...) are
stepped one row at a time (``max_batch`` 1), still through the same queue.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from typing import Iterator, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.base.seam import Model
from engine.cache import KVCache, kv_quant, left_padded
from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.core import RunState, advance_rows, check_prompt
from engine.base.measures import common_prefix
from engine.reports.serving import RunRecord, ServingStats, Tick
from engine.settings import env_int
from engine.threads import step_threads
from engine.trace import StageTrace, StepTrace

DEFAULT_MAX_BATCH_CPU = 16
DEFAULT_MAX_BATCH_GPU = 32
DEFAULT_MAX_QUEUE = 256
# Rows the app's schedulers (``Schedulers``) keep for a presenter's runs (``RunControl.priority``,
# issue #52): the room's runs fill at most max_batch - PRESENTER_ROWS rows, so a presenter's run
# joins at the next tick however full the room (none kept on a scheduler of one row).
PRESENTER_ROWS = 1
# While a presenter's run is in the batch the room's rows are forwarded every this many ticks
# (DP_PRESENTER_SHARE): on the 2-core CPU a forward of 16 rows costs ~1.6x one of a single row
# (docs/performance.md, bench.token_split: 3.23 ms a token at 16 rows, 32.0 ms at one), so with the
# room's steps every 4th tick keeps the presenter's lesson near 1.5x its time alone (bench.presenter_priority).
DEFAULT_PRESENTER_SHARE = 4
DEFAULT_PREFILL_CHUNK = 256
# Joiners prefilled together share a common prompt prefix's forward once it is this long (shorter
# ones cost less than the extra forward that feeding the prefix alone takes).
MIN_SHARED_PREFIX = 16
PAD_SLACK = 2.0  # joiners prefilled together may hold at most this many times their real tokens
# An idle scheduler's worker waits this long before its first prefill, so runs sent together (a
# Compare's lanes start in threads a few ms apart) share one prefill instead of the first going alone.
GATHER_S = 0.02
# How long a worker whose rows all wait for their stages (``_Run.parked``) sleeps before it looks again:
# a mask is a few ms at most, so a short wait; the worker holds no lock meanwhile.
PARK_POLL_S = 0.002


class SchedulerFull(RuntimeError):
    """Too many runs are waiting for a row (``DP_MAX_QUEUE``)."""


def env_limit(name: str, default: int, minimum: int) -> int:
    """An integer limit from the environment (engine.settings.env_int: unset or empty means
    ``default``; a bad value raises SettingsError, a ValueError, naming the variable and value)."""
    return env_int(name, default, minimum)


def default_max_batch(device: torch.device) -> int:
    default = DEFAULT_MAX_BATCH_GPU if device.type == "cuda" else DEFAULT_MAX_BATCH_CPU
    return env_limit("DP_MAX_BATCH", default, 1)


def default_prefill_chunk() -> int:
    """Prompt tokens prefilled per tick for a long prompt: env ``DP_PREFILL_CHUNK`` (0: no chunking)."""
    return env_limit("DP_PREFILL_CHUNK", DEFAULT_PREFILL_CHUNK, 0)


def default_presenter_share() -> int:
    """Ticks per room forward while a presenter's run is in the batch: env ``DP_PRESENTER_SHARE`` (>= 1)."""
    return env_limit("DP_PRESENTER_SHARE", DEFAULT_PRESENTER_SHARE, 1)


def bytes_per_position(lm: Model) -> int:
    """Bytes one cached position of one row holds in a full-precision cache: 2 (K and V) × layers ×
    KV heads × head dim × the model's bytes per element."""
    geo = kv_quant.geometry(lm.model.config, lm.dtype)
    return geo.values_per_position * geo.bytes_per_element


def batchable(lm: Model) -> bool:
    """Whether the model's KV cache is made of plain full-attention layers, whose rows can be padded
    and stacked. (Sliding-window and linear-attention layers cannot; those run one row at a time.)"""
    layers = DynamicCache(config=lm.model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


# --- one run -----------------------------------------------------------------------------------------
class _Run:
    """One user's run: its ``RunState`` (chain, generator, stop rules, token row) plus its control
    and output queue. Built in the caller's thread (so config errors raise there); stepped by the worker."""

    def __init__(self, lm: Model, prompt_ids: Sequence[int], config: DecodingConfig,
                 prefix: Sequence[int], force: int | None, control: RunControl | None,
                 resume: Sequence[StageTrace] | None = None):
        self.lm, self.control = lm, control
        self.front = control is not None and control.priority  # a presenter's: a row of the scheduler's ``_front``
        self.state = RunState(lm, prompt_ids, config, prefix=prefix, force=force, resume=resume)
        self.sequence = self.state.sequence  # what the prefill feeds
        self.out: queue.SimpleQueue = queue.SimpleQueue()  # StepTrace | BaseException
        self.closed = False  # the consumer went away
        self.steps, self.last_ms = 0, 0.0  # what its user received (for ServingStats)
        self.first_ms: float | None = None
        self.chunk_kv: KVCache | None = None  # its own cache while a long prompt is prefilled in chunks
        self.fed = 0  # prompt positions that cache holds
        self.parked: torch.Tensor | None = None  # its logits [1, V] while its stages are not ready
        if not self.state.needs_replay:
            prepare(self)  # its first step's stage work (the grammar's first mask) runs while it waits and prefills

    def record(self, reason: str) -> RunRecord:
        """What the run's user received, as the Serving view's record of it."""
        first = self.first_ms
        tpot = (self.last_ms - first) / (self.steps - 1) if self.steps > 1 and first is not None else None
        return RunRecord(time.time(), self.state.prompt_length, self.steps, self.first_ms, tpot, reason)

    @property
    def last_token(self) -> int:
        return self.state.last_token

    def stopped(self) -> RunStopped | None:
        """Why the worker should drop this run now (None: keep it). A closed consumer needs no
        message; a cancelled or timed-out control gets its RunStopped."""
        if self.closed:
            return RunStopped("cancelled", "stopped: the consumer went away")
        if self.control is not None:
            try:
                self.control.check()
            except RunStopped as stop:
                return stop
        return None


def prepare(run: _Run) -> None:
    """Start the run's stages' work for its next step (``Stage.prepare``), off the worker's thread."""
    for stage in run.state.chain.stages:
        stage.prepare(run.state.ids)


def ready(run: _Run) -> bool:
    """Whether the run's stages can step it at once (``Stage.ready``)."""
    return all(stage.ready() for stage in run.state.chain.stages)


# --- the batched KV cache ------------------------------------------------------------------------------
class _Batch:
    """The active rows: one ``KVCache`` whose rows are left-padded (its mask says where) and the
    runs in row order."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kv: KVCache | None = None
        self.runs: list[_Run] = []

    @property
    def cache(self) -> KVCache:
        """The rows' cache (RuntimeError while the batch holds no row)."""
        if self.kv is None:
            raise RuntimeError("scheduler: the batch holds no rows")
        return self.kv

    def forward(self) -> torch.Tensor:
        """Feed every row's last token, a parked row's masked out (it has no new token yet: its
        position is a hole); returns the next-token logits [B, V] in float32 (a parked row's: unused)."""
        ids = torch.tensor([[run.last_token] for run in self.runs], dtype=torch.long, device=self.device)  # [B, 1]
        parked = [run.parked is not None for run in self.runs]
        mask = torch.tensor([[int(not p)] for p in parked], dtype=torch.long, device=self.device) if any(parked) \
            else None  # [B, 1]
        return self.cache.forward(ids, mask=mask).logits[:, -1, :].float()

    def add(self, runs: list[_Run], kv: KVCache) -> None:
        """Append prefilled runs (``kv`` holds their rows) as the last rows."""
        if not self.runs:
            self.kv, self.runs = kv, list(runs)
            return
        self.cache.append_rows(kv)
        self.runs.extend(runs)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices, in order) and trim the left padding they all share."""
        if not rows:
            self.kv, self.runs = None, []
            return
        self.cache.keep_rows(rows)
        self.runs = [self.runs[i] for i in rows]


def length_groups(runs: list[_Run], slack: float = PAD_SLACK) -> list[list[_Run]]:
    """The runs sorted by prompt length (shortest first) and cut into groups prefilled together:
    a group grows while its padded size (count x longest) stays within ``slack`` x its real tokens."""
    groups: list[list[_Run]] = []
    real = 0
    for run in sorted(runs, key=lambda r: len(r.sequence)):
        n = len(run.sequence)
        if groups and n * (len(groups[-1]) + 1) <= slack * (real + n):
            groups[-1].append(run)
            real += n
        else:
            groups.append([run])
            real = n
    return groups


def shared_prefix(sequences: Sequence[Sequence[int]], minimum: int = MIN_SHARED_PREFIX) -> int:
    """Positions every one of ``sequences`` begins with, leaving each at least one position of its
    own (its next-token logits come from it); 0 for fewer than two sequences or below ``minimum``."""
    if len(sequences) < 2:
        return 0
    shared = min(common_prefix(sequences[0], other) for other in sequences[1:])
    shared = min(shared, min(len(s) for s in sequences) - 1)
    return shared if shared >= minimum else 0


def distinct_sequences(runs: list[_Run]) -> tuple[list[_Run], list[int]]:
    """The first run of each distinct sequence, and for every run the index of its sequence among
    them. Runs with the same prompt (a Compare's lanes, its seed sweep, a room on one lesson's
    prompt) are prefilled once: their rows would be the same computation."""
    fed: list[_Run] = []
    index: dict[tuple[int, ...], int] = {}
    rows = []
    for run in runs:
        key = tuple(run.sequence)
        if key not in index:
            index[key] = len(fed)
            fed.append(run)
        rows.append(index[key])
    return fed, rows


def _priority(run: _Run) -> bool:
    """Whether ``run`` is a presenter's (its control said so when it was sent): it goes first, may
    take a kept row, and is a row of the presenter's batch."""
    return run.front


# --- the scheduler ---------------------------------------------------------------------------------------
class Scheduler:
    """Steps many runs of one model in one batched forward per tick. Thread-safe: any number of
    handler threads may call ``stream`` at once. Holds its model only weakly."""

    def __init__(self, lm: Model, *, max_batch: int | None = None, max_queue: int | None = None,
                 prefill_chunk: int | None = None, share_prefix: bool = True, presenter_rows: int = 0,
                 presenter_share: int | None = None):
        self._model = weakref.ref(lm)
        self.device = lm.device
        self.max_batch = max_batch if max_batch is not None else default_max_batch(lm.device)
        self.max_queue = max_queue if max_queue is not None else env_limit("DP_MAX_QUEUE", DEFAULT_MAX_QUEUE, 0)
        self.prefill_chunk = prefill_chunk if prefill_chunk is not None else default_prefill_chunk()
        self.share_prefix = share_prefix  # joiners' common prompt prefix fed once (``_feed``)
        if not batchable(lm):
            self.max_batch = 1
        # rows kept for a presenter's runs (PRESENTER_ROWS on the app's schedulers; a private one keeps none)
        self.presenter_rows = min(presenter_rows, self.max_batch - 1)
        # ticks per forward of the room's rows while a presenter's run is in the batch
        self.presenter_share = presenter_share if presenter_share is not None else default_presenter_share()
        if self.max_batch < 1 or self.max_queue < 0 or self.prefill_chunk < 0 or presenter_rows < 0:
            raise ValueError(f"scheduler: max_batch must be >= 1, max_queue, prefill_chunk and presenter_rows >= 0, "
                             f"got {self.max_batch}, {self.max_queue}, {self.prefill_chunk}, {presenter_rows}")
        if self.presenter_share < 1:
            raise ValueError(f"scheduler: presenter_share must be >= 1, got {self.presenter_share}")
        self.serving = ServingStats(bytes_per_position(lm))  # every tick and ended run, for the Serving view
        self._lock = threading.Lock()
        self._waiting: list[_Run] = []
        self._batch = _Batch(lm.device)  # the room's rows
        self._front = _Batch(lm.device)  # a presenter's rows (``_priority``), forwarded every tick
        self._front_ticks = 0  # ticks with a presenter's row (the room's rows go every presenter_share-th)
        self._room_beside = 0  # of those, ticks that forwarded the room's rows too
        self._chunking: list[_Run] = []  # long prompts being prefilled, a chunk per tick (worker only)
        self._tick_fed = self._tick_saved = 0  # prompt tokens fed / not fed thanks to sharing, this tick
        self._worker: threading.Thread | None = None
        self._active = 0
        self._ticks = 0
        self._rows_stepped = 0
        self._closing = False
        self._held = False  # ``gathered``: submitted runs wait for the block's end
        _ALL.add(self)

    def stream(self, prompt_ids: Sequence[int], config: DecodingConfig, *, prefix: Sequence[int] = (),
               force: int | None = None, control: RunControl | None = None,
               resume: Sequence[StageTrace] | None = None) -> Iterator[StepTrace]:
        """Yield what ``decode.stream(lm, prompt_ids, config, prefix=prefix, force=force, resume=resume)`` yields,
        computed in shared forwards. Raises SchedulerFull when the queue is full, RunStopped when
        ``control`` is cancelled or past its limit. Closing the generator frees the row."""
        check_prompt(prompt_ids)
        if config.strategy not in ("greedy", "sample"):
            raise ValueError(f"strategy: the scheduler runs greedy and sample runs, got {config.strategy!r}")
        lm = self._model()
        if lm is None:
            raise RuntimeError("scheduler: its model was unloaded; load it again")
        run = _Run(lm, prompt_ids, config, prefix, force, control, resume)
        self._submit(run)
        try:
            while True:
                item = run.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            run.closed = True  # the worker drops the row at its next tick

    def stats(self) -> dict:
        """Active runs (rows and long prompts being prefilled), queued runs, ticks (batched
        forwards) and the mean rows per tick, with the limits; ``presenter_ticks``: ticks that
        forwarded a presenter's rows, ``room_beside_presenter``: those that forwarded the room's too."""
        with self._lock:
            return {"active": self._active, "queued": len(self._waiting), "ticks": self._ticks,
                    "mean_batch": self._rows_stepped / self._ticks if self._ticks else 0.0,
                    "presenter_ticks": self._front_ticks, "room_beside_presenter": self._room_beside,
                    "max_batch": self.max_batch, "max_queue": self.max_queue, "prefill_chunk": self.prefill_chunk}

    def close(self, timeout: float = 5.0) -> None:
        """Fail every run still here and wait (up to ``timeout`` s) for the worker to end. Called at
        interpreter exit, so the worker is never killed in the middle of a forward."""
        with self._lock:
            self._closing = True
            worker = self._worker
        if worker is not None:
            worker.join(timeout)

    def _rows(self) -> list[_Run]:
        """Every run holding a row: the presenter's batch's, then the room's."""
        return self._front.runs + self._batch.runs

    def _batch_of(self, run: _Run) -> _Batch:
        return self._front if _priority(run) else self._batch

    def _reset(self) -> None:
        """Forget every row (their runs were failed by the caller)."""
        self._batch, self._front, self._chunking = _Batch(self.device), _Batch(self.device), []

    def _submit(self, run: _Run) -> None:
        with self._lock:
            if self._closing:
                raise RuntimeError("scheduler: the server is shutting down")
            if not _priority(run) and self._active + len(self._waiting) >= self.max_batch + self.max_queue:
                raise SchedulerFull(
                    f"scheduler: the queue is full ({len(self._waiting)} runs waiting, {self._active} running, "
                    f"limit DP_MAX_QUEUE={self.max_queue}); try again in a moment")
            if _priority(run):  # a presenter's run goes before the room's, after earlier presenters'
                place = next((i for i, r in enumerate(self._waiting) if not _priority(r)), len(self._waiting))
                self._waiting.insert(place, run)
            else:
                self._waiting.append(run)
            if self._worker is None and not self._held:
                self._start_worker()

    def settle(self, timeout_s: float = 30.0) -> bool:
        """Wait until the worker has ended (True) or ``timeout_s`` passed (False). A run's last token
        goes to its stream before its tick is recorded in ``serving``; a report that reads the ticks
        after its runs' last tokens settles first, or it can miss the last tick."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._worker is None:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)

    def _start_worker(self) -> None:
        """Start the worker (the lock held by the caller)."""
        self._worker = threading.Thread(target=self._work, name="dp-scheduler", daemon=True)
        self._worker.start()

    @contextlib.contextmanager
    def gathered(self, count: int, timeout_s: float = 30.0) -> Iterator[None]:
        """Runs submitted in the block start together: on leaving it the worker waits until ``count``
        runs wait (``timeout_s`` at most), so they join in one tick and share one prefill, whatever
        the threads' timing (the serving demonstrations' "sent at once"; GATHER_S alone is a
        window that a loaded machine's threads can miss)."""
        with self._lock:
            self._held = True
        try:
            yield
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                with self._lock:
                    if len(self._waiting) >= count:
                        break
                time.sleep(0.005)
        finally:
            with self._lock:
                self._held = False
                if self._waiting and self._worker is None and not self._closing:
                    self._start_worker()

    def _work(self) -> None:
        """The worker: tick while any run is active or waiting, then end (a new run starts a new one)."""
        time.sleep(GATHER_S)
        with torch.inference_mode():
            while True:
                with self._lock:
                    self._waiting = [run for run in self._waiting if self._still_wanted(run)]  # cancelled in line
                    free = self.max_batch - len(self._rows()) - len(self._chunking)
                    joiners = self._admit(free)
                    if self._closing:
                        self._fail(self._rows() + self._chunking + joiners + self._waiting,
                                   RuntimeError("scheduler: the server is shutting down"))
                        self._reset()
                        self._waiting, joiners = [], []
                    if not joiners and not self._rows() and not self._chunking:
                        self._worker, self._active = None, 0
                        return
                try:
                    self._tick(joiners)
                except BaseException as exc:  # noqa: BLE001 (a bug here must reach the users, not kill the worker)
                    self._fail(self._rows() + self._chunking + joiners, exc)
                    self._reset()
                with self._lock:
                    self._active = len(self._rows()) + len(self._chunking)

    def _tick(self, joiners: list[_Run]) -> None:
        """Drop stopped rows; prefill the joiners and hand out their first token (runs that arrived
        meanwhile join too, up to ``max_batch``) and feed one chunk of a long prompt; then, for each
        batch due this tick (``_due``: the presenter's, and the room's), one batched forward of its
        rows, the runs that arrived during it, and each row's step. Joiners go first so a newcomer's
        first token never waits for both a forward and a capture of the rows already running. The
        tick goes to ``serving``."""
        for batch in (self._front, self._batch):
            self._drop(batch, [i for i, run in enumerate(batch.runs) if not self._still_wanted(run)])
        self._tick_fed = self._tick_saved = 0
        started = time.perf_counter()
        while joiners:
            self._join([run for run in joiners if self._still_wanted(run)])
            joiners = self._take_waiting()
        self._feed_chunk()
        self._unpark()
        prefill_s, forward_s, step_s = time.perf_counter() - started, 0.0, 0.0
        due = self._due()
        if not due:
            if self._rows():  # every row waits for its stages: no forward until one is ready
                time.sleep(PARK_POLL_S)
            return
        stepped: list[_Run] = []
        lengths: list[int] = []
        width = 0
        for batch in due:
            rows = list(batch.runs)
            live = [i for i, run in enumerate(rows) if run.parked is None]
            running = [rows[i] for i in live]
            began = time.perf_counter()
            with step_threads(batch.device, len(rows)):
                logits = batch.forward()  # [B, V]
            if len(live) < len(rows):
                logits = logits[live]  # [R, V]: the rows that step
            forwarded = time.perf_counter()
            lengths += [run.state.ids.shape[1] for run in running]  # real positions each row holds now
            width = max(width, batch.cache.length)
            # Runs that arrived during the forward get their first token before the rows' capture,
            # so a newcomer waits at most one forward or one capture, not both.
            for late in iter(self._take_waiting, []):
                self._join([run for run in late if self._still_wanted(run)])
            joined = time.perf_counter()
            with step_threads(batch.device, len(running)):
                self._step(running, logits)
            stepped += running
            prefill_s += joined - forwarded
            forward_s += forwarded - began
            step_s += time.perf_counter() - joined
        self._record_tick(stepped, tuple(lengths), width, prefill_s=prefill_s, forward_s=forward_s, step_s=step_s)

    def _due(self) -> list[_Batch]:
        """The batches forwarded this tick, each with a row to step: the presenter's every tick; the
        room's every tick while the presenter's has none to step, else every ``presenter_share``-th."""
        front, room = (any(run.parked is None for run in b.runs) for b in (self._front, self._batch))
        if not front:
            return [self._batch] if room else []
        with self._lock:
            self._front_ticks += 1
            if not room or self._front_ticks % self.presenter_share:
                return [self._front]
            self._room_beside += 1
        return [self._front, self._batch]

    def _record_tick(self, running: list[_Run], lengths: tuple[int, ...], width: int, *, prefill_s: float,
                     forward_s: float, step_s: float) -> None:
        reserved = sum(run.state.prompt_length + run.state.config.max_new_tokens for run in running)
        with self._lock:
            self._ticks += 1
            self._rows_stepped += len(running)
            queued = len(self._waiting)
        self.serving.add_tick(Tick(time.time(), len(running), queued, len(self._chunking), width, lengths, reserved,
                                   self._tick_fed, self._tick_saved, prefill_s * 1000, forward_s * 1000,
                                   step_s * 1000))

    def _join(self, joiners: list[_Run]) -> None:
        """Prefill the joiners and step their first token, shortest prompts first, in groups of
        similar length (``length_groups``: one long prompt neither pads the short ones to its length
        nor holds back their first token); branches of stateful chains alone, with their replay;
        prompts longer than ``prefill_chunk`` go to the chunked prefill (``_feed_chunk``)."""
        chunked = [run for run in joiners if self._chunked(run)]
        for run in chunked:
            run.chunk_kv = KVCache(run.lm.model)
        self._chunking.extend(chunked)
        self._chunking.sort(key=lambda run: not _priority(run))  # a presenter's long prompt is fed first
        joiners = [run for run in joiners if run.chunk_kv is None]
        groups = [group for front in (True, False)  # a presenter's runs join their own batch
                  for group in length_groups([run for run in joiners if not run.state.needs_replay
                                              and _priority(run) == front])]
        groups += [[run] for run in joiners if run.state.needs_replay]
        for group in groups:
            runs, logits = self._prefill(group, replay=group[0].state.needs_replay)
            if runs and logits is not None:
                self._step(runs, logits)

    def _chunked(self, run: _Run) -> bool:
        return 0 < self.prefill_chunk < len(run.sequence) and not run.state.needs_replay

    def _feed_chunk(self) -> None:
        """Feed the next ``prefill_chunk`` tokens of the oldest long prompt into its own cache (all
        that is left when no row is decoding: nobody waits for it); once the whole prompt is in,
        its run joins the batch as its last row with its first token."""
        self._chunking = [run for run in self._chunking if self._still_wanted(run)]
        if not self._chunking:
            return
        run = self._chunking[0]
        size = self.prefill_chunk if self._rows() else len(run.sequence) - run.fed
        piece = run.sequence[run.fed:run.fed + size]
        kv = run.chunk_kv
        try:
            if kv is None:
                raise RuntimeError("scheduler: a chunked prompt without its cache")
            ids = torch.tensor([piece], dtype=torch.long, device=self.device)  # [1, C]
            logits = kv.forward(ids).logits[:, -1, :].float()  # [1, V]
        except Exception as exc:  # noqa: BLE001 (that run fails; the rows go on)
            self._chunking.pop(0)
            self._fail([run], exc)
            return
        run.fed += len(piece)
        self._tick_fed += len(piece)
        if run.fed == len(run.sequence):
            self._chunking.pop(0)
            self._batch_of(run).add([run], kv)
            run.chunk_kv = None
            self._step([run], logits)

    def _unpark(self) -> None:
        """Step the parked rows whose stages are ready now (a grammar's mask done, or past its
        budget: that step ends its run with one line), with the logits they kept, so their next
        token is in this tick's forward."""
        due = [(run, parked) for run in self._rows() if (parked := run.parked) is not None and ready(run)]
        if due:
            logits = torch.cat([parked for _, parked in due])  # [D, V]
            for run, _ in due:
                run.parked = None
            self._step([run for run, _ in due], logits)

    def _take_waiting(self) -> list[_Run]:
        """Runs that arrived while the last joiners were prefilled, as many as there are free rows."""
        with self._lock:
            if self._closing:
                return []
            free = max(self.max_batch - len(self._rows()) - len(self._chunking), 0)
            return self._admit(free)

    def _admit(self, free: int) -> list[_Run]:
        """Take the waiting runs that get one of ``free`` rows (the lock held by the caller), in line
        order: a presenter's run any free row, the room's only rows outside the ``presenter_rows`` kept."""
        room = self.max_batch - self.presenter_rows - sum(not _priority(r) for r in self._rows() + self._chunking)
        joiners: list[_Run] = []
        left: list[_Run] = []
        for run in self._waiting:
            if len(joiners) < free and (_priority(run) or room > 0):
                joiners.append(run)
                room -= not _priority(run)
            else:
                left.append(run)
        self._waiting = left
        return joiners

    def _step(self, runs: list[_Run], logits: torch.Tensor) -> None:
        """Each run's own step on its row of ``logits`` [R, V] (``core.advance_rows``: the batched
        capture, equal to each row's ``RunState.advance``); a run whose stages are not ready keeps
        its row and is parked instead (``_unpark`` steps it). Finished and failed runs leave the
        batch (and are recorded in ``serving``); the others' stages start their next step's work;
        then every StepTrace (or the run's exception) goes to its stream."""
        now = [i for i, run in enumerate(runs) if ready(run)]
        if len(now) < len(runs):
            for i, run in enumerate(runs):
                if i not in now:
                    run.parked = logits[i:i + 1].clone()  # [1, V]
            runs, logits = [runs[i] for i in now], logits[now]
        if not runs:
            return
        results = advance_rows([run.state for run in runs], logits)
        done = {}
        for run, item in zip(runs, results):
            if isinstance(item, Exception):
                done[id(run)] = "error"
                continue
            run.steps += 1
            run.first_ms = item.elapsed_ms if run.first_ms is None else run.first_ms
            run.last_ms = item.elapsed_ms
            if item.finish_reason is not None:
                done[id(run)] = item.finish_reason
        if done:
            for batch in (self._front, self._batch):
                if any(id(run) in done for run in batch.runs):
                    batch.keep([i for i, run in enumerate(batch.runs) if id(run) not in done])
            for run in runs:
                if id(run) in done:
                    self.serving.add_run(run.record(done[id(run)]))
        for run in runs:
            if id(run) not in done:
                prepare(run)
        with self._lock:  # before the outputs go out, so a consumer that saw its last step sees its row gone
            self._active = len(self._rows()) + len(self._chunking)
        for run, item in zip(runs, results):
            run.out.put(item)

    def _prefill(self, runs: list[_Run], replay: bool = False) -> tuple[list[_Run], torch.Tensor | None]:
        """Prefill the joiners together (one forward, left-padded, each distinct sequence once:
        ``distinct_sequences``; a prefix they all share fed once: ``_feed``) and add them as the last
        rows. Returns the runs added and their next-token logits [J, V] (no runs: the forward
        failed and they got its exception). ``replay`` (one run, a branch whose chain is stateful):
        ``RunState.prefill``, as ``decode.stream`` prefills it (the forward keeps its prefix
        positions' logits, replayed)."""
        if not runs:
            return [], None
        fed, rows = distinct_sequences(runs)
        kv = KVCache(runs[0].lm.model)
        try:  # logits [U, V]
            if replay:
                logits, tokens = runs[0].state.prefill(kv), len(runs[0].sequence)
            else:
                logits, tokens = self._feed(kv, [run.sequence for run in fed])
        except Exception as exc:  # noqa: BLE001 (the joiners fail; the running rows go on)
            self._fail(runs, exc)
            return [], None
        self._tick_fed += tokens
        self._tick_saved += sum(len(run.sequence) for run in runs) - tokens
        if len(fed) < len(runs):  # each run gets its own copy of its sequence's KV rows: [U, ...] -> [J, ...]
            kv.keep_rows(rows)
            logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))
        self._batch_of(runs[0]).add(runs, kv)  # ``_join`` groups a presenter's runs apart from the room's
        return runs, logits  # [J, V]

    def _feed(self, kv: KVCache, sequences: list[list[int]]) -> tuple[torch.Tensor, int]:
        """Feed ``sequences`` into the empty ``kv`` as its rows; returns their next-token logits
        [U, V] and the positions fed. A prefix they all share (``shared_prefix``) is fed once, as
        one row, copied to every row, then each row's rest follows (left-padded after the
        prefix: the mask keeps every real position's number); the result is the one-forward
        prefill's, to float rounding."""
        shared = shared_prefix(sequences) if self.share_prefix else 0
        if shared:
            kv.forward(torch.tensor([sequences[0][:shared]], dtype=torch.long, device=self.device))  # [1, P]
            kv.keep_rows([0] * len(sequences))
            sequences = [s[shared:] for s in sequences]
        ids, mask = left_padded(sequences, self.device)  # [U, T]
        logits = kv.forward(ids, mask=mask).logits[:, -1, :].float()
        return logits, shared + sum(len(s) for s in sequences)

    def _still_wanted(self, run: _Run) -> bool:
        """Whether the run goes on; a stopped one is recorded, then gets its RunStopped (unless its
        consumer left)."""
        stop = run.stopped()
        if stop is None:
            return True
        self.serving.add_run(run.record(stop.reason))
        if not run.closed:
            run.out.put(stop)
        return False

    def _fail(self, runs: list[_Run], exc: BaseException) -> None:
        """End ``runs`` with ``exc`` (recorded in ``serving`` first)."""
        for run in runs:
            self.serving.add_run(run.record("error"))
            run.out.put(exc)

    @staticmethod
    def _drop(batch: _Batch, rows: list[int]) -> None:
        if rows:
            gone = set(rows)
            batch.keep([i for i in range(len(batch.runs)) if i not in gone])


_ALL: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for scheduler in list(_ALL):
        scheduler.close()


class Schedulers:
    """One Scheduler per loaded model, owned by whoever serves requests: the app's ``Shared`` holds
    its own; ``scheduler_for`` uses a process-wide one (the CLI, benchmarks, tests). Nothing is
    written onto the model; a model the registry drops is forgotten here when it is collected (its
    scheduler holds it only weakly, and its worker ends once the model is gone)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._of: dict[int, Scheduler] = {}

    def get(self, lm: Model) -> Scheduler:
        """The scheduler of ``lm``, created on first use (thread-safe), with PRESENTER_ROWS kept."""
        with self._lock:
            scheduler = self._of.get(id(lm))
            if scheduler is None or scheduler._model() is not lm:
                scheduler = Scheduler(lm, presenter_rows=PRESENTER_ROWS)
                self._of[id(lm)] = scheduler
                weakref.finalize(lm, self._forget, id(lm), scheduler)
            return scheduler

    def _forget(self, key: int, scheduler: Scheduler) -> None:
        with self._lock:
            if self._of.get(key) is scheduler:
                del self._of[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._of)


_PROCESS_SCHEDULERS = Schedulers()


def scheduler_for(lm: Model) -> Scheduler:
    """The process-wide scheduler of this loaded model (``Schedulers``); the app uses its own."""
    return _PROCESS_SCHEDULERS.get(lm)
