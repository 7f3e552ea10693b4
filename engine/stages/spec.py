"""The stage room's name for the stage specs: ``engine.base.stage_spec`` (StageSpec, the registry
STAGES, the note words) and ``engine.base.knobs`` (Knob, ConfigError), which live on the base floor
so that the config reads them without importing a stage. The stage families import them from here."""

from engine.base.knobs import *  # noqa: F401,F403
from engine.base.stage_spec import *  # noqa: F401,F403
