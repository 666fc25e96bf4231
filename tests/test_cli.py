"""Tests for the command line and settings: bad input gets one clear line, never a traceback."""

import dataclasses
import json
import os

import pytest

from streamchat import settings
from streamchat.cli import main
from streamchat.config import ConfigError


def run(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["generate", ""], "the prompt is empty"),
    (["generate", "hi", "--model", "/no/such/model"], "model path does not exist: /no/such/model"),
    (["generate", "hi", "--window-tokens", "-3"], "window_tokens must be a positive integer, got -3"),
    (["generate", "hi", "--sink-tokens", "0"], "sink_tokens must be a positive integer, got 0"),
    (["generate", "hi", "--window-tokens", "16"], "window_tokens (16) must hold at least two blocks"),
    (["generate", "hi", "--block-size", "12"], "block_size must be a power of two"),
    (["generate", "hi", "--dtype", "float8"], "dtype must be one of auto, float32, bfloat16, float16"),
    (["generate", "hi", "--weights", "int3"], "weights must be one of auto, bf16, int8, int4; got 'int3'"),
    (["generate", "hi", "--device", "cuda", "--weights", "int4"], "--weights int4 runs on CPU only"),
    (["generate", "hi", "--num-blocks", "abc"], "--num-blocks: cannot read 'abc' as int"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens must be positive"),
    (["generate", "hi", "--temperature", "5"], "temperature must be a number in [0, 2]"),
    (["generate", "hi", "--repetition-penalty", "0"], "repetition_penalty must be a number in (0, 10]"),
    (["generate", "hi", "--frequency-penalty", "nan"], "frequency_penalty must be a number in [-2, 2]"),
    (["generate", "hi", "--min-p", "1.5"], "min_p must be a number in [0, 1]"),
    (["generate", "hi", "--num-blocks", "8"], "KV pool has only 7"),
    (["serve", "--min-prefill-share", "-1"], "min_prefill_share must be in [0, 10], got -1.0"),
    (["serve", "--port", "70000"], "port must be 0..65535"),
    (["serve", "--served-model-name", "a", "--served-model-name", "a"], "served_model_name names one model twice"),
    (["serve", "--config", "/no/file.toml"], "cannot read config file /no/file.toml"),
])
def test_bad_input_is_one_clear_line(argv, message, capsys):
    """Each bad flag or value exits non-zero with the reason, no traceback."""
    code, err = run(argv, capsys)
    assert code in (1, 2)
    assert message in err and "Traceback" not in err


def test_non_llama_checkpoint_is_refused(tmp_path, capsys):
    """A folder holding another architecture names what it holds and what is supported."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    code, err = run(["generate", "hi", "--model", str(tmp_path)], capsys)
    assert code == 2 and "holds a 'gpt2' model; supported: deepseek_v2, deepseek_v3, llama, mistral, qwen2" in err


def test_a_file_that_is_not_gguf_is_refused(tmp_path, capsys):
    """--model pointing at some other file says what it expects."""
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    code, err = run(["generate", "hi", "--model", str(f)], capsys)
    assert code == 1 and "is a file but not a .gguf" in err


def test_unknown_flag_is_argparse_error(capsys):
    """An unknown flag is refused by the parser with exit code 2."""
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--no-such-flag"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_precedence_flag_over_env_over_toml(tmp_path):
    """Flags win over STREAMCHAT_* variables, which win over the TOML file."""
    toml = tmp_path / "s.toml"
    toml.write_text('[server]\nport = 1111\nhost = "0.0.0.0"\n[cache]\nwindow_tokens = 512\n')
    import argparse

    p = argparse.ArgumentParser()
    settings.add_flags(p)
    args = p.parse_args(["--config", str(toml), "--port", "3333"])
    cfg = settings.load(args, {"STREAMCHAT_PORT": "2222", "STREAMCHAT_WINDOW_TOKENS": "1024"})
    assert (cfg.server.port, cfg.server.host, cfg.cache.window_tokens) == (3333, "0.0.0.0", 1024)
    args = p.parse_args(["--config", str(toml)])
    assert settings.load(args, {"STREAMCHAT_PORT": "2222"}).server.port == 2222
    assert settings.load(args, {}).server.port == 1111
    cfg = settings.load(p.parse_args([]), {"STREAMCHAT_ALLOWED_ORIGINS": "http://a, http://b"})
    assert cfg.server.allowed_origins == ("http://a", "http://b")


def test_weights_setting_and_eval_list():
    """--weights / STREAMCHAT_WEIGHTS set ModelConfig.weights; `eval --weights` is its own repeatable list."""
    import argparse

    from streamchat.cli import build_parser
    from streamchat.evaluate import check_args

    p = argparse.ArgumentParser()
    settings.add_flags(p, ("model",))
    assert settings.load(p.parse_args(["--weights", "int4"]), {}).model.weights == "int4"
    assert settings.load(p.parse_args([]), {"STREAMCHAT_WEIGHTS": "int8"}).model.weights == "int8"
    args = build_parser().parse_args(["eval", "--weights", "int4", "--weights", "int8,bf16,int4"])
    assert check_args(args)[2] == ["int4", "int8", "bf16"]
    assert check_args(build_parser().parse_args(["eval"]), "auto")[2] == ["auto"]


def test_bad_toml_is_a_config_error(tmp_path):
    """Invalid TOML and unknown sections are refused by name."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        settings.load(None, {"STREAMCHAT_CONFIG": str(bad)})
    bad.write_text("[servr]\nport = 1\n")
    with pytest.raises(ConfigError, match="unknown sections"):
        settings.load(None, {"STREAMCHAT_CONFIG": str(bad)})


