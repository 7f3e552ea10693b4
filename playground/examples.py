"""Example runs for a first screen that already teaches: each view's default prompt and preset,
run once on the default model in a background thread when the app starts, and kept in memory.

A view describes its example as an ``ExampleRequest`` (the prompt, the config its controls show on
a fresh page, the chat checkbox, the extras its Generate runs too) and asks ``cache_for(registry)``
for it when a page opens. The run goes through ``Shared.run`` like every other run (this module
never decodes), so an example is the very trace the user gets by pressing Generate unchanged.

The cache lives on the model registry (the process-wide state the design allows), keyed by model,
quantization, prompt, preset, config and chat; it holds one entry per view, never per user.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.settings import env_flag, zero_gpu_space
from engine.trace import Trace

if TYPE_CHECKING:  # shared imports gradio; this module is imported by it only through the views
    from .shared import Shared

log = logging.getLogger(__name__)
EXAMPLE_SECONDS = 300.0  # an example that takes longer on a slow machine is dropped, not waited for
State = Literal["ready", "pending", "none"]


def enabled() -> bool:
    """Example runs at startup: on unless env ``DP_EXAMPLES`` is 0 / false / no / off, and off on
    ZeroGPU (``SPACES_ZERO_GPU``): there every model call runs in a worker forked per request, and a
    fork taken while the startup thread holds the model registry's lock would inherit it held."""
    return not zero_gpu_space() and env_flag("DP_EXAMPLES")


@dataclass(frozen=True)
class ExampleRequest:
    """What a view's Generate runs on a fresh page. ``with_greedy``: a greedy run of the same
    prompt too (the beam view compares with it); ``compare_baseline``: time a target-only run."""

    view: str
    prompt: str
    preset: str
    config: DecodingConfig
    chat: bool
    compare_baseline: bool = False
    with_greedy: bool = False

    def key(self, model: str, quantization: str) -> tuple:
        config = json.dumps(self.config.to_dict(sparse=True), sort_keys=True)
        return (model, quantization or "none", self.prompt, self.preset, config, self.chat, self.compare_baseline,
                self.with_greedy)


@dataclass(frozen=True)
class Example:
    """A finished example: the run's trace (and the greedy run of the same prompt, if asked)."""

    request: ExampleRequest
    trace: Trace
    greedy: Trace | None = None


def compute(shared: Shared, request: ExampleRequest, model: str, quantization: str = "none",
            control: RunControl | None = None) -> Example:
    """Run ``request`` on ``model`` through ``Shared.run``, as the view's Generate does."""
    control = control or RunControl(deadline_s=EXAMPLE_SECONDS)
    lm = shared.lm(model, quantization)
    prompt_ids = shared.encode_prompt(lm, request.prompt, request.chat)
    trace = shared.run(lm, request.prompt, request.config, chat=request.chat, prompt_ids=prompt_ids, control=control,
                       compare_baseline=request.compare_baseline)
    greedy = None
    if request.with_greedy:
        greedy = shared.run(lm, request.prompt, request.config.replace(strategy="greedy"), chat=request.chat,
                            prompt_ids=prompt_ids, control=control)
    return Example(request, trace, greedy)


