"""Lock leases for hung clients (opt-in): a receipt held past --lock-lease-seconds is released, its session is
told on its stream, a later use says why; the age of the oldest receipt is always exported."""
from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest

from radixd.client import CacheClient, NotFound

from .conftest import ServerProc
from .test_service import conserved


def _metric(srv: ServerProc, name: str) -> float:
    with urllib.request.urlopen(f"http://{srv.metrics_url.split('//')[1]}", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")


def test_a_silent_client_loses_its_lock_after_the_lease():
    srv = ServerProc("--num-slots", "1024", "--lock-lease-seconds", "0.5")
    try:
        with CacheClient(srv.target, name="silent") as c:
            toks = np.arange(1, 65, dtype=np.int32)
            c.insert(toks, c.alloc(64))
            m = c.match_prefix(toks, lock=True)
            assert c.stats()["protected_tokens"] == 64
            events = c.session_events()
            ev = next(e for e in events if e.expired_receipt_id)  # the client goes silent; the server speaks
            assert ev.expired_receipt_id == m.receipt_id and "lease" in ev.message
            s = conserved(c)
            assert s["receipts"] == 0 and s["protected_tokens"] == 0 and s["evictable_tokens"] == 64
            with pytest.raises(NotFound) as e:
                c.unlock([m.receipt_id])
            assert "expired" in str(e.value) and "--lock-lease-seconds" in str(e.value)
            assert _metric(srv, "radixd_expired_receipts_total") == 1.0
    finally:
        srv.stop()


def test_without_a_lease_locks_stay_and_their_age_is_exported(server):
    with CacheClient(server.target, name="holder") as c:
        toks = np.arange(500, 532, dtype=np.int32)
        c.insert(toks, c.alloc(32))
        m = c.match_prefix(toks, lock=True)
        t0 = time.monotonic()
        while _metric(server, "radixd_oldest_receipt_age_seconds") < 0.2:
            assert time.monotonic() - t0 < 10
        assert c.stats()["receipts"] == 1
        c.unlock([m.receipt_id])
        assert _metric(server, "radixd_oldest_receipt_age_seconds") == 0.0
