"""The daemon's log: plain text for a terminal, or one JSON object per line for log collectors.

Owns the root handler's format and which libraries may speak at INFO. A
record's structured fields ride in `extra=` (the per-response line, the
start-up block): the text format shows only the message, the JSON format
adds every such field as a key of its own. Torch-free.
"""

from __future__ import annotations

import datetime
import logging
import sys

import orjson

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries whose INFO lines an operator does not need (their warnings still show).
# (alembic's are quieted while it migrates: streamchat.store.migrate)
QUIET_LOGGERS = ("websockets.server",)
# The attributes every LogRecord has; anything else on a record came in `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the record's
    `extra=` fields, and `exception` (the formatted traceback) when it carries one."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        doc.update((k, v) for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_"))
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


class _Fields(logging.Filter):
    """Adds the same fields to every record the handler sees (a record's own `extra=` wins)."""

    def __init__(self, fields: dict) -> None:
        super().__init__()
        self.fields = fields

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in self.fields.items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


def setup(level: str = "INFO", fmt: str = "text", stream=None, fields: dict | None = None) -> None:
    """Configure the root logger once for the process (replacing any handler it had).

    `fields` ride on every record (the daemon's id in a fleet): keys of each JSON line.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}; got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    if fields:
        handler.addFilter(_Fields(dict(fields)))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))


def block(title: str, rows: dict[str, str]) -> str:
    """A title and aligned `name  value` rows: the start-up summary as text."""
    width = max(map(len, rows), default=0)
    return "\n".join([title] + [f"  {name:<{width}}  {value}" for name, value in rows.items()])
