"""Train Medusa-1 heads by self-distillation: the base model writes its own training text.

    python -m engine.strategies.medusa_train [--model embedded] [--heads 4] [--tokens 96] [--epochs 4]
                                  [--soft 0.0] [--data-cache DIR]

1. The base model continues each prompt of ``engine/assets/medusa_prompts.txt`` (chat template,
   greedy, batched, prompts of similar length together) and returns, as it generates, the final
   hidden state h_j of every generated position j: exactly what the heads see when decoding with
   the cache (the LM head is frozen and shared; nothing else is trained). ``--data-cache DIR``
   keeps that text (hidden states, tokens, lengths) as safetensors files in DIR: a later run
   with the same model, prompts, ``--tokens`` and ``--holdout`` loads it instead of generating.
2. Head k learns, by cross-entropy, the token k + 1 positions after j. With ``--soft w`` a
   share w of the loss is instead the cross-entropy against the base model's own distribution
   for that token (the LM head's softmax on h_{j+k}, renormalised over the shortlist: the
   Medusa paper's self-distillation); w = 0 trains on the hard labels only. The heads read out and
   propose only a shortlist: the ``--vocab`` most frequent tokens of that text (the model's own
   words; 6x cheaper to train and to read out than the 49,152-token vocabulary); labels outside it
   count as misses in the accuracy.
3. The last ``--holdout`` prompts are never trained on; per-head top-1 accuracy on their text is
   printed after each epoch. The heads go to ``engine/assets/medusa-<model>.safetensors`` (float16,
   with the shortlist) with a ``.sha256`` and a ``.json`` holding this command, the settings and
   the accuracies.

The defaults finish in about 23 minutes on an otherwise idle 2-core CPU; on a GPU raise
``--tokens``, ``--epochs`` and the prompt set for bigger models.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.base.seam import Model
from engine.strategies.medusa import ASSETS, MedusaHeads, head_logits, heads_path, save_heads, shortlist_logits
from engine.backends.local import ModelSpec, load_model
from engine.threads import set_threads

PROMPTS = ASSETS / "medusa_prompts.txt"
HEAD_DECAY = 0.8  # head k's loss weight is 0.8^k (the Medusa paper's): later heads are harder


@dataclass
class Settings:
    model: str = "embedded"
    heads: int = 4
    tokens: int = 96  # generated per prompt
    epochs: int = 4
    batch: int = 256  # positions per optimiser step
    lr: float = 3e-3
    weight_decay: float = 0.0
    soft: float = 0.0  # weight of the soft-target loss (the base model's distribution), 1 - soft on the hard label
    vocab: int = 8192  # shortlist size (0 = the whole vocabulary)
    prompts: int = 0  # use only the first N prompts of the file (0 = all)
    holdout: int = 18  # prompts kept for evaluation (the last ones)
    gen_batch: int = 128
    seed: int = 0
    threads: int = 2


def read_prompts(path: Path) -> list[str]:
    """One prompt per non-empty line; the two characters ``\\n`` in a line stand for a newline (the
    edit prompts carry their paragraph after a blank line)."""
    return [line.strip().replace("\\n", "\n") for line in path.read_text().splitlines() if line.strip()]


def say(text: str) -> None:
    print(text, flush=True)


@torch.inference_mode()
def generate_text(lm: Model, prompts: list[str],
                  settings: Settings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generate a greedy continuation per prompt; return the final hidden states [N, H] of the
    positions that chose a generated token, the tokens they chose [N] and the length of each
    continuation [P] (they are concatenated in that order, the shortest prompts first)."""
    tok = lm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else lm.eos_token_ids[0]
    encoded = sorted((lm.encode(p, chat=True) for p in prompts), key=len)  # similar lengths: little padding
    hiddens, tokens, lengths = [], [], []
    t0, done = time.perf_counter(), 0
    for start in range(0, len(encoded), settings.gen_batch):
        rows = encoded[start: start + settings.gen_batch]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=lm.device)  # left padding
        mask = (torch.arange(width) >= torch.tensor([width - len(r) for r in rows])[:, None]).long().to(lm.device)
        out = lm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=settings.tokens, do_sample=False,
                                pad_token_id=pad, eos_token_id=list(lm.eos_token_ids), output_hidden_states=True,
                                return_dict_in_generate=True)
        # step 0: the prompt's last position chose generated token 0; step s: generated token s - 1's position
        steps = [out.hidden_states[0][-1][:, -1]] + [h[-1][:, 0] for h in out.hidden_states[1:]]
        hidden = torch.stack(steps, dim=1).float().cpu()  # [B, S, H]
        for row in range(len(rows)):
            generated = out.sequences[row, width:].tolist()
            ends = [i for i, t in enumerate(generated) if t in lm.eos_token_ids]
            generated = generated[: ends[0] + 1] if ends else generated
            hiddens.append(hidden[row, : len(generated)])
            tokens.append(torch.tensor(generated, dtype=torch.long))
            lengths.append(len(generated))
        done += len(rows)
        say(f"  generated {done}/{len(encoded)} prompts ({time.perf_counter() - t0:.0f} s)")
    return torch.cat(hiddens), torch.cat(tokens), torch.tensor(lengths, dtype=torch.long)


