"""Pins the wire protocol: client events parsed to exact dataclasses, exact error codes, exact server events."""

import json
import math
import re
import subprocess
import sys

import orjson
import pytest

from streamchat.server import events as E
from streamchat.server import protocol
from streamchat.server.protocol import (
    CLIENT_EVENT_TYPES,
    ERROR_CODES,
    SERVER_ERROR_CODES,
    ErrorCode,
    InputTextAppend,
    InputTextCommit,
    ItemCreate,
    Limits,
    ProtocolError,
    ResponseCancel,
    ResponseCreate,
    SessionResume,
    SessionStats,
    SessionUpdate,
    parse_client_event,
)

LIMITS = Limits(max_text_chars=100, max_output_tokens=4096, max_stop_strings=4, max_event_id_chars=32,
                max_stop_chars=8)


def parse(event):
    """Parse a dict (sent as JSON text) or a raw frame."""
    frame = event if isinstance(event, (str, bytes)) else json.dumps(event)
    return parse_client_event(frame, limits=LIMITS)


def refuse(event):
    with pytest.raises(ProtocolError) as info:
        parse(event)
    return info.value


# -- valid client events -------------------------------------------------------------

USER_ITEM = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}

VALID = [
    ({"type": "session.update", "session": {"instructions": "Be brief.", "max_output_tokens": 200}},
     SessionUpdate(instructions="Be brief.", max_output_tokens=200)),
    ({"type": "session.update", "event_id": "e1", "session": {"max_output_tokens": "inf"}},
     SessionUpdate(event_id="e1", max_output_tokens="inf")),
    ({"type": "session.update", "session": {}}, SessionUpdate()),
    ({"type": "session.update", "session": {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "frequency_penalty": -2, "presence_penalty": 0.5,
        "repetition_penalty": 1.1, "min_p": 0.05, "seed": "ignored: not a session field"}},
     SessionUpdate(temperature=0.7, top_p=0.9, top_k=40, frequency_penalty=-2.0, presence_penalty=0.5,
                   repetition_penalty=1.1, min_p=0.05)),
    ({"type": "session.update", "session": {"temperature": None, "min_p": None}}, SessionUpdate()),
    ({"type": "conversation.item.create", "event_id": "e2", "item": USER_ITEM},
     ItemCreate(event_id="e2", role="user", text="hi")),
    ({"type": "conversation.item.create", "item": {
        "id": "item_7", "type": "message", "role": "assistant",
        "content": [{"type": "output_text", "text": "a"}, {"type": "text", "text": "b"}]}},
     ItemCreate(role="assistant", text="ab", item_id="item_7")),
    ({"type": "conversation.item.create", "item": {"role": "system", "content": []}},
     ItemCreate(role="system", text="")),
    ({"type": "response.create"}, ResponseCreate()),
    ({"type": "response.create", "response": None}, ResponseCreate()),
    ({"type": "response.create", "event_id": "e3", "response": {
        "max_output_tokens": 64, "instructions": "Answer in French.", "temperature": 0,
        "top_p": 0.9, "top_k": 40, "seed": -7, "stop": ["\n\n", "User:"]}},
     ResponseCreate(event_id="e3", max_output_tokens=64, instructions="Answer in French.",
                    temperature=0.0, top_p=0.9, top_k=40, seed=-7, stop=("\n\n", "User:"))),
    ({"type": "response.create", "response": {
        "frequency_penalty": 2, "presence_penalty": -0.0, "repetition_penalty": 10, "min_p": 1}},
     ResponseCreate(frequency_penalty=2.0, presence_penalty=0.0, repetition_penalty=10.0, min_p=1.0)),
    ({"type": "response.create", "response": {"repetition_penalty": 5e-324, "min_p": 0, "frequency_penalty": None}},
     ResponseCreate(repetition_penalty=5e-324, min_p=0.0)),
    ({"type": "response.cancel"}, ResponseCancel()),
    ({"type": "response.cancel", "event_id": "e4", "response_id": "resp_1"},
     ResponseCancel(event_id="e4", response_id="resp_1")),
    ({"type": "streamchat.input_text.append", "text": "and then "}, InputTextAppend(text="and then ")),
    ({"type": "streamchat.input_text.append", "text": ""}, InputTextAppend(text="")),
    ({"type": "streamchat.input_text.commit", "event_id": "e5"}, InputTextCommit(event_id="e5")),
    ({"type": "streamchat.session.resume", "session_id": "sess_1", "resume_token": "tok"},
     SessionResume(session_id="sess_1", resume_token="tok")),
    ({"type": "streamchat.session.stats"}, SessionStats()),
]


