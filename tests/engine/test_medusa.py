"""Medusa, chain and tree verification: greedy equals target-only greedy token for token; sampling
keeps the target's distribution (chi-square, as tests/engine/test_speculative.py); the tree's mask,
positions and node choice checked by hand; the cache after each round equals an uncached prefill;
heads file I/O with its checksum; trace JSON round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.helpers.common import make_tiny_llama
from engine.strategies import medusa
from engine import runner
from engine.runner import RunRequest
from engine.config import ConfigError, DecodingConfig
from engine.strategies.medusa import (CHAIN, TREE, HeadProposal, MedusaHeads, TreeShape, build_tree, head_logits, load_heads, rounds_of, save_heads)
from engine.trace import TokenProb, Trace
from tests.helpers.speculative import chi_square_p, exact_two_token_joint, wrap
from tests.helpers.medusa import random_heads, target_only  # noqa: F401

GREEDY = DecodingConfig(strategy="medusa", temperature=0.0, max_new_tokens=20, medusa_heads=3)
SHAPES = pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])


def test_untrained_heads_read_out_exactly_the_base_head(tiny_lm):
    """W = 0, b = 0: h + SiLU(0) = h, so every head's logits are the LM head's."""
    lm_head = tiny_lm.model.get_output_embeddings()
    h = torch.randn(5, 64)
    logits = head_logits(MedusaHeads(64, 3), lm_head, h)  # [5, 3, V]
    assert logits.shape == (5, 3, tiny_lm.vocab_size)
    for k in range(3):
        torch.testing.assert_close(logits[:, k], lm_head(h).float())


def test_a_shortlist_reads_out_only_its_tokens(tiny_lm, tmp_path):
    """Heads with a shortlist give the LM head's logits on its tokens and -inf elsewhere (so they
    never propose another token); the shortlist survives the file round trip."""
    lm_head = tiny_lm.model.get_output_embeddings()
    vocab = torch.tensor([2, 5, 7, 40, 99])
    heads = MedusaHeads(64, 2, vocab)
    h = torch.randn(3, 64)
    logits = head_logits(heads, lm_head, h)  # [3, 2, V]
    assert logits.shape == (3, 2, tiny_lm.vocab_size)
    outside = torch.ones(tiny_lm.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isneginf(logits[..., outside]).all()
    torch.testing.assert_close(logits[:, 0, vocab], lm_head(h).float()[:, vocab])
    path = tmp_path / "short.safetensors"
    save_heads(heads, path, {"base_model": "tiny"})
    assert load_heads(tiny_lm, path).vocab.tolist() == vocab.tolist()


def test_readout_equals_the_lm_head(tiny_lm):
    """The verify forward's own read-out (weight @ h.T for a plain head, the packed product for a
    packed one) equals nn.Linear to float rounding."""
    lm_head = tiny_lm.model.get_output_embeddings()
    h = torch.randn(7, 64)
    expected = torch.nn.functional.linear(h, lm_head.weight)
    torch.testing.assert_close(medusa.readout(lm_head, h), expected, rtol=1e-5, atol=1e-5)
    plain = torch.nn.Linear(64, lm_head.weight.shape[0], bias=False)
    plain.weight = lm_head.weight
    torch.testing.assert_close(medusa.readout(plain, h), expected, rtol=1e-5, atol=1e-5)


@SHAPES
@pytest.mark.parametrize("knobs", [{}, {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2}])
@pytest.mark.parametrize("scale", [0.0, 3.0])
def test_greedy_medusa_equals_target_greedy(tiny_lm, knobs, scale, shape):
    config = GREEDY.replace(**knobs)
    ids = tiny_lm.encode("The cat sat on the mat. The cat sat on the")
    trace = runner.collect(medusa.stream(tiny_lm, "", ids, config, heads=random_heads(64, 3, scale), shape=shape))
    assert trace.generated_token_ids == target_only(tiny_lm, ids, config)
    assert trace.summary["rounds"] == len(trace.rounds)
    assert trace.summary["tokens_per_target_forward"] == len(trace.steps) / len(trace.rounds)
    assert all(len(r.proposals) <= 3 and r.k == len(r.tree) <= shape.nodes for r in trace.rounds)
    if shape == CHAIN:  # one node per head: each head's top-1
        assert all([n.token_id for n in r.tree] == [p.token_id for p in r.proposals] for r in trace.rounds)


# --- the tree, by hand ----------------------------------------------------------------------------------
def proposal(head: int, *probs_and_ids: tuple[int, float]) -> HeadProposal:
    cands = [TokenProb(t, f"t{t}", p) for t, p in probs_and_ids]
    return HeadProposal(head, cands[0].token_id, cands[0].token, cands)


def test_build_tree_takes_the_best_paths_by_product_of_head_probabilities():
    """Head 1: a .6, b .25; head 2: c .5, d .4. Paths: a .6, ac .30, b .25, ad .24, bc .125, bd .1.
    The best 4: a, ac, b, ad, each parent before its children."""
    heads = [proposal(1, (10, 0.6), (11, 0.25)), proposal(2, (20, 0.5), (21, 0.4))]
    tree = build_tree(heads, TreeShape(width=2, nodes=4), eos_ids=())
    assert [(n.token_id, n.parent, n.depth, n.rank) for n in tree] == [
        (10, -1, 1, 0), (20, 0, 2, 0), (11, -1, 1, 1), (21, 0, 2, 1)]
    assert [round(n.score, 6) for n in tree] == [0.6, 0.3, 0.25, 0.24]
    assert [n.token_id for n in build_tree(heads, CHAIN, ())] == [10, 20]  # the chain: each head's top-1
    nothing_after_eos = build_tree(heads, TreeShape(2, 6), eos_ids=(10,))
    assert [n.token_id for n in nothing_after_eos] == [10, 11, 20, 21]


def test_the_dynamic_tree_leaves_out_paths_below_min_score():
    """The same heads: paths a .6, ac .30, b .25, ad .24, bc .125, bd .1. min_score .25 keeps a,
    ac, b (a path of exactly .25 stays); .7 keeps nothing (the round then verifies the root
    alone); the node budget still applies."""
    heads = [proposal(1, (10, 0.6), (11, 0.25)), proposal(2, (20, 0.5), (21, 0.4))]
    assert [n.token_id for n in build_tree(heads, TreeShape(2, 6, min_score=0.25), ())] == [10, 20, 11]
    assert [n.token_id for n in build_tree(heads, TreeShape(2, 2, min_score=0.1), ())] == [10, 20]
    assert build_tree(heads, TreeShape(2, 6, min_score=0.7), ()) == []
    assert [n.token_id for n in build_tree(heads, TreeShape(1, 4, min_score=0.5), ())] == [10]  # the chain, cut


def test_tree_attention_mask_sees_cache_ancestors_and_self():
    """Root r, nodes 0 = a (depth 1), 1 = c under a, 2 = b (depth 1): with 2 cached positions."""
    heads = [proposal(1, (10, 0.6), (11, 0.25)), proposal(2, (20, 0.5))]
    tree = build_tree(heads, TreeShape(width=2, nodes=3), eos_ids=())
    assert [(n.token_id, n.parent) for n in tree] == [(10, -1), (20, 0), (11, -1)]
    mask = medusa.tree_attention_mask(tree, cached=2, dtype=torch.float32)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 1, 1, 0, 0, 0],   # root: cache + itself
                       [1, 1, 1, 1, 0, 0],   # a: cache, root, a
                       [1, 1, 1, 1, 1, 0],   # c: cache, root, a, c
                       [1, 1, 1, 0, 0, 1]]   # b: cache, root, b (not its cousin a, c)
    assert mask.min() == torch.finfo(torch.float32).min


def test_tree_shape_is_validated():
    with pytest.raises(ConfigError, match="medusa_tree: nodes 0 must be in"):
        TreeShape(width=2, nodes=0)
    with pytest.raises(ConfigError, match=r"medusa_tree: min_score 1.0 must be in \[0, 1\)"):
        TreeShape(width=2, nodes=4, min_score=1.0)


def oracle_proposer(reference: list[int], decoys: int):
    """A ``propose`` whose head k ranks ``decoys`` wrong tokens first, then the target's own
    greedy token (decoys = 0: a perfect proposer)."""
    def propose(self, k):
        if self.hidden is None or k <= 0:
            return []
        done = len(self.generated)
        out = []
        for i, t in enumerate(reference[done: done + k]):
            wrong = [TokenProb(t + 1 + j, "", 0.4 / (j + 1)) for j in range(decoys)]
            out.append(HeadProposal(i + 1, t, "", wrong + [TokenProb(t, "", 0.1)]))
        return out
    return propose


@pytest.mark.parametrize("shape, decoys, emitted", [
    (CHAIN, 0, [1, 4, 4, 4]),  # every top-1 right: K + 1 tokens per round after the first
    (CHAIN, 1, [1] * 13),  # every top-1 wrong: the chain accepts nothing
    (TreeShape(width=2, nodes=16), 1, [1, 4, 4, 4]),  # the right token is each head's second: the tree finds it
])
def test_an_oracle_proposer_is_accepted_where_the_tree_holds_it(tiny_lm, monkeypatch, shape, decoys, emitted):
    ids = tiny_lm.encode("Once upon a time")
    config = GREEDY.replace(max_new_tokens=13)
    reference = target_only(tiny_lm, ids, config)
    monkeypatch.setattr(medusa._MedusaVerifier, "propose", oracle_proposer(reference, decoys))
    trace = runner.collect(medusa.stream(tiny_lm, "", ids, config, heads=MedusaHeads(64, 3), shape=shape))
    assert trace.generated_token_ids == reference
    assert [len(r.emitted_token_ids) for r in trace.rounds] == emitted
    assert trace.summary["tokens_per_target_forward"] == 13 / len(emitted)
    for r in trace.rounds:  # the record: the accepted path is the emitted tokens, its nodes marked accepted
        assert [r.tree[i].token_id for i in r.path] == r.emitted_token_ids[: len(r.path)]
        assert all(r.tree[i].status == "accepted" for i in r.path)
        assert [r.tree[i].depth for i in r.path] == list(range(1, len(r.path) + 1))


@SHAPES
def test_the_cache_after_each_round_equals_an_uncached_recompute(tiny_lm, monkeypatch, shape):
    """After each round the cache holds exactly the sequence minus its last token, with the keys
    and values of a fresh prefill, and the next logits equal an uncached forward's."""
    checked = []
    original = medusa._MedusaVerifier.medusa_round

    def spy(self, index):
        out = original(self, index)
        assert self.cache.length == len(self.sequence) - 1 and list(self.cache.tokens) == self.sequence[:-1]
        with torch.inference_mode():
            fresh = tiny_lm.model(torch.tensor([self.sequence[:-1]]), use_cache=True).past_key_values
            for ours, theirs in zip(self.cache.cache.layers, fresh.layers):
                torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(ours.values, theirs.values, atol=1e-4, rtol=1e-4)
            full = tiny_lm.model(torch.tensor([self.sequence])).logits[0, -1]
            cached = tiny_lm.model(torch.tensor([self.sequence[-1:]]), past_key_values=self.cache.cache,
                                   use_cache=True).logits[0, -1]
        self.cache.cache.crop(-1)  # undo the probe
        torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)
        checked.append(len(out.path))
        return out

    monkeypatch.setattr(medusa._MedusaVerifier, "medusa_round", spy)
    ids = tiny_lm.encode("a b a b a b")
    reference = target_only(tiny_lm, ids, GREEDY)
    monkeypatch.setattr(medusa._MedusaVerifier, "propose", oracle_proposer(reference, 1 if shape != CHAIN else 0))
    runner.collect(medusa.stream(tiny_lm, "", ids, GREEDY, heads=MedusaHeads(64, 3), shape=shape))
    assert len(checked) > 3 and max(checked) >= 2  # paths of several nodes were accepted (in the tree: second ranks)


