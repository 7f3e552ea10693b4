"""The KV cache, one room: ``kv_cache`` (KVCache: prefill, step, rewind, sync, left-padded rows for the
batch; ``left_padded``) and ``kv_quant`` (the cache kinds: quantized, sliding window, and their bytes).
The run config's cache knobs (``kv_cache``, ``kv_residual_length``) are declared in ``engine.config``."""

from engine.cache import kv_quant  # noqa: F401
from engine.cache.kv_cache import KVCache, left_padded  # noqa: F401