@pytest.mark.parametrize(("event", "expected"), VALID, ids=[e["type"] for e, _ in VALID])
def test_valid_event_parses_to_exact_dataclass(event, expected):
    """Each client event type parses to exactly the expected frozen dataclass."""
    assert parse(event) == expected


def test_every_client_event_type_is_covered():
    """The valid examples exercise every client event type of the spec."""
    assert {e["type"] for e, _ in VALID} == set(CLIENT_EVENT_TYPES)
    assert len(CLIENT_EVENT_TYPES) == 8


def test_sdk_shaped_events_parse():
    """What the official openai SDK sends (GA shapes, extra fields, nulls) parses."""
    session = {"type": "realtime", "model": "gpt-realtime", "output_modalities": ["text"],
               "instructions": "x", "tools": [], "tool_choice": "auto", "audio": {"input": {}},
               "truncation": "auto", "tracing": None, "max_output_tokens": None}
    assert parse({"type": "session.update", "session": session}) == SessionUpdate(instructions="x")
    create = {"type": "conversation.item.create", "previous_item_id": "item_0",
              "item": {**USER_ITEM, "id": "item_1", "object": "realtime.item", "status": "completed"}}
    assert parse(create) == ItemCreate(role="user", text="hi", item_id="item_1")
    response = {"conversation": "auto", "output_modalities": ["text"], "metadata": {"k": "v"},
                "tool_choice": "none", "instructions": None}
    assert parse({"type": "response.create", "response": response}) == ResponseCreate()


def test_sdk_models_serialize_to_parseable_events():
    """Events built with the SDK's own pydantic models parse (public to_json path)."""
    import openai.types.realtime as rt  # a test dependency: missing, the test fails rather than skips

    frames = [
        rt.SessionUpdateEvent(type="session.update", session=rt.RealtimeSessionCreateRequest(
            type="realtime", instructions="Be kind.", output_modalities=["text"], max_output_tokens=9)),
        rt.ConversationItemCreateEvent(type="conversation.item.create", item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "yo"}]}),
        rt.ResponseCreateEvent(type="response.create"),
        rt.ResponseCancelEvent(type="response.cancel", event_id="c1"),
    ]
    parsed = [parse(f.to_json(use_api_names=True, exclude_unset=True)) for f in frames]
    assert parsed == [SessionUpdate(instructions="Be kind.", max_output_tokens=9),
                      ItemCreate(role="user", text="yo"), ResponseCreate(), ResponseCancel(event_id="c1")]


def test_dataclasses_are_frozen():
    """Parsed events are immutable."""
    with pytest.raises(AttributeError):
        parse({"type": "streamchat.input_text.append", "text": "x"}).text = "y"


def test_limit_boundaries_are_inclusive():
    """Exactly at each limit is accepted."""
    assert parse({"type": "streamchat.input_text.append", "text": "x" * 100}).text == "x" * 100
    assert parse({"type": "response.create", "response": {"max_output_tokens": 4096}}).max_output_tokens == 4096
    assert parse({"type": "response.create", "response": {"stop": list("abcd")}}).stop == tuple("abcd")
    assert parse({"type": "response.create", "response": {"stop": ["é" * 8]}}).stop == ("é" * 8,)
    assert parse({"type": "streamchat.session.stats", "event_id": "e" * 32}).event_id == "e" * 32
    assert parse({"type": "response.create", "response": {"temperature": 2, "top_p": 1}}).temperature == 2.0


# -- errors ---------------------------------------------------------------------------------


