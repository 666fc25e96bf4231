"""Tests of `streamchat feed` against the fake daemon: appends, commits, --ask and session handling."""

import asyncio
import io
import os
import threading
import time

import pytest
from client_fake_daemon import FakeDaemon

from streamchat.client.chat import ChatConfig, ChatSession
from streamchat.client.connection import Endpoint, RetryPolicy
from streamchat.client.errors import ClientError
from streamchat.client.feed import FeedConfig, run_feed
from streamchat.client.render import PlainUI
from streamchat.client.repl import Repl
from streamchat.client.sessions import SavedSession, SessionStore

FAST = RetryPolicy(attempts=3, initial_s=0.01, max_s=0.02)
TEXT = "The meeting opened.\nAlice spoke first.\n\n\nBob answered.\n"


def feed_config(daemon, **kwargs):
    return FeedConfig(Endpoint(daemon.url), retry=FAST, reconnect=FAST, **kwargs)


async def feed(config, store, stdin=None):
    out, err = io.StringIO(), io.StringIO()
    rc = await run_feed(config, store, stdin=stdin or io.StringIO(""), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_file_lines_are_appended_and_committed_at_blank_lines(tmp_path):
    """With one line per append, each line (break kept) is sent; blank lines and the end commit, then stats."""
    source = tmp_path / "meeting.txt"
    source.write_text(TEXT)
    store = SessionStore(tmp_path / "sessions.json")

    async def main():
        async with FakeDaemon() as daemon:
            config = feed_config(daemon, source=str(source), max_append_chars=1)
            return await feed(config, store), daemon.received

    (rc, out, err), received = run(main())
    assert rc == 0 and out == "sess_1\n"
    assert [(e["type"], e.get("text")) for e in received] == [
        ("streamchat.input_text.append", "The meeting opened.\n"),
        ("streamchat.input_text.append", "Alice spoke first.\n"),
        ("streamchat.input_text.commit", None),
        ("streamchat.session.stats", None),
        ("streamchat.input_text.append", "Bob answered.\n"),
        ("streamchat.input_text.commit", None),
        ("streamchat.session.stats", None),
    ]
    assert err.splitlines() == [
        "fed 2 lines, 6 tokens, 1 items · context 6 tokens · evicted 100",
        "fed 3 lines, 8 tokens, 2 items · context 8 tokens · evicted 100",
    ]
    [saved] = store.load()
    assert (saved.id, saved.resume_token) == ("sess_1", "tok_1")


def test_lines_already_read_are_batched_into_large_appends(tmp_path):
    """Lines that have arrived go into one append up to max_append_chars; blank lines still commit."""
    lines = [f"line {i} of the minutes\n" for i in range(200)]
    text = "".join(lines[:120]) + "\n" + "".join(lines[120:])
    source = tmp_path / "minutes.txt"
    source.write_text(text)

    async def main():
        async with FakeDaemon() as daemon:
            config = feed_config(daemon, source=str(source), max_append_chars=500)
            result = await feed(config, SessionStore(tmp_path / "s"))
            return result, daemon.received

    (rc, _, err), received = run(main())
    assert rc == 0
    appends = [e["text"] for e in received if e["type"] == "streamchat.input_text.append"]
    assert "".join(appends) == text.replace("\n\n", "\n")
    assert all(len(a) <= 500 and a.endswith("\n") for a in appends)
    assert len(appends) < 40  # about 4,700 characters in pieces of up to 500, not 200 lines
    commits = [i for i, e in enumerate(received) if e["type"] == "streamchat.input_text.commit"]
    assert len(commits) == 2
    assert "".join(e.get("text", "") for e in received[:commits[0]]) == "".join(lines[:120])
    assert err.splitlines()[-1].startswith("fed 200 lines, 1,000 tokens, 2 items")


def test_too_large_append_is_split_in_halves(tmp_path):
    """An append the daemon answers message_too_large is sent again in halves, cut at line breaks if it can."""
    async def main(text):
        async with FakeDaemon(max_text_chars=12) as daemon:
            config = feed_config(daemon, quiet=True, max_append_chars=1000)
            result = await feed(config, SessionStore(tmp_path / "s"), stdin=io.StringIO(text))
            return result, [e["text"] for e in daemon.received
                            if e["type"] == "streamchat.input_text.append" and len(e["text"]) <= 12]

    (rc, _, _), accepted = run(main("aaaa bbbb cccc dddd eeee\n"))
    assert rc == 0 and accepted == ["aaaa bbbb cc", "cc ddd", "d eeee\n"]
    (rc, _, err), accepted = run(main("ab\n" * 20))
    assert rc == 0 and "".join(accepted) == "ab\n" * 20
    assert all(a.endswith("\n") for a in accepted)


def test_system_is_set_before_the_text(tmp_path):
    """--system sends session.update before the first append."""
    async def main():
        async with FakeDaemon() as daemon:
            await feed(feed_config(daemon, system="Summarise."), SessionStore(tmp_path / "s"),
                       stdin=io.StringIO("x\n"))
            return daemon.received

    received = run(main())
    assert received[0]["session"] == {"type": "realtime", "instructions": "Summarise."}
    assert [e["type"] for e in received[1:3]] == ["streamchat.input_text.append",
                                                   "streamchat.input_text.commit"]


def test_ask_prints_the_answer_after_the_feed(tmp_path):
    """--ask commits, adds the question as a user item, asks for a reply and prints it on stdout."""
    async def main():
        async with FakeDaemon(reply=["Bob ", "answered."]) as daemon:
            config = feed_config(daemon, ask="Who answered?", quiet=True)
            result = await feed(config, SessionStore(tmp_path / "s"), stdin=io.StringIO("Bob answered.\n"))
            return result, daemon.types(), daemon.received[-2]

    (rc, out, err), types, ask = run(main())
    assert rc == 0 and out == "sess_1\nBob answered.\n"
    assert err == "2 tokens · first token 12 ms · 40.0 tokens/s · 32 cached\n"
    assert types[-2:] == ["conversation.item.create", "response.create"]
    assert ask["item"]["content"] == [{"type": "input_text", "text": "Who answered?"}]


def test_stdin_is_committed_after_the_idle_time(tmp_path):
    """Lines read from a pipe as they arrive are committed once no line came for commit_idle seconds."""
    read_fd, write_fd = os.pipe()

    def writer():
        with os.fdopen(write_fd, "w") as pipe:
            pipe.write("first words\n")
            pipe.flush()
            time.sleep(0.4)
            pipe.write("later words\n")

    async def main():
        async with FakeDaemon() as daemon:
            thread = threading.Thread(target=writer)
            thread.start()
            with os.fdopen(read_fd) as stdin:
                await feed(feed_config(daemon, commit_idle_s=0.1, quiet=True),
                           SessionStore(tmp_path / "s"), stdin=stdin)
            thread.join()
            return daemon.types()

    assert run(main()) == ["streamchat.input_text.append", "streamchat.input_text.commit",
                           "streamchat.session.stats", "streamchat.input_text.append",
                           "streamchat.input_text.commit", "streamchat.session.stats"]


def test_session_resumes_with_the_token_from_the_session_file(tmp_path):
    """--session ID takes the resume token from the session file."""
    store = SessionStore(tmp_path / "s")
    store.save(SavedSession("sess_known", "tok_known"))

    async def main():
        async with FakeDaemon() as daemon:
            daemon.add_session("sess_known", "tok_known")
            result = await feed(feed_config(daemon, session="sess_kn", quiet=True), store,
                                stdin=io.StringIO("more\n"))
            return result, daemon.received[0]

    (rc, out, _), resume = run(main())
    assert rc == 0 and out == ""
    assert (resume["session_id"], resume["resume_token"]) == ("sess_known", "tok_known")


def test_session_without_a_known_token_needs_resume_token(tmp_path):
    """--session of an id not in the file fails with a hint; --resume-token works and is saved."""
    store = SessionStore(tmp_path / "s")

    async def main():
        async with FakeDaemon() as daemon:
            daemon.add_session("sess_x", "tok_x")
            with pytest.raises(ClientError) as info:
                await feed(feed_config(daemon, session="sess_x"), store)
            await feed(feed_config(daemon, session="sess_x", resume_token="tok_x", quiet=True), store)
            return str(info.value)

    message = run(main())
    assert message.startswith("no resume token for session sess_x: it is not in ")
    assert message.endswith("; pass --resume-token TOKEN")
    assert store.find("sess_x").resume_token == "tok_x"


def test_chat_can_resume_a_session_created_by_feed(tmp_path):
    """A session made by `feed --new` is in the shared session file, so chat's /resume attaches to it."""
    store = SessionStore(tmp_path / "sessions.json")

    class Script:
        def __init__(self, *inputs):
            self.inputs = list(inputs)

        async def read(self):
            return self.inputs.pop(0) if self.inputs else None

    async def main():
        async with FakeDaemon() as daemon:
            _, out, _ = await feed(feed_config(daemon, quiet=True), store, stdin=io.StringIO("notes\n"))
            session_id = out.strip()
            err = io.StringIO()
            chat = ChatSession(ChatConfig(Endpoint(daemon.url), retry=FAST), store)
            await Repl(chat, PlainUI(io.StringIO(), err), Script(f"/resume {session_id}")).run()
            return session_id, err.getvalue(), daemon.received[-1]

    session_id, err, resume = run(main())
    assert session_id == "sess_1"
    assert f"resumed session {session_id} (restored from memory)" in err
    assert (resume["type"], resume["resume_token"]) == ("streamchat.session.resume", "tok_1")


def test_lost_connection_is_resumed_and_the_line_sent_again(tmp_path):
    """If the socket drops before an append is acknowledged, feed resumes the session and resends it."""
    async def main():
        async with FakeDaemon(drop_at_append=2) as daemon:
            result = await feed(feed_config(daemon, quiet=True, max_append_chars=1),
                                SessionStore(tmp_path / "s"), stdin=io.StringIO("one\ntwo\nthree\n"))
            return result, daemon.received

    (rc, _, _), received = run(main())
    assert rc == 0
    assert [(e["type"], e.get("text") or e.get("session_id")) for e in received] == [
        ("streamchat.input_text.append", "one\n"),
        ("streamchat.input_text.append", "two\n"),
        ("streamchat.session.resume", "sess_1"),
        ("streamchat.input_text.append", "two\n"),
        ("streamchat.input_text.append", "three\n"),
        ("streamchat.input_text.commit", None),
        ("streamchat.session.stats", None),
    ]


def test_missing_source_file_is_reported_before_connecting(tmp_path):
    """A FILE that cannot be opened fails with its name and no connection is made."""
    async def main():
        async with FakeDaemon() as daemon:
            with pytest.raises(ClientError, match="cannot read .*nope.txt: No such file"):
                await feed(feed_config(daemon, source=str(tmp_path / "nope.txt")), SessionStore(tmp_path / "s"))
            return daemon.connections

    assert run(main()) == 0
