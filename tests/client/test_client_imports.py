"""Tests that the client imports no torch, nothing of the daemon, and starts fast."""

import subprocess
import sys
import time

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


def best_of_three(argv):
    times = []
    for _ in range(3):
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        times.append(time.perf_counter() - started)
        assert done.returncode == 0, done.stderr
    return min(times)


def test_help_starts_in_under_a_second():
    """`python -m streamchat.client --help` finishes in under a second."""
    assert best_of_three([sys.executable, "-m", "streamchat.client", "--help"]) < 1.0


def test_chat_modules_import_in_under_a_second():
    """Importing everything the chat needs (websockets, prompt_toolkit, rich included) takes under a second."""
    code = ("import streamchat.client.repl, streamchat.client.prompt, streamchat.client.feed, "
            "prompt_toolkit.shortcuts, rich.live, rich.markdown, rich.syntax")
    assert best_of_three([sys.executable, "-c", code]) < 1.0