class ExampleCache:
    """Finished examples by key; ``want`` queues a request, ``start`` computes the queue in one
    background thread (one example at a time: the machine's cores belong to the users)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[tuple, Example] = {}
        self._queued: dict[tuple, ExampleRequest] = {}
        self._pending: set[tuple] = set()  # keys a startup thread has yet to finish
        self._thread: threading.Thread | None = None
        self._control: RunControl | None = None  # the running thread's: close() cancels it
        _CACHES.add(self)

    def want(self, request: ExampleRequest) -> None:
        """Queue ``request`` for the next ``start`` (a request already done or queued is kept once)."""
        with self._lock:
            self._queued.setdefault((request.view, request.prompt, request.preset, request.chat), request)

    def start(self, shared: Shared, model: str, quantization: str = "none") -> threading.Thread | None:
        """Compute the queued requests on ``model`` in a daemon thread; None when there is nothing
        to do or examples are off (env DP_EXAMPLES=0)."""
        with self._lock:
            busy = set(self._done) | self._pending
            todo = [r for r in self._queued.values() if r.key(model, quantization) not in busy]
            self._queued.clear()
            if not todo or not enabled():
                return None
            self._pending |= {r.key(model, quantization) for r in todo}
            self._control = RunControl(deadline_s=EXAMPLE_SECONDS)
            thread = threading.Thread(target=self._run, args=(shared, todo, model, quantization, self._control),
                                      name="dp-examples", daemon=True)
            self._thread = thread
        thread.start()
        return thread

    def _run(self, shared: Shared, todo: list[ExampleRequest], model: str, quantization: str,
             control: RunControl) -> None:
        for request in todo:
            key = request.key(model, quantization)
            try:
                control.check()  # closed (the process exits): the rest are not started
                example = compute(shared, request, model, quantization, control)
            except RunStopped as exc:  # closed at exit (or its time limit): nothing to show
                log.info("example run for %s stopped: %s", request.view, exc)
                example = None
            except Exception as exc:  # an example is a nicety: log it, the view says "press Generate"
                log.warning("example run for %s failed: %s: %s", request.view, type(exc).__name__, exc)
                example = None
            with self._lock:
                self._pending.discard(key)
                if example is not None:
                    self._done[key] = example

    def get(self, request: ExampleRequest, model: Any, quantization: Any) -> tuple[State, Example | None]:
        """("ready", example), ("pending", None) while the startup thread may still produce it, or
        ("none", None): another model, examples off, or the run failed."""
        key = request.key(model if isinstance(model, str) else "", quantization if isinstance(quantization, str) else "")
        with self._lock:
            if key in self._done:
                return "ready", self._done[key]
            return ("pending" if key in self._pending else "none"), None

    def close(self, timeout: float = 30.0) -> None:
        """Stop the startup thread within one step of its run and wait for it (at exit: a daemon
        thread still inside torch when the interpreter finalizes aborts the process)."""
        control, thread = self._control, self._thread
        if control is not None:
            control.cancel()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the startup thread is done (tests, the CLI); True if it finished."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True


_CACHES_LOCK = threading.Lock()
_CACHES: "weakref.WeakSet[ExampleCache]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for cache in list(_CACHES):
        cache.close()


def cache_for(registry: Any) -> ExampleCache:
    """The example cache of this model registry, created on first use; it lives on the registry
    object, so it goes with the models it was computed on."""
    with _CACHES_LOCK:
        cache = getattr(registry, "_examples", None)
        if cache is None:
            cache = ExampleCache()
            registry._examples = cache
        return cache


def fresh_config(panel: Any) -> DecodingConfig:
    """The config a knob panel's controls show on a fresh page (what Generate runs untouched)."""
    return panel.config(*[component.value for component in panel.inputs])


PREPARING = "Preparing an example run of this prompt… or press Generate to run your own now."
POLL_S = 1.0  # how often a fresh page asks whether its example is ready


def matches(request: ExampleRequest | None, prompt: Any, chat: Any, panel: Any, values: Any) -> bool:
    """Whether a page still shows ``request``'s inputs: same prompt, chat checkbox and config
    (a page whose user edited them, or that a share link filled, gets no example)."""
    if request is None or prompt != request.prompt or bool(chat) != request.chat:
        return False
    try:
        return panel.config(*values) == request.config
    except ValueError:  # an invalid knob on the page: not the example's config
        return False


def wire_poll(shared: Any, view: Any, out: Any, extra: Any, on_example: Any) -> None:
    """Poll for the startup example while the page has no run of its own (no model call):
    ``on_example(timer, model, quantization, extra, session, prompt, chat, *knob values)`` returns
    the view's updates and stops the timer once the example is shown or cannot be."""
    import functools

    import gradio as gr

    timer = gr.Timer(POLL_S)
    inputs = [shared.model, shared.quantization, extra, out.session, view.prompt, view.chat, *view.panel.inputs]
    timer.tick(functools.partial(on_example, timer), inputs, [*out.all(), timer], api_visibility="private", queue=False)


def poll(registry: Any, request: ExampleRequest, timer: Any, status: Any, model: Any, quantization: Any,
         fresh: bool) -> tuple[dict, Example | None]:
    """One poll of a fresh page for its startup example: (updates, example). ``example`` is set once
    it is ready (the caller adds its view's updates to ``updates``, which stop the timer); otherwise
    ``updates`` is the whole answer: "preparing" while pending, or the timer stopped when the page is
    no longer ``fresh`` (it ran something, or its inputs differ) or no example will come."""
    import gradio as gr

    from .shared import status_html

    done = {timer: gr.Timer(active=False)}
    if not fresh:
        return done, None
    ready, example = cache_for(registry).get(request, model, quantization)
    if ready == "pending":
        return {status: status_html(PREPARING)}, None
    if example is None:
        return done | {status: ""}, None
    return done, example