# --- sampling: the target distribution is unchanged ------------------------------------------------
E2E_RUNS = 1500


@pytest.mark.parametrize("shape", [pytest.param(CHAIN, marks=pytest.mark.slow), TreeShape(width=3, nodes=6)],
                         ids=["chain", "tree"])  # the chain is the tree's one-child case: CI's slow run checks it too
def test_sampling_medusa_keeps_the_target_distribution(tiny_lm, shape):
    """Two tokens after a one-token prompt on an 8-token model: the first from p, the second
    through the heads' candidates (the tree: three siblings tested one after another) and the
    rejection rule. Their joint must be the target's."""
    target = wrap(make_tiny_llama(vocab_size=8, seed=0, layers=1, hidden=32), tiny_lm, "tiny8-target", eos=())
    heads = random_heads(32, 2, 4.0, seed=3)
    config = DecodingConfig(strategy="medusa", temperature=2.0, top_k=6, frequency_penalty=1.0,
                            max_new_tokens=3, medusa_heads=2, top_n=3)
    joint = exact_two_token_joint(target, [3], config)
    firsts, seconds, rejected = [], [], 0
    for seed in range(E2E_RUNS):
        collected = list(medusa.rounds(target, [3], dataclasses.replace(config, seed=seed), heads, shape=shape))
        tokens = [t for r in collected for t in r.emitted_token_ids]
        firsts.append(tokens[0])
        seconds.append(tokens[1])
        rejected += any(d.resampled is not None for r in collected for d in r.drafted)
    assert 0.1 * E2E_RUNS < rejected < 0.9 * E2E_RUNS  # both paths taken often
    assert chi_square_p(torch.tensor(firsts), torch.tensor(seconds), joint) > 1e-3


