"""Prometheus metrics: RPC histograms/counters updated per call, cache state read live at scrape time."""
from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from .pools.allocator import STATE_NAMES

if TYPE_CHECKING:
    from .core import CacheCore

BUCKETS = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0)


_LE = tuple(floatToGoString(b) for b in BUCKETS) + ("+Inf",)


class RpcCollector:
    """RPC latency and outcomes as plain counts the event loop bumps, turned into families at scrape time: a
    prometheus_client Histogram takes a lock per bucket, which the per-call path should not pay."""

    def __init__(self) -> None:
        self.latency: dict[str, list] = {}  # method -> [count per bucket ..., count over the last bound, sum]
        self.codes: dict[tuple[str, str], int] = {}

    def observe(self, method: str, seconds: float, code: str) -> None:
        """One finished RPC (called on the event loop only)."""
        h = self.latency.get(method)
        if h is None:
            h = self.latency[method] = [0] * len(_LE) + [0.0]
        h[bisect_left(BUCKETS, seconds)] += 1  # Prometheus buckets are upper-inclusive
        h[-1] += seconds
        key = (method, code)
        self.codes[key] = self.codes.get(key, 0) + 1

    def collect(self):
        hist = HistogramMetricFamily("radixd_rpc_latency_seconds", "Server-side RPC latency", labels=["method"])
        for method, h in list(self.latency.items()):
            h = list(h)  # one copy under the GIL, so count, buckets and sum agree
            cum, buckets = 0, []
            for le, n in zip(_LE, h):
                cum += n
                buckets.append((le, cum))
            hist.add_metric([method], buckets, h[-1])
        yield hist
        req = CounterMetricFamily("radixd_rpc_requests", "RPCs by method and status code", labels=["method", "code"])
        err = CounterMetricFamily("radixd_rpc_errors", "Failed RPCs by method and status code",
                                  labels=["method", "code"])
        for (method, code), n in list(self.codes.items()):
            req.add_metric([method, code], n)
            if code != "OK":
                err.add_metric([method, code], n)
        yield req
        yield err


class CacheCollector:
    """Reads the engine's counters at scrape time: no bookkeeping on the hot path."""

    def __init__(self, core: "CacheCore"):
        self.core = core

    def collect(self):
        core, t = self.core, self.core.tree
        ht = getattr(core, "host_tier", None)  # a hybrid model's host tier: a tree of its own
        host_alloc = ht.alloc if ht is not None else core.host_alloc
        slots = GaugeMetricFamily("radixd_pool_slots", "Pool slots by tier and state", labels=["tier", "state"])
        for i, name in enumerate(STATE_NAMES):
            slots.add_metric(["device", name], core.alloc.counts[i])
            if host_alloc:
                slots.add_metric(["host", name], host_alloc.counts[i])
        yield slots
        yield CounterMetricFamily("radixd_hit_tokens", "Tokens served from cache by MatchPrefix",
                                  value=t.counters.hit_tokens)
        yield CounterMetricFamily("radixd_queried_tokens", "Tokens asked for by MatchPrefix",
                                  value=t.counters.queried_tokens)
        ev = CounterMetricFamily("radixd_evicted_tokens", "Tokens evicted, by tier", labels=["tier"])
        ev.add_metric(["device"], t.counters.evicted_tokens_device)
        ev.add_metric(["host"], ht.tree.counters.evicted_tokens_device if ht else t.counters.evicted_tokens_host)
        yield ev
        yield CounterMetricFamily("radixd_inserted_tokens", "Tokens adopted into the tree",
                                  value=t.counters.inserted_tokens)
        cached = GaugeMetricFamily("radixd_cached_tokens", "Cached tokens by lock state", labels=["state"])
        cached.add_metric(["evictable"], t.evictable_size)
        cached.add_metric(["protected"], t.protected_size)
        yield cached
        yield GaugeMetricFamily("radixd_tree_nodes", "Radix tree nodes", value=t.num_nodes)
        if getattr(core, "hybrid", False):
            yield from _component_families(core)
        yield GaugeMetricFamily("radixd_sessions", "Attached client sessions", value=len(core.sessions))
        yield GaugeMetricFamily("radixd_active_receipts", "Lock receipts not yet released", value=t.num_receipts)
        yield GaugeMetricFamily("radixd_oldest_receipt_age_seconds", "How long the oldest live lock receipt has "
                                "been held", value=core.sessions.oldest_receipt_age())
        yield CounterMetricFamily("radixd_expired_receipts", "Lock receipts released by --lock-lease-seconds",
                                  value=core.expired_receipts)
        yield CounterMetricFamily("radixd_stock_asks", "Allocs that found the pool short while other sessions "
                                  "held slots, and asked for stocks back", value=core.pressure.waited)
        yield CounterMetricFamily("radixd_stock_rescues", "Of those, the ones served once stocks came back",
                                  value=core.pressure.rescued)
        yield CounterMetricFamily("radixd_host_hit_tokens", "Tokens a MatchPrefix found on the host tier only",
                                  value=ht.host_hit_tokens if ht else t.counters.host_hit_tokens)
        yield CounterMetricFamily("radixd_backup_tokens", "Tokens copied device -> host",
                                  value=ht.demoted_tokens if ht else t.counters.backup_tokens)
        yield CounterMetricFamily("radixd_load_back_tokens", "Tokens loaded host -> device",
                                  value=ht.loaded_tokens if ht else t.counters.load_back_tokens)
        hcached = GaugeMetricFamily("radixd_host_cached_tokens", "Host-tier tokens by lock state", labels=["state"])
        hcached.add_metric(["evictable"], ht.tree.evictable_size if ht else t.host_evictable_size)
        hcached.add_metric(["protected"], ht.tree.protected_size if ht else t.host_protected_size)
        yield hcached
        if core.host is not None:
            yield GaugeMetricFamily("radixd_transfers_in_flight", "Copies submitted and not yet landed",
                                    value=len(core.host.engine.active))
            yield CounterMetricFamily("radixd_transfer_failures", "Copies that failed and were rolled back",
                                      value=core.host.failed_transfers)
        st = core.storage
        if st is not None:
            yield CounterMetricFamily("radixd_storage_hit_tokens", "Tokens prefetched from L3 into the tree",
                                      value=st.hit_tokens)
            b = CounterMetricFamily("radixd_storage_bytes", "Bytes moved to (put) and from (get) L3",
                                    labels=["direction"])
            pages = CounterMetricFamily("radixd_storage_pages", "Pages written to, read from, or found already in L3",
                                        labels=["direction"])
            for d in ("put", "get"):
                b.add_metric([d], st.bytes[d])
                pages.add_metric([d], st.pages[d])
            pages.add_metric(["put_skipped"], st.pages["put_skipped"])
            yield b
            yield pages
            err = CounterMetricFamily("radixd_storage_errors", "L3 failures by kind", labels=["kind"])
            for kind in sorted(set(st.errors) | {"io", "timeout", "unavailable", "error", "skipped_down"}):
                err.add_metric([kind], st.errors.get(kind, 0))  # known kinds at 0, so the series exist
            yield err
            out = CounterMetricFamily("radixd_prefetch_outcomes", "L3 prefetches by outcome", labels=["outcome"])
            for o in sorted(set(st.outcomes) | {"completed", "truncated", "timed_out", "error"}):
                out.add_metric([o], st.outcomes.get(o, 0))
            yield out
            yield GaugeMetricFamily("radixd_prefetches_in_flight", "L3 prefetches running", value=len(st.prefetches))
        hub = core.events
        if hub is not None:
            yield CounterMetricFamily("radixd_kv_event_batches", "KV event batches published",
                                      value=hub.published_seq - hub.failed)
            yield GaugeMetricFamily("radixd_kv_event_backlog_batches", "KV event batches taken from the tree and "
                                    "not yet published (the publisher thread is behind)",
                                    value=hub.next_seq - hub.published_seq)
            lost = CounterMetricFamily("radixd_kv_events_lost", "KV events never published", labels=["reason"])
            lost.add_metric(["queue_bound"], hub.dropped)
            lost.add_metric(["build_failed"], hub.failed)
            yield lost


