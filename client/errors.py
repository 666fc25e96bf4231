"""Errors the client reports to a person, each worded so that they can act on it.

Every failure the chat and feed commands expect ends up as a `ClientError`
whose message is printed as is; nothing here knows about terminals.
"""

from __future__ import annotations

START_HINT = "Start it with `make serve` (in the source tree) or `streamchat serve`."
KEY_HINT = "pass --api-key KEY or set STREAMCHAT_API_KEY"


class ClientError(Exception):
    """A failure with a message meant for the person at the keyboard."""


class DaemonNotRunning(ClientError):
    """Nothing listens at the daemon's address."""

    def __init__(self, url: str) -> None:
        super().__init__(
            f"cannot connect to {url}: connection refused. "
            f"Is the streamchat daemon running? {START_HINT}"
        )


class AuthFailed(ClientError):
    """The handshake was refused with HTTP 401."""

    def __init__(self, url: str, key_given: bool) -> None:
        what = "rejected the API key" if key_given else "requires an API key"
        super().__init__(f"the daemon at {url} {what} (HTTP 401): {KEY_HINT} to the daemon's key.")


class SessionNotFound(ClientError):
    """The daemon knows no session with this id and resume token."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        super().__init__(
            f"session {session_id} was not found: the daemon does not know it, "
            "or its resume token is wrong (it may never have received a message)."
        )


class Overloaded(ClientError):
    """The daemon had no capacity, even after retrying with backoff."""

    def __init__(self, attempts: int = 1, waited_s: float = 0.0) -> None:
        self.attempts = attempts
        super().__init__(
            f"the daemon is overloaded: no capacity after {attempts} attempts "
            f"over {waited_s:.1f} s. Try again later."
        )


class ConnectionLost(ClientError):
    """The websocket closed while the client expected more."""

    def __init__(self, url: str, detail: str = "") -> None:
        super().__init__(f"lost the connection to {url}" + (f" ({detail})" if detail else ""))


class ServerError(ClientError):
    """An `error` event, as the daemon worded it."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(f"the daemon answered {code}" + (f": {message}" if message else ""))


def from_error_event(error: dict, session_id: str = "") -> ClientError:
    """The exception for the `error` object of an `error` server event."""
    code = str(error.get("code") or error.get("type") or "error")
    if code == "session_not_found":
        return SessionNotFound(session_id or "?")
    if code in ("overloaded", "session_leased"):  # session_leased: another daemon's lease runs out soon
        return Overloaded()
    return ServerError(code, str(error.get("message") or ""))
