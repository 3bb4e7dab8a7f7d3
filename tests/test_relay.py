"""The relay process (`radixd.client.relay`) against a real server: a RelayedClient's calls do what a plain client's do
(answers, precise errors, nothing changed by a refused call), its session is the relay's and goes with it (the
server frees what it held within a second when the engine or the relay dies), the events stream it relays keeps a
LocalIndex current, concurrent threads each get their own answers, and the engine's process runs no gRPC thread."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from radixd.client import CacheClient, InvalidArgument, PermissionDenied, Unauthenticated, Unavailable
from radixd.client.background import Stores
from radixd.client.events import LocalIndex
from radixd.client.relay import RelayedClient
from radixd.proto import cache_pb2 as pb

from .conftest import ServerProc

PAGE = 16


def _until(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def srv():
    s = ServerProc("--num-slots", "4096", "--page-size", str(PAGE), "--kv-events")
    yield s
    s.stop()


def test_relayed_calls_answer_as_a_plain_client_and_refusals_change_nothing(srv):
    probe = CacheClient(srv.target, name="probe")
    c = RelayedClient(srv.target, name="relayed")
    try:
        assert c.proc.poll() is None and c.session_id and c.instance_id == probe.instance_id
        assert probe.stats()["sessions"] == 2  # the relay's session and the probe's
        toks = np.arange(100, 164)
        slots = c.alloc(64)
        assert slots.size == 64 and probe.stats()["held_tokens"] == 64
        (ins, m), = c.cache_unfinished([dict(tokens=toks, indices=slots, prev_prefix_len=0, receipt_id=0)])
        assert m.receipt_id and c.event_seq > 0
        assert np.array_equal(probe.match_prefix(toks).indices, slots)
        before = probe.stats()
        with pytest.raises(InvalidArgument, match="outside"):
            c.free(np.array([99999]))
        with pytest.raises(PermissionDenied, match="is tree"):  # slots the tree owns now, not this session
            c.cache_unfinished([dict(tokens=toks[:16], indices=slots[:16], prev_prefix_len=0, receipt_id=0)])
        assert probe.stats() == before and probe.check() == []
        c.unlock([m.receipt_id])
        assert probe.stats()["protected_tokens"] == 0 and probe.stats()["held_tokens"] == 0
        assert np.array_equal(c.match_prefix(toks).indices, slots)
    finally:
        c.close()
        probe.close()
    assert c.proc.returncode == 0


def test_concurrent_threads_each_get_their_own_answers(srv):
    c = RelayedClient(srv.target)
    errors: list[str] = []

    def work(k: int) -> None:
        for i in range(100):
            payload = f"{k}:{i}".encode() * (1 + i % 50)
            got = c.echo(payload)
            if got != payload:
                errors.append(f"thread {k} call {i}: {got[:20]!r}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    c.close()
    assert not errors and not any(t.is_alive() for t in threads)


def test_a_bad_token_is_refused_at_start():
    s = ServerProc("--num-slots", "256", "--token", "sesame")
    try:
        with pytest.raises(Unauthenticated):
            RelayedClient(s.target, token="wrong")
        c = RelayedClient(s.target, token="sesame")
        assert c.info()["capacity_tokens"] == 256
        c.close()
    finally:
        s.stop()


def test_the_session_goes_with_the_relay(srv):
    """Killing the relay ends its session: the server frees its held slots, and the engine's calls fail fast."""
    probe = CacheClient(srv.target, name="probe")
    c = RelayedClient(srv.target)
    c.alloc(128)
    assert probe.stats()["held_tokens"] == 128
    c.proc.send_signal(signal.SIGKILL)
    c.proc.wait(5)
    t = time.monotonic()
    _until(lambda: probe.stats()["held_tokens"] == 0, "held slots outlived the relay")
    assert time.monotonic() - t < 2.0
    with pytest.raises(Unavailable, match="relay"):
        c.alloc(16)
    c.close()
    assert probe.stats()["sessions"] == 1 and probe.check() == []
    probe.close()


