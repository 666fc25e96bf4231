"""Which exceptions carry a message for a person, not a traceback. Torch-free."""

from __future__ import annotations


def user_message(exc: BaseException) -> str | None:
    """The one-line message for a known failure, or None for a bug."""
    from streamchat.model.loader import ModelLoadError

    if isinstance(exc, ModelLoadError):
        return str(exc)
    if type(exc).__name__ in ("EngineError", "NoFreeBlocks"):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return None
