"""The stages: one ``StageSpec`` each (``engine.stages.spec``: the registry ``STAGES`` every other
module reads) and the stage families, one module each. Importing this package registers every
stage; it exports the registry, ``build_stage`` / ``share_key`` and every stage class.

Add a stage: its class and, right under it, its ``register(StageSpec(...))``, in the family module
it belongs to (or a new module imported below); nothing else changes (docs/architecture.md).
"""

from __future__ import annotations

from engine.stages.spec import (  # noqa: F401
    MAX_STRING_LEN, MAX_BIAS_ENTRIES, ConfigError, Knob, BuildContext, ExportView, Lines, Reasons, Caveat, Export,
    Interop, StageSpec, STAGES, register, unregister, on_change, declared, quoted, token_names, stage_label,
    truncation_note, reshape_note, title_number, param, number,
)
from engine.stages.base import (  # noqa: F401
    Stage, require, Wrapped, softmax, build_stage, share_key,
)
from engine.stages.constraints import (  # noqa: F401
    Constraints, word_token_variants, build_constraints, LogitBias, build_logit_bias, MinNewTokens,
)
from engine.stages.penalties import (  # noqa: F401
    RepetitionPenalty, FrequencyPenalty, PresencePenalty, NoRepeatNGram, Dry, DRY_DEFAULT_BREAKERS,
    breaker_token_ids,
)
from engine.stages.temperature import (  # noqa: F401
    Temperature, DynamicTemperature, Smoothing,
)
from engine.stages.truncation import (  # noqa: F401
    TopK, TopP, TOP_P_FLOOR, top_p_fast, MinP, TypicalP, Epsilon, TopNSigma, Eta, TopA, TopH,
)
from engine.stages.stateful import (  # noqa: F401
    Xtc, Mirostat,
)
from engine.stages.grammar import (  # noqa: F401
    Grammar, GrammarFacts, grammar_facts, grammar_cost,
)
from engine.stages.watermark import (  # noqa: F401
    Watermark, green_ids,
)
