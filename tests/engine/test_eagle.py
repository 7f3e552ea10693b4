"""EAGLE (issue #53): greedy equals the target's own greedy token for token; the tree verify's
logits and features equal an uncached recompute of each tree path; sampling keeps the target's
distribution (chi-square, as tests/engine/test_speculative.py); the head file's atomic save, checksum and
round trip; the training script's pieces on a tiny model; the shipped head."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from tests.helpers.common import make_tiny_llama
from engine import runner
from engine.config import ConfigError, DecodingConfig
from engine.strategies import decode, eagle, eagle_head, eagle_train
from engine.strategies.eagle import Budget
from engine.strategies.eagle_head import feature_layers, load_head, save_head
from engine.strategies.medusa import TreeNode
from engine.trace import Trace
from tests.helpers.eagle import random_head
from tests.helpers.speculative import chi_square_p, exact_two_token_joint, wrap

GREEDY = DecodingConfig(strategy="eagle", temperature=0.0, max_new_tokens=20)


def target_only(lm, ids, config) -> list[int]:
    base = config.replace(strategy="greedy" if config.is_greedy else "sample")
    return [s.chosen_token_id for s in decode.stream(lm, ids, base)]


@pytest.mark.parametrize("budget", [Budget(1, 1, 1), Budget(12, 5, 4), Budget(24, 6, 3)],
                         ids=["one", "default", "deep"])
def test_greedy_eagle_equals_target_greedy(tiny_lm, budget):
    ids = tiny_lm.encode("a b a b a b")
    trace = runner.collect(eagle.stream(tiny_lm, "", ids, GREEDY, head=random_head(tiny_lm, 512), budget=budget))
    assert trace.generated_token_ids == target_only(tiny_lm, ids, GREEDY)
    records = eagle.rounds_of(Trace.from_json(trace.to_json()))
    assert records and all(len(r.tree) <= budget.tokens for r in records)
    assert sum(len(r.emitted_token_ids) for r in records) == len(trace.generated_token_ids)


def test_the_draft_tree_is_ancestor_closed_and_scored_by_path(tiny_lm):
    """Each node's parent comes first and outscores it; depth = parent's + 1; budget respected."""
    ids = tiny_lm.encode("one two three")
    budget = Budget(10, 4, 3)
    verifier = eagle._EagleVerifier(tiny_lm, ids, GREEDY, random_head(tiny_lm, 256), budget)
    tree = verifier.grow(budget.depth)
    assert 0 < len(tree) <= budget.tokens and max(n.depth for n in tree) > 1
    for node in tree:
        if node.parent >= 0:
            parent = tree[node.parent]
            assert parent.index < node.index and parent.depth + 1 == node.depth and parent.score >= node.score
        else:
            assert node.depth == 1
    assert verifier.draft_cache.get_seq_length() == verifier.head_len == len(ids) - 1  # tree slots dropped


def test_tree_verify_equals_an_uncached_recompute_of_each_path(tiny_lm):
    ids = tiny_lm.encode("the cat sat on")
    verifier = eagle._EagleVerifier(tiny_lm, ids, GREEDY, random_head(tiny_lm, 256), Budget())
    tokens = [101, 202, 303, 404, 505, 606]
    parents = [-1, -1, 0, 0, 2, 1]
    tree = []
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        depth = 1 if parent < 0 else tree[parent].depth + 1
        tree.append(TreeNode(i, parent, depth, 0, token, str(token), 1.0))
    logits, features = verifier.verify(tree)
    layers = verifier.head.head.layers
    for row in range(len(tree) + 1):
        path, at = [], row - 1
        while at >= 0:
            path.insert(0, tree[at].token_id)
            at = tree[at].parent
        with torch.inference_mode():
            out = tiny_lm.model(torch.tensor([ids + path]), output_hidden_states=True)
        torch.testing.assert_close(logits[row], out.logits[0, -1].float(), atol=1e-4, rtol=1e-4)
        fresh = torch.cat([out.hidden_states[i][0, -1] for i in layers])
        torch.testing.assert_close(features[row], fresh, atol=1e-4, rtol=1e-4)


# --- sampling: the target distribution is unchanged ------------------------------------------------
E2E_RUNS = 1500


def test_sampling_eagle_keeps_the_target_distribution(tiny_lm):
    """Two tokens after a two-token prompt on an 8-token model, both through the draft tree (three
    siblings per node tested one after another) and the rejection rule: their joint is the target's."""
    target = wrap(make_tiny_llama(vocab_size=8, seed=0, layers=1, hidden=32), tiny_lm, "tiny8-target", eos=())
    head = random_head(target, 8, seed=3)
    config = DecodingConfig(strategy="eagle", temperature=2.0, top_k=6, frequency_penalty=1.0, max_new_tokens=3,
                            top_n=3)
    prompt = [3, 5]
    joint = exact_two_token_joint(target, prompt, config)
    firsts, seconds, refused, deep = [], [], 0, 0
    for seed in range(E2E_RUNS):
        collected = list(eagle.rounds(target, prompt, config.replace(seed=seed), head, budget=Budget(6, 2, 3)))
        tokens = [t for r in collected for t in r.emitted_token_ids]
        firsts.append(tokens[0])
        seconds.append(tokens[1])
        refused += collected[0].refused_at == 1  # every depth-1 candidate refused
        deep += len(collected[0].path) >= 1
    assert 0.1 * E2E_RUNS < refused < 0.9 * E2E_RUNS and deep > 0.1 * E2E_RUNS  # both ways taken often
    assert chi_square_p(torch.tensor(firsts), torch.tensor(seconds), joint) > 1e-3


