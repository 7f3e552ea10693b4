"""Issue #29: llama.cpp's server as a remote backend (engine.backends).

The tests marked `remote` run against a real llama-server built from the llama.cpp in
llama-cpp-python's sdist (deploy/llama_server.sh) serving the embedded Q4_1 GGUF; they run last and
wait for the build. The others (knob mapping, operator list, dead and slow servers) need no server.
"""

from __future__ import annotations

import http.server
import math
import subprocess
import threading
import time

import pytest
import torch

from engine.strategies import served_decode
from engine.backends import client, llamacpp, remote, served
from engine.chain import Chain
from engine.config import DecodingConfig
from engine.settings import SettingsError
from tests.helpers.common import ROOT, free_port
from tests.helpers.remote_llamacpp import PROMPT, llamacpp_greedy, server_test  # noqa: F401


# --- no server needed ------------------------------------------------------------------------------
def test_knobs_map_to_request_fields_in_the_stage_order_and_the_rest_is_named():
    config = DecodingConfig(strategy="sample", temperature=0.7, top_k=40, repetition_penalty=1.1,
                            epsilon_cutoff=0.01, top_a=0.2, seed=5)
    request = llamacpp.llamacpp_request(config)
    fields = request.fields
    assert fields["samplers"] == ["penalties", "temperature", "top_k"]  # our default order: penalties, T, top-k
    assert (fields["temperature"], fields["top_k"], fields["repeat_penalty"], fields["seed"]) == (0.7, 40, 1.1, 5)
    assert fields["top_p"] == 1.0 and fields["min_p"] == 0.0  # neutral values sent, so no server default leaks in
    assert [n.key for n in request.unmapped] == ["epsilon_cutoff", "top_a"]
    assert "seed" in {n.key for n in request.caveats}  # mapped, but llama.cpp's generator is not ours


def test_greedy_maps_to_top_k_one_after_the_non_sampling_stages():
    fields = llamacpp.llamacpp_request(DecodingConfig(strategy="greedy", repetition_penalty=1.2, temperature=0.5)).fields
    assert fields["samplers"] == ["penalties", "top_k"] and fields["top_k"] == 1 and fields["mirostat"] == 0


def test_the_operator_lists_remote_models_and_a_bad_item_is_one_line():
    listed = "llamacpp:http://127.0.0.1:8080/, openai:http://h:8000/v1"
    specs = served.allowed_remote_models({"DP_REMOTE_MODELS": listed})
    assert [str(s) for s in specs] == ["llamacpp:http://127.0.0.1:8080", "openai:http://h:8000/v1"]
    assert served.allowed_remote_models({}) == ()
    with pytest.raises(SettingsError, match=r"DP_REMOTE_MODELS: expected llamacpp \| openai:http"):
        served.allowed_remote_models({"DP_REMOTE_MODELS": "vllm:http://h"})


def test_an_unreachable_server_is_one_line_naming_the_url():
    port = free_port()  # closed again: nothing listens there
    start = time.perf_counter()
    with pytest.raises(client.RemoteError) as caught:
        llamacpp.connect(f"http://127.0.0.1:{port}", timeout_s=2)
    message = str(caught.value)
    assert time.perf_counter() - start < 2.5
    assert f"http://127.0.0.1:{port}/v1/models: cannot connect" in message and "\n" not in message
    print(message)


class SlowHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        time.sleep(3)

    def log_message(self, *args):
        pass


def test_a_slow_server_is_one_line_within_the_timeout():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    start = time.perf_counter()
    try:
        with pytest.raises(client.RemoteError) as caught:
            llamacpp.connect(url, timeout_s=0.5)
    finally:
        server.shutdown()
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, elapsed
    assert str(caught.value) == f"llama.cpp server {url}/v1/models: no answer within the 0.5 s timeout"


@server_test
def test_a_second_build_call_reuses_the_cached_binary(llama_server_binary):
    start = time.perf_counter()
    out = subprocess.run(["sh", str(ROOT / "deploy" / "llama_server.sh")], capture_output=True, text=True, check=True)
    assert time.perf_counter() - start < 1.0
    assert out.stdout.strip() == str(llama_server_binary)


@server_test
def test_greedy_through_the_backend_equals_llamacpp_greedy(server_model, embedded):
    ids = server_model.encode(PROMPT)
    assert ids == embedded.encode(PROMPT)  # the server's tokenizer reads the prompt as ours does
    assert server_model.encode(PROMPT, chat=True) == embedded.encode(PROMPT, chat=True)  # and its chat template
    assert server_model.eos_token_ids == embedded.eos_token_ids
    config = DecodingConfig(strategy="greedy", max_new_tokens=16)
    theirs = llamacpp_greedy(server_model, ids, 16)
    step = served_decode.run_step(server_model, PROMPT, config)
    fast = served_decode.run_fast(server_model, PROMPT, config)
    print("llama.cpp greedy:", repr(server_model.decode(theirs)))
    assert step.generated_token_ids == theirs
    assert fast.generated_token_ids == theirs
    assert step.extra["remote"]["mode"] == "step" and fast.extra["remote"]["mode"] == "fast"
    assert [s.name for s in fast.steps[0].stages] == ["raw", "final"]
    assert fast.extra["remote"]["unmapped"] == [] and step.extra["remote"]["unmapped"] == []
    step.to_json(), fast.to_json()  # strict JSON


