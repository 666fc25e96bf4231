"""The front's face of the engine core when its core is gone: commands are refused at once, never stuck."""

import asyncio
import time

import pytest
import zmq

from streamchat.engine import api
from streamchat.engine.api import EngineError
from streamchat.engine.core_client import CoreClient
from streamchat.engine.supervisor import SEND_WAIT_S


def client_whose_core_died() -> tuple[CoreClient, zmq.Socket]:
    """A CoreClient serving (ready) on sockets whose core connected, took a command, and died."""
    c = CoreClient(config=None, call_timeout_s=30.0)
    cmd, out = c.ctx.socket(zmq.PUSH), c.ctx.socket(zmq.PULL)
    cmd.bind(f"ipc://{c._dir}/cmd")
    out.bind(f"ipc://{c._dir}/out")
    c._socks = (cmd, out)
    c._ready.set()
    peer = zmq.Context.instance().socket(zmq.PULL)
    peer.connect(f"ipc://{c._dir}/cmd")
    return c, peer


async def core_dies(c: CoreClient, peer: zmq.Socket) -> None:
    """The core process ends (kill -9): nothing reads its commands, and zmq has noticed."""
    peer.close(linger=0)
    deadline = time.monotonic() + 5
    while c._socks[0].getsockopt(zmq.EVENTS) & zmq.POLLOUT:
        assert time.monotonic() < deadline, "zmq did not notice the peer's end"
        await asyncio.sleep(0.01)


async def _submit_after_death():
    c, peer = client_whose_core_died()
    try:
        await c.send([b"hello"])
        assert peer.recv() == b"hello"  # a live core takes commands at once
        await core_dies(c, peer)
        t0 = time.monotonic()
        with pytest.raises(EngineError) as err:
            await c.submit(api.GetStats("sess_x"))
        return err.value.code, time.monotonic() - t0, dict(c._calls)
    finally:
        await c.aclose()


def test_a_command_to_a_dead_core_is_refused_not_stuck():
    """Before the front has seen the core die, a command is refused engine_restarting within SEND_WAIT_S
    (its socket would hold the send until the restart closed it, which raised CancelledError)."""
    code, took, calls = asyncio.run(asyncio.wait_for(_submit_after_death(), 10))
    assert code == "engine_restarting"
    assert SEND_WAIT_S <= took < SEND_WAIT_S + 2
    assert calls == {}


async def _submit_while_restarting():
    c, peer = client_whose_core_died()
    try:
        await core_dies(c, peer)
        task = asyncio.create_task(c.submit(api.GetStats("sess_x")))
        await asyncio.sleep(0.1)
        c._close_sockets()  # the restart replaces the sockets while the command waits to be sent
        return await asyncio.wait_for(task, 5)
    finally:
        await c.aclose()


def test_a_command_waiting_when_the_sockets_are_replaced_fails_engine_restarting():
    """Not a CancelledError: that one ended whole connections and the daemon's periodic jobs."""
    with pytest.raises(EngineError) as err:
        asyncio.run(_submit_while_restarting())
    assert err.value.code == "engine_restarting"


def test_a_stream_closed_before_its_response_finished_leaves_no_detokenizer():
    """A StartResponse the core refuses (overloaded, ...) is closed by its caller and never finishes."""
    from streamchat.engine.outputs import OutputProcessor

    async def go():
        c = CoreClient(config=None)
        c.outputs = OutputProcessor(tokenizer=None)
        try:
            c.open_stream("resp_1", "sess_x")
            held = "resp_1" in c.outputs
            c.close_stream("resp_1")
            return held, "resp_1" in c.outputs, c._streams
        finally:
            await c.aclose()

    assert asyncio.run(go()) == (True, False, {})


def test_a_disowned_core_is_not_joined_at_the_interpreters_exit():
    """launch.disown: multiprocessing's exit handler joins every child it still knows; a killed core
    whose memory the kernel is slow to free must not hold the daemon's exit, so it is forgotten."""
    import multiprocessing
    import signal

    from streamchat.engine import launch

    proc = multiprocessing.get_context("fork").Process(target=signal.pause, daemon=True)
    proc.start()
    try:
        assert proc in multiprocessing.active_children()
        launch.disown(proc)
        assert proc not in multiprocessing.active_children()
        assert launch.running(proc)  # forgotten by the exit handler, not ended
    finally:
        proc.kill()
        proc.join(5)
    assert not launch.running(proc)
