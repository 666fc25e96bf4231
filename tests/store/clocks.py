"""A clock the tests move by hand, shared by every store of a test (one fleet, one time)."""

from __future__ import annotations

import datetime as dt

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


class ManualClock:
    """Returns the same aware UTC time until `advance` moves it."""

    def __init__(self, start: dt.datetime = T0) -> None:
        self.now = start

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


def at(seconds: float) -> dt.datetime:
    """T0 plus `seconds`."""
    return T0 + dt.timedelta(seconds=seconds)
