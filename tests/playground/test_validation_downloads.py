"""Download files (traces hold users' prompts) live in a private directory of this process (mode
0700, files 0600, Gradio's own copies in it too), never in the shared world-readable /tmp/gradio,
and the directory is gone when the server closes and when the process exits."""

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from playground import downloads

ROOT = Path(__file__).resolve().parents[2]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_are_private():
    path = Path(downloads.json_file("trace.json", {"prompt": "my secret prompt"}))
    root = downloads.private_root()
    assert root in path.parents and path.parent.parent == downloads.download_dir()
    assert _mode(root) == 0o700 and _mode(path.parent) == 0o700 and _mode(path) == 0o600
    assert not str(path).startswith(str(Path(tempfile.gettempdir()) / "gradio"))


def test_gradio_cache_points_into_the_private_directory():
    import gradio as gr

    cache = downloads.use_private_cache()
    assert cache.parent == downloads.private_root() and _mode(cache) == 0o700
    assert gr.File().GRADIO_CACHE == str(cache)  # every component built after this caches there


SCRIPT = """
import json, sys
from playground import downloads
path = downloads.trace_file(type("T", (), {"to_dict": lambda self: {"prompt": "secret"}})())
cache = downloads.use_private_cache()
print(json.dumps([str(downloads.private_root()), path, str(cache)]))
if sys.argv[1] == "close":
    import os
    class Demo:
        def close(self):
            pass
    demo, other = Demo(), Demo()
    downloads.remove_on_close(demo)
    downloads.remove_on_close(other)  # a second app of the process, still serving
    demo.close()
    assert os.path.exists(path) and os.path.isdir(cache), "gone while another app of the process serves"
    other.close()
    other.close()  # a second close is harmless
    assert not os.path.exists(path), "still there after close"
    again = downloads.write_text("x.json", "{}")  # a later app of the same process gets a new private folder
    assert os.path.exists(again) and oct(os.stat(downloads.private_root()).st_mode & 0o777) == "0o700"
"""


def _run(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_removed_at_exit():
    root, path, cache = _run("exit")
    assert not Path(root).exists() and not Path(path).exists() and not Path(cache).exists()


def test_removed_when_the_server_closes():
    root, path, _ = _run("close")
    assert not Path(root).exists()
