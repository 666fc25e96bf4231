"""Pins the sampling params: new ranges, the model's defaults from generation_config.json, and precedence."""

import json

import pytest

from streamchat.model import sampling_params as sp
from streamchat.model.sampling_params import (DEFAULT_PARAMS, REQUEST_FIELDS, SAMPLING_FIELDS, SamplingParams,
                                              load_model_defaults, resolve_params)
from streamchat.server import protocol



# -- fields and ranges ------------------------------------------------------------------------


def test_old_positional_fields_keep_their_places():
    """The first four fields are still (temperature, top_p, top_k, seed); the new ones follow, off."""
    assert SAMPLING_FIELDS[:4] == ("temperature", "top_p", "top_k", "seed")
    p = SamplingParams(0.7, 0.9, 40, 1)
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.7, 0.9, 40, 1)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.min_p) == (0.0, 0.0, 1.0, 0.0)
    assert not p.penalized and SamplingParams().greedy


def test_penalized_means_any_penalty_set():
    """penalized is true for each penalty away from its neutral value, and only then."""
    assert [SamplingParams(**{k: v}).penalized for k, v in (
        ("frequency_penalty", 0.1), ("presence_penalty", -0.1), ("repetition_penalty", 1.01),
        ("repetition_penalty", 1.0), ("min_p", 0.5), ("temperature", 1.0))] == [True, True, True, False, False, False]


def test_protocol_field_names_are_sampling_fields():
    """Every sampling field the parser reads is a SamplingParams field; sessions take all but the seed and the
    per-request logit_bias and logprobs."""
    assert set(protocol.RESPONSE_SAMPLING_FIELDS) == set(SAMPLING_FIELDS) | set(REQUEST_FIELDS)
    assert set(protocol.SESSION_SAMPLING_FIELDS) == set(SAMPLING_FIELDS) - {"seed"}


def test_default_params_hold_a_conversation():
    """The measured default is valid and samples (it is not greedy)."""
    assert DEFAULT_PARAMS.validate() is DEFAULT_PARAMS and not DEFAULT_PARAMS.greedy


# -- resolve_params -----------------------------------------------------------------------------

MODEL = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1)


def test_response_over_session_over_model():
    """Each field comes from the response if set there, else the session, else the model."""
    session = {"temperature": 0.3, "top_k": 20, "min_p": 0.05}
    response = {"temperature": 1.2, "seed": 5, "frequency_penalty": 0.5}
    assert resolve_params(MODEL, session, response) == SamplingParams(
        temperature=1.2, top_p=0.9, top_k=20, seed=5, frequency_penalty=0.5, repetition_penalty=1.1, min_p=0.05)


def test_none_is_unset_and_empty_is_the_model():
    """A None value falls through to the layer below; nothing set gives the model defaults."""
    assert resolve_params(MODEL, {}, {}) == MODEL
    assert resolve_params(MODEL, {"temperature": None}, {"top_p": None}) == MODEL
    assert resolve_params(MODEL, {"temperature": 0.0}, {"temperature": None}).greedy


def test_resolve_validates_and_names_only_sampling_fields():
    """An out-of-range value is ValueError; a name that is no sampling field is TypeError."""
    with pytest.raises(ValueError, match=r"repetition_penalty must be a number in \(0, 10\]"):
        resolve_params(MODEL, {}, {"repetition_penalty": 0})
    with pytest.raises(ValueError, match="min_p"):
        resolve_params(MODEL, {"min_p": 2.0}, {})
    with pytest.raises(TypeError, match="stop"):
        resolve_params(MODEL, {}, {"stop": ("x",)})


def test_parsed_events_resolve_in_one_call():
    """The parser's sampling() dicts feed resolve_params directly."""
    limits = protocol.Limits()
    update = protocol.parse_client_event(json.dumps(
        {"type": "session.update", "session": {"temperature": 0.4, "presence_penalty": 0.5}}), limits=limits)
    create = protocol.parse_client_event(json.dumps(
        {"type": "response.create", "response": {"temperature": 0.9, "seed": 3, "max_output_tokens": 8}}),
        limits=limits)
    params = resolve_params(MODEL, update.sampling(), create.sampling())
    assert params == SamplingParams(0.9, 0.9, 0, 3, presence_penalty=0.5, repetition_penalty=1.1)


# -- the model's defaults ---------------------------------------------------------------------


def write_config(folder, config):
    (folder / "generation_config.json").write_text(json.dumps(config) if isinstance(config, dict) else config)
    return folder


@pytest.mark.parametrize(("config", "expected"), [
    ({"temperature": 0.6, "top_p": 0.95, "do_sample": True},
     SamplingParams(temperature=0.6, top_p=0.95)),
    ({"top_k": 50, "repetition_penalty": 1.05, "min_p": 0.1},
     SamplingParams(temperature=1.0, top_k=50, repetition_penalty=1.05, min_p=0.1)),
    ({"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.2},
     SamplingParams(temperature=0.0, repetition_penalty=1.2)),
    ({"temperature": 5.0, "top_p": 0.8, "min_p": None},
     SamplingParams(temperature=1.0, top_p=0.8)),
    ({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}, DEFAULT_PARAMS),
    ("{not json", DEFAULT_PARAMS),
    ("[1, 2]", DEFAULT_PARAMS),
])
def test_generation_config_sets_the_model_defaults(tmp_path, config, expected):
    """Keys present win over HF's neutral values; do_sample false is greedy; bad keys or files fall back."""
    assert load_model_defaults(write_config(tmp_path, config)) == expected


def test_no_generation_config_gives_the_measured_defaults(tmp_path):
    """A folder without generation_config.json (the converted GGUF) serves DEFAULT_PARAMS."""
    assert load_model_defaults(tmp_path) == DEFAULT_PARAMS


def test_a_transformers_generation_config_is_read(tmp_path):
    """A file written by transformers' GenerationConfig gives back its sampling values."""
    from transformers import GenerationConfig

    GenerationConfig(do_sample=True, temperature=0.5, top_p=0.85, top_k=30,
                     repetition_penalty=1.15).save_pretrained(tmp_path)
    assert load_model_defaults(tmp_path) == SamplingParams(temperature=0.5, top_p=0.85, top_k=30,
                                                           repetition_penalty=1.15)


def test_repetition_window_is_documented_size():
    """The window the sampler uses is 64 tokens (docs/protocol.md says so)."""
    assert sp.REPETITION_WINDOW == 64
