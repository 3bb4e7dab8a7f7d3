"""The vLLM connector's asynchronous stores, worker side, in vLLM's venv: the protocol with vLLM's engine.

    python tests/vllm_async_save_check.py

Drives `_Worker` as vLLM's model runner does (wait_for_save, get_finished, build_connector_worker_meta,
handle_preemptions) with copies held back by a gate: a save returns before its copy lands; a store is reported
only once it has landed; a finished request's blocks are released (finished_sending) only after its copies; a
preemption waits for the copies of the preempted request; a copy that raises is reported failed (its slots go
back) and still releases the blocks; with async_save off every copy is done before the save returns. Prints "ok".
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from radixd.vllm.connector import RadixdConnectorMetadata, _Worker


def _worker(async_save: bool) -> tuple[_Worker, threading.Event, list]:
    w = _Worker(SimpleNamespace(async_save=async_save))
    w.layers, w.stream, w.save_stream = [torch.zeros(1)], None, None
    if async_save:
        from concurrent.futures import ThreadPoolExecutor
        w._pool = ThreadPoolExecutor(1)
    gate, copied = threading.Event(), []

    def pairs(groups, pages, twins):  # where the real copy starts: held until the gate opens
        assert gate.wait(30), "the gate never opened"
        if pages == [-1]:
            raise RuntimeError("copy failed")
        copied.append(pages)
        return {}
    w._pairs = pairs
    return w, gate, copied


def _store(sid: int, rid: str, first_slot: int) -> tuple:
    return sid, rid, [[sid]], [first_slot], [], -1


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def main() -> None:
    w, gate, copied = _worker(True)
    t = time.perf_counter()
    w.save(RadixdConnectorMetadata(stores=[_store(1, "r1", 0), _store(2, "r2", 32)]))
    assert time.perf_counter() - t < 1 and copied == [], "the save waited for its copy"
    assert w.finished({"r1"}) is None and w.report() is None  # r1 finished, its copy still out
    gate.set()
    got = []
    _until(lambda: got.append(w.report()) or got[-1] is not None, "the stores were never reported")
    assert got[-1].stored == {1: 1, 2: 1} and not got[-1].failed and copied == [[0], [32]]
    assert w.finished(set()) == {"r1"}  # r1's blocks may go now; r2 still runs
    assert w.finished({"r9"}) is None  # a request with no store: vLLM never kept its blocks

    gate.clear()
    w.save(RadixdConnectorMetadata(stores=[_store(3, "r2", 64)]))
    waiter = threading.Thread(target=w.preempted, args=({"r2"},))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "a preemption did not wait for the preempted request's copy"
    gate.set()
    waiter.join(30)
    assert not waiter.is_alive() and copied[-1] == [64]
    assert w.report().stored == {3: 1}
    w.preempted({"r5"})  # nothing of r5 in flight: returns at once

    w.save(RadixdConnectorMetadata(stores=[_store(4, "r2", -1)]))
    got = []
    _until(lambda: got.append(w.report()) or got[-1] is not None, "the failed copy never landed")
    assert got[-1].failed == {4} and got[-1].stored == {}
    assert w.finished({"r2"}) == {"r2"}
    w.close()

    s, gate, copied = _worker(False)
    gate.set()
    s.save(RadixdConnectorMetadata(stores=[_store(7, "q", 96)]))
    assert copied == [[96]] and s.report().stored == {7: 1} and s.finished({"q"}) is None
    print("ok")


if __name__ == "__main__":
    main()
