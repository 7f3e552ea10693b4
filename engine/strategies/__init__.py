"""The decoding strategies, one module each, each registering its ``StrategySpec``
(``engine.base.strategy_spec``): greedy and sampling (``decode``), beam search, speculative decoding,
contrastive search and decoding, MCTS and Medusa, and their streams on a served model
(``remote_beam``, ``remote_speculative``; greedy and sampling in ``engine.backends.remote``).
Importing this package registers every strategy, in this order (the strategy pickers' order).

Add a strategy: a module here with its ``stream(ctx)`` and one ``register(StrategySpec(...))``, and
its import below (docs/architecture.md).
"""

from engine.strategies import decode, beam, speculative, contrastive, mcts, medusa, eagle  # noqa: F401  (the order matters)
from engine.strategies import remote_beam, remote_speculative  # noqa: F401  (their served streams)
