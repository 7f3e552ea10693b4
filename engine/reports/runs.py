"""What a report asks of the orchestrators, as an interface: ``Runs`` (run a strategy, open a
private batched scheduler) and ``Batcher`` (that scheduler). The reports sit on a floor below
``engine.runner`` and ``engine.scheduler`` (docs/architecture.md), so they never import them: the
caller hands them ``engine.runner.RUNS``, which fills this interface."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ContextManager, Iterator, Protocol, Sequence

from engine.base.seam import Model

if TYPE_CHECKING:  # annotations only
    from engine.config import DecodingConfig
    from engine.control import RunControl
    from engine.reports.serving import ServingStats
    from engine.trace import StepTrace, Trace


class Batcher(Protocol):
    """A batched scheduler of one model (``engine.scheduler.Scheduler``): many greedy/sampling runs
    stepped in one forward per tick."""

    serving: "ServingStats"  # every tick and ended run

    def stream(self, prompt_ids: Sequence[int], config: "DecodingConfig", *,
               control: "RunControl | None" = None) -> Iterator["StepTrace"]: ...

    def gathered(self, count: int) -> ContextManager[None]: ...

    def settle(self, timeout_s: float = 30.0) -> bool: ...

    def close(self) -> None: ...


class Runs(Protocol):
    """How a report runs strategies (``engine.runner.RUNS``)."""

    def run(self, lm: Model, prompt: str, config: "DecodingConfig", *, chat: bool = False,
            prompt_ids: Sequence[int] | None = None, registry: Any = None, scheduler: Any = None) -> "Trace":
        """``engine.runner.run`` of that request: the whole run's Trace."""
        ...

    def scheduler(self, lm: Model, *, max_batch: int | None = None, max_queue: int | None = None,
                  prefill_chunk: int | None = None, share_prefix: bool = True) -> Batcher:
        """A private batched scheduler of ``lm`` (close it when done)."""
        ...
