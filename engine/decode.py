"""Greedy and sampling: prefill once, then one token per forward through the KV cache.

``stream`` yields one StepTrace per generated token (so the UI streams); ``run`` collects a whole
Trace. Branching continues a finished run from any step with another token: the cache is synced
(rewound to the shared prefix), never rebuilt, and the generator is advanced to where it was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from . import sampling
from .cache import KVCache
from .config import DecodingConfig
from .models import LoadedModel
from .processors import Chain
from .trace import StepTrace, Timing, Trace


@dataclass
class StopCheck:
    """EOS, stop strings and the token budget. ``text`` is the generated text cut before a stop
    string (stop strings are not part of the returned text, as in OpenAI's API)."""

    lm: LoadedModel
    config: DecodingConfig

    def reason(self, generated: Sequence[int]) -> str | None:
        if generated and generated[-1] in self.lm.eos_token_ids:
            return "eos"
        if self.config.stop and self._stop_index(self.lm.decode(list(generated))) is not None:
            return "stop_string"
        if len(generated) >= self.config.max_new_tokens:
            return "max_new_tokens"
        return None

    def _stop_index(self, text: str) -> int | None:
        hits = [text.find(s) for s in self.config.stop if s in text]
        return min(hits) if hits else None

    def text(self, generated: Sequence[int]) -> str:
        text = self.lm.decode(list(generated))
        cut = self._stop_index(text) if self.config.stop else None
        return text if cut is None else text[:cut]


def make_generator(config: DecodingConfig, device: torch.device) -> torch.Generator:
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    return torch.Generator(device=gen_device).manual_seed(config.seed)


def stream(lm: LoadedModel, prompt_ids: Sequence[int], config: DecodingConfig, *,
           prefix: Sequence[int] = (), force: int | None = None, cache: KVCache | None = None,
           ) -> Iterator[StepTrace]:
    """Yield a StepTrace per generated token until EOS, a stop string or max_new_tokens.

    ``prefix``: tokens already generated (a branch continues after them); ``force``: the token to
    take at the first new step instead of sampling. ``cache`` may be a cache left by an earlier run
    of the same prompt: it is rewound to the shared prefix, not rebuilt."""
    if not prompt_ids:
        raise ValueError("prompt: empty after tokenisation; type at least one character")
    start = time.perf_counter()
    cache = cache or KVCache(lm.model, config.kv_cache, config.kv_residual_length)
    generator = None if config.is_greedy else make_generator(config, lm.device)
    chain = Chain.from_config(config, len(prompt_ids), lm.tokenizer, lm.eos_token_ids, generator=generator)
    stopper = StopCheck(lm, config)
    sequence = list(prompt_ids) + list(prefix)
    if prefix and chain.stateful:  # mirostat's μ and XTC's draws: replay the steps before
        logits = replay(lm, cache, chain, prompt_ids, prefix, generator)
    else:
        if generator is not None and prefix:
            sampling.skip_draws(generator, len(prefix), lm.vocab_size, lm.device)
        logits = cache.sync(sequence)  # prefill: one forward over what the cache lacks
    ids = torch.tensor([sequence], dtype=torch.long, device=lm.device)
    generated = list(prefix)
    while True:
        traced = chain.traced(ids, logits, config.top_n, lm.token_text)
        stages = traced.stages
        if force is not None:
            pick = sampling.Pick(force, float(traced.final_probs[force]))
            if generator is not None:  # keep the generator aligned with an unforced run
                sampling.skip_draws(generator, 1, lm.vocab_size, lm.device)
        elif not sampling.has_tokens(traced.logits):
            raise sampling.NoTokensLeft(len(generated))
        elif generator is None:
            token = int(torch.argmax(traced.logits[0]))
            pick = sampling.Pick(token, float(traced.final_probs[token]))
        else:
            pick = sampling.sample_probs(traced.final_probs, generator)
        chain.observe(ids, pick.token_id)
        chain.annotate(stages)
        generated.append(pick.token_id)
        reason = stopper.reason(generated)
        yield StepTrace(
            index=len(generated) - 1, chosen_token_id=pick.token_id, chosen_token=lm.token_text(pick.token_id),
            chosen_prob=pick.prob, raw_prob=float(traced.raw_probs[pick.token_id]),
            draw=pick.draw, draw_low=pick.low, draw_high=pick.high,
            entropy=stages[-1].entropy, raw_entropy=stages[0].entropy, stages=stages,
            elapsed_ms=(time.perf_counter() - start) * 1000, forced=force is not None, finish_reason=reason,
        )
        if reason is not None:
            return
        force = None
        ids = torch.cat([ids, torch.tensor([[pick.token_id]], device=lm.device)], dim=1)
        logits = cache.step([pick.token_id])


def replay(lm: LoadedModel, cache: KVCache, chain: Chain, prompt_ids: Sequence[int], prefix: Sequence[int],
           generator: torch.Generator | None) -> torch.Tensor:
    """Bring a stateful chain and the generator to where a run stood after generating ``prefix``.

    One forward returns the logits of every prefix position (the cache is rewound to the prompt
    minus its last token first); then, position by position, the chain is applied (XTC draws its
    coin as the run did), the generator skips the pick's draws, and the prefix token is observed
    (mirostat's μ moves). Returns the logits after the last prefix token [1, V]."""
    tokens = list(prompt_ids) + list(prefix)
    start = len(prompt_ids) - 1  # the position whose logits picked prefix[0]
    common = 0
    for a, b in zip(cache.tokens, tokens[:start]):
        if a != b:
            break
        common += 1
    cache.rewind(cache.length - common)
    feed = torch.tensor([tokens[common:]], dtype=torch.long)
    rows = cache.forward(feed, all_logits=True).logits[0, start - common:].float()  # [len(prefix) + 1, V]
    for i, token in enumerate(prefix):
        ids = torch.tensor([tokens[:start + 1 + i]], dtype=torch.long, device=lm.device)
        chain(ids, rows[i:i + 1])
        if generator is not None:
            sampling.skip_draws(generator, 1, lm.vocab_size, lm.device)
        chain.observe(ids, token)
    return rows[-1:]


def assemble(lm: LoadedModel, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig,
             steps: list[StepTrace], chat: bool, branch_of: int | None = None) -> Trace:
    """A Trace from collected steps (also used by the UI while streaming)."""
    generated = [s.chosen_token_id for s in steps]
    total_ms = steps[-1].elapsed_ms if steps else 0.0
    summary = run_summary(steps)
    return Trace(
        model=lm.name, strategy=config.strategy, config=config.to_dict(sparse=True), prompt=prompt,
        prompt_token_ids=list(prompt_ids), text=StopCheck(lm, config).text(generated),
        generated_token_ids=generated, stop_reason=(steps[-1].finish_reason or "") if steps else "",
        steps=steps, timing=timing(steps), chat=chat, quantization=lm.quantization, device=str(lm.device),
        branch_of=branch_of, summary=summary | {"total_ms": total_ms},
    )


def timing(steps: Sequence[StepTrace]) -> Timing:
    if not steps:
        return Timing(0.0, 0.0, 0.0)
    total = steps[-1].elapsed_ms
    return Timing(ttft_ms=steps[0].elapsed_ms, tokens_per_s=len(steps) / (total / 1000) if total > 0 else 0.0, total_ms=total)


def run_summary(steps: Sequence[StepTrace]) -> dict:
    """Mean log-prob (under the final, processed distribution and the raw model) and perplexity."""
    import math

    if not steps:
        return {"tokens": 0}
    logp = [math.log(max(s.chosen_prob, 1e-45)) for s in steps]
    raw = [math.log(max(s.raw_prob, 1e-45)) for s in steps]
    mean_raw = sum(raw) / len(raw)
    return {
        "tokens": len(steps),
        "mean_logprob": sum(logp) / len(logp),
        "mean_raw_logprob": mean_raw,
        "perplexity": math.exp(-mean_raw),
        "mean_entropy": sum(s.entropy for s in steps) / len(steps),
    }


def run(lm: LoadedModel, prompt: str, config: DecodingConfig, *, chat: bool = False,
        cache: KVCache | None = None) -> Trace:
    """Greedy or sampling run to completion."""
    prompt_ids = lm.encode(prompt, chat)
    steps = list(stream(lm, prompt_ids, config, cache=cache))
    return assemble(lm, prompt, prompt_ids, config, steps, chat)


def branch(lm: LoadedModel, parent: Trace, at_step: int, token_id: int, *, cache: KVCache | None = None) -> Iterator[StepTrace]:
    """Continue ``parent`` from step ``at_step`` with ``token_id`` instead of what it chose.
    Yields the parent's steps before ``at_step`` unchanged, then the new ones."""
    if not 0 <= at_step < len(parent.steps):
        raise ValueError(f"at_step: {at_step} is out of range; the run has {len(parent.steps)} steps")
    if not 0 <= token_id < lm.vocab_size:
        raise ValueError(f"token_id: {token_id} is out of range; vocabulary has {lm.vocab_size} tokens")
    config = DecodingConfig.from_dict(parent.config)
    yield from parent.steps[:at_step]
    prefix = parent.generated_token_ids[:at_step]
    yield from stream(lm, parent.prompt_token_ids, config, prefix=prefix, force=token_id, cache=cache)
