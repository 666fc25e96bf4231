"""`streamchat serve` flags shown taking effect in a running daemon, each by what it changes.

Three daemons, each started once for the module and each flag checked by its own effect:

- `stored`: int8 KV, h2o eviction, the torch attention backend, a pool sized by --kv-memory-gib,
  --pin-system-prompt false, --log-level DEBUG, --cache-dir, a non-loopback --host and
  --max-append-item-chars; its last test stops it with SIGTERM under load within
  --shutdown-timeout-s and resumes a session from disk in a second start.
- `limited`: --max-running 1 with a short --queue-timeout-s (overloaded), a short
  --engine-call-timeout-s (engine_unavailable), int4 KV on the cpu attention backend, and a
  --shutdown-timeout-s that bounds a SIGTERM even when the engine core is frozen.
- `tuned`: one thread, int8 weights with int8 decode activations, fp8 KV, 32-token blocks, 40 sink
  tokens, and an engine restart window short enough to let two core deaths pass.

Both pass --kv-dtype explicitly: auto measures the storages for minutes at a model's first start.
"""

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import time
import urllib.request

import orjson
import pytest
from conftest import Client, Daemon

pytestmark = pytest.mark.slow

WINDOW = 64  # tokens: four blocks of 16, so a couple of short turns evict
STORED_BLOCKS_GIB = 0.05
STORED_SHUTDOWN_S = 8.0
LIMITED_QUEUE_S, LIMITED_CALL_S, LIMITED_SHUTDOWN_S = 2.0, 2.0, 3.0
# A system prompt far longer than sink block + window: pinned, it would all stay in the context.
LONG_INSTRUCTIONS = ("You are a careful assistant. You answer in full sentences, you never use lists, "
                     "and you always check your arithmetic twice before you answer. ") * 4
# Greedy, the bundled model counts on until max_output_tokens with every KV dtype (a story or counting
# in words ends after 13 to 30 tokens with int4).
LONG_REPLY = "Write the numbers from 1 to 500, one per line."
NO_END = {"0": -100, "2": -100}  # logit_bias: <|endoftext|> and <|im_end|> never sampled


def stored_args(cache_dir):
    return ["--kv-dtype", "int8", "--eviction", "h2o", "--h2o-recent-tokens", "32",
            "--window-tokens", str(WINDOW), "--attention-backend", "torch", "--device", "cpu",
            "--num-blocks", "0", "--kv-memory-gib", str(STORED_BLOCKS_GIB), "--pin-system-prompt", "false",
            "--log-level", "DEBUG", "--log-format", "json", "--cache-dir", str(cache_dir), "--host", "0.0.0.0",
            "--max-append-item-chars", "300", "--checkpoint-idle-s", "0", "--prefix-sharing", "false",
            "--shutdown-timeout-s", str(STORED_SHUTDOWN_S)]


def user_item(text):
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}


