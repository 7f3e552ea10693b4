"""What deploy/quantize.sh makes, one ``KEY=value`` a line (engine.backends.quant_methods.plan):
the embedded model's directory (converted once if needed), the cache folder, the calibration sets,
the variants and the recipe's settings.

    python -m deploy.quantize_plan
"""

from __future__ import annotations

import sys

from engine.backends.local import embedded_model_dir
from engine.backends.quant_methods import plan

if __name__ == "__main__":
    for key, value in plan(embedded_model_dir(lambda msg: print(msg, file=sys.stderr))).items():
        print(f"{key}={value}")
