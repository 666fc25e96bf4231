"""The official `openai` Python SDK holds a text conversation with the daemon, unchanged."""

import asyncio

import pytest

pytestmark = pytest.mark.slow


def test_openai_sdk_realtime_conversation(daemon):
    """session.update, item, response.create, deltas to response.done, through AsyncOpenAI.realtime."""
    from openai import AsyncOpenAI

    async def go():
        client = AsyncOpenAI(api_key="unused", websocket_base_url=f"ws://127.0.0.1:{daemon.port}/v1")
        async with client.realtime.connect(model="SmolLM2-135M-Instruct") as conn:
            await conn.session.update(session={"type": "realtime", "instructions": "You are terse.",
                                               "output_modalities": ["text"]})
            await conn.conversation.item.create(item={
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]})
            await conn.response.create(response={"max_output_tokens": 20})
            deltas, seen = [], []
            async for event in conn:
                seen.append(event.type)
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                if event.type == "response.done":
                    final = event.response
                    break
        assert seen[0] == "session.created" and "session.updated" in seen
        assert deltas and final.status in ("completed", "incomplete")
        assert final.output[0].content[0].text == "".join(deltas)
        assert final.usage.output_tokens >= 1

    asyncio.run(go())
