"""Off the engine's scheduler thread: prefix lookups, publishes, releases and a stock of slots, each on its own
thread and batched, so an engine integration never waits on a radixd call while it has other work."""
from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
from collections import deque
from functools import partial
from typing import Any, Callable, Hashable, Optional

import numpy as np

from .client import CacheClient
from .errors import RadixdError

log = logging.getLogger("radixd.client")
EMPTY = np.zeros(0, np.int64)


class Inbox:
    """Work an engine's scheduler thread hands to one of these threads, with no lock and no system call on its side
    while the thread is awake: on a cache-cold scheduler thread a Condition's notify cost about 35 us, and waking a
    sleeping thread (a futex call) 35 us more, twice the rest of a hook. The thread polls every `tick` while work
    keeps coming and sleeps after `rest` seconds without any; a post then wakes it (that one call pays the wake).
    The tick is 5 ms: each poll takes the GIL, and against a Python-heavy CPU forward a 1 ms tick was measured
    costing it 3%, 2 ms 0.7%, 5 ms under 0.1%. A waiter (an engine with nothing else to run) rings at once.
    Against vLLM's real CPU forward each poll costs more than that (it takes the GIL from the forward in mid-step,
    and the forward's thread then waits to be woken): `poll=False` never polls (every post to a sleeping thread
    wakes it: a thread whose work comes seldom, as lookups with a local index answering misses), and a longer `tick`
    polls less (a thread whose work can wait, as publishes: bench/vllm_bench.py read a miss at 1k tokens 1.032x
    with the vLLM store thread's tick at 20 ms, 1.041x at 5 ms, medians of 3 runs)."""

    def __init__(self, tick: float = 0.005, rest: float = 1.0, poll: bool = True):
        self.tick, self.rest, self.poll = tick, rest, poll
        self.items: deque = deque()
        self._bell = threading.Lock()
        self._bell.acquire()  # held: not rung
        self._asleep = False
        self._last = time.monotonic()

    def post(self, item: Any) -> None:
        self.items.append(item)
        if self._asleep:
            self.ring()

    def nudge(self) -> None:
        """Something besides a post needs the thread (a refill): wake it if it sleeps, else its next tick sees it."""
        if self._asleep:
            self.ring()

    def ring(self) -> None:
        """Wake the thread now (someone waits on it, or it must stop)."""
        try:
            self._bell.release()
        except RuntimeError:  # rung already
            pass

    def wait(self, ready: Callable[[], bool], until: Callable[[], Optional[float]] = lambda: None) -> None:
        """The thread's side: until ready(), polling each tick while work came within `rest`, else asleep until rung
        (a post before `_asleep` is set is seen by the check after it; one after it rings) or until the monotonic
        time `until()` names (None: no deadline); not polling, asleep whenever there is nothing to do."""
        while not ready():
            if self.poll and (time.monotonic() - self._last < self.rest or self.items):  # (work held back polls,
                # never sleeps)
                self._bell.acquire(timeout=self.tick)
                continue
            self._asleep = True
            if not ready():
                deadline = until()
                if deadline is None:
                    self._bell.acquire()
                else:
                    self._bell.acquire(timeout=max(deadline - time.monotonic(), 0.001))
            self._asleep = False
        self._last = time.monotonic()

    def nap(self, seconds: float) -> None:
        """Sleep up to `seconds`, ended early by a ring."""
        if seconds > 0:
            self._bell.acquire(timeout=seconds)

    def drain(self) -> list:
        out = []
        try:
            while True:
                out.append(self.items.popleft())
        except IndexError:
            return out


class PressureWatch:
    """radixd's pressure counter (GetInfo's `pressure_segment`), mapped read-only: it goes up when an Alloc found the
    pool short while sessions held slots, and a stock holder that sees it change returns its stock."""

    def __init__(self, segment: str):
        self.mm: Optional[mmap.mmap] = None
        if segment:
            try:
                with open(os.path.join("/dev/shm", segment), "rb") as f:
                    self.mm = mmap.mmap(f.fileno(), 8, prot=mmap.PROT_READ)
            except OSError:  # another node's radixd (over TCP): stocks go back when idle only
                self.mm = None
        self.seen = self.value()

    def value(self) -> int:
        return struct.unpack_from("<Q", self.mm, 0)[0] if self.mm is not None else 0

    def changed(self) -> bool:
        """Whether radixd asked for stocks back since the last look (then the look counts as seen)."""
        if self.mm is None:
            return False
        v = self.value()
        if v == self.seen:
            return False
        self.seen = v
        return True


