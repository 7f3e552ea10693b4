"""What a strategy is made of: ``StrategySpec`` and the registry ``STRATEGIES`` every other module reads.

A strategy lives in ONE module of ``engine/strategies/``: its ``stream(ctx)`` (a generator of
``engine.trace.Event``s, the last one holding the Trace) and, right under it, one
``register(StrategySpec(...))`` saying everything else about it: its knobs and their cross-checks,
where its trace keeps its records, whether it continues from a step, what it needs of a model,
how other tools run it, and (``serve``) its stream on a served model. ``config`` derives the
strategy names and knobs from ``STRATEGIES``; ``trace`` reads the record types, ``interop`` the
knobs in use and how other tools run it, ``engine.runner`` the streams, and the views say "not
available for this model" from ``unavailable``.

On the base floor (docs/architecture.md): no torch here and no engine import but the knobs (``Knob``)
and the seam (``Capabilities``): ``config`` and ``trace`` read this registry, and the strategy
modules, on a floor above them, register into it. ``STRATEGIES`` fills when ``engine.strategies`` is
imported, which importing anything under ``engine`` does (``engine/__init__.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.base.knobs import Knob
from engine.base.seam import Capabilities

# What a strategy may need of a model (``Capabilities`` fields), in words: a served model (an API that
# hands out a top-N per token) has none of them; a model loaded here has all (engine.base.seam).
NEEDS = {
    "full_logits": "full logits",
    "hidden_states": "the model's hidden states",
    "kv_cache": "the model's own KV cache",
    "weights": "the model's own weights",
}

Stream = Callable[[Any], Any]  # (engine.runner.RunContext) -> Iterator[Event]


@dataclass(frozen=True)
class Exported:
    """How another tool (``StrategySpec.exports``' key: "webui" for text-generation-webui, "llama"
    for llama.cpp) runs a strategy it lacks: ``note`` on the strategy (``{tool}`` is the tool's
    name) and ``knob_note`` on each of its knobs in use there, and on ``also``: other knobs that
    mean something only to it (contrastive search's top-k)."""

    note: str
    knob_note: str
    also: tuple[str, ...] = ()


@dataclass(frozen=True)
class StrategySpec:
    """Everything about one strategy (a value of ``DecodingConfig.strategy``) but its algorithm.

    ``stream(ctx)``: the run on a model loaded here. ``knobs``: the config keys it owns (each
    knob's ``strategy`` is set to it); ``in_use``: its knobs that change the run even at their
    neutral value (exports write them). ``check(config)``: ConfigError naming the knob when its
    knobs do not fit together. ``records``: where its trace keeps its typed records (a Trace field
    or a key of ``extra`` -> the record type). ``continues``: it continues from a step
    (``prefix`` / ``force``: branching, "continue from here"). ``needs``: what it needs of a model
    (``NEEDS`` keys) and ``needs_why``, the reason in words (default: from ``needs``).
    ``exported_as``: "greedy" when other tools lack it and run its nearest relative; "" when they
    run it; ``exports``: what an export to each tool that lacks it says (``Exported``). ``doc``: one line for the strategy pickers. ``served``: its stream on a served model
    (``serve`` sets it) and ``served_continues``: that stream continues from a step."""

    name: str
    stream: Stream
    knobs: tuple[Knob, ...] = ()
    in_use: tuple[str, ...] = ()
    check: Callable[[Any], None] | None = None
    records: dict[str, Any] = field(default_factory=dict)
    continues: bool = False
    needs: tuple[str, ...] = ()
    needs_why: str = ""
    exported_as: str = ""
    exports: dict[str, Exported] = field(default_factory=dict)
    doc: str = ""
    served: Stream | None = None
    served_continues: bool = False

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"strategy {self.name!r}: the name must be an identifier")
        unknown = [n for n in self.needs if n not in NEEDS]
        if unknown:
            raise ValueError(f"strategy {self.name!r}: needs {unknown[0]!r}; known: {', '.join(NEEDS)}")
        missing = [k for k in self.in_use if k not in {knob.name for knob in self.knobs}]
        if missing:
            raise ValueError(f"strategy {self.name!r}: in_use names {missing[0]!r}, not one of its knobs")
        for knob in self.knobs:
            if knob.stage is not None or knob.strategy not in (None, self.name):
                raise ValueError(f"strategy {self.name!r}: knob {knob.name!r} belongs to "
                                 f"{knob.stage or knob.strategy!r}")
        object.__setattr__(self, "knobs", tuple(k if k.strategy else dataclasses.replace(k, strategy=self.name)
                                                for k in self.knobs))

    @property
    def why(self) -> str:
        """What it needs of a model, in words ("needs the model's hidden states")."""
        return self.needs_why or "needs " + " and ".join(NEEDS[n] for n in self.needs)

    def runs_on(self, capabilities: Capabilities) -> bool:
        """Whether a model with ``capabilities`` runs it: in this process, when it has what the
        strategy needs; behind a server's API, when the strategy has a served stream."""
        if not capabilities.in_process:
            return self.served is not None
        return all(capabilities.has(n) for n in self.needs)

    def unavailable(self, capabilities: Capabilities) -> str | None:
        """One line saying why a model with ``capabilities`` cannot run it, or None when it can."""
        if self.runs_on(capabilities):
            return None
        why = self.why if self.needs else "has no implementation over a served model's API yet"
        return f"{self.name}: not available for a served model ({why})"


# --- the registry ------------------------------------------------------------------------------------
STRATEGIES: dict[str, StrategySpec] = {}  # in registration order (engine/strategies/__init__.py's)
_listeners: list[Callable[[], None]] = []


def register(spec: StrategySpec) -> StrategySpec:
    """Add a strategy (a name or knob already taken raises ValueError); modules that derive tables
    from ``STRATEGIES`` (``config``) recompute them."""
    if spec.name in STRATEGIES:
        raise ValueError(f"strategy {spec.name!r} is registered twice")
    taken = {k.name: s.name for s in STRATEGIES.values() for k in s.knobs}
    clash = [k.name for k in spec.knobs if taken.get(k.name, spec.name) != spec.name]
    if clash:
        raise ValueError(f"strategy {spec.name!r}: knob {clash[0]!r} belongs to strategy {taken[clash[0]]!r}")
    STRATEGIES[spec.name] = spec
    _changed()
    return spec


def serve(name: str, stream: Stream, *, continues: bool = False) -> None:
    """Give the registered strategy ``name`` its stream on a served model."""
    STRATEGIES[name] = dataclasses.replace(STRATEGIES[name], served=stream, served_continues=continues)


def unregister(name: str) -> None:
    """Remove a strategy (tests that register a toy strategy clean up with this)."""
    STRATEGIES.pop(name, None)
    _changed()


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` after every register / unregister (and now)."""
    _listeners.append(listener)
    listener()


def _changed() -> None:
    for listener in _listeners:
        listener()

