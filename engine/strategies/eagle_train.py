"""Train the EAGLE-3 draft head (engine.strategies.eagle_head) on the target's own text.

    python -m engine.strategies.eagle_train [--model embedded] [--prompts 320] [--tokens 64]
                                            [--vocab 8192] [--minutes 6] [--ttt 3] [--lr 0.001]
                                            [--reg 1.0] [--threads 1] [--data-cache DIR]

1. Data (self-distillation, as Medusa's heads: the same prompt file, engine/assets/medusa_prompts.txt,
   reused): the target continues the first ``--prompts`` prompts (chat template, greedy, batched),
   then ONE forward over each whole sequence returns its hidden states after the low, middle and
   high layers (``eagle_head.feature_layers``), its final (normed) state and its own greedy choice
   at every position (EAGLE's distillation label: on the continuation it is the next token, on the
   prompt what the target would have said there, so the prompt's positions teach too). The last
   ``--holdout`` prompts are held out. ``--data-cache DIR`` keeps all of it (safetensors, keyed by
   model, prompts and ``--tokens``) so a second run trains without generating again.
2. The draft vocabulary: the ``--vocab`` most frequent tokens of the generated text (``d2t``);
   labels outside it count as misses.
3. Training-time test (EAGLE-3): step 1 feeds the target's fused features of position j with token
   j + 1 and aims at token j + 2; step s > 1 feeds the head's own outputs of step s - 1 with token
   j + s, attending to the target-fed keys up to where it branched and to its own earlier steps
   there (the keys it sees when drafting a tree at decode time); each step feeds only its new rows
   over a cache of the earlier ones. Loss on every position of the text, step s weighted 0.8^(s-1):
   cross-entropy plus ``--reg`` times EAGLE-1's smooth-L1 regression of the head's normed state on
   the target's final state that predicted the same token. Learning rate: warm-up, then a cosine
   over the ``--minutes`` budget (or ``--max-steps``).
4. Per-step top-1 accuracy on 16 training sequences (a sanity check) and on the held-out text is
   printed with the wall time; the head goes to ``engine/assets/eagle-<model>.safetensors``
   (+ ``.json``, ``.sha256``), all three renamed into place only once complete.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from engine.backends.local import ModelSpec, load_model
from engine.base.seam import Model
from engine.strategies.eagle_head import EagleHead, HeadConfig, feature_layers, head_path, save_head
from engine.strategies.medusa_train import PROMPTS, read_prompts, say
from engine.threads import set_threads

STEP_DECAY = 0.8


@dataclass
class Settings:
    model: str = "embedded"
    prompts: int = 320  # the first N prompts of the file
    holdout: int = 16  # of those, the last ones (evaluation only)
    tokens: int = 64  # generated per prompt
    vocab: int = 8192
    ttt: int = 3  # training-time-test steps
    batch: int = 4  # sequences per optimiser step
    lr: float = 1e-3
    reg: float = 1.0  # weight of the feature regression against the cross-entropy
    minutes: float = 6.0  # training wall-time budget
    max_steps: int = 0  # 0: until the budget is spent
    gen_batch: int = 64
    seed: int = 0
    threads: int = 1  # the 2-core machine is shared; one thread leaves the other core to the rest
    out: str = ""  # default: engine/assets/eagle-<model>.safetensors
    data_cache: str = ""  # a directory for the generated text and its features ("": none)


@dataclass
class Sample:
    tokens: torch.Tensor  # [T] prompt + continuation
    features: torch.Tensor  # [T, 3H] float16
    start: int  # first generated position
    final: torch.Tensor  # [T, H] float16: the target's last (normed) hidden state, its LM head's input
    predicted: torch.Tensor  # [T] the target's greedy choice at each position (of token i + 1)


@torch.inference_mode()
def make_samples(lm: Model, prompts: list[str], settings: Settings, layers: tuple[int, int, int]) -> list[Sample]:
    """Greedy continuations, then each sequence's features from one batched forward."""
    tok = lm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else lm.eos_token_ids[0]
    samples, t0 = [], time.perf_counter()
    encoded = sorted((lm.encode(p, chat=True) for p in prompts), key=len)
    for start in range(0, len(encoded), settings.gen_batch):
        rows = encoded[start: start + settings.gen_batch]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=lm.device)
        mask = (torch.arange(width) >= torch.tensor([width - len(r) for r in rows])[:, None]).long().to(lm.device)
        out = lm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=settings.tokens, do_sample=False,
                                pad_token_id=pad, eos_token_id=list(lm.eos_token_ids))
        full_mask = torch.cat([mask, (out[:, width:] != -1).long()], dim=1)
        for row, prompt in enumerate(rows):
            generated = out[row, width:].tolist()
            ends = [i for i, t in enumerate(generated) if t in lm.eos_token_ids]
            keep = ends[0] + 1 if ends else len(generated)
            full_mask[row, width + keep:] = 0
        positions = (full_mask.cumsum(dim=1) - 1).clamp(min=0)
        # the decoder alone: the full logits of a 96-row batch would be gigabytes; its greedy choice is read row by row
        hidden = lm.model.get_decoder()(input_ids=out, attention_mask=full_mask, position_ids=positions,
                                        output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i] for i in layers], dim=-1).to(torch.float16).cpu()  # [B, W, 3H]
        finals = hidden[-1].to(torch.float16).cpu()
        for row, prompt in enumerate(rows):
            real = full_mask[row].bool().cpu()
            predicted = lm.model.get_output_embeddings()(hidden[-1][row]).argmax(-1).cpu()
            samples.append(Sample(out[row].cpu()[real], feats[row][real], len(prompt), finals[row][real],
                                  predicted[real]))
        say(f"  data: {start + len(rows)}/{len(encoded)} prompts ({time.perf_counter() - t0:.0f} s)")
    return samples


