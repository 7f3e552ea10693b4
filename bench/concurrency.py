"""Many users on one model: N simulated users start a run at the same moment, each with its own
prompt and seed, 32 tokens each. Prints aggregate tokens/s, its ratio to N = 1 (same process), and
p50/p95 time to first token and to done.

    python -m bench.concurrency [--users 1 4 16 32] [--tokens 32] [--rounds 1] [--model embedded] [--same-prompt]
    python -m bench.concurrency --app http://127.0.0.1:7860 [--users 1 4 16]

Threads mode: each user is a thread calling ``scheduler_for(lm).stream`` (the engine's batched
scheduler: one forward per tick for every active run). ``--app``: each user is a gradio_client
session calling a running app's ``/step_trace`` endpoint. The sessions open before the clock
starts (``app_clients``: opening the page is not pressing Generate; a session's opening costs the
server ~0.4 s of CPU, which overlapped the other users' runs when each user connected after the
start). The endpoint returns the whole trace at the end, so time to first token there is the
client's wait for the server to start the request (submit to Gradio's ``process_starts`` message,
printed as "queued") plus the server's own ``timing.ttft_ms``; time to done is the client's.
Targets on a 2-core CPU with the embedded model: 16 users >= 4x the aggregate tokens/s of one,
p95 time to first token <= 3 s at 16 users.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve the other users' work

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SUBJECTS = ["a lighthouse", "the moon", "a bicycle", "rain in the city", "an old library", "a lost key",
            "the first snow", "a robot gardener", "a mountain village", "the night train", "a paper boat",
            "a market at dawn", "a clockmaker", "the desert wind", "a violin", "a quiet harbour"]


def prompt_for(user: int) -> str:
    """A distinct prompt per user (plain text, so the model rarely stops before the token budget)."""
    return f"User {user} writes a story about {SUBJECTS[user % len(SUBJECTS)]}. Once upon a time,"


def one_prompt(user: int) -> str:
    """User 0's prompt for every user (``--same-prompt``: a room running one lesson's prompt)."""
    return prompt_for(0)


@dataclass
class UserResult:
    tokens: int
    ttft_s: float
    done_s: float
    queued_s: float = 0.0  # --app: submit to the server starting the request (part of ttft_s)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(round(q / 100 * len(ordered) + 0.5))))
    return ordered[rank - 1]


def run_users(n: int, user_fn) -> tuple[list[UserResult], float]:
    """Start ``n`` threads at once (a barrier); each returns a UserResult. Returns them and the wall time."""
    barrier = threading.Barrier(n + 1)
    results: list[UserResult | BaseException] = [None] * n  # type: ignore[list-item]

    def user(i: int) -> None:
        barrier.wait()
        try:
            results[i] = user_fn(i)
        except BaseException as exc:  # noqa: BLE001 (counted as an error below)
            results[i] = exc

    threads = [threading.Thread(target=user, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} users failed; first: {errors[0]!r}")
    return results, wall  # type: ignore[return-value]


def engine_user(lm, tokens: int, prompt=prompt_for):
    from engine.config import DecodingConfig
    from engine.scheduler import scheduler_for

    def user_fn(i: int) -> UserResult:
        start = time.perf_counter()
        ids = lm.encode(prompt(i))
        config = DecodingConfig(strategy="sample", seed=1000 + i, max_new_tokens=tokens)
        ttft, count = None, 0
        for _ in scheduler_for(lm).stream(ids, config):
            count += 1
            ttft = ttft if ttft is not None else time.perf_counter() - start
        return UserResult(count, ttft or 0.0, time.perf_counter() - start)

    return user_fn


def app_clients(url: str, n: int) -> list:
    """``n`` gradio_client sessions of the app at ``url``, connected one after another, each with
    one request made (``/lessons``, no model): the server builds a session's state (a copy of
    every component's config, ~0.1 s in its event loop) on the session's first request, as a
    browser's page load does, so it is not part of that session's first run."""
    from gradio_client import Client

    # httpx loads the CA bundle for every request it makes with verification on (~50 ms of the
    # bench's CPU per request, on the server's cores); a plain-http URL has nothing to verify.
    verify = not url.startswith("http://")
    # gradio_client's default timeout (httpx's 5 s) let a loaded 2-core run's queue join time out (bench.room,
    # 16 users in fast mode)
    clients = [Client(url, verbose=False, ssl_verify=verify, httpx_kwargs={"timeout": 120}) for _ in range(n)]
    for client in clients:
        client.predict(api_name="/lessons")
    return clients


def app_user(clients: list, tokens: int, prompt=prompt_for):
    from gradio_client.utils import Status

    def user_fn(i: int) -> UserResult:
        config = {"strategy": "sample", "seed": 1000 + i, "max_new_tokens": tokens}
        submitted, start = datetime.now(), time.perf_counter()
        job = clients[i].submit(prompt(i), config, "", False, "embedded", "none", api_name="/step_trace")
        started = None  # when the client heard that the server started the request (queue left)
        while started is None and not job.done():
            status = job.status()
            started = status.time if status.code == Status.PROCESSING else None
            time.sleep(0.02)  # the status keeps the message's arrival time, so polling only has to be faster than a run
        trace = job.result()
        done = time.perf_counter() - start
        waited = (started - submitted).total_seconds() if started is not None else 0.0
        return UserResult(len(trace["generated_token_ids"]), waited + trace["timing"]["ttft_ms"] / 1000, done, waited)

    return user_fn


def prefill_seconds(lm, n: int) -> float:
    """Wall time of one forward over the N users' prompts (left-padded, as the scheduler prefills
    joiners): when N users arrive at once, none can see a first token before this, so it is the
    floor of p95 time to first token on this machine."""
    import torch
    from transformers import DynamicCache

    prompts = [lm.encode(prompt_for(i)) for i in range(n)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[p[0]] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        start = time.perf_counter()
        lm.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                 past_key_values=DynamicCache(config=lm.model.config), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def report(rows: list[tuple[int, list[UserResult], float, float | None]]) -> None:
    base = None
    print(f"\n{'users':>5} {'tokens':>7} {'wall s':>7} {'agg tok/s':>10} {'vs 1':>6} "
          f"{'ttft p50':>9} {'ttft p95':>9} {'done p50':>9} {'done p95':>9} {'mean batch':>10}")
    for n, results, wall, mean_batch in rows:
        total = sum(r.tokens for r in results)
        rate = total / wall
        base = rate if n == 1 else base  # each round against its own single user
        ratio = f"{rate / base:.2f}x" if base else "-"
        ttft = [r.ttft_s for r in results]
        done = [r.done_s for r in results]
        batch = f"{mean_batch:.1f}" if mean_batch is not None else "-"
        print(f"{n:>5} {total:>7} {wall:>7.2f} {rate:>10.2f} {ratio:>6} {percentile(ttft, 50):>9.2f} "
              f"{percentile(ttft, 95):>9.2f} {percentile(done, 50):>9.2f} {percentile(done, 95):>9.2f} {batch:>10}")
        if any(r.queued_s for r in results):
            queued = [r.queued_s for r in results]
            print(f"{'':>5} of which queued (submit to the request starting): p50 {percentile(queued, 50):.2f} s, "
                  f"p95 {percentile(queued, 95):.2f} s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--users", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--model", default="embedded")
    p.add_argument("--rounds", type=int, default=1, help="repeat the sweep (each round's ratios use its own N = 1)")
    p.add_argument("--same-prompt", action="store_true",
                   help="every user sends user 0's prompt (a room on one lesson), still with its own seed")
    p.add_argument("--app", default="", help="URL of a running app: drive /step_trace with gradio_client instead")
    args = p.parse_args()
    prompt = one_prompt if args.same_prompt else prompt_for
    rows = []
    if args.app:
        user_fn = app_user(app_clients(args.app.rstrip("/"), max(args.users)), args.tokens, prompt)
        user_fn(0)  # warm-up: the app loads its model on first use
        print(f"app {args.app}, /step_trace, {args.tokens} tokens per user")
        for _ in range(args.rounds):
            for n in args.users:
                results, wall = run_users(n, user_fn)
                rows.append((n, results, wall, None))
    else:
        import torch

        from engine.backends.local import ModelSpec, load_model
        from engine.scheduler import scheduler_for

        lm = load_model(ModelSpec(args.model))
        scheduler = scheduler_for(lm)
        print(f"model {lm.name} on {lm.device} ({lm.dtype}), torch threads {torch.get_num_threads()}, "
              f"max batch {scheduler.max_batch}, {args.tokens} tokens per user")
        user_fn = engine_user(lm, args.tokens, prompt)
        user_fn(0)  # warm-up
        for _ in range(args.rounds):
            for n in args.users:
                before = scheduler.stats()
                results, wall = run_users(n, user_fn)
                after = scheduler.stats()
                ticks = after["ticks"] - before["ticks"]
                rows_stepped = after["mean_batch"] * after["ticks"] - before["mean_batch"] * before["ticks"]
                rows.append((n, results, wall, rows_stepped / ticks if ticks else None))
    report(rows)
    if not args.app and not args.same_prompt:
        floors = ", ".join(f"{n} users {prefill_seconds(lm, n):.2f} s" for n in args.users)
        print(f"prefill of every user's prompt in one forward (the floor of p95 ttft when all arrive at once): {floors}")


if __name__ == "__main__":
    main()
