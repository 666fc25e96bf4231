"""The daemon: model, engine thread, store and websocket server wired together.

Owns start-up (load the model, migrate the store, bind the port), the plain
HTTP answers on the websocket port (/healthz, /metrics, 400, 401, 403, 404,
405, 426, 503; the OpenAI HTTP API under /v1/ is `server.openai_http`), the
ASGI application that routes each request and websocket (served by uvicorn
through `server.front`, adapted by `server.asgi`), saving idle sessions to disk now and then, and shutdown on
SIGTERM/SIGINT: stop accepting, end running responses (stored incomplete),
close sockets with 1001, save every session's KV to disk, flush the store,
exit 0.
"""

from __future__ import annotations

import asyncio
import http
import logging
import signal
import time
from urllib.parse import parse_qs, urlsplit

import orjson
from websockets.datastructures import Headers
from websockets.http11 import Response

from streamchat.config import Config, freeze_startup_heap, omp_wait_defaults
from streamchat.engine.api import EngineError
from streamchat.server import asgi, fleet, front, web
from streamchat.server.origins import host_allowed, is_loopback, self_origins
from streamchat.server.asgi import HttpRequest
from streamchat.server.openai_http import OpenAIHttp
from streamchat.server.protocol import Limits, ProtocolError, url_session_id

log = logging.getLogger(__name__)

REALTIME_PATH = "/v1/realtime"
INSECURE_KEY_PREFIX = "openai-insecure-api-key."
ORIGIN_FREE_PATHS = ("/healthz", "/metrics")  # readable by GET without an Origin check


