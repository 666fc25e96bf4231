"""Tests of the chat REPL driven by scripted input against the fake daemon."""

import asyncio
import io
import os
import signal
import time

from client_fake_daemon import FakeDaemon

from streamchat.client.chat import ChatConfig, ChatSession
from streamchat.client.connection import Endpoint, RetryPolicy
from streamchat.client.render import PlainUI
from streamchat.client.repl import EXIT_HINT, Repl
from streamchat.client.sessions import SavedSession, SessionStore

FAST = RetryPolicy(attempts=3, initial_s=0.01, max_s=0.02)
STATUS = "4 tokens · first token 12 ms · 40.0 tokens/s · 32 cached"


class Script:
    """A reader that returns scripted inputs; a coroutine function runs first, an exception is raised."""

    def __init__(self, *inputs):
        self.inputs = list(inputs)

    async def read(self):
        if not self.inputs:
            return None
        item = self.inputs.pop(0)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item
        if callable(item):
            return await item()
        return item


async def chat(daemon, store, *inputs, **config):
    out, err = io.StringIO(), io.StringIO()
    session = ChatSession(ChatConfig(Endpoint(daemon.url), retry=FAST, reconnect=FAST, **config), store)
    rc = await Repl(session, PlainUI(out, err), Script(*inputs)).run()
    return rc, out.getvalue(), err.getvalue()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_message_gets_a_streamed_reply_and_the_session_is_remembered(tmp_path):
    """A message is sent as a user item, the reply printed with its status, and the session saved."""
    store = SessionStore(tmp_path / "sessions.json")

    async def main():
        async with FakeDaemon() as daemon:
            return await chat(daemon, store, "Hi there"), daemon.received

    (rc, out, err), received = run(main())
    assert rc == 0 and out == "Hello, world\n" + STATUS + "\n"
    assert err.startswith("new session sess_1 · model fake-model")
    assert [e["type"] for e in received] == ["conversation.item.create", "response.create"]
    assert received[0]["item"] == {"type": "message", "role": "user",
                                   "content": [{"type": "input_text", "text": "Hi there"}]}
    [saved] = store.load()
    assert (saved.id, saved.resume_token, saved.title) == ("sess_1", "tok_1", "Hi there")


def test_no_input_leaves_no_session_in_the_file(tmp_path):
    """A chat that sends nothing does not record its (unstored) session."""
    store = SessionStore(tmp_path / "sessions.json")

    async def main():
        async with FakeDaemon() as daemon:
            return await chat(daemon, store, "/bye", "never read")

    assert run(main())[0] == 0
    assert store.load() == []


def test_settings_and_system_instructions_reach_the_daemon(tmp_path):
    """/set system sends session.update; /set max_tokens, temperature and the penalties go with response.create."""
    store = SessionStore(tmp_path / "sessions.json")

    async def main():
        async with FakeDaemon() as daemon:
            result = await chat(daemon, store, "/set system Be terse.", "/set max_tokens 64",
                                "/set temperature 0.2", "/set repetition_penalty 1.2", "/set min_p 0.05",
                                "/set frequency_penalty -0.5", "/set presence_penalty 0.5",
                                "/show system", "/show settings", "Q")
            return result, daemon.received

    (rc, out, err), received = run(main())
    update, item, create = received
    assert update["type"] == "session.update"
    assert update["session"] == {"type": "realtime", "instructions": "Be terse."}
    assert create["response"] == {"max_output_tokens": 64, "temperature": 0.2, "repetition_penalty": 1.2,
                                  "min_p": 0.05, "frequency_penalty": -0.5, "presence_penalty": 0.5}
    assert out.startswith("Be terse.\nmax_output_tokens = 64\ntemperature = 0.2\nrepetition_penalty = 1.2\n"
                          "min_p = 0.05\nfrequency_penalty = -0.5\npresence_penalty = 0.5\nHello, world\n")
    assert store.find("sess_1").instructions == "Be terse."


def test_show_stats_and_session(tmp_path):
    """/show stats prints the cache figures; /show session the id, model and window."""
    async def main():
        async with FakeDaemon() as daemon:
            return await chat(daemon, SessionStore(tmp_path / "s.json"), "/show stats", "/show session")

    _, out, _ = run(main())
    lines = out.splitlines()
    assert lines[:2] == ["context 0 tokens · total 100 · evicted 100",
                         "blocks 7 owned, 2 shared · KV 3.0 MiB · 0 items"]
    assert lines[2] == "session   sess_1 (new)"
    assert "window    4 sink + 2048 window tokens, blocks of 16" in lines


def test_clear_opens_a_new_session_with_the_same_instructions(tmp_path):
    """/clear reconnects to a new session and sets the same system instructions there."""
    async def main():
        async with FakeDaemon() as daemon:
            result = await chat(daemon, SessionStore(tmp_path / "s.json"), "/clear", "/show session",
                                system="Pirate voice.")
            return result, daemon.received, daemon.connections

    (_, out, err), received, connections = run(main())
    assert connections == 2
    assert [e["session"]["instructions"] for e in received] == ["Pirate voice.", "Pirate voice."]
    assert "new session sess_2" in err and "session   sess_2 (new)" in out


