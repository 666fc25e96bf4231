"""One client's system prompt cannot starve the others: instructions are bounded and counted (issue 26)."""

import asyncio
import http.client
import time
import urllib.request

import orjson
import pytest
from conftest import Client, Daemon

pytestmark = pytest.mark.slow


def health(d) -> dict:
    return orjson.loads(urllib.request.urlopen(d.http + "/healthz", timeout=10).read())


def user_item(text):
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}


def post_chat(d, body: dict) -> tuple[int, dict, float]:
    c = http.client.HTTPConnection("127.0.0.1", d.port, timeout=120)
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", body=orjson.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.status, orjson.loads(r.read()), time.monotonic() - t0
    c.close()
    return out


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """The default frame, body and text limits (1 MiB, 200,000 characters), as a user's daemon has them."""
    d = Daemon(tmp_path_factory.mktemp("bounds") / "s.db", "--max-frame-bytes", "1048576",
               "--max-text-chars", "200000").start()
    yield d
    d.stop()


def test_huge_system_prompts_are_refused_while_another_session_streams(daemon):
    """While a third session streams, a ~100,000-token system prompt over HTTP is answered 400
    instructions_too_long at once (never queued, never tokenized whole), 199,000 characters of websocket
    instructions get the same error naming the limit and leave the session as it was, a turn's instructions
    too; the stream completes and /healthz queues nothing afterwards."""
    async def go():
        x = await Client.open(daemon.url)
        await x.send(user_item("Count from one to fifty in words."))
        await x.until("conversation.item.done")
        await x.send({"type": "response.create", "response": {"max_output_tokens": 48, "temperature": 0}})
        await x.until("response.output_text.delta")

        status, body, took = await asyncio.to_thread(post_chat, daemon, {
            "model": "SmolLM2-135M-Instruct", "max_tokens": 4,
            "messages": [{"role": "system", "content": "lorem ipsum dolor sit amet " * 6500}] * 3  # ~100k tokens
            + [{"role": "user", "content": "hi"}]})
        assert status == 400 and body["error"]["code"] == "instructions_too_long", body
        assert "--max-instructions-tokens" in body["error"]["message"]

        y = await Client.open(daemon.url)
        await y.send({"type": "session.update", "session": {"instructions": "Be brief."}})
        await y.until("session.updated")
        await y.send({"type": "session.update", "session": {"instructions": "a" * 199_000}})
        err = (await y.until("error"))[-1]["error"]
        assert err["code"] == "instructions_too_long" and "--max-instructions-tokens" in err["message"]
        await y.send(user_item("Hello."))
        await y.until("conversation.item.done")
        turn = " ".join(["word"] * 1500)  # few characters a token: refused after tokenizing, by its count
        await y.send({"type": "response.create", "response": {"instructions": turn, "max_output_tokens": 4}})
        err = (await y.until("error"))[-1]["error"]
        assert err["code"] == "instructions_too_long" and "tokens" in err["message"]
        await y.send({"type": "session.update", "session": {"max_output_tokens": 100}})
        got = (await y.until("session.updated"))[-1]
        assert got["session"]["instructions"] == "Be brief."

        done = (await x.until("response.done"))[-1]["response"]
        assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 48
        await x.close()
        await y.close()
        return took

    took = asyncio.run(go())
    assert took < 10, f"the refusal took {took:.1f} s"
    deadline = time.monotonic() + 30
    while health(daemon)["queued_tokens"]:
        assert time.monotonic() < deadline, health(daemon)
        time.sleep(0.2)
