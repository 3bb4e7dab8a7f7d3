"""gRPC handlers: decode with numpy, one call into the engine, encode. Errors map to precise statuses."""
from __future__ import annotations

import asyncio
import inspect
import time
from functools import wraps

import grpc
import numpy as np

from radixd.proto import cache_pb2 as pb
from radixd.proto import cache_pb2_grpc as pb_grpc

from . import __version__
from .core import CacheCore, Item, decode_slots, decode_tokens, token_key
from .errors import BadRequest, Conflict, NotFound, ServiceError
from .metrics import Metrics
from .pools.allocator import SlotError
from .tree.errors import TreeError


def _ns(item) -> tuple[str, str]:
    return item.extra_key, item.cache_salt


def _slots(arr: np.ndarray) -> bytes:
    return arr.astype("<i8", copy=False).tobytes()


def _inserted(r) -> pb.InsertResult:
    return pb.InsertResult(prefix_len=r.prefix_len, node_id=r.node_id, freed_duplicates=r.freed_duplicates,
                           adopted=r.adopted, backup_transfer_ids=r.backups, mamba_exist=r.mamba_exist)


def _plain_only(what: str) -> None:
    raise BadRequest(f"{what}: this server holds a plain model (start it with --hybrid-cache for a hybrid one)")


def descriptor_msg(d) -> pb.PoolDescriptor:
    return pb.PoolDescriptor(
        instance_id=d.instance_id, tier=d.tier, backend=d.backend, handle=d.handle, size_bytes=d.size_bytes,
        dtype=d.dtype, num_layers=d.num_layers, kv_heads=d.kv_heads, head_dim=d.head_dim, page_size=d.page_size,
        num_slots=d.num_slots, mla=d.mla, layout=d.layout, gpu_uuid=d.gpu_uuid, device_index=d.device_index,
        pinned=d.pinned, buffers=[pb.BufferDescriptor(name=b.name, offset=b.offset, shape=list(b.shape),
                                                      dtype=b.dtype) for b in d.buffers])


def unary(method):
    """Time the call, count it, and turn engine errors into statuses (the state is untouched)."""
    def deco(fn):
        is_async = inspect.iscoroutinefunction(fn)

        @wraps(fn)
        async def handler(self, request, context):
            t0 = time.perf_counter()
            code = "OK"
            try:
                if is_async:
                    return await fn(self, request)
                return fn(self, request)
            except ServiceError as e:
                code = e.code.name
                err = (e.code, str(e))
            except (TreeError, SlotError) as e:
                from .core import _tree_error
                mapped = _tree_error(e)
                code = getattr(mapped, "code", grpc.StatusCode.INVALID_ARGUMENT).name
                err = (getattr(mapped, "code", grpc.StatusCode.INVALID_ARGUMENT), str(e))
            except Exception:
                code = "INTERNAL"  # a bug, not bad input: counted as such, gRPC reports it as UNKNOWN
                raise
            finally:
                if self.core.events is not None:
                    self.core.events.flush()  # what this call changed, published before it answers
                self.core.pressure.freed()  # (an Alloc waiting on stocks tries again)
                self.metrics.observe(method, time.perf_counter() - t0, code)
            await context.abort(*err)
        return handler
    return deco


