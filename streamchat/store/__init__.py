"""Durable store of sessions and transcripts (SQLAlchemy + Alembic, SQLite by default or PostgreSQL),
with the fleet's session leases and daemon registry.

Torch-free: nothing here knows about the model, the engine or the KV cache.
"""

from streamchat.store.async_store import AsyncStore
from streamchat.store.errors import ITEM_ID_IN_USE, LEASE_LOST, STORE_UNAVAILABLE, StoreError
from streamchat.store.leases import Lease, Leases
from streamchat.store.migrate import alembic_config
from streamchat.store.records import (
    DuplicateId,
    ItemNotOpen,
    ItemRecord,
    SessionRecord,
    UnknownItem,
    UnknownSession,
)
from streamchat.store.registry import DaemonState, Registry
from streamchat.store.store import Store
from streamchat.store.tokens import hash_token, new_resume_token, verify_token

__all__ = [
    "ITEM_ID_IN_USE",
    "LEASE_LOST",
    "STORE_UNAVAILABLE",
    "AsyncStore",
    "DaemonState",
    "DuplicateId",
    "ItemNotOpen",
    "ItemRecord",
    "Lease",
    "Leases",
    "Registry",
    "SessionRecord",
    "Store",
    "StoreError",
    "UnknownItem",
    "UnknownSession",
    "alembic_config",
    "hash_token",
    "new_resume_token",
    "verify_token",
]