def test_seeded_sampling_repeats(tiny_lm):
    config = DecodingConfig(strategy="eagle", temperature=0.8, seed=5, max_new_tokens=12)
    ids = tiny_lm.encode("Hello there")
    head = random_head(tiny_lm, 512)
    runs = [runner.collect(eagle.stream(tiny_lm, "", ids, config, head=head)).generated_token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


# --- the head file -------------------------------------------------------------------------------------
def test_head_round_trip_checksum_and_atomic_save(tiny_lm, tmp_path, monkeypatch):
    head = random_head(tiny_lm, 300)
    path = tmp_path / "eagle-tiny.safetensors"
    digest = save_head(head, path)
    assert path.with_suffix(".sha256").read_text().split()[0] == digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert json.loads(path.with_suffix(".json").read_text())["draft_vocab"] == 300
    loaded = load_head(tiny_lm, path)
    assert torch.equal(loaded.d2t, head.d2t)
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor.half().float(), atol=0, rtol=0)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def interrupted(tensors, filename):  # the process dies halfway through writing the weights
        open(filename, "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(eagle_head, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_head(random_head(tiny_lm, 300, seed=1), path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing half-written, no temp left
    assert len(path.with_suffix(".sha256").read_text().splitlines()) == 2  # the weights' and the JSON's
    config = path.with_suffix(".json")
    config.write_text(config.read_text().replace('"draft_vocab": 300', '"draft_vocab": 301'))
    with pytest.raises(ConfigError, match="checksum"):  # a config out of step with its weights
        load_head(tiny_lm, path)
    config.write_bytes(before[config.name])
    load_head(tiny_lm, path)
    path.write_bytes(path.read_bytes()[:-1] + b"x")
    with pytest.raises(ConfigError, match="checksum"):
        load_head(tiny_lm, path)
    with pytest.raises(ConfigError, match="no trained head"):
        load_head(tiny_lm, tmp_path / "missing.safetensors")


def test_training_pieces_on_a_tiny_model_write_a_loadable_head(tiny_lm, tmp_path):
    settings = eagle_train.Settings(tokens=6, gen_batch=3, batch=2, minutes=1.0, max_steps=2, ttt=3)
    layers = feature_layers(tiny_lm.model.config.num_hidden_layers)
    samples = eagle_train.make_samples(tiny_lm, ["Hello", "Tell me a story", "Why is the sky blue?"], settings, layers)
    assert len(samples) == 3 and all(s.features.shape == (len(s.tokens), 3 * 64) for s in samples)
    vocab = eagle_train.draft_vocab(samples, 16, tiny_lm.eos_token_ids)
    head = eagle_train.initial_head(tiny_lm, vocab, layers, {"test": True})
    before = head.fc.weight.detach().clone()
    acc, steps = eagle_train.train(head, samples[:2], samples[2:], settings)
    assert steps == 2 and len(acc) == 3 and all(0.0 <= a <= 1.0 for a in acc)
    assert not torch.equal(head.fc.weight, before)  # it learned something
    path = tmp_path / "eagle-tiny.safetensors"
    save_head(head, path)
    assert torch.equal(load_head(tiny_lm, path).d2t, vocab)


def test_the_data_cache_gives_back_what_was_made(tiny_lm, tmp_path, monkeypatch):
    """--data-cache: the second run loads the same sequences, features, final states and the target's
    own greedy labels without generating (make_samples is not called again); another --tokens is
    another file. On the continuation the label at t is the token at t (greedy self-distillation)."""
    settings = eagle_train.Settings(tokens=5, gen_batch=2, data_cache=str(tmp_path))
    layers = feature_layers(tiny_lm.model.config.num_hidden_layers)
    prompts = ["Hello", "Tell me a story", "Why is the sky blue?"]
    made = eagle_train.cached_samples(tiny_lm, prompts, settings, layers)
    assert len(list(tmp_path.glob("eagle-data-*.safetensors"))) == 1 and not list(tmp_path.glob("*.partial"))
    for s in made:
        assert s.predicted[s.start - 1: -1].tolist() == s.tokens[s.start:].tolist()

    def never(*args):
        raise AssertionError("generated again")

    monkeypatch.setattr(eagle_train, "make_samples", never)
    loaded = eagle_train.cached_samples(tiny_lm, prompts, settings, layers)
    assert len(loaded) == len(made)
    for a, b in zip(made, loaded):
        assert a.start == b.start
        for name in eagle_train.SAMPLE_FIELDS:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(AssertionError, match="generated again"):
        eagle_train.cached_samples(tiny_lm, prompts, eagle_train.Settings(tokens=6, data_cache=str(tmp_path)), layers)


def uncached_unroll(head, batch, steps):
    """The training-time test recomputed from scratch at every step: step s feeds the whole
    concatenation of steps 1..s under ttt_mask (no cache). Returns each step's logits."""
    tokens, (b, width) = batch.tokens, batch.tokens.shape
    n = width - 1
    allowed, j = eagle_train.ttt_mask(n, steps), torch.arange(n)
    fused, fed_tokens, fed_feats, out, prev = head.fuse(batch.feats[:, :n]), [], [], [], None
    for s in range(1, steps + 1):
        fed_tokens.append(tokens[:, (j + s).clamp(max=width - 1)])
        fed_feats.append(fused if prev is None else prev[:, -n:])
        mask = torch.zeros(s * n, s * n).masked_fill(~allowed[: s * n, : s * n], torch.finfo(torch.float32).min)
        positions = torch.cat([j + t for t in range(s)])[None].expand(b, -1)
        prev = head(torch.cat(fed_tokens, 1), torch.cat(fed_feats, 1), positions, mask[None, None])
        out.append(head.logits(prev[:, -n:]))
    return out


def test_cached_training_unroll_equals_a_full_recompute_and_aligns_targets(tiny_lm):
    """The trainer feeds each step's new rows over a cache; the same logits come from feeding every
    step's rows again. Step s at row j reads token j + s and aims at token j + s + 1, whose target
    state is the final state at j + s (the classic off-by-one)."""
    head = random_head(tiny_lm, 300)
    torch.manual_seed(1)
    tokens = torch.randint(300, (2, 12))
    finals = torch.randn(2, 12, 64)
    generated = torch.zeros(2, 12, dtype=torch.bool)
    generated[:, 5:] = True
    batch = eagle_train.Batch(tokens, torch.randn(2, 12, 3 * 64), finals, generated, tokens + 1000)
    with torch.no_grad():
        steps = eagle_train.unroll(head, batch, 3)
        fresh = uncached_unroll(head, batch, 3)
    for s, (step, logits) in enumerate(zip(steps, fresh), start=1):
        torch.testing.assert_close(step.logits, logits, atol=1e-4, rtol=1e-4)
        j = 2  # any row with j + s + 1 inside the text
        assert torch.equal(step.final[:, j], finals[:, j + s])
        assert torch.equal(step.labels[:, j], tokens[:, j + s + 1] + 1000)
        assert step.valid[:, j].tolist() == [j + s + 1 >= 5] * 2


def test_training_fits_its_own_text(tiny_lm):
    """A few dozen steps on two sequences: the head's top-1 on them climbs far above chance (the
    shipped head's held-out 0.07 came from 11 steps, not from misaligned targets)."""
    settings = eagle_train.Settings(tokens=12, gen_batch=2, batch=2, minutes=5.0, max_steps=60, ttt=2, lr=3e-3)
    layers = feature_layers(tiny_lm.model.config.num_hidden_layers)
    samples = eagle_train.make_samples(tiny_lm, ["Hello", "Tell me a story"], settings, layers)
    vocab = eagle_train.draft_vocab(samples, 64, tiny_lm.eos_token_ids)
    lookup = torch.full((tiny_lm.vocab_size,), -100, dtype=torch.long)
    lookup[vocab] = torch.arange(len(vocab))
    head = eagle_train.initial_head(tiny_lm, vocab, layers, {})
    before = eagle_train.accuracy(head, samples, lookup, 2)
    eagle_train.train(head, samples, samples, settings)
    after = eagle_train.accuracy(head, samples, lookup, 2)
    assert after[0] > max(0.6, before[0] + 0.3)


def test_ttt_mask_sees_the_branch_point_and_its_own_earlier_steps():
    allowed = eagle_train.ttt_mask(4, 3).reshape(3, 4, 3, 4)
    assert allowed[0, 2, 0, :].tolist() == [True, True, True, False]  # step 1: causal
    assert allowed[2, 1, 0, :].tolist() == [True, True, False, False]  # step 3 at j=1: target keys up to 1
    assert allowed[2, 1, 1, :].tolist() == [False, True, False, False]  # its own step 2 only
    assert allowed[2, 1, 2, :].tolist() == [False, True, False, False]
    assert not allowed[1, 1, 2].any()  # never a later step


def test_the_knobs_are_validated():
    with pytest.raises(ConfigError, match="eagle_tokens"):
        DecodingConfig(strategy="eagle", eagle_tokens=0)
    with pytest.raises(ConfigError, match="eagle_depth"):
        DecodingConfig(strategy="eagle", eagle_depth=11)


def test_a_head_of_the_first_layout_is_refused_by_name(tiny_lm, tmp_path):
    """The first heads mixed token and feature with an ``in_proj``; their JSON has no ``layout``. Such
    a file (checksum intact) is one line naming the layout, never a state-dict traceback."""
    path = tmp_path / "eagle-old.safetensors"
    save_head(random_head(tiny_lm, 300), path)
    config = path.with_suffix(".json")
    raw = json.loads(config.read_text())
    del raw["layout"]
    config.write_text(json.dumps(raw))
    weights = path.with_suffix(".sha256").read_text().splitlines()[0]
    config_sum = hashlib.sha256(config.read_bytes()).hexdigest()
    path.with_suffix(".sha256").write_text(f"{weights}\n{config_sum}  {config.name}\n")
    with pytest.raises(ConfigError, match="layout 'in_proj \\(the first\\)', not 'vllm-eagle3'") as info:
        load_head(tiny_lm, path)
    assert "\n" not in str(info.value) and "eagle_train" in str(info.value)


# --- the shipped head on the embedded model -----------------------------------------------------------
def test_the_shipped_head_matches_its_checksum():
    path = eagle_head.ASSETS / "eagle-smollm2-135m-instruct.safetensors"
    expected = path.with_suffix(".sha256").read_text().split()[0]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == expected
    meta = path.with_suffix(".json")
    meta_line = path.with_suffix(".sha256").read_text().splitlines()[1].split()
    assert meta_line == [hashlib.sha256(meta.read_bytes()).hexdigest(), meta.name]
    config = json.loads(path.with_suffix(".json").read_text())
    assert config["base_model"] == "SmolLM2-135M-Instruct" and len(config["meta"]["heldout_top1"]) >= 1
    assert config["meta"]["heldout_top1"][0] > 0.2  # the first head's 0.07 came from 11 steps (docs/performance.md)


@pytest.mark.slow
def test_shipped_head_greedy_equals_target_on_the_embedded_model(embedded):
    config = GREEDY.replace(max_new_tokens=64)
    per_forward = []
    for prompt in ("Explain the water cycle in two sentences.", "Write a short poem about the sea.",
                   "List three uses of a paperclip."):
        ids = embedded.encode(prompt, chat=True)
        trace = runner.collect(eagle.stream(embedded, "", ids, config))
        assert trace.generated_token_ids == target_only(embedded, ids, config)
        per_forward.append(trace.summary["tokens_per_target_forward"])
    assert min(per_forward) > 1.0  # the head's drafts get accepted
