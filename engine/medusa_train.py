"""Train Medusa-1 heads by self-distillation: the base model writes its own training text.

    python -m engine.medusa_train [--model embedded] [--heads 4] [--tokens 96] [--epochs 2]

1. The base model continues each prompt of ``engine/assets/medusa_prompts.txt`` (chat template,
   greedy, batched), so the heads learn what the model itself says.
2. One forward per batch over prompt + continuation gives the final hidden state h_j of every
   generated position j (the LM head is frozen and shared; nothing else is trained).
3. Head k learns, by cross-entropy over the full vocabulary, the token k + 1 positions after j.
4. The last ``--holdout`` prompts are never trained on; per-head top-1 accuracy on their text is
   printed after each epoch. The heads go to ``engine/assets/medusa-<model>.safetensors`` (float16)
   with a ``.sha256`` and a ``.json`` holding this command, the settings and the accuracies.

The defaults finish in about 15-25 minutes on a shared 2-core CPU; on a GPU raise ``--tokens``,
``--epochs`` and ``--prompts`` for bigger models.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

from .medusa import ASSETS, MedusaHeads, head_logits, heads_path, save_heads
from .models import LoadedModel, ModelSpec, load_model

PROMPTS = ASSETS / "medusa_prompts.txt"


@dataclass
class Settings:
    model: str = "embedded"
    heads: int = 4
    tokens: int = 96  # generated per prompt
    epochs: int = 2
    batch: int = 128  # positions per optimiser step
    lr: float = 1e-3
    prompts: int = 0  # use only the first N prompts of the file (0 = all)
    holdout: int = 18  # prompts kept for evaluation (the last ones)
    gen_batch: int = 32
    seed: int = 0
    threads: int = 2


def say(text: str) -> None:
    print(text, flush=True)


@torch.inference_mode()
def self_distill(lm: LoadedModel, prompts: list[str], settings: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate a greedy continuation per prompt; return hidden states [N, H] of the generated
    positions and their labels [N, K] (label k is the token k + 2 after the position; -100 where
    the text ends first)."""
    tok = lm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else lm.eos_token_ids[0]
    hiddens, labels = [], []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), settings.gen_batch):
        rows = [lm.encode(p, chat=True) for p in prompts[start: start + settings.gen_batch]]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # left padding
        mask = (torch.arange(width) >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
        out = lm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=settings.tokens, do_sample=False,
                                pad_token_id=pad, eos_token_id=list(lm.eos_token_ids))
        for row, full in zip(rows, out):
            generated = full[width:].tolist()
            ends = [i for i, t in enumerate(generated) if t in lm.eos_token_ids]
            generated = generated[: ends[0] + 1] if ends else generated
            h, y = _positions(lm, row, generated, settings.heads)
            hiddens.append(h)
            labels.append(y)
        say(f"  generated {min(start + settings.gen_batch, len(prompts))}/{len(prompts)} prompts "
            f"({time.perf_counter() - t0:.0f} s)")
    return torch.cat(hiddens), torch.cat(labels)


