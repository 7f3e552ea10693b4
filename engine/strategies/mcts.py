"""MCTS decoding: before committing each token, search a tree of continuations with PUCT and
commit the root's most visited child.

One simulation (``mcts_simulations`` per position):

- **Selection**: from the root, descend to the child maximising
  Q + c_puct * prior * sqrt(N_parent) / (1 + N_child), until a node that is not expanded yet.
  An unvisited child's Q is 0, the largest possible mean log-prob, so every child is tried once
  before any is revisited.
- **Expansion**: the leaf's children are the ``mcts_expand_k`` most probable tokens of its
  processed distribution (the user's stage chain applied; top-k, deterministic: the seed plays no
  part, so every run of the same config repeats exactly). Their prior is that probability.
- **Evaluation**: a greedy rollout of ``mcts_rollout_tokens`` tokens from the leaf (argmax of the
  processed distribution). The value is the mean log-prob, under the *raw* model, of every token
  from the root: the path to the leaf, then the rollout. So a token that leads into a
  low-probability continuation scores low even when it is the most probable one itself.
- **Backpropagation**: every node on the path gets N += 1 and Q = mean of the values through it.

KV cache: the cache holds the committed sequence (the root). A simulation feeds the path in ONE
forward, steps the rollout token by token, then crops the cache back to the root: nothing before
the root is ever recomputed. A simulation costs max(1, rollout) forwards.

``stream`` yields an Event per committed token (steps: its StepTrace; record: the ``MctsPosition``
with the whole search tree); the last event holds the Trace, trees under ``extra["mcts"]``.

Stopped (cancelled, or past the request's time limit, checked once per simulation), ``stream`` still
ends with a Trace: the tokens committed so far and their trees, ``summary["stopped"]`` = the reason
("cancelled" | "time_limit") with its message in ``summary["stopped_message"]``, and the search that
was under way, with nothing committed, under ``extra["mcts_interrupted"]``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from engine import core, sampling
from engine.base.seam import Model
from engine.cache import KVCache
from engine.config import DecodingConfig, Knob
from engine.control import RunControl, RunStopped, check
from engine.base.measures import MIN_PROB
from engine.chain import Chain
from engine.core import RunContext
from engine.base.strategy_spec import StrategySpec, register
from engine.trace import Event, StepTrace, Trace, from_dict

MIN_LOGPROB = -100.0  # log-probs are clamped here so a zero probability stays finite in JSON


# --- records ----------------------------------------------------------------------------------
@dataclass
class MctsNode:
    """One node of a position's search tree (``id`` 0 is the root: the committed text so far).
    ``prior``: the token's probability under its parent's processed distribution; ``logprob``: its
    raw log-prob; ``q``: the mean value of the simulations through it (0 while unvisited);
    ``values``: the value of each rollout evaluated from this node; ``rollout``: the tokens of its
    first rollout; ``committed``: the root's child that became the next token."""

    id: int
    parent: int | None
    token_id: int | None
    token: str
    depth: int
    prior: float
    logprob: float
    visits: int = 0
    q: float = 0.0
    values: list[float] = field(default_factory=list)
    rollout: list[int] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    committed: bool = False


def token_of(node: MctsNode) -> int:
    """A child node's token id (only the root has none)."""
    if node.token_id is None:
        raise ValueError("the search tree's root has no token")
    return node.token_id


@dataclass
class MctsPosition:
    """The search that chose generated token ``index``."""

    index: int
    chosen_token_id: int
    chosen_token: str
    simulations: int
    forwards: int
    search_ms: float
    nodes: list[MctsNode]


NOT_COMMITTED = -1  # chosen_token_id of a search stopped before it committed a token


def positions_of(trace: Trace) -> list[MctsPosition]:
    """The trace's search trees as MctsPosition records (a trace rebuilt by hand may hold dicts)."""
    return from_dict(list[MctsPosition], trace.extra.get("mcts", []))


def interrupted_of(trace: Trace) -> MctsPosition | None:
    """The search a stopped run was in when it stopped (its simulations so far, nothing committed:
    ``chosen_token_id`` is NOT_COMMITTED), or None."""
    return from_dict(MctsPosition, trace.extra.get("mcts_interrupted"))


class SearchStopped(RunStopped):
    """RunStopped raised inside a search; ``position`` holds that search's tree so far."""

    def __init__(self, stop: RunStopped, position: MctsPosition):
        super().__init__(stop.reason, str(stop))
        self.position = position

    def __reduce__(self):
        return RunStopped, (self.reason, str(self))


# --- the search -------------------------------------------------------------------------------
def puct(child: MctsNode, parent_visits: int, c_puct: float) -> float:
    """Q + c * prior * sqrt(N_parent) / (1 + N_child)."""
    return child.q + c_puct * child.prior * math.sqrt(parent_visits) / (1 + child.visits)


