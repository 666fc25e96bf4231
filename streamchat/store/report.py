"""The fleet as an operator reads it: `streamchat fleet`'s table, and its JSON for machines.

Pure functions of `registry.DaemonState` lists (and, for ages, the time the
report is made); no database, no I/O.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence

from streamchat.store.registry import DaemonState

HEADER = ("DAEMON", "STATE", "ADDRESS", "HEARTBEAT", "STARTED", "SESSIONS")
MAX_LISTED = 3  # session ids shown per daemon in the table; --json lists them all


def fleet_json(states: Sequence[DaemonState]) -> str:
    """One JSON array, a daemon an object, times in ISO 8601."""
    return json.dumps([state.to_json() for state in states], indent=2)


def fleet_table(states: Sequence[DaemonState], now: dt.datetime) -> str:
    """A header, a row per daemon in aligned columns, then a summary line."""
    rows = [HEADER] + [_row(state, now) for state in states]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER) - 1)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip() for row in rows]
    return "\n".join([*lines, _summary(states)])


def _row(state: DaemonState, now: dt.datetime) -> tuple[str, ...]:
    heartbeat = "-" if state.heartbeat_at is None else f"{_age(now - state.heartbeat_at)} ago"
    started = "-" if state.started_at is None else state.started_at.strftime("%Y-%m-%d %H:%M:%SZ")
    return state.id, state.state, state.address or "-", heartbeat, started, _sessions(state.sessions)


def _sessions(sessions: Sequence[str]) -> str:
    if not sessions:
        return "0"
    listed = ", ".join(sessions[:MAX_LISTED])
    more = f", +{len(sessions) - MAX_LISTED} more" if len(sessions) > MAX_LISTED else ""
    return f"{len(sessions)}  {listed}{more}"


def _age(delta: dt.timedelta) -> str:
    """A short age: 4.2s, 17m, 3h, 2d (a clock behind the database's reads as 0s)."""
    seconds = max(delta.total_seconds(), 0.0)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h"
    return f"{int(seconds // 86400)}d"


def _summary(states: Sequence[DaemonState]) -> str:
    counts: dict[str, int] = {}
    for state in states:
        counts[state.state] = counts.get(state.state, 0) + 1
    by_state = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
    num_sessions = sum(len(state.sessions) for state in states)
    return f"{len(states)} daemons ({by_state or 'none'}); {num_sessions} sessions leased"
