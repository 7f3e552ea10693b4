"""Record a real vLLM's greedy answers under structured outputs, for tests/remote/test_grammar_remote.py.

    python tests/data/vllm/record_structured.py http://127.0.0.1:PORT/v1 [BACKEND]

The server must serve the embedded model (SmolLM2-135M-Instruct, float32) under the name it reports;
vLLM needs ``model.embed_tokens.weight`` in the folder (the embedded model's is tied to lm_head: copy
it under that name too). Each case's prompt is encoded here exactly as the engine encodes it (the
chat template), sent as token ids to /v1/completions at temperature 0 with ``structured_outputs``,
and its answer written to ``structured_<BACKEND>.json`` beside this script: token ids, text, the
finish reason and the top-5 log-probabilities of each step (to explain a difference token by token).
BACKEND names the server's ``--structured-outputs-config`` backend (auto: xgrammar, vLLM's default).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from engine.backends.local import ModelSpec  # noqa: E402
from engine.backends.registry import ModelRegistry  # noqa: E402
from engine.presets import builtin_presets  # noqa: E402
from engine.stages import STAGES  # noqa: E402

# (name, prompt, preset stem): the presets' own grammars, so the test reads them from the same place
CASES = [("json-object", "Describe a fictional person.", "json-object"),
         ("yes-no-maybe", "Should I take an umbrella today?", "yes-no-maybe"),
         ("iso-date", "When did the Berlin wall fall?", "iso-date"),
         ("arithmetic", "What is twelve plus thirty? Write it as a sum.", "arithmetic")]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.load(answer)


def main(url: str, backend: str) -> None:
    lm = ModelRegistry().get(ModelSpec())
    with urllib.request.urlopen(url + "/models", timeout=60) as answer:
        served = json.load(answer)["data"][0]["id"]
    with urllib.request.urlopen(url.removesuffix("/v1") + "/version", timeout=60) as answer:
        version = json.load(answer).get("version")
    out = {"vllm_version": version, "backend": backend, "model": served, "cases": {}}
    for name, prompt, stem in CASES:
        config = builtin_presets()[stem].config.replace(strategy="greedy")
        ids = lm.encode(prompt, True)
        fields = STAGES["grammar"].served.openai(config)  # what fast mode sends vLLM: structured_outputs
        choice = post(url + "/completions", {
            "model": served, "prompt": ids, "max_tokens": config.max_new_tokens, "temperature": 0.0, "logprobs": 5,
            "return_tokens_as_token_ids": True, "return_token_ids": True, **fields})["choices"][0]
        tops = choice["logprobs"]["top_logprobs"]
        out["cases"][name] = {"prompt": prompt, "preset": stem, "prompt_token_ids": ids,
                              "token_ids": choice["token_ids"], "text": choice["text"],
                              "finish_reason": choice["finish_reason"],
                              "top_logprobs": [{k.removeprefix("token_id:"): v for k, v in top.items()} for top in tops]}
        print(name, repr(choice["text"]), choice["finish_reason"])
    path = Path(__file__).with_name(f"structured_{backend}.json")
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main(sys.argv[1].rstrip("/"), sys.argv[2] if len(sys.argv) > 2 else "auto")
