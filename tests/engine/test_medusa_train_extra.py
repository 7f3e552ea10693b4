"""Medusa head training: the self-distilled text cache (safetensors round trip, checked against the
settings it was made with), the soft targets (the base model's distribution at the position that
chose each head's label) and the argument checks. On the tiny random Llama: fast, meaningless."""

from __future__ import annotations

import pytest
import torch

from engine.strategies import medusa_train
from engine.strategies.medusa import MedusaHeads
from engine.strategies.medusa_train import (Settings, cached_text, labels_for, parse, shortlist, teacher_logprobs, to_shortlist, train)

PROMPTS = ["Say hi.", "Name a colour.", "Count to three.", "What is tea?"]


def small(**changes) -> Settings:
    return Settings(**{"heads": 3, "tokens": 6, "holdout": 1, "gen_batch": 2, "epochs": 2, "batch": 8, **changes})


def test_the_cache_is_written_then_loaded_unchanged(tiny_lm, tmp_path, monkeypatch):
    data, held = cached_text(tiny_lm, PROMPTS, small(), tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["heldout.safetensors", "train.safetensors"]
    assert int(data[2].sum()) == len(data[0]) == len(data[1]) and len(data[2]) == 3 and len(held[2]) == 1

    def no_generation(*args, **kwargs):
        raise AssertionError("generated although the cache holds the text")

    monkeypatch.setattr(medusa_train, "generate_text", no_generation)
    again = cached_text(tiny_lm, PROMPTS, small(heads=2), tmp_path / "cache")  # labels are rebuilt per --heads
    for before, after in zip(data + held, again[0] + again[1]):
        assert torch.equal(before, after)


def test_a_cache_made_with_other_settings_is_refused(tiny_lm, tmp_path):
    cached_text(tiny_lm, PROMPTS, small(), tmp_path)
    with pytest.raises(SystemExit, match="--data-cache"):
        cached_text(tiny_lm, PROMPTS, small(tokens=5), tmp_path)
    with pytest.raises(SystemExit, match="--data-cache"):
        cached_text(tiny_lm, PROMPTS[::-1], small(), tmp_path)


def test_the_soft_target_of_head_k_is_the_distribution_that_chose_its_label(tiny_lm):
    """Greedy text: the hard label of head k at j is the argmax of the teacher at j + k."""
    (hidden, tokens, lengths), _ = cached_text(tiny_lm, PROMPTS, small(), None)
    labels = labels_for(tokens, lengths, 3)
    vocab = shortlist(torch.cat([tokens[:, None], labels], 1), 8192)
    heads = MedusaHeads(hidden.shape[1], 3, vocab)
    teacher = teacher_logprobs(heads, tiny_lm.model.get_output_embeddings(), hidden)
    assert teacher.shape == (len(hidden), len(vocab))
    torch.testing.assert_close(teacher.float().exp().sum(-1), torch.ones(len(hidden)), atol=1e-2, rtol=0)
    chosen = vocab[teacher.float().argmax(-1)]
    assert torch.equal(chosen, tokens)
    for k in range(1, 4):
        valid = labels[:, k - 1] != -100
        assert torch.equal(labels[valid.nonzero()[:, 0], k - 1], chosen[valid.nonzero()[:, 0] + k])


@pytest.mark.parametrize("soft", [0.0, 0.5, 1.0])
def test_training_with_soft_targets_runs_and_moves_the_heads(tiny_lm, soft):
    (hidden, tokens, lengths), (held_hidden, held_tokens, held_lengths) = cached_text(tiny_lm, PROMPTS, small(), None)
    labels = labels_for(tokens, lengths, 3)
    heads = MedusaHeads(hidden.shape[1], 3, shortlist(labels, 8192))
    held = (held_hidden, labels_for(held_tokens, held_lengths, 3))
    acc = train(tiny_lm, heads, (hidden, labels), held, small(soft=soft))
    assert len(acc) == 3 and all(0.0 <= a <= 1.0 for a in acc)
    assert heads.weight.abs().sum() > 0
    assert to_shortlist(labels, heads.vocab, tiny_lm.vocab_size).max() < len(heads.vocab)


@pytest.mark.parametrize("argv, message", [
    (["--soft", "1.5"], "--soft: must be between 0.0"),
    (["--soft", "-0.1"], "--soft: must be between 0.0"),
    (["--lr", "0"], "--lr: must be more than 0"),
    (["--weight-decay", "-1"], "--weight-decay: must be 0 or more"),
])
def test_arguments_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


def test_the_data_cache_must_be_a_directory(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        parse(["--data-cache", str(tmp_path / "file")])
    assert f"--data-cache: must be a directory, got the file {tmp_path / 'file'}" in capsys.readouterr().err
    assert parse(["--data-cache", str(tmp_path / "new"), "--soft", "0.5"]).soft == 0.5