class Lookups:
    """Prefix lookups off an engine's scheduler thread: one MatchPrefix with lock per namespace for every key
    submitted since the last round, load-backs of host hits (when asked) waited for here. Results are taken by
    key; a lookup given up on is released when it lands."""

    def __init__(self, client: CacheClient, load_back: bool, stores: "Stores", hybrid: bool = False,
                 linger: float = 0.001, hand_over: bool = False, firsts: int = 0,
                 prefetch: Optional[Callable[[np.ndarray], Any]] = None,
                 unfetch: Optional[Callable[[Any], None]] = None, poll: bool = True):
        self.client, self.load_back, self.stores = client, load_back, stores
        # `prefetch(prefix)`, here, for a hit submitted with prefetch=True: the engine's own copy of the pages it
        # will load (its slots, filled), kept in `fetched` under the key until taken; `unfetch` gets one back that
        # nobody will take (the lookup dropped)
        self.prefetch, self.unfetch = prefetch, unfetch
        self.fetched: dict[Hashable, Any] = {}
        self.hybrid = hybrid  # a hybrid model's server: results are (FULL slots, receipt, SWA twins, state slot)
        # work done here rather than on the scheduler thread, which runs cache-cold after each forward:
        # `hand_over` gives each landed lock to `stores` (held under the lookup's key) before its result is taken;
        # `firsts` (a page size) ends each result with a list of its pages' first slots (what the workers copy)
        self.hand_over, self.firsts = hand_over, firsts
        # while nobody waits on a lookup, a round waits up to `linger` for more requests (an engine adds a burst one
        # by one): one MatchPrefix for the burst instead of one each; a waiter starts the round at once
        self.linger = linger
        self._waiters = 0
        self._cv = threading.Condition()  # results, waiters and idleness; submissions go through the inbox
        self._inbox = Inbox(poll=poll)  # (rid, tokens, namespace, load_back); poll=False: each submit wakes it
        self._done: dict[Hashable, tuple[np.ndarray, int]] = {}
        self._dropped: set[Hashable] = set()  # given up on while in flight: released once they land
        self._busy = False
        self._stop = False
        self.rpcs = 0  # calls made here (for tests and benchmarks)
        self._thread = threading.Thread(target=self._run, name="radixd-lookups", daemon=True)
        self._thread.start()

    def submit(self, rid: Hashable, tokens: Any, ns: dict[str, str], load_back: Optional[bool] = None,
               upto: Optional[int] = None, prefetch: bool = False) -> None:
        """Look the tokens up (locking what matched); `load_back` overrides the default for this key. With `upto`,
        only tokens[:upto], cut on the lookup thread (tokens may grow at the end meanwhile, never change). With
        `prefetch`, a hit is also handed to the `prefetch` hook before its result is posted."""
        self._inbox.post((rid, tokens, ns, self.load_back if load_back is None else load_back, upto, prefetch))

    def take(self, rid: Hashable, wait: float = 0.0) -> Optional[tuple[np.ndarray, int]]:
        """The lookup's result, waiting up to `wait` seconds for it (a wait releases the GIL, so the lookup
        thread runs at once instead of after the interpreter's switch interval, 5 ms per hand-over)."""
        if wait <= 0:
            return self._done.pop(rid, None)
        with self._cv:
            if rid not in self._done:
                self._waiters += 1
                self._inbox.ring()
                try:
                    self._cv.wait_for(lambda: rid in self._done, wait)
                finally:
                    self._waiters -= 1
            return self._done.pop(rid, None)

    def drop(self, rid: Hashable) -> None:
        """The scheduler stopped waiting for this lookup: whatever it locked is released."""
        with self._cv:
            done = self._done.pop(rid, None)
            if done is None:
                self._dropped.add(rid)
            fetched = self.fetched.pop(rid, None)
        if fetched is not None:
            self.unfetch(fetched)
        if done is not None and self.hand_over:
            self.stores.release(rid)
        elif done is not None:
            self.stores.unlock(done[1])

    def _run(self) -> None:
        inbox = self._inbox
        while True:
            inbox.wait(lambda: bool(inbox.items) or self._stop)
            if self._stop and not inbox.items:
                return
            until = time.monotonic() + self.linger
            while not self._stop and not self._waiters and time.monotonic() < until:
                inbox.nap(until - time.monotonic())
            with self._cv:
                self._busy = True  # before the queue empties: idle() never sees neither
                batch = inbox.drain()
            results, failed, fetched = {}, [], {}
            try:
                results, failed = self._lookup(batch)
                if self.firsts:
                    results = {rid: res + (res[0][::self.firsts].tolist(),) for rid, res in results.items()}
                if self.prefetch is not None:
                    fetched = self._prefetch(batch, results)
            finally:
                with self._cv:
                    late = []
                    for rid, res in results.items():
                        if rid in self._dropped:
                            self._dropped.discard(rid)
                            late.append(res[1])
                            if rid in fetched:
                                self.unfetch(fetched.pop(rid))
                            continue
                        if rid in fetched:  # (before the result: whoever takes the result finds it)
                            self.fetched[rid] = fetched.pop(rid)
                        if self.hand_over and res[1]:
                            self.stores.hold(rid, res[0], res[1])
                        self._done[rid] = res
                    for r in late + failed:  # queued before this thread reads idle, so a settle sees them
                        self.stores.unlock(r)
                    self._busy = False
                    self._cv.notify_all()

    def _prefetch(self, batch: list, results: dict) -> dict[Hashable, Any]:
        """The `prefetch` hook's copies of this round's hits that asked for one (a failed one is only a lost head
        start: the engine loads the pages itself)."""
        out = {}
        for item in batch:
            rid = item[0]
            res = results.get(rid)
            if not item[5] or res is None or not len(res[0]) or rid in self._dropped:
                continue
            try:
                got = self.prefetch(res[0])
            except Exception:
                log.exception("radixd prefetch failed")
                continue
            if got is not None:
                out[rid] = got
        return out

    def _lookup(self, batch: list) -> tuple[dict[Hashable, tuple[np.ndarray, int]], list[int]]:
        """Each request's locked prefix (empty on a miss or an error), and receipts of loads that failed."""
        out: dict[Hashable, tuple[np.ndarray, int]] = {}
        failed_receipts: list[int] = []
        groups: dict[tuple, list] = {}
        for rid, tokens, ns, lb, upto, _ in batch:
            groups.setdefault(tuple(sorted(ns.items())), []).append((rid, tokens if upto is None else tokens[:upto], lb))
        for ns, items in groups.items():
            try:
                self.rpcs += 1
                if self.hybrid:
                    for (rid, _, _), m in zip(items, self.client.match_hybrid([t for _, t, _ in items], lock=True,
                                                                              **dict(ns))):
                        out[rid] = (m.indices, m.receipt_id, m.swa_indices, m.mamba_src)
                    continue
                matches = self.client.match_batch([t for _, t, _ in items], lock=True, **dict(ns))
            except RadixdError as e:  # radixd down or refusing: misses, never failed requests
                log.warning("radixd match failed: %s", e)
                for rid, _, _ in items:
                    out[rid] = (EMPTY, 0, EMPTY, -1) if self.hybrid else (EMPTY, 0)
                continue
            loads = []
            for (rid, _, lb), m in zip(items, matches):
                out[rid] = (m.indices, m.receipt_id)
                if lb and m.host_hit_len:
                    try:
                        self.rpcs += 1
                        lb = self.client.load_back(m.receipt_id)
                        out[rid] = (lb.indices, lb.receipt_id)
                        if lb.loaded_len:
                            loads.append((rid, lb.transfer_id))
                    except RadixdError as e:
                        log.warning("radixd load-back failed: %s", e)
            if loads:
                try:
                    self.rpcs += 1
                    _, failed = self.client.wait_transfers([t for _, t in loads])
                except RadixdError as e:
                    failed = [t for _, t in loads]
                    log.warning("radixd wait for load-backs failed: %s", e)
                for rid, t in loads:
                    if t in failed:  # its pages never arrived: a miss (its lock goes with the others)
                        failed_receipts.append(out[rid][1])
                        out[rid] = (EMPTY, 0)
        return out, failed_receipts

    def idle(self) -> bool:
        with self._cv:
            return not (self._inbox.items or self._busy)

    def wait_idle(self, timeout: float) -> None:
        """Until no lookup is out (a request may be waiting on one: it goes first)."""
        with self._cv:
            if not (self._inbox.items or self._busy):
                return
            self._waiters += 1
            self._inbox.ring()
            try:
                self._cv.wait_for(lambda: not (self._inbox.items or self._busy), timeout)
            finally:
                self._waiters -= 1

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._inbox.ring()
        self._thread.join(timeout=30)


