"""Shared by the tests: what tests/engine/test_serving_stats.py and the tests beside it use."""

from __future__ import annotations


__all__ = ['ForwardLog']


# --- the scheduler's records against its forwards ------------------------------------------------------
class ForwardLog:
    """Every decode forward's (rows, real length of each row, width, cache bytes after it), read
    from the model's own call: its attention mask (None: no row is padded) and its cache."""

    def __init__(self, model):
        self.calls: list[tuple[int, tuple[int, ...], int, int]] = []
        self.handle = model.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output):
        ids = kwargs["input_ids"]
        if ids.shape[1] != 1:
            return  # a prefill
        cache = kwargs["past_key_values"]
        width = cache.get_seq_length()
        mask = kwargs.get("attention_mask")
        lengths = tuple(int(n) for n in mask.sum(dim=1)) if mask is not None else (width,) * ids.shape[0]
        nbytes = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                     for layer in cache.layers)
        self.calls.append((ids.shape[0], lengths, width, nbytes))
