"""Resume tokens: minting, hashing, constant-time checking.

The store keeps only `hash_token(token)`; the token itself goes to the client
once and is never written anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

TOKEN_BYTES = 24  # 192 bits of entropy, above the 128-bit floor


def new_resume_token() -> str:
    """A fresh URL-safe resume token with 192 bits of entropy."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def hash_token(token: str) -> str:
    """The hex sha256 of `token`, which is what the store keeps."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def verify_token(token: str, token_hash: str) -> bool:
    """Whether `token` hashes to `token_hash`, compared in constant time."""
    return hmac.compare_digest(hash_token(token).encode("ascii"), token_hash.encode("ascii", "replace"))
