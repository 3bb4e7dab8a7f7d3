"""`RadixdConnector`: radixd as the shared, external KV tier of vLLM engines (vLLM 0.32.0's KV connector API).

vLLM keeps its own block pool; radixd is the tier behind it that outlives engines and is shared by them.
Scheduler side (one radixd session per engine, so a dead engine loses its locks and slots within a second):
  get_num_new_matched_tokens  MatchPrefix(lock) on the prompt (page aligned, before its last token), a
                              LoadBack first when radixd holds more on its host tier; the pages beyond
                              vLLM's own hit are the external hit;
  update_state_after_alloc    remembers which tokens to load (or nothing);
  build_connector_meta        loads (radixd pages -> the request's new blocks) and stores: prompt pages
                              computed by this step beyond what radixd has get radixd slots (Alloc);
  update_connector_output     the workers report stores done: the pages are published (CacheUnfinished,
                              which frees duplicates and re-locks the longer prefix);
  request_finished            publishes what is still pending, then releases the lock.
Worker side: maps radixd's device pool, checks the geometry, and copies whole pages (`start_load_kv` before
the forward, stores in `wait_for_save` after it; on a side stream on GPU, waited for before returning),
converting layouts exactly.
Configure with `kv_connector_extra_config`: `radixd_target` (default `$RADIXD_TARGET` or the default
socket), `radixd_token`, `load_back` (default true).
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorWorkerMetadata)

from radixd.client import CacheClient, RadixdError
from radixd.server.config import DEFAULT_SOCKET

from .layout import Geometry, geometry, load_blocks, probe_cpu_layout, save_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("radixd.vllm")
SUPPORTED_VLLM = "0.32.0"


@dataclass
class RadixdConnectorMetadata(KVConnectorMetadata):
    """One step's copies: loads (vLLM blocks, radixd page first slots) and stores (id, blocks, pages)."""

    loads: list[tuple[list[int], list[int]]] = field(default_factory=list)
    stores: list[tuple[int, list[int], list[int]]] = field(default_factory=list)


@dataclass
class RadixdWorkerMetadata(KVConnectorWorkerMetadata):
    """Store ids a worker has copied into radixd this step."""

    stored: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, RadixdWorkerMetadata)
        return RadixdWorkerMetadata(self.stored | other.stored)


@dataclass
class _Req:
    tokens: list[int]
    ns: dict[str, str]
    receipt: int = 0
    prefix: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # radixd slots, locked
    local: int = 0  # vLLM's own computed tokens when matched
    load: Optional[tuple[int, int]] = None  # (first token, tokens) to load this step
    blocks: list[int] = field(default_factory=list)
    planned: int = 0  # tokens whose store has been planned (published or in flight)
    inflight: set[int] = field(default_factory=set)
    finished: bool = False
    storing: bool = True
    pending: bool = False  # its lookup is still on the lookup thread
    asked: float = 0.0  # when the lookup was started (a lookup older than the deadline is a miss)


def _namespace(request: "Request") -> dict[str, str]:
    lora = getattr(request, "lora_request", None)
    return dict(extra_key=lora.lora_name if lora is not None else "", cache_salt=request.cache_salt or "")


class RadixdConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by a radixd server (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.target = extra.get("radixd_target") or os.environ.get("RADIXD_TARGET") or \
            "unix://" + DEFAULT_SOCKET[len("unix:"):]
        self.token = extra.get("radixd_token") or os.environ.get("RADIXD_TOKEN")
        self.load_back = str(extra.get("load_back", "true")).lower() not in ("0", "false", "no")
        self.lookup_deadline = float(extra.get("lookup_deadline_ms", 200)) / 1000  # then a lookup is a miss
        self.block_size = vllm_config.cache_config.block_size
        self.cache_dtype = vllm_config.cache_config.cache_dtype
        self.model_dtype = vllm_config.model_config.dtype
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp != 1:
            raise ValueError(f"radixd connector: tensor_parallel_size {tp} is not supported yet (use 1)")
        self._sched: Optional[_Scheduler] = None
        self._worker: Optional[_Worker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _Scheduler(self)
        else:
            self._worker = _Worker(self)

    # ------------------------------------------------------------ scheduler side
    def on_new_request(self, request: "Request") -> None:
        self._sched.arrived(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        n = self._sched.matched(request, num_computed_tokens)
        return n, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._sched.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._sched.build(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, RadixdWorkerMetadata):
            self._sched.stored(meta.stored)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sched.finished(request.request_id)
        return False, None

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RadixdConnectorMetadata)
        self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # stores copy every layer at once in wait_for_save, after the forward

    def wait_for_save(self):
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, RadixdConnectorMetadata)
            self._worker.save(meta)

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        return self._worker.report()

    def shutdown(self):
        if self._sched is not None:
            self._sched.close()
        if self._worker is not None:
            self._worker.close()


class _Lookups:
    """radixd calls off the scheduler thread: prefix lookups (one MatchPrefix with lock per namespace for every
    request that arrived since the last round, load-backs of host hits waited for here) and releases (one
    Unlock for every receipt let go since the last round). The scheduler never waits on them."""

    def __init__(self, client: CacheClient, load_back: bool):
        self.client, self.load_back = client, load_back
        self._cv = threading.Condition()
        self._queue: list[tuple[str, np.ndarray, tuple]] = []
        self._unlocks: list[int] = []
        self._done: dict[str, tuple[np.ndarray, int]] = {}
        self._dropped: set[str] = set()  # given up on while in flight: released once they land
        self._busy = False
        self._stop = False
        self.rpcs = 0  # calls made here (for tests and benchmarks)
        self._thread = threading.Thread(target=self._run, name="radixd-lookups", daemon=True)
        self._thread.start()

    def submit(self, rid: str, tokens: np.ndarray, ns: dict[str, str]) -> None:
        with self._cv:
            self._queue.append((rid, tokens, tuple(sorted(ns.items()))))
            self._cv.notify()

    def take(self, rid: str) -> Optional[tuple[np.ndarray, int]]:
        with self._cv:
            return self._done.pop(rid, None)

    def drop(self, rid: str) -> None:
        """The scheduler stopped waiting for this lookup: whatever it locked is released."""
        with self._cv:
            done = self._done.pop(rid, None)
            if done is None:
                self._dropped.add(rid)
            elif done[1]:
                self._unlocks.append(done[1])
                self._cv.notify()

    def release(self, receipt: int) -> None:
        if receipt:
            with self._cv:
                self._unlocks.append(receipt)
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._queue or self._unlocks or self._stop):
                    self._cv.wait()
                if self._stop and not self._queue and not self._unlocks:
                    return
                batch, self._queue = self._queue, []
                unlocks, self._unlocks = self._unlocks, []
                self._busy = True
            results, failed = {}, []
            try:
                if unlocks:
                    self._unlock(unlocks)
                if batch:
                    results, failed = self._lookup(batch)
            finally:
                with self._cv:
                    self._busy = False
                    late = []
                    for rid, res in results.items():
                        if rid in self._dropped:
                            self._dropped.discard(rid)
                            late.append(res[1])
                        else:
                            self._done[rid] = res
                    self._unlocks.extend(r for r in late + failed if r)
                    self._cv.notify_all()

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

    def _lookup(self, batch: list) -> tuple[dict[str, tuple[np.ndarray, int]], list[int]]:
        """Each request's locked prefix (empty on a miss or an error), and receipts of loads that failed."""
        out: dict[str, tuple[np.ndarray, int]] = {}
        failed_receipts: list[int] = []
        groups: dict[tuple, list] = {}
        for rid, tokens, ns in batch:
            groups.setdefault(ns, []).append((rid, tokens))
        for ns, items in groups.items():
            try:
                self.rpcs += 1
                matches = self.client.match_batch([t for _, t in items], lock=True, **dict(ns))
            except RadixdError as e:  # radixd down or refusing: misses, never failed requests
                log.warning("radixd match failed: %s", e)
                for rid, _ in items:
                    out[rid] = (_EMPTY, 0)
                continue
            loads = []
            for (rid, _), m in zip(items, matches):
                out[rid] = (m.indices, m.receipt_id)
                if self.load_back and m.host_hit_len:
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
                        out[rid] = (_EMPTY, 0)
        return out, failed_receipts

    def idle(self) -> bool:
        with self._cv:
            return not (self._queue or self._busy)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30)