@server_test
def test_the_server_s_raw_top_n_matches_our_engine_within_quantization_error(server_model, embedded):
    """KL between the server's raw distribution (Q4_1 GGUF) and ours (the same GGUF converted to
    float32 safetensors) over 20 positions, on the top-100 plus one bucket for the rest."""
    ids = embedded.encode(PROMPT)
    sequence = ids + llamacpp_greedy(server_model, ids, 20)
    with torch.inference_mode():
        local = torch.softmax(embedded.model(torch.tensor([sequence])).logits[0].float(), dim=-1)  # [S, V]
    kls, agree = [], 0
    for i in range(20):
        position = len(ids) - 1 + i
        logits, tail = remote.top_logits(server_model, sequence[:position + 1], 100)
        theirs = logits[0].exp()
        top = torch.nonzero(theirs > 0)[:, 0]
        p = torch.cat([theirs[top], torch.tensor([tail])]).double().clamp_min(1e-12)
        q_row = local[position]
        q = torch.cat([q_row[top], (1 - q_row[top].sum()).reshape(1)]).double().clamp_min(1e-12)
        kls.append(float((p * (p / q).log()).sum()))
        agree += int(theirs.argmax()) == int(q_row.argmax())
    mean_kl = sum(kls) / len(kls)
    print(f"KL(server || ours) over 20 positions: mean {mean_kl:.4f} nats, max {max(kls):.4f}; "
          f"top-1 agreement {agree}/20")
    assert all(math.isfinite(k) for k in kls)
    assert mean_kl < 0.05 and agree >= 17


@server_test
def test_a_seeded_step_mode_run_is_reproducible_and_the_seed_matters(server_model):
    config = DecodingConfig(strategy="sample", temperature=1.2, top_k=50, max_new_tokens=12, seed=3)
    first = served_decode.run_step(server_model, PROMPT, config)
    again = served_decode.run_step(server_model, PROMPT, config)
    other = served_decode.run_step(server_model, PROMPT, config.replace(seed=4))
    assert first.generated_token_ids == again.generated_token_ids
    assert first.generated_token_ids != other.generated_token_ids
    assert all(s.draw is not None for s in first.steps)  # our own draw, with its u
    label = first.extra["remote"]
    assert label["backend"] == "llamacpp" and label["top_n"] == served.STEP_TOP_N
    assert len(label["tail_mass"]) == len(first.steps) and all(0 <= t < 1 for t in label["tail_mass"])
    assert [s.name for s in first.steps[0].stages] == ["raw", "temperature", "top_k", "final"]


# Knobs whose stages see only what a top-k or a relative cutoff keeps, so the server's top-100 is all
# they need: our chain over it must give llama.cpp's own post-sampling distribution.
EXACT_KNOBS = [dict(temperature=0.7, top_k=20), dict(min_p=0.1), dict(typical_p=0.8, top_k=50),
               dict(temperature=1.5, top_k=10, xtc_probability=1.0, xtc_threshold=0.05),
               dict(dry_multiplier=0.8, top_k=20)]


@server_test
@pytest.mark.parametrize("knobs", EXACT_KNOBS, ids=lambda k: ",".join(k))
def test_our_chain_over_the_raw_top_n_gives_llamacpp_s_final_distribution(server_model, knobs):
    """The knobs mapped to llama.cpp's request run its samplers; our stages over its raw top-100
    (step mode) give the same final probabilities, so the mapping and the stages agree."""
    config = DecodingConfig(strategy="sample", seed=1, **knobs)
    ids = server_model.encode(PROMPT + " Rome. My favourite city is")
    answer = server_model.client.post("/completion", {
        **llamacpp.llamacpp_request(config, server_model.context).fields, "prompt": ids, "n_predict": 1,
        "n_probs": 40, "post_sampling_probs": True})
    theirs = {t["id"]: t["prob"] for t in answer["completion_probabilities"][0]["top_probs"]}
    raw, _ = remote.top_logits(server_model, ids, 100)
    chain = Chain.from_config(config, len(ids), server_model.tokenizer, server_model.eos_token_ids,
                              generator=torch.Generator().manual_seed(1))
    final = chain.traced(torch.tensor([ids]), raw, 40, server_model.token_text).stages[-1]
    ours = {t.token_id: t.prob for t in final.top}
    assert set(ours) == set(theirs)
    assert max(abs(ours[t] - theirs[t]) for t in ours) < 1e-4