def test_seeded_sampling_repeats(tiny_lm):
    config = DecodingConfig(strategy="medusa", temperature=0.8, seed=5, max_new_tokens=12)
    ids = tiny_lm.encode("Hello")
    heads = random_heads(64, 3, 3.0)
    runs = [runner.collect(medusa.stream(tiny_lm, "", ids, config, heads=heads)).generated_token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


# --- trace and heads file ---------------------------------------------------------------------------
def test_trace_json_round_trips_with_proposals(tiny_lm):
    trace = runner.collect(medusa.stream(tiny_lm, "hi", tiny_lm.encode("hi", False), GREEDY.replace(max_new_tokens=8),
                                           heads=random_heads(64, 3, 3.0)))
    text = trace.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    back = medusa.rounds_of(Trace.from_json(text))
    assert [len(r.proposals) for r in back] == [len(r.proposals) for r in trace.rounds]
    assert back[1].proposals[0].candidates[0].token_id == back[1].tree[0].token_id  # the best node: head 1's top-1
    assert [(n.index, n.parent, n.status) for n in back[1].tree] == [
        (n.index, n.parent, n.status) for n in trace.rounds[1].tree]
    assert [back[1].tree[i].token_id for i in back[1].path] == back[1].emitted_token_ids[: len(back[1].path)]
    assert sum(len(r.emitted_token_ids) for r in back) == 8
    assert all(r.steps == [] for r in trace.rounds)  # steps live in trace.steps only


def test_heads_file_round_trip_and_checksum(tiny_lm, tmp_path):
    heads = random_heads(64, 2, 1.0)
    path = tmp_path / "heads.safetensors"
    save_heads(heads, path, {"base_model": "tiny"})
    loaded = load_heads(tiny_lm, path)
    torch.testing.assert_close(loaded.weight, heads.weight.half().float())
    path.write_bytes(path.read_bytes()[:-1] + b" ")
    with pytest.raises(ConfigError, match="strategy: medusa: heads.safetensors does not match its checksum"):
        load_heads(tiny_lm, path)
    with pytest.raises(ConfigError, match="strategy: medusa: no trained heads for tiny-random-llama"):
        load_heads(tiny_lm)


def test_medusa_heads_knob_is_validated():
    with pytest.raises(ConfigError, match="medusa_heads: 5 is out of range"):
        DecodingConfig(strategy="medusa", medusa_heads=5)
    with pytest.raises(ConfigError, match="medusa_tree_width: 9 is out of range"):
        DecodingConfig(strategy="medusa", medusa_tree_width=9)
    with pytest.raises(ConfigError, match="medusa_tree_nodes: 0 is out of range"):
        DecodingConfig(strategy="medusa", medusa_tree_nodes=0)
    for bad in (-0.01, 0.6, float("nan")):
        with pytest.raises(ConfigError, match="medusa_tree_min_score: "):
            DecodingConfig(strategy="medusa", medusa_tree_min_score=bad)


def test_the_tree_knobs_choose_the_verified_tree(tiny_lm):
    """``medusa_tree_width`` / ``medusa_tree_nodes`` reach the verifier: the rounds' trees have that
    shape (width 1: the chain, one node per head), and the defaults are the engine's TREE."""
    from engine.strategies.medusa import shape_of

    assert shape_of(DecodingConfig(strategy="medusa")) == TREE
    assert shape_of(DecodingConfig(strategy="medusa", medusa_tree_width=1, medusa_tree_nodes=9)) == TreeShape(1, 3)
    heads = random_heads(tiny_lm.model.config.hidden_size, 3, 3.0)
    ids = tiny_lm.encode("a b c", chat=False)
    for width, nodes in ((1, 3), (2, 5)):
        config = GREEDY.replace(max_new_tokens=6, medusa_tree_width=width, medusa_tree_nodes=nodes)
        trace = runner.collect(medusa.stream(tiny_lm, "a b c", ids, config, heads=heads))
        assert trace.summary["tree_width"] == width and trace.summary["tree_nodes"] == nodes
        assert all(len(r.tree) <= nodes for r in rounds_of(trace))
        assert trace.generated_token_ids == target_only(tiny_lm, ids, config)


@pytest.mark.parametrize("min_score", [0.05, 0.3, 0.49])
def test_the_dynamic_tree_knob_reaches_the_verifier_and_keeps_greedy_exact(tiny_lm, min_score):
    """``medusa_tree_min_score``: every verified node's path score reaches it, trees shrink (to
    the root alone where no path does), the summary records it with the mean tree size, and the
    tokens are still target-only greedy's."""
    from engine.strategies.medusa import shape_of

    config = GREEDY.replace(max_new_tokens=12, medusa_tree_width=4, medusa_tree_nodes=24,
                            medusa_tree_min_score=min_score)
    assert shape_of(config) == TreeShape(4, 24, min_score)
    ids = tiny_lm.encode("The cat sat on the mat. The cat sat on the", chat=False)
    trace = runner.collect(medusa.stream(tiny_lm, "", ids, config, heads=random_heads(64, 3, 3.0)))
    rounds = rounds_of(trace)
    assert all(n.score >= min_score for r in rounds for n in r.tree)
    assert trace.summary["tree_min_score"] == min_score
    assert trace.summary["mean_tree_nodes"] == pytest.approx(sum(len(r.tree) for r in rounds) / len(rounds))
    assert trace.summary["mean_tree_nodes"] < 24
    assert trace.generated_token_ids == target_only(tiny_lm, ids, config)
    json.loads(trace.to_json())  # strict JSON with the new fields
    if min_score == 0.49:  # random heads are rarely that sure: some rounds verify the root alone
        assert any(not r.tree and len(r.emitted_token_ids) == 1 for r in rounds)


# --- the shipped heads on the embedded model -----------------------------------------------------------
@pytest.mark.slow
def test_trained_heads_greedy_equals_target_and_accept_drafts(embedded):
    ids = embedded.encode("Explain the water cycle in two sentences.", chat=True)
    config = GREEDY.replace(max_new_tokens=48)
    reference = target_only(embedded, ids, config)
    per_forward, nodes = {}, {}
    big, dynamic = TreeShape(6, 32), TreeShape(8, 48, min_score=0.02)
    for shape in (CHAIN, TREE, big, dynamic):
        trace = runner.collect(medusa.stream(embedded, "", ids, config, shape=shape))
        assert trace.generated_token_ids == reference
        per_forward[shape] = trace.summary["tokens_per_target_forward"]
        nodes[shape] = trace.summary["mean_tree_nodes"]
    assert per_forward[CHAIN] > 1.0  # heads' tokens get accepted
    assert per_forward[TREE] >= per_forward[CHAIN]  # the default tree holds the chain's top-1s
    assert per_forward[big] > per_forward[TREE]  # and a bigger tree finds more (2.8 vs 1.9 on this prompt)
    assert per_forward[dynamic] > per_forward[TREE] and nodes[dynamic] < nodes[big]  # the dynamic tree: cheaper
    assert medusa.heads_path(embedded.name).with_suffix(".sha256").is_file()


# --- where a greedy run leaves target-only, and whether rounding explains it ------------------------------
def test_first_difference_names_the_token_and_tells_a_rounding_tie_from_a_defect(tiny_lm):
    """engine.strategies.speculative.first_difference (the bench's and the view's check): equal runs give
    None; a token the target ranks far below its choice is a defect; a token whose LM-head row
    equals the chosen one's (so its logit ties exactly, in any dtype) is a rounding tie; a run
    that stops early is never a tie."""
    from engine.strategies.speculative import first_difference

    lm = dataclasses.replace(tiny_lm, model=make_tiny_llama())  # its LM head is edited below
    ids = lm.encode("The tide comes in", chat=False)
    expected = target_only(lm, ids, GREEDY.replace(max_new_tokens=6))
    assert first_difference(lm, ids, expected, expected) == {"baseline_first_difference": None,
                                                             "baseline_rounding_tie": False}
    n = 3
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids + expected[:n]])).logits[0, -1]
    worst = int(logits.argmin())
    defect = expected[:n] + [worst] + expected[n + 1:]
    assert first_difference(lm, ids, defect, expected) == {"baseline_first_difference": n,
                                                           "baseline_rounding_tie": False}
    twin = next(t for t in range(1000, 2000) if t not in ids + expected)
    with torch.no_grad():
        lm.model.lm_head.weight[twin] = lm.model.lm_head.weight[expected[n]]
    tie = expected[:n] + [twin] + expected[n + 1:]
    assert first_difference(lm, ids, tie, expected) == {"baseline_first_difference": n, "baseline_rounding_tie": True}
    assert first_difference(lm, ids, expected[:n], expected) == {"baseline_first_difference": n,
                                                                 "baseline_rounding_tie": False}