_EMPTY = np.zeros(0, np.int64)


class _Scheduler:
    """Per-engine bookkeeping: what each request locked in radixd, loads, and stores in flight. On the scheduler
    thread it makes at most two calls a step, both batched over every request of the step: one Alloc for the
    pages to store and one CacheUnfinished to publish them; lookups and releases run on `_Lookups`."""

    def __init__(self, conn: RadixdConnector):
        self.conn = conn
        self.page = conn.block_size
        self.client = CacheClient(conn.target, token=conn.token, name=f"vllm-scheduler-{os.getpid()}")
        info = self.client.info()
        if info["page_size"] != self.page:
            raise ValueError(f"radixd connector: radixd's page size {info['page_size']} != vLLM's block size "
                             f"{self.page}; start radixd with --page-size {self.page}")
        self.reqs: dict[str, _Req] = {}
        self.stores: dict[int, tuple[str, int, int, np.ndarray]] = {}  # id -> (request, start, end, slots)
        self._next = 0
        self.hits = 0  # tokens loaded from radixd (for tests and logs)
        self.rpcs = 0  # calls made on the scheduler thread
        self.lookups = _Lookups(self.client, conn.load_back)

    def _align(self, n: int) -> int:
        return max(n, 0) - max(n, 0) % self.page

    def _release(self, st: _Req) -> None:
        self.lookups.release(st.receipt)
        st.receipt = 0

    def arrived(self, request: "Request") -> None:
        """A request was queued: start its lookup now, so its answer is there when it is scheduled."""
        rid = request.request_id
        if rid in self.reqs or request.prompt_token_ids is None:
            return
        toks = request.prompt_token_ids
        st = _Req(list(toks), _namespace(request))
        self.reqs[rid] = st
        n = self._align(len(toks) - 1)  # the engine always computes the last prompt token itself
        if n:
            st.pending, st.asked = True, time.monotonic()
            self.lookups.submit(rid, np.asarray(toks[:n], dtype=np.int32), st.ns)

    def matched(self, request: "Request", num_computed: int) -> Optional[int]:
        """Tokens radixd holds beyond vLLM's own; None while the lookup is still on its way (asked again next
        step); a lookup past its deadline is a miss."""
        rid = request.request_id
        st = self.reqs.get(rid)
        if st is None:
            self.arrived(request)
            st = self.reqs.get(rid)
            if st is None:
                return 0
        if st.pending:
            res = self.lookups.take(rid)
            if res is None:
                if time.monotonic() - st.asked < self.conn.lookup_deadline:
                    return None
                self.lookups.drop(rid)
                log.info("radixd lookup for %s took longer than %.0f ms: a miss", rid,
                         self.conn.lookup_deadline * 1e3)
                res = (_EMPTY, 0)
            st.pending = False
            st.prefix, st.receipt = res
            st.planned = len(st.prefix)
        st.local = num_computed
        return max(len(st.prefix) - num_computed, 0)

    def allocated(self, request: "Request", num_external: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is not None and num_external > 0:
            st.load = (st.local, num_external)

    def build(self, so: "SchedulerOutput") -> RadixdConnectorMetadata:
        meta = RadixdConnectorMetadata()
        self._plans: list[tuple[str, _Req, int, int]] = []
        for nr in so.scheduled_new_reqs:
            st = self.reqs.get(nr.req_id)
            if st is None:
                continue
            st.blocks = list(nr.block_ids[0])
            if st.load is not None:
                start, n = st.load
                pages = st.prefix[start:start + n:self.page].tolist()
                meta.loads.append((st.blocks[start // self.page:(start + n) // self.page], pages))
                self.hits += n
                st.load = None
            self._plan(nr.req_id, st, nr.num_computed_tokens + so.num_scheduled_tokens[nr.req_id], meta)
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            st = self.reqs.get(rid)
            if st is None:
                continue
            nb = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                st.blocks = list(nb[0]) if nb else []
            elif nb:
                st.blocks.extend(nb[0])
            self._plan(rid, st, cr.num_computed_tokens[i] + so.num_scheduled_tokens[rid], meta)
        self._allocate(meta)
        return meta

    def _plan(self, rid: str, st: _Req, computed_after: int, meta: RadixdConnectorMetadata) -> None:
        """Note the prompt pages this step completes beyond what radixd has (slots come in `_allocate`)."""
        end = min(self._align(computed_after), self._align(len(st.tokens)))
        start = st.planned
        if not st.storing or st.finished or st.pending or end <= start or end // self.page > len(st.blocks):
            return
        self._plans.append((rid, st, start, end))

    def _allocate(self, meta: RadixdConnectorMetadata) -> None:
        """One Alloc for every page the step stores."""
        plans, self._plans = self._plans, []
        if not plans:
            return
        try:
            self.rpcs += 1
            got = self.client.alloc([end - start for _, _, start, end in plans])
        except RadixdError as e:  # radixd is full of locked pages: this step's pages are not cached there
            log.info("radixd alloc failed (%s); not storing %d requests", e, len(plans))
            for _, st, _, _ in plans:
                st.storing = False
            return
        for (rid, st, start, end), slots in zip(plans, got):
            slots = np.asarray(slots, dtype=np.int64)
            self._next += 1
            self.stores[self._next] = (rid, start, end, slots)
            st.inflight.add(self._next)
            st.planned = end
            meta.stores.append((self._next, st.blocks[start // self.page:end // self.page],
                                slots[::self.page].tolist()))

    def stored(self, ids: set[int]) -> None:
        """Workers copied these stores: publish them all in one CacheUnfinished, then finish requests that
        waited on them."""
        items, owners, lost = [], [], []
        for sid in sorted(ids):
            entry = self.stores.pop(sid, None)
            if entry is None:
                continue
            rid, start, end, slots = entry
            st = self.reqs.get(rid)
            if st is None:
                lost.append(slots)
                continue
            st.inflight.discard(sid)
            if start != len(st.prefix) or any(o is st for o, _ in owners):  # cannot attach (yet): dropped
                lost.append(slots)
                st.storing = False
                continue
            items.append(dict(tokens=np.asarray(st.tokens[:end], dtype=np.int32),
                              indices=np.concatenate([st.prefix, slots]), prev_prefix_len=len(st.prefix),
                              receipt_id=st.receipt, **st.ns))
            owners.append((st, slots))
        if items:
            try:
                self.rpcs += 1
                res = self.client.cache_unfinished(items)
                for (st, _), (_, m) in zip(owners, res):
                    st.prefix, st.receipt = m.indices, m.receipt_id
            except RadixdError as e:
                log.warning("radixd publish of %d requests failed: %s", len(items), e)
                for st, slots in owners:
                    lost.append(slots)
                    st.storing = False
        if lost:
            self._free(np.concatenate(lost))
        for rid in [rid for rid, st in self.reqs.items() if st.finished and not st.inflight]:
            self._finish(rid)

    def _free(self, slots: np.ndarray) -> None:
        try:
            self.rpcs += 1
            self.client.free(slots)
        except RadixdError as e:
            log.warning("radixd free failed: %s", e)

    def finished(self, rid: str) -> None:
        st = self.reqs.get(rid)
        if st is None:
            return
        st.finished = True
        if st.pending:  # finished (or aborted) before its lookup came back
            st.pending = False
            self.lookups.drop(rid)
        if not st.inflight:  # otherwise the workers' report of this step's stores finishes it
            self._finish(rid)

    def _finish(self, rid: str) -> None:
        st = self.reqs.pop(rid)
        self._release(st)

    def close(self) -> None:
        for rid in list(self.reqs):
            if self.reqs[rid].pending:
                self.lookups.drop(rid)
            self._finish(rid)
        self.lookups.close()
        self.client.close()


_LAYER = re.compile(r"(\d+)")


def _probe_cpu_kernel(geo: Geometry, conn: RadixdConnector) -> Geometry:
    """The block layout of the CPU attention kernel this engine runs, learnt from the kernel itself."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(conn.model_dtype, geo.block_size, geo.head_dim, conn.cache_dtype)

    def write(key, value, key_cache, value_cache, slots) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype=conn.cache_dtype)

    return probe_cpu_layout(geo, write, f"vLLM's CPU attention kernel '{isa}' (kv cache dtype {conn.cache_dtype})")


class _Worker:
    """Maps radixd's device pool and copies pages between it and vLLM's blocks."""

    def __init__(self, conn: RadixdConnector):
        self.conn = conn
        self.layers: list[torch.Tensor] = []
        self.geo: Optional[Geometry] = None
        self.done: set[int] = set()
        self.pools = None
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=lambda n: [int(x) for x in _LAYER.findall(n)] or [0])
        self.layers = [kv_caches[n] for n in names]
        self.geo = geometry(self.layers[0], self.conn.block_size)
        if self.geo.layout == "cpu":
            self.geo = _probe_cpu_kernel(self.geo, self.conn)
        client = CacheClient(self.conn.target, token=self.conn.token, attach=False)
        try:
            self.pools = client.map_pools(self.layers[0].device)
        finally:
            client.close()
        dev = self.pools.device[0]
        d = dev.descriptor
        want = (len(self.layers), self.geo.kv_heads, self.geo.head_dim, self.geo.block_size, self.geo.dtype)
        have = (d.num_layers, d.kv_heads, d.head_dim, d.page_size, dev.k_buffer[0].dtype if dev.k_buffer else None)
        if d.mla or want != have:
            raise ValueError("radixd connector: the KV geometry differs (layers, kv heads, head dim, page size, "
                             f"dtype): vLLM has {want}, radixd has {have}; start radixd with matching "
                             "--layers/--kv-heads/--head-dim/--page-size/--dtype (or --model-config)")
        if dev.k_buffer[0].device != self.layers[0].device:
            raise ValueError(f"radixd connector: radixd's pool is on {dev.k_buffer[0].device}, vLLM's KV on "
                             f"{self.layers[0].device}")
        self.k, self.v = dev.k_buffer, dev.v_buffer
        dv = self.layers[0].device
        self.stream = torch.cuda.Stream(device=dv) if dv.type == "cuda" else None  # copies off the compute stream

    def _copy(self, fn) -> None:
        """Run page copies on the side stream (GPU), ordered after the forward's writes, and wait for them:
        loads must land before the forward reads, stores before vLLM may reuse the blocks."""
        if self.stream is None:
            fn()
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()
        self.stream.synchronize()

    def _idx(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.layers[0].device)

    def load(self, meta: RadixdConnectorMetadata) -> None:
        def run() -> None:
            for blocks, pages in meta.loads:
                b, p = self._idx(blocks), self._idx(pages)
                for i, kv in enumerate(self.layers):
                    load_blocks(kv, self.geo, b, self.k[i], self.v[i], p)
        if meta.loads:
            self._copy(run)

    def save(self, meta: RadixdConnectorMetadata) -> None:
        def run() -> None:
            for sid, blocks, pages in meta.stores:
                b, p = self._idx(blocks), self._idx(pages)
                for i, kv in enumerate(self.layers):
                    save_blocks(kv, self.geo, b, self.k[i], self.v[i], p)
        if meta.stores:
            self._copy(run)
            self.done.update(sid for sid, _, _ in meta.stores)

    def report(self) -> Optional[RadixdWorkerMetadata]:
        if not self.done:
            return None
        out, self.done = RadixdWorkerMetadata(self.done), set()
        return out

    def close(self) -> None:
        self.k = self.v = []
        if self.pools is not None:
            self.pools.close()
            self.pools = None
