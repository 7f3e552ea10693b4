"""docs/architecture.md's "Add a backend" recipe for a served model, followed with a toy: an API class
answering in-process from a model loaded here, wrapped in a ``RemoteModel`` exactly as a server's
``connect`` wraps its API. With nothing else changed, the engine runs it: the strategies with a served
stream run on it, greedy equals the local model's own greedy token for token (the top-N holds the argmax,
so step mode is exact), the trace is labelled as a served run, and what needs more than a top-N is one
line naming the backend."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from engine import runner
from engine.backends.client import JsonClient
from engine.backends.served import Entry, RemoteModel, RemoteTokenizer
from engine.config import DecodingConfig
from engine.strategies import decode

PROMPT = "The tide came in"


class ToyApi:
    """The requests step mode makes (``next_top``) and the tokenizer's (``tokenize``, ``detokenize``,
    ``chat_ids``), answered by ``lm``; what the API adds beyond a top-N: nothing."""

    backend = "toy"
    scores_prompt = False  # no prompt log-probabilities (vLLM's)
    server_draws = False  # no logits processor drawing with our chain

    def __init__(self, lm) -> None:
        self.lm = lm
        self.client = JsonClient("http://127.0.0.1:9", 5, "toy")  # never called: the answers are in-process
        self.requests = 0

    def tokenize(self, text: str, special: bool) -> list[int]:
        return self.lm.tokenizer.encode(text, add_special_tokens=special)

    def detokenize(self, ids: list[int]) -> str:
        return self.lm.tokenizer.decode(ids)

    def chat_ids(self, prompt: str) -> list[int]:
        return self.lm.encode(prompt, chat=True)

    def next_top(self, ids: Sequence[int], top_n: int) -> list[Entry]:
        self.requests += 1
        logp = torch.log_softmax(self.lm.next_logits(list(ids))[0].float(), -1)
        top = torch.topk(logp, top_n)
        return [(int(t), float(v), None) for v, t in zip(top.values, top.indices)]


def toy_model(lm) -> RemoteModel:
    api = ToyApi(lm)
    return RemoteModel(name="toy:http://127.0.0.1:9", api=api, tokenizer=RemoteTokenizer(api),
                       vocab_size=lm.vocab_size, eos_token_ids=tuple(lm.eos_token_ids), verify=0, top_n=20)


@pytest.fixture(scope="module")
def toy(tiny_lm) -> RemoteModel:
    return toy_model(tiny_lm)


def test_the_toy_backend_runs_the_served_strategies_and_says_why_not_the_others(toy):
    assert toy.backend == "toy" and runner.is_served(toy)
    runs = runner.runs_on(toy)
    assert {"greedy", "sample"} <= set(runs) and "contrastive_search" not in runs
    with pytest.raises(ValueError, match=r"^strategy: 'contrastive_search' does not run on the toy backend; it runs "):
        list(runner.stream(runner.RunRequest(toy, PROMPT, DecodingConfig(strategy="contrastive_search",
                                                                          penalty_alpha=0.6, top_k=4,
                                                                          max_new_tokens=2))))


def test_greedy_on_the_toy_backend_equals_the_local_models_own_greedy(tiny_lm, toy):
    config = DecodingConfig(strategy="greedy", max_new_tokens=12)
    ids = tiny_lm.encode(PROMPT)
    local = [s.chosen_token_id for s in decode.stream(tiny_lm, ids, config)]
    before = toy.api.requests
    trace = runner.run(runner.RunRequest(toy, PROMPT, config))
    assert [s.chosen_token_id for s in trace.steps] == local
    assert toy.api.requests - before == len(local)  # verify=0: one request per token
    label = trace.extra["remote"]
    assert (label["backend"], label["mode"], label["top_n"]) == ("toy", "step", 20)
    assert len(label["tail_mass"]) == len(local) and all(0.0 <= t < 1.0 for t in label["tail_mass"])


def test_a_sampled_run_on_the_toy_backend_is_its_seeds_and_draws_from_the_top_n(tiny_lm, toy):
    """Sampling draws with our generator on the server's top-N renormalised: the same seed gives the
    same tokens twice, and every token is one of that step's top 20."""
    config = DecodingConfig(strategy="sample", seed=5, temperature=1.5, max_new_tokens=8)
    first = runner.run(runner.RunRequest(toy, PROMPT, config))
    again = runner.run(runner.RunRequest(toy, PROMPT, config))
    assert [s.chosen_token_id for s in first.steps] == [s.chosen_token_id for s in again.steps]
    ids = tiny_lm.encode(PROMPT)
    for step in first.steps:
        top = torch.topk(tiny_lm.next_logits(ids)[0], 20).indices.tolist()
        assert step.chosen_token_id in top
        ids.append(step.chosen_token_id)