SAMPLE_FIELDS = ("tokens", "features", "final", "predicted")


def cached_samples(lm: Model, prompts: list[str], settings: Settings,
                   layers: tuple[int, int, int]) -> list[Sample]:
    """``make_samples``, loaded from ``settings.data_cache`` when it holds them for the same model,
    prompts, ``--tokens`` and layers, else made and saved there (renamed into place once whole)."""
    if not settings.data_cache:
        return make_samples(lm, prompts, settings, layers)
    key = {"base_model": lm.name, "tokens": str(settings.tokens), "layers": ",".join(map(str, layers)),
           "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest()}
    name = hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:16]
    path = Path(settings.data_cache) / f"eagle-data-{name}.safetensors"
    if path.exists():
        with safe_open(str(path), framework="pt") as handle:
            parts = {n: handle.get_tensor(n) for n in (*SAMPLE_FIELDS, "lengths", "starts")}
        lengths = parts["lengths"].tolist()
        split = {n: torch.split(parts[n], lengths) for n in SAMPLE_FIELDS}
        say(f"loaded {len(lengths)} sequences from {path}")
        return [Sample(split["tokens"][i], split["features"][i], start, split["final"][i], split["predicted"][i])
                for i, start in enumerate(parts["starts"].tolist())]
    samples = make_samples(lm, prompts, settings, layers)
    tensors = {n: torch.cat([getattr(s, n) for s in samples]).contiguous() for n in SAMPLE_FIELDS}
    tensors["lengths"] = torch.tensor([len(s.tokens) for s in samples], dtype=torch.long)
    tensors["starts"] = torch.tensor([s.start for s in samples], dtype=torch.long)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata=key)
    partial.replace(path)
    say(f"saved {len(samples)} sequences to {path}")
    return samples


def draft_vocab(samples: list[Sample], size: int, eos_ids) -> torch.Tensor:
    """The ``size`` most frequent generated tokens (EOS always in), most frequent first."""
    counts = Counter(t for s in samples for t in s.tokens[s.start:].tolist())
    top = [t for t, _ in counts.most_common(size)]
    missing = [e for e in eos_ids if e not in top]
    return torch.tensor((top[: size - len(missing)] + missing) if size > len(missing) else top, dtype=torch.long)


def ttt_mask(n: int, steps: int) -> torch.Tensor:
    """[steps * n, steps * n] bool: row (s, j) sees (1, j') for j' <= j and (t, j) for 2 <= t <= s."""
    j = torch.arange(n)
    allowed = torch.zeros(steps, n, steps, n, dtype=torch.bool)
    allowed[:, :, 0, :] = j[None, :, None] >= j[None, None, :]
    for s in range(1, steps):
        for t in range(1, s + 1):
            allowed[s, j, t, j] = True
    return allowed.reshape(steps * n, steps * n)


@dataclass
class Batch:
    """Right-padded tokens [B, T], features [B, T, 3H], the target's final states [B, T, H], which
    positions count [B, T] (``generated``: every position after the first, inside the text) and
    draft labels [B, T] (at t the target's greedy choice at t - 1, -100 outside the draft vocabulary)."""

    tokens: torch.Tensor
    feats: torch.Tensor
    finals: torch.Tensor
    generated: torch.Tensor
    labels: torch.Tensor


