"""What the store hands back and the words it accepts.

Records are frozen snapshots copied out of a database transaction, so no ORM
object (and no lazy load) ever escapes `streamchat.store.store`. The allowed
values of `role`, `kind` and `status` live here, with the errors the store
raises for misuse.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from streamchat.store.models import ItemRow, SessionRow

SESSION_STATUSES = frozenset({"active", "closed"})
ROLES = frozenset({"system", "user", "assistant"})
KINDS = frozenset({"message", "append", "response"})
ITEM_STATUSES = frozenset({"completed", "in_progress", "incomplete", "cancelled", "failed"})
OPEN_STATUS = "in_progress"
FINAL_STATUSES = ITEM_STATUSES - {OPEN_STATUS}


class UnknownSession(KeyError):
    """No session has this id."""

    def __str__(self) -> str:
        return f"unknown session {self.args[0]!r}"


class UnknownItem(KeyError):
    """The session has no item with this id."""

    def __str__(self) -> str:
        return f"session {self.args[0]!r} has no item {self.args[1]!r}"


class ItemNotOpen(ValueError):
    """The item is already finished, so it takes no more text."""


class DuplicateId(ValueError):
    """A session with this id already exists (session ids are the server's own, so this is misuse).

    A client-chosen item id already in use is `StoreError` with code item_id_in_use instead.
    """


@dataclasses.dataclass(frozen=True, slots=True)
class SessionRecord:
    """A session as committed: settings, counters, timestamps (aware UTC), status."""

    id: str
    token_hash: str
    instructions: str
    settings: dict[str, Any]
    total_tokens: int
    evicted_tokens: int
    num_items: int
    created_at: dt.datetime
    last_active_at: dt.datetime
    status: str

    @classmethod
    def from_row(cls, row: SessionRow) -> SessionRecord:
        """Copy a loaded row; call inside the transaction that loaded it."""
        return cls(
            id=row.id,
            token_hash=row.token_hash,
            instructions=row.instructions,
            settings=dict(row.settings),
            total_tokens=row.total_tokens,
            evicted_tokens=row.evicted_tokens,
            num_items=row.num_items,
            created_at=row.created_at,
            last_active_at=row.last_active_at,
            status=row.status,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ItemRecord:
    """A transcript item as committed; `seq` is its 0-based place in the session."""

    session_id: str
    seq: int
    item_id: str
    role: str
    kind: str
    text: str
    num_tokens: int
    status: str
    created_at: dt.datetime
    updated_at: dt.datetime

    @classmethod
    def from_row(cls, row: ItemRow) -> ItemRecord:
        """Copy a loaded row; call inside the transaction that loaded it."""
        return cls(
            session_id=row.session_id,
            seq=row.seq,
            item_id=row.item_id,
            role=row.role,
            kind=row.kind,
            text=row.text,
            num_tokens=row.num_tokens,
            status=row.status,
            created_at=row.created_at,
            updated_at=row.updated_at,
        )


def check_word(name: str, value: str, allowed: frozenset[str]) -> None:
    """Raise ValueError unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {sorted(allowed)}, not {value!r}")


def check_count(name: str, value: int) -> None:
    """Raise ValueError unless `value` is a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, not {value!r}")
