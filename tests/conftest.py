"""Shared fixtures: the embedded model (loaded once per session) and a tiny random Llama that
shares the embedded tokenizer, for tests that need speed rather than sense."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

# OpenMP threads spin-wait by default; on a busy 2-core machine that makes batched forwards 10-30x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from engine.backends.local import LoadedModel, ModelSpec, embedded_model_dir  # noqa: E402
from engine.backends.registry import ModelRegistry
from engine.threads import default_threads, set_threads  # noqa: E402
from tests.helpers.common import (ARTIFACTS, CHROMIUM_ARGS, VLLM_TEST_ARGS, browser_page,  # noqa: E402,F401
                                  free_port, launch_local, make_tiny_llama, serve_llama)


def worker_threads() -> int:
    """One test process's torch threads: the cores (``default_threads``) shared among the xdist
    workers. make test's first phase runs two workers on two cores; two threads each would be four
    threads on two cores, where a forward's threads wait at every parallel region for a peer the
    other worker's threads have descheduled (one thread also beats two for one sequence here)."""
    return max(1, default_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


set_threads(worker_threads())  # engine.threads is the one place the thread count is set


def share_httpx_ssl_contexts() -> None:
    """httpx builds a new SSLContext for every client and every module-level call (``httpx.post``),
    also for an http:// URL, and each one loads the whole CA bundle: ~20-50 ms of CPU. gradio_client
    makes two per call (its ``send_data`` post and the stream it opens), so on this suite's 2 cores a
    py-spy profile of the two workers found 24% of their busy time in ``ssl.create_default_context``.
    The tests talk to 127.0.0.1 over plain HTTP; one context per (verify, trust_env) serves them all
    (an SSLContext is made to be shared). A caller's own context or certificate is left alone."""
    import functools

    import httpx._transports.default as transports

    made = transports.create_ssl_context

    @functools.lru_cache(maxsize=4)
    def shared(verify: bool, trust_env: bool):
        return made(verify=verify, cert=None, trust_env=trust_env)

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if isinstance(verify, bool) and cert is None:
            return shared(verify, trust_env)
        return made(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = create_ssl_context


share_httpx_ssl_contexts()


def index_gradio_client_components() -> None:
    """gradio_client's ``Client()`` finds every input and output component of every endpoint by a
    linear scan of the app's components: this app has 930 components and 4,648 such references,
    0.23 s of a ``Client()``'s 0.34 s of CPU, and the suite opens hundreds of sessions. The same
    lookup through a dict made once per config; the method's body is otherwise gradio_client's own,
    replaced only while its source is the scan it was written against."""
    import inspect

    from gradio_client import client, utils

    scan = 'i for i in self.client.config["components"] if i["id"] == component_id'
    if scan not in inspect.getsource(client.Endpoint._get_component_type):
        return

    def _get_component_type(self, component_id: int):
        config = self.client.config
        index = getattr(self.client, "_components_by_id", None)
        if index is None or index[0] is not config:
            index = self.client._components_by_id = (config, {c["id"]: c for c in config["components"]})
        component = index[1][component_id]
        skip_api = component.get("skip_api", component["type"] in utils.SKIP_COMPONENTS)
        return client.ComponentApiType(skip_api, self.value_is_file(component), component["type"] == "state")

    client.Endpoint._get_component_type = _get_component_type


index_gradio_client_components()


class SessionRegistry(ModelRegistry):
    """The session's registry: the embedded model, once loaded, stays loaded. Tests hold that object
    (the ``embedded`` fixture) and watch it (a forward hook, the scheduler's stats by model); had a
    test that loads four other models evicted it, the app would run a fresh copy the hook never sees
    (the run "never started"), depending on which files a worker ran before."""

    def get(self, spec: ModelSpec, progress=None, *, key: str = "model") -> LoadedModel:
        lm = super().get(spec, progress, key=key)
        with self._lock:
            if spec == ModelSpec():
                self._embedded = lm
            elif getattr(self, "_embedded", None) is not None and ModelSpec() not in self._models:
                self._models = {ModelSpec(): self._embedded, **self._models}  # back, as the least recently used
        return lm


@pytest.fixture(scope="session")
def registry() -> ModelRegistry:
    return SessionRegistry(capacity=4)


@pytest.fixture(scope="session")
def embedded(registry) -> LoadedModel:
    """SmolLM2-135M-Instruct, fp32 on CPU."""
    return registry.get(ModelSpec())


@pytest.fixture(scope="session")
def tiny_lm() -> LoadedModel:
    """A 2-layer random Llama over the embedded tokenizer (vocab 49152): fast, meaningless."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    model = make_tiny_llama()
    return LoadedModel(
        name="tiny-random-llama", model=model, tokenizer=tokenizer, device=torch.device("cpu"),
        dtype=torch.float32, quantization="none", source="tiny", eos_token_ids=(2,),
        memory_bytes=int(model.get_memory_footprint()),
    )


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def live_forwards(live_app, registry, embedded):
    """Counts forwards of the embedded model (the live app's model) while the test runs, once the
    app's startup examples (their own runs on the same model) are done."""
    from playground.examples import cache_for

    assert cache_for(registry).wait(300), "the startup examples did not finish"
    count = [0]
    handle = embedded.model.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    yield count
    handle.remove()


@pytest.fixture(scope="session")
def live_app(registry):
    """The whole app served in-process on a free loopback port; yields its URL."""
    from playground.app import build_app

    demo = build_app(registry)
    launch_local(demo)
    yield demo.local_url.rstrip("/")
    demo.close()


@pytest.fixture(scope="session")
def browser():
    """Debian's chromium driven by Playwright (no browser download)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    yield from browser_page(browser, 1400, 1000)


@pytest.fixture
def projector_page(browser):
    """A page the size of a projector (1280x720), as the presenter view is used."""
    yield from browser_page(browser, 1280, 720)


# --- llama.cpp's server (issue #29): tests marked `remote` -----------------------------------------
import tempfile  # noqa: E402

LLAMA_BUILD_WAIT_S = 1800  # `make test` starts the build in the background; a cold build takes ~15-25 min
LLAMA_BUILD_LOG = Path(tempfile.gettempdir()) / "llama-server-build-pytest.log"


def pytest_collection_modifyitems(config, items):
    """Tests marked `quantized`, then those marked `remote`, then those marked `vllm`, run last, so the
    checkpoints, the llama-server build and the vLLM install `make test` started in the background
    overlap everything else (a stable sort keeps every other order)."""
    items.sort(key=lambda item: (item.get_closest_marker("vllm") is not None,
                                 item.get_closest_marker("remote") is not None,
                                 item.get_closest_marker("quantized") is not None))


# `make test` runs two pytest-xdist workers. A test file is one unit of work, so its module fixtures (an
# app, a page, a server) are made once, on one worker; the files with tests marked `vllm` are one unit, so
# the two vLLM servers (a minute each to start, a few GB) start once, on one worker. Units go out in the
# order above (`--no-loadscope-reorder`). (xdist's own `--dist loadgroup` cannot do this under pytest 9:
# it renames items through an attribute pytest no longer reads.)
VLLM_FILES = frozenset(path.relative_to(ROOT).as_posix() for path in Path(__file__).parent.rglob("test_*.py")
                       if "pytest.mark.vllm" in path.read_text(errors="replace"))


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "vllm" if path in VLLM_FILES else path

    return FileScheduling(config, log)


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    """The cached llama-server, built (or waited for, when a build is running) by
    deploy/llama_server.sh; fails with one line, never skips, when it cannot be had."""
    import subprocess

    with open(LLAMA_BUILD_LOG, "w") as log:
        try:
            done = subprocess.run(["nice", "-n", "19", "sh", str(ROOT / "deploy" / "llama_server.sh"), sys.executable],
                                  stdout=subprocess.PIPE, stderr=log, text=True, timeout=LLAMA_BUILD_WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"llama-server: not built within {LLAMA_BUILD_WAIT_S} s (log: {LLAMA_BUILD_LOG})",
                        pytrace=False)
    if done.returncode != 0:
        last = (LLAMA_BUILD_LOG.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
        pytest.fail(f"llama-server: the build failed ({last[:200]}; log: {LLAMA_BUILD_LOG})", pytrace=False)
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def llama_server(llama_server_binary) -> Iterator[str]:
    """A real llama-server serving the embedded GGUF on a free 127.0.0.1 port; yields its URL and
    stops it after the session."""
    with serve_llama(llama_server_binary) as url:
        yield url


@pytest.fixture(scope="session")
def server_model(llama_server):
    """The real llama-server as a RemoteModel (step mode), connected once for the session."""
    from engine.backends import llamacpp

    return llamacpp.connect(llama_server, timeout_s=60)


# --- the 4-bit checkpoints (issue #40): tests marked `quantized` ------------------------------------
QUANTIZE_WAIT_S = 2400  # `make test` starts deploy/quantize.sh in the background; a cold run takes minutes
QUANTIZE_LOG = Path(tempfile.gettempdir()) / "quantize-pytest.log"


@pytest.fixture(scope="session")
def quant_checkpoints() -> Path:
    """The cache folder of the RTN / GPTQ / AWQ checkpoints, made (or waited for, when a run is going
    on) by deploy/quantize.sh; fails with one line, never skips, when they cannot be had."""
    import subprocess

    with open(QUANTIZE_LOG, "w") as log:
        try:
            done = subprocess.run(["nice", "-n", "19", "sh", str(ROOT / "deploy" / "quantize.sh"), sys.executable],
                                  stdout=subprocess.PIPE, stderr=log, text=True, timeout=QUANTIZE_WAIT_S, cwd=ROOT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"quantize: the checkpoints were not made within {QUANTIZE_WAIT_S} s (log: {QUANTIZE_LOG})",
                        pytrace=False)
    if done.returncode != 0:
        last = (QUANTIZE_LOG.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
        pytest.fail(f"quantize: making the checkpoints failed ({last[:200]}; log: {QUANTIZE_LOG})", pytrace=False)
    return Path(done.stdout.strip().splitlines()[-1])


# --- vLLM (issue #37): tests marked `vllm` --------------------------------------------------------
VLLM_INSTALL_WAIT_S = 1800  # `make test` starts the install in the background; a cold one takes minutes
VLLM_INSTALL_LOG = Path(tempfile.gettempdir()) / "vllm-install-pytest.log"


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The cached vLLM environment's python, installed (or waited for, when `make test`'s background
    install runs) by deploy/vllm.sh; fails with one line, never skips, when it cannot be had."""
    from deploy.vllm_serve import VllmError, install

    try:
        return install(sys.executable, VLLM_INSTALL_LOG, VLLM_INSTALL_WAIT_S)
    except VllmError as exc:
        pytest.fail(f"vllm: the install failed ({exc}; log: {VLLM_INSTALL_LOG})", pytrace=False)


@pytest.fixture(scope="session")
def vllm_servers(vllm_python, tmp_path_factory) -> Iterator[dict[str, str]]:
    """The two real vLLM servers of the live tests on free 127.0.0.1 ports, started at once so their
    starts (about a minute each, mostly imports) overlap: ``good`` over the embedded model's folder,
    ``tied_only`` over that folder in the conversion's old layout (tests/data/vllm/record.py's
    tied_only_folder: the weights vLLM reads are missing). Their URLs; fails in one line if one does not start."""
    from deploy.vllm_serve import VllmError, serving_all
    from engine.backends.local import embedded_model_dir
    from tests.data.vllm.record import tied_only_folder

    ARTIFACTS.mkdir(exist_ok=True)
    folder = tied_only_folder(embedded_model_dir(), tmp_path_factory.mktemp("vllm") / "tied-only")
    servers = [(VLLM_TEST_ARGS, ARTIFACTS / "vllm-server.log"),
               ((*VLLM_TEST_ARGS, "--model", str(folder)), ARTIFACTS / "vllm-server-tied-only.log")]
    try:
        with serving_all(vllm_python, servers) as (good, tied_only):
            yield {"good": good, "tied_only": tied_only}
    except VllmError as exc:
        pytest.fail(f"{exc}", pytrace=False)


@pytest.fixture(scope="session")
def vllm_server(vllm_servers) -> str:
    """The real vLLM serving the embedded model (float32) for the session; its URL."""
    return vllm_servers["good"]


@pytest.fixture(scope="session")
def vllm_model(vllm_server):
    """The real vLLM as a RemoteModel (step mode), connected once as the operator lists it."""
    from deploy.vllm_serve import remote_spec
    from engine.backends import remote, served

    return remote.connect_spec(served.RemoteSpec.parse(remote_spec(vllm_server)), timeout_s=120)


# --- where the suite's time goes (CI shows the end of the output: this summary is printed last) -------
_FILE_SECONDS: dict[str, float] = {}
_WAITS: dict[str, float] = {}  # a background prerequisite's fixture -> seconds its setup took (every worker's)
_NEW_WAITS: dict[str, float] = {}  # this process's, not yet handed on with a test's report
_PREREQUISITES = ("llama_server_binary", "quant_checkpoints", "vllm_python", "vllm_servers", "llama_server",
                  "live_app", "embedded")


def pytest_runtest_logreport(report) -> None:
    """(Under xdist the controller sees every worker's reports: the summary covers the whole run.)"""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    for key, value in report.user_properties:
        if key == "session_fixture_s":
            name, seconds = value
            _WAITS[name] = _WAITS.get(name, 0.0) + seconds


class _SessionFixtureTimer:
    """A plugin, not a conftest hook: a session fixture is set up on the session's node, which a
    conftest's hooks inside tests/ do not reach."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        import time

        start = time.monotonic()
        yield
        if fixturedef.argname in _PREREQUISITES and fixturedef.scope == "session":
            _NEW_WAITS[fixturedef.argname] = _NEW_WAITS.get(fixturedef.argname, 0.0) + time.monotonic() - start


def pytest_configure(config) -> None:
    config.pluginmanager.register(_SessionFixtureTimer(), "decoding-playground-session-fixture-timer")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A session fixture's setup time travels with the report of the test that made it (a worker's
    report reaches the controller, which prints the summary)."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        report.user_properties.extend(("session_fixture_s", wait) for wait in _NEW_WAITS.items())
        _NEW_WAITS.clear()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter) -> None:
    """The 20 test files that took longest (setup, call and teardown together) and the session
    fixtures that wait on a background build or start a server (summed over the workers): the next
    session sees where the fresh clone's time goes."""
    write = terminalreporter.write_line
    write("suite time by file (s): " + ", ".join(
        f"{path.removeprefix('tests/')} {seconds:.0f}"
        for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:20]))
    write("session fixtures (s): " + ", ".join(f"{name} {seconds:.0f}" for name, seconds in _WAITS.items()))