def labels_for(tokens: torch.Tensor, lengths: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[N, K] labels of concatenated continuations (``tokens`` [N], split by ``lengths``)."""
    return torch.cat([_labels(part.tolist(), num_heads) for part in torch.split(tokens, lengths.tolist())])


def _labels(generated: list[int], num_heads: int) -> torch.Tensor:
    """[len(generated), K]: at the position that chose generated[s], head k's label generated[s + k]."""
    y = torch.full((len(generated), num_heads), -100, dtype=torch.long)
    for s in range(len(generated)):
        for k in range(1, num_heads + 1):
            if s + k < len(generated):
                y[s, k - 1] = generated[s + k]
    return y


CACHE_FILES = ("train.safetensors", "heldout.safetensors")


def _cache_key(lm: Model, prompts: list[str], settings: Settings) -> dict[str, str]:
    """What the self-distilled text depends on (stored with it and checked when it is loaded)."""
    digest = hashlib.sha256("\n".join(prompts).encode()).hexdigest()
    return {"base_model": lm.name, "tokens": str(settings.tokens), "holdout": str(settings.holdout),
            "prompts_sha256": digest}


def cached_text(lm: Model, prompts: list[str], settings: Settings,
                cache: Path | None) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The self-distilled (hidden, tokens, lengths) of the training and the held-out prompts:
    loaded from ``cache`` (a directory of safetensors files) when it holds them for the same
    model, prompts, ``--tokens`` and ``--holdout``; otherwise generated (and saved there)."""
    key = _cache_key(lm, prompts, settings)
    files = [cache / name for name in CACHE_FILES] if cache is not None else []
    if files and all(f.exists() for f in files):
        parts = []
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                stored = handle.metadata() or {}
                differ = [f"{k}={stored.get(k)} (not {v})" for k, v in key.items() if stored.get(k) != v]
                if differ:
                    raise SystemExit(f"--data-cache: {f} holds text for other settings: {', '.join(differ)}; "
                                     f"use another directory or delete it")
                parts.append(tuple(handle.get_tensor(n) for n in ("hidden", "tokens", "lengths")))
        say(f"loaded the self-distilled text from {cache}")
        return parts[0], parts[1]
    data = generate_text(lm, prompts[: -settings.holdout], settings)
    held = generate_text(lm, prompts[-settings.holdout:], settings)
    if cache is not None:  # files name its contents
        cache.mkdir(parents=True, exist_ok=True)
        for f, part in zip(files, (data, held)):
            save_file({n: t.contiguous() for n, t in zip(("hidden", "tokens", "lengths"), part)}, str(f), metadata=key)
        say(f"saved the self-distilled text to {cache}")
    return data, held


def shortlist(labels: torch.Tensor, size: int) -> torch.Tensor | None:
    """The ``size`` most frequent label tokens, sorted by id (None: ``size`` 0, the whole vocabulary)."""
    if size == 0:
        return None
    counts = Counter(labels[labels != -100].tolist())
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)), dtype=torch.long)


def to_shortlist(labels: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Labels as indices into the shortlist (-100 where absent: not trainable)."""
    if vocab is None:
        return labels
    index = torch.full((vocab_size,), -100, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    return torch.where(labels == -100, labels, index[labels.clamp_min(0)])


@torch.inference_mode()
def accuracy(heads: MedusaHeads, lm_head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor) -> list[float]:
    """Per-head top-1 accuracy over the positions that have a label (full-vocabulary ids)."""
    hits = torch.zeros(heads.num_heads)
    counts = torch.zeros(heads.num_heads)
    for start in range(0, len(hidden), 256):
        pred = head_logits(heads, lm_head, hidden[start: start + 256]).argmax(-1).cpu()  # [B, K]
        y = labels[start: start + 256].cpu()
        valid = y != -100
        hits += ((pred == y) & valid).sum(0)
        counts += valid.sum(0)
    return (hits / counts.clamp_min(1)).tolist()


@torch.inference_mode()
def teacher_logprobs(heads: MedusaHeads, lm_head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The base model's own next-token log-probabilities at every position [N, V'] (float16),
    renormalised over the shortlist (the whole vocabulary without one): computed once, read by
    every epoch (0.55 GB for the defaults' 58k positions x 4.7k tokens; 10x that with --vocab 0)."""
    out = []
    for start in range(0, len(hidden), 1024):
        h = hidden[start: start + 1024]
        logits = shortlist_logits(heads, lm_head, h[:, None])[:, 0] if len(heads.vocab) else lm_head(h).float()
        out.append(torch.log_softmax(logits, dim=-1).to(torch.float16))
    return torch.cat(out)


def train(lm: Model, heads: MedusaHeads, data: tuple[torch.Tensor, torch.Tensor], held: tuple[torch.Tensor, torch.Tensor],
          settings: Settings) -> list[float]:
    """AdamW on the per-head loss over the shortlist (head k weighted 0.8^k); prints progress and
    held-out accuracy. The loss mixes the cross-entropy against the hard label (weight 1 - soft)
    and the Medusa paper's self-distillation loss (weight soft): the cross-entropy against the
    base model's own distribution at the labelled position, i.e. head k at position j learns the
    softmax of the LM head on h_{j+k}, the hidden state that chose head k's label."""
    lm_head = lm.model.get_output_embeddings()
    lm_head.requires_grad_(False)
    hidden, labels = data
    targets = to_shortlist(labels, heads.vocab.cpu() if len(heads.vocab) else None, lm.vocab_size).to(hidden.device)
    weights = torch.tensor([HEAD_DECAY ** k for k in range(heads.num_heads)], device=hidden.device)
    ahead = torch.arange(1, heads.num_heads + 1, device=hidden.device)  # head k's label was chosen at j + k
    teacher = teacher_logprobs(heads, lm_head, hidden) if settings.soft > 0 else None
    opt = torch.optim.AdamW(heads.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    gen = torch.Generator().manual_seed(settings.seed)
    total = math.ceil(len(hidden) / settings.batch) * settings.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=settings.lr, total_steps=total, pct_start=0.1)
    t0, step = time.perf_counter(), 0
    acc = accuracy(heads, lm_head, *held)
    say(f"held-out top-1 before training (= base head, k+1 ahead): {_fmt(acc)}")
    for epoch in range(settings.epochs):
        order = torch.randperm(len(hidden), generator=gen)
        for start in range(0, len(hidden), settings.batch):
            idx = order[start: start + settings.batch].to(hidden.device)
            states = heads(hidden[idx])  # [B, K, H]
            logits = shortlist_logits(heads, lm_head, states) if len(heads.vocab) else lm_head(states).float()
            y = targets[idx]  # [B, K]
            loss = torch.zeros(())
            if settings.soft < 1:
                per_head = torch.nn.functional.cross_entropy(logits.permute(0, 2, 1), y, ignore_index=-100,
                                                             reduction="none")  # [B, K]
                loss = loss + (1 - settings.soft) * _mean_per_head(per_head, y != -100, weights)
            if teacher is not None:
                labelled = labels[idx] != -100  # j + k lies in the same text: its hidden state is h_{j+k}
                rows = torch.where(labelled, idx[:, None] + ahead, idx[:, None])  # [B, K]
                p = teacher[rows].float().exp()  # [B, K, V']
                per_head = -(p * torch.log_softmax(logits, dim=-1)).sum(-1)  # [B, K]
                loss = loss + settings.soft * _mean_per_head(per_head, labelled, weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0 or step == total:
                say(f"  epoch {epoch + 1} step {step}/{total} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
        acc = accuracy(heads, lm_head, *held)
        say(f"epoch {epoch + 1}: held-out top-1 per head {_fmt(acc)}")
    return acc


def _mean_per_head(per_head: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sum over heads of ``weights`` x the mean of ``per_head`` [B, K] over its ``valid`` positions."""
    valid = valid.float()
    return ((per_head * valid).sum(0) / valid.sum(0).clamp_min(1) * weights).sum()


def _fmt(acc: list[float]) -> str:
    return ", ".join(f"head {k + 1}: {a:.3f}" for k, a in enumerate(acc))


def parse(argv: list[str] | None) -> Settings:
    """The training settings of a command line (``parse_run``'s first)."""
    return parse_run(argv)[0]


def parse_run(argv: list[str] | None) -> tuple[Settings, str | None, str | None]:
    """A command line's training settings, its ``--out`` file and its ``--data-cache`` directory
    (None: not given); a bad value exits in one line naming the argument."""
    defaults = Settings()
    p = argparse.ArgumentParser(prog="python -m engine.strategies.medusa_train", description=__doc__.split("\n")[0])
    for name, value in asdict(defaults).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--out", default=None, help="output .safetensors (default engine/assets/medusa-<model>.safetensors)")
    p.add_argument("--data-cache", default=None, metavar="DIR",
                   help="directory of the self-distilled text (safetensors): loaded if there, else generated and saved")
    args = p.parse_args(argv)
    out = args.out
    if args.data_cache is not None and os.path.isfile(args.data_cache):
        p.error(f"--data-cache: must be a directory, got the file {args.data_cache}")
    settings = Settings(**{k: getattr(args, k) for k in asdict(defaults)})
    if settings.prompts < 0:
        p.error(f"--prompts: must be 0 (all) or more, got {settings.prompts}")
    if not 0.0 <= settings.soft <= 1.0:
        p.error(f"--soft: must be between 0.0 (hard labels only) and 1.0 (soft targets only), got {settings.soft}")
    if settings.lr <= 0:
        p.error(f"--lr: must be more than 0, got {settings.lr}")
    if settings.weight_decay < 0:
        p.error(f"--weight-decay: must be 0 or more, got {settings.weight_decay}")
    if settings.vocab < 0:
        p.error(f"--vocab: must be 0 (the whole vocabulary) or more, got {settings.vocab}")
    for name in ("heads", "tokens", "epochs", "batch", "holdout", "gen_batch", "threads"):
        if getattr(settings, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(settings, name)}")
    return settings, out, args.data_cache


def main(argv: list[str] | None = None) -> int:
    settings, out, data_cache = parse_run(argv)
    set_threads(settings.threads)
    torch.manual_seed(settings.seed)
    t0 = time.perf_counter()
    lm = load_model(ModelSpec(settings.model, device="cpu" if not torch.cuda.is_available() else "auto", dtype="float32"))
    prompts = read_prompts(PROMPTS)
    prompts = prompts[: settings.prompts] if settings.prompts else prompts
    if settings.holdout >= len(prompts):
        raise SystemExit(f"--holdout: {settings.holdout} leaves no training prompts (the file has {len(prompts)})")
    say(f"{lm.name}: self-distilling {len(prompts)} prompts x {settings.tokens} tokens, {settings.heads} heads")
    cache = Path(data_cache) if data_cache else None
    text, held_text = cached_text(lm, prompts, settings, cache)
    data = (text[0], labels_for(text[1], text[2], settings.heads))
    held = (held_text[0], labels_for(held_text[1], held_text[2], settings.heads))
    say(f"self-distilled ({time.perf_counter() - t0:.0f} s)")
    say(f"{len(data[0])} training positions, {len(held[0])} held-out positions ({time.perf_counter() - t0:.0f} s)")
    vocab = shortlist(data[1], settings.vocab)
    heads = MedusaHeads(int(lm.model.config.hidden_size), settings.heads, vocab).to(lm.device)
    say(f"shortlist: {len(vocab) if vocab is not None else lm.vocab_size} tokens")
    acc = train(lm, heads, (data[0].to(lm.device), data[1].to(lm.device)), (held[0].to(lm.device), held[1].to(lm.device)), settings)
    path = out and os.path.abspath(out) or heads_path(lm.name)
    meta = {"base_model": lm.name, "heads": settings.heads, "hidden": int(lm.model.config.hidden_size)}
    digest = save_heads(heads, Path(path), meta)
    info = {"command": "python -m engine.strategies.medusa_train " + " ".join(argv if argv is not None else sys.argv[1:]),
            "settings": {k: v for k, v in asdict(settings).items()}, "base_model": lm.name,
            "train_positions": len(data[0]), "heldout_positions": len(held[0]),
            "shortlist": len(heads.vocab) or lm.vocab_size,
            "heldout_top1": [round(a, 4) for a in acc], "seconds": round(time.perf_counter() - t0, 1),
            "sha256": digest, "torch": torch.__version__}
    Path(path).with_suffix(".json").write_text(json.dumps(info, indent=2) + "\n")
    say(f"wrote {path} ({Path(path).stat().st_size / 1e6:.1f} MB, sha256 {digest[:12]}...) in {info['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