def test_sessions_lists_and_resume_uses_the_saved_token(tmp_path):
    """/sessions lists the file's sessions; /resume with an id prefix resumes with the stored token."""
    store = SessionStore(tmp_path / "s.json")
    store.save(SavedSession("sess_old", "tok_old", title="earlier talk", last_used=1.0))

    async def main():
        async with FakeDaemon() as daemon:
            daemon.add_session("sess_old", "tok_old", instructions="old rules")
            result = await chat(daemon, store, "/sessions", "/resume sess_o", "/show system")
            return result, daemon.received

    (_, out, err), received = run(main())
    assert out.splitlines()[0].startswith("  sess_old  1970-01-01")
    assert out.splitlines()[0].endswith("earlier talk")
    assert received == [{"type": "streamchat.session.resume", "event_id": "client_0",
                         "session_id": "sess_old", "resume_token": "tok_old"}]
    assert "resumed session sess_old (restored from memory)" in err
    assert out.splitlines()[-1] == "old rules"


def test_resume_of_unknown_session_reports_and_continues(tmp_path):
    """/resume of an id the file lacks, or the daemon rejects, prints an error and keeps the chat."""
    store = SessionStore(tmp_path / "s.json")
    store.save(SavedSession("sess_gone", "tok"))

    async def main():
        async with FakeDaemon() as daemon:
            return await chat(daemon, store, "/resume nope", "/resume sess_gone", "hi")

    rc, out, err = run(main())
    assert "no session nope in" in err and "/sessions lists the sessions" in err
    assert "session sess_gone was not found" in err
    assert rc == 0 and out == "Hello, world\n" + STATUS + "\n"


def test_ctrl_c_during_a_reply_cancels_it_and_keeps_the_partial_text(tmp_path):
    """SIGINT while a reply streams sends response.cancel; the partial reply stays with a cancelled status."""
    out = io.StringIO()

    async def main():
        # after each delta the fake waits up to 30 s for a cancel: the SIGINT lands after "one" whatever the load
        async with FakeDaemon(reply=["one ", "two ", "three ", "four"], delta_delay_s=30) as daemon:
            async def interrupt_soon():
                deadline = time.monotonic() + 30
                while "one" not in out.getvalue():
                    assert time.monotonic() < deadline, "the first delta was never printed"
                    await asyncio.sleep(0.01)
                os.kill(os.getpid(), signal.SIGINT)

            session = ChatSession(ChatConfig(Endpoint(daemon.url), retry=FAST), SessionStore(tmp_path / "s"))
            killer = asyncio.ensure_future(interrupt_soon())
            rc = await Repl(session, PlainUI(out, io.StringIO()), Script("count")).run()
            await killer
            return rc, daemon.types()

    rc, types = run(main())
    assert rc == 0 and types == ["conversation.item.create", "response.create", "response.cancel"]
    text, status = out.getvalue().splitlines()
    assert text == "one " and status.startswith("cancelled (client_cancelled) · 1 tokens")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_at_the_prompt_hints_how_to_leave(tmp_path):
    """KeyboardInterrupt from the reader prints the exit hint; the end of input leaves with 0."""
    async def main():
        async with FakeDaemon() as daemon:
            return await chat(daemon, SessionStore(tmp_path / "s"), KeyboardInterrupt, "/frob")

    rc, _, err = run(main())
    assert rc == 0
    assert err.splitlines()[1:] == [EXIT_HINT, "unknown command /frob; type /? for help"]


def test_connection_lost_mid_reply_reconnects_and_resumes(tmp_path):
    """A dropped socket mid-reply keeps the partial text, resumes the same session, and the chat goes on."""
    store = SessionStore(tmp_path / "s.json")

    async def main():
        async with FakeDaemon(drop_after_deltas=2) as daemon:
            result = await chat(daemon, store, "first", "second")
            return result, daemon.received

    (rc, out, err), received = run(main())
    assert out == ("Hello\nconnection lost: the reply was cut short\n"
                   "Hello, world\n" + STATUS + "\n")
    assert "reconnected to sess_1 (restored from memory)" in err
    assert [e["type"] for e in received] == ["conversation.item.create", "response.create",
                                             "streamchat.session.resume",
                                             "conversation.item.create", "response.create"]
    assert received[2]["session_id"] == "sess_1" and received[2]["resume_token"] == "tok_1"


def test_regen_asks_for_another_reply(tmp_path):
    """/regen sends response.create again without a new user item."""
    async def main():
        async with FakeDaemon() as daemon:
            result = await chat(daemon, SessionStore(tmp_path / "s"), "hi", "/regen")
            return result, daemon.types()

    (_, out, _), types = run(main())
    assert types == ["conversation.item.create", "response.create", "response.create"]
    assert out.count("Hello, world\n") == 2


def test_read_adds_a_file_as_a_user_item_without_a_reply(tmp_path):
    """/read sends the file's text as one user item and asks for no reply; a missing file is an error."""
    notes = tmp_path / "notes.txt"
    notes.write_text("line 1\nline 2\n")

    async def main():
        async with FakeDaemon() as daemon:
            result = await chat(daemon, SessionStore(tmp_path / "s"), f"/read {notes}",
                                f"/read {tmp_path}/missing.txt")
            return result, daemon.received

    (_, out, err), received = run(main())
    assert [e["type"] for e in received] == ["conversation.item.create"]
    assert received[0]["item"]["content"][0]["text"] == "notes.txt:\n\nline 1\nline 2\n"
    assert "added notes.txt (14 characters)" in err
    assert "cannot read" in err and "missing.txt: No such file or directory" in err


def test_fenced_multiline_message_is_sent_without_fences(tmp_path):
    """An input fenced with triple quotes is sent as its inner lines."""
    async def main():
        async with FakeDaemon() as daemon:
            await chat(daemon, SessionStore(tmp_path / "s"), '"""\nline a\nline b\n"""')
            return daemon.received[0]["item"]["content"][0]["text"]

    assert run(main()) == "line a\nline b"
