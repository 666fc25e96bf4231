"""Sessions across an engine core restart, against a fake core client: each command reaches a core that
holds its session, and a failed rebuild loses no session."""

import asyncio
from types import SimpleNamespace

import pytest

from streamchat.engine import api
from streamchat.engine.api import EngineError
from streamchat.model.sampling_params import SamplingParams
from streamchat.server.sessions import Hub, LiveSession


class RestartingEngine:
    """A CoreClient stand-in whose core has died and not yet been started again (epoch 1)."""

    def __init__(self) -> None:
        self.epoch = 1
        self.restarting = True
        self.sent: list[tuple[int, api.Command]] = []  # (the epoch of the core it reached, the command)
        self.tokenizer = SimpleNamespace(chat=SimpleNamespace(system_prefix=lambda instructions: [1, 2]))
        self.snapshot = SimpleNamespace(tiers={"disk": None})
        self.refuse: set[type] = set()

    async def wait_ready(self, timeout_s=None) -> None:
        if self.restarting:  # the next core starts
            await asyncio.sleep(0)
            self.epoch += 1
            self.restarting = False

    async def submit(self, cmd, timeout_s=None):
        await self.wait_ready()
        if type(cmd) in self.refuse:
            raise EngineError("engine_restarting", "refused")
        self.sent.append((self.epoch, cmd))


def hub_with(engine) -> tuple[Hub, LiveSession]:
    hub = Hub(engine, store=None, model_name="m", cache_cfg=None, model_defaults=SamplingParams(), fleet=None)
    s = LiveSession("sess_a", "hash", epoch=1)  # open in the core that died
    hub.sessions[s.id] = s
    return hub, s


def test_a_call_made_while_the_core_restarts_reopens_the_session_first():
    """The epoch has not advanced yet when the call comes: the command still waits for the next core and
    finds its session there (it went straight to the new core, which answered session_not_found)."""
    engine = RestartingEngine()
    hub, s = hub_with(engine)
    asyncio.run(hub.call(s, api.CheckRoom(s.id, 5)))
    assert [(epoch, type(cmd).__name__) for epoch, cmd in engine.sent] == [
        (2, "CloseSession"), (2, "OpenSession"), (2, "CheckRoom")]
    assert s.epoch == 2


def test_a_failed_rebuild_keeps_the_session_and_reopens_it_on_its_next_call():
    """A rebuild the engine refuses leaves the session held (a connection may hold it) and marked as in
    no core, so its next call builds it again before the command."""
    engine = RestartingEngine()
    engine.restarting = False
    hub, s = hub_with(engine)
    engine.refuse = {api.CloseSession}
    asyncio.run(hub.restore.rebuild(s))
    assert hub.sessions == {s.id: s} and s.epoch == 0
    engine.refuse = set()
    asyncio.run(hub.call(s, api.CheckRoom(s.id, 5)))
    assert [type(cmd).__name__ for _, cmd in engine.sent] == ["CloseSession", "OpenSession", "CheckRoom"]
    assert s.epoch == 1


@pytest.mark.parametrize("code, rebuilt", [("engine_restarting", False), ("overloaded", True)])
def test_a_command_failed_by_the_cores_death_is_not_rebuilt_into_the_next_core(code, rebuilt):
    """The core that failed it is gone, and the session comes back from the store on its next call: a
    rebuild would only wait on the restart a second time (past the client's deadline)."""
    engine = RestartingEngine()
    engine.restarting = False
    hub, s = hub_with(engine)
    rebuilds = []

    async def rebuild(session):
        rebuilds.append(session.id)

    async def submit(cmd, timeout_s=None):
        raise EngineError(code, "failed")

    hub.restore.rebuild, hub.submit = rebuild, submit
    with pytest.raises(EngineError):
        asyncio.run(hub.call(s, api.Queue(s.id, (1,), "item", False, False, None), rebuild_on_failure=True))
    assert rebuilds == ([s.id] if rebuilt else [])
