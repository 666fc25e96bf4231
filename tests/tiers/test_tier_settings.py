"""Tests of the tier settings: flags and environment fill TierConfig; bad values are refused by name."""

import argparse

import pytest

from streamchat import settings
from streamchat.config import ConfigError, TierConfig


def load(argv, environ=None):
    p = argparse.ArgumentParser()
    settings.add_flags(p)
    return settings.load(p.parse_args(argv), environ=environ or {}).tiers


def test_flags_and_environment_fill_the_tier_settings():
    """--host-tier-gib, --disk-tier-gib, --data-dir, --checkpoint-idle-s and their STREAMCHAT_ variables."""
    assert load([]) == TierConfig(host_tier_gib=1.0, disk_tier_gib=10.0, data_dir=None, checkpoint_idle_s=60.0)
    t = load(["--host-tier-gib", "0.5", "--data-dir", "/srv/kv"], {"STREAMCHAT_DISK_TIER_GIB": "0",
                                                                    "STREAMCHAT_CHECKPOINT_IDLE_S": "2.5"})
    assert (t.host_tier_gib, t.disk_tier_gib, t.data_dir, t.checkpoint_idle_s) == (0.5, 0.0, "/srv/kv", 2.5)
    assert t.host_bytes == 1 << 29 and t.disk_bytes == 0


@pytest.mark.parametrize("argv,message", [
    (["--host-tier-gib", "-1"], "host_tier_gib must be a finite number >= 0"),
    (["--disk-tier-gib", "nan"], "disk_tier_gib must be a finite number >= 0"),
    (["--checkpoint-idle-s", "inf"], "checkpoint_idle_s must be a finite number >= 0"),
    (["--data-dir", " "], "data_dir must not be empty"),
    (["--host-tier-gib", "lots"], "--host-tier-gib: cannot read 'lots' as float"),
])
def test_bad_tier_settings_are_refused_by_name(argv, message):
    """Negative, NaN or infinite sizes, an empty data dir and non-numbers are ConfigErrors naming the setting."""
    with pytest.raises(ConfigError, match=message):
        load(argv)
