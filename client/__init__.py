"""The bundled terminal chat client and live-feed tool. Imports no torch."""

DEFAULT_URL = "ws://127.0.0.1:8765/v1/realtime"