class _Search:
    """One position's tree. ``root_logits`` [1, V]: the model's logits after the root sequence."""

    def __init__(self, lm: Model, cache: KVCache, chain: Chain, config: DecodingConfig,
                 sequence: list[int], root_logits: torch.Tensor, remaining: int):
        self.lm, self.cache, self.chain, self.config = lm, cache, chain, config
        self.sequence, self.remaining = sequence, remaining
        self.nodes = [MctsNode(0, None, None, "", 0, 1.0, 0.0)]
        self.forwards = 0
        self._expand(self.nodes[0], root_logits, [])

    def _processed(self, path: list[int], logits: torch.Tensor) -> torch.Tensor:
        ids = torch.tensor([self.sequence + path], dtype=torch.long, device=self.lm.device)
        return self.chain(ids, logits.float())  # [1, V]

    def _expand(self, node: MctsNode, logits: torch.Tensor, path: list[int]) -> None:
        """Children: the top ``mcts_expand_k`` tokens of the node's processed distribution."""
        probs = torch.softmax(self._processed(path, logits)[0], dim=-1)
        raw = torch.log_softmax(logits[0].float(), dim=-1)
        values, ids = torch.topk(probs, min(self.config.mcts_expand_k, probs.shape[-1]))
        for p, t in zip(values.tolist(), ids.tolist()):
            if p <= 0:  # fewer than k tokens survive the stages
                break
            child = MctsNode(len(self.nodes), node.id, t, self.lm.token_text(t), node.depth + 1, p,
                             max(MIN_LOGPROB, float(raw[t])))
            self.nodes.append(child)
            node.children.append(child.id)

    def _select(self) -> list[MctsNode]:
        """The path from the root to the first node not expanded yet (root excluded)."""
        node, path = self.nodes[0], []
        while node.children:
            node = max((self.nodes[c] for c in node.children), key=lambda ch: puct(ch, node.visits, self.config.mcts_c_puct))
            path.append(node)
        return path

    def simulate(self) -> None:
        path = self._select()
        leaf = path[-1]
        tokens = [token_of(n) for n in path]
        logprobs = [n.logprob for n in path]
        terminal = leaf.token_id in self.lm.eos_token_ids or leaf.depth >= self.remaining
        rollout: list[int] = []
        if not terminal:
            logits = self.cache.forward(torch.tensor([tokens]), all_logits=False).logits[:, -1].float()  # [1, V]
            self.forwards += 1
            self._expand(leaf, logits, tokens)
            rollout, rollout_logprobs = self._rollout(tokens, logits)
            logprobs += rollout_logprobs
            self.cache.rewind(self.cache.length - len(self.sequence))
        value = sum(logprobs) / len(logprobs)
        if not leaf.values:
            leaf.rollout = rollout
        leaf.values.append(value)
        for node in [self.nodes[0], *path]:
            node.visits += 1
            node.q += (value - node.q) / node.visits  # running mean

    def _rollout(self, path: list[int], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Greedy continuation of ``mcts_rollout_tokens`` tokens after ``path`` (``logits`` [1, V]:
        after the path's last token); returns the tokens and their raw log-probs."""
        n = min(self.config.mcts_rollout_tokens, self.remaining - len(path))
        tokens: list[int] = []
        logprobs: list[float] = []
        for i in range(n):
            token = sampling.greedy(self._processed(path + tokens, logits)).token_id
            tokens.append(token)
            logprobs.append(max(MIN_LOGPROB, float(torch.log_softmax(logits[0], dim=-1)[token])))
            if token in self.lm.eos_token_ids or i == n - 1:
                break
            logits = self.cache.step([token])
            self.forwards += 1
        return tokens, logprobs

    def best_child(self) -> MctsNode:
        """Most visits; ties go to the higher Q, then the higher prior."""
        children = [self.nodes[c] for c in self.nodes[0].children]
        return max(children, key=lambda ch: (ch.visits, ch.q, ch.prior))


def raw_logprob(lm: Model, prompt_ids: Sequence[int], tokens: Sequence[int]) -> float:
    """Sum of the raw model's log-probs of ``tokens`` after ``prompt_ids``, by one uncached
    forward: the yardstick for comparing MCTS, greedy and beam outputs on one prompt."""
    if not tokens:
        return 0.0
    ids = torch.tensor([list(prompt_ids) + list(tokens)], dtype=torch.long, device=lm.device)
    with torch.inference_mode():
        logits = lm.model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float()  # [T, V]
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt_ids):, None])
    return float(logprobs.clamp_min(MIN_LOGPROB).sum())