def test_error_codes_are_the_spec_codes():
    """ERROR_CODES lists exactly the spec's codes, in spec order, as the Enum does."""
    assert ERROR_CODES == (
        "invalid_json", "invalid_event", "unknown_event", "conversation_already_has_active_response",
        "response_cancel_not_active", "session_not_found", "message_too_large", "overloaded", "internal",
        "store_unavailable", "item_id_in_use", "pending_limit_exceeded", "engine_unavailable",
        "engine_restarting", "instructions_too_long", "session_leased", "lease_lost",
    )
    assert tuple(c.value for c in ErrorCode) == ERROR_CODES
    assert SERVER_ERROR_CODES == {"overloaded", "internal", "store_unavailable", "engine_unavailable",
                                  "engine_restarting", "session_leased", "lease_lost"}


def test_url_session_id():
    """The URL's session_id (a proxy routes on it): absent, one valid id, or invalid_event."""
    limits = Limits(max_event_id_chars=8)
    assert protocol.url_session_id("model=m", limits) is None
    assert protocol.url_session_id("model=m&session_id=sess_1", limits) == "sess_1"
    for query in ("session_id=", "session_id=a&session_id=a", "session_id=" + "x" * 9):
        with pytest.raises(ProtocolError) as err:
            protocol.url_session_id(query, limits)
        assert err.value.code == "invalid_event"


def test_protocol_error_fields_and_unknown_code():
    """ProtocolError stores a plain-str code; a code outside the spec is a ValueError."""
    exc = ProtocolError(ErrorCode.SESSION_NOT_FOUND, "no such session", "e9")
    assert (exc.code, exc.message, exc.event_id) == ("session_not_found", "no such session", "e9")
    assert type(exc.code) is str and str(exc) == "session_not_found: no such session"
    with pytest.raises(ValueError):
        ProtocolError("teapot", "x")