def test_medusa_summary_explains_a_difference(tiny_lm):
    from playground.views.search import medusa_summary

    ids = tiny_lm.encode("Hello", chat=False)
    run_trace = runner.collect(medusa.stream(tiny_lm, "", ids, GREEDY.replace(max_new_tokens=3),
                                             heads=random_heads(64, 3, 1.0)))
    base = {"tokens_per_target_forward": 1.5, "speedup": 1.3, "baseline_tokens_per_s": 20.0, "head_acceptance": [0.4]}
    for extra, fragment in [
        ({"baseline_same_tokens": True, "baseline_first_difference": None}, "Same tokens as target-only: yes"),
        ({"baseline_same_tokens": False}, "sampling: the same distribution"),
        ({"baseline_same_tokens": False, "baseline_first_difference": 7, "baseline_rounding_tie": True},
         "from token 7 on, where the target's two best tokens tie"),
        ({"baseline_same_tokens": False, "baseline_first_difference": 7, "baseline_rounding_tie": False},
         "but token 7 differs"),
    ]:
        trace = dataclasses.replace(run_trace, summary=base | extra)
        assert fragment in medusa_summary(trace)
        assert "Slower than target-only here" not in medusa_summary(trace)  # speed-up 1.3
    slower = medusa_summary(dataclasses.replace(run_trace, summary=base | {"speedup": 0.85}))
    assert "Slower than target-only here" in slower and "DP_DTYPE=bfloat16" in slower
    assert "Slower" not in medusa_summary(dataclasses.replace(run_trace, summary=base | {"speedup": float("nan")}))


