"""Record a real vLLM's answers for the offline tests (tests/remote/test_remote_openai.py, test_remote_stream.py,
test_remote_speculative.py): each scenario below runs engine.backends' own code against the server through
a recording client, so the files hold exactly the requests the tests make and what vLLM answered.

    python -m tests.data.vllm.record [--url http://127.0.0.1:8000]

Without --url it installs and starts vLLM (deploy/vllm_serve.py, with a 1 s keep-alive interval), and
also serves a folder in the converted model's old layout (the tied embedding under one name) to record
the uniform answer of a model whose weights did not load. Writes, next to this file:

- ``exchanges.json``: ``{"vllm", "recorded", "exchanges": [{"scenario", "method", "path", "body",
  "status", "answer" | "sse"}]}`` (``sse``: a stream's bytes as sent, keep-alive comments included);
- ``broken.json``: the same for the server over the old folder;
- ``error_400.json``, ``error_404.json``: ``{"status", "body"}`` of two refused requests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from deploy import vllm_serve  # noqa: E402
from engine import runner  # noqa: E402
from engine.backends import client, openai, remote, served  # noqa: E402
from engine.config import DecodingConfig  # noqa: E402
from engine.runner import RunRequest  # noqa: E402

HERE = Path(__file__).resolve().parent
# The prompts and knobs the offline tests run (they import them from here).
CAPITAL = "What is the capital of France? Answer in one word."  # chat: greedy ends with EOS in 8 tokens
STORY = "Once upon a time"
STEP_TOP = 5
GREEDY = DecodingConfig(strategy="greedy", max_new_tokens=10)
FAST = DecodingConfig(strategy="sample", temperature=0.7, top_p=0.9, typical_p=0.5, max_new_tokens=10, top_n=5)
HOT = DecodingConfig(strategy="sample", temperature=2.0, max_new_tokens=8, top_n=2, seed=1)  # sampled outside the top 2
PERIOD = 30  # "." in SmolLM2's vocabulary: an operator's extra EOS id here, so vLLM stops with stop_reason 30
SCORED_LENGTH = 2  # prompt_logprobs' top-N
MISSING_MODEL = "no-such-model"


def long_text(nonce: str) -> str:
    """A prompt of about 1,500 tokens (a new one per ``nonce``, so vLLM's prefix cache does not skip its
    prefill): its prefill takes seconds, so the stream sends keep-alive comments first."""
    return f"Record {nonce}. " + " ".join(f"Line {i}: the lighthouse keeper counts ships." for i in range(170))


@dataclass
class RecordingClient(client.JsonClient):
    """engine.backends.client's JsonClient, keeping every exchange in ``log`` (the scenario named in ``scenario``)."""

    log: ClassVar[list[dict[str, Any]]] = []
    scenario: ClassVar[str] = ""

    def _keep(self, method: str, path: str, body: Any, **answer: Any) -> None:
        where = urllib.parse.urlparse(self.url).path + path
        if "sse" not in answer and any((e["method"], e["path"], e["body"]) == (method, where, body) for e in self.log):
            return  # asked again (a second connect's probe): the replay answers the first
        self.log.append({"scenario": self.scenario, "method": method, "path": where, "body": body, "status": 200,
                         **answer})

    def get(self, path: str) -> Any:
        answer = super().get(path)
        self._keep("GET", path, None, answer=answer)
        return answer

    def post(self, path: str, body: dict[str, Any]) -> Any:
        answer = super().post(path, body)
        self._keep("POST", path, body, answer=answer)
        return answer

    def stream_post(self, path: str, body: dict[str, Any]) -> Iterator[Any]:
        lines: list[bytes] = []
        read = self._read
        self._read = lambda exchange, reader, where: (  # type: ignore[method-assign]
            lines.append(read(exchange, reader, where)) or lines[-1])
        try:
            yield from super().stream_post(path, body)
        finally:
            del self._read
            self._keep("POST", path, body, sse=b"".join(lines).decode())


@contextlib.contextmanager
def recording(scenario: str) -> Iterator[None]:
    """engine.backends.openai builds RecordingClients inside the block, the exchanges labelled ``scenario``."""
    real = openai.JsonClient
    openai.JsonClient, RecordingClient.scenario = RecordingClient, scenario  # type: ignore[misc]
    try:
        yield
    finally:
        openai.JsonClient = real  # type: ignore[misc]


def spec(url: str, *eos: int) -> served.RemoteSpec:
    return served.RemoteSpec(
        "openai", url + "/v1", vllm_serve.VOCAB, eos or (vllm_serve.EOS,))