ERRORS = [
    # (frame, code, echoed event_id)
    ("{not json", "invalid_json", None),
    ("", "invalid_json", None),
    ('{"type": "response.create", "event_id": "e1"', "invalid_json", None),
    ('{"type": "streamchat.input_text.append", "text": "\\ud800"}', "invalid_json", None),
    ('{"type": "streamchat.input_text.append", "text": "\\udc00\\ud800"}', "invalid_json", None),
    ('{"type": "streamchat.input_text.append", "text": "\ud800"}', "invalid_json", None),
    ('{"type": "response.create", "response": {"temperature": NaN}}', "invalid_json", None),
    ('{"type": "response.create", "response": {"temperature": 1e400}}', "invalid_json", None),
    ('{"type": "response.create", "response": {"temperature": 1e999}}', "invalid_json", None),
    ('{"type": "response.create", "response": {"top_p": -1e999}}', "invalid_json", None),
    ('{"type": "response.create", "response": {"top_k": Infinity}}', "invalid_json", None),
    ('{"type": "response.create", "response": {"seed": -Infinity}}', "invalid_json", None),
    ('{"type": "session.update", "session": {"max_output_tokens": NaN}}', "invalid_json", None),
    ("[" * 2000 + "]" * 2000, "invalid_json", None),
    ('{"a":' * 1100 + "1" + "}" * 1100, "invalid_json", None),
    ("\ufeff{}", "invalid_json", None),
    (b'{"type": "response.create"}', "invalid_event", None),
    (b"\xff\xfe", "invalid_event", None),
    ("[]", "invalid_event", None),
    ('"response.create"', "invalid_event", None),
    ("null", "invalid_event", None),
    ({}, "invalid_event", None),
    ({"type": 5, "event_id": "e1"}, "invalid_event", "e1"),
    ({"type": None}, "invalid_event", None),
    ({"type": "response.create", "event_id": 5}, "invalid_event", None),
    ({"type": "response.create", "event_id": "e" * 33}, "invalid_event", None),
    ({"type": "session.update", "event_id": "e2"}, "invalid_event", "e2"),
    ({"type": "session.update", "session": []}, "invalid_event", None),
    ({"type": "session.update", "session": {"type": "transcription"}}, "invalid_event", None),
    ({"type": "session.update", "session": {"instructions": 3}}, "invalid_event", None),
    ({"type": "session.update", "session": {"max_output_tokens": 0}}, "invalid_event", None),
    ({"type": "session.update", "session": {"max_output_tokens": 4097}}, "invalid_event", None),
    ({"type": "session.update", "session": {"max_output_tokens": "INF"}}, "invalid_event", None),
    ({"type": "session.update", "session": {"max_output_tokens": 5.0}}, "invalid_event", None),
    ({"type": "session.update", "session": {"max_output_tokens": True}}, "invalid_event", None),
    ({"type": "conversation.item.create"}, "invalid_event", None),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "type": "function_call"}}, "invalid_event", None),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "role": "tool"}}, "invalid_event", None),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "role": None}}, "invalid_event", None),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "content": "hi"}}, "invalid_event", None),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "content": ["hi"]}}, "invalid_event", None),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "content": [
        {"type": "input_audio", "audio": "AAAA"}]}}, "invalid_event", None),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "content": [
        {"type": "input_text", "text": None}]}}, "invalid_event", None),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "id": ""}}, "invalid_event", None),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "id": 7}}, "invalid_event", None),
    ({"type": "conversation.item.create", "item": USER_ITEM, "previous_item_id": 1}, "invalid_event", None),
    ({"type": "response.create", "response": "fast"}, "invalid_event", None),
    ({"type": "response.create", "response": {"temperature": -0.1}}, "invalid_event", None),
    ({"type": "response.create", "response": {"temperature": 2.01}}, "invalid_event", None),
    ({"type": "response.create", "response": {"temperature": "1"}}, "invalid_event", None),
    ({"type": "response.create", "response": {"temperature": True}}, "invalid_event", None),
    ({"type": "response.create", "response": {"top_k": False}}, "invalid_event", None),
    ({"type": "response.create", "response": {"seed": True}}, "invalid_event", None),
    ({"type": "response.create", "response": {"top_p": 0}}, "invalid_event", None),
    ({"type": "response.create", "response": {"top_p": 1.5}}, "invalid_event", None),
    ({"type": "response.create", "response": {"top_k": -1}}, "invalid_event", None),
    ({"type": "response.create", "response": {"top_k": 1.0}}, "invalid_event", None),
    ({"type": "response.create", "response": {"seed": "1"}}, "invalid_event", None),
    ({"type": "response.create", "response": {"seed": 18446744073709551616}}, "invalid_event", None),
    ({"type": "response.create", "response": {"seed": 2**64 - 1}}, "invalid_event", None),
    ({"type": "response.create", "response": {"seed": 2**63}}, "invalid_event", None),
    ({"type": "response.create", "response": {"seed": -(2**63) - 1}}, "invalid_event", None),
    ({"type": "response.create", "response": {"seed": -0.0}}, "invalid_event", None),
    ({"type": "response.create", "response": {"top_k": 2**63}}, "invalid_event", None),
    ({"type": "response.create", "response": {"top_k": -0.0}}, "invalid_event", None),
    ({"type": "response.create", "response": {"temperature": 2**64 - 1}}, "invalid_event", None),
    ({"type": "response.create", "response": {"top_p": -0.0}}, "invalid_event", None),
    ({"type": "response.create", "response": {"frequency_penalty": 2.01}}, "invalid_event", None),
    ({"type": "response.create", "response": {"frequency_penalty": -2.01}}, "invalid_event", None),
    ({"type": "response.create", "response": {"presence_penalty": "0.5"}}, "invalid_event", None),
    ({"type": "response.create", "response": {"presence_penalty": True}}, "invalid_event", None),
    ({"type": "response.create", "response": {"repetition_penalty": 0}}, "invalid_event", None),
    ({"type": "response.create", "response": {"repetition_penalty": -0.0}}, "invalid_event", None),
    ({"type": "response.create", "response": {"repetition_penalty": 10.5}}, "invalid_event", None),
    ({"type": "response.create", "response": {"min_p": -0.1}}, "invalid_event", None),
    ({"type": "response.create", "response": {"min_p": 1.01}}, "invalid_event", None),
    ({"type": "session.update", "event_id": "e7", "session": {"temperature": 3}}, "invalid_event", "e7"),
    ({"type": "session.update", "session": {"top_k": 1.5}}, "invalid_event", None),
    ({"type": "session.update", "session": {"top_p": 0}}, "invalid_event", None),
    ({"type": "session.update", "session": {"repetition_penalty": 0}}, "invalid_event", None),
    ({"type": "session.update", "session": {"min_p": False}}, "invalid_event", None),
    ({"type": "response.create", "event_id": "e6", "response": {"stop": ["x" * 9]}}, "invalid_event", "e6"),
    ({"type": "response.create", "response": {"stop": ["ok", "é" * 9]}}, "invalid_event", None),
    ({"type": "response.create", "response": {"stop": "x"}}, "invalid_event", None),
    ({"type": "response.create", "response": {"stop": [""]}}, "invalid_event", None),
    ({"type": "response.create", "response": {"stop": [1]}}, "invalid_event", None),
    ({"type": "response.create", "response": {"stop": list("abcde")}}, "invalid_event", None),
    ({"type": "response.create", "response": {"instructions": ["x"]}}, "invalid_event", None),
    ({"type": "response.cancel", "response_id": 3}, "invalid_event", None),
    ({"type": "streamchat.input_text.append"}, "invalid_event", None),
    ({"type": "streamchat.input_text.append", "text": 1, "event_id": "e3"}, "invalid_event", "e3"),
    ({"type": "streamchat.session.resume", "session_id": "s"}, "invalid_event", None),
    ({"type": "streamchat.session.resume", "session_id": "s", "resume_token": "t" * 33}, "invalid_event", None),
    ({"type": "input_audio_buffer.append", "audio": "", "event_id": "e4"}, "unknown_event", "e4"),
    ({"type": ""}, "unknown_event", None),
    ({"type": "Response.Create"}, "unknown_event", None),
    ({"type": "streamchat.input_text.append", "text": "x" * 101, "event_id": "e5"}, "message_too_large", "e5"),
    ({"type": "conversation.item.create", "item": {**USER_ITEM, "content": [
        {"type": "input_text", "text": "x" * 60}, {"type": "text", "text": "y" * 41}]}}, "message_too_large", None),
    ({"type": "session.update", "session": {"instructions": "x" * 101}}, "message_too_large", None),
    ({"type": "response.create", "response": {"instructions": "x" * 101}}, "message_too_large", None),
]


