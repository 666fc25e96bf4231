"""The engine core: its own process, the step loop on its main thread, two I/O threads beside it.

Owns the core process's life: building the engine (model, pool, tiers),
reading commands and writing outputs off the step loop, answering each
command once (between steps, or later for a file being read), one
`StepOutput` per loop iteration carrying every response's new tokens, a
heartbeat while idle, and the end (a `stop`, a fatal error, or the front
dying: the core never outlives it). The front (`engine.core_client`)
starts and supervises it.

    input thread:  zmq PULL -> decode -> inbox ─┐
    reader thread (disk tier): file read -> ───┤ (a wake-up)
    main thread:   inbox -> engine.handle / engine.step -> outbox
    output thread: outbox -> encode -> zmq PUSH (a heartbeat when idle)
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import time

from streamchat.engine import wire

log = logging.getLogger(__name__)

_STOP, _WAKE = object(), object()
SNAPSHOT_EVERY_S = 0.2  # the published figures are at most this old while the core works
BEAT_EVERY_S = 0.5  # an idle core says it is alive this often


def main(config, addresses: tuple[str, str], parent_pid: int, log_level: str, log_format: str) -> None:
    """The core process's entry point (spawned by the front's CoreClient)."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the front, which stops us in order
    from streamchat import logs

    logs.setup(log_level, log_format, fields={"daemon_id": config.fleet.daemon_id})
    core = EngineCore(config, addresses)
    sys.exit(core.run())


def _die_with_parent(parent_pid: int) -> None:
    """The kernel kills this process when the front dies, however it dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the front died before the line above
        os._exit(1)


class EngineCore:
    def __init__(self, config, addresses: tuple[str, str], engine=None) -> None:
        """`addresses`: (commands in, outputs out). `engine`: an engine already built (tests)."""
        import zmq

        self.config = config
        self.engine = engine
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)  # the default; the outputs socket sets its own (finite) linger
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.samples: list[tuple[str, float]] = []
        self._replies: list[wire.Reply] = []
        self._snapshot_at = 0.0
        self._closing = threading.Event()
        self._threads = [threading.Thread(target=self._read_commands, args=(addresses[0],), daemon=True,
                                          name="streamchat-core-input"),
                         threading.Thread(target=self._write_outputs, args=(addresses[1],), daemon=True,
                                          name="streamchat-core-output")]
        for t in self._threads:
            t.start()

    def run(self) -> int:
        """Build the engine (unless given), say ready, serve until stopped; the exit code."""
        try:
            if self.engine is None:
                from streamchat.config import freeze_startup_heap

                self.engine = build_engine(self.config)
                freeze_startup_heap()
            self.bound_cpus = self._bind_threads()
            self.outbox.put([wire.READY, wire.encode(core_info(self.engine, self.config, self.bound_cpus))])
        except BaseException as exc:  # noqa: BLE001 - the front must hear why, then we exit
            from streamchat.config import ConfigError
            from streamchat.errors import user_message

            known = user_message(exc) or (str(exc) if isinstance(exc, ConfigError) else None)
            if known is None:
                log.exception("the engine core could not start")
            return self._fatal(known or f"{type(exc).__name__}: {exc}", 2, "config" if known else "error")
        eng = self.engine
        eng.placer.notify = lambda: self.inbox.put(_WAKE)
        eng.metrics.observers.append(lambda kind, value: self.samples.append((kind, value)))
        try:
            code = self._loop()
        except BaseException as exc:  # noqa: BLE001 - a bug outside any one step
            log.exception("the engine core failed")
            return self._fatal(f"engine core failed: {exc!r}", 3)
        self._close()
        return code

    def _bind_threads(self) -> list[int]:
        """The step's threads one to a CPU (kernels/cpu.py `bind_threads`) where this core owns its process
        (it runs on the main thread: not a core in a thread of a test), last: every thread of ours has
        started (a thread this one started from now on would inherit its CPU)."""
        if (not self.config.model.bind_threads or self.engine.runner.model.device.type != "cpu"
                or threading.current_thread() is not threading.main_thread()):
            return []
        import torch

        from streamchat.kernels.cpu import bind_threads

        return bind_threads(torch.get_num_threads())

    def _loop(self) -> int:
        eng = self.engine
        limit = self.config.scheduler.max_failed_steps
        while True:
            if not self._drain(block=not eng.has_work()):
                return 0
            eng.placer.take_loads()
            if self._replies and eng.has_work():  # answers do not wait for the step
                self.outbox.put([wire.OUT, wire.StepOutput(replies=self._replies)])
                self._replies = []
            out = wire.StepOutput(replies=self._replies)
            self._replies = []
            out.add(eng.step() if eng.has_work() else self._command_events())
            if eng.failed_steps >= limit:
                self._send(out)
                return self._fatal(f"{eng.failed_steps} engine steps failed in a row", 3)
            self._send(out)

    def _command_events(self) -> list:
        events, self.engine.command_events = self.engine.command_events, []
        return events

    def _drain(self, block: bool) -> bool:
        """Run every queued command (waiting for one when there is nothing to step); False: stop."""
        try:
            item = self.inbox.get(timeout=BEAT_EVERY_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                return False
            if item is not _WAKE:
                self._run(*item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _run(self, req_id: int, deadline: float, cmd) -> None:
        from streamchat.engine.api import EngineError
        from streamchat.engine.saving import Later

        if time.monotonic() > deadline:
            self._replies.append(wire.reply(req_id, error=(
                "engine_unavailable", "the engine did not take this request in time; retry")))
            return
        try:
            result = self.engine.handle(cmd)
        except EngineError as exc:
            self._replies.append(wire.reply(req_id, error=(exc.code, str(exc))))
            return
        except Exception as exc:  # noqa: BLE001 - one bad request must not end the core
            log.exception("engine command %s failed", type(cmd).__name__)
            self._replies.append(wire.reply(req_id, error=("internal", f"the engine failed on "
                                                                       f"{type(cmd).__name__}: {exc!r}")))
            return
        if isinstance(result, Later):  # answered once its file is read and landed
            result.on_done = lambda later: self._answer(req_id, type(cmd), later.value)
        else:
            self._answer(req_id, type(cmd), result)

    def _answer(self, req_id: int, cmd_type: type, value) -> None:
        try:
            self._replies.append(wire.reply(req_id, value))
        except TypeError as exc:  # a result that cannot cross: a defect, answered as one
            log.error("the result of %s cannot be sent: %s", cmd_type.__name__, exc)
            self._replies.append(wire.reply(req_id, error=("internal", f"{cmd_type.__name__}: {exc}")))

    def _send(self, out: wire.StepOutput) -> None:
        from streamchat.engine.figures import take_snapshot

        now = time.monotonic()
        if now - self._snapshot_at >= SNAPSHOT_EVERY_S or not self.engine.has_work():
            out.snapshot = take_snapshot(self.engine)
            self._snapshot_at = now
        out.samples, self.samples = self.samples, []
        if out:
            self.outbox.put([wire.OUT, out])

    def _fatal(self, reason: str, code: int, kind: str = "error") -> int:
        if kind != "config":
            log.critical("the engine core cannot go on: %s", reason)
        self.outbox.put(wire.fatal(kind, reason))
        self._close()
        return code

    def _close(self) -> None:
        """Send what is queued, then end: the disk tier's writes are finished first."""
        pager = self.engine.pager if self.engine is not None else None
        if pager is not None:
            pager.close()
        self._closing.set()
        self.outbox.put(_STOP)
        for t in self._threads:
            t.join(timeout=10)
        self.ctx.term()

    # -- the I/O threads ------------------------------------------------------------------

    def _read_commands(self, address: str) -> None:
        import zmq

        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        while not self._closing.is_set():
            if not sock.poll(200):
                continue
            frames = sock.recv_multipart()
            if frames[0] == wire.STOP:
                self.inbox.put(_STOP)
                break
            try:
                self.inbox.put(wire.decode_call(frames[1]))
            except (ValueError, IndexError) as exc:
                log.error("dropped a message from the front: %s", exc)
        sock.close()

    def _write_outputs(self, address: str) -> None:
        import zmq

        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(address)
        while True:
            try:
                item = self.outbox.get(timeout=BEAT_EVERY_S)
            except queue.Empty:
                sock.send_multipart([wire.BEAT])
                continue
            if item is _STOP:
                sock.close()
                return
            kind, body = item
            sock.send_multipart([kind, body if isinstance(body, bytes) else wire.encode(body)])


