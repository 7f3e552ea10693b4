"""The model seam: models loaded in this process (``local``: transformers, quantized variants),
served models (``served``: the model; ``llamacpp`` and ``openai``: their APIs; ``client``: the JSON
client, bounded, one deadline, no redirects; ``schema``: every answer's fields checked; ``remote``:
step mode and fast mode) and the registry of both (``registry``: the
operator's allow-list, loaded and connected models, drafter and amateur variants)."""
