"""The written-file fixture the kvfile tests share."""

import pytest
from tierkit import layout, snapshot

from streamchat.tiers import kvfile


@pytest.fixture
def written(tmp_path):
    """(layout, path) of a valid file of snapshot(layout())."""
    lay = layout()
    path = tmp_path / "s.safetensors"
    kvfile.write_atomic(path, snapshot(lay), lay)
    return lay, path