@pytest.mark.parametrize(("event", "code", "echo"), ERRORS, ids=range(len(ERRORS)))
def test_error_code_and_event_id_echo(event, code, echo):
    """Each malformed frame gets exactly its code, echoing a readable event_id."""
    exc = refuse(event)
    assert (exc.code, exc.event_id) == (code, echo)
    assert exc.message


def test_parse_error_codes_all_reachable():
    """Every code the parser owns has an example above."""
    assert {code for _, code, _ in ERRORS} == {"invalid_json", "invalid_event", "unknown_event", "message_too_large"}


def test_non_frame_argument_is_a_type_error():
    """Passing something that is not a frame is caller misuse, not a ProtocolError."""
    with pytest.raises(TypeError):
        parse_client_event(42, limits=LIMITS)


def test_limits_must_be_positive():
    """A zero limit is a configuration mistake, for every limit."""
    for name in ("max_text_chars", "max_output_tokens", "max_stop_strings", "max_event_id_chars", "max_stop_chars"):
        with pytest.raises(ValueError):
            Limits(**{name: 0})
    assert Limits().max_stop_chars == 256


# -- numbers at the edges of what orjson and the ranges admit -------------------------------

NUMBERS = [
    # (raw response object, the ResponseCreate fields it parses to)
    ('{"temperature": -0.0}', {"temperature": 0.0}),
    ('{"temperature": 5e-324, "top_p": 5e-324}', {"temperature": 5e-324, "top_p": 5e-324}),
    ('{"temperature": 1e-400}', {"temperature": 0.0}),
    ('{"temperature": 1e-300, "top_p": 1.0e0}', {"temperature": 1e-300, "top_p": 1.0}),
    ('{"top_k": -0, "seed": -0}', {"top_k": 0, "seed": 0}),
    ('{"top_k": 9223372036854775807, "seed": -9223372036854775808}', {"top_k": 2**63 - 1, "seed": -(2**63)}),
    ('{"seed": 9223372036854775807}', {"seed": 2**63 - 1}),
]


@pytest.mark.parametrize(("raw", "fields"), NUMBERS, ids=range(len(NUMBERS)))
def test_edge_numbers_parse_exactly(raw, fields):
    """Negative zeros, subnormals, underflow and the int64 bounds parse to exactly these values."""
    event = parse(f'{{"type": "response.create", "response": {raw}}}')
    assert event == ResponseCreate(**fields)
    if event.temperature is not None:
        assert math.copysign(1.0, event.temperature) == 1.0  # -0.0 arrives as +0.0


