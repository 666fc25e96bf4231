"""streamchat: a daemon for long conversations with language models over websockets."""

__version__ = "0.1.0"