@pytest.mark.parametrize("shape, decoys", [(CHAIN, 0), (TreeShape(width=2, nodes=16), 1)], ids=["chain", "tree"])
def test_bfloat16_medusa_equals_target_greedy_up_to_rounding_ties(tiny_lm, monkeypatch, shape, decoys):
    """The DP_DTYPE=bfloat16 path (mask, heads, read-out and kept cache rows in bfloat16): with an
    oracle proposer the rounds accept several tokens, and the run equals target-only greedy in
    bfloat16 or leaves it only at a rounding tie of the target (first_difference)."""
    from engine.strategies.speculative import first_difference

    lm = dataclasses.replace(tiny_lm, model=make_tiny_llama().to(torch.bfloat16), dtype=torch.bfloat16)
    for prompt in ("Once upon a time", "The tide comes in", "def f(x):"):
        ids = lm.encode(prompt)
        config = GREEDY.replace(max_new_tokens=24)
        reference = target_only(lm, ids, config)
        monkeypatch.setattr(medusa._MedusaVerifier, "propose", oracle_proposer(reference, decoys))
        heads = MedusaHeads(64, 3).to(torch.bfloat16)
        trace = runner.collect(medusa.stream(lm, "", ids, config, heads=heads, shape=shape))
        diff = first_difference(lm, ids, trace.generated_token_ids, reference)
        assert diff["baseline_first_difference"] is None or diff["baseline_rounding_tie"], (prompt, diff)
        assert max(len(r.emitted_token_ids) for r in trace.rounds) == 4  # whole paths accepted