class Daemon:
    def __init__(self, config: Config, log_level: str = "INFO", log_format: str = "text") -> None:
        self.config = config
        self.log_settings = (log_level, log_format)  # the engine core logs the same way
        self.stopping = asyncio.Event()
        self.connections: set = set()
        self.exit_code = 0
        self.tasks: list[asyncio.Task] = []
        self.started_at = time.time()
        self.openai = OpenAIHttp(self, REALTIME_PATH)  # /v1/ routes other than the websocket
        self.gate = front.Gate()  # connections counted against --max-connections
        self.http_tasks: set[asyncio.Task] = set()  # one per HTTP request of the OpenAI API in progress

    async def start(self) -> None:
        from streamchat.engine.core_client import CoreClient, Supervision
        from streamchat.model.sampling_params import load_model_defaults
        from streamchat.server.metrics import DaemonMetrics
        from streamchat.server.sessions import Hub
        from streamchat.store import AsyncStore, Store

        cfg = self.config
        store = Store(cfg.store.url)
        sched = cfg.scheduler
        self.aengine = CoreClient(cfg, sched.engine_call_timeout_s,
                                  Supervision(max_restarts=sched.max_engine_restarts,
                                              restart_window_s=sched.engine_restart_window_s),
                                  *self.log_settings)
        self.aengine.on_fatal = self._engine_failed
        core = asyncio.ensure_future(self.aengine.start())  # the core loads its model while the store migrates
        try:
            await asyncio.to_thread(store.migrate)
        except BaseException:
            core.cancel()
            await asyncio.gather(core, return_exceptions=True)
            raise
        self.store = AsyncStore(store)
        self.fleet = fleet.Fleet(self.store, cfg.fleet)
        info = await core
        self.model_name = info.model_name
        names = cfg.server.served_model_name
        # what a client may name as `model`; the first is what the session object reports
        self.served_names = tuple(n for n in names if n != "*") or (self.model_name,)
        self.any_model_name = "*" in names
        self.metrics = DaemonMetrics(self.aengine)
        self.hub = Hub(self.aengine, self.store, self.served_names[0], cfg.cache,
                       load_model_defaults(info.model_folder), self.fleet)
        s = cfg.server
        self.limits = Limits(max_text_chars=s.max_text_chars, max_output_tokens=s.max_output_tokens)
        self.server = await front.listen(self, s, self.gate)
        self.port = self.server.sockets[0].getsockname()[1]
        fleet.wire(self)
        await self.fleet.start(f"{s.host}:{self.port}")  # registered, heartbeating; sessions leased as they come
        self._log_ready(info)
        restore = self.hub.restore
        if info.snapshot.tiers["disk"] is not None and cfg.tiers.checkpoint_idle_s:
            self._every(cfg.tiers.checkpoint_idle_s, restore.checkpoint_idle, "checkpointing idle sessions")
        self._every(s.session_idle_release_s, restore.release_idle, "releasing idle sessions")

    def _log_ready(self, info) -> None:
        """One block of what an operator needs: the model as served, the pool, the tiers, where."""
        from sqlalchemy.engine import make_url

        from streamchat.logs import block

        cfg, snap = self.config, info.snapshot
        host, disk = snap.tiers["host"], snap.tiers["disk"]
        fields = {
            "address": f"ws://{cfg.server.host}:{self.port}{REALTIME_PATH}", "model": self.model_name,
            "model_path": info.model_path, "served_model_names": list(self.served_names),
            "any_model_name": self.any_model_name, "engine_pid": info.pid,
            "device": info.device, "dtype": info.dtype, "weights": info.weights,
            "decode_activations": info.activations, "threads": info.threads, "bound_cpus": info.bound_cpus,
            "attention": info.attention,
            "kv_blocks": snap.kv_blocks_total, "kv_block_tokens": cfg.cache.block_size,
            "kv_bytes": snap.kv_blocks_total * snap.kv_bytes_per_block, "kv_dtype": info.kv_dtype,
            "kv_dtype_reason": info.kv_dtype_reason,
            "window": f"{cfg.cache.sink_tokens} sink + {cfg.cache.window_tokens} window tokens",
            "host_tier": f"{host['blocks_total']} blocks" if host else "off",
            "disk_tier": f"{disk['root']} (budget {cfg.tiers.disk_tier_gib:g} GiB)" if disk else "off",
            "data_dir": str(info.data_dir), "store": make_url(cfg.store.url).render_as_string(hide_password=True),
            "sampling": self.hub.session_sampling(), "daemon_id": self.fleet.id,
        }
        f = fields
        names = ", ".join(self.served_names) + (", any name (*)" if self.any_model_name else "")
        sampling = ", ".join(f"{k} {v:g}" for k, v in f["sampling"].items())
        rows = {
            "model": f"{f['model']} from {f['model_path']}; clients may name it: {names}",
            "compute": f"{f['device']}, {f['dtype']}, {f['weights']} weights ({f['decode_activations']} decode "
                       f"activations), {f['attention']} attention, {f['threads']} threads"
                       f"{' bound to CPUs ' + ','.join(map(str, f['bound_cpus'])) if f['bound_cpus'] else ''} "
                       f"(engine core pid {f['engine_pid']})",
            "kv pool": f"{f['kv_blocks']} blocks of {f['kv_block_tokens']} tokens, "
                       f"{f['kv_bytes'] / 2**20:.1f} MiB ({f['kv_dtype']} kv dtype: {f['kv_dtype_reason']}); "
                       f"{f['window']}",
            "tiers": f"host {f['host_tier']}, disk {f['disk_tier']}",
            "data": f"store {f['store']}, saved sessions in {f['data_dir']}",
            "sampling": f"{sampling} (when a request and its session set none)",
            "fleet": f"daemon {self.fleet.id}; session leases of {cfg.fleet.lease_s:g} s, renewed every "
                     f"{cfg.fleet.heartbeat_s:g} s",
        }
        log.info(block(f"streamchat ready on {f['address']}", rows), extra=fields)

    def _every(self, idle_s: float, job, what: str) -> None:
        """Run `job(idle_s)` every few seconds until the daemon stops (a task it owns)."""
        async def loop() -> None:
            while not self.stopping.is_set():
                try:
                    await asyncio.wait_for(self.stopping.wait(), timeout=min(idle_s, 5.0))
                    return
                except TimeoutError:
                    pass
                try:
                    await job(idle_s)
                except EngineError as exc:  # the core restarting (or gone): the next round tries again
                    log.info("%s skipped: %s", what, exc)
                except Exception:
                    log.exception("%s failed", what)
        self.tasks.append(asyncio.create_task(loop()))

    def _engine_failed(self, reason: str) -> None:
        """The engine cannot go on: /healthz says 503, and the daemon saves what it can and exits 1."""
        log.critical("stopping the daemon: %s; a supervisor should restart it, and clients resume", reason)
        self.exit_code = 1
        self.stopping.set()

    # -- HTTP -------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        """The ASGI application: a websocket handshake, the OpenAI API, or one of the plain answers."""
        request = asgi.request_of(scope)
        s = self.config.server
        if scope["type"] == "websocket":
            if (await receive())["type"] != "websocket.connect":  # ASGI's first event of a handshake
                return
            refused = self.process_request(request)
            if refused is not None:
                return await asgi.deny(send, refused)
            subprotocols = scope.get("subprotocols", [])
            await send({"type": "websocket.accept", "subprotocol": "realtime" if "realtime" in subprotocols else None})
            return await self.handle(asgi.AsgiWebSocket(scope, receive, send, s.send_timeout_s))
        if self.openai.claims(request.path):
            return await asgi.serve_http(self.openai, scope, receive, send, s.send_timeout_s, s.body_timeout_s,
                                         self.http_tasks)
        response = self.process_request(request)
        if response is None:  # the websocket's path, asked without an upgrade
            response = _plain(http.HTTPStatus.UPGRADE_REQUIRED, f"{REALTIME_PATH} is a websocket: open it with a "
                              "websocket client (Connection: Upgrade, Upgrade: websocket)\n",
                              {"Upgrade": "websocket"})
        await asgi.answer(scope, send, response, s.send_timeout_s, close=request.content_length is not None)

    def over_capacity(self) -> bool:
        """Past --max-connections (each caller's own connection counted), or shutting down."""
        return self.stopping.is_set() or self.gate.count > self.config.server.max_connections

    def process_request(self, request: HttpRequest) -> Response | None:
        """The answer to a request outside the OpenAI API, or None to accept a websocket handshake."""
        url = urlsplit(request.target)
        duplicate = asgi.duplicate_header(request.headers)
        if duplicate is not None:
            return _plain(http.HTTPStatus.BAD_REQUEST, f"the {duplicate} header appears more than once\n")
        if request.method != "GET":
            return _plain(http.HTTPStatus.METHOD_NOT_ALLOWED, "only GET is served\n", {"Allow": "GET"})
        refused = self._refuse_foreign(request.headers, url.path, request.port)
        if refused is not None:
            return refused
        page = web.respond(url.path, request.headers)
        if page is not None:
            return page
        if url.path == "/healthz":
            health = self.health()
            ok = health["status"] != "failed"
            return _json(http.HTTPStatus.OK if ok else http.HTTPStatus.SERVICE_UNAVAILABLE, health)
        if url.path == "/metrics":
            if not (self.config.server.metrics_public or self._authorized(request.headers)):
                return _unauthorized()
            return _plain(http.HTTPStatus.OK, self.metrics.render().decode(),
                          {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
        if url.path != REALTIME_PATH:
            return _plain(http.HTTPStatus.NOT_FOUND, "not found\n")
        if not self._authorized(request.headers):
            return _unauthorized()
        try:
            url_session_id(url.query, self.limits)  # a proxy routes on it; the resume event must agree
        except ProtocolError as exc:
            return _plain(http.HTTPStatus.BAD_REQUEST, exc.message + "\n")
        model = parse_qs(url.query).get("model", [None])[0]
        if model is not None and not self.serves_model(model):
            served = ", ".join(repr(n) for n in self.served_names)
            return _plain(http.HTTPStatus.BAD_REQUEST, f"this daemon serves the model {served}, not {model!r}; "
                          "the operator may add names with --served-model-name\n")
        if self.over_capacity():
            return _plain(http.HTTPStatus.SERVICE_UNAVAILABLE, "overloaded: too many connections; retry later\n",
                          {"Retry-After": "1"})
        return None

    def served_models(self) -> list[str]:
        """The model names `/v1/models` lists (--served-model-name, else the model's own)."""
        return list(self.served_names)

    def serves_model(self, name: str) -> bool:
        """Whether a client may ask for `name` (the Realtime `model` query, the HTTP API's `model`)."""
        return self.any_model_name or name in self.served_names

    def _refuse_foreign(self, headers: Headers, path: str, port: int) -> Response | None:
        """403 for a request a web page on another site could have made.

        Host: while bound to loopback, and on any address once --allowed-hosts
        is given, only loopback names or --allowed-hosts, so a page whose DNS
        name was rebound to the daemon's address gets nothing.
        Origin: a websocket handshake is not subject to CORS, so any page could
        open one; only no Origin (not a browser), the daemon's own pages or
        --allowed-origins pass. /healthz and /metrics skip the Origin check: a
        cross-origin page can send the GET but cannot read the answer.
        """
        s = self.config.server
        hosts = headers.get_all("Host")
        if (is_loopback(s.host) or s.allowed_hosts) and not (len(hosts) == 1 and host_allowed(hosts[0], s.allowed_hosts)):
            log.info("refused a request for Host %s", hosts)
            return _plain(http.HTTPStatus.FORBIDDEN, f"Host {', '.join(hosts)!r} is not allowed; to allow it, "
                          "start the daemon with --allowed-hosts NAME\n")
        origins = headers.get_all("Origin")
        if not origins or path in ORIGIN_FREE_PATHS:
            return None
        allowed = s.allowed_origins or self_origins(s.host, port)
        if len(origins) == 1 and (origins[0] in allowed or "*" in allowed):
            return None
        log.info("refused a request from Origin %s", origins)
        return _plain(http.HTTPStatus.FORBIDDEN, f"Origin {', '.join(origins)!r} is not allowed; to allow it, "
                      f"start the daemon with --allowed-origins {origins[0]}\n")

    def _authorized(self, headers: Headers) -> bool:
        import hmac

        key = self.config.server.api_key
        if not key:
            return True
        auth = headers.get("Authorization", "")
        offered = auth[7:] if auth.startswith("Bearer ") else ""
        for proto in headers.get_all("Sec-WebSocket-Protocol"):
            for item in proto.split(","):
                if item.strip().startswith(INSECURE_KEY_PREFIX):
                    offered = offered or item.strip()[len(INSECURE_KEY_PREFIX):]
        return hmac.compare_digest(offered.encode(), key.encode())

    def health(self) -> dict:
        """Read from the engine's published snapshot: never from live engine state."""
        snap = self.aengine.snapshot
        fatal = self.aengine.fatal
        status = ("failed" if fatal else "stopping" if self.stopping.is_set()
                  else "restarting" if self.aengine.restarting else "ok")
        tiers = snap.tiers
        info = self.aengine.info
        return {"status": status, **({"reason": fatal} if fatal else {}), **fleet.health(self.fleet),
                "model": self.model_name,
                "kv_dtype": {"dtype": info.kv_dtype, "why": info.kv_dtype_reason},
                "engine": {"pid": info.pid, "starts": self.aengine.epoch},
                "kv_blocks": {"free": snap.kv_blocks_free + snap.kv_blocks_cached, "total": snap.kv_blocks_total,
                              "held": snap.kv_blocks_held, "block_size": self.config.cache.block_size},
                "kv_bytes_per_token": snap.kv_bytes_per_token,
                "tiers": {"host": _pick(tiers["host"], "blocks_used", "blocks_total"),
                          "disk": _pick(tiers["disk"], "files", "bytes", "budget_bytes")},
                "sessions": len(self.hub.sessions), "sessions_in_engine": snap.sessions,
                "queued_tokens": snap.queued_tokens, "failed_steps": snap.failed_steps,
                "running": snap.sessions_running, "connections": len(self.connections),
                "connections_counted": self.gate.count}

    # -- websocket ----------------------------------------------------------------

    async def handle(self, websocket) -> None:
        from streamchat.server.connection import Connection

        conn = Connection(self.hub, websocket, self.limits, self.config.server, self.metrics)
        self.connections.add(conn)
        self.metrics.connections = len(self.connections)
        peer = websocket.remote_address
        log.info("connection from %s", peer[0] if peer else "?")
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)
            self.metrics.connections = len(self.connections)
            log.info("connection from %s closed (%s)", peer[0] if peer else "?", websocket.close_code)

    async def shutdown(self) -> None:
        """Within --shutdown-timeout-s: stop accepting, end responses (stored incomplete), close
        with 1001, save every session's KV to disk, stop the engine; then flush the store.

        Whatever is still running at the deadline is left: transcripts are already durable, so a
        session not saved to disk is rebuilt from its transcript on resume.
        """
        timeout = self.config.server.shutdown_timeout_s
        deadline = time.monotonic() + timeout
        self.stopping.set()
        try:
            async with asyncio.timeout(timeout * 0.9):
                await self._close_connections()
                for task in self.tasks:
                    task.cancel()
                await asyncio.gather(*self.tasks, return_exceptions=True)
                if self.aengine.fatal is None and not self.aengine.restarting:
                    try:
                        await self.hub.restore.persist_all(max(0.5, deadline - time.monotonic() - 1.5))
                    except Exception:
                        log.exception("saving sessions to disk failed; they will be rebuilt from their transcripts")
                await self.fleet.stop()  # leases end once the files are saved: another daemon may take over now
                await self.aengine.stop(max(0.1, deadline - time.monotonic() - 1.0))
        except TimeoutError:
            log.warning("shutdown passed its %g s deadline; leaving what still runs", timeout)
            # A core that never answered (hung, or stopped by a signal) must not outlive the deadline:
            # the interpreter's exit joins its child processes, so a live core would hold the exit.
            await self.aengine.stop(0.1)
        if not self.fleet.stopped:
            await asyncio.wait([asyncio.ensure_future(self.fleet.stop())], timeout=max(0.5, deadline - time.monotonic()))
        await self.aengine.aclose()
        try:
            await asyncio.wait_for(self.store.aclose(), max(0.5, deadline - time.monotonic()))
        except TimeoutError:
            log.warning("the store did not close in time; its committed writes are safe")

    async def _close_connections(self) -> None:
        self.server.close()
        for task in list(self.http_tasks):
            task.cancel()  # its request's `finally` runs: the completion's session is closed
        if self.http_tasks:
            await asyncio.wait(list(self.http_tasks), timeout=5.0)
        for conn in list(self.connections):
            await conn.cancel_quietly()
        for conn in list(self.connections):
            await asyncio.gather(*list(conn.tasks), return_exceptions=True)
            await conn.ws.close(1001, "server shutting down")
        front.close_all(self.gate, grace_s=1.0)


async def _serve(config: Config, log_level: str, log_format: str) -> int:
    daemon = Daemon(config, log_level, log_format)
    try:
        await daemon.start()
    except BaseException:
        if getattr(daemon, "aengine", None) is not None:
            await daemon.aengine.stop(1.0)
            await daemon.aengine.aclose()
        raise
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.stopping.set)
    freeze_startup_heap()
    print(f"streamchat: listening on ws://{config.server.host}:{daemon.port}{REALTIME_PATH}", flush=True)
    await daemon.stopping.wait()
    log.info("shutting down")
    await daemon.shutdown()
    return daemon.exit_code


def run(config: Config, log_level: str = "INFO", log_format: str = "text") -> int:
    # torch's OpenMP workers (in the engine core, which inherits this environment) spin while
    # they wait; on a few cores that starves the front: passive waiting after a short spin.
    omp_wait_defaults()
    return asyncio.run(_serve(config, log_level, log_format))


def _plain(status: http.HTTPStatus, text: str, headers: dict | None = None) -> Response:
    return asgi.plain(status.value, text, headers)


def _unauthorized() -> Response:
    return _plain(http.HTTPStatus.UNAUTHORIZED, "missing or wrong API key\n", {"WWW-Authenticate": "Bearer"})


def _json(status: http.HTTPStatus, doc: dict) -> Response:
    body = orjson.dumps(doc)
    h = Headers({"Content-Type": "application/json", "Content-Length": str(len(body))})
    return Response(status.value, status.phrase, h, body)


def _pick(figures: dict | None, *keys: str) -> dict | None:
    return {k: figures[k] for k in keys} if figures is not None else None
