#!/bin/sh
# Make the 4-bit checkpoints of the embedded model (issue #40: RTN, GPTQ and AWQ, W4A16, groups of 64
# and 32) once per machine and cache them outside the repo; print the cache folder.
#
#   sh deploy/quantize.sh PYTHON        (PYTHON: the app's venv python, e.g. .venv/bin/python)
#
# llm-compressor 0.14 pins transformers <= 5.17 (the app runs 5.x above that), so it gets its own
# venv, made once in the cache like the llama-server build: $CACHE/llmcompressor-0.14/. torch there is
# the local CPU wheel (torch==2.13.0; a plain `torch` would pull a multi-GB CUDA build). The app's
# python says what to make (python -m deploy.quantize_plan: model folder, cache folder,
# calibration sets, variants); deploy/quantize.py writes each checkpoint to a temporary folder and
# renames it into place, so a cancelled run leaves only whole checkpoints and the next run makes the
# rest. A lock lets `make test` (in the background) and `make quantize` run together.
#
# Environment: QUANTIZE_VARIANTS (a space-separated subset of the plan's variants: the app's
# on-demand maker, playground/checkpoint_maker.py, asks for one lesson's), QUANTIZE_VENV (the
# llm-compressor venv, default in the cache: a test on a fresh cache reuses the installed one).
set -eu

PY=${1:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
CACHE=${DECODING_PLAYGROUND_CACHE:-$HOME/.cache/decoding-playground}
LC_VERSION=0.14.0.1
VENV=${QUANTIZE_VENV:-$CACHE/llmcompressor-0.14}
BASE_PY=${QUANTIZE_BASE_PYTHON:-python3}   # makes the venv: any Python 3.10+ with venv

command -v flock >/dev/null || { echo "quantize: flock is missing (apt-get install util-linux)" >&2; exit 1; }
mkdir -p "$CACHE"
exec 9>"$CACHE/llmcompressor-0.14.lock"
flock 9                                 # another run holds it; we then find its venv and checkpoints

if [ ! -f "$VENV/.installed-$LC_VERSION" ]; then
  echo "quantize: installing llm-compressor $LC_VERSION into $VENV (once, ~2 min)" >&2
  rm -rf "$VENV"
  "$BASE_PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q torch==2.13.0 >&2
  "$VENV/bin/python" -m pip install -q "llmcompressor==$LC_VERSION" >&2
  touch "$VENV/.installed-$LC_VERSION"    # the marker last: a cancelled install is redone whole
fi

PLAN=$(cd "$ROOT" && "$PY" -m deploy.quantize_plan)
value() { printf '%s\n' "$PLAN" | sed -n "s/^$1=//p"; }
OUT=$(value OUT)
set --
for cal in $(value CALIBRATION); do set -- "$@" --calibration "$cal"; done
# One thread: on the 2-core machines this runs beside the test suite (make test) or the app.
OMP_NUM_THREADS=${QUANTIZE_THREADS:-1} OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false \
  "$VENV/bin/python" "$HERE/quantize.py" --model "$(value MODEL)" --out "$OUT" "$@" \
  --max-tokens "$(value MAX_TOKENS)" --dampening "$(value DAMPENING)" --actorder "$(value ACTORDER)" \
  --n-grid "$(value N_GRID)" ${QUANTIZE_VARIANTS:-$(value VARIANTS)} >&2
echo "$OUT"
