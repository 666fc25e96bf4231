"""A model's fingerprint from the bytes of its weights, each file hashed once and its digest cached.

Owns the name that every prefix-block hash and every saved KV file's layout
carry for the weights (`ModelSource.fingerprint`): blake2b over config.json
and, file by file in name order, each `*.safetensors` file's name and the
blake2b digest of its bytes. Two folders of the same shape with other
weights (a fine-tune) get other fingerprints, so neither takes the other's KV.

Hashing reads every byte of the weights, so a file's digest is cached in
`<cache>/` (0700), one entry per resolved path, valid while the file's size,
mtime_ns, inode and ctime_ns are what they were (a copy that keeps size and
mtime, `cp -p` or `rsync -t`, still has a new inode and ctime). A cached
digest is believed only if the entry and its folder are this user's and no
one else may write them (`private_files`): anyone who could edit it could
make one model pass for another. Knows nothing about loading weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from streamchat import private_files

log = logging.getLogger(__name__)

DIGEST_BYTES = 32  # per file
FINGERPRINT_BYTES = 16  # the model's: 32 hex digits


def fingerprint(folder: Path, cache: Path) -> str:
    """The fingerprint of the model in `folder` (config.json and *.safetensors), digests cached in `cache`."""
    h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
    h.update(b"config.json\0" + (folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        h.update(f"\0{path.name}\0".encode() + file_digest(path, cache))
    return h.hexdigest()


def file_digest(path: Path, cache: Path) -> bytes:
    """blake2b of the file's bytes: from the cache when the file is unchanged, else hashed and cached."""
    key = _key(path)
    entry = cache / (hashlib.blake2b(key["path"].encode(), digest_size=16).hexdigest() + ".json")
    cached = _cached(entry, key)
    if cached is not None:
        return cached
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=DIGEST_BYTES)).digest()
    try:
        private_files.private_dir(cache)
        why = private_files.distrust_dir(cache)
        if why is None:
            private_files.write_private(entry, json.dumps({**key, "blake2b": digest.hex()}).encode())
        else:
            log.warning("not caching the digest of %s: %s; it is hashed again at every start", path.name, why)
    except OSError as exc:
        log.warning("could not cache the digest of %s in %s: %s", path.name, cache, exc.strerror)
    return digest


def _key(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino,
            "ctime_ns": st.st_ctime_ns}


def _cached(entry: Path, key: dict) -> bytes | None:
    """The digest the entry holds for exactly this file, if the entry can be believed."""
    try:
        why = private_files.distrust(entry)
        if why is not None:
            log.warning("ignoring the cached weights digest %s: %s", entry, why)
            return None
        doc = json.loads(entry.read_bytes())
        if not isinstance(doc, dict) or any(doc.get(k) != v for k, v in key.items()):
            return None
        digest = bytes.fromhex(doc["blake2b"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):  # unreadable or not ours: hash again
        return None
    return digest if len(digest) == DIGEST_BYTES else None