def batch_of(samples: list[Sample], lookup: torch.Tensor, prompt: bool = True) -> Batch:
    """``prompt=False``: only the continuation's positions count (what drafting at decode time meets)."""
    width = max(len(s.tokens) for s in samples)
    tokens = torch.zeros(len(samples), width, dtype=torch.long)
    feats = torch.zeros(len(samples), width, samples[0].features.shape[-1])
    finals = torch.zeros(len(samples), width, samples[0].final.shape[-1])
    generated = torch.zeros(len(samples), width, dtype=torch.bool)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    for i, s in enumerate(samples):
        tokens[i, : len(s.tokens)] = s.tokens
        feats[i, : len(s.tokens)] = s.features.float()
        finals[i, : len(s.tokens)] = s.final.float()
        generated[i, 1 if prompt else s.start: len(s.tokens)] = True
        labels[i, 1: len(s.tokens)] = lookup[s.predicted[:-1]]
    return Batch(tokens, feats, finals, generated, labels)


@dataclass
class Step:
    """One training-time-test step's output for the token at j + s + 1: draft logits [B, n, V'],
    the head's normed state [B, n, H] and the target's final state it should equal (the one
    that predicted that token), the labels and which of them count (generated, inside the text)."""

    logits: torch.Tensor
    state: torch.Tensor
    final: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor


def unroll(head: EagleHead, batch: Batch, steps: int) -> list[Step]:
    """Training-time test. Step 1 at row j reads (features of j, token j + 1) and aims at token
    j + 2, whose predictor in the target is the final state at j + 1; step s > 1 reads the head's
    own step s - 1 output at j and token j + s, and aims at token j + s + 1 (final state j + s)."""
    tokens = batch.tokens
    b, width = tokens.shape
    n = width - 1
    allowed = ttt_mask(n, steps)
    j = torch.arange(n)
    cache = DynamicCache()  # each step feeds only its n new rows; the earlier steps' keys stay cached
    feature, out = head.fuse(batch.feats[:, :n]), []
    for s in range(1, steps + 1):
        shift = (j + s).clamp(max=width - 1)
        rows = allowed[(s - 1) * n: s * n, : s * n]
        mask = torch.zeros(rows.shape).masked_fill(~rows, torch.finfo(torch.float32).min)
        positions = (j + s - 1)[None].expand(b, -1)
        state = head(tokens[:, shift], feature, positions, mask[None, None], cache)
        target = (j + s + 1).clamp(max=width - 1)
        valid = batch.generated[:, target] & (j + s + 1 < width)[None]
        out.append(Step(head.logits(state), head.norm(state), batch.finals[:, shift], batch.labels[:, target], valid))
        feature = state
    return out


def accuracy(head: EagleHead, samples: list[Sample], lookup: torch.Tensor, steps: int) -> list[float]:
    """Per step, the share of the samples' generated tokens the head's top-1 got right (the
    target's own greedy choices there)."""
    hits, totals = [0] * steps, [0] * steps
    with torch.no_grad():
        for i in range(0, len(samples), 4):
            for s, step in enumerate(unroll(head, batch_of(samples[i: i + 4], lookup, prompt=False), steps)):
                right = (step.logits.argmax(-1) == step.labels) & step.valid
                hits[s] += int(right.sum())
                totals[s] += int(step.valid.sum())
    return [h / max(t, 1) for h, t in zip(hits, totals)]


def initial_head(lm: Model, vocab: torch.Tensor, layers: tuple[int, int, int], meta: dict) -> EagleHead:
    """A head whose decoder layer and norms start as the target's last ones (their scale fits its
    states): q/k/v read the feature half as the target's do and the embedding half starts at zero;
    the fusion starts random."""
    config = HeadConfig(lm.name, int(lm.model.config.hidden_size), lm.vocab_size, len(vocab), layers, meta)
    head = EagleHead(lm.model.config, config, vocab)
    base = lm.model.model
    last = base.layers[-1].state_dict()
    with torch.no_grad():
        for name, value in head.layer.state_dict().items():
            source = last[name]
            if value.shape == source.shape:
                value.copy_(source)
            else:  # [out, 2H]: [embedding half | feature half]
                value.zero_()
                value[:, source.shape[1]:] = source
        head.hidden_norm.weight.copy_(base.layers[-1].input_layernorm.weight)
        head.norm.load_state_dict(base.norm.state_dict())
    return head.float().bind(lm.model)


def step_loss(step: Step, reg: float) -> torch.Tensor:
    """Cross-entropy on the known labels plus ``reg`` times EAGLE-1's feature regression (smooth L1
    between the head's normed state and the target's final state, over the same positions): the
    regression hands every position 576 targets instead of one label, so a short run learns more."""
    if not step.valid.any():
        return torch.zeros(())
    labels = step.labels.masked_fill(~step.valid, -100)
    loss = torch.zeros(()) if not (labels != -100).any() else \
        torch.nn.functional.cross_entropy(step.logits.flatten(0, 1), labels.flatten())
    return loss + reg * torch.nn.functional.smooth_l1_loss(step.state[step.valid], step.final[step.valid])


