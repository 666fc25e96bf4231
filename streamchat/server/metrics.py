"""The daemon's Prometheus metrics: names, histograms, and a collector over the engine's snapshot.

Owns metric names (all `streamchat_` prefixed, `_total` counters, `_seconds`
durations, `_ratio` fractions; never a session id in a label). Reads the
engine's published snapshot at scrape time; histograms are fed by the engine thread
through EngineMetrics observers (prometheus_client is thread-safe).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from streamchat.tiers.residency import TIERS

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
        engine.observe(self._observe)

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
    """Engine figures from the snapshot the engine thread publishes: never live engine state."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self.m = metrics

    def collect(self):
        snap = self.m.engine.snapshot
        yield _gauge("streamchat_kv_blocks", "KV pool blocks by state", "state", {
            "free": snap.kv_blocks_free, "cached": snap.kv_blocks_cached,
            "used": snap.kv_blocks_used, "shared": snap.kv_blocks_shared})
        yield GaugeMetricFamily("streamchat_kv_blocks_capacity", "Usable KV pool blocks", value=snap.kv_blocks_total)
        yield GaugeMetricFamily("streamchat_kv_usage_ratio", "Fraction of KV blocks in use",
                                value=snap.kv_blocks_used / max(1, snap.kv_blocks_total))
        yield GaugeMetricFamily("streamchat_kv_bytes_per_token", "KV bytes one token takes in the pool",
                                value=snap.kv_bytes_per_token)
        yield _gauge("streamchat_sessions", "Engine sessions by state", "state", {
            "running": snap.sessions_running, "waiting": snap.sessions_waiting, "idle": snap.sessions_idle,
            "paged_out": snap.sessions - snap.sessions_by_residency.get("device", 0)})
        yield GaugeMetricFamily("streamchat_queued_tokens", "Tokens waiting to enter the cache",
                                value=snap.queued_tokens)
        yield GaugeMetricFamily("streamchat_connections", "Open websocket connections", value=self.m.connections)
        for name, doc, value in (
            ("prefix_query_tokens", "Tokens looked up in the prefix cache", snap.prefix_queried_tokens),
            ("prefix_hit_tokens", "Tokens served from the prefix cache", snap.prefix_hit_tokens),
            ("evicted_tokens", "Tokens evicted from session windows (every policy)", snap.evicted_tokens),
            ("preemptions", "Running sessions preempted for memory", snap.preemptions),
            ("idle_drops", "Idle sessions that gave up their blocks", snap.idle_drops),
            ("cached_block_evictions", "Cached free blocks reused for new data", snap.cached_block_evictions),
            ("steps", "Engine steps", snap.steps),
            ("failed_steps", "Engine steps that failed (their responses failed, sessions rebuilt)",
             snap.failed_steps),
            ("tokens", "Tokens computed", snap.tokens),
            ("step_seconds", "Time spent in model steps", snap.step_seconds),
            ("decode_steps", "Engine steps of decode rows only", snap.decode_steps),
            ("decode_step_seconds", "Time spent in steps of decode rows only", snap.decode_step_seconds),
        ):
            yield CounterMetricFamily(f"streamchat_{name}_total", doc, value=value)
        by_policy = CounterMetricFamily("streamchat_evicted_tokens_by_policy",
                                        "Tokens evicted from session windows, by eviction policy", labels=["policy"])
        for policy, value in snap.evicted_by_policy.items():
            by_policy.add_metric([policy], value)
        yield by_policy
        if snap.tiers.get("moves") is not None:
            yield from _tier_metrics(snap)


def _gauge(name: str, doc: str, label: str, values: dict) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=[label])
    for key, value in values.items():
        g.add_metric([key], value)
    return g


def _tier_metrics(snap):
    """Sessions and bytes per tier, moves between tiers, saved files refused."""
    tiers = snap.tiers
    host, disk = tiers["host"], tiers["disk"]
    yield _gauge("streamchat_tier_sessions", "Sessions by where their KV is (dropped: tokens only)", "tier",
                 {t.value: snap.sessions_by_residency.get(t.value, 0) for t in TIERS})
    used = {"device": snap.kv_blocks_used * snap.kv_bytes_per_block}
    capacity = {"device": snap.kv_blocks_total * snap.kv_bytes_per_block}
    if host is not None:
        used["host"], capacity["host"] = host["bytes"], host["capacity_bytes"]
    if disk is not None:
        used["disk"], capacity["disk"] = disk["bytes"], disk["budget_bytes"]
    yield _gauge("streamchat_tier_bytes", "Bytes held per tier (disk: every saved file)", "tier", used)
    yield _gauge("streamchat_tier_capacity_bytes", "Size of each tier", "tier", capacity)
    moves = CounterMetricFamily("streamchat_tier_moves_total", "Sessions moved between tiers",
                                labels=["from_tier", "to_tier"])
    for (src, dst), n in tiers["moves"].items():
        moves.add_metric([src, dst], n)
    yield moves
    failures = CounterMetricFamily("streamchat_tier_load_failures_total",
                                   "Saved session files not used, by reason", labels=["reason"])
    for reason, n in tiers["load_failures"].items():
        failures.add_metric([reason], n)
    yield failures
    if disk is not None:
        yield GaugeMetricFamily("streamchat_tier_disk_files", "Saved session files", value=disk["files"])
        for name, doc, key in (
            ("writes", "Session files written", "writes"),
            ("written_bytes", "Bytes of session files written", "written_bytes"),
            ("write_failures", "Session file writes that failed", "write_failures"),
            ("deletions", "Session files deleted to keep the data directory within its budget", "deletions"),
        ):
            yield CounterMetricFamily(f"streamchat_tier_disk_{name}_total", doc, value=disk[key])
