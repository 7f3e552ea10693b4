"""The chain: the user's stages in the user's order, applied to next-token logits and recorded
(raw, after every stage, final) for many rows at once (``traced_rows``, the batched scheduler's
path) or one row (``Chain.traced``, its one-row case: one implementation of the recording). The
stages themselves live in ``engine/stages/`` (one module per kind, each registering its spec).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from engine.config import DecodingConfig
from engine.stages import Stage, build_stage, share_key
from engine.trace import StageTrace, TokenProb


@dataclass
class Chain:
    """An ordered list of stages; the order is data the user chose. Each stage's record is its
    knobs plus the diagnostics its ``run`` returned; the stateful stages' state goes through their
    own API (``accept`` after each pick via ``observe``, ``reset``, ``clone``, ``state`` /
    ``load_state``)."""

    stages: list[Stage] = field(default_factory=list)
    _accepted: list[dict] = field(default_factory=list, repr=False)  # what each stage learnt from the last pick

    @classmethod
    def from_config(cls, config: DecodingConfig, prompt_length: int = 0, tokenizer: Any = None,
                    eos_token_ids: Sequence[int] = (), *, generator: torch.Generator | None = None) -> "Chain":
        """The config's active stages in its order. ``generator``: the run's seeded generator, handed
        to the stages that draw (XTC with 0 < xtc_probability < 1 needs it)."""
        return cls([build_stage(n, config, prompt_length, tokenizer, eos_token_ids, generator)
                    for n in config.active_stages()])

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    @property
    def stateful(self) -> bool:
        """True when a stage keeps state across steps or draws: the run must call ``observe`` after
        every pick, and resuming mid-run must replay the chain over the earlier steps."""
        return any(s.stateful for s in self.stages)

    def observe(self, input_ids: torch.Tensor, token_id: int) -> None:
        """Tell every stage which token was picked after ``input_ids`` [1, S] (``Stage.accept``)."""
        self._accepted = [stage.accept(input_ids, token_id) for stage in self.stages]

    def reset(self) -> None:
        """Every stage back to its state when built (mirostat's μ at 2τ, no loaded XTC draw)."""
        for stage in self.stages:
            stage.reset()
        self._accepted = []

    def clone(self) -> "Chain":
        """An independent chain in the same state (a branch can go on from it; stages that draw
        share the run's generator)."""
        return Chain([stage.clone() for stage in self.stages])

    def skip(self) -> None:
        """Consume the draws of one step's calls (XTC's coin), in the order the stages draw."""
        for stage in self.stages:
            stage.skip()

    def resumable(self, recorded: Sequence[StageTrace]) -> bool:
        """Whether ``recorded`` holds the state of every stage that carries one across steps
        (mirostat's μ): a trace without it (an older or edited one) is replayed instead."""
        states = {r.name for r in recorded if r.state}
        return all(stage.name in states for stage in self.stages if stage.carries)

    def resume(self, recorded: Sequence[StageTrace]) -> None:
        """Carry into each stage what its namesake had carried to the step that recorded
        ``recorded`` (mirostat's μ), so a branch from that step needs no replay of the steps
        before it (the caller skips their draws: ``skip`` and the pick's)."""
        states = {r.name: r.state for r in recorded if r.state}
        for stage in self.stages:
            if stage.name in states:
                stage.resume(states[stage.name])

    def load_states(self, recorded: Sequence[StageTrace]) -> None:
        """Load into each stage the state its namesake recorded at a step (``recorded``: that
        step's stage records), so the chain re-processes the step as the run did."""
        states = {r.name: r.state for r in recorded if r.state}
        for stage in self.stages:
            if stage.name in states:
                stage.load_state(states[stage.name])

    def annotate(self, traces: list[StageTrace]) -> None:
        """After ``observe``: add what the stages learnt from the pick (mirostat's μ after) to the
        records ``traced`` made (``traces``: raw, one per stage, final)."""
        for learnt, trace in zip(self._accepted, traces[1:]):
            if learnt:
                trace.params = {**trace.params, **learnt}

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            logits = stage(input_ids, logits)
        return logits

    def traced(self, input_ids: torch.Tensor, logits: torch.Tensor, top_n: int,
               token_text: Callable[[int], str]) -> "Traced":
        """Apply the chain to one row (B = 1) and record raw, every stage, and final: the one-row
        case of ``traced_rows`` (a stage's exception is raised). Cost: one softmax and one top-k
        per stage, no Python loop over the vocabulary."""
        out = traced_rows([self], [input_ids], logits, [top_n], token_text)[0]
        if isinstance(out, Exception):
            raise out
        return out


def spread_probs(probs: torch.Tensor, ids: torch.Tensor, size: int) -> torch.Tensor:
    """Probabilities [n] at ``ids`` as [size], 0 elsewhere."""
    return torch.zeros(size, dtype=probs.dtype, device=probs.device).index_copy_(0, ids, probs)


@dataclass
class Traced:
    """What ``Chain.traced`` returns: the final logits [1, V], the stage records, and the raw and
    final probabilities (so the caller needs no further softmax); ``between``: the probabilities
    after each stage between raw and final (``stages[1:-1]``), so the picked token's p at a stage
    whose top-N misses it can be recorded (``core.step_trace``). The probabilities are [V], or, for a
    row recorded on its ``support`` (``traced_rows``' supports: ids [n], ascending, outside which every
    logit is -inf), [n] at those ids; ``raw_probs``, ``final_probs`` and ``stage_probs`` are always [V],
    ``prob`` reads one token's p from either."""

    logits: torch.Tensor  # [1, V]; on a support [1, V], or [1, n] when no stage ran (``final_logits``)
    stages: list[StageTrace]
    raw: torch.Tensor
    final: torch.Tensor
    between: list[torch.Tensor] = field(default_factory=list)
    support: torch.Tensor | None = None
    vocab_size: int = 0  # V (0: the logits' width)

    def __iter__(self):
        """Unpacks as ``final_logits, stages``."""
        return iter((self.logits, self.stages))

    def dense(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs`` (one of this record's) over the whole vocabulary [V]."""
        if self.support is None:
            return probs
        return spread_probs(probs, self.support, self.vocab_size or self.logits.shape[-1])

    def prob(self, probs: torch.Tensor, token: int) -> float:
        """``token``'s p in ``probs`` (one of this record's): 0 outside the support."""
        if self.support is None:
            return float(probs[token])
        at = int(torch.searchsorted(self.support, token))
        return float(probs[at]) if at < len(self.support) and int(self.support[at]) == token else 0.0

    @property
    def raw_probs(self) -> torch.Tensor:
        return self.dense(self.raw)

    @property
    def final_probs(self) -> torch.Tensor:
        return self.dense(self.final)

    @property
    def stage_probs(self) -> list[torch.Tensor]:
        return [self.dense(p) for p in self.between]

    def final_logits(self) -> torch.Tensor:
        """The final logits [1, V], or [1, n] at the support."""
        if self.support is None or self.logits.shape[-1] == len(self.support):
            return self.logits
        return self.logits[:, self.support]


def traced_rows(chains: Sequence[Chain], input_ids: Sequence[torch.Tensor],
                logits: torch.Tensor | Sequence[torch.Tensor], top_n: Sequence[int], token_text: Callable[[int], str],
                supports: Sequence[torch.Tensor | None] | None = None,
                vocab_size: int | None = None) -> list["Traced | Exception"]:
    """``Chain.traced`` for B rows at once: row b is ``chains[b].traced(input_ids[b], logits[b:b+1],
    top_n[b], token_text)`` (input_ids[b]: [1, S_b]; logits [B, V]), with the same tokens and
    floats. The statistics of each stage position are computed on [R, V] for every row that has a
    stage there, with one ``.tolist()`` per statistic; stages shareable across rows run once per
    group of equal params. A row whose stage raises gets that exception and drops out.

    ``supports[b]`` (ids [n], ascending): every logit of row b outside them is -inf (a served model's
    top-N); its row is [1, V], or [1, n]: the logits at those ids (spread over [1, ``vocab_size``] with
    -inf only when a stage runs on it). The stages run on [1, V]; the records are made on the n ids
    only (what lies outside adds nothing to a softmax, a sum or a top list: the same records, the
    floats to the order of a sum) while each stage keeps the rest at -inf, which is checked: a stage
    that makes a token outside finite (or NaN) moves the row back to [V] records from there on.
    ``logits``: [B, V], or the B rows as a list ([1, V] or [1, n] each)."""
    every = list(range(len(chains)))
    # [1, V] each (or [1, n] on a support): row b's logits so far
    rows: list[torch.Tensor] = [logits[b:b + 1].float() for b in every] if isinstance(logits, torch.Tensor) \
        else [r.float() for r in logits]
    if not vocab_size and supports is not None and any(
            s is not None and r.shape[-1] == len(s) for r, s in zip(rows, supports)):
        raise ValueError("vocab_size: needed for a row given on its support ([1, n])")
    recorder = _RowsRecorder(list(top_n), token_text, list(supports) if supports is not None else None,
                             vocab_size or max(r.shape[-1] for r in rows))
    for b in every:
        recorder.check_support(b, rows[b])
    traces = [[t] for t in recorder.record_rows(every, rows, ["raw"] * len(every), [{}] * len(every))]
    raw_probs = recorder.probs_of(every)
    stage_probs: list[list[torch.Tensor]] = [[] for _ in every]  # row b's probabilities after each of its stages
    errors: dict[int, Exception] = {}
    for j in range(max((len(c.stages) for c in chains), default=0)):
        active = [b for b, c in enumerate(chains) if j < len(c.stages) and b not in errors]
        found: dict[int, dict] = {}
        for b in active:  # a row given on its support is spread over [1, V] for its first stage
            rows[b] = recorder.spread_row(b, rows[b])
        errors.update(_apply_position(j, active, chains, input_ids, rows, found))
        active = [b for b in active if b not in errors]
        if active:
            for b in active:
                recorder.check_support(b, rows[b])
            stages = [chains[b].stages[j] for b in active]
            records = recorder.record_rows(active, rows, [s.name for s in stages],
                                           [{**s.knobs, **found[b]} for b, s in zip(active, stages)],
                                           [s.state() for s in stages])
            for b, trace, probs in zip(active, records, recorder.probs_of(active)):
                traces[b].append(trace)
                stage_probs[b].append(probs)
    out: list[Traced | Exception] = []
    for b in range(len(chains)):
        if b in errors:
            out.append(errors[b])
            continue
        last = traces[b][-1]
        traces[b].append(StageTrace("final", last.kept, 0.0, last.entropy, 0.0, list(last.top), [], {},
                                    varentropy=last.varentropy))
        support = recorder.support[b]
        if support is None:  # a row that left its support: its earlier probabilities over [V] too
            raw_probs[b] = recorder.spread(b, raw_probs[b])
            stage_probs[b] = [recorder.spread(b, p) for p in stage_probs[b]]
        out.append(Traced(rows[b], traces[b], raw_probs[b], recorder.probs_of([b])[0], stage_probs[b], support,
                          recorder.vocab_size if support is not None else 0))
    return out


def _apply_position(j: int, active: list[int], chains: Sequence[Chain], input_ids: Sequence[torch.Tensor],
                    rows: list, found: dict[int, dict]) -> dict[int, Exception]:
    """Apply stage ``j`` of each active row's chain to ``rows[b]`` (in place in the list; its
    diagnostics into ``found[b]``): shareable stages with equal knobs once on the stacked rows
    (they have no diagnostics), the others row by row. Returns the rows whose stage raised."""
    groups: dict[tuple, list[int]] = {}
    alone: list[int] = [] if len(active) > 1 else list(active)  # one row shares with nobody
    for b in active if len(active) > 1 else ():
        key = share_key(chains[b].stages[j])
        (groups.setdefault(key, []) if key is not None else alone).append(b)
    for key, members in groups.items():
        if len(members) == 1:
            alone.extend(members)
            continue
        try:
            out, shared = chains[members[0]].stages[j].run(input_ids[members[0]], torch.cat([rows[b] for b in members]))
        except Exception:  # noqa: BLE001 (stateless: retried row by row below, so the error lands on its row)
            alone.extend(members)
            continue
        for i, b in enumerate(members):
            rows[b], found[b] = out[i:i + 1], shared
    errors: dict[int, Exception] = {}
    for b in alone:
        try:
            rows[b], found[b] = chains[b].stages[j].run(input_ids[b], rows[b])
        except Exception as exc:  # noqa: BLE001 (one row's failure ends that row only)
            errors[b] = exc
    return errors


def entropy_rows(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each row of ``probs`` [R, V] -> [R], removed tokens (p = 0)
    counting 0. Equals ``torch.special.entr(probs).sum(-1)`` to float rounding (bit for bit on the
    rows measured): entr is a scalar loop on CPU, while log and multiply are vectorized, 2.4x less
    CPU on a raw [16, 49152] row set. The clamp keeps log away from 0, which the vectorized log
    takes a slow path for (30x), and 0 * log(tiny) = 0 is entr's value at 0 (bench/chain_capture.py)."""
    return entropy_varentropy_rows(probs, varentropy=False)[0]


def entropy_varentropy_rows(probs: torch.Tensor, varentropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Entropy H (as ``entropy_rows``) and varentropy Σ p (−log p − H)² (nats², the variance of the
    surprisal: what entropy-adaptive samplers read beside H) of each row of ``probs`` [R, V] -> [R]
    each, from one log of the row; p = 0 counts 0 in both. The direct form, not Σ p log² p − H²,
    which cancels catastrophically on a peaked row."""
    log_p = probs.clamp(min=_TINY).log()  # [R, V]
    entropy = -(probs * log_p).sum(dim=-1)  # [R]
    if not varentropy:
        return entropy, None
    return entropy, (probs * (log_p + entropy[:, None]).square()).sum(dim=-1)


_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32


class _RowsRecorder:
    """Statistics of consecutive distributions, for many rows at once: keeps each row's previous
    probabilities and top list (so each stage costs one softmax); one softmax, entropy, top-k and
    ``.tolist()`` per statistic for all the rows of a stage position. A row with a support (ids [n],
    ascending; -inf outside) is recorded alone on [1, n]."""

    def __init__(self, top_n: list[int], token_text: Callable[[int], str],
                 supports: list[torch.Tensor | None] | None = None, vocab_size: int = 0):
        self.top_n, self.token_text, self.vocab_size = top_n, token_text, vocab_size
        self.support: list[torch.Tensor | None] = supports or [None] * len(top_n)
        self.former: dict[int, tuple[torch.Tensor, int]] = {}  # rows that left their support: (it, V)
        self.prev: list[tuple[torch.Tensor, int] | None] = [None] * len(top_n)  # (probs [R, V or n], row) per row
        self.prev_top: list[list[TokenProb]] = [[] for _ in top_n]

    def on_support(self, b: int, row: torch.Tensor) -> bool:
        """Whether ``row`` is row b's logits at its support only ([1, n])."""
        support = self.support[b]
        return support is not None and row.shape[-1] == len(support)

    def spread_row(self, b: int, row: torch.Tensor) -> torch.Tensor:
        """Row b's logits over [1, V] (-inf outside its support where given on it)."""
        support = self.support[b]
        if support is None or row.shape[-1] != len(support):  # not on its support (``on_support``)
            return row
        out = torch.full((1, self.vocab_size), -math.inf, dtype=row.dtype, device=row.device)
        return out.index_copy_(1, support, row)

    def check_support(self, b: int, row: torch.Tensor) -> None:
        """Row b's logits ``row`` [1, V] hold -inf at every id outside its support (a row given on
        its support does by construction); else the row is recorded over [V] from now on (its
        previous probabilities spread over [V])."""
        support = self.support[b]
        if support is None or self.on_support(b, row) \
                or float(row.index_fill(1, support, -math.inf).amax()) == -math.inf:
            return
        self.former[b] = (support, row.shape[-1])
        self.support[b] = None
        if self.prev[b] is not None:
            self.prev[b] = (self.spread(b, self.probs_of([b])[0])[None], 0)

    def spread(self, b: int, probs: torch.Tensor) -> torch.Tensor:
        """Row b's probabilities ``probs`` over [V]: as they are, or spread from the support it left."""
        if b not in self.former or probs.shape[-1] == self.former[b][1]:
            return probs
        return spread_probs(probs, *self.former[b])

    def record_rows(self, active: list[int], rows: list[torch.Tensor], names: list[str], params: list[dict],
                    states: list[dict] | None = None) -> list[StageTrace]:
        """``record`` for ``active`` rows whose logits are ``rows[b]`` [1, V]: the rows without a support
        stacked [R, V], each row with one alone on its n ids."""
        out: dict[int, StageTrace] = {}
        dense = [i for i, b in enumerate(active) if self.support[b] is None]
        if dense:
            members = [active[i] for i in dense]
            stacked = torch.cat([rows[b] for b in members]) if len(members) > 1 else rows[members[0]]  # [R, V]
            for i, trace in zip(dense, self.record(members, stacked, [names[i] for i in dense],
                                                   [params[i] for i in dense],
                                                   [states[i] for i in dense] if states else None)):
                out[i] = trace
        for i, b in enumerate(active):
            support = self.support[b]
            if support is not None:
                on = rows[b] if self.on_support(b, rows[b]) else rows[b][:, support]
                out[i] = self.record([b], on, [names[i]], [params[i]], [states[i]] if states else None,
                                     support)[0]
        return [out[i] for i in range(len(active))]

    def previous(self, b: int) -> tuple[torch.Tensor, int]:
        """Row b's latest record: (the probabilities it was made on [R, V] or [1, n], its row there)."""
        held = self.prev[b]
        if held is None:
            raise RuntimeError(f"chain: row {b} has no record yet")
        return held

    def probs_of(self, rows: list[int]) -> list[torch.Tensor]:
        """The latest probabilities of each of ``rows``: [V], or [n] on its support."""
        return [probs[at] for probs, at in (self.previous(b) for b in rows)]

    def _prev_stacked(self, rows: list[int]) -> torch.Tensor:
        """The previous probabilities of ``rows`` as [R, V] (no copy when they are one record's rows)."""
        held = [self.previous(b) for b in rows]
        first = held[0][0]
        if all(probs is first for probs, _ in held) and [at for _, at in held] == list(range(first.shape[0])):
            return first
        return torch.stack(self.probs_of(rows))

    def record(self, rows: list[int], logits: torch.Tensor, names: list[str], params: list[dict],
               states: list[dict] | None = None, support: torch.Tensor | None = None) -> list[StageTrace]:
        """The StageTraces of ``rows`` (indices into the batch) whose logits are ``logits`` [R, V], or of
        one row's [1, n] at the ids ``support``."""
        probs = torch.softmax(logits, dim=-1)  # [R, V]; masked tokens get exactly 0
        alive = probs > 0
        kept = alive.sum(dim=-1)  # [R]
        entropy, varentropy = entropy_varentropy_rows(probs)  # [R] each
        assert varentropy is not None  # (asked for)
        first = self.prev[rows[0]] is None
        if first:
            mass, tv = [0.0] * len(rows), [0.0] * len(rows)
        else:
            prev = self._prev_stacked(rows)
            mass = prev.masked_fill(alive, 0.0).sum(dim=-1).tolist()
            tv = (0.5 * (probs - prev).abs().sum(dim=-1)).tolist()
        kept_list, entropy_list, varentropy_list = kept.tolist(), entropy.tolist(), varentropy.tolist()
        tops = self._tops(rows, probs, kept_list, support)
        removed = [[] for _ in rows] if first else self._removed(rows, alive, support)
        out = []
        for i, b in enumerate(rows):
            out.append(StageTrace(names[i], kept_list[i], float(mass[i]), entropy_list[i], float(tv[i]),
                                  tops[i], removed[i], dict(params[i]), dict(states[i]) if states else {},
                                  varentropy=varentropy_list[i]))
            self.prev[b], self.prev_top[b] = (probs, i), tops[i]
        return out

    def _tops(self, rows: list[int], probs: torch.Tensor, kept: list[int],
              support: torch.Tensor | None = None) -> list[list[TokenProb]]:
        """Each row's top min(top_n, kept, V) tokens (removed tokens are not "top"); one top-k per
        distinct k (on a support: its positions read as its ids)."""
        ks = [min(self.top_n[b], kept[i], probs.shape[1]) for i, b in enumerate(rows)]
        tops: list[list[TokenProb]] = [[] for _ in rows]
        for k in set(ks):
            members = [i for i, ki in enumerate(ks) if ki == k]
            some = probs.index_select(0, torch.tensor(members, dtype=torch.long, device=probs.device)) \
                if len(members) < len(rows) else probs
            values, ids = torch.topk(some, k)
            if support is not None:
                ids = support[ids]
            for i, id_row, p_row in zip(members, ids.tolist(), values.tolist()):
                tops[i] = [TokenProb(t, self.token_text(t), p) for t, p in zip(id_row, p_row)]
        return tops

    def _removed(self, rows: list[int], alive: torch.Tensor,
                 support: torch.Tensor | None = None) -> list[list[TokenProb]]:
        """Of each row's previous top list, the tokens this stage removed (on a support: the previous
        top tokens, all inside it, found at their positions in it)."""
        width = max(len(self.prev_top[b]) for b in rows)
        if width == 0:
            return [[] for _ in rows]
        ids = torch.tensor([[t.token_id for t in self.prev_top[b]] + [0] * (width - len(self.prev_top[b])) for b in rows],
                           dtype=torch.long, device=alive.device)  # [R, width], padded with token 0
        if support is not None:
            ids = torch.searchsorted(support, ids).clamp(max=len(support) - 1)
        still = alive.gather(1, ids).tolist()
        return [[t for t, s in zip(self.prev_top[b], still[i]) if not s] for i, b in enumerate(rows)]
