"""Reading the engine core's output socket on the event loop, without pyzmq's awaitables.

The socket's file descriptor wakes the reader; its readiness is an edge, so
every message waiting is taken before the next wait, with plain non-blocking
receives. pyzmq's awaitable poll and receive cost about a third of the
front's CPU per streamed token: time the core's two step threads lost on a
2-core machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq

LOOK_EVERY_S = 0.1  # `ended` is looked at at least this often


async def read_until_ended(sock, ended: asyncio.Event, on_message: Callable[[list[bytes]], None]) -> None:
    """`on_message(frames)` for each message until `ended` is set and nothing waits, or the socket closes."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    fd = sock.getsockopt(zmq.FD)
    loop.add_reader(fd, wake.set)

    def look() -> None:  # one timer for the reader's life, not one per wait
        nonlocal beat
        wake.set()
        beat = loop.call_later(LOOK_EVERY_S, look)

    beat = loop.call_later(LOOK_EVERY_S, look)
    try:
        while True:
            try:
                taken = take_waiting(sock, on_message)
            except zmq.ZMQError:  # closed: that core is gone
                return
            if taken:
                continue
            if ended.is_set():
                return
            wake.clear()
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # arrived since the last receive
                continue
            await wake.wait()
    finally:
        beat.cancel()
        loop.remove_reader(fd)


def take_waiting(sock, on_message: Callable[[list[bytes]], None]) -> int:
    """Every message waiting, handed on; how many (ZMQError: the socket is closed)."""
    taken = 0
    while True:
        try:
            frames = [zmq.Socket.recv(sock, zmq.NOBLOCK)]  # the plain call, not pyzmq's awaitable one
        except zmq.Again:
            return taken
        while sock.getsockopt(zmq.RCVMORE):  # a message's frames arrive together
            frames.append(zmq.Socket.recv(sock, zmq.NOBLOCK))
        taken += 1
        on_message(frames)