def schedule(settings: Settings, step: int, elapsed: float) -> float:
    """The learning rate: a 20-step warm-up, then a cosine to a tenth over the budget (the wall
    time, or --max-steps when given)."""
    done = step / settings.max_steps if settings.max_steps else elapsed / (settings.minutes * 60)
    return settings.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))


def train(head: EagleHead, data: list[Sample], held: list[Sample], settings: Settings) -> tuple[list[float], int]:
    lookup = torch.full((head.head.vocab_size,), -100, dtype=torch.long)
    lookup[head.d2t] = torch.arange(len(head.d2t))
    params = [p for p in head.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=settings.lr)
    generator = torch.Generator().manual_seed(settings.seed)
    t0, step = time.perf_counter(), 0
    weights = [STEP_DECAY ** s for s in range(settings.ttt)]
    while time.perf_counter() - t0 < settings.minutes * 60 and (not settings.max_steps or step < settings.max_steps):
        picks = torch.randint(len(data), (settings.batch,), generator=generator).tolist()
        steps = unroll(head, batch_of([data[i] for i in picks], lookup), settings.ttt)
        loss = sum((w * step_loss(s, settings.reg) for w, s in zip(weights, steps)), torch.zeros(()))
        for group in optimiser.param_groups:
            group["lr"] = schedule(settings, step, time.perf_counter() - t0)
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        step += 1
        if step % 25 == 0:
            say(f"  step {step}: loss {float(loss.detach()):.3f} ({time.perf_counter() - t0:.0f} s)")
    seen = accuracy(head, data[:16], lookup, settings.ttt)
    say(f"training-text top-1 per draft position (16 sequences): {', '.join(f'{a:.3f}' for a in seen)}")
    acc = accuracy(head, held, lookup, settings.ttt)
    say(f"held-out top-1 per draft position: {', '.join(f'{a:.3f}' for a in acc)} after {step} steps")
    return acc, step


def parse(argv: list[str] | None) -> Settings:
    defaults = Settings()
    parser = argparse.ArgumentParser(prog="python -m engine.strategies.eagle_train", description=__doc__.split("\n")[0])
    for name, value in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    settings = Settings(**vars(parser.parse_args(argv)))
    for name in ("prompts", "tokens", "vocab", "ttt", "batch", "gen_batch", "threads"):
        if getattr(settings, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(settings, name)}")
    if not 1 <= settings.holdout < settings.prompts:
        parser.error(f"--holdout must be in [1, --prompts), got {settings.holdout}")
    if not (settings.minutes > 0 and math.isfinite(settings.minutes)):
        parser.error(f"--minutes must be a positive number, got {settings.minutes}")
    return settings


def main(argv: list[str] | None = None) -> int:
    settings = parse(argv)
    set_threads(settings.threads)
    torch.manual_seed(settings.seed)
    t0 = time.perf_counter()
    lm = load_model(ModelSpec(settings.model, device="cpu", dtype="float32"))
    layers = feature_layers(int(lm.model.config.num_hidden_layers))
    prompts = read_prompts(PROMPTS)[: settings.prompts]
    samples = cached_samples(lm, prompts, settings, layers)
    held_prompts = {tuple(lm.encode(p, chat=True)) for p in prompts[-settings.holdout:]}
    held = [s for s in samples if tuple(s.tokens[: s.start].tolist()) in held_prompts]
    data = [s for s in samples if tuple(s.tokens[: s.start].tolist()) not in held_prompts]
    vocab = draft_vocab(data, settings.vocab, lm.eos_token_ids)
    say(f"data: {len(data)} training and {len(held)} held-out sequences, draft vocabulary {len(vocab)} "
        f"({time.perf_counter() - t0:.0f} s)")
    meta = {"command": "python -m engine.strategies.eagle_train " + " ".join(sys.argv[1:] if argv is None else argv),
            "settings": asdict(settings), "data": "greedy continuations of engine/assets/medusa_prompts.txt"}
    head = initial_head(lm, vocab, layers, meta)
    acc, steps = train(head, data, held, settings)
    seconds = time.perf_counter() - t0
    head.head.meta |= {"heldout_top1": [round(a, 4) for a in acc], "steps": steps, "seconds": round(seconds, 1)}
    path = Path(settings.out) if settings.out else head_path(lm.name)
    digest = save_head(head, path)
    size = path.stat().st_size / 1e6
    say(f"wrote {path} ({size:.1f} MB, sha256 {digest[:12]}); wall time {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