SAMPLING_NAMES = ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty", "repetition_penalty",
                  "min_p")
def test_sampling_fields_by_name():
    """sampling() gives the set sampling fields only: a response's seed included, never stop or instructions."""
    update = parse({"type": "session.update", "session": {"instructions": "x", "min_p": 0.1, "top_k": 5}})
    assert update.sampling() == {"top_k": 5, "min_p": 0.1}
    create = parse({"type": "response.create", "response": {
        "seed": 0, "stop": ["x"], "instructions": "y", "presence_penalty": 1, "max_output_tokens": 3}})
    assert create.sampling() == {"seed": 0, "presence_penalty": 1.0}
    assert parse({"type": "response.create"}).sampling() == {} == SessionUpdate().sampling()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("frequency_penalty", 3, "response.frequency_penalty must be a number in [-2, 2], got 3"),
    ("presence_penalty", -3, "response.presence_penalty must be a number in [-2, 2], got -3"),
    ("repetition_penalty", 0, "response.repetition_penalty must be a number in (0, 10], got 0"),
    ("min_p", 2, "response.min_p must be a number in [0, 1], got 2"),
])
def test_penalty_errors_name_the_field_and_range(field, value, message):
    """The error message says which field and what it admits."""
    assert refuse({"type": "response.create", "response": {field: value}}).message == message


NUMERIC_FIELDS = [("response", "seed"), ("response", "max_output_tokens"), ("session", "max_output_tokens")] + \
    [(outer, name) for outer in ("response", "session") for name in SAMPLING_NAMES]


@pytest.mark.parametrize(("literal", "field"), [(lit, f) for lit in ("NaN", "Infinity", "-Infinity", "1e999")
                                                for f in NUMERIC_FIELDS])
def test_non_finite_numbers_are_invalid_event_even_from_a_lenient_decoder(monkeypatch, literal, field):
    """If the JSON decoder let NaN or an infinity through, every numeric field still refuses it."""
    monkeypatch.setattr(protocol.orjson, "loads", json.loads)  # the stdlib decodes all four
    outer, key = field
    kind = "response.create" if outer == "response" else "session.update"
    exc = refuse(f'{{"type": "{kind}", "event_id": "e1", "{outer}": {{"{key}": {literal}}}}}')
    assert (exc.code, exc.event_id) == ("invalid_event", "e1")
    assert f"{outer}.{key}" in exc.message


# -- server events ----------------------------------------------------------------------------

TRUNCATION = {"sink_tokens": 4, "window_tokens": 2048, "block_size": 16}
EVT_ID = re.compile(r"evt_[0-9a-f]{32}")


def strip_id(event):
    """The event without its random event_id, after checking the id's shape."""
    assert EVT_ID.fullmatch(event["event_id"])
    return {k: v for k, v in event.items() if k != "event_id"}


def make_session(token="tok"):
    return E.session_object(session_id="sess_1", model="smollm2", instructions="", max_output_tokens="inf",
                            truncation=TRUNCATION, resume_token=token)


def test_session_object_shows_its_sampling_defaults():
    """Given sampling defaults, the session object shows them right after max_output_tokens."""
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                "repetition_penalty": 1.1, "min_p": 0.0}
    session = E.session_object(session_id="sess_1", model="smollm2", instructions="", max_output_tokens="inf",
                               truncation=TRUNCATION, sampling=sampling)
    assert list(session) == ["type", "object", "id", "model", "instructions", "output_modalities",
                             "max_output_tokens", *sampling, "truncation"]
    assert {k: session[k] for k in sampling} == sampling
    with pytest.raises(AssertionError):
        E.session_object(session_id="s", model="m", instructions="", max_output_tokens="inf",
                         truncation=TRUNCATION, sampling={"id": "sess_evil"})


def test_new_id_has_128_random_bits():
    """new_id is prefix, underscore, 32 hex digits, and never repeats."""
    ids = {E.new_id("item") for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"item_[0-9a-f]{32}", i) for i in ids)


