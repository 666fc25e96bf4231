"""The model card: an engine core's config and tokenizer without transformers, exactly as transformers reads them."""

import json
import os
import subprocess
import sys

import pytest
from kernel_build import require_kernels  # tests/ is on sys.path (its conftest.py)

from streamchat.model import card
from streamchat.text.chat import ChatFormat, Frames
from streamchat.text.tokenizer import export_tokenizer

TEXTS = ["Hello there", "Sure — 你好 🙂 <|im_end|> ok", "  spaces\nand\ttabs  "]


@pytest.fixture(scope="module")
def written(bundled_fp32, tmp_path_factory):
    hf_config, hf_tok = bundled_fp32.hf_config, bundled_fp32.tokenizer
    path = tmp_path_factory.mktemp("cards") / "cards" / "c.json"
    card.write(path, hf_config, export_tokenizer(hf_tok), Frames.from_template(hf_tok), hf_tok.eos_token_id)
    return path


def test_a_card_reads_back_what_transformers_read(bundled_fp32, written):
    hf_config, hf_tok = bundled_fp32.hf_config, bundled_fp32.tokenizer
    assert oct(written.stat().st_mode & 0o777) == "0o600"
    config, tok = card.read(written)
    assert config.to_dict() == json.loads(json.dumps(hf_config.to_dict()))  # JSON's keys are strings
    for name in ("model_type", "hidden_size", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings",
                 "eos_token_id", "vocab_size"):
        assert getattr(config, name) == getattr(hf_config, name), name
    assert tok.eos_token_id == hf_tok.eos_token_id and tok.chat.frames == Frames.from_template(hf_tok)
    core = ChatFormat.of(hf_tok)
    for text in TEXTS:
        assert tok(text)["input_ids"] == core.encode(text)
        assert tok.chat.message("user", text) == core.message("user", text)


def test_a_bad_or_foreign_card_is_not_used(written, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_bytes(written.read_bytes()[:1000])
    bad.chmod(0o600)
    assert card.read(bad) is None
    shared = tmp_path / "shared.json"
    shared.write_bytes(written.read_bytes())
    shared.chmod(0o666)  # anyone could have written it
    assert card.read(shared) is None
    assert card.read(tmp_path / "none.json") is None


def test_the_card_key_follows_config_and_template_not_weights(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("config.json", "tokenizer_config.json", "model.safetensors"):
        (folder / name).write_text("{}")
    key = card.card_path(tmp_path, folder, "fp")
    os.utime(folder / "model.safetensors", ns=(1, 1))  # the fingerprint covers the weights
    assert card.card_path(tmp_path, folder, "fp") == key
    assert card.card_path(tmp_path, folder, "fp2") != key
    (folder / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    assert card.card_path(tmp_path, folder, "fp") != key


def test_rope_other_than_plain_writes_no_card(bundled_fp32, tmp_path):
    class Yarn:
        def to_dict(self):
            return {"model_type": "deepseek_v2", "rope_scaling": {"type": "yarn", "factor": 4.0}}

    hf_tok = bundled_fp32.tokenizer
    path = tmp_path / "c.json"
    card.write(path, Yarn(), export_tokenizer(hf_tok), Frames.from_template(hf_tok), 0)
    assert not path.exists()


def test_a_second_core_start_reads_the_card_and_compares_no_blocks(monkeypatch, tmp_path):
    """A core's first load writes the card, compares the GGUF's blocks with the converted weights and marks
    the card; the next load in the same format skips the comparison (another format would not), and a
    core process started with the card never imports transformers."""
    from streamchat.config import ModelConfig
    from streamchat.kernels import cpu
    from streamchat.model import runner

    require_kernels()  # a skip only without a C compiler; a failed build fails here with its message
    calls = []
    real = cpu.Groups.decodes_to
    monkeypatch.setattr(cpu.Groups, "decodes_to", lambda self, w: calls.append(1) or real(self, w))
    # A cache folder of its own (the converted model linked in): no other test's core start, in this
    # process or in another test worker, marks the blocks checked between the two loads. float32: one
    # dtype on every machine (auto is bfloat16 where the CPU has it; its loads compare the blocks too).
    folder, fingerprint = _bundled_folder_and_fingerprint()
    (tmp_path / folder.name).symlink_to(folder, target_is_directory=True)
    cfg = ModelConfig(num_threads=1, dtype="float32", cache_dir=str(tmp_path))
    path = card.card_path(tmp_path, folder, fingerprint)
    counts = []
    for _ in range(2):
        calls.clear()
        runner.load_model(cfg, use_card=True)
        counts.append(len(calls))
    assert counts[0] > 0 and counts[1] == 0, counts
    assert card.blocks_checked(path, "bf16") and not card.blocks_checked(path, "int8")
    code = ("import sys; from streamchat.config import ModelConfig; from streamchat.model import runner; "
            f"lm = runner.load_model(ModelConfig(num_threads=1, dtype='float32', cache_dir={str(tmp_path)!r}), "
            "use_card=True); "
            "print(type(lm.tokenizer).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["CardTokenizer", "False"], out.stdout


def _bundled_folder_and_fingerprint():
    from streamchat.model.loader import resolve

    source = resolve(None)
    return source.folder, source.fingerprint
