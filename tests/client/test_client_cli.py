"""Tests of the `chat` and `feed` commands as processes: pipes, a pty, flags and exit codes."""

import os
import socket
import stat
import subprocess
import sys

import pexpect
import pytest
from client_fake_daemon import ThreadedDaemon

STATUS = "4 tokens · first token 12 ms · 40.0 tokens/s · 32 cached"


@pytest.fixture
def env(tmp_path):
    environ = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "state"), PYTHONIOENCODING="utf-8")
    environ.pop("STREAMCHAT_API_KEY", None)
    return environ


def client(*argv, env, stdin=""):
    return subprocess.run([sys.executable, "-m", "streamchat.client", *argv], input=stdin,
                          capture_output=True, text=True, env=env, timeout=30)


def test_chat_from_a_pipe_prints_plain_replies(env):
    """Piped input: each line is a message; stdout holds the replies and status lines only."""
    with ThreadedDaemon() as daemon:
        done = client("chat", daemon.url, env=env, stdin="hi\n/show system\nagain\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"Hello, world\n{STATUS}\n(no system instructions)\nHello, world\n{STATUS}\n"
    assert done.stderr.startswith("new session sess_1")


def test_feed_with_ask_as_a_process(env, tmp_path):
    """`feed --new FILE --ask Q` prints the new session id, then the answer; progress goes to stderr."""
    source = tmp_path / "t.txt"
    source.write_text("alpha beta\n")
    with ThreadedDaemon(reply=["It ", "was alpha."]) as daemon:
        done = client("feed", daemon.url, str(source), "--new", "--ask", "What?", env=env)
        types = daemon.types()
    assert done.returncode == 0, done.stderr
    assert done.stdout == "sess_1\nIt was alpha.\n"
    assert "fed 1 lines, 2 tokens, 1 items" in done.stderr
    assert types == ["streamchat.input_text.append", "streamchat.input_text.commit",
                     "streamchat.session.stats", "conversation.item.create", "response.create"]
    session_file = tmp_path / "state" / "streamchat" / "sessions.json"
    assert stat.S_IMODE(session_file.stat().st_mode) == 0o600


def test_api_key_from_flag_and_environment(env):
    """--api-key, or STREAMCHAT_API_KEY, is sent as a bearer token; a wrong one exits 1 with advice."""
    with ThreadedDaemon(api_key="k") as daemon:
        wrong = client("chat", daemon.url, "--api-key", "bad", env=env, stdin="/bye\n")
        flag = client("chat", daemon.url, "--api-key", "k", env=env, stdin="/bye\n")
        from_env = client("chat", daemon.url, env={**env, "STREAMCHAT_API_KEY": "k"}, stdin="/bye\n")
        headers = daemon.auth_headers
    assert wrong.returncode == 1
    assert wrong.stderr.startswith("streamchat: the daemon at ws://127.0.0.1:")
    assert "rejected the API key (HTTP 401): pass --api-key KEY or set STREAMCHAT_API_KEY" in wrong.stderr
    assert (flag.returncode, from_env.returncode) == (0, 0)
    assert headers == ["Bearer bad", "Bearer k", "Bearer k"]


def test_daemon_not_running_exits_1_with_how_to_start_it(env):
    """Connection refused: exit 1 and a message naming make serve and streamchat serve."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = client("chat", f"ws://127.0.0.1:{port}/v1/realtime", env=env, stdin="hi\n")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (f"streamchat: cannot connect to ws://127.0.0.1:{port}/v1/realtime: "
                           "connection refused. Is the streamchat daemon running? Start it with "
                           "`make serve` (in the source tree) or `streamchat serve`.\n")


@pytest.mark.parametrize("argv, error", [
    (["feed"], "one of the arguments --session --new is required"),
    (["feed", "--new", "--commit-idle", "0"], "argument --commit-idle: must be more than 0"),
    (["feed", "--new", "a", "b"], "expected [URL] [FILE|-], got a b"),
    (["chat", "--max-tokens", "x"], "argument --max-tokens: expected a whole number, not 'x'"),
    (["chat", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_flags_give_argparse_errors(env, argv, error):
    """Bad flags exit 2 with argparse's usage and a precise error."""
    done = client(*argv, env=env)
    assert done.returncode == 2
    assert done.stderr.startswith("usage: streamchat ")
    assert done.stderr.rstrip().endswith(error)


def test_chat_in_a_pty(env, tmp_path):
    """In a terminal: a reply streams as Markdown, Ctrl-C cancels it, Ctrl-C at the prompt hints, /bye leaves."""
    env = {**env, "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1"}
    # after each delta the fake waits up to 30 s for a cancel, so Ctrl-C lands mid-reply whatever the load
    with ThreadedDaemon(reply=["**one** ", "two ", "three ", "four"], delta_delay_s=30) as daemon:
        child = pexpect.spawn(sys.executable, ["-m", "streamchat.client", "chat", daemon.url],
                              env=env, timeout=10, encoding="utf-8", dimensions=(24, 80))
        try:
            child.expect(">>> ")
            child.send("hello\r")
            child.expect("one")
            child.sendintr()
            child.expect(r"cancelled \(client_cancelled\) · \d+ tokens")
            child.expect(">>> ")
            child.send("\x03")
            child.expect("Use Ctrl-D or /bye to exit.")
            child.expect(">>> ")
            child.send("/bye\r")
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
        types = daemon.types()
    assert child.exitstatus == 0
    assert types == ["conversation.item.create", "response.create", "response.cancel"]
    history = tmp_path / "state" / "streamchat" / "history"
    assert stat.S_IMODE(history.stat().st_mode) == 0o600
    assert "+hello" in history.read_text() and "+/bye" in history.read_text()