def record_good(url: str) -> None:
    """Every scenario of the offline tests against the server over the converted folder."""
    with recording("connect"):
        model = remote.connect_spec(spec(url), timeout_s=120)
        openai.connect_openai(url + "/v1", timeout_s=120)  # no options: the same probe, no EOS check
    with recording("step"):
        step = model.with_mode("step", STEP_TOP)
        greedy = runner.run(RunRequest(step, CAPITAL, GREEDY, chat=True)).generated_token_ids
    with recording("fast"):
        runner.run(RunRequest(model.with_mode("fast"), CAPITAL, FAST, chat=True))
    with recording("n_plus_one"):
        runner.run(RunRequest(model.with_mode("fast"), STORY, HOT))
    with recording("prompt_logprobs"):
        ids = model.encode(CAPITAL, chat=True)
        model.api.prompt_logprobs(ids + greedy[:3], SCORED_LENGTH)
    with recording("eos_stop_token"):
        stopper = remote.connect_spec(spec(url, vllm_serve.EOS, PERIOD), timeout_s=120, mode="fast")
        trace = runner.run(RunRequest(stopper, CAPITAL, GREEDY, chat=True))
        assert trace.generated_token_ids[-1] == PERIOD, trace.generated_token_ids
    record_keep_alive(model)


def record_keep_alive(model: served.RemoteModel, tries: int = 3) -> None:
    """A fast-mode stream whose prefill is long enough for a keep-alive comment (1 s idle)."""
    for attempt in range(tries):
        before = len(RecordingClient.log)
        with recording("keep_alive"):
            runner.run(RunRequest(model.with_mode("fast"), long_text(f"{time.time():.0f}-{attempt}"),
                                  GREEDY.replace(max_new_tokens=3)))
        if any(": keep-alive" in e.get("sse", "") for e in RecordingClient.log[before:]):
            return
        del RecordingClient.log[before:]  # try a new prompt
    raise SystemExit("record: no keep-alive comment in the stream (is --sse-keep-alive-interval 1 set?)")


def raw(url: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    """(status, body text) of a POST, errors included."""
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def record_errors(url: str) -> None:
    """Two refusals (the logprobs limit, a model the server does not have) and a stream's error chunk."""
    body = {"model": vllm_serve.SERVED_NAME, "prompt": [504, 3575], "max_tokens": 1, "logprobs": 101}
    for status, name, changes in ((400, "error_400.json", {}), (404, "error_404.json", {"model": MISSING_MODEL})):
        got, text = raw(url, "/v1/completions", body | changes)
        assert got == status, (got, text)
        (HERE / name).write_text(json.dumps({"status": got, "body": json.loads(text)}, indent=1) + "\n")
    got, text = raw(url, "/v1/completions", body | {"stream": True, "logprobs": 500})
    assert got == 200 and '"error"' in text, (got, text)  # a stream refuses with an error chunk, HTTP 200
    RecordingClient.log.append({"scenario": "stream_error", "method": "POST", "path": "/v1/completions",
                                "body": None, "status": 200, "sse": text})


def tied_only_folder(source: Path, dest: Path) -> Path:
    """``source`` (the converted embedded model) in the layout the conversion wrote before layout 2:
    the tied embedding under one name (``lm_head.weight``, no ``model.embed_tokens.weight``) and no
    ``architectures`` in config.json (safetensors' save_model and a GGUF config)."""
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            shutil.copy(item, dest / item.name)
    config = json.loads((source / "config.json").read_text())
    config.pop("architectures", None)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(source / "model.safetensors"))
    del weights["model.embed_tokens.weight"]
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def record_broken(url: str) -> None:
    with recording("broken"):
        try:
            remote.connect_spec(spec(url), timeout_s=120)
        except client.RemoteError as exc:
            print(f"record: the old folder, as expected: {exc}")
        else:
            raise SystemExit("record: the server over the old folder answered like a model")


def write(name: str, version: str) -> None:
    text = json.dumps({"vllm": version, "recorded": time.strftime("%Y-%m-%d"), "exchanges": RecordingClient.log},
                      indent=1, allow_nan=False)
    (HERE / name).write_text(text + "\n")
    RecordingClient.log = []


def server_version(url: str) -> str:
    with urllib.request.urlopen(url + "/version", timeout=30) as answer:
        return json.load(answer)["version"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="", help="a running vLLM (make vllm) started with --sse-keep-alive-interval 1")
    parser.add_argument("--broken-url", default="", help="a running vLLM over tied_only_folder's folder")
    args = parser.parse_args()
    python = "" if args.url and args.broken_url else vllm_serve.install()
    keep_alive = ("--sse-keep-alive-interval", "1")
    with (contextlib.nullcontext(args.url) if args.url else vllm_serve.serving(python, keep_alive)) as url:
        record_good(url)
        record_errors(url)
        write("exchanges.json", server_version(url))
    with tempfile.TemporaryDirectory() as tmp:
        from engine.backends.local import embedded_model_dir

        folder = tied_only_folder(embedded_model_dir(), Path(tmp) / "tied-only")
        broken = contextlib.nullcontext(args.broken_url) if args.broken_url else \
            vllm_serve.serving(python, ("--model", str(folder)))
        with broken as url:
            record_broken(url)
            write("broken.json", server_version(url))
    print(f"record: wrote {HERE}")


if __name__ == "__main__":
    main()
