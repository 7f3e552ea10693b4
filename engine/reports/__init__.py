"""What the views report about runs and models: drift between model variants and KV cache kinds
(``drift``), the KV-cache arithmetic of real models (``kv_arith``), metrics that compare runs
(``metrics``) and the lessons' checks (``lessons``)."""
