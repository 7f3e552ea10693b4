"""The Serving view's four one-click demonstrations, each a measurement on the real model (issue #41).

1. ``batching_demo``: the same mixed-length requests through the scheduler (continuous batching:
   a finished row leaves and a waiting request takes it at the next tick) and through a static
   batch (waves of ``max_batch``; every row of a wave is computed until the wave's longest is done,
   and all of them are answered then). Tokens per second, the mean wait, and the row-steps each
   computed (exactly: Σ (tokens - 1) for continuous, Σ wave size × (longest - 1) for static).
2. ``paged_demo``: requests of mixed prompt lengths and budgets (ending early, at a full stop) through the scheduler; at the tick
   holding the most positions, the KV positions our left-padded batch holds, what a paged cache of
   16-position blocks would hold, and a contiguous worst-case reservation (engine.reports.serving).
3. ``prefix_demo``: N users whose prompts share a long prefix (the lesson's text), prefilled with
   and without the scheduler's shared-prefix prefill: prompt tokens fed, prefill time, and the KV
   blocks a paged cache that shares full blocks would hold (computed).
4. ``chunked_demo``: K users decode; a long prompt arrives; the others' inter-token latency while it
   is prefilled, with the prompt prefilled in one forward and in chunks between decode ticks.

Every demonstration runs greedy requests on a private scheduler of the page's model (``runs.scheduler``:
``engine.runner.RUNS`` hands it ``engine.scheduler.Scheduler``), so the
room's own runs are neither counted in it nor slowed by its settings; each returns its tokens so a
test can check that the variants produce the same text. Times are wall clock on this machine, with
the room's load on it: the view prints the load average beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import uuid
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from engine.base.seam import Model
from engine.backends.client import JsonClient, RemoteError
from engine.cache import KVCache, left_padded
from engine.config import DecodingConfig
from engine.control import RunControl
from engine.core import RunState, advance_rows
from engine.reports.serving import BLOCK_SIZE, KVLayout, Tick, blocks, kv_layout, percentile
from engine.reports.vllm_metrics import MetricsWatch, VllmWindow, window
from engine.reports.runs import Batcher, Runs
from engine.trace import StepTrace

SUBJECTS = ("a lighthouse", "the moon", "a bicycle", "rain in the city", "an old library", "a lost key",
            "the first snow", "a robot gardener", "a mountain village", "the night train", "a paper boat",
            "a market at dawn", "a clockmaker", "the desert wind", "a violin", "a quiet harbour")
# The lesson's shared text: every user of the prefix demo sends it, then a question of their own.
LESSON = ("A language model reads the prompt once and keeps, for every position, a key and a value per layer: "
          "the KV cache. Each new token attends to all of them, so the cache grows by one position per token, "
          "and serving many users at once is mostly a question of where these positions live. A server that "
          "reserves room for the longest possible answer of every request wastes most of its memory on space "
          "that is never written; one that hands out small blocks as the text grows wastes at most one "
          "partly filled block per request. When many users send the same opening text, their first positions "
          "hold the same keys and values, and a server may compute them once and share them. ")
QUESTIONS = ("Why does the cache grow?", "What is a block?", "Who shares what?", "What is wasted?",
             "Why reserve memory?", "What does attention read?", "When is a prefix shared?", "What is a position?")


def story_prompt(lm: Model, user: int, words: int = 0) -> list[int]:
    """A distinct plain-text prompt per user; ``words`` more words of padding text make it longer."""
    extra = " ".join(["and then the story went on"] * (words // 6))
    return lm.encode(f"User {user} writes a story about {SUBJECTS[user % len(SUBJECTS)]}. {extra} Once upon a time,")


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS has none): the demonstrations'
    times are measured beside the room's own work."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


@dataclass
class JobResult:
    """One request of a demonstration: when it was sent, its steps, when its last step came."""

    sent: float  # time.perf_counter()
    steps: list[StepTrace] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # perf_counter() at each step's arrival
    done: float = 0.0
    texts: list[str] = field(default_factory=list)  # a served model's streamed pieces (vLLM demonstrations)

    @property
    def tokens(self) -> list[int]:
        return [s.chosen_token_id for s in self.steps]


def consume(scheduler: Batcher, ids: Sequence[int], config: DecodingConfig, control: RunControl,
            result: JobResult, errors: list) -> None:
    """Read one request's stream into ``result`` (a thread's body; an error goes to ``errors``)."""
    try:
        for step in scheduler.stream(ids, config, control=control):
            result.steps.append(step)
            result.arrivals.append(time.perf_counter())
        result.done = time.perf_counter()
    except BaseException as exc:  # noqa: BLE001 (re-raised by the caller)
        errors.append(exc)


def run_jobs(scheduler: Batcher, jobs: Sequence[tuple[list[int], DecodingConfig]], control: RunControl,
             delays: Sequence[float] | None = None) -> list[JobResult]:
    """Send every job to ``scheduler`` (each from its own thread, after its delay in seconds, all
    at once by default) and wait for all of them; the first error is raised."""
    errors: list[BaseException] = []
    results, threads = [], []
    # all at once: every job joins the same tick (``gathered``), so the demonstration is the same on a loaded machine
    together = scheduler.gathered(len(jobs)) if delays is None else contextlib.nullcontext()
    with together:
        for i, (ids, config) in enumerate(jobs):
            if delays is not None and delays[i]:
                time.sleep(delays[i])
            result = JobResult(time.perf_counter())
            results.append(result)
            thread = threading.Thread(target=consume, args=(scheduler, ids, config, control, result, errors),
                                      daemon=True)
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def greedy(max_new_tokens: int) -> DecodingConfig:
    return DecodingConfig(strategy="greedy", max_new_tokens=max_new_tokens)


# --- 1. continuous vs static batching --------------------------------------------------------------
@dataclass
class BatchingSide:
    name: str
    wall_s: float
    tokens: int
    tokens_per_s: float
    mean_wait_s: float  # sent to the last token, over the requests
    waits_s: list[float]  # each request's, in request order
    row_steps: int  # rows computed by the decode forwards
    forwards: int  # decode forwards
    # Counted, not timed (the machine's other load does not change them): each request's wait in
    # decode forwards (sent to its last token; continuous: sorted, as the ticks say how many requests
    # each one finished, not which) and their mean. None where the ticks cannot say (a request
    # finished at its first token).
    wait_ticks: list[int] | None = None
    mean_wait_ticks: float | None = None


@dataclass
class BatchingDemo:
    requests: int
    max_batch: int
    budgets: list[int]  # each request's max_new_tokens
    continuous: BatchingSide
    static: BatchingSide
    same_tokens: int  # requests whose tokens are the same both ways
    tokens: dict[str, list[list[int]]]
    load: float | None
    at: float


def static_batch(lm: Model, jobs: Sequence[tuple[list[int], DecodingConfig]], max_batch: int,
                 control: RunControl) -> tuple[list[JobResult], int, int, list[int]]:
    """Static batching: waves of ``max_batch`` requests in arrival order, each prefilled left-padded
    and stepped until its longest request is done (finished rows keep being computed: their last
    token is fed again and its output ignored); every request of a wave gets its answer at the
    wave's end. Returns the results, the decode forwards, the rows they computed and each request's
    wait in decode forwards (its wave's end)."""
    start, results, forwards, row_steps, wait_ticks = time.perf_counter(), [], 0, 0, []
    for w in range(0, len(jobs), max_batch):
        wave = jobs[w:w + max_batch]
        states = [RunState(lm, ids, config) for ids, config in wave]
        steps: list[list[StepTrace]] = [[] for _ in wave]
        kv = KVCache(lm.model)
        ids, mask = left_padded([s.sequence for s in states], lm.device)
        logits = kv.forward(ids, mask=mask).logits[:, -1, :].float()  # [W, V]
        live = list(range(len(wave)))
        while live:
            control.check()
            for b, item in zip(live, advance_rows([states[b] for b in live], logits[live])):
                if isinstance(item, Exception):
                    raise item
                steps[b].append(item)
            live = [b for b in live if steps[b][-1].finish_reason is None]
            if live:  # every row of the wave is fed, finished or not: they hold their place until the wave ends
                feed = torch.tensor([[s.last_token] for s in states], dtype=torch.long, device=lm.device)  # [W, 1]
                logits = kv.forward(feed).logits[:, -1, :].float()
                forwards, row_steps = forwards + 1, row_steps + len(wave)
        done = time.perf_counter()
        results += [JobResult(start, s, [done] * len(s), done) for s in steps]
        wait_ticks += [forwards] * len(wave)
    return results, forwards, row_steps, wait_ticks


def continuous_wait_ticks(ticks: Sequence[Tick], requests: int) -> list[int] | None:
    """Each request's wait in decode forwards under continuous batching, sorted, from the scheduler's
    ticks (every request queued before the first: ``gathered``): tick k's forward ran ``rows[k]`` rows
    and left ``queued[k]`` waiting, so ``queued[k-1] - queued[k]`` joined in tick k and the rows it
    finished are ``rows[k] - rows[k+1] + joined[k+1]`` (none after the last). None when the counts
    do not add up to ``requests`` (a request finished at its first token never held a row)."""
    if not ticks:
        return None
    rows = [t.rows for t in ticks] + [0]
    queued = [requests] + [t.queued for t in ticks] + [ticks[-1].queued]  # queued[k + 1]: after tick k
    finished = [rows[k] - rows[k + 1] + queued[k + 1] - queued[k + 2] for k in range(len(ticks))]
    if sum(finished) != requests or any(f < 0 for f in finished):
        return None
    return [k + 1 for k, f in enumerate(finished) for _ in range(f)]


def batching_verdict(d: Any) -> str:
    """What the demonstration shows, in words, from its own numbers: the counts first (row-steps and
    waits in decode forwards, which the machine's other load does not change), then the wall clock,
    and where the wall clock disagrees, why."""
    c, s = _side(d, "continuous"), _side(d, "static")
    counted = (f"Counted in the scheduler's own steps, which the machine's other load does not change: continuous "
               f"batching computed {c['row_steps']:,} row-steps against static's {s['row_steps']:,}")
    if c["mean_wait_ticks"] is not None and s["mean_wait_ticks"] is not None:
        counted += (f" and answered a request after {c['mean_wait_ticks']:.1f} decode forwards on average against "
                    f"{s['mean_wait_ticks']:.1f}")
    faster = c["tokens_per_s"] >= s["tokens_per_s"] and c["mean_wait_s"] <= s["mean_wait_s"]
    if faster:
        return counted + (f"; the wall clock agrees ({c['tokens_per_s']:,.1f} against {s['tokens_per_s']:,.1f} "
                          f"tokens/s, mean wait {c['mean_wait_s']:,.1f} s against {s['mean_wait_s']:,.1f} s).")
    per = {k: 1000 * x["wall_s"] / max(1, x["forwards"]) for k, x in (("c", c), ("s", s))}
    load = d["load"] if isinstance(d, dict) else d.load
    return counted + (f". The wall clock disagrees here ({c['tokens_per_s']:,.1f} against {s['tokens_per_s']:,.1f} "
                      f"tokens/s, mean wait {c['mean_wait_s']:,.1f} s against {s['mean_wait_s']:,.1f} s) because a "
                      f"continuous forward took {per['c']:,.0f} ms and a static one {per['s']:,.0f} ms: the two ran one "
                      f"after the other, so each met a different share of this machine's other work"
                      f"{'' if load is None else f' (load average {load:.1f})'}, and a continuous tick also does "
                      f"the scheduler's bookkeeping (a thread per request, joins as rows free). The counts are the "
                      f"demonstration's result; the times are this machine's, now.")


def _side(d: Any, name: str) -> dict:
    """One side of a BatchingDemo (or of its JSON) as a dict."""
    side = d[name] if isinstance(d, dict) else getattr(d, name)
    return side if isinstance(side, dict) else dataclasses.asdict(side)


def batching_side(name: str, results: list[JobResult], start: float, forwards: int, row_steps: int,
                  wait_ticks: list[int] | None) -> BatchingSide:
    wall = max(r.done for r in results) - start
    tokens = sum(len(r.steps) for r in results)
    waits = [r.done - start for r in results]
    mean_ticks = sum(wait_ticks) / len(wait_ticks) if wait_ticks else None
    return BatchingSide(name, wall, tokens, tokens / wall if wall > 0 else 0.0, sum(waits) / len(waits), waits,
                        row_steps, forwards, wait_ticks, mean_ticks)


def batching_demo(lm: Model, control: RunControl, requests: int = 8, max_batch: int = 4,
                  budgets: Sequence[int] = (2, 12, 4, 16, 3, 8, 6, 14), *, runs: Runs) -> BatchingDemo:
    """Continuous vs static batching of the same ``requests`` (budgets cycled), ``max_batch`` rows."""
    plan = [budgets[i % len(budgets)] for i in range(requests)]
    jobs = [(story_prompt(lm, i), greedy(n)) for i, n in enumerate(plan)]
    scheduler = runs.scheduler(lm, max_batch=max_batch, max_queue=requests)
    start = time.perf_counter()
    continuous = run_jobs(scheduler, jobs, control)
    scheduler.settle()  # the last tick is recorded after its tokens went out
    ticks = scheduler.serving.snapshot().ticks
    static, forwards, row_steps, static_ticks = static_batch(lm, jobs, max_batch, control)
    c_tokens, s_tokens = [r.tokens for r in continuous], [r.tokens for r in static]
    return BatchingDemo(
        requests=requests, max_batch=max_batch, budgets=plan,
        continuous=batching_side("continuous", continuous, start, len(ticks), sum(t.rows for t in ticks),
                                 continuous_wait_ticks(ticks, requests)),
        static=batching_side("static", static, static[0].sent, forwards, row_steps, static_ticks),
        same_tokens=sum(a == b for a, b in zip(c_tokens, s_tokens)), tokens={"continuous": c_tokens, "static": s_tokens},
        load=load_average(), at=time.time())


# --- 2. paged blocks vs contiguous reservation -----------------------------------------------------
@dataclass
class PagedDemo:
    requests: int
    block: int
    peak: KVLayout  # at the tick holding the most positions
    lengths: list[int]  # the rows' real lengths at that tick
    width: int
    series: dict[str, list]  # per tick: used, padded, paged, reserved positions
    load: float | None
    at: float


def paged_demo(lm: Model, control: RunControl, requests: int = 8, block: int = BLOCK_SIZE, *,
               runs: Runs) -> PagedDemo:
    """Requests with mixed prompt lengths and budgets (32 to 64 tokens, each ending at its first
    sentence's full stop: like a chat answer, shorter than its budget) through the scheduler, then
    the KV layouts of every tick (exact, from the rows' lengths)."""
    jobs = [(story_prompt(lm, i, words=12 * (i % 4)),
             DecodingConfig(strategy="greedy", max_new_tokens=32 + 8 * (i % 5), stop=(".",))) for i in range(requests)]
    scheduler = runs.scheduler(lm, max_batch=requests, max_queue=requests)
    run_jobs(scheduler, jobs, control)
    scheduler.settle()
    snap = scheduler.serving.snapshot()
    layouts = [kv_layout(t.lengths, t.width, t.reserved, snap.bytes_per_position, block) for t in snap.ticks]
    at = max(range(len(layouts)), key=lambda i: layouts[i].padded)
    return PagedDemo(requests=requests, block=block, peak=layouts[at], lengths=list(snap.ticks[at].lengths),
                     width=snap.ticks[at].width,
                     series={key: [getattr(x, key) for x in layouts] for key in ("used", "padded", "paged", "reserved")},
                     load=load_average(), at=time.time())


# --- 3. prefix sharing ------------------------------------------------------------------------------
@dataclass
class PrefixSide:
    name: str
    prefill_tokens: int  # prompt positions fed by the joining tick(s)
    prefill_ms: float
    ttft_ms: dict  # p50 / max of the users' time to first token


@dataclass
class PrefixDemo:
    users: int
    prompt_tokens: list[int]
    shared_tokens: int  # the prefix every prompt begins with
    shared: PrefixSide
    unshared: PrefixSide
    same_tokens: int
    tokens: dict[str, list[list[int]]]
    paged_blocks: dict[str, int]  # a paged cache at the block size: each prompt its own blocks vs full prefix blocks shared
    block: int
    load: float | None
    at: float


def prefix_side(name: str, scheduler: Batcher, results: list[JobResult]) -> PrefixSide:
    scheduler.settle()
    ticks = scheduler.serving.snapshot().ticks
    ttft = [r.steps[0].elapsed_ms for r in results if r.steps]
    return PrefixSide(name, sum(t.prefill_tokens for t in ticks), sum(t.prefill_ms for t in ticks),
                      {"p50": percentile(ttft, 50), "max": max(ttft)})


def prefix_demo(lm: Model, control: RunControl, users: int = 8, block: int = BLOCK_SIZE, *,
                runs: Runs) -> PrefixDemo:
    """``users`` prompts = the lesson's text + a question each, sent at once, with the scheduler's
    shared-prefix prefill and without it; plus the blocks a paged cache would hold for them."""
    prompts = [lm.encode(LESSON + QUESTIONS[i % len(QUESTIONS)] + f" (user {i})") for i in range(users)]
    shared = min(next((k for k, (a, b) in enumerate(zip(prompts[0], p)) if a != b), len(p)) for p in prompts[1:])
    jobs = [(p, greedy(4)) for p in prompts]
    sides, tokens = {}, {}
    for name, share in (("shared", True), ("unshared", False)):
        scheduler = runs.scheduler(lm, max_batch=users, max_queue=users, share_prefix=share)
        results = run_jobs(scheduler, jobs, control)
        sides[name], tokens[name] = prefix_side(name, scheduler, results), [r.tokens for r in results]
    full = shared // block  # full blocks of the shared prefix: a paged cache keeps them once
    return PrefixDemo(
        users=users, prompt_tokens=[len(p) for p in prompts], shared_tokens=shared, shared=sides["shared"],
        unshared=sides["unshared"], same_tokens=sum(a == b for a, b in zip(tokens["shared"], tokens["unshared"])),
        tokens=tokens, block=block, load=load_average(), at=time.time(),
        paged_blocks={"each": sum(blocks(len(p), block) for p in prompts),
                      "shared": full + sum(blocks(len(p) - full * block, block) for p in prompts)})


# --- 4. chunked prefill ------------------------------------------------------------------------------
@dataclass
class ChunkedSide:
    name: str
    chunk: int  # prompt tokens per tick (0: one forward)
    long_ttft_ms: float  # the long prompt's time to first token
    others_tokens_meanwhile: list[int]  # tokens each decoding user received while it was prefilled
    others_gap_ms: dict  # the decoding users' inter-token gaps in that time: p50 / max
    long_tokens: list[int]
    others_tokens: list[list[int]]


@dataclass
class ChunkedDemo:
    decoding: int
    long_prompt_tokens: int
    chunk: int
    one_forward: ChunkedSide
    chunked: ChunkedSide
    same_tokens: bool  # every request's tokens equal with and without chunking
    load: float | None
    at: float


def chunked_side(name: str, chunk: int, results: list[JobResult]) -> ChunkedSide:
    """The long request is the last result; the window is from its send to its first token's
    arrival (its time to first token); the others' gaps are those that overlap the window."""
    long, others = results[-1], results[:-1]
    start, end = long.sent, long.arrivals[0]
    meanwhile = [sum(start < t <= end for t in r.arrivals) for r in others]
    gaps = [(b - a) * 1000 for r in others for a, b in zip(r.arrivals, r.arrivals[1:]) if b > start and a < end]
    return ChunkedSide(name, chunk, (end - start) * 1000, meanwhile,
                       {"p50": percentile(gaps, 50), "max": max(gaps)} if gaps else {"p50": None, "max": None},
                       long.tokens, [r.tokens for r in others])


def chunked_demo(lm: Model, control: RunControl, decoding: int = 3, long_words: int = 600, chunk: int = 128,
                 budget: int = 40, *, runs: Runs) -> ChunkedDemo:
    """``decoding`` users decode ``budget`` tokens; once each has its first tokens, a prompt of about
    ``long_words`` words arrives. Run with the prompt prefilled in one forward and in ``chunk``-token chunks."""
    jobs = [(story_prompt(lm, i), greedy(budget)) for i in range(decoding)]
    long_ids = story_prompt(lm, decoding, words=long_words)
    sides = {}
    for name, size in (("one_forward", 0), ("chunked", chunk)):
        scheduler = runs.scheduler(lm, max_batch=decoding + 1, max_queue=decoding + 1, prefill_chunk=size)
        results = [JobResult(time.perf_counter()) for _ in jobs]
        errors: list[BaseException] = []
        threads = [threading.Thread(target=consume, args=(scheduler, ids, config, control, r, errors), daemon=True)
                   for (ids, config), r in zip(jobs, results)]
        for thread in threads:
            thread.start()
        while not errors and any(len(r.steps) < 2 for r in results):  # the others are decoding
            control.check()
            time.sleep(0.005)
        long = run_jobs(scheduler, [(long_ids, greedy(4))], control)[0]
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        sides[name] = chunked_side(name, size, results + [long])
    a, b = sides["one_forward"], sides["chunked"]
    return ChunkedDemo(decoding=decoding, long_prompt_tokens=len(long_ids), chunk=chunk, one_forward=a, chunked=b,
                       same_tokens=a.long_tokens == b.long_tokens and a.others_tokens == b.others_tokens,
                       load=load_average(), at=time.time())


# --- the same on a served vLLM ------------------------------------------------------------------------
VLLM_TIMEOUT_S = 120.0


def vllm_model(server: str) -> str:
    """The name the server serves its model under (its /v1/models' first id)."""
    answer = JsonClient(server + "/v1", timeout_s=VLLM_TIMEOUT_S, server="vLLM").get("/models")
    try:
        name = answer["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        name = None
    if not isinstance(name, str) or not 0 < len(name) <= 512:
        raise RemoteError(f"vLLM {server}/v1/models: no model id in the answer")
    return name


def vllm_tokens(server: str, model: str, prompt: str) -> int:
    """How many tokens the server makes of ``prompt`` (its /tokenize)."""
    answer = JsonClient(server, timeout_s=VLLM_TIMEOUT_S, server="vLLM").post("/tokenize", {"model": model, "prompt": prompt})
    count = answer.get("count") if isinstance(answer, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise RemoteError(f"vLLM {server}/tokenize: no token count in the answer")
    return count


def vllm_consume(server: str, model: str, prompt: str, max_tokens: int, control: RunControl, result: JobResult,
                 errors: list) -> None:
    """Stream one greedy completion from the server into ``result`` (each event's arrival time)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    events = JsonClient(server + "/v1", timeout_s=VLLM_TIMEOUT_S, server="vLLM").stream_post("/completions", body)
    try:
        for event in events:
            control.check()
            choices = event.get("choices") if isinstance(event, dict) else None
            if choices:
                result.arrivals.append(time.perf_counter())
                result.texts.append(str(choices[0].get("text", "")) if isinstance(choices[0], dict) else "")
        result.done = time.perf_counter()
    except BaseException as exc:  # noqa: BLE001 (re-raised by the caller)
        errors.append(exc)
    finally:
        events.close()


def vllm_streams(server: str, model: str, jobs: Sequence[tuple[str, int]], control: RunControl) -> list[JobResult]:
    """Every (prompt, max_tokens) streamed at once, each from its own thread; the first error raised."""
    errors: list[BaseException] = []
    results = [JobResult(time.perf_counter()) for _ in jobs]
    threads = [threading.Thread(target=vllm_consume, args=(server, model, p, n, control, r, errors), daemon=True)
               for (p, n), r in zip(jobs, results)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@dataclass
class VllmPrefixDemo:
    server: str
    users: int
    prompt_tokens: int  # the shared text's tokens on the server
    cold_ttft_ms: float  # the first user: nothing cached yet
    warm_ttft_ms: dict  # the others, each sent after the one before: p50 / max
    saved_ms: float  # cold - warm p50: the prefill the cache spared each of them
    metrics: VllmWindow  # the server's /metrics over the demonstration: prefix queries, hits, hit rate
    at: float


def vllm_prefix_demo(watch: MetricsWatch, control: RunControl, users: int = 6) -> VllmPrefixDemo:
    """One user sends a fresh long shared text (a new first line each time, so nothing of it is
    cached), then ``users - 1`` send the same text with their own question, one after another;
    time to first token of each, and the server's prefix-cache counters before and after."""
    server = watch.server
    model = vllm_model(server)
    text = f"Session {uuid.uuid4().hex[:12]}.\n" + LESSON * 3
    before = watch.sample(fresh=True)
    cold = vllm_streams(server, model, [(text + QUESTIONS[0], 4)], control)[0]
    # one after another: each warm request's first token then measures its own prefill, not a queue
    warm = [vllm_streams(server, model, [(text + QUESTIONS[i % len(QUESTIONS)], 4)], control)[0] for i in range(1, users)]
    metrics = window(before, watch.sample(fresh=True))
    first = [(r.arrivals[0] - r.sent) * 1000 for r in warm if r.arrivals]
    cold_ms = (cold.arrivals[0] - cold.sent) * 1000 if cold.arrivals else 0.0
    return VllmPrefixDemo(server=server, users=users, prompt_tokens=vllm_tokens(server, model, text), cold_ttft_ms=cold_ms,
                          warm_ttft_ms={"p50": percentile(first, 50), "max": max(first)},
                          saved_ms=cold_ms - percentile(first, 50), metrics=metrics, at=time.time())


CHUNKED_MEANWHILE = 3  # tokens each other user gets while a long prompt is read: more than one step did it

@dataclass
class VllmChunkedDemo:
    server: str
    decoding: int
    long_prompt_tokens: int
    long_ttft_ms: float
    others_tokens_meanwhile: list[int]
    others_gap_ms: dict
    chunked: bool | None  # whether every engine step stayed under the long prompt's length: chunks
    metrics: VllmWindow  # its ``largest_step``: the bucket of the step with the most tokens
    at: float


def vllm_chunked_demo(watch: MetricsWatch, control: RunControl, decoding: int = 3, long_words: int = 600,
                      budget: int = 48) -> VllmChunkedDemo:
    """``decoding`` users stream ``budget`` tokens; once each has its first tokens, a long prompt
    arrives. The others' tokens and gaps while it is prefilled, its time to first token, and from
    the server's histogram the largest number of tokens one engine step took: below the prompt's
    length, the server prefilled it in chunks (vLLM's chunked prefill, its token budget per step)."""
    server = watch.server
    model = vllm_model(server)
    long_text = f"User {decoding} writes a story. " + " ".join(["and then the story went on"] * (long_words // 6))
    before = watch.sample(fresh=True)
    errors: list[BaseException] = []
    others = [JobResult(time.perf_counter()) for _ in range(decoding)]
    threads = [threading.Thread(target=vllm_consume, args=(server, model, f"User {i} writes a story about "
                                                           f"{SUBJECTS[i]}. Once upon a time,", budget, control, r, errors),
                                daemon=True) for i, r in enumerate(others)]
    for thread in threads:
        thread.start()
    while not errors and any(len(r.arrivals) < 2 for r in others) and any(t.is_alive() for t in threads):
        control.check()
        time.sleep(0.005)
    long = vllm_streams(server, model, [(long_text, 2)], control)[0]
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    metrics = window(before, watch.sample(fresh=True))
    side = chunked_side("served", 0, others + [long])
    tokens = vllm_tokens(server, model, long_text)
    # Read in chunks: every engine step decodes the others beside one chunk, so each other user gets a token per
    # chunk while the long prompt is read; in one step they get at most one (two when a token of the step before
    # arrives late). vLLM's iteration-tokens histogram cannot say it: vLLM records a prompt's computed tokens at
    # the step that finishes its prefill (vllm/v1/metrics/stats.py PromptTokenStats), chunked or not.
    meanwhile = side.others_tokens_meanwhile
    return VllmChunkedDemo(server=server, decoding=decoding, long_prompt_tokens=tokens, long_ttft_ms=side.long_ttft_ms,
                           others_tokens_meanwhile=meanwhile, others_gap_ms=side.others_gap_ms,
                           chunked=min(meanwhile) >= CHUNKED_MEANWHILE if meanwhile else None, metrics=metrics,
                           at=time.time())
