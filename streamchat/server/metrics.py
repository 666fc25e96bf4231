"""The daemon's Prometheus metrics: names, histograms, and a collector over live engine figures.

Owns metric names (all `streamchat_` prefixed, `_total` counters, `_seconds`
durations, `_ratio` fractions; never a session id in a label). Reads the
engine's figures at scrape time; histograms are fed by the engine thread
through EngineMetrics observers (prometheus_client is thread-safe).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from streamchat.engine.session import TIERS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class DaemonMetrics:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self.ttft = Histogram("streamchat_time_to_first_token_seconds", "Time from response.create to its first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("streamchat_inter_token_latency_seconds", "Time between consecutive output tokens",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.step_tokens = Histogram("streamchat_step_tokens", "Tokens computed per engine step",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=self.registry)
        self._responses = Counter("streamchat_responses_total", "Responses finished, by status",
                                  ["status"], registry=self.registry)
        self._errors = Counter("streamchat_errors_total", "Error events sent, by code", ["code"],
                               registry=self.registry)
        self._resumes = Counter("streamchat_resumes_total", "Sessions resumed, by where their KV came from",
                                ["restored_from"], registry=self.registry)
        self.connections = 0
        self.registry.register(_EngineCollector(self))
        engine.metrics.observers.append(self._observe)

    def _observe(self, kind: str, value: float) -> None:
        {"ttft": self.ttft, "itl": self.itl, "step_tokens": self.step_tokens}[kind].observe(value)

    def response_done(self, status: str) -> None:
        self._responses.labels(status).inc()

    def errors(self, code: str) -> None:
        self._errors.labels(code).inc()

    def resumed(self, restored_from: str) -> None:
        self._resumes.labels(restored_from).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, metrics: DaemonMetrics) -> None:
        self.m = metrics

    def collect(self):
        eng = self.m.engine
        pool, mgr, sched = eng.pool, eng.manager, eng.scheduler.stats
        sessions = list(eng.sessions.values())
        yield _gauge("streamchat_kv_blocks", "KV pool blocks by state", "state", {
            "free": pool.num_free - pool.num_cached_free, "cached": pool.num_cached_free,
            "used": pool.num_used,
            "shared": sum(1 for c in pool.ref_counts if c > 1)})
        yield GaugeMetricFamily("streamchat_kv_blocks_capacity", "Usable KV pool blocks", value=pool.num_usable)
        yield GaugeMetricFamily("streamchat_kv_usage_ratio", "Fraction of KV blocks in use",
                                value=pool.num_used / pool.num_usable)
        yield GaugeMetricFamily("streamchat_kv_bytes_per_token", "KV bytes one token takes in the pool",
                                value=eng.runner.bytes_per_token)
        yield _gauge("streamchat_sessions", "Engine sessions by state", "state", {
            "running": sum(1 for s in sessions if s.response is not None and s.response.phase.value != "queued"),
            "waiting": sum(1 for s in sessions if s.response is not None and s.response.phase.value == "queued"),
            "idle": sum(1 for s in sessions if s.response is None),
            "paged_out": sum(1 for s in sessions if not s.resident)})
        yield GaugeMetricFamily("streamchat_connections", "Open websocket connections", value=self.m.connections)
        yield CounterMetricFamily("streamchat_prefix_query_tokens_total", "Tokens looked up in the prefix cache",
                                  value=mgr.num_prefix_queried_tokens)
        yield CounterMetricFamily("streamchat_prefix_hit_tokens_total", "Tokens served from the prefix cache",
                                  value=mgr.num_prefix_hit_tokens)
        yield CounterMetricFamily("streamchat_evicted_tokens_total", "Tokens evicted by the sink + window policy",
                                  value=mgr.num_evicted_tokens)
        yield CounterMetricFamily("streamchat_preemptions_total", "Running sessions preempted for memory",
                                  value=sched.preemptions)
        yield CounterMetricFamily("streamchat_idle_drops_total", "Idle sessions that gave up their blocks",
                                  value=sched.idle_drops)
        yield CounterMetricFamily("streamchat_cached_block_evictions_total",
                                  "Cached free blocks reused for new data", value=pool.num_cache_evictions)
        yield CounterMetricFamily("streamchat_steps_total", "Engine steps", value=eng.metrics.steps)
        yield CounterMetricFamily("streamchat_tokens_total", "Tokens computed", value=eng.metrics.tokens)
        yield CounterMetricFamily("streamchat_step_seconds_total", "Time spent in model steps",
                                  value=eng.metrics.step_seconds)
        if eng.pager is not None:
            yield from _tier_metrics(eng, sessions)


def _gauge(name: str, doc: str, label: str, values: dict) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=[label])
    for key, value in values.items():
        g.add_metric([key], value)
    return g


def _tier_metrics(eng, sessions):
    """Sessions and bytes per tier, moves between tiers, saved files refused."""
    pager, per_block = eng.pager, eng.runner.bytes_per_block
    host, disk = pager.host, pager.disk
    tiers = [s.tier for s in sessions]
    yield _gauge("streamchat_tier_sessions", "Sessions by where their KV is (dropped: tokens only)", "tier",
                 {t: tiers.count(t) for t in TIERS})
    used = {"device": eng.pool.num_used * per_block}
    capacity = {"device": eng.pool.num_usable * per_block}
    if host is not None:
        used["host"], capacity["host"] = host.pool.num_used * per_block, host.capacity * per_block
    if disk is not None:
        used["disk"], capacity["disk"] = disk.num_bytes, disk.budget
    yield _gauge("streamchat_tier_bytes", "Bytes held per tier (disk: every saved file)", "tier", used)
    yield _gauge("streamchat_tier_capacity_bytes", "Size of each tier", "tier", capacity)
    moves = CounterMetricFamily("streamchat_tier_moves_total", "Sessions moved between tiers",
                                labels=["from_tier", "to_tier"])
    for (src, dst), n in list(pager.moves.items()):
        moves.add_metric([src, dst], n)
    yield moves
    failures = CounterMetricFamily("streamchat_tier_load_failures_total",
                                   "Saved session files not used, by reason", labels=["reason"])
    for reason, n in list(pager.load_failures.items()):
        failures.add_metric([reason], n)
    yield failures
    if disk is not None:
        yield GaugeMetricFamily("streamchat_tier_disk_files", "Saved session files", value=disk.num_files)
        yield CounterMetricFamily("streamchat_tier_disk_writes_total", "Session files written",
                                  value=disk.num_writes)
        yield CounterMetricFamily("streamchat_tier_disk_written_bytes_total", "Bytes of session files written",
                                  value=disk.num_written_bytes)
        yield CounterMetricFamily("streamchat_tier_disk_write_failures_total", "Session file writes that failed",
                                  value=disk.num_write_failures)
        yield CounterMetricFamily("streamchat_tier_disk_deletions_total",
                                  "Session files deleted to keep the data directory within its budget",
                                  value=disk.num_deletions)
