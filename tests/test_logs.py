"""Tests for the daemon's log formats: JSON lines carry the record's fields; alembic stays quiet."""

import io
import json
import logging

import pytest

from streamchat import logs


@pytest.fixture
def restore_root():
    """logs.setup replaces the root handler: put back pytest's afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_lines_carry_the_message_and_extra_fields(restore_root):
    """--log-format json: one object per line with time, level, logger, message, each extra field, and
    the traceback of an exception."""
    out = io.StringIO()
    logs.setup("INFO", "json", stream=out)
    log = logging.getLogger("streamchat.test")
    log.info("response %s done", "resp_1", extra={"session_id": "sess_1", "output_tokens": 7, "ttft_ms": 12.5})
    log.debug("not shown at INFO")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second = [json.loads(line) for line in out.getvalue().splitlines()]
    assert {k: first[k] for k in ("level", "logger", "message", "session_id", "output_tokens", "ttft_ms")} == {
        "level": "INFO", "logger": "streamchat.test", "message": "response resp_1 done",
        "session_id": "sess_1", "output_tokens": 7, "ttft_ms": 12.5}
    assert first["time"].endswith("+00:00") and "exception" not in first
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]


def test_text_format_and_a_bad_format(restore_root):
    """--log-format text is one human line per record; an unknown format is refused."""
    out = io.StringIO()
    logs.setup("WARNING", "text", stream=out)
    logging.getLogger("streamchat.test").warning("hello %d", 3, extra={"session_id": "s"})
    logging.getLogger("streamchat.test").info("quiet")
    assert out.getvalue().endswith(" WARNING streamchat.test: hello 3\n") and out.getvalue().count("\n") == 1
    with pytest.raises(ValueError, match="log format must be one of text, json"):
        logs.setup("INFO", "xml")


def test_migrating_a_store_logs_no_alembic_lines(tmp_path, caplog):
    """A fresh store migrates without alembic's INFO lines (plugins, impl, revisions), in a new process
    too (importing alembic logs)."""
    import subprocess
    import sys

    from streamchat.store import Store

    caplog.set_level(logging.INFO)
    Store(f"sqlite:///{tmp_path / 'a.db'}").migrate()
    assert not [r for r in caplog.records if r.name.startswith("alembic")]
    code = ("import logging, sys; logging.basicConfig(level='INFO', stream=sys.stdout)\n"
            "from streamchat.store import Store\n"
            f"Store('sqlite:///{tmp_path / 'b.db'}').migrate(); print('migrated')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["migrated"] and "alembic" not in done.stderr
    assert logging.getLogger("alembic").level == logging.NOTSET  # restored after migrating


def test_block_aligns_rows():
    """The start-up block: a title, then `name  value` rows aligned on the longest name."""
    assert logs.block("ready", {"model": "m", "kv pool": "3 blocks"}) == "ready\n  model    m\n  kv pool  3 blocks"

