"""The client end to end against a real daemon: a pty, pipes, a long feed, errors a person can act on."""

import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from importlib import resources

import pexpect
import pytest
from pexpect.popen_spawn import PopenSpawn
from real_daemon import RealDaemon, session_stats

pytestmark = pytest.mark.slow

KEY = "secret"
CLIENT = [sys.executable, "-m", "streamchat.client"]
STATUS = r"(\d+) tokens · first token \d+ ms · [\d.]+ tokens/s · [\d,]+ cached"
STATS = (r"context ([\d,]+) tokens · total ([\d,]+) · evicted ([\d,]+)\r?\n"
         r"blocks \d+ owned, \d+ shared · KV [\d.]+ \w+ · \d+ items\r?\n")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """One daemon with an API key for the chat and error tests."""
    d = RealDaemon(tmp_path_factory.mktemp("db") / "chat.db", "--api-key", KEY,
                   "--window-tokens", "512", "--num-blocks", "400").start()
    yield d
    assert d.stop() == 0  # SIGTERM: a clean shutdown


@pytest.fixture
def env(tmp_path):
    """A private session file (XDG_STATE_HOME) and the daemon's key in the environment."""
    # COLUMNS and LINES (pytest-xdist's workers set 80 x 24) would override the pty's own size
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STREAMCHAT_") and k not in ("COLUMNS", "LINES")}
    return dict(environ, XDG_STATE_HOME=str(tmp_path / "state"), PYTHONIOENCODING="utf-8",
                STREAMCHAT_API_KEY=KEY)


def saved_sessions(env):
    path = os.path.join(env["XDG_STATE_HOME"], "streamchat", "sessions.json")
    with open(path, encoding="utf-8") as file:
        return json.load(file)["sessions"]


def run_client(*argv, env, stdin="", timeout=60):
    return subprocess.run([*CLIENT, *argv], input=stdin, capture_output=True, text=True, env=env,
                          timeout=timeout)


def prompt(child):
    """Waits for a fresh, empty prompt (not a redraw of the line being typed)."""
    child.expect(r"\x1b\[\?2004h")  # bracketed paste is switched on as each prompt starts
    child.expect(">>> ")


def test_chat_in_a_pty_streams_cancels_and_resumes(daemon, env, tmp_path):
    """In a terminal: a reply streams, /show stats, Ctrl-C cancels a long reply, /resume from the session file, /bye."""
    env = {**env, "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1"}
    child = pexpect.spawn(CLIENT[0], [*CLIENT[1:], "chat", daemon.url], env=env, timeout=60,
                          encoding="utf-8", dimensions=(40, 160))
    child.logfile_read = open(tmp_path / "pty.log", "w", encoding="utf-8")  # for a failure's post-mortem
    try:
        child.expect(r"new session (sess_\w+)")
        first = child.match.group(1)
        prompt(child)
        child.send("/set max_tokens 24\r")
        child.expect("max_tokens = 24")
        prompt(child)
        child.send("Say hello to me.\r")
        child.expect(r"\x1b\[\?2004l")  # the prompt is done; the reply follows
        child.expect(STATUS)
        replied = int(child.match.group(1))  # 24, or fewer where this CPU's greedy path meets EOS
        assert replied > 0
        assert child.before.count("\x1b[2K") >= 2, child.before  # drawn piece by piece as it streamed
        prompt(child)
        child.send("/show stats\r")
        child.expect(STATS)
        context = int(child.match.group(1).replace(",", ""))
        # The user's four words and their frame, then the reply: nothing evicted.
        assert context >= replied + 4 and child.match.group(3) == "0", (context, replied)
        prompt(child)

        child.send("/set max_tokens 200\r")
        child.expect("max_tokens = 200")
        prompt(child)
        child.send("Write a long story about a cat who learns to sail.\r")
        child.expect(r"\x1b\[\?2004l")
        child.expect(r"[A-Za-z]{3}")  # the first words of the reply are on screen
        child.sendintr()
        child.expect(r"cancelled \(client_cancelled\) · (\d+) tokens")
        assert 0 < int(child.match.group(1)) < 200
        prompt(child)

        child.send("/clear\r")
        child.expect(r"new session (sess_\w+)")
        assert child.match.group(1) != first
        prompt(child)
        assert first in [s["id"] for s in saved_sessions(env)]
        child.send(f"/resume {first[:12]}\r")
        child.expect(rf"resumed session {first} \(restored from memory\)")
        prompt(child)
        child.send("/show stats\r")
        child.expect(STATS)
        assert int(child.match.group(1).replace(",", "")) > context  # the cancelled reply is kept
        prompt(child)
        child.send("/bye\r")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
        child.logfile_read.close()
    assert child.exitstatus == 0


