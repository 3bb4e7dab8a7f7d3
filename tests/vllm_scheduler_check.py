"""The vLLM connector's scheduler side against a real radixd, in vLLM's venv: lookups off the scheduler thread.

    python tests/vllm_scheduler_check.py TARGET SERVER_PID

Drives `_Scheduler` as vLLM's scheduler does (arrival, asks, finish) and checks: an idle engine waits for a
lookup and gets radixd's hit; a busy engine is answered None at once while radixd is stopped (SIGSTOP), a miss
once the deadline passed, and the lock the late lookup took is released when it lands; stores come from the
slot stock with no call on the scheduler thread, and keep vLLM stepping until the workers report them; closing
leaves no lock and no held slot. Prints "ok".
"""
from __future__ import annotations

import os
import signal
import sys
import time
from types import SimpleNamespace

import numpy as np

from radixd.client import CacheClient
from radixd.vllm.connector import _Scheduler

PAGE = 32


def _request(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, lora_request=None, cache_salt=None)


def _until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def main() -> None:
    target, pid = sys.argv[1], int(sys.argv[2])
    conn = SimpleNamespace(block_size=PAGE, target=target, token=None, load_back=True, lookup_deadline=0.3,
                           slot_stock=1024, hma=False, groups=["full"], local_index=True, async_save=True,
                           relay=True, store_tick=0.02)
    rng = np.random.default_rng(3)
    a = rng.integers(3, 500, 5 * PAGE + 7).tolist()
    b = rng.integers(3, 500, 3 * PAGE + 1).tolist()
    with CacheClient(target, name="check") as c:
        slots = c.alloc(4 * PAGE)
        c.insert(np.asarray(a[:4 * PAGE], np.int32), slots)  # radixd holds 4 of a's 5 whole pages
        sched = _Scheduler(conn)

        # idle engine: the ask waits for the lookup; the hit is radixd's 4 pages (the last token never counts)
        sched.arrived(_request("a", a))
        assert sched.matched(_request("a", a), 0) == 4 * PAGE
        assert sched.matched(_request("a", a), PAGE) == 3 * PAGE  # beyond what vLLM has itself
        assert c.stats()["receipts"] == 1

        # the slot stock: a first short step allocates on the scheduler thread, later ones take from the stock
        pages = sched.background.take_pages(2)
        assert pages is None
        _until(lambda: len(sched.background._stock) >= 4, "the stock was never filled")
        before = sched.rpcs
        got = sched.background.take_pages(2)
        assert got is not None and got.shape == (2, PAGE) and sched.rpcs == before
        sched.background.free(got.reshape(-1))

        # busy engine (a is running) and radixd stopped: None at once, then a miss past the deadline
        os.kill(pid, signal.SIGSTOP)
        try:
            sched.arrived(_request("b", b))
            t0 = time.perf_counter()
            answers = []
            while True:
                t = time.perf_counter()
                n = sched.matched(_request("b", b), 0)
                answers.append(time.perf_counter() - t)
                if n is not None:
                    break
                time.sleep(0.01)  # vLLM's next step
            assert n == 0 and time.perf_counter() - t0 >= conn.lookup_deadline, (n, time.perf_counter() - t0)
            assert max(answers) < 0.02, f"an ask blocked the scheduler for {max(answers) * 1e3:.1f} ms"
        finally:
            os.kill(pid, signal.SIGCONT)
        _until(lambda: sched.lookups.idle() and sched.background.idle(), "the late lookup never landed")
        _until(lambda: c.stats()["receipts"] == 1, "the late lookup's lock was kept")  # a's alone

        # a step that computes b's 3 whole pages plans their store (slots from the stock): until the workers report
        # it, the connector has work pending, and vLLM keeps stepping for it (has_pending_push_work)
        from radixd.vllm.connector import RadixdConnector
        step = SimpleNamespace(preempted_req_ids=None, num_scheduled_tokens={"b": len(b)},
                               scheduled_new_reqs=[SimpleNamespace(req_id="b", block_ids=([7, 8, 9, 10],),
                                                                   num_computed_tokens=0)],
                               scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                                     num_computed_tokens=[]))
        meta = sched.build(step)
        assert len(meta.stores) == 1 and meta.stores[0][2] == [[7, 8, 9]], meta.stores
        owner = SimpleNamespace(_sched=sched)
        assert RadixdConnector.has_pending_push_work(owner)
        sid = meta.stores[0][0]
        sched.stored({sid: 1}, workers=2)  # one of two ranks copied its heads: not published yet
        assert RadixdConnector.has_pending_push_work(owner) and sid in sched.stores
        from radixd.vllm.connector import RadixdWorkerMetadata
        assert RadixdWorkerMetadata({sid: 1}).aggregate(RadixdWorkerMetadata({sid: 1, 99: 1})).stored == {sid: 2, 99: 1}
        sched.stored({sid: 1}, workers=2)  # the other rank's report, a step later: published by the store thread
        assert not RadixdConnector.has_pending_push_work(owner)
        assert not RadixdConnector.has_pending_push_work(SimpleNamespace(_sched=None))  # (a worker's connector)
        _until(lambda: c.match_prefix(np.asarray(b[:3 * PAGE], np.int32)).matched_len == 3 * PAGE,
               "b's store was never published")

        sched.finished("a")
        sched.finished("b")
        _until(lambda: c.stats()["receipts"] == 0, "a finished request kept its lock")
        sched.close()
        s = c.stats()
        assert s["receipts"] == 0 and s["held_tokens"] == 0, s
        assert c.check() == []
    print("ok")


if __name__ == "__main__":
    main()