def build_engine(config):
    """The model, its pool and the engine the daemon runs, from the config."""
    from streamchat.autotune import measure_weights, resolve_kv_dtype
    from streamchat.engine.engine import Engine
    from streamchat.model.runner import ModelRunner, load_model
    from streamchat.tiers.disk import default_data_dir

    loaded = load_model(config.model, measure=measure_weights, use_card=True)
    cache, kv_reason = resolve_kv_dtype(loaded, config.cache, config.model.cache_dir)
    log.info("kv dtype %s: %s", cache.kv_dtype, kv_reason)
    runner = ModelRunner(loaded, cache, config.scheduler.max_running, config.model.cuda_graphs, kv_reason)
    data_dir = config.tiers.data_dir or default_data_dir(config.store.url)
    return Engine(runner, cache, config.scheduler, tiers=config.tiers, data_dir=data_dir, sync_io=False)


def core_info(engine, config, bound_cpus: list[int]) -> wire.CoreInfo:
    import torch

    from streamchat.engine.figures import take_snapshot
    from streamchat.text.tokenizer import export_tokenizer

    loaded, model = engine.runner.loaded, engine.runner.model
    pager = engine.pager
    data_dir = str(pager.disk.root) if pager is not None and pager.disk is not None else None
    return wire.CoreInfo(
        pid=os.getpid(), model_name=loaded.source.name, model_path=str(loaded.source.gguf or loaded.source.folder),
        model_folder=str(loaded.source.folder), tokenizer_json=export_tokenizer(loaded.tokenizer),
        frames=engine.chat.frames, device=str(model.device), dtype=str(model.dtype).removeprefix("torch."),
        weights=loaded.weights, activations=config.model.decode_activations, threads=torch.get_num_threads(),
        bound_cpus=bound_cpus, attention=model.backend.name, kv_dtype=engine.runner.kv_dtype,
        kv_dtype_reason=engine.runner.kv_dtype_reason, data_dir=data_dir,
        snapshot=take_snapshot(engine))