# --- the loop ---------------------------------------------------------------------------------
def positions(lm: Model, prompt_ids: Sequence[int], config: DecodingConfig,
              control: RunControl | None = None) -> Iterator[Event]:
    """Search, commit, repeat: yield an Event per committed token (steps: [its StepTrace], record:
    its MctsPosition, the search tree) until EOS, a stop string or max_new_tokens. ``control`` is checked once per simulation: stopped, it raises
    SearchStopped (a RunStopped) holding the tree of the search under way."""
    core.check_prompt(prompt_ids)
    start = time.perf_counter()
    cache = KVCache(lm.model)
    generator = None if config.is_greedy else core.make_generator(config, lm.device)  # for stages that draw (XTC)
    chain = Chain.from_config(config, len(prompt_ids), lm.tokenizer, lm.eos_token_ids, generator=generator)
    stopper = core.StopCheck(lm, config)
    sequence = list(prompt_ids)
    logits = cache.sync(sequence)  # [1, V] after the root; the cache holds exactly the root
    generated: list[int] = []
    while True:
        t0 = time.perf_counter()
        search = _Search(lm, cache, chain, config, sequence, logits, config.max_new_tokens - len(generated))
        for done in range(config.mcts_simulations):
            try:
                check(control)
            except RunStopped as stop:
                raise SearchStopped(stop, MctsPosition(len(generated), NOT_COMMITTED, "", done, search.forwards,
                                                       (time.perf_counter() - t0) * 1000, search.nodes)) from None
            search.simulate()
        chosen = search.best_child()
        chosen.committed = True
        token = token_of(chosen)
        step = _step_trace(lm, chain, config, sequence, logits, token, len(generated), start)
        chain.observe(torch.tensor([sequence], dtype=torch.long, device=lm.device), token)  # mirostat's μ moves
        chain.annotate(step.stages)
        generated.append(token)
        step.finish_reason = stopper.reason(generated)
        record = MctsPosition(step.index, token, chosen.token, config.mcts_simulations,
                              search.forwards, (time.perf_counter() - t0) * 1000, search.nodes)
        yield Event(steps=[step], record=record)
        if step.finish_reason is not None:
            return
        sequence.append(token)
        logits = cache.step([token])


def _step_trace(lm: Model, chain: Chain, config: DecodingConfig, sequence: list[int], logits: torch.Tensor,
                token: int, index: int, start: float) -> StepTrace:
    """The committed token's StepTrace: the root's stages, as a greedy step would record them."""
    ids = torch.tensor([sequence], dtype=torch.long, device=lm.device)
    traced = chain.traced(ids, logits, config.top_n, lm.token_text)
    chosen = sampling.Pick(token, float(traced.final_probs[token]))  # the search chose it, no draw
    return core.step_trace(lm, traced, chosen, index, (time.perf_counter() - start) * 1000)


def stream(lm: Model, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, *, chat: bool = False,
           control: RunControl | None = None) -> Iterator[Event]:
    """One Event per committed token (steps: [its StepTrace]; record: its MctsPosition); the last
    Event holds the Trace with the trees under ``extra["mcts"]`` and search totals in ``summary``.
    A stopped run ends with its partial Trace (see the module docstring), never an exception."""
    steps, records = [], []
    stopped: RunStopped | None = None
    try:
        for event in positions(lm, prompt_ids, config, control):
            steps += event.steps
            records.append(event.record)
            yield event
    except RunStopped as stop:
        stopped = stop
    trace = core.assemble(lm, prompt, prompt_ids, config, steps, chat)
    trace.extra["mcts"] = records
    searched = [*records, stopped.position] if isinstance(stopped, SearchStopped) else records
    trace.summary |= {
        "simulations": sum(r.simulations for r in searched),
        "search_forwards": sum(r.forwards for r in searched),
        "total_raw_logprob": sum(math.log(max(s.raw_prob, MIN_PROB)) for s in steps),
    }
    if stopped is not None:
        trace.summary |= {"stopped": stopped.reason, "stopped_message": str(stopped)}
        if isinstance(stopped, SearchStopped):
            trace.extra["mcts_interrupted"] = stopped.position
    yield Event(trace=trace)


# --- the strategy -------------------------------------------------------------------------------------
def run(ctx: RunContext) -> Iterator[Event]:
    """MCTS on a model loaded here (``engine.runner.stream``; it checks the control inside its searches)."""
    yield from stream(ctx.lm, ctx.prompt, ctx.ids, ctx.config, chat=ctx.chat, control=ctx.control)


register(StrategySpec(
    "mcts", run, records={"mcts": list[MctsPosition], "mcts_interrupted": MctsPosition},
    needs=("full_logits", "kv_cache"), needs_why="needs full logits and the model's own cache at every node",
    doc="Before each token, a PUCT tree search over continuations; commit the root's most visited child.",
    knobs=(
        Knob("mcts_simulations", "int", 32, 1, 256, doc="MCTS: PUCT simulations per generated token.", step=1),
        Knob("mcts_c_puct", "float", 1.5, 0.0, 10.0,
             doc="MCTS: exploration weight c in Q + c * prior * sqrt(N_parent) / (1 + N_child).", step=0.1),
        Knob("mcts_expand_k", "int", 4, 1, 16, doc="MCTS: children per expanded node (the top-k of its processed prior).",
             step=1),
        Knob("mcts_rollout_tokens", "int", 4, 0, 16,
             doc="MCTS: greedy rollout length scoring a new leaf (mean raw log-prob of path + rollout; 0 = the path "
                 "alone).", step=1),
    )))