def test_generate_prints_a_reply(capsys):
    """`streamchat generate` prints the model's reply on stdout (greedy here, so it is always the same)."""
    assert main(["generate", "What is the capital of France?", "--max-tokens", "12", "--dtype", "float32",
                 "--temperature", "0"]) == 0
    assert "Paris" in capsys.readouterr().out


class FakeLLM:
    """Stands in for streamchat.llm.LLM: serves `default_params` and records what generate asks of it."""

    calls = []

    def __init__(self, config):
        from streamchat.model.sampling_params import SamplingParams

        self.default_params = SamplingParams(temperature=0.3, top_p=0.8, repetition_penalty=1.05)

    def chat(self, prompts, max_tokens, system, params):
        from types import SimpleNamespace

        FakeLLM.calls.append((prompts, max_tokens, system, params))
        return [SimpleNamespace(text="the reply")]


def test_generate_hands_every_sampling_flag_to_the_model(capsys, monkeypatch):
    """Each sampling flag reaches the reply's SamplingParams with its value, and an unset one keeps the
    model's default (the sampler itself is tested in tests/model; the real model prints in the test above)."""
    import streamchat.llm
    from streamchat.model.sampling_params import SamplingParams

    monkeypatch.setattr(streamchat.llm, "LLM", FakeLLM)
    monkeypatch.setattr(FakeLLM, "calls", [])
    base = ["generate", "Hi?", "--max-tokens", "7", "--system", "Be brief."]
    flags = {"--temperature": ("temperature", 1.7), "--top-p": ("top_p", 0.5), "--top-k": ("top_k", 40),
             "--min-p": ("min_p", 0.05), "--seed": ("seed", 11), "--frequency-penalty": ("frequency_penalty", 0.2),
             "--presence-penalty": ("presence_penalty", -0.4), "--repetition-penalty": ("repetition_penalty", 1.3)}
    model_defaults = FakeLLM(None).default_params
    for flag, (name, value) in flags.items():
        assert main([*base, flag, str(value)]) == 0
        assert capsys.readouterr().out == "the reply\n"
        prompts, max_tokens, system, params = FakeLLM.calls.pop()
        assert (prompts, max_tokens, system) == (["Hi?"], 7, "Be brief.")
        assert params == dataclasses.replace(model_defaults, **{name: value}), flag
    argv = [*base] + [str(x) for flag, (_, value) in flags.items() for x in (flag, value)]
    assert main(argv) == 0
    assert FakeLLM.calls.pop()[3] == SamplingParams(**{name: value for name, value in flags.values()})
    assert main(base) == 0 and FakeLLM.calls.pop()[3] == model_defaults


def test_served_model_name_is_repeatable_and_comma_separated():
    """--served-model-name a --served-model-name b,c gives three names; the variable takes a list;
    other list flags repeat the same way."""
    import argparse

    p = argparse.ArgumentParser()
    settings.add_flags(p, ("server",))
    args = p.parse_args(["--served-model-name", "a", "--served-model-name", "b,c", "--allowed-hosts", "x",
                         "--allowed-hosts", "y"])
    cfg = settings.load(args, {})
    assert cfg.server.served_model_name == ("a", "b", "c") and cfg.server.allowed_hosts == ("x", "y")
    assert settings.load(p.parse_args([]), {}).server.served_model_name == ()
    env = {"STREAMCHAT_SERVED_MODEL_NAME": "gpt-realtime,*"}
    assert settings.load(p.parse_args([]), env).server.served_model_name == ("gpt-realtime", "*")
    from streamchat.config import ServerConfig

    with pytest.raises(ConfigError, match="served_model_name: ' a' is not a model name"):
        ServerConfig(served_model_name=(" a",)).validate()


def test_serve_log_flags_are_checked(capsys):
    """--log-format takes text or json, --log-level a level name; anything else is an argparse error."""
    from streamchat.cli import build_parser

    args = build_parser().parse_args(["serve", "--log-format", "json", "--log-level", "debug"])
    assert (args.log_format, args.log_level) == ("json", "DEBUG")
    for argv in (["serve", "--log-format", "xml"], ["serve", "--log-level", "chatty"]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 2
    assert "invalid choice: 'xml'" in capsys.readouterr().err


def test_omp_wait_defaults_spin_briefly_then_sleep_and_leave_set_values(monkeypatch):
    """Before torch starts, the daemon asks libgomp for passive waiting after a bounded spin; a value
    the user's environment already sets is kept."""
    from streamchat.config import OMP_WAIT, omp_wait_defaults

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    omp_wait_defaults()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and OMP_WAIT["GOMP_SPINCOUNT"] == "30000"
    assert os.environ["GOMP_SPINCOUNT"] == "0"


def test_freeze_startup_heap_keeps_what_lives_now_out_of_the_collectors_passes():
    import gc

    from streamchat.config import freeze_startup_heap

    before = gc.get_freeze_count()
    alive = [[i] for i in range(1000)]  # 1,000 tracked objects made before the freeze
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= before + len(alive)
        assert gc.get_count()[0] < 100  # and the youngest generation starts over
    finally:
        gc.unfreeze()
