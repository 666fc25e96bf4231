"""Tests of the fleet's settings: --daemon-id, --lease-s, --heartbeat-s (FleetConfig), their defaults and checks."""

from __future__ import annotations

import argparse
import socket

import pytest

from streamchat import settings
from streamchat.cli import main
from streamchat.config import DAEMON_ID_PATTERN, FleetConfig


def _load(argv: list[str], environ: dict[str, str] | None = None) -> FleetConfig:
    parser = argparse.ArgumentParser()
    settings.add_flags(parser)
    return settings.load(parser.parse_args(argv), environ or {}).fleet


def test_defaults_generate_a_fresh_id() -> None:
    """Unset, the id is this host's name plus six hex digits, new at every load; leases last 15 s, beats every 5 s."""
    first, second = _load([]), _load([])
    host = socket.gethostname()
    assert first.daemon_id != second.daemon_id
    for fleet in (first, second):
        assert DAEMON_ID_PATTERN.fullmatch(fleet.daemon_id)
        prefix, _, suffix = fleet.daemon_id.rpartition("-")
        assert prefix == host[:48] and len(suffix) == 6 and int(suffix, 16) >= 0
        assert (fleet.lease_s, fleet.heartbeat_s) == (15.0, 5.0)


def test_flags_over_environment() -> None:
    """Flags set all three; STREAMCHAT_* variables do where no flag is given."""
    assert _load(["--daemon-id", "d1", "--lease-s", "6", "--heartbeat-s", "3"]) == FleetConfig("d1", 6.0, 3.0)
    environ = {"STREAMCHAT_DAEMON_ID": "pod-0", "STREAMCHAT_LEASE_S": "30", "STREAMCHAT_HEARTBEAT_S": "10"}
    assert _load([], environ) == FleetConfig("pod-0", 30.0, 10.0)
    assert _load(["--daemon-id", "d2"], environ) == FleetConfig("d2", 30.0, 10.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--daemon-id", "a b"], "daemon_id must be 1 to 64 of A-Z a-z 0-9 . _ : -, got 'a b'"),
        (["--daemon-id", "x" * 65], "daemon_id must be 1 to 64 of A-Z a-z 0-9 . _ : -"),
        (["--lease-s", "0"], "lease_s must be a finite number > 0, got 0.0"),
        (["--heartbeat-s", "inf"], "heartbeat_s must be a finite number > 0, got inf"),
        (["--lease-s", "8", "--heartbeat-s", "5"], "heartbeat_s (5.0) must be at most half of lease_s (8.0)"),
    ],
)
def test_bad_values_are_one_clear_line(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    """`streamchat serve` refuses a bad fleet setting before it loads anything, exit 2 and the reason."""
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamchat: error: ") and message in err
