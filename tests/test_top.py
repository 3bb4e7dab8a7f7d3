"""`radixd top` driven headless against a live server: a few refreshes, each with the numbers it promises."""
from __future__ import annotations

import io
import subprocess
import sys

import numpy as np

from radixd.client import CacheClient
from radixd.server.top import quantile

CLI = [sys.executable, "-m", "radixd.server.cli"]


def test_quantiles_come_from_the_bucket_deltas():
    before = {0.001: 10, 0.01: 10, float("inf"): 10}
    now = {0.001: 12, 0.01: 19, float("inf"): 20}  # 10 new calls: 2 under 1 ms, 7 more under 10 ms, 1 slower
    assert quantile(0.5, now, before) == 0.01 and quantile(0.99, now, before) == float("inf")
    assert quantile(0.5, before, before) is None


def test_top_prints_live_frames_of_a_busy_server(server):
    with CacheClient(server.target, name="load") as c:
        toks = np.arange(1, 257, dtype=np.int32)
        c.insert(toks, c.alloc(256))
        m = c.match_prefix(toks, lock=True)
        p = subprocess.Popen(CLI + ["top", "--target", server.target, "--interval", "0.3", "--iterations", "3"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**__import__("os").environ, "COLUMNS": "160"})  # (wide enough, whatever is set)
        for _ in range(200):  # traffic while top watches
            c.match_prefix(toks)
        out, err = p.communicate(timeout=60)
        c.unlock([m.receipt_id])
    assert p.returncode == 0, err
    assert out.count("hit rate now") == 3 and "overall" in out and "receipts 1" in out
    assert "MatchPrefix" in out and "device" in out and "p99" in out


def test_top_renders_into_any_console(server):
    from rich.console import Console

    from radixd.server.top import run
    with CacheClient(server.target, name="top") as c:
        buf = io.StringIO()
        run(c, interval=0.05, iterations=2, console=Console(file=buf, width=150))
    assert buf.getvalue().count("pools (tokens)") == 2


def test_top_in_a_terminal_quits_on_q(server):
    import os
    import select
    import time
    master, slave = os.openpty()
    p = subprocess.Popen(CLI + ["top", "--target", server.target, "--interval", "0.2"], stdin=slave, stdout=slave,
                         stderr=slave, env={**os.environ, "TERM": "xterm", "COLUMNS": "140", "LINES": "40"})
    os.close(slave)
    seen, deadline = b"", time.monotonic() + 60
    try:
        while b"pools (tokens)" not in seen:  # the screen is drawn
            assert time.monotonic() < deadline and p.poll() is None, seen[-500:]
            if select.select([master], [], [], 0.5)[0]:
                seen += os.read(master, 65536)
        os.write(master, b"q")
        assert p.wait(15) == 0
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