def _positions(lm: LoadedModel, prompt: list[int], generated: list[int], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states at positions j = len(prompt) - 1 ... (those whose next token is generated)
    and the labels s_{j+2} .. s_{j+1+K} for the heads."""
    seq = prompt + generated
    out = lm.model(input_ids=torch.tensor([seq]), output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1][0].float()  # [T, H], normalised (the LM head's input)
    first = len(prompt) - 1
    positions = range(first, len(seq) - 1)
    y = torch.full((len(positions), num_heads), -100, dtype=torch.long)
    for row, j in enumerate(positions):
        for k in range(1, num_heads + 1):
            if j + 1 + k < len(seq):
                y[row, k - 1] = seq[j + 1 + k]
    return hidden[first: len(seq) - 1], y


@torch.inference_mode()
def accuracy(heads: MedusaHeads, lm_head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> list[float]:
    """Per-head top-1 accuracy over the positions that have a label."""
    hits = torch.zeros(heads.num_heads)
    counts = torch.zeros(heads.num_heads)
    for start in range(0, len(hidden), 256):
        pred = head_logits(heads, lm_head, hidden[start: start + 256]).argmax(-1)  # [B, K]
        y = labels[start: start + 256]
        valid = y != -100
        hits += ((pred == y) & valid).sum(0)
        counts += valid.sum(0)
    return (hits / counts.clamp_min(1)).tolist()


def train(lm: LoadedModel, heads: MedusaHeads, data: tuple[torch.Tensor, torch.Tensor], held: tuple[torch.Tensor, torch.Tensor],
          settings: Settings) -> list[float]:
    """Adam on the summed per-head cross-entropy; prints progress and held-out accuracy."""
    lm_head = lm.model.get_output_embeddings()
    lm_head.requires_grad_(False)
    hidden, labels = data
    opt = torch.optim.AdamW(heads.parameters(), lr=settings.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(settings.seed)
    steps_per_epoch = math.ceil(len(hidden) / settings.batch)
    total = steps_per_epoch * settings.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=settings.lr, total_steps=total, pct_start=0.1)
    t0, step = time.perf_counter(), 0
    acc = accuracy(heads, lm_head, *held)
    say(f"held-out top-1 before training (= base head, k+1 ahead): {_fmt(acc)}")
    for epoch in range(settings.epochs):
        order = torch.randperm(len(hidden), generator=gen)
        for start in range(0, len(hidden), settings.batch):
            idx = order[start: start + settings.batch]
            logits = head_logits(heads, lm_head, hidden[idx])  # [B, K, V]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[idx].flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 20 == 0 or step == total:
                say(f"  epoch {epoch + 1} step {step}/{total} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
        acc = accuracy(heads, lm_head, *held)
        say(f"epoch {epoch + 1}: held-out top-1 per head {_fmt(acc)}")
    return acc


def _fmt(acc: list[float]) -> str:
    return ", ".join(f"head {k + 1}: {a:.3f}" for k, a in enumerate(acc))


def parse(argv: list[str] | None) -> Settings:
    defaults = Settings()
    p = argparse.ArgumentParser(prog="python -m engine.medusa_train", description=__doc__.split("\n")[0])
    for name, value in asdict(defaults).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--out", default=None, help="output .safetensors (default engine/assets/medusa-<model>.safetensors)")
    args = p.parse_args(argv)
    out = args.out
    settings = Settings(**{k: getattr(args, k) for k in asdict(defaults)})
    if settings.prompts < 0:
        p.error(f"--prompts: must be 0 (all) or more, got {settings.prompts}")
    for name in ("heads", "tokens", "epochs", "batch", "holdout", "gen_batch", "threads"):
        if getattr(settings, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(settings, name)}")
    settings.out = out  # type: ignore[attr-defined]
    return settings


def main(argv: list[str] | None = None) -> int:
    settings = parse(argv)
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    t0 = time.perf_counter()
    lm = load_model(ModelSpec(settings.model, device="cpu" if not torch.cuda.is_available() else "auto", dtype="float32"))
    prompts = [line.strip() for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = prompts[: settings.prompts] if settings.prompts else prompts
    if settings.holdout >= len(prompts):
        raise SystemExit(f"--holdout: {settings.holdout} leaves no training prompts (the file has {len(prompts)})")
    say(f"{lm.name}: self-distilling {len(prompts)} prompts x {settings.tokens} tokens, {settings.heads} heads")
    data = self_distill(lm, prompts[: -settings.holdout], settings)
    held = self_distill(lm, prompts[-settings.holdout:], settings)
    say(f"{len(data[0])} training positions, {len(held[0])} held-out positions ({time.perf_counter() - t0:.0f} s)")
    heads = MedusaHeads(int(lm.model.config.hidden_size), settings.heads).to(lm.device)
    acc = train(lm, heads, (data[0].to(lm.device), data[1].to(lm.device)), (held[0].to(lm.device), held[1].to(lm.device)), settings)
    path = settings.out and os.path.abspath(settings.out) or heads_path(lm.name)
    meta = {"base_model": lm.name, "heads": settings.heads, "hidden": int(lm.model.config.hidden_size)}
    from pathlib import Path

    digest = save_heads(heads, Path(path), meta)
    info = {"command": "python -m engine.medusa_train " + " ".join(argv if argv is not None else sys.argv[1:]),
            "settings": {k: v for k, v in asdict(settings).items()}, "base_model": lm.name,
            "train_positions": len(data[0]), "heldout_positions": len(held[0]),
            "heldout_top1": [round(a, 4) for a in acc], "seconds": round(time.perf_counter() - t0, 1),
            "sha256": digest, "torch": torch.__version__}
    Path(path).with_suffix(".json").write_text(json.dumps(info, indent=2) + "\n")
    say(f"wrote {path} ({Path(path).stat().st_size / 1e6:.1f} MB, sha256 {digest[:12]}...) in {info['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