def test_session_object_and_token_shown_once():
    """session.created shows resume_token; session.updated and resumed never do."""
    session = make_session()
    assert list(session) == ["type", "object", "id", "model", "instructions", "output_modalities",
                             "max_output_tokens", "resume_token", "truncation"]
    assert session["truncation"] == {"type": "streamchat.sink_window", **TRUNCATION}
    assert strip_id(E.session_created(session)) == {"type": "session.created", "session": session}
    public = {k: v for k, v in session.items() if k != "resume_token"}
    assert make_session(token=None) == public
    assert strip_id(E.session_updated(session)) == {"type": "session.updated", "session": public}
    assert strip_id(E.session_resumed(session, "disk")) == {
        "type": "streamchat.session.resumed", "session": public, "restored_from": "disk"}
    with pytest.raises(ValueError):
        E.session_resumed(session, "cloud")


def test_item_object_and_item_events():
    """Items are GA realtime.item messages; the part type follows the role."""
    user = E.item_object("item_1", "user", "hi")
    assert user == {"id": "item_1", "object": "realtime.item", "type": "message", "status": "completed",
                    "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    assert E.item_object("i", "system", "s")["content"] == [{"type": "input_text", "text": "s"}]
    assert E.item_object("i", "assistant", "a")["content"] == [{"type": "output_text", "text": "a"}]
    assert E.item_object("i", "assistant", None, status="in_progress")["content"] == []
    with pytest.raises(ValueError):
        E.item_object("i", "user", "x", status="done")
    assert strip_id(E.item_added(user)) == {"type": "conversation.item.added", "previous_item_id": None, "item": user}
    assert strip_id(E.item_done(user, "item_0")) == {
        "type": "conversation.item.done", "previous_item_id": "item_0", "item": user}


def test_streamchat_events():
    """input_text.appended and session.stats carry their figures at top level."""
    assert strip_id(E.input_text_appended("item_1", 5, 120)) == {
        "type": "streamchat.input_text.appended", "item_id": "item_1", "tokens": 5, "context_tokens": 120}
    stats = {"context_tokens": 2052, "total_tokens": 90000, "evicted_tokens": 87948,
             "blocks": {"owned": 100, "shared": 29}, "kv_bytes": 123456, "items": 40}
    assert strip_id(E.session_stats(stats)) == {"type": "streamchat.session.stats", **stats}
    with pytest.raises(ValueError):
        E.session_stats({"context_tokens": 1})


@pytest.mark.parametrize("code", ERROR_CODES)
def test_error_event_for_each_code(code):
    """Every code builds an error event; internal, overloaded, store_ and engine_unavailable, engine_restarting
    and the fleet's session_leased and lease_lost are server_error."""
    server = ("internal", "overloaded", "store_unavailable", "engine_unavailable", "engine_restarting",
              "session_leased", "lease_lost")
    kind = "server_error" if code in server else "invalid_request_error"
    assert strip_id(E.error(code, "msg", "e1")) == {
        "type": "error", "error": {"type": kind, "code": code, "message": "msg", "event_id": "e1"}}
    assert E.error(ErrorCode(code), "msg")["error"]["event_id"] is None


def test_error_event_rejects_unknown_code():
    """Only spec codes go on the wire."""
    with pytest.raises(ValueError):
        E.error("oops", "msg")


def test_response_object_status_details():
    """status_details follows the status: none, reason, or error."""
    usage = E.usage_object(input_tokens=10, output_tokens=3, cached_tokens=8, context_tokens=13,
                           evicted_tokens=0, ttft_ms=12.5, output_tokens_per_s=80.0)
    assert usage == {"total_tokens": 13, "input_tokens": 10, "output_tokens": 3,
                     "input_token_details": {"cached_tokens": 8}, "context_tokens": 13, "evicted_tokens": 0,
                     "timing": {"ttft_ms": 12.5, "output_tokens_per_s": 80.0}}
    item = E.item_object("item_2", "assistant", "ok")
    assert E.response_object("resp_1", "completed", output=[item], usage=usage, max_output_tokens=64) == {
        "id": "resp_1", "object": "realtime.response", "status": "completed", "status_details": None,
        "output": [item], "output_modalities": ["text"], "max_output_tokens": 64, "usage": usage}
    details = {s: E.response_object("r", s)["status_details"] for s in E.RESPONSE_STATUSES}
    assert details == {
        "in_progress": None, "completed": None,
        "cancelled": {"type": "cancelled", "reason": "client_cancelled"},
        "incomplete": {"type": "incomplete", "reason": "max_output_tokens"},
        "failed": {"type": "failed", "error": {"type": "server_error", "code": "internal",
                                               "message": "response failed"}},
    }
    with pytest.raises(ValueError):
        E.response_object("r", "done")


def response_events(text_pieces, status="completed"):
    """The full event list of one response streaming `text_pieces`."""
    opened = E.item_object("item_2", "assistant", None, status="in_progress")
    events = E.response_start_events(E.response_object("resp_1", "in_progress"), opened, "item_1")
    events += [E.output_text_delta("resp_1", "item_2", piece) for piece in text_pieces]
    final = E.item_object("item_2", "assistant", "".join(text_pieces),
                          status="completed" if status == "completed" else "incomplete")
    events += E.response_end_events(E.response_object("resp_1", status, output=[final]), final, "item_1")
    return events


def test_response_event_sequence_order():
    """One response emits exactly the spec's ordered event types."""
    assert [e["type"] for e in response_events(["Hel", "lo", " wörld"])] == [
        "response.created", "response.output_item.added", "conversation.item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "conversation.item.done", "response.done",
    ]
    assert [e["type"] for e in response_events([], "cancelled")][-1] == "response.done"


def test_response_event_fields():
    """Part events carry response_id, item_id, output_index 0, content_index 0; text matches deltas."""
    events = [strip_id(e) for e in response_events(["Hel", "lo"])]
    ids = {"response_id": "resp_1", "item_id": "item_2", "output_index": 0, "content_index": 0}
    assert events[3] == {"type": "response.content_part.added", **ids, "part": {"type": "text", "text": ""}}
    assert events[4] == {"type": "response.output_text.delta", **ids, "delta": "Hel"}
    assert events[6] == {"type": "response.output_text.done", **ids, "text": "Hello"}
    assert events[7] == {"type": "response.content_part.done", **ids, "part": {"type": "text", "text": "Hello"}}
    assert events[1]["item"]["content"] == [] and events[1]["output_index"] == 0
    assert events[2]["previous_item_id"] == "item_1"
    assert events[8]["item"]["content"] == [{"type": "output_text", "text": "Hello"}]
    assert events[10]["response"]["output"] == [events[8]["item"]]
    assert len({e["event_id"] for e in response_events(["a"])}) == 10


def test_encode_is_compact_utf8_json_text():
    """encode gives the exact compact JSON text of the event."""
    event = {"type": "response.output_text.delta", "delta": "é\u2028😀"}
    assert E.encode(event) == '{"type":"response.output_text.delta","delta":"é\u2028😀"}'
    error = E.error("internal", "x", "e1")
    assert isinstance(E.encode(error), str) and orjson.loads(E.encode(error)) == error


def test_server_events_validate_against_the_openai_sdk_models():
    """The GA SDK's own models accept every server event (session truncation aside)."""
    import openai.types.realtime as rt  # a test dependency: missing, the test fails rather than skips
    import pydantic
    adapter = pydantic.TypeAdapter(rt.RealtimeServerEvent)
    session = make_session()
    del session["truncation"]  # streamchat.sink_window is our extension; the SDK parses it unchecked
    usage = E.usage_object(input_tokens=1, output_tokens=1, cached_tokens=0, context_tokens=2,
                           evicted_tokens=0, ttft_ms=None, output_tokens_per_s=None)
    events = [E.session_created(session), E.session_updated(session), E.error("internal", "x"),
              E.item_added(E.item_object("i", "user", "x")), E.item_done(E.item_object("i", "system", "x")),
              E.response_done(E.response_object("r", "failed", usage=usage))]
    events += response_events(["a", "b"]) + response_events(["a"], "incomplete")
    for event in events:
        assert adapter.validate_python(event).type == event["type"]


def test_protocol_modules_import_no_torch():
    """The protocol layer is torch-free (house habit 2), checked in a clean interpreter."""
    code = ("import sys, streamchat.server.protocol, streamchat.server.events; "
            "sys.exit(bool({'torch', 'triton', 'websockets'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