class RadixCacheService(pb_grpc.RadixCacheServicer):
    """The RadixCache gRPC service over one CacheCore."""

    def __init__(self, core: CacheCore, metrics: Metrics, stopping: asyncio.Event, eviction_policy: str):
        self.core = core
        self.metrics = metrics
        self.stopping = stopping
        self.policy = eviction_policy
        self.hybrid = getattr(core, "hybrid", False)

    def _items(self, items, with_receipt: bool) -> list[Item]:
        cap = self.core.alloc.capacity
        out = []
        for i, it in enumerate(items):
            item = Item(decode_tokens(it.tokens, f"item {i} tokens"), decode_slots(it.indices, cap, f"item {i} indices"),
                        _ns(it), it.prev_prefix_len, it.priority, it.receipt_id if with_receipt else 0)
            if it.swa_evicted_seqlen or it.HasField("mamba_value"):
                if not self.hybrid:
                    _plain_only(f"item {i} swa_evicted_seqlen / mamba_value")
                item.swa_evicted_seqlen = it.swa_evicted_seqlen
                item.mamba_value = it.mamba_value if it.HasField("mamba_value") else None
            out.append(item)
        return out

    @unary("GetInfo")
    def GetInfo(self, request):
        c = self.core
        info = pb.ServerInfo(instance_id=c.instance_id, page_size=c.alloc.page_size, eviction_policy=self.policy,
                             version=__version__, capacity_tokens=c.alloc.capacity,
                             max_batch_tokens=c.max_batch_tokens, write_policy=c.tree.write_policy or "",
                             device_pools=[descriptor_msg(p.descriptor) for p in c.device_pools],
                             storage=c.storage.store.describe() if c.storage else "", storage_format=c.storage_format,
                             metrics_url=f"http://{self.metrics.address}/metrics" if self.metrics.address else "",
                             pressure_segment=c.pressure.segment)
        if c.host_pool is not None:
            info.host_pool.CopyFrom(descriptor_msg(c.host_pool.descriptor))
        if self.hybrid:
            lay = c.layout
            h = info.hybrid
            h.full_layers.extend(lay.full_layers)
            if c.swa is not None:
                h.sliding_window, h.swa_capacity_tokens = lay.window, c.swa.swa_capacity
                h.swa_layers.extend(lay.swa_layers)
                info.swa_pool.CopyFrom(descriptor_msg(c.swa_pool.descriptor))
            if c.states is not None:
                h.mamba_chunk, h.mamba_states = c.tree.mamba.chunk, c.states.capacity
                h.state_layers.extend(lay.state_layers)
                info.state_pool.CopyFrom(descriptor_msg(c.state_pool.descriptor))
        return info

    async def Attach(self, request, context):
        session = self.core.attach(request.client_name or "anonymous")
        self.metrics.observe("Attach", 0.0, "OK")
        sid, iid = session.session_id, self.core.instance_id
        try:
            yield pb.SessionEvent(session_id=sid, instance_id=iid, message="attached")
            stop = asyncio.ensure_future(self.stopping.wait())
            got = None
            try:
                while True:
                    got = asyncio.ensure_future(session.events.get())
                    done, _ = await asyncio.wait({stop, got}, return_when=asyncio.FIRST_COMPLETED)
                    if got not in done:
                        break
                    t = got.result()
                    if isinstance(t, tuple):  # ("expired", receipt): the lock lease released it
                        yield pb.SessionEvent(session_id=sid, instance_id=iid, message="lock lease expired",
                                              expired_receipt_id=t[1])
                        continue
                    yield pb.SessionEvent(session_id=sid, instance_id=iid, message="transfer done",
                                          transfer_id=t.id, transfer_ok=t.ok)
            finally:  # a client that goes cancels this generator inside the wait: neither future may outlive it
                stop.cancel()
                if got is not None:
                    got.cancel()
            yield pb.SessionEvent(session_id=sid, instance_id=iid, message="server shutting down")
        finally:
            self.core.end_session(session)  # stream ended: client exit, crash, network or shutdown
            self.core.pressure.freed()

    @unary("Alloc")
    async def Alloc(self, request):
        s = self.core.session(request.session_id)
        if self.hybrid:
            full, twins, states, (ev, ev_swa, ev_m) = await self.core.alloc_slots(s, list(request.num_tokens),
                                                                                 request.mamba_states)
            resp = pb.AllocResponse(evicted_tokens=ev, swa_evicted_tokens=ev_swa, mamba_evicted=ev_m,
                                    states=_slots(states))
            for i, a in enumerate(full):
                resp.allocations.add(indices=_slots(a), swa_indices=_slots(twins[i]) if twins else b"")
            return resp
        if request.mamba_states:
            _plain_only("mamba_states")
        allocations, evicted = await self.core.alloc_slots(s, list(request.num_tokens))
        resp = pb.AllocResponse(evicted_tokens=evicted)
        for a in allocations:
            resp.allocations.add(indices=_slots(a))
        return resp

    @unary("Free")
    def Free(self, request):
        s = self.core.session(request.session_id)
        slots = decode_slots(request.indices, self.core.alloc.capacity)
        if self.hybrid:
            states = decode_slots(request.states, self.core.states_capacity or 1, "states")
            freed, n = self.core.free_slots(s, slots, states, request.swa_only)
            return pb.FreeResponse(freed=freed, freed_states=n)
        if request.states or request.swa_only:
            _plain_only("states / swa_only")
        return pb.FreeResponse(freed=self.core.free_slots(s, slots))

    @unary("Insert")
    def Insert(self, request):
        s = self.core.session(request.session_id)
        res = self.core.insert(s, self._items(request.items, False))
        return pb.InsertResponse(results=[_inserted(r) for r in res])

    def _match_hybrid(self, request, s) -> pb.MatchResponse:
        core = self.core
        items = [(token_key(it.tokens, i), (it.extra_key, it.cache_salt), it.lock, it.mamba_cow, it.skip_mamba)
                 for i, it in enumerate(request.items)]
        resp = pb.MatchResponse()
        add = resp.results.add
        for m, r, slot in core.match_hybrid(s, items):
            res = add(device_indices=_slots(m.indices), matched_len=m.matched_len, node_id=m.node_id, receipt_id=r,
                      best_node_id=m.node_id, full_hit_len=m.full_hit_len,
                      swa_indices=_slots(core.swa_twins(m.indices)) if core.swa is not None else b"")
            if m.swa_branching_seqlen is not None:
                res.swa_branching_seqlen = m.swa_branching_seqlen
            if m.mamba_branching_seqlen is not None:
                res.mamba_branching_seqlen = m.mamba_branching_seqlen
            if core.states is not None:
                if m.mamba_src >= 0:
                    res.mamba_src = m.mamba_src
                if slot >= 0:
                    res.mamba_slot = slot
        return resp

    @unary("MatchPrefix")
    async def MatchPrefix(self, request):
        s = self.core.session(request.session_id) if request.session_id else None
        if self.hybrid:
            if self.core.storage is not None:  # what L3 restores beyond both tiers first (as the policy waits)
                await self.core.storage.fetch([(token_key(it.tokens, i), (it.extra_key, it.cache_salt))
                                               for i, it in enumerate(request.items)], self.core)
            return self._match_hybrid(request, s)
        resp = pb.MatchResponse()
        add = resp.results.add  # filled in place: a list of messages would be copied once more, slots and all
        if self.core.storage is None:
            items = [(token_key(it.tokens, i), (it.extra_key, it.cache_salt), it.lock)
                     for i, it in enumerate(request.items)]
            for m, r in self.core.match(s, items):
                add(device_indices=_slots(m.indices), matched_len=m.matched_len, host_hit_len=m.host_hit_len,
                    node_id=m.node_id, receipt_id=r, best_node_id=m.best_node_id)
            return resp
        items = [(decode_tokens(it.tokens, f"item {i} tokens"), _ns(it), it.lock) for i, it in enumerate(request.items)]
        for m, r, pf in await self.core.match_storage(s, items):
            add(device_indices=_slots(m.indices), matched_len=m.matched_len, host_hit_len=m.host_hit_len,
                node_id=m.node_id, receipt_id=r, best_node_id=m.best_node_id, prefetch_len=pf)
        return resp

    @unary("Prefetch")
    async def Prefetch(self, request):
        items = [(decode_tokens(it.tokens, f"item {i} tokens"), _ns(it)) for i, it in enumerate(request.items)]
        res = await self.core.prefetch(items, request.wait)
        return pb.PrefetchResponse(results=[pb.PrefetchResult(prefetch_len=n, host_len=c) for n, c in res])

    @unary("Lock")
    def Lock(self, request):
        s = self.core.session(request.session_id)
        return pb.LockResponse(receipt_id=self.core.lock(s, list(request.node_id)))

    @unary("Unlock")
    def Unlock(self, request):
        s = self.core.session(request.session_id)
        if request.swa_only:
            if not self.hybrid:
                _plain_only("swa_only")
            self.core.unlock(s, list(request.receipt_id), swa_only=True)
        else:
            self.core.unlock(s, list(request.receipt_id))
        return pb.UnlockResponse()

    @unary("CacheFinished")
    def CacheFinished(self, request):
        s = self.core.session(request.session_id)
        res = self.core.cache_finished(s, self._items(request.items, True))
        return pb.CacheFinishedResponse(results=[_inserted(r) for r in res])

    @unary("CacheUnfinished")
    def CacheUnfinished(self, request):
        s = self.core.session(request.session_id)
        resp = pb.CacheUnfinishedResponse()
        for r, m, receipt in self.core.cache_unfinished(s, self._items(request.items, True)):
            resp.results.add(insert=_inserted(r), device_indices=_slots(m.indices), matched_len=m.matched_len,
                             node_id=m.node_id, receipt_id=receipt,
                             swa_indices=_slots(self.core.swa_twins(m.indices)) if self.hybrid else b"")
        hub = self.core.events
        if hub is not None:  # what this call stored is in the batches before event_seq (an engine's local index)
            hub.flush()
            resp.event_seq = hub.next_seq
        return resp

    @unary("Evict")
    async def Evict(self, request):
        if self.hybrid:
            dev, host, swa, mamba = await self.core.evict(request.num_tokens, request.host_tokens, request.swa_tokens,
                                                          request.mamba_states)
            return pb.EvictResponse(evicted_tokens=dev, host_evicted_tokens=host, swa_evicted_tokens=swa,
                                    mamba_evicted=mamba)
        if request.swa_tokens or request.mamba_states:
            _plain_only("swa_tokens / mamba_states")
        dev, host = await self.core.evict(request.num_tokens, request.host_tokens)
        return pb.EvictResponse(evicted_tokens=dev, host_evicted_tokens=host)

    @unary("LoadBack")
    async def LoadBack(self, request):
        s = self.core.session(request.session_id)
        items = [Item(np.zeros(0, np.int32), np.zeros(0, np.int64), ("", ""), receipt=it.receipt_id,
                      mem_quota=it.mem_quota if it.HasField("mem_quota") else None) for it in request.items]
        out = await self.core.load_back(s, items)
        for r in out:  # GPU: answer once each copy's interprocess event is recorded, never before
            if r.transfer is not None and r.transfer.enqueued is not None:
                await r.transfer.enqueued
        resp = pb.LoadBackResponse()
        for r in out:
            resp.results.add(device_indices=_slots(r.indices), loaded_len=r.loaded_len, receipt_id=r.receipt,
                             transfer_id=r.transfer.id if r.transfer else 0, reason=r.reason,
                             ipc_event_handle=r.transfer.ipc_event_handle if r.transfer else b"")
        return resp

    @unary("WaitTransfers")
    async def WaitTransfers(self, request):
        host = self.core.host
        ids = list(request.transfer_ids)
        if host is None and self.hybrid and request.storage and not ids and self.core.storage is not None:
            idle = await self.core.storage.idle(request.timeout_ms / 1000.0 if request.timeout_ms else 0)
            return pb.WaitTransfersResponse(storage_idle=idle)  # (a hybrid model's copies are synchronous)
        if host is None:
            raise Conflict("the host tier is off: there are no transfers")
        unknown = [i for i in ids if host.engine.get(i) is None]
        if unknown:
            raise NotFound(f"unknown transfer id {unknown[0]} (never issued, or finished long ago)")
        timeout = request.timeout_ms / 1000.0 if request.timeout_ms else 0
        done = await host.engine.wait(ids, timeout)
        idle = False
        if request.storage and self.core.storage is not None:
            idle = await self.core.storage.idle(timeout)
        return pb.WaitTransfersResponse(completed=[t.id for t in done], failed=[t.id for t in done if not t.ok],
                                        storage_idle=idle)

    @unary("GetStats")
    def GetStats(self, request):
        return pb.Stats(**self.core.stats())

    @unary("CheckInvariants")
    def CheckInvariants(self, request):
        bad = self.core.check()
        return pb.CheckInvariantsResponse(ok=not bad, violations=bad)

    @unary("Reset")
    def Reset(self, request):
        return pb.ResetResponse(freed_tokens=self.core.reset())

    async def WatchEvents(self, request, context):
        hub = self.core.events
        if hub is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "KV events are off (start the server with --kv-events or --kv-events-endpoint)")
        from .events import Watcher, to_proto
        watcher = Watcher(hub.watcher_limit)
        if request.follow:
            hub.watchers.add(watcher)  # registered before the replay is read: no batch falls between
        try:
            if request.snapshot:
                if request.HasField("from_seq"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "WatchEvents: snapshot and from_seq exclude each other (a snapshot starts "
                                        "from the current state)")
                seq, chunks = await hub.snapshot()
                ts = time.time()
                for i, events in enumerate(chunks):
                    msg = to_proto(seq, ts, events)
                    msg.snapshot, msg.snapshot_more = True, i < len(chunks) - 1
                    yield msg
                last = seq - 1
            elif request.HasField("from_seq"):
                await hub.settled()
                gap, items = hub.replay(request.from_seq)
                if gap is not None and request.from_seq < hub.next_seq:
                    yield pb.EventBatch(gap=True, first_seq=gap, message=f"batches {request.from_seq}..{gap - 1} "
                                        "left the replay buffer: resynchronise")
                last = -1
                for b in items:
                    last = b.seq
                    yield to_proto(b.seq, b.ts, b.events)
            else:
                last = hub.next_seq - 1
            while request.follow:
                batch = await watcher.queue.get()
                if batch is None:
                    yield pb.EventBatch(lost=True, first_seq=hub.next_seq,
                                        message="this consumer fell behind and lost events: resynchronise")
                    return
                if batch.seq > last:
                    last = batch.seq
                    yield batch
        finally:
            hub.watchers.discard(watcher)

    @unary("Echo")
    def Echo(self, request):
        return pb.EchoResponse(payload=request.payload)


class TokenAuth(grpc.aio.ServerInterceptor):
    """Bearer-token check on every call except health probes."""

    def __init__(self, token: str):
        self._ok = f"Bearer {token}"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        self._deny = deny

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        meta = dict(details.invocation_metadata or ())
        if meta.get("authorization") == self._ok:
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._deny)
        if handler.unary_stream:
            async def deny_stream(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
                yield  # pragma: no cover
            return grpc.unary_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(self._deny)
