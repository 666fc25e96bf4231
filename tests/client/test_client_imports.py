"""Tests that the client imports no torch, nothing of the daemon, and only light packages."""

import subprocess
import sys

BLOCKER = r'''
import importlib, pkgutil, sys

class BlockHeavy:
    """Refuses torch, transformers and triton, as on a machine without them."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "transformers", "triton"}:
            raise ImportError(f"blocked import of {name}")
        return None

sys.meta_path.insert(0, BlockHeavy())
try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not block torch")

import streamchat.client
for info in pkgutil.iter_modules(streamchat.client.__path__):
    importlib.import_module("streamchat.client." + info.name)
from streamchat.client.cli import main
for argv in (["--help"], ["chat", "--help"], ["feed", "--help"]):
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
outside = sorted(m for m in sys.modules
                 if m.split(".")[0] in {"torch", "transformers", "triton"}
                 or (m.startswith("streamchat.") and not m.startswith("streamchat.client")))
print("OUTSIDE", outside)
'''


def test_client_imports_no_torch_nor_daemon_modules():
    """With torch, transformers and triton unimportable, every client module imports and --help works."""
    done = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "OUTSIDE []"
    assert "usage: streamchat feed" in done.stdout


LIGHT = {"streamchat", "websockets", "prompt_toolkit", "rich", "pygments", "wcwidth", "markdown_it", "mdurl",
         "orjson", "typing_extensions"}


def top_level_imports(code: str) -> set[str]:
    """Top-level packages outside the standard library that `code` leaves in sys.modules."""
    probe = code + "\nimport sys\nprint(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    names = set(eval(done.stdout.splitlines()[-1]))  # a printed list of names
    return {n for n in names if not n.startswith("_")}  # __main__, the editable-install finder


def test_help_imports_only_light_packages():
    """`streamchat.client --help` loads nothing beyond the client's few light dependencies (it starts fast)."""
    code = "import sys, runpy\nsys.argv = ['x', '--help']\ntry:\n    runpy.run_module('streamchat.client', run_name='__main__')\nexcept SystemExit:\n    pass"
    assert top_level_imports(code) <= LIGHT


def test_chat_modules_import_only_light_packages():
    """Everything the chat needs (websockets, prompt_toolkit, rich) pulls in nothing heavy (numpy, torch, ...)."""
    code = ("import streamchat.client.repl, streamchat.client.prompt, streamchat.client.feed, "
            "prompt_toolkit.shortcuts, rich.live, rich.markdown, rich.syntax")
    assert top_level_imports(code) <= LIGHT