def test_chat_through_pipes_prints_plain_text(daemon, env, tmp_path):
    """With stdin and stdout piped: plain replies and status lines, /show stats, SIGINT cancels, /resume, /bye."""
    err_path = tmp_path / "stderr.txt"
    command = shlex.join([*CLIENT, "chat", daemon.url, "--plain"]) + " 2>" + shlex.quote(str(err_path))
    child = PopenSpawn(["sh", "-c", "exec " + command], env=env, timeout=60, encoding="utf-8")
    out = []
    try:
        child.sendline("/set max_tokens 24")
        child.sendline("Say hello to me.")
        child.expect(STATUS + r"\n")
        out.append(child.before + child.after)
        assert child.before.strip()  # the reply text
        child.sendline("/show stats")
        child.expect(STATS)
        out.append(child.before + child.after)
        assert child.match.group(3) == "0"

        child.sendline("/set max_tokens 200")
        child.sendline("Write a long story about a cat who learns to sail.")
        child.expect(r"[A-Za-z]{3}")
        child.kill(signal.SIGINT)
        child.expect(r"cancelled \(client_cancelled\) · (\d+) tokens.*\n")
        out.append(child.before + child.after)
        assert 0 < int(child.match.group(1)) < 200

        [first] = saved_sessions(env)
        child.sendline("/clear")
        child.sendline(f"/resume {first['id']}")
        child.sendline("/show session")
        child.expect(rf"session   {first['id']} \(restored from memory\)")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
        out.append(child.before)
    finally:
        if child.proc.poll() is None:
            child.kill(signal.SIGKILL)
    assert child.wait() == 0
    assert "\x1b" not in "".join(out)
    err = err_path.read_text()
    assert err.startswith("new session sess_")
    assert "max_tokens = 24" in err and f"resumed session {first['id']} (restored from memory)" in err

    # A one-shot pipe: stdout is only the reply and its status line.
    done = run_client("chat", daemon.url, "--max-tokens", "16", env=env, stdin="Name a colour.\n")
    assert done.returncode == 0, done.stderr
    *reply, status = done.stdout.splitlines()
    assert "".join(reply).strip()
    assert re.fullmatch(r"(incomplete \(max_output_tokens\) · )?" + STATUS, status)


def test_wrong_or_missing_api_key_exits_1_with_advice(daemon, env):
    """A wrong key, or none, is refused at the handshake: exit 1 and a message saying how to pass the key."""
    wrong = run_client("chat", daemon.url, "--api-key", "nope", env=env, stdin="hi\n")
    assert wrong.returncode == 1 and wrong.stdout == ""
    assert wrong.stderr == (f"streamchat: the daemon at {daemon.url} rejected the API key (HTTP 401): "
                            "pass --api-key KEY or set STREAMCHAT_API_KEY to the daemon's key.\n")
    no_key = {k: v for k, v in env.items() if k != "STREAMCHAT_API_KEY"}
    missing = run_client("feed", daemon.url, "--new", env=no_key, stdin="text\n")
    assert missing.returncode == 1 and missing.stdout == ""
    assert "requires an API key (HTTP 401): pass --api-key KEY" in missing.stderr