ENGINE = textwrap.dedent("""
    import os, sys, time
    from radixd.client.relay import RelayedClient
    c = RelayedClient(sys.argv[1], name="engine")
    c.alloc(64)
    c.echo(b"x")
    names = sorted({open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")})
    print(c.proc.pid, ",".join(names), flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), 9)
    c.close()
""")


def test_an_engine_that_dies_takes_its_relay_and_session_with_it(srv):
    """A real engine process killed outright: its relay exits (it watches its parent) and the server frees the
    slots the engine held within a second of the relay's end."""
    probe = CacheClient(srv.target, name="probe")
    out = subprocess.run([sys.executable, "-c", ENGINE, srv.target, "die"], capture_output=True, text=True,
                         timeout=60)
    relay_pid = int(out.stdout.split()[0])
    t = time.monotonic()

    def gone() -> bool:
        try:
            os.kill(relay_pid, 0)
            with open(f"/proc/{relay_pid}/stat") as f:
                return f.read().split(") ")[1][0] == "Z"
        except OSError:
            return True
    _until(gone, "the relay outlived its engine")
    _until(lambda: probe.stats()["held_tokens"] == 0, "held slots outlived the engine")
    assert time.monotonic() - t < 3.0
    assert probe.stats()["sessions"] == 1 and probe.check() == []
    probe.close()


def test_the_engines_process_runs_no_grpc_thread(srv):
    """The point of the relay: gRPC's threads (its event engine, its timer) live in the relay, not beside the
    forward; a plain client's process has them (the same check, so it can fail)."""
    out = subprocess.run([sys.executable, "-c", ENGINE, srv.target, "close"], capture_output=True, text=True,
                         timeout=60)
    names = out.stdout.split()[1].split(",")
    assert not [n for n in names if n.startswith(("event_engine", "grpc"))], names
    plain = ENGINE.replace("from radixd.client.relay import RelayedClient", "from radixd.client import CacheClient")
    plain = plain.replace("RelayedClient(sys.argv[1], name=\"engine\")", "CacheClient(sys.argv[1], name=\"engine\")")
    plain = plain.replace("print(c.proc.pid,", "print(0,")
    out = subprocess.run([sys.executable, "-c", plain, srv.target, "close"], capture_output=True, text=True,
                         timeout=60)
    assert [n for n in out.stdout.split()[1].split(",") if n.startswith(("event_engine", "grpc"))], out.stdout


def test_a_local_index_follows_the_events_through_the_relay(srv):
    """Stores publishes through the relay, and the index fed by the relayed events stream sees them (and stays
    current as of the client's own last store); a cancelled stream ends."""
    c = RelayedClient(srv.target)
    index = LocalIndex(c, srv.target, PAGE)
    stores = Stores(c, PAGE, 256)
    try:
        assert index.current()
        toks = np.arange(5000, 5064)
        assert index.known_miss(toks)
        pages = None
        while pages is None:
            pages = stores.take_pages(4, wait=1.0)
        stores.publish("r", toks, 0, pages, dict(extra_key="", cache_salt=""))
        stores.wait_idle(5.0)
        _until(lambda: not index.known_miss(toks) and index.current(), "the relayed events never showed the store")
        stores.release("r")
        stores.wait_idle(5.0)
        st = c.watch_events(pb.WatchEventsRequest(follow=True, snapshot=True))
        got: list = []

        def read() -> None:
            try:
                for b in st:
                    got.append(b)
            except Exception as e:  # noqa: BLE001 (what ended it is checked below)
                got.append(e)
        t = threading.Thread(target=read)
        t.start()
        _until(lambda: any(getattr(b, "snapshot", False) and not b.snapshot_more for b in got), "no snapshot")
        st.cancel()
        t.join(5)
        assert not t.is_alive() and isinstance(got[-1], Exception) and "cancel" in str(got[-1])
        snap = [h for b in got[:-1] for ev in b.events if ev.WhichOneof("kind") == "stored"
                for h in ev.stored.block_hashes]
        assert len(snap) == 4  # the 4 pages the store published
    finally:
        stores.close()
        index.close()
        c.close()
