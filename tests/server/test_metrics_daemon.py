"""/metrics values against a scripted workload: two sessions sharing a system prompt, turns that evict, a
cancel, a bad frame and a resume; every counter and histogram moved by exactly what happened."""

import asyncio
import urllib.request

import pytest
from conftest import Client, settled_stats, wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

# Two full blocks and more once wrapped in the chat template, so the second session finds them by hash.
SYSTEM = ("You are a patient tutor for curious children. Answer every question in plain words, give one short "
          "example, and never use lists or headings.")
# Three turns of about 40 tokens each: past the 64-token window that follows the pinned system prompt.
QUESTIONS = ["Why is the sky blue during the day, but red and orange when the sun goes down in the evening?",
             "Why do the leaves of most trees turn yellow and brown and then fall to the ground in autumn?",
             "How do small birds manage to fly so far south every winter without getting lost on the way?"]


def scrape(daemon):
    """{(sample name, sorted labels): value} of one /metrics scrape."""
    with urllib.request.urlopen(daemon.http + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def delta(before, after, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def turn(c, text, **response):
    """A user item, then a greedy response of at most 8 tokens; its response.done object."""
    await c.send({"type": "conversation.item.create",
                  "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
    await c.until("conversation.item.done")
    await c.send({"type": "response.create", "response": {"max_output_tokens": 8, "temperature": 0, **response}})
    return (await c.until("response.done"))[-1]["response"]


async def workload(url):
    """Session a: three turns past its 64-token window, then closed and resumed; session b: the same system
    prompt, one turn, one response cancelled at once, one bad frame. Returns (responses, per-session stats)."""
    a, b = await Client.open(url), await Client.open(url)
    for c in (a, b):
        await c.send({"type": "session.update", "session": {"instructions": SYSTEM}})
        assert (await c.recv())["type"] == "session.updated"
    responses = [await turn(a, q) for q in QUESTIONS] + [await turn(b, QUESTIONS[0])]
    await b.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]}})
    await b.until("conversation.item.done")
    await b.send({"type": "response.create", "response": {"max_output_tokens": 200}})
    await b.send({"type": "response.cancel"})
    responses.append((await b.until("response.done"))[-1]["response"])
    await b.ws.send("{not json")
    assert (await b.recv())["error"]["code"] == "invalid_json"
    figures = [await settled_stats(a), await settled_stats(b)]
    sid, token = a.created["session"]["id"], a.created["session"]["resume_token"]
    await a.close()
    again = await Client.open(url)
    await again.send({"type": "streamchat.session.resume", "session_id": sid, "resume_token": token})
    resumed = await again.recv()
    assert resumed["type"] == "streamchat.session.resumed" and resumed["restored_from"] == "memory", resumed
    await again.close()
    await b.close()
    return responses, figures


def test_metrics_count_exactly_what_the_workload_did(counted_daemon):
    """Prefix hits are the second session's system prompt blocks; evicted tokens (all and by policy) are the
    sessions' own; responses by status, TTFT and inter-token counts, errors and resumes match the events."""
    daemon = counted_daemon
    before = scrape(daemon)
    responses, (sa, sb) = asyncio.run(workload(daemon.url))
    wait_for(lambda: scrape(daemon)[("streamchat_connections", ())] == 0, "every connection to close")
    after = scrape(daemon)

    statuses = [r["status"] for r in responses]
    assert statuses == ["incomplete"] * 4 + ["cancelled"], statuses  # greedy replies longer than 8 tokens
    for status in ("incomplete", "cancelled", "completed", "failed"):
        assert delta(before, after, "streamchat_responses_total", status=status) == statuses.count(status), status

    # the shared system prompt: a found nothing, b found every full block of it (and nothing more)
    assert sa["prefix"]["hit_tokens"] == 0 and sb["prefix"]["hit_tokens"] >= 32, (sa["prefix"], sb["prefix"])
    assert sb["prefix"]["hit_tokens"] % 16 == 0 and sb["cached_tokens"] >= sb["prefix"]["hit_tokens"]
    assert delta(before, after, "streamchat_prefix_hit_tokens_total") == sb["prefix"]["hit_tokens"]
    assert delta(before, after, "streamchat_prefix_query_tokens_total") == (
        sa["prefix"]["queried_tokens"] + sb["prefix"]["queried_tokens"])

    # eviction: whole blocks, the tokens that left each session's context, all under sink_window
    evicted = sa["evicted_tokens"] + sb["evicted_tokens"]
    for s in (sa, sb):
        assert s["evicted_tokens"] == s["total_tokens"] - s["context_tokens"] and s["evicted_tokens"] % 16 == 0, s
    assert sa["evicted_tokens"] >= 32 and sa["eviction"] == "sink_window", sa
    assert delta(before, after, "streamchat_evicted_tokens_total") == evicted
    assert delta(before, after, "streamchat_evicted_tokens_by_policy_total", policy="sink_window") == evicted
    assert delta(before, after, "streamchat_evicted_tokens_by_policy_total", policy="h2o") == 0
    assert delta(before, after, "streamchat_preemptions_total") == 0  # 400 blocks: nothing is short
    assert delta(before, after, "streamchat_idle_drops_total") == 0

    # one first token per response that produced one; one gap per later token
    outputs = [r["usage"]["output_tokens"] for r in responses]
    assert delta(before, after, "streamchat_time_to_first_token_seconds_count") == sum(n > 0 for n in outputs)
    assert delta(before, after, "streamchat_inter_token_latency_seconds_count") == sum(max(n - 1, 0) for n in outputs)
    assert delta(before, after, "streamchat_step_tokens_sum") == delta(before, after, "streamchat_tokens_total")
    assert delta(before, after, "streamchat_errors_total", code="invalid_json") == 1
    assert delta(before, after, "streamchat_resumes_total", restored_from="memory") == 1

    # steps of decode rows only (what bench/step.py times): each of the four 8-token replies ran alone, so its
    # seven tokens after the first came from such steps; every turn's prompt took at least one other step
    decode_steps, steps = (delta(before, after, f"streamchat_{n}_total") for n in ("decode_steps", "steps"))
    assert 4 * 7 <= decode_steps <= steps - 4, (decode_steps, steps)
    decode_seconds = delta(before, after, "streamchat_decode_step_seconds_total")
    assert 0 < decode_seconds < delta(before, after, "streamchat_step_seconds_total")