def test_medusa_summary_names_the_dynamic_tree(tiny_lm):
    from playground.views.search import medusa_summary

    ids = tiny_lm.encode("Hello", chat=False)
    config = GREEDY.replace(max_new_tokens=4, medusa_tree_width=4, medusa_tree_nodes=24, medusa_tree_min_score=0.05)
    text = medusa_summary(runner.collect(medusa.stream(tiny_lm, "", ids, config, heads=random_heads(64, 3, 3.0))))
    assert "Verified tree: each head's top 4, at most 24 nodes, only paths with probability ≥ 0.05: " in text
    assert "nodes per forward on average" in text


@pytest.mark.parametrize("strategy", ["speculative", "medusa"])
def test_nothing_left_to_pick_ends_the_run_saying_why(tiny_lm, strategy):
    """Every token masked (allowed and banned the same word, EOS held back): speculative and Medusa
    both end with stop_reason "no_tokens_left" and strict JSON, as greedy and sampling do (Medusa
    raised NoTokensLeft out of its stream before)."""
    config = DecodingConfig.from_dict({"strategy": strategy, "max_new_tokens": 5, "allowed_words": ["cat"],
                                       "banned_words": ["cat"], "min_new_tokens": 5,
                                       **({"drafter": "ngram"} if strategy == "speculative" else {"medusa_heads": 3})})
    ids = tiny_lm.encode("hi", False)
    if strategy == "medusa":
        trace = runner.collect(medusa.stream(tiny_lm, "hi", ids, config, heads=MedusaHeads(64, 3)))
    else:
        trace = runner.run(RunRequest(tiny_lm, "hi", config, prompt_ids=ids))
    assert trace.stop_reason == "no_tokens_left" and trace.generated_token_ids == []
    assert json.loads(trace.to_json())["stop_reason"] == "no_tokens_left"
