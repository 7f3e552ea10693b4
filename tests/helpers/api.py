"""A gradio_client session against the app, as a script or a room's user opens one."""

from __future__ import annotations

from typing import Any

# gradio_client's own default read timeout is 5 s for its first calls (the app's config, its API
# info): on a 2-core CI machine with a browser test and the room's runs beside it, the app can take
# longer than that to answer them, which a test would read as the app failing (issue #50's CI run).
API_TIMEOUT_S = 120.0


def api_client(url: str, timeout_s: float = API_TIMEOUT_S) -> Any:
    """A ``gradio_client.Client`` for the app at ``url`` whose every request waits up to ``timeout_s``."""
    from gradio_client import Client

    return Client(url, verbose=False, httpx_kwargs={"timeout": timeout_s})
