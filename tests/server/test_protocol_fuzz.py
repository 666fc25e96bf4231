"""Fuzzes parse_client_event: any frame yields a ClientEvent or a ProtocolError with a spec code, nothing else."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamchat.server.protocol import (
    CLIENT_EVENT_TYPES,
    ERROR_CODES,
    InputTextAppend,
    Limits,
    ProtocolError,
    ResponseCreate,
    SessionUpdate,
    parse_client_event,
)

# Small limits so that generated values cross every boundary often.
LIMITS = Limits(max_text_chars=64, max_output_tokens=100, max_stop_strings=3, max_event_id_chars=16,
                max_stop_chars=3)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check(frame):
    """The fuzz oracle: a well-formed ClientEvent, or a ProtocolError with a spec code."""
    try:
        event = parse_client_event(frame, limits=LIMITS)
    except ProtocolError as exc:
        assert exc.code in ERROR_CODES
        assert exc.event_id is None or (isinstance(exc.event_id, str) and len(exc.event_id) <= 16)
        return exc
    assert event.TYPE in CLIENT_EVENT_TYPES
    assert event.event_id is None or len(event.event_id) <= 16
    for text in (getattr(event, "text", None), getattr(event, "instructions", None)):
        assert text is None or len(text) <= 64
    if isinstance(event, (ResponseCreate, SessionUpdate)):
        check_sampling_fields(event)
    return event


def check_sampling_fields(event):
    """Accepted sampling fields are finite and inside the documented ranges."""
    assert event.temperature is None or (math.isfinite(event.temperature) and 0 <= event.temperature <= 2)
    assert event.top_p is None or 0 < event.top_p <= 1
    assert event.top_k is None or 0 <= event.top_k <= 2**63 - 1
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(event, name)
        assert value is None or (math.isfinite(value) and -2 <= value <= 2)
    assert event.repetition_penalty is None or 0 < event.repetition_penalty <= 10
    assert event.min_p is None or 0 <= event.min_p <= 1
    if isinstance(event, ResponseCreate):
        assert event.seed is None or -(2**63) <= event.seed <= 2**63 - 1
        assert event.stop is None or (len(event.stop) <= 3 and all(0 < len(s) <= 3 for s in event.stop))


json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=80)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def fields(*names):
    """A dict holding a random subset of `names`, each with a random JSON value."""
    return st.dictionaries(st.sampled_from(names), json_values, max_size=len(names))


def with_overrides(base, extra):
    """`base`, half of the time with some fields replaced by random values."""
    return st.builds(lambda b, e: {**b, **e}, base, st.just({}) | extra)


# Plausible values for the fields we read, so that fuzzing also reaches past the first check.
plausible = {
    "max_output_tokens": st.just("inf") | st.integers(-5, 120),
    "instructions": st.text(max_size=8) | st.text(min_size=60, max_size=70),
    "temperature": st.floats(-1, 3) | st.integers(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 50) | st.integers(2**63 - 2, 2**64),
    "frequency_penalty": st.floats(-3, 3) | st.integers(-3, 3),
    "presence_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 11) | st.integers(-1, 11),
    "min_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-(2**64), 2**65) | st.integers(-(2**63) - 2, -(2**63) + 2) | st.integers(2**63 - 2, 2**63 + 2),
    "stop": st.lists(st.text(max_size=4), max_size=5),
    "text": st.text(max_size=8) | st.text(min_size=60, max_size=70),
    "role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
    "id": st.text(min_size=1, max_size=12) | st.text(max_size=20),
    "session_id": st.text(min_size=1, max_size=12) | st.text(max_size=20),
    "resume_token": st.text(min_size=1, max_size=12) | st.text(max_size=20),
    "response_id": st.text(min_size=1, max_size=12) | st.text(max_size=20),
    "event_id": st.text(min_size=1, max_size=12) | st.text(max_size=20),
}
parts = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "text", "input_audio"]), "text": st.text(max_size=40)}),
    max_size=3)
items = with_overrides(
    st.fixed_dictionaries({"type": st.just("message"), "role": plausible["role"], "content": parts}),
    fields("type", "role", "content", "id"),
)
inner = st.fixed_dictionaries({}, optional={k: plausible[k] for k in (
    "max_output_tokens", "instructions", "temperature", "top_p", "top_k", "seed", "stop", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "min_p")})
known_events = st.builds(
    lambda kind, body: {**body, "type": kind},
    st.sampled_from(CLIENT_EVENT_TYPES),
    with_overrides(st.fixed_dictionaries({}, optional={
        "event_id": plausible["event_id"], "session": inner, "response": inner | st.none(), "item": items,
        "text": plausible["text"], "session_id": plausible["session_id"],
        "resume_token": plausible["resume_token"], "response_id": plausible["response_id"],
    }), fields("event_id", "session", "response", "item", "text", "session_id", "previous_item_id")),
)


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes(data):
    """Binary frames are always invalid_event; the same bytes as text never crash."""
    assert check(data).code == "invalid_event"
    check(data.decode("utf-8", errors="surrogateescape"))  # lone surrogates in a str


@FUZZ
@given(st.text(max_size=200))
def test_random_text(text):
    """Arbitrary text frames never crash the parser."""
    check(text)


@FUZZ
@given(json_values, st.booleans())
def test_random_json_values(value, ascii_only):
    """Any JSON value parses or is refused; a non-object is invalid_event."""
    result = check(json.dumps(value, ensure_ascii=ascii_only))
    if not isinstance(value, dict):
        assert result.code == "invalid_event"


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(known_events)
def test_known_types_with_random_fields(event):
    """Known event types with random and plausible fields never crash, and keep their type."""
    result = check(json.dumps(event))
    if not isinstance(result, ProtocolError):
        assert type(result).TYPE == event["type"]


@FUZZ
@given(st.sampled_from(CLIENT_EVENT_TYPES), st.integers(0, 3000), st.sampled_from(["[", '{"k":']))
def test_deep_nesting(kind, depth, opener):
    """Deep nesting in any field parses (ignored) or is invalid_json past orjson's depth limit."""
    closer = "]" if opener == "[" else "}"
    nested = opener * depth + "1" + closer * depth
    frame = f'{{"type": "{kind}", "text": {nested}, "session": {nested}, "extra": {nested}}}'
    result = check(frame)
    if depth >= 1024:
        assert result.code == "invalid_json"


