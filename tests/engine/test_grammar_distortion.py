"""Issue #39's distortion view (engine.reports.distortion), against brute force: every tokenization
of every string of a small finite grammar is listed from the vocabulary's texts, each scored with
one uncached forward over the whole sequence (transformers, no KV cache, no grammar library), and
the two distributions are rebuilt from those scores alone: the model conditioned on the grammar,
and masked decoding with its allowed mass Z worked out from the strings themselves."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import ConfigError, DecodingConfig
from engine.reports.distortion import NotEnumerable, distortion_report
from engine.runner import RUNS

UMBRELLA = ("Should I take an umbrella today?", ("Yes", "No", "Maybe"))
COLOURS = ("What colour is the sky?", ("Blue", "Grey", "Red", "Green", "Pink", "Gold"))


def vocabulary(lm) -> dict[str, list[int]]:
    """Each text a single token decodes to -> the ids that decode to it (special tokens and parts of
    a character left out: no grammar of plain words allows them)."""
    specials = set(lm.tokenizer.all_special_ids)
    out: dict[str, list[int]] = {}
    for i in range(len(lm.tokenizer)):
        text = lm.tokenizer.decode([i])
        if i not in specials and text and "\ufffd" not in text:
            out.setdefault(text, []).append(i)
    return out


def tokenizations(text: str, vocab: dict[str, list[int]]) -> list[list[int]]:
    """Every sequence of token ids whose texts spell ``text``."""
    if not text:
        return [[]]
    out = []
    for cut in range(1, len(text) + 1):
        for token in vocab.get(text[:cut], []):
            out += [[token] + rest for rest in tokenizations(text[cut:], vocab)]
    return out


@torch.inference_mode()
def brute_force(lm, prompt: str, strings: tuple[str, ...]) -> tuple[dict[str, float], dict[str, float]]:
    """(exact, masked) by string, from uncached forwards over prompt + path + end, one per path."""
    vocab = vocabulary(lm)
    texts = {i: t for t, ids in vocab.items() for i in ids}
    ids = lm.encode(prompt, True)
    eos = lm.eos_token_ids[0]
    joint, masked = {}, {}
    for s in strings:
        joint[s] = masked[s] = 0.0
        for path in tokenizations(s, vocab):
            sequence = ids + path + [eos]
            logp = torch.log_softmax(lm.model(torch.tensor([sequence])).logits[0].double(), -1)  # [T, V]
            rows = logp[len(ids) - 1: len(sequence) - 1]  # the distributions that picked path + end
            score, log_q, spelled = 0.0, 0.0, ""
            for row, token in zip(rows, path + [eos]):
                allowed = [t for t, x in texts.items() if any(w.startswith(spelled + x) for w in strings)]
                allowed += [e for e in lm.eos_token_ids if spelled in strings]
                score += float(row[token])
                log_q += float(row[token]) - float(torch.logsumexp(row[allowed], 0))
                spelled += texts.get(token, "")
            joint[s] += math.exp(score)
            masked[s] += math.exp(log_q)
    total = sum(joint.values())
    return {s: p / total for s, p in joint.items()}, masked


@pytest.mark.slow
@pytest.mark.parametrize("prompt, strings", [UMBRELLA, COLOURS], ids=["3 answers", "6 colours"])
def test_both_distributions_sum_to_one_and_match_brute_force(embedded, prompt, strings):
    config = DecodingConfig(strategy="sample", grammar="(" + "|".join(strings) + ")", grammar_kind="regex")
    report = distortion_report(embedded, prompt, config, chat=True)
    assert {s.text for s in report.strings} == set(strings)
    assert sum(s.exact for s in report.strings) == pytest.approx(1.0, abs=1e-9)
    assert sum(s.masked for s in report.strings) == pytest.approx(1.0, abs=1e-6)  # not renormalised
    exact, masked = brute_force(embedded, prompt, strings)
    for s in report.strings:
        assert s.exact == pytest.approx(exact[s.text], rel=1e-3, abs=1e-9), s
        assert s.masked == pytest.approx(masked[s.text], rel=1e-3, abs=1e-9), s
    assert report.total_variation == pytest.approx(0.5 * sum(abs(exact[t] - masked[t]) for t in strings), abs=1e-3)


def test_a_grammar_too_big_to_enumerate_is_one_line(tiny_lm):
    config = DecodingConfig(strategy="sample", grammar="[a-z]+", grammar_kind="regex")
    with pytest.raises(NotEnumerable) as err:
        distortion_report(tiny_lm, "x", config, max_prefixes=40)
    assert str(err.value).startswith("grammar: more than 40 token prefixes") and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="^grammar: the distortion view needs a grammar"):
        distortion_report(tiny_lm, "x", DecodingConfig(strategy="sample"))


@pytest.mark.slow
def test_the_lesson_checks_its_claim_and_its_batched_sweep_equals_runs_alone(embedded):
    """The lesson "JSON mode never breaks the format: what it costs" on the embedded model: every run
    of its seed sweep writes one of the three answers, both exact distributions sum to 1 and differ;
    the sweep's runs, stepped together by a scheduler of their own, equal the same runs alone."""
    from engine import runner
    from engine.reports import lessons
    from engine.runner import RunRequest

    lesson = lessons.builtin_lessons()["grammar"]
    traces = lessons.run_lesson(embedded, lesson, runs=RUNS)
    outcome = lessons.evaluate(embedded, lesson, traces, runs=RUNS)
    assert outcome.ok and outcome.figures["valid_runs"] == outcome.figures["runs"] == 8, outcome.summary
    assert {s.text for s in outcome.report.strings} == set(UMBRELLA[1])
    assert outcome.figures["exact_sum"] == pytest.approx(1.0, abs=1e-9)
    assert outcome.figures["masked_sum"] == pytest.approx(1.0, abs=1e-6)
    top = max(outcome.report.strings, key=lambda s: s.masked)
    assert f"picks {top.text!r} {top.masked:.0%} of the time" in outcome.summary  # the sentence is the numbers'
    config, ids = lesson.runs[0].config, traces[0].prompt_token_ids
    for seed_offset, swept in enumerate(lessons._seed_sweep(embedded, lesson, config, ids, 4, RUNS), start=1):
        alone = runner.run(RunRequest(embedded, lesson.prompt, config.replace(seed=config.seed + seed_offset),
                                      chat=True, prompt_ids=ids))
        assert swept.generated_token_ids == alone.generated_token_ids and swept.text in UMBRELLA[1]
