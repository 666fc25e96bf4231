"""Tests of the daemon's log as an operator sees it: one start-up block, a line per response, JSON."""

import asyncio
import json
import signal

import pytest
from conftest import Client, Daemon

pytestmark = pytest.mark.slow


def test_json_log_start_up_block_and_a_line_per_response(tmp_path):
    """--log-format json: every log line is a JSON object; start-up is one record carrying the model, pool,
    tiers and address (no alembic or websockets lines); each finished response logs its figures.
    --served-model-name '*' accepts any model name."""
    d = Daemon(tmp_path / "s.db", "--log-format", "json", "--served-model-name", "*").start()
    try:
        async def go():
            c = await Client.open(d.url + "?model=gpt-realtime-anything")
            await c.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}})
            await c.send({"type": "response.create", "response": {"max_output_tokens": 3}})
            done = (await c.until("response.done"))[-1]["response"]
            await c.close()
            return c.created["session"], done
        session, done = asyncio.run(go())
    finally:
        d.kill(signal.SIGTERM)
    lines = d.log + d.proc.stdout.read().splitlines(keepends=True)
    records = [json.loads(line) for line in lines if not line.startswith("streamchat: listening")]
    assert len(records) == len(lines) - 1
    assert not [r for r in records if r["logger"].startswith(("alembic", "websockets"))]
    [ready] = [r for r in records if r["message"].startswith("streamchat ready on ws://")]
    assert ready["address"] == d.url and ready["model"] == session["model"] == "SmolLM2-135M-Instruct"
    assert ready["served_model_names"] == ["SmolLM2-135M-Instruct"] and ready["any_model_name"] is True
    assert ready["kv_blocks"] == 399 and ready["kv_block_tokens"] == 16 and ready["kv_bytes"] > 0
    assert ready["device"].startswith(("cpu", "cuda")) and ready["weights"] == "bf16"
    assert ready["dtype"] in ("float32", "bfloat16")
    assert ready["data_dir"] == str(tmp_path / "s.kv") and ready["disk_tier"].startswith(str(tmp_path / "s.kv"))
    assert ready["sampling"]["temperature"] == 0.7 and "\n  kv pool " in ready["message"]
    [finished] = [r for r in records if r.get("response_id") == done["id"]]
    u = done["usage"]
    assert {k: finished[k] for k in ("session_id", "status", "input_tokens", "cached_tokens", "output_tokens")} == {
        "session_id": session["id"], "status": done["status"], "input_tokens": u["input_tokens"],
        "cached_tokens": u["input_token_details"]["cached_tokens"], "output_tokens": u["output_tokens"]}
    assert finished["level"] == "INFO" and finished["ttft_ms"] > 0