def get(d, path, headers=None, host="127.0.0.1"):
    req = urllib.request.Request(f"http://{host}:{d.port}{path}", headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read()


def health(d) -> dict:
    return orjson.loads(get(d, "/healthz")[1])


def metric(d, name) -> float | None:
    text = get(d, "/metrics")[1].decode()
    m = re.search("^" + re.escape(name) + r" (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


async def turn(c, text, max_tokens=12):
    """An item and a greedy reply; the reply's text."""
    await c.send(user_item(text))
    await c.until("conversation.item.done")
    await c.send({"type": "response.create", "response": {"max_output_tokens": max_tokens, "temperature": 0}})
    done = (await c.until("response.done"))[-1]["response"]
    assert done["status"] in ("completed", "incomplete"), done
    return done["output"][0]["content"][0]["text"]


async def stats(c):
    await c.send({"type": "streamchat.session.stats"})
    return (await c.until("streamchat.session.stats"))[-1]


def log_records(d):
    """The JSON records logged so far (after the daemon stopped: all of them)."""
    return [json.loads(line) for line in d.log if line.startswith("{")]


def drain_log(d):
    """Read the rest of a stopped daemon's output into d.log."""
    d.log += d.proc.stdout.read().splitlines(keepends=True)


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    """A --cache-dir holding the bundled model's converted folder (a link to the default cache's: a
    conversion would cost the test ~20 s) and nothing else."""
    from streamchat.model import loader

    source = loader.resolve(None)  # converts into the default cache once if no test has yet
    folder = tmp_path_factory.mktemp("models")
    (folder / source.folder.name).symlink_to(source.folder, target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def stored(tmp_path_factory, model_cache):
    d = Daemon(tmp_path_factory.mktemp("stored") / "s.db", *stored_args(model_cache)).start()
    yield d
    d.stop()


def test_pool_flags_show_in_healthz_and_the_ready_record(stored):
    """--kv-dtype int8: 68 bytes per token per KV head for K and V; --kv-memory-gib 0.05: the pool
    holds what fits (one block is the null block); --attention-backend torch and --host 0.0.0.0 in
    the ready record; --log-level DEBUG: debug records from the front and from the engine core."""
    import torch

    from streamchat.config import CacheConfig
    from streamchat.kernels import quant
    from streamchat.model.runner import num_blocks_for

    h = health(stored)
    per_token = quant.bytes_per_token("int8", torch.float32, 30, 3, 64)  # int8's bytes: any model dtype
    assert per_token == 2 * 30 * 3 * 68 == h["kv_bytes_per_token"]
    assert h["kv_dtype"] == {"dtype": "int8", "why": "as configured (--kv-dtype int8)"}
    fits = num_blocks_for(CacheConfig(kv_dtype="int8", kv_memory_gib=STORED_BLOCKS_GIB), per_token, torch.device("cpu"))
    assert fits == int(STORED_BLOCKS_GIB * (1 << 30)) // (per_token * 16)
    assert h["kv_blocks"]["total"] == fits - 1
    [ready] = [r for r in log_records(stored) if r["message"].startswith("streamchat ready on")]
    assert ready["attention"] == "torch" and ready["kv_dtype"] == "int8" and ready["device"] == "cpu"
    assert ready["address"] == f"ws://0.0.0.0:{stored.port}/v1/realtime"
    cpus = sorted(os.sched_getaffinity(0))  # the daemon's too: it inherits them
    one_per_cpu = ready["threads"] == len(cpus) >= 2 and shutil.which(os.environ.get("CC", "cc"))
    assert ready["bound_cpus"] == (cpus if one_per_cpu else []), (ready["threads"], cpus)  # --bind-threads
    assert ready["kv_bytes"] == (fits - 1) * per_token * 16
    debug = [r for r in log_records(stored) if r["level"] == "DEBUG"]
    assert any(r["logger"] == "streamchat.model.runner" and "torch attention" in r["message"] for r in debug)
    assert any(r["logger"].startswith("streamchat.store") for r in debug), debug


def test_cache_dir_is_where_the_model_is_found(stored, model_cache):
    """--cache-dir: the daemon took the converted model from it (no conversion) and cached the
    weights' digest there; without the flag nothing would be written to that folder."""
    entries = list((model_cache / "fingerprints").glob("*.json"))
    assert entries, sorted(p.name for p in model_cache.iterdir())
    [folder] = [p for p in model_cache.iterdir() if p.is_symlink()]
    assert [json.loads(p.read_text())["path"] for p in entries] == [str((folder / "model.safetensors").resolve())]
    assert not [r for r in log_records(stored) if r["message"].startswith("converting")]


def non_loopback_address() -> str | None:
    """This machine's address on its default route (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def test_non_loopback_host_serves_other_addresses_and_host_names(stored):
    """--host 0.0.0.0: any Host header is served (on loopback a foreign name gets 403, see
    test_security), and so is the machine's non-loopback address where it has one."""
    status, body = get(stored, "/healthz", {"Host": f"chat.example:{stored.port}"})
    assert status == 200 and orjson.loads(body)["status"] == "ok"
    address = non_loopback_address()
    if address is not None:
        status, body = get(stored, "/healthz", host=address)
        assert status == 200 and orjson.loads(body)["kv_dtype"]["dtype"] == "int8"


def test_h2o_evicts_an_unpinned_system_prompt(stored):
    """--pin-system-prompt false and --eviction h2o: a system prompt longer than sink block + window
    is evicted like any block (pinned, the context would hold all of it), by the h2o policy, and
    the session's KV bytes are int8's per token."""
    async def go():
        c = await Client.open(stored.url)
        await c.send({"type": "session.update", "session": {"instructions": LONG_INSTRUCTIONS}})
        await c.until("session.updated")
        await turn(c, "Name a planet.", max_tokens=8)
        st = await stats(c)
        await c.close()
        return st

    evicted_before = metric(stored, 'streamchat_evicted_tokens_by_policy_total{policy="h2o"}') or 0.0
    st = asyncio.run(go())
    sink_block, block = 16, 16
    assert st["eviction"] == "h2o" and st["evicted_tokens"] > 0, st
    assert st["context_tokens"] <= sink_block + WINDOW + block < st["total_tokens"], st
    assert st["total_tokens"] - st["context_tokens"] == st["evicted_tokens"]
    blocks = st["blocks"]["owned"] + st["blocks"]["shared"]
    assert st["kv_bytes"] == blocks * block * health(stored)["kv_bytes_per_token"]
    after = metric(stored, 'streamchat_evicted_tokens_by_policy_total{policy="h2o"}')
    assert after - evicted_before == st["evicted_tokens"]
    assert not metric(stored, 'streamchat_evicted_tokens_by_policy_total{policy="sink_window"}')


def test_max_append_item_chars_refuses_the_append_past_it_and_keeps_the_rest(stored):
    """--max-append-item-chars 300: two appends of 120 characters pass, a third is message_too_large
    naming the limit, and the item keeps exactly the first two."""
    async def go():
        c = await Client.open(stored.url)
        for word in ("alpha ", "bravo "):
            await c.send({"type": "streamchat.input_text.append", "text": word * 20})
            await c.until("streamchat.input_text.appended")
        await c.send({"type": "streamchat.input_text.append", "text": "charlie " * 15, "event_id": "e3"})
        err = (await c.until("error"))[-1]["error"]
        await c.send({"type": "streamchat.input_text.commit"})
        done = (await c.until("conversation.item.done"))[-1]
        await c.close()
        return err, done

    err, done = asyncio.run(go())
    assert err["code"] == "message_too_large" and err["event_id"] == "e3" and "300" in err["message"], err
    assert done["item"]["content"][0]["text"] == "alpha " * 20 + "bravo " * 20


def test_sigterm_under_load_exits_within_the_timeout_and_int8_resumes_from_disk(stored, model_cache):
    """Two identical int8/h2o sessions evict; one continues live. Then SIGTERM while two others
    stream: exit 0 within --shutdown-timeout-s, the streams end and close 1001; a second start
    resumes the other session from disk and its next greedy reply equals the live one."""
    turns = ["Tell me about cats.", "And what about dogs?"]

    async def before():
        x, y = await Client.open(stored.url), await Client.open(stored.url)
        for c in (x, y):  # unpinned (see above): evicted in the first turn already
            await c.send({"type": "session.update", "session": {"instructions": LONG_INSTRUCTIONS}})
            await c.until("session.updated")
        for text in turns:
            assert await turn(x, text, max_tokens=8) == await turn(y, text, max_tokens=8)
        sx = await stats(x)
        assert sx["evicted_tokens"] > 0 and sx["eviction"] == "h2o"
        live = await turn(y, "Answer in one word: which?", max_tokens=16)
        await x.close()
        await y.close()
        streams = [await Client.open(stored.url) for _ in range(2)]
        for s in streams:
            await s.send(user_item(LONG_REPLY))
            await s.until("conversation.item.done")
            # sampled, so its end tokens are banned: a reply that ended by itself before the SIGTERM
            # landed read as completed (a CI run of 2026-12-07)
            await s.send({"type": "response.create", "response": {"max_output_tokens": 200, "logit_bias": NO_END}})
        for s in streams:
            await s.until("response.output_text.delta")
        t0 = time.monotonic()
        stored.proc.send_signal(signal.SIGTERM)
        for s in streams:
            done = (await s.until("response.done"))[-1]["response"]
            assert done["status"] == "cancelled", (done["status"], done.get("status_details"), done.get("usage"))
            with pytest.raises(Exception):
                await s.recv(timeout=30)
            assert s.ws.close_code == 1001
        code = await asyncio.to_thread(stored.proc.wait, 60)
        return (x.created["session"]["id"], x.created["session"]["resume_token"]), sx, live, code, \
            time.monotonic() - t0

    (sid, token), sx, live, code, took = asyncio.run(before())
    assert code == 0 and took < STORED_SHUTDOWN_S, took
    drain_log(stored)
    saved = [re.match(r"saved (\d+) of (\d+) sessions", r["message"]) for r in log_records(stored)]
    [(num_saved, num_sessions)] = [m.groups() for m in saved if m]
    assert num_saved == num_sessions and int(num_sessions) >= 4, (num_saved, num_sessions)
    again = Daemon(stored.db_path, *stored_args(model_cache)).start()
    try:
        async def after():
            c = await Client.open(again.url)
            await c.send({"type": "streamchat.session.resume", "session_id": sid, "resume_token": token})
            resumed = await c.recv()
            if resumed.get("restored_from") != "disk":
                again.kill(signal.SIGTERM)
                drain_log(again)
                pytest.fail(f"resumed {resumed}; log: {[r['message'] for r in log_records(again) if 'sess' in r['message']]}")
            st = await stats(c)
            assert (st["context_tokens"], st["evicted_tokens"]) == (sx["context_tokens"], sx["evicted_tokens"])
            reply = await turn(c, "Answer in one word: which?", max_tokens=16)
            await c.close()
            return reply

        assert asyncio.run(after()) == live
    finally:
        again.stop()


# -- limits -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("limited") / "s.db", "--max-running", "1",
               "--queue-timeout-s", str(LIMITED_QUEUE_S), "--engine-call-timeout-s", str(LIMITED_CALL_S),
               "--shutdown-timeout-s", str(LIMITED_SHUTDOWN_S), "--kv-dtype", "int4",
               "--attention-backend", "cpu", "--device", "cpu", "--window-tokens", "32").start()
    yield d
    d.stop()


@contextlib.contextmanager
def frozen(pid):
    """The engine core stopped (SIGSTOP) for the block; resumed, or killed if the block ended its
    daemon, afterwards."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_limited_daemon_runs_int4_on_the_cpu_backend(limited):
    """--kv-dtype int4 with --attention-backend cpu: 44 bytes per token per KV head for K and V, and
    the ready line names the cpu backend (the next test streams 200 tokens through its window)."""
    h = health(limited)
    assert h["kv_dtype"]["dtype"] == "int4" and h["kv_bytes_per_token"] == 2 * 30 * 3 * 44
    assert any("cpu attention" in line for line in limited.log), "".join(limited.log)


def test_a_response_queued_past_the_queue_timeout_is_overloaded(limited):
    """--max-running 1: while one response streams, another session's response waits; after
    --queue-timeout-s without a token it fails `overloaded` (error, then response.done failed),
    while the first streams on (through its int4 window until blocks leave it; then it is cancelled);
    the waiting session then gets its reply."""
    async def go():
        p, q = await Client.open(limited.url), await Client.open(limited.url)
        await p.send(user_item(LONG_REPLY))
        await p.until("conversation.item.done")
        await q.send(user_item("Name a colour."))
        await q.until("conversation.item.done")
        # P's greedy reply must outlast Q's queue timeout: its end tokens are banned (int4 keys over a 32-token
        # window ended it after 12 tokens once the products' rounding changed)
        await p.send({"type": "response.create", "response": {"max_output_tokens": 120, "temperature": 0,
                                                               "logit_bias": NO_END}})
        await p.until("response.output_text.delta")
        t0 = time.monotonic()
        await q.send({"type": "response.create", "response": {"max_output_tokens": 8, "temperature": 0}})
        events = await q.until("response.done")
        waited = time.monotonic() - t0
        running = health(limited)["running"]
        deadline, p_done = time.monotonic() + 60, None
        while p_done is None:  # P streams on through its (int4) window until blocks leave it
            await p.send({"type": "streamchat.session.stats"})
            seen = await p.until("streamchat.session.stats")
            p_done = next((e["response"] for e in seen if e["type"] == "response.done"), None)
            if seen[-1]["evicted_tokens"] > 0 and p_done is None:
                await p.send({"type": "response.cancel"})
                p_done = (await p.until("response.done"))[-1]["response"]
            assert p_done is not None or time.monotonic() < deadline, seen[-1]
            await asyncio.sleep(0.2)
        again = await turn(q, "Name a colour.", max_tokens=4)
        await p.close()
        await q.close()
        return events, waited, running, p_done, again

    events, waited, running, p_done, again = asyncio.run(go())
    types = [e["type"] for e in events]
    assert "response.output_text.delta" not in types
    [err] = [e["error"] for e in events if e["type"] == "error"]
    assert err["code"] == "overloaded", err
    done = events[-1]["response"]
    assert done["status"] == "failed" and done["status_details"]["error"]["code"] == "overloaded", done
    assert LIMITED_QUEUE_S <= waited < LIMITED_QUEUE_S + 15, waited
    assert running == 1  # the first response still held the one running slot
    assert p_done["status"] == "cancelled" and p_done["usage"]["evicted_tokens"] > 0, p_done  # int4, cpu backend
    assert again


def test_a_command_the_frozen_engine_cannot_take_in_time_is_engine_unavailable(limited):
    """--engine-call-timeout-s: with the engine core frozen past the timeout, an item is answered
    engine_unavailable (never applied); the core resumed, the session goes on."""
    pid = health(limited)["engine"]["pid"]

    async def go():
        c = await Client.open(limited.url)
        await c.send(user_item("My name is Ada."))
        await c.until("conversation.item.done")
        with frozen(pid):
            await c.send(user_item("This one is not taken in time.") | {"event_id": "late"})
            # not a wait for a condition: the core must stay frozen past the call's deadline
            await asyncio.sleep(LIMITED_CALL_S + 1.0)
        events = await c.until("error")
        reply = await turn(c, "What is my name?", max_tokens=6)
        st = await stats(c)
        await c.close()
        return events, st, reply

    events, st, reply = asyncio.run(go())
    err = events[-1]["error"]
    assert err["code"] == "engine_unavailable" and err["event_id"] == "late", err
    assert st["items"] == 3, st  # Ada, the question and the reply: the refused item is not among them
    assert reply
    assert health(limited)["engine"] == {"pid": pid, "starts": 1}  # not restarted


def test_sigterm_with_a_frozen_engine_exits_within_the_shutdown_timeout(limited):
    """--shutdown-timeout-s 3: SIGTERM while a response streams and the engine core is frozen (it can
    neither cancel, save nor stop): the daemon still exits 0 within the timeout (the default would
    be 10 s), its socket closed and its engine core killed."""
    from websockets.exceptions import ConnectionClosed

    pid = health(limited)["engine"]["pid"]

    async def go():
        c = await Client.open(limited.url)
        await c.send(user_item(LONG_REPLY))
        await c.until("conversation.item.done")
        await c.send({"type": "response.create", "response": {"max_output_tokens": 200}})
        await c.until("response.output_text.delta")
        with frozen(pid):
            t0 = time.monotonic()
            limited.proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(limited.proc.wait, 60)
            took = time.monotonic() - t0
            with pytest.raises(ConnectionClosed):
                while True:
                    await c.recv(timeout=10)
            return code, took

    code, took = asyncio.run(go())
    assert code == 0 and took < LIMITED_SHUTDOWN_S + 2.0, (code, took)  # + the interpreter's own exit
    drain_log(limited)
    assert "shutdown passed its 3 s deadline" in "".join(limited.log)
    deadline = time.monotonic() + 10
    while True:  # killed by the daemon: gone, or a zombie until init reaps it
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        assert time.monotonic() < deadline, f"engine core {pid} still alive in state {state}"
        time.sleep(0.1)

# -- compute and cache shape --------------------------------------------------------------------

TUNED_BLOCK, TUNED_SINK, TUNED_WINDOW, TUNED_RESTART_WINDOW_S = 32, 40, 64, 4.0


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("tuned") / "s.db", "--num-threads", "1", "--weights", "int8",
               "--decode-activations", "int8", "--kv-dtype", "fp8", "--block-size", str(TUNED_BLOCK),
               "--sink-tokens", str(TUNED_SINK), "--window-tokens", str(TUNED_WINDOW), "--device", "cpu",
               "--max-engine-restarts", "1", "--engine-restart-window-s", str(TUNED_RESTART_WINDOW_S),
               "--log-format", "json").start()
    yield d
    d.stop()


def test_tuned_daemon_computes_as_its_flags_ask(tuned):
    """--num-threads 1, --weights int8, --decode-activations int8 and --kv-dtype fp8, as the engine
    core reports them after building its model and pool (not as the front was told)."""
    import torch

    from streamchat.kernels import quant

    [ready] = [r for r in log_records(tuned) if r["message"].startswith("streamchat ready on")]
    assert (ready["threads"], ready["weights"], ready["decode_activations"]) == (1, "int8", "int8"), ready
    assert ready["bound_cpus"] == []  # one thread: nothing to bind
    assert ready["kv_dtype"] == "fp8" and ready["kv_block_tokens"] == TUNED_BLOCK
    h = health(tuned)
    assert h["kv_bytes_per_token"] == quant.bytes_per_token("fp8", torch.float32, 30, 3, 64)
    assert h["kv_blocks"]["block_size"] == TUNED_BLOCK


def test_block_size_and_sink_tokens_shape_what_eviction_keeps(tuned):
    """--block-size 32 and --sink-tokens 40 (two sink blocks) with a 64-token window: eviction takes
    whole 32-token blocks, and what stays is the 64 sink tokens plus more than one block less than the
    window (with the default 4 sink tokens, or 16-token blocks, the bounds below would not hold)."""
    async def go():
        c = await Client.open(tuned.url)
        for text in ("Count from one to twenty in words.", "Now count down from twenty to one."):
            await turn(c, text, max_tokens=48)
        st = await stats(c)
        await c.close()
        return st

    st = asyncio.run(go())
    sink_region = 2 * TUNED_BLOCK  # 40 sink tokens round up to two blocks
    assert st["evicted_tokens"] > 0 and st["evicted_tokens"] % TUNED_BLOCK == 0, st
    assert sink_region + TUNED_WINDOW - TUNED_BLOCK < st["context_tokens"] <= sink_region + TUNED_WINDOW, st
    assert st["blocks"]["owned"] + st["blocks"]["shared"] == -(-st["context_tokens"] // TUNED_BLOCK), st


def wait_engine_start(d, starts: int, deadline_s: float = 180) -> dict:
    """/healthz once the daemon's engine core has started `starts` times and is ready; fails loudly."""
    deadline = time.monotonic() + deadline_s
    while True:
        assert d.proc.poll() is None, f"the daemon exited with code {d.proc.returncode}"
        h = health(d)
        if h["engine"]["starts"] == starts and h["status"] == "ok":
            return h
        assert time.monotonic() < deadline, f"engine start {starts} never came: {h}"
        time.sleep(0.2)


def test_engine_deaths_further_apart_than_the_restart_window_are_survived(tuned):
    """--max-engine-restarts 1 with --engine-restart-window-s 4: two core deaths more than 4 s apart are
    each restarted and the daemon serves on (with the default 300 s window, the second would be the one
    too many: /healthz 503 and exit 1, as test_boundary_daemon shows for --max-engine-restarts 0)."""
    first = health(tuned)["engine"]
    os.kill(first["pid"], signal.SIGKILL)
    killed = time.monotonic()
    second = wait_engine_start(tuned, first["starts"] + 1)["engine"]
    assert second["pid"] != first["pid"]
    time.sleep(max(0.0, killed + TUNED_RESTART_WINDOW_S + 1 - time.monotonic()))  # out of the window
    os.kill(second["pid"], signal.SIGKILL)
    third = wait_engine_start(tuned, first["starts"] + 2)["engine"]
    assert third["pid"] not in (first["pid"], second["pid"])

    async def go():
        c = await Client.open(tuned.url)
        text = await turn(c, "Name a planet.", max_tokens=6)
        await c.close()
        return text

    assert asyncio.run(go()).strip() and health(tuned)["status"] == "ok" and tuned.proc.poll() is None
