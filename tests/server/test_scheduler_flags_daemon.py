"""The scheduler's limits as `streamchat serve` flags, in a running daemon.

--max-tokens-per-step, --max-pending-tokens and --max-pending-tokens-per-session are shown here
taking effect through the websocket (their logic: tests/engine/test_scheduler.py and
test_boundary.py). Two scheduler flags are tested in the engine only, because a running daemon
gives a test no handle on what they act on: --target-step-ms sizes prefill chunks from measured step
times (tests/engine/test_scheduler.py drives it with a fake clock; on a shared 2-core host a real
one would make the test's outcome the host's load), and --max-failed-steps counts steps that raise
(tests/engine/test_boundary.py injects the failure; nothing a client sends makes a step fail).
"""

import asyncio
import re
import urllib.request

import pytest
from conftest import Client, Daemon

pytestmark = pytest.mark.slow

BUDGET = 32  # --max-tokens-per-step: two blocks of 16
PER_SESSION, TOTAL = 1000, 400  # --max-pending-tokens-per-session, --max-pending-tokens


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("sched") / "s.db", "--max-tokens-per-step", str(BUDGET),
               "--max-pending-tokens-per-session", str(PER_SESSION), "--max-pending-tokens", str(TOTAL)).start()
    yield d
    d.stop()


def user_item(text):
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}


def steps(d) -> float:
    text = urllib.request.urlopen(d.http + "/metrics", timeout=10).read().decode()
    return float(re.search(r"^streamchat_steps_total (\S+)$", text, re.M).group(1))


def tokens(text: str) -> int:
    """The text's tokens under the bundled model's tokenizer (the item adds its framing on top)."""
    from transformers import AutoTokenizer

    from streamchat.model import loader

    return len(AutoTokenizer.from_pretrained(loader.resolve(None).folder)(text)["input_ids"])


def test_a_prefill_takes_at_most_max_tokens_per_step_a_step(daemon):
    """An item of about 300 tokens enters the cache in at least 300 / 32 steps (the default budget would
    take it in one), and its session then holds it all."""
    text = "word " * 300
    count = tokens(text)
    need = -(-count // BUDGET)

    async def go():
        c = await Client.open(daemon.url)
        before = steps(daemon)
        await c.send(user_item(text))
        await c.until("conversation.item.done")
        taken = steps(daemon) - before
        await c.send({"type": "streamchat.session.stats"})
        stats = (await c.until("streamchat.session.stats"))[-1]
        await c.close()
        return taken, stats

    taken, stats = asyncio.run(go())
    assert taken >= need >= 10, (taken, need)
    assert stats["total_tokens"] >= count, stats  # the context is the window of it (DAEMON_ARGS)


def test_past_the_daemon_wide_queue_limit_is_overloaded(daemon):
    """An item of about 500 tokens: within one session's limit (1,000) but over what all may queue (400):
    `overloaded`, and the session is as it was (a later short item is taken)."""
    async def go():
        c = await Client.open(daemon.url)
        await c.send(user_item("word " * 500))
        err = (await c.until("error"))[-1]["error"]
        await c.send(user_item("Hello."))
        await c.until("conversation.item.done")
        await c.close()
        return err

    err = asyncio.run(go())
    assert err["code"] == "overloaded", err


def test_past_one_session_s_queue_limit_is_refused_by_that_limit(daemon):
    """An item of about 1,100 tokens, over one session's limit (1,000): `pending_limit_exceeded`, which a
    client handles by waiting for its own items rather than retrying later."""
    async def go():
        c = await Client.open(daemon.url)
        await c.send(user_item("word " * 1100))
        err = (await c.until("error"))[-1]["error"]
        await c.close()
        return err

    err = asyncio.run(go())
    assert err["code"] == "pending_limit_exceeded" and str(PER_SESSION) in err["message"], err
