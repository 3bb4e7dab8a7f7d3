"""Many client processes at once, and clients SIGKILLed at random points: nothing leaks."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from radixd.client import CacheClient

from .conftest import ServerProc

WORKER = os.path.join(os.path.dirname(__file__), "workers.py")
ROOT = os.path.dirname(os.path.dirname(__file__))


def spawn(target: str, seed: int, seconds: float) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, WORKER, target, str(seed), str(seconds)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(params=["device-only", "write_through", "write_back"])
def busy_server(request):
    host = [] if request.param == "device-only" else ["--host-slots", "4096", "--write-policy", request.param,
                                                        "--load-back-threshold", "1"]
    s = ServerProc("--num-slots", "2048", "--page-size", "1", *host)
    yield s
    s.stop()


def test_eight_concurrent_clients_keep_invariants(busy_server):
    procs = [spawn(busy_server.target, seed, 4.0) for seed in range(8)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.split()[-2] == "ops" and int(out.split()[-1]) > 0
    with CacheClient(busy_server.target) as c:
        deadline = time.monotonic() + 2
        while (c.stats()["sessions"] != 1 or c.stats()["in_flight_tokens"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        s = c.stats()
        assert s["sessions"] == 1 and s["held_tokens"] == 0 and s["receipts"] == 0 and s["in_flight_tokens"] == 0
        assert s["free_tokens"] + s["cached_tokens"] == s["capacity_tokens"]
        assert c.check() == []
        assert s["cached_tokens"] > 0 and s["hit_tokens_total"] > 0
        if c.info()["write_policy"]:  # the host tier was exercised: demotions, host hits and load-backs
            assert s["backup_tokens_total"] > 0 and s["host_hit_tokens_total"] > 0 and s["load_back_tokens_total"] > 0


def test_sigkilled_clients_lose_locks_and_slots_within_a_second(busy_server):
    rng = random.Random(7)
    kills = 0
    slowest = 0.0
    with CacheClient(busy_server.target, name="observer") as obs:
        while kills < 100:
            batch = [spawn(busy_server.target, 1000 + kills + i, 30.0) for i in range(5)]
            for p in batch:
                if rng.random() < 0.8:
                    assert p.stdout.readline().strip() == "attached"  # mid-workload kills
                time.sleep(rng.random() * 0.05)
                p.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            for p in batch:
                p.wait(30)
                assert p.returncode == -signal.SIGKILL
                p.stdout.close()
                p.stderr.close()
            kills += len(batch)
            while True:
                s = obs.stats()
                if s["sessions"] == 1 and s["held_tokens"] == 0 and s["receipts"] == 0 and not s["in_flight_tokens"]:
                    break
                assert time.monotonic() - killed_at < 1.0, f"not released within 1 s: {s}"
                time.sleep(0.005)
            slowest = max(slowest, time.monotonic() - killed_at)
            assert s["free_tokens"] + s["cached_tokens"] == s["capacity_tokens"]
            assert obs.check() == []
        assert obs.check() == []
    assert kills >= 100
    print(f"{kills} kills, slowest release {slowest * 1000:.0f} ms")