def _component_families(core):
    """A hybrid model's SWA KV and state pools, by state, and the tree's share of each (evictable, protected)."""
    st = core.stats()
    pool = GaugeMetricFamily("radixd_component_slots", "Hybrid models: SWA KV slots and state slots by state",
                             labels=["component", "state"])
    if core.swa is not None:
        for state, key in (("free", "swa_free_tokens"), ("held", "swa_held_tokens"),
                           ("evictable", "swa_evictable_tokens"), ("protected", "swa_protected_tokens")):
            pool.add_metric(["swa", state], st[key])
    if core.states is not None:
        for state, key in (("free", "mamba_free"), ("held", "mamba_held"), ("evictable", "mamba_evictable"),
                           ("protected", "mamba_protected")):
            pool.add_metric(["mamba", state], st[key])
    yield pool
    if getattr(core, "host_tier", None) is not None:
        host = GaugeMetricFamily("radixd_host_component_slots", "Hybrid models' host tier: SWA KV slots and state "
                                 "slots, free or cached", labels=["component", "state"])
        for comp, free, cached in (("swa", "host_swa_free_tokens", "host_swa_cached_tokens"),
                                   ("mamba", "host_mamba_free", "host_mamba_cached")):
            if free in st:
                host.add_metric([comp, "free"], st[free])
                host.add_metric([comp, "cached"], st[cached])
        yield host


class Metrics:
    """Per-RPC latency and outcome; plus the live collector."""

    def __init__(self, core: "CacheCore"):
        disable_created_metrics()  # no `_created` twin of every counter and histogram
        self.registry = CollectorRegistry()
        self.rpc = RpcCollector()
        self.registry.register(self.rpc)
        self.observe = self.rpc.observe  # one finished RPC: (method, seconds, code)
        self.transfer_bytes = Counter("radixd_transfer_bytes", "Bytes copied between tiers", ["direction"],
                                      registry=self.registry)
        self.transfer_seconds = Histogram("radixd_transfer_seconds", "Copy time per transfer", ["direction"],
                                          buckets=BUCKETS, registry=self.registry)
        self.registry.register(CacheCollector(core))
        self.address = ""
        if core.host is not None:
            core.host.engine.listeners.append(self.observe_transfer)
        if core.storage is not None:
            hist = Histogram("radixd_storage_seconds", "L3 call latency", ["call"], buckets=BUCKETS + (2.5, 5.0),
                             registry=self.registry)
            core.storage.observe = lambda call, s: hist.labels(call).observe(s)

    def observe_transfer(self, t) -> None:
        """Called on the event loop when a copy lands."""
        if t.ok:
            self.transfer_bytes.labels(t.direction).inc(t.nbytes)
            self.transfer_seconds.labels(t.direction).observe(t.seconds)

    def serve(self, host: str, port: int) -> str:
        """Start the HTTP endpoint; port 0 picks a free one. Returns host:port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.address = f"{host}:{server.server_port}"
        return self.address
