"""The RPC metrics radixd keeps by hand expose exactly what prometheus_client's own Histogram and Counter
would for the same calls (names, labels, bucket edges, cumulative counts, sums)."""
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from radixd.server.metrics import BUCKETS, RpcCollector

calls = st.lists(st.tuples(st.sampled_from(["MatchPrefix", "Insert", "Alloc"]),
                           st.one_of(st.sampled_from(BUCKETS), st.floats(0, 3, allow_nan=False)),
                           st.sampled_from(["OK", "OK", "NOT_FOUND", "INVALID_ARGUMENT"])), max_size=60)


def _lines(reg: CollectorRegistry) -> list[str]:
    return sorted(line for line in generate_latest(reg).decode().splitlines() if line)


@settings(max_examples=60, deadline=None)
@given(calls)
def test_rpc_collector_matches_prometheus_client(seq):
    ours = CollectorRegistry()
    rpc = RpcCollector()
    ours.register(rpc)
    ref = CollectorRegistry()
    lat = Histogram("radixd_rpc_latency_seconds", "Server-side RPC latency", ["method"], buckets=BUCKETS,
                    registry=ref)
    req = Counter("radixd_rpc_requests", "RPCs by method and status code", ["method", "code"], registry=ref)
    err = Counter("radixd_rpc_errors", "Failed RPCs by method and status code", ["method", "code"], registry=ref)
    for method, seconds, code in seq:
        rpc.observe(method, seconds, code)
        lat.labels(method).observe(seconds)
        req.labels(method, code).inc()
        if code != "OK":
            err.labels(method, code).inc()
    want = [line for line in _lines(ref) if "_created" not in line]
    assert _lines(ours) == want