def test_daemon_not_running_says_how_to_start_it(env):
    """Nothing listening at the URL: chat and feed exit 1 naming `make serve` and `streamchat serve`."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"ws://127.0.0.1:{sock.getsockname()[1]}/v1/realtime"
    for argv in (["chat", url], ["feed", url, "--new"]):
        done = run_client(*argv, env=env, stdin="hi\n", timeout=30)
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr == (f"streamchat: cannot connect to {url}: connection refused. Is the "
                               "streamchat daemon running? Start it with `make serve` (in the "
                               "source tree) or `streamchat serve`.\n")


FEED_CHARS = 9_000  # about 2,200 tokens of the bundled novel: eight times the window
SYSTEM = "You answer questions about the text you were given."


def test_a_feed_of_eight_windows_keeps_the_session_bounded(tmp_path, env):
    """`feed` pushes 2k+ tokens through a 256-token window, --ask answers, blocks stay bounded; then the daemon
    stops. (bench/longchat.py and docs/eval.md take far longer texts through the window.)"""
    window, sink, block = 256, 4, 16
    daemon = RealDaemon(tmp_path / "feed.db", "--window-tokens", str(window), "--sink-tokens",
                        str(sink), "--num-blocks", "200").start()
    try:
        env = {k: v for k, v in env.items() if k != "STREAMCHAT_API_KEY"}
        text = resources.files("streamchat").joinpath("data/botchan.txt").read_text(encoding="utf-8")
        source = tmp_path / "botchan.txt"
        source.write_text(text[:FEED_CHARS], encoding="utf-8")

        created = run_client("feed", daemon.url, "--new", "--system", SYSTEM, env=env, stdin="")
        assert created.returncode == 0, created.stderr
        session_id = created.stdout.strip()
        [saved] = saved_sessions(env)
        assert saved["id"] == session_id
        _, before = session_stats(daemon.url, session_id, saved["resume_token"])
        system_tokens = before["context_tokens"]
        assert system_tokens > 0

        started = time.monotonic()
        fed = run_client("feed", daemon.url, str(source), "--session", session_id[:12],
                         "--ask", "Who is the narrator?", "--max-tokens", "32", env=env, timeout=600)
        elapsed = time.monotonic() - started
        assert fed.returncode == 0, fed.stderr
        assert fed.stdout.strip()  # the answer
        progress = re.search(r"fed ([\d,]+) lines, ([\d,]+) tokens, 1 items · context ([\d,]+) "
                             r"tokens · evicted ([\d,]+)", fed.stderr)
        assert progress, fed.stderr
        tokens = int(progress.group(2).replace(",", ""))
        assert tokens >= 2_000

        resumed, stats = session_stats(daemon.url, session_id, saved["resume_token"])
        assert resumed["restored_from"] == "memory"
        bound = math.ceil((sink + window) / block) + 1 + math.ceil(system_tokens / block)
        blocks = stats["blocks"]["owned"] + stats["blocks"]["shared"]
        assert blocks <= bound, stats
        assert stats["evicted_tokens"] > 0
        assert stats["context_tokens"] <= (bound - 1) * block  # sink (whole blocks) + window
        health = daemon.healthz()
        used = health["kv_blocks"]["total"] - health["kv_blocks"]["free"]
        assert health["sessions"] == 1 and used <= bound, health
        print(f"\nfed {tokens:,} tokens in {elapsed:.1f} s ({tokens / elapsed:,.0f} tokens/s, the "
              f"answer included); {blocks} blocks held (bound {bound}), {used} in use in the pool, "
              f"evicted {stats['evicted_tokens']:,}; answer: {fed.stdout.strip()[:80]!r}")
    finally:
        stopped = daemon.stop()
    assert stopped == 0  # SIGTERM: a clean shutdown
    gone = run_client("chat", daemon.url, "--resume", session_id, env=env, stdin="")
    assert gone.returncode == 1 and "connection refused" in gone.stderr
    assert "Start it with `make serve` (in the source tree) or `streamchat serve`." in gone.stderr
