"""Tests for the connection's send queue: deltas merge behind a slow client, order is kept."""

import asyncio

import orjson
import pytest

from streamchat.server.outbox import Outbox, SlowClient


class SlowSocket:
    """Records frames; each send takes `delay` seconds."""

    def __init__(self, delay):
        self.delay = delay
        self.frames = []

    async def send(self, message, **kw):
        await asyncio.sleep(self.delay)
        self.frames.append(orjson.loads(message))


def delta(text, item="item_1"):
    return {"type": "response.output_text.delta", "item_id": item, "delta": text}


def test_pending_deltas_merge_and_concatenate_exactly():
    """200 deltas queued behind a slow client go out as few frames with the same text, in order."""
    async def go():
        box, ws = Outbox(limit=50), SlowSocket(0.01)
        writer = asyncio.create_task(box.run(ws))
        box.put({"type": "response.created"})
        for i in range(200):
            box.put(delta(f"{i},"))
        box.put({"type": "response.done"})
        box.close()
        await writer
        return ws.frames, box.num_merged

    frames, merged = asyncio.run(go())
    assert frames[0]["type"] == "response.created" and frames[-1]["type"] == "response.done"
    text = "".join(f["delta"] for f in frames[1:-1])
    assert text == "".join(f"{i}," for i in range(200))
    assert len(frames) < 20 and merged == 200 - (len(frames) - 2)


def test_deltas_of_different_items_never_merge():
    """A delta of another item starts a new frame."""
    async def go():
        box, ws = Outbox(limit=50), SlowSocket(0.01)
        writer = asyncio.create_task(box.run(ws))
        for item in ("a", "a", "b", "b", "a"):
            box.put(delta("x", item))
        box.close()
        await writer
        return [f["item_id"] for f in ws.frames]

    assert asyncio.run(go()) in (["a", "a", "b", "a"], ["a", "b", "a"])


def test_a_client_past_the_limit_is_refused():
    """More non-mergeable events than the limit raise SlowClient instead of growing forever."""
    async def go():
        box = Outbox(limit=5)
        with pytest.raises(SlowClient):
            for i in range(10):
                box.put({"type": "conversation.item.added", "n": i})

    asyncio.run(go())