class Stores:
    """Publishes, releases and a stock of radixd slots, off an engine's scheduler thread. The thread owns each request's
    radixd lock (prefix slots and receipt) from the moment the scheduler hands it over; operations run in the
    order they were queued, batched per round: one CacheUnfinished for every publish (a request's next chunks in
    the same call, each item extending the one before and taking over its lock), one Unlock, one Free, one Alloc
    refill. A
    request released in the round of its last publish (one that ends at its prefill: a prefill node, a one-token
    answer) is published by CacheFinished, which inserts and releases in one call.
    A model with state layers: each publish donates a state slot (the server keeps a copy of it, and the slot goes
    back into the stock after the call: no Free, no refill), so the stock keeps state slots too, and a release is
    an Unlock."""

    def __init__(self, client: CacheClient, page: int, stock_max: int, linger: float = 0.002, hybrid: bool = False,
                 states: int = 0, capacity: int = 0, prime: int = 0, tick: float = 0.005, idle_return: float = 5.0,
                 pressure: str = "", watch: float = 0.05):
        self.client, self.page, self.stock_max, self.linger = client, page, stock_max, linger
        # radixd's request for stocks back (GetInfo's pressure_segment), looked at every `watch` seconds while a
        # stock is held: an Alloc that finds the pool short waits half a second for stocks before it is refused
        self.pressure, self.watch = PressureWatch(pressure), watch
        self.returned = 0  # stocks given back because radixd asked
        # the stock grows by doubling up to this: at most an eighth of the server (`capacity` tokens, 0: unknown),
        # so that slots held ready never crowd out the cache of a small server; a store larger than that takes its
        # shortfall in a one-off Alloc, never kept
        self.grow_max = min(stock_max, capacity // 8) if capacity else stock_max
        self._bound = max(self.grow_max // page, 0)  # most pages the stock holds
        self._need = 0  # pages a waiting take needs now (more than the stock holds: one refill serves it)
        self.idle_return = idle_return  # seconds without a take after which the stock goes back to radixd
        self._last_take = time.monotonic()
        self._asked = False  # radixd asked for the stock back; it goes at the thread's next turn
        self.hybrid = hybrid  # a hybrid model's server: the stock keeps each page's SWA twin page too
        self.states_max = states  # most state slots held ready (0: the model has no state layers)
        self._twins = np.zeros((0, page), np.int64)
        self._states = EMPTY
        self._want_states = 0
        self._taken_states = 0
        self._mu = threading.Lock()
        self._cv = threading.Condition(self._mu)  # the stock and idleness; operations go through the inbox
        self._inbox = Inbox(tick=tick)
        self._held: dict[Hashable, tuple[np.ndarray, int]] = {}  # rid -> (locked prefix slots, receipt)
        self.refused: set[Hashable] = set()  # requests whose publish failed: the scheduler stops storing them
        self._stock = np.zeros((0, page), np.int64)  # held radixd pages for stores, one row each
        self._heads: list[int] = []  # each stocked page's first slot (listed on this thread, not the scheduler's)
        # pages the stock should hold: `prime` tokens (at most the most it grows to) from the start, filled before
        # the first store asks, so that an engine's first steps do not each refill a stock that is still growing
        self._want = min(prime, self.grow_max) // page
        self._taken = 0  # pages asked for since the last refill
        self._busy = False
        self._stop = False
        self.rpcs = 0
        self.first: Optional[Lookups] = None  # lookups run before this thread's calls
        # `stepped`: the engine calls `flush` at the end of each scheduler step, and a round (with its calls) runs
        # then, for all of the step's work, rather than each tick; work left with no step end (an idle engine)
        # goes after `max_wait`
        self.stepped, self.max_wait = False, 0.5
        self._flush = False
        self._since: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name="radixd-stores", daemon=True)
        self._thread.start()

    def hold(self, rid: Hashable, prefix: np.ndarray, receipt: int) -> None:
        self._inbox.post(("hold", rid, prefix, receipt))

    def publish(self, rid: Hashable, tokens: np.ndarray, start: int, slots: np.ndarray, ns: dict[str, str],
                finished: bool = False, swa_floor: int = 0, state: int = -1,
                copy: Optional[Callable[[], bool]] = None) -> None:
        """Attach `slots` (the pages of tokens[start:start + slots.size], any shape; tokens may run on: they are cut
        here, on this thread) after the request's locked prefix:
        CacheUnfinished (the lock moves to the longer prefix), or CacheFinished when `finished` (the lock goes).
        Hybrid models: below `swa_floor` the pages have no sliding-window KV; `state` is the held slot holding the
        recurrent state as of the last token (models with state layers). `copy` writes the pages' KV, here, before
        any call of the round (it must not raise); False: they are not kept (and a finished request's lock goes)."""
        self._inbox.post(("publish", rid, tokens, start, slots, ns, finished, swa_floor, state, copy))

    def store(self, rid: Hashable, tokens: Any, prefix: np.ndarray, receipt: int, ns: dict[str, str],
              copy: Callable[[int, Optional[np.ndarray]], bool], lookup: Optional[np.ndarray] = None) -> None:
        """A finished request's whole pages (`tokens`: its token ids, any int sequence, whole pages), of which radixd
        holds `prefix` locked by `receipt`, planned here, on this thread, with the rest of the step's stores: slots for
        the pages beyond the prefix from the stock (one Alloc first if it is short), `copy(start, slots)` to write
        tokens[start:]'s KV into them, then one CacheFinished (or, when radixd holds them all, a release that counts
        the hit). `copy` is called once at least (slots None: nothing is stored; later calls must do nothing);
        `lookup`: the tokens the prefix was looked up for, when they may differ from `tokens` (where they disagree,
        the lock goes and every page is published, as radixd dedups the ones it has). Not for a hybrid server."""
        self._inbox.post(("store", rid, tokens, prefix, receipt, ns, copy, lookup))

    def release(self, rid: Hashable, tokens: Optional[np.ndarray] = None, ns: Optional[dict[str, str]] = None) -> None:
        """Let go of the request's lock: with its tokens (any length from what it holds on), as a finished request
        (CacheFinished over what it holds: hits counted, write-through backups started, as SGLang's
        cache_finished_req); else Unlock."""
        self._inbox.post(("release", rid, tokens, ns))

    def unlock(self, receipt: int) -> None:
        if receipt:
            self._inbox.post(("unlock", receipt))

    def free(self, slots: np.ndarray, state: int = -1) -> None:
        if len(slots):
            self._inbox.post(("free", slots))
        if state >= 0:
            self._inbox.post(("free_state", state))

    def take_pages(self, n: int, wait: float = 0.0, states: int = 0, firsts: bool = False) -> Optional[Any]:
        """n stocked pages (rows of slots), or None when the stock is short (after waiting up to `wait` for
        refills); the stock is kept at twice the most pages asked for between two refills, doubled at every
        refill while stores keep coming (at most `slot_stock_tokens`, or n when n is larger), and refilled when
        it falls to half: under a steady stream of stores one Alloc serves many requests. For a hybrid model's
        server, (pages, their SWA twin pages, `states` state slots). With `firsts`, (that, a list of the pages'
        first slots)."""
        with self._mu:  # the plain lock (a Condition's `with` is a Python call): this runs on the scheduler thread
            self._taken += n
            self._taken_states += states
            self._last_take = time.monotonic()
            self._want = max(self._want, min(2 * self._taken, self._bound))
            if states:
                self._want_states = max(self._want_states, min(2 * self._taken_states, max(self.states_max, states)))
            short = len(self._stock) < n or len(self._states) < states
            if short and wait > 0:
                self._need = max(self._need, n)  # (past the bound: the refill allocates it, once)
                self._inbox.ring()
                self._cv.wait_for(lambda: (len(self._stock) >= n and len(self._states) >= states) or self._stop, wait)
                short = len(self._stock) < n or len(self._states) < states
            got = None
            if not short:
                got, self._stock = self._stock[:n], self._stock[n:]
                heads = self._heads[:n]
                del self._heads[:n]
                if self.hybrid:
                    got = (got, self._twins[:n], self._states[:states])
                    self._twins, self._states = self._twins[n:], self._states[states:]
                if firsts:
                    got = (got, heads)
            if self._needs_refill():
                self._inbox.nudge()
            return got

    def _needs_refill(self) -> bool:
        return (self._want > 0 and len(self._stock) <= self._want // 2) or len(self._stock) < self._need or \
            (self._want_states > 0 and len(self._states) <= self._want_states // 2)

    def _idle_deadline(self) -> Optional[float]:
        """When a stock left untouched goes back to radixd, or the next look at radixd's pressure counter (None:
        nothing stocked)."""
        if not len(self._stock) and not len(self._states):
            return None
        idle = self._last_take + self.idle_return
        return min(idle, time.monotonic() + self.watch) if self.pressure.mm is not None else idle

    def _stock_idle(self) -> bool:
        """Whether the stock goes back: untouched for `idle_return`, or radixd asked for it."""
        if not len(self._stock) and not len(self._states):
            return False
        if self.pressure.changed():
            self.returned += 1
            self._asked = True
        return (self._asked or time.monotonic() >= self._last_take + self.idle_return) and not self._inbox.items

    def _return_stock(self) -> None:
        """An idle engine's stock goes back to radixd (the next stores grow it again from nothing)."""
        with self._cv:
            self._asked = False
            stock, self._stock = self._stock, np.zeros((0, self.page), np.int64)
            states, self._states = self._states, EMPTY
            twins, self._twins = self._twins, np.zeros((0, self.page), np.int64)
            self._heads = []
            self._want = self._want_states = self._taken = self._taken_states = 0
        try:
            if self.hybrid and (len(stock) or len(states)):
                self.rpcs += 1
                self.client.free_hybrid(stock.reshape(-1), states=states)
            elif len(stock):
                self.rpcs += 1
                self.client.free(stock.reshape(-1))
        except RadixdError as e:  # (the session ended, or the server went: radixd dropped them already)
            log.info("radixd slot stock return failed: %s", e)

    def flush(self) -> None:
        """The engine's scheduler step ended: its work goes to radixd in one round now (`stepped`)."""
        if self._inbox.items:  # (none: nothing to flush, and no flag left over for the next step's first post)
            self._flush = True
            self._inbox.nudge()

    def _due(self) -> bool:
        """Whether the queued work goes now (stepped: at a step's end, or `max_wait` after it came)."""
        if not self._inbox.items:
            self._since = None
            return self._stop or self._flush and not self.stepped
        if not self.stepped or self._flush or self._stop:
            return True
        now = time.monotonic()
        if self._since is None:
            self._since = now
        return now - self._since >= self.max_wait

    def _run(self) -> None:
        inbox = self._inbox
        while True:
            inbox.wait(lambda: self._due() or self._needs_refill() or self._stock_idle(), self._idle_deadline)
            if self._stop and not inbox.items:
                return
            if self._stock_idle() and not self._due() and not self._needs_refill():
                self._return_stock()
                continue
            due = self._due()  # else a refill alone: the step's work waits for its end
            if due and self.linger and not self._stop and not self.stepped:  # a step's publishes into one call
                time.sleep(self.linger)
            if due and self.first is not None:
                self.first.wait_idle(0.05)
            with self._cv:
                self._busy = True  # before the queue empties: idle() never sees neither
                ops = []
                if due:
                    self._flush, self._since = False, None
                    ops = inbox.drain()
            try:
                self._round(ops)
                self._refill()
            except Exception:  # a bug here must not leave the scheduler waiting on a dead thread
                log.exception("radixd store thread")
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _round(self, ops: list[tuple]) -> None:
        unlocks: list[int] = []
        self._state_frees: list[int] = []
        try:
            self._calls(self._plan_stores(ops, unlocks), unlocks)
        finally:  # (a bug in the round must not leave the scheduler polling a copy that never ran)
            for op in ops:
                if op[0] == "store":
                    op[6](0, None)

    def _plan_stores(self, ops: list[tuple], unlocks: list[int]) -> list[tuple]:
        """The round's `store`s as the holds, publishes and releases they come to, with slots from the stock."""
        stores = [op for op in ops if op[0] == "store"]
        if not stores:
            return ops
        plans: dict[int, tuple] = {}  # id(op) -> (ids, prefix, receipt, pages wanted)
        need = 0
        for op in stores:
            _, rid, tokens, prefix, receipt, ns, copy, lookup = op
            ids = np.asarray(tokens, dtype=np.int32)
            if lookup is not None:
                lookup = np.asarray(lookup, dtype=np.int32)
                k = min(len(lookup), len(ids))
                if lookup[:k].tobytes() != ids[:k].tobytes():  # looked up for other tokens: the lock goes
                    if receipt:
                        unlocks.append(receipt)
                    prefix, receipt = EMPTY, 0
            want = max(len(ids) - len(prefix), 0) // self.page
            plans[id(op)] = (ids, prefix, receipt, want)
            need += want
        stock = self._take_here(need)
        out = []
        for op in ops:
            if op[0] != "store":
                out.append(op)
                continue
            _, rid, _, _, _, ns, copy, _ = op
            ids, prefix, receipt, want = plans[id(op)]
            if want == 0:  # radixd holds it all: releasing it as finished counts the hit
                out += [("hold", rid, prefix, receipt), ("release", rid, ids, ns)]
                copy(len(ids), None)
            elif len(stock) < want:  # radixd had no slots for it: not stored
                copy(0, None)
                if receipt:
                    unlocks.append(receipt)
            else:
                pages, stock = stock[:want], stock[want:]
                start = len(prefix)
                out += [("hold", rid, prefix, receipt), ("publish", rid, ids, start, pages, ns, True, 0, -1,
                                                         partial(copy, start, pages.reshape(-1)))]
        if len(stock):  # (whole stores only: what one could not use goes back)
            with self._cv:
                self._stock = np.concatenate([stock, self._stock])
                self._heads[:0] = stock[:, 0].tolist()
        return out

    def _take_here(self, n: int) -> np.ndarray:
        """On this thread: n stocked pages (fewer if radixd has fewer), after one Alloc when the stock is short."""
        with self._cv:
            self._taken += n
            self._last_take = time.monotonic()
            self._want = max(self._want, min(2 * self._taken, self._bound))
            short = len(self._stock) < n
        if short:  # (to what the stock should hold after the take: no second Alloc after the round)
            self._refill(n + self._want)
        with self._cv:
            got, self._stock = self._stock[:n], self._stock[n:]
            del self._heads[:len(got)]
            return got

    def _calls(self, ops: list[tuple], unlocks: list[int]) -> None:
        """The round's operations, in order, as the fewest calls."""
        batch: list[tuple] = []  # (rid, item, new slots, finished)
        frees: list[np.ndarray] = []
        copied = {id(op): op[9]() for op in ops if op[0] == "publish" and op[9] is not None}
        chained: set[int] = set()  # id() of the items that extend an earlier item of the batch
        for op in ops:
            kind, rid = op[0], op[1]
            if kind == "release" and not (self.hybrid or self.states_max):
                at = next((i for i in range(len(batch) - 1, -1, -1) if batch[i][0] == rid), None)
                if at is not None and (batch[at][3] or id(batch[at][1]) in chained):
                    at = None  # (an item extending another stays unfinished: the one it extends is locked for it)
                if at is not None:  # its last publish is in this round: one CacheFinished inserts and releases
                    batch[at] = batch[at][:3] + (True,)
                    self._held.pop(rid, None)
                    self.refused.discard(rid)
                    continue
            chain = None  # a request's next chunk after its publish in this round: one call takes both (the
            if kind == "publish" and not op[6]:  # second extends the first, whose receipt goes after the call)
                chain = next((b for b in reversed(batch) if b[0] == rid), None)
                if chain is not None and (chain[3] or rid in self.refused):
                    chain = None
            if kind in ("publish", "release") and chain is None and any(b[0] == rid for b in batch):
                self._publish(batch, frees, unlocks)  # its next call needs this one's receipt
                batch = []
            if kind == "hold":
                self._held[rid] = (op[2], op[3])
            elif kind == "publish":
                _, _, tokens, start, slots, ns, finished, floor, state, _ = op
                slots = np.ravel(slots)
                prefix, receipt = (chain[1]["indices"], 0) if chain is not None else self._held.get(rid, (EMPTY, 0))
                if rid in self.refused or start != len(prefix) or not copied.get(id(op), True):
                    frees.append(slots)  # cannot attach (or their KV was not written): the pages are not kept
                    if state >= 0:
                        self._state_frees.append(state)
                    if finished:  # nothing follows a finished request's publish: its lock goes now
                        self._held.pop(rid, None)
                        self.refused.discard(rid)
                        if receipt:
                            unlocks.append(receipt)
                    else:
                        self.refused.add(rid)
                    continue
                item = dict(tokens=tokens[:start + slots.size], indices=np.concatenate([prefix, slots]),
                            prev_prefix_len=len(prefix),
                            receipt_id=receipt, **ns)
                if floor > len(prefix):
                    item["swa_evicted_seqlen"] = floor
                if state >= 0:
                    item["mamba_value"] = state
                if chain is not None:
                    chained.add(id(item))
                batch.append((rid, item, slots, finished))
            elif kind == "release":
                _, _, tokens, ns = op
                prefix, receipt = self._held.pop(rid, (EMPTY, 0))
                self.refused.discard(rid)
                if receipt and tokens is not None and len(prefix) and not self.states_max:
                    batch.append((rid, dict(tokens=tokens[:len(prefix)], indices=prefix, prev_prefix_len=len(prefix),
                                            receipt_id=receipt, **ns), EMPTY, True))
                elif receipt:
                    unlocks.append(receipt)
            elif kind == "unlock":
                unlocks.append(rid)
            elif kind == "free":
                frees.append(np.ravel(rid))
            elif kind == "free_state":
                self._state_frees.append(rid)
        if batch:
            self._publish(batch, frees, unlocks)
        if unlocks:
            self._unlock(unlocks)
        states, self._state_frees = self._state_frees, []
        if frees or states:
            try:
                self.rpcs += 1
                slots = np.concatenate(frees) if frees else EMPTY
                if states:
                    self.client.free_hybrid(slots, states=np.asarray(states, np.int64))
                else:
                    self.client.free(slots)
            except RadixdError as e:
                log.warning("radixd free failed: %s", e)

    def _publish(self, batch: list[tuple], frees: list[np.ndarray], unlocks: list[int]) -> None:
        """One CacheUnfinished for the unfinished items, one CacheFinished for the finished ones."""
        for finished in (False, True):
            part = [b for b in batch if b[3] == finished]
            if not part:
                continue
            try:
                self.rpcs += 1
                if finished:
                    self.client.cache_finished([item for _, item, _, _ in part])
                else:
                    res = self.client.cache_unfinished([item for _, item, _, _ in part])
            except RadixdError as e:  # refused as a whole: nothing changed in radixd
                log.warning("radixd publish of %d requests failed: %s", len(part), e)
                for rid, item, slots, _ in part:
                    frees.append(slots)
                    if "mamba_value" in item:
                        self._state_frees.append(item["mamba_value"])
                    if finished:
                        unlocks.append(item["receipt_id"])
                    else:
                        self.refused.add(rid)
                continue
            for rid, _, _, _ in part:
                if finished:
                    self._held.pop(rid, None)
            if not finished:
                reuse = []
                last = {b[0]: i for i, b in enumerate(part)}
                for i, ((rid, item, _, _), (_, m)) in enumerate(zip(part, res)):
                    if last[rid] != i:  # a later item of the call extended it and took over its lock
                        if m.receipt_id:
                            unlocks.append(m.receipt_id)
                    else:
                        self._held[rid] = (m.indices, m.receipt_id)
                    if "mamba_value" in item:  # the tree kept a copy (or had a state there): the slot is ours
                        reuse.append(item["mamba_value"])  # again, back into the stock for the next store
                if reuse:
                    with self._cv:
                        self._states = np.concatenate([self._states, np.asarray(reuse, np.int64)])

    def _unlock(self, receipts: list[int]) -> None:
        try:
            self.rpcs += 1
            self.client.unlock(receipts)
        except RadixdError as e:  # one stale receipt fails the call: release the rest one by one
            log.info("radixd unlock of %d receipts failed (%s); retrying one by one", len(receipts), e)
            for r in receipts:
                try:
                    self.rpcs += 1
                    self.client.unlock([r])
                except RadixdError:
                    pass

    def _refill(self, need: int = 0) -> None:
        """Top the stock up to what it should hold (at least `need` pages) when it fell to half of that."""
        with self._cv:
            refill = self._needs_refill() or len(self._stock) < need
            if refill:  # stores keep coming: a larger stock next time (one Alloc per more requests)
                self._want = max(self._want, min(2 * self._want, self._bound))
                self._want_states = max(self._want_states, min(2 * self._want_states, self.states_max))
            need = max(need, self._need)
            short = max(self._want - len(self._stock), need - len(self._stock), 0) if refill else 0
            short_states = max(self._want_states - len(self._states), 0) if refill else 0
            self._taken = self._taken_states = self._need = 0
        if short <= 0 and short_states <= 0:
            return
        twins, states = None, EMPTY
        try:
            self.rpcs += 1
            if self.hybrid:
                a = self.client.alloc_hybrid([short * self.page], mamba_states=short_states)
                got = a.full[0].reshape(-1, self.page).astype(np.int64)
                twins = a.swa[0].reshape(-1, self.page).astype(np.int64) if a.swa[0].size else \
                    np.full((short, self.page), -1, np.int64)
                states = a.states.astype(np.int64)
            else:
                got = self.client.alloc(short * self.page).reshape(-1, self.page).astype(np.int64)
        except RadixdError as e:  # radixd is full of locked pages: stores fall back to Alloc on the scheduler
            log.info("radixd slot stock refill failed: %s", e)
            with self._cv:
                self._want = len(self._stock)
                self._want_states = len(self._states)
            return
        with self._cv:
            self._stock = np.concatenate([self._stock, got])
            self._heads.extend(got[:, 0].tolist())
            if twins is not None:
                self._twins = np.concatenate([self._twins, twins])
                self._states = np.concatenate([self._states, states])
            self._cv.notify_all()

    def idle(self) -> bool:
        with self._cv:
            return not (self._inbox.items or self._busy)

    def wait_idle(self, timeout: float) -> None:
        self.flush()
        self._inbox.ring()
        with self._cv:
            self._cv.wait_for(lambda: not (self._inbox.items or self._busy), timeout)

    def stocked(self) -> int:
        """Tokens of radixd slots held ready (radixd counts them as held)."""
        with self._cv:
            return len(self._stock) * self.page

    def close(self) -> None:
        """Release everything still held (locks, stocked slots), then stop."""
        with self._cv:
            for rid in list(self._held):
                self._inbox.items.append(("release", rid, None, None))
            stock, self._stock, self._want = self._stock, np.zeros((0, self.page), np.int64), 0
            self._heads = []
            self._twins = self._twins[:0]
            states, self._states, self._want_states = self._states, EMPTY, 0
            if len(stock):
                self._inbox.items.append(("free", stock.reshape(-1)))
            for st in states.tolist():
                self._inbox.items.append(("free_state", st))
            self._stop = True
            self._cv.notify_all()
        self._inbox.ring()
        self._thread.join(timeout=30)
