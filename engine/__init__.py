"""The decoding engine (no UI): importing any part of it registers every stage and strategy
(``engine.stages``, ``engine.strategies``), so a config, a trace or the runner always sees them all.
This face is the top floor (docs/architecture.md): the config and the trace, lower down, read the
registries (``engine.base``) when they validate, never the modules that fill them."""

import engine.stages  # noqa: F401  (registers every stage)
import engine.strategies  # noqa: F401  (registers every strategy)