@FUZZ
@given(st.sampled_from(CLIENT_EVENT_TYPES), st.integers(0xD800, 0xDFFF), st.booleans())
def test_lone_surrogate_escapes(kind, surrogate, as_text):
    """A lone surrogate escape such as \\ud800 anywhere in a string is invalid_json."""
    escape = f"\\u{surrogate:04x}"
    field = "text" if as_text else "event_id"
    frame = f'{{"type": "{kind}", "{field}": "a{escape}b"}}'
    assert check(frame).code == "invalid_json"


@FUZZ
@given(st.integers(0, 200), st.sampled_from(["x", "é", "😀"]))
def test_text_size_boundary(length, char):
    """Append text is accepted up to max_text_chars (code points), then message_too_large."""
    result = check(json.dumps({"type": "streamchat.input_text.append", "text": char * length, "event_id": "e"}))
    if length <= 64:
        assert result == InputTextAppend(event_id="e", text=char * length)
    else:
        assert (result.code, result.event_id) == ("message_too_large", "e")


@FUZZ
@given(inner)
def test_response_create_fields_exactly(response):
    """A response.create with plausible fields parses to exactly those fields, or is refused."""
    result = check(json.dumps({"type": "response.create", "response": response}))
    if isinstance(result, ProtocolError):
        assert result.code in ("invalid_event", "message_too_large")
        return
    stop = response.get("stop")
    numbers = {k: float(response[k]) + 0.0 for k in ("temperature", "top_p", "frequency_penalty",
                                                     "presence_penalty", "repetition_penalty", "min_p")
               if k in response}
    assert result == ResponseCreate(
        max_output_tokens=response.get("max_output_tokens"), instructions=response.get("instructions"),
        top_k=response.get("top_k"), seed=response.get("seed"), stop=None if stop is None else tuple(stop),
        **numbers,
    )


def test_huge_strings_at_default_limits():
    """Multi-megabyte text and keys are refused or ignored quickly, never crash."""
    limits = Limits()
    huge = "a" * (limits.max_text_chars + 1)
    for frame in (
        json.dumps({"type": "streamchat.input_text.append", "text": huge}),
        json.dumps({"type": "conversation.item.create", "item": {
            "role": "user", "content": [{"type": "text", "text": huge[:600_000]}] * 2}}),
    ):
        with pytest.raises(ProtocolError) as info:
            parse_client_event(frame, limits=limits)
        assert info.value.code == "message_too_large"
    frame = json.dumps({"type": "streamchat.session.stats", huge: huge})
    assert parse_client_event(frame, limits=limits).TYPE == "streamchat.session.stats"
