"""Sync and asyncio clients: attach a session, typed methods per RPC, pool mapping, restart detection."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import grpc
import numpy as np

from radixd.proto import cache_pb2 as pb
from radixd.proto import cache_pb2_grpc as pb_grpc

from . import codec
from .errors import NotFound, RadixdError, ServerRestarted, Unavailable, from_rpc_error


def _credentials(tls: Any):
    """tls: None (insecure), True (system roots) or a PEM root certificate (bytes or path)."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    pem = tls if isinstance(tls, bytes) else open(tls, "rb").read()
    return grpc.ssl_channel_credentials(root_certificates=pem)


class _Base:
    def __init__(self, target: str, token: Optional[str], tls: Any, name: str):
        self.target = target
        self.name = name
        self._meta = (("authorization", f"Bearer {token}"),) if token else ()
        self._creds = _credentials(tls)
        self.session_id = ""
        self.instance_id = ""
        self.event_seq = 0  # KV events: the first batch after every store this client made (CacheUnfinished)
        self.lost = False  # the session is gone (radixd restarted or unreachable): set by any call that found so

    def _seen(self, err: RadixdError) -> RadixdError:
        """Note an error that means this session is gone (an engine integration attaches anew), and return it."""
        if isinstance(err, (ServerRestarted, Unavailable)) or (isinstance(err, NotFound) and "session" in str(err)):
            self.lost = True
        return err

    def _restart_check(self, err: RadixdError, current_instance: str) -> RadixdError:
        if current_instance and self.instance_id and current_instance != self.instance_id:
            e = ServerRestarted(f"server restarted: instance {self.instance_id} is gone, now {current_instance}; "
                                "call reconnect() and map the pools again")
            return e
        return err


class CacheClient(_Base):
    """Blocking client. `CacheClient("unix:///tmp/radixd.sock")` attaches a session immediately."""

    def __init__(self, target: str, *, token: Optional[str] = None, tls: Any = None, name: str = "python-client",
                 attach: bool = True, timeout: float = 30.0):
        super().__init__(target, token, tls, name)
        opts = codec.channel_options()
        self._channel = (grpc.secure_channel(target, self._creds, opts) if self._creds
                         else grpc.insecure_channel(target, opts))
        self._stub = pb_grpc.RadixCacheStub(self._channel)
        self._timeout = timeout
        self._stream = None
        if attach:
            self.attach()

    # ---------------------------------------------------------------- plumbing
    def _call(self, name: str, request):
        try:
            return getattr(self._stub, name)(request, metadata=self._meta, timeout=self._timeout)
        except grpc.RpcError as e:
            err = from_rpc_error(e)
            if isinstance(err, NotFound) and "session" in str(err):
                try:
                    current = self._stub.GetInfo(pb.GetInfoRequest(), metadata=self._meta, timeout=5).instance_id
                except grpc.RpcError:
                    current = ""
                err = self._restart_check(err, current)
            raise self._seen(err) from None

    def attach(self) -> str:
        """Open the session stream; the session lives exactly as long as this stream."""
        self._stream = self._stub.Attach(pb.AttachRequest(client_name=self.name), metadata=self._meta)
        try:
            first = next(self._stream)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        self.session_id, self.instance_id = first.session_id, first.instance_id
        return self.session_id

    def transfer_events(self):
        """Completions of this session's transfers as (transfer_id, ok), read from the session stream."""
        for ev in self._stream:
            if ev.transfer_id:
                yield ev.transfer_id, ev.transfer_ok

    def session_events(self):
        """Everything the server tells this session on its stream, as raw SessionEvent messages (transfer
        completions, receipts released by the lock lease, shutdown)."""
        yield from self._stream

    def reconnect(self) -> str:
        """Drop the old session (if any) and attach a new one, e.g. after ServerRestarted."""
        if self._stream is not None:
            self._stream.cancel()
        return self.attach()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- RPCs
    def info(self) -> dict:
        return codec.info_dict(self._call("GetInfo", pb.GetInfoRequest()))

    def alloc(self, num_tokens: int | Sequence[int]) -> np.ndarray | list[np.ndarray]:
        """Slots for num_tokens (whole pages); a list in, a list out."""
        single = isinstance(num_tokens, int)
        resp = self._call("Alloc", pb.AllocRequest(session_id=self.session_id,
                                                   num_tokens=[num_tokens] if single else list(num_tokens)))
        out = [codec.slots_array(a.indices) for a in resp.allocations]
        return out[0] if single else out

    def free(self, indices: Any) -> int:
        return self._call("Free", pb.FreeRequest(session_id=self.session_id,
                                                 indices=codec.slots_bytes(indices))).freed

    def alloc_hybrid(self, num_tokens: Sequence[int], mamba_states: int = 0) -> codec.Allocated:
        """Hybrid models: FULL slots per size with their SWA twins, and `mamba_states` state slots."""
        return codec.allocated(self._call("Alloc", codec.alloc_hybrid_request(self.session_id, num_tokens,
                                                                             mamba_states)))

    def free_hybrid(self, indices: Any = (), *, states: Any = (), swa_only: bool = False) -> tuple[int, int]:
        """Hybrid models: free held FULL slots (with their SWA twins) or, swa_only, just their SWA twins (decode
        left the window); and held state slots. Returns (slots freed, states freed)."""
        r = self._call("Free", codec.free_hybrid_request(self.session_id, indices, states, swa_only))
        return r.freed, r.freed_states

    def match_hybrid(self, keys: Sequence[Any], *, lock: bool = False, mamba_cow: bool = False,
                     skip_mamba: bool = False, extra_key: str = "", cache_salt: str = "") -> list[codec.HybridMatch]:
        """Hybrid models: match (and lock) in a namespace; mamba_cow gives each request a state slot of its own,
        filled with the matched state."""
        return codec.hybrid_matches(self._call("MatchPrefix", codec.hybrid_match_request(
            self.session_id, keys, lock, mamba_cow, skip_mamba, extra_key, cache_salt)))

    def release_swa(self, receipt_ids: Sequence[int]) -> None:
        """Hybrid models: decode passed the window; release the receipts' SWA (and state) locks, keep FULL's."""
        self._call("Unlock", pb.UnlockRequest(session_id=self.session_id, receipt_id=list(receipt_ids),
                                              swa_only=True))

    def evict_hybrid(self, num_tokens: int = 0, swa_tokens: int = 0, mamba_states: int = 0) -> tuple[int, int, int]:
        """Hybrid models: evict per component; returns (FULL tokens, SWA tokens, states) evicted."""
        r = self._call("Evict", pb.EvictRequest(num_tokens=num_tokens, swa_tokens=swa_tokens,
                                                mamba_states=mamba_states))
        return r.evicted_tokens, r.swa_evicted_tokens, r.mamba_evicted

    def insert(self, tokens: Any, indices: Any, *, extra_key: str = "", cache_salt: str = "",
               prev_prefix_len: int = 0, priority: int = 0) -> codec.Inserted:
        return self.insert_batch([dict(tokens=tokens, indices=indices, extra_key=extra_key, cache_salt=cache_salt,
                                       prev_prefix_len=prev_prefix_len, priority=priority)])[0]

    def insert_batch(self, items: Iterable[dict]) -> list[codec.Inserted]:
        resp = self._call("Insert", codec.insert_request(pb.InsertRequest, self.session_id, items))
        return codec.inserted(resp.results)

    def match_prefix(self, tokens: Any, *, lock: bool = False, extra_key: str = "",
                     cache_salt: str = "") -> codec.Match:
        return self.match_batch([tokens], lock=lock, extra_key=extra_key, cache_salt=cache_salt)[0]

    def match_batch(self, keys: Sequence[Any], *, lock: bool = False, extra_key: str = "",
                    cache_salt: str = "") -> list[codec.Match]:
        return codec.matches(self._call("MatchPrefix", codec.match_request(self.session_id, keys, lock, extra_key,
                                                                           cache_salt)))

    def prefetch(self, keys: Sequence[Any], *, wait: bool = False, extra_key: str = "",
                 cache_salt: str = "") -> list[codec.Prefetched]:
        """Start fetching each key's uncached part from the L3 store (a request was queued)."""
        return codec.prefetched(self._call("Prefetch", codec.prefetch_request(keys, wait, extra_key, cache_salt)))

    def lock(self, node_ids: Sequence[int]) -> list[int]:
        return list(self._call("Lock", pb.LockRequest(session_id=self.session_id, node_id=list(node_ids))).receipt_id)

    def unlock(self, receipt_ids: Sequence[int]) -> None:
        self._call("Unlock", pb.UnlockRequest(session_id=self.session_id, receipt_id=list(receipt_ids)))

    def cache_finished(self, items: Iterable[dict]) -> list[codec.Inserted]:
        resp = self._call("CacheFinished", codec.insert_request(pb.CacheFinishedRequest, self.session_id, items))
        return codec.inserted(resp.results)

    def cache_unfinished(self, items: Iterable[dict]) -> list[tuple[codec.Inserted, codec.Match]]:
        resp = self._call("CacheUnfinished", codec.insert_request(pb.CacheUnfinishedRequest, self.session_id, items))
        self.event_seq = max(self.event_seq, resp.event_seq)
        return [(codec.inserted([r.insert])[0],
                 codec.Match(codec.slots_array(r.device_indices), r.matched_len, 0, r.node_id, r.receipt_id))
                for r in resp.results]

    def evict(self, num_tokens: int, host_tokens: int = 0) -> int:
        """Evict device tokens (and host tokens); returns the device tokens evicted."""
        return self._call("Evict", pb.EvictRequest(num_tokens=num_tokens, host_tokens=host_tokens)).evicted_tokens

    def evict_host(self, host_tokens: int) -> int:
        return self._call("Evict", pb.EvictRequest(host_tokens=host_tokens)).host_evicted_tokens

    def load_back(self, receipt_id: int, mem_quota: Optional[int] = None) -> codec.Loaded:
        """Bring a locked match's host segment back to device; wait_transfers before reading it."""
        return self.load_back_batch([(receipt_id, mem_quota)])[0]

    def load_back_batch(self, items: Sequence[tuple[int, Optional[int]]]) -> list[codec.Loaded]:
        req = pb.LoadBackRequest(session_id=self.session_id, items=[
            pb.LoadBackItem(receipt_id=r, mem_quota=q) if q is not None else pb.LoadBackItem(receipt_id=r)
            for r, q in items])
        return codec.loaded(self._call("LoadBack", req))

    def wait_transfers(self, transfer_ids: Sequence[int], timeout_ms: int = 10_000) -> tuple[list[int], list[int]]:
        """(completed, failed) among transfer_ids, after waiting up to timeout_ms for all of them."""
        r = self._call("WaitTransfers", pb.WaitTransfersRequest(transfer_ids=list(transfer_ids),
                                                                 timeout_ms=timeout_ms))
        return list(r.completed), list(r.failed)

    def wait_storage(self, transfer_ids: Sequence[int] = (), timeout_ms: int = 10_000) -> bool:
        """Wait for these copies, then until no L3 write or prefetch is left; True if L3 went idle."""
        return self._call("WaitTransfers", pb.WaitTransfersRequest(transfer_ids=list(transfer_ids),
                                                                    timeout_ms=timeout_ms, storage=True)).storage_idle

    def stats(self) -> dict[str, int]:
        return codec.stats_dict(self._call("GetStats", pb.GetStatsRequest()))

    def check(self) -> list[str]:
        """Server-side invariant check; an empty list means consistent."""
        r = self._call("CheckInvariants", pb.CheckInvariantsRequest())
        return list(r.violations)

    def reset(self) -> int:
        return self._call("Reset", pb.ResetRequest()).freed_tokens

    def echo(self, payload: bytes) -> bytes:
        return self._call("Echo", pb.EchoRequest(payload=payload)).payload

    def map_pools(self, device: Any = None, host: bool = True, elsewhere: bool = False) -> codec.MappedPools:
        """Map the pools (zero-copy torch views); refuses pools of another server instance.

        `device` (a torch CUDA device or this process's ordinal) takes the device pool on that GPU, matched by UUID
        (ordinals differ between processes); without it, every device pool on a GPU this process sees.
        host=False leaves the host pool unmapped: an engine's workers never copy from it, and mapping it pins it.
        elsewhere=True: with no pool on `device`'s GPU, the first pool on a GPU this process sees."""
        from .pools import map_pool, select_device_pools
        info = self.info()
        if self.instance_id and info["instance_id"] != self.instance_id:
            raise ServerRestarted(f"server restarted (instance {info['instance_id']}); call reconnect() first")
        pools = info["device_pools"]
        if any(p.backend == "cuda" for p in pools):
            from radixd.server.pools import cuda

            from .pools import PoolMappingError
            try:
                want = None
                if device is not None and getattr(device, "type", "cuda") == "cuda":
                    idx = device if isinstance(device, int) else (getattr(device, "index", None) or 0)
                    want = cuda.gpu_uuid(idx)
                pools = select_device_pools(pools, want, lambda: cuda.visible_uuids(cuda._libcuda()), elsewhere)
            except LookupError as e:
                raise PoolMappingError(str(e)) from None
        iid = info["instance_id"]
        return codec.MappedPools([map_pool(p, iid) for p in pools],
                                 map_pool(info["host_pool"], iid) if info["host_pool"] and host else None,
                                 map_pool(info["swa_pool"], iid) if info["swa_pool"] else None,
                                 map_pool(info["state_pool"], iid) if info["state_pool"] else None)


class AsyncCacheClient(_Base):
    """asyncio client: `async with AsyncCacheClient(target) as c: await c.match_prefix(...)`."""

    def __init__(self, target: str, *, token: Optional[str] = None, tls: Any = None, name: str = "python-aio-client",
                 timeout: float = 30.0):
        super().__init__(target, token, tls, name)
        opts = codec.channel_options()
        self._channel = (grpc.aio.secure_channel(target, self._creds, opts) if self._creds
                         else grpc.aio.insecure_channel(target, opts))
        self._stub = pb_grpc.RadixCacheStub(self._channel)
        self._timeout = timeout
        self._stream = None

    async def _call(self, name: str, request):
        try:
            return await getattr(self._stub, name)(request, metadata=self._meta, timeout=self._timeout)
        except grpc.RpcError as e:
            err = from_rpc_error(e)
            if isinstance(err, NotFound) and "session" in str(err):
                try:
                    current = (await self._stub.GetInfo(pb.GetInfoRequest(), metadata=self._meta,
                                                        timeout=5)).instance_id
                except grpc.RpcError:
                    current = ""
                err = self._restart_check(err, current)
            raise err from None

    async def attach(self) -> str:
        self._stream = self._stub.Attach(pb.AttachRequest(client_name=self.name), metadata=self._meta)
        try:
            first = await self._stream.read()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        self.session_id, self.instance_id = first.session_id, first.instance_id
        return self.session_id

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        await self._channel.close()

    async def __aenter__(self):
        await self.attach()
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def info(self) -> dict:
        return codec.info_dict(await self._call("GetInfo", pb.GetInfoRequest()))

    async def alloc(self, num_tokens: Sequence[int]) -> list[np.ndarray]:
        resp = await self._call("Alloc", pb.AllocRequest(session_id=self.session_id, num_tokens=list(num_tokens)))
        return [codec.slots_array(a.indices) for a in resp.allocations]

    async def free(self, indices: Any) -> int:
        return (await self._call("Free", pb.FreeRequest(session_id=self.session_id,
                                                        indices=codec.slots_bytes(indices)))).freed

    async def insert_batch(self, items: Iterable[dict]) -> list[codec.Inserted]:
        resp = await self._call("Insert", codec.insert_request(pb.InsertRequest, self.session_id, items))
        return codec.inserted(resp.results)

    async def match_batch(self, keys: Sequence[Any], *, lock: bool = False, extra_key: str = "",
                          cache_salt: str = "") -> list[codec.Match]:
        return codec.matches(await self._call("MatchPrefix", codec.match_request(self.session_id, keys, lock,
                                                                                 extra_key, cache_salt)))

    async def match_prefix(self, tokens: Any, **kw) -> codec.Match:
        return (await self.match_batch([tokens], **kw))[0]

    async def prefetch(self, keys: Sequence[Any], *, wait: bool = False, extra_key: str = "",
                       cache_salt: str = "") -> list[codec.Prefetched]:
        return codec.prefetched(await self._call("Prefetch", codec.prefetch_request(keys, wait, extra_key,
                                                                                   cache_salt)))

    async def unlock(self, receipt_ids: Sequence[int]) -> None:
        await self._call("Unlock", pb.UnlockRequest(session_id=self.session_id, receipt_id=list(receipt_ids)))

    async def alloc_hybrid(self, num_tokens: Sequence[int], mamba_states: int = 0) -> codec.Allocated:
        """Hybrid models: as CacheClient.alloc_hybrid."""
        return codec.allocated(await self._call("Alloc", codec.alloc_hybrid_request(self.session_id, num_tokens,
                                                                                   mamba_states)))

    async def free_hybrid(self, indices: Any = (), *, states: Any = (), swa_only: bool = False) -> tuple[int, int]:
        r = await self._call("Free", codec.free_hybrid_request(self.session_id, indices, states, swa_only))
        return r.freed, r.freed_states

    async def match_hybrid(self, keys: Sequence[Any], *, lock: bool = False, mamba_cow: bool = False,
                           skip_mamba: bool = False, extra_key: str = "",
                           cache_salt: str = "") -> list[codec.HybridMatch]:
        return codec.hybrid_matches(await self._call("MatchPrefix", codec.hybrid_match_request(
            self.session_id, keys, lock, mamba_cow, skip_mamba, extra_key, cache_salt)))

    async def release_swa(self, receipt_ids: Sequence[int]) -> None:
        await self._call("Unlock", pb.UnlockRequest(session_id=self.session_id, receipt_id=list(receipt_ids),
                                                    swa_only=True))

    async def cache_finished(self, items: Iterable[dict]) -> list[codec.Inserted]:
        resp = await self._call("CacheFinished", codec.insert_request(pb.CacheFinishedRequest, self.session_id, items))
        return codec.inserted(resp.results)

    async def evict(self, num_tokens: int, host_tokens: int = 0) -> int:
        return (await self._call("Evict", pb.EvictRequest(num_tokens=num_tokens,
                                                          host_tokens=host_tokens))).evicted_tokens

    async def load_back(self, receipt_id: int, mem_quota: Optional[int] = None) -> codec.Loaded:
        """Bring a locked match's host segment back to device; wait_transfers before reading it."""
        item = pb.LoadBackItem(receipt_id=receipt_id)
        if mem_quota is not None:
            item.mem_quota = mem_quota
        resp = await self._call("LoadBack", pb.LoadBackRequest(session_id=self.session_id, items=[item]))
        return codec.loaded(resp)[0]

    async def wait_transfers(self, transfer_ids: Sequence[int], timeout_ms: int = 10_000) -> tuple[list[int], list[int]]:
        r = await self._call("WaitTransfers", pb.WaitTransfersRequest(transfer_ids=list(transfer_ids),
                                                                       timeout_ms=timeout_ms))
        return list(r.completed), list(r.failed)

    async def stats(self) -> dict[str, int]:
        return codec.stats_dict(await self._call("GetStats", pb.GetStatsRequest()))

    async def check(self) -> list[str]:
        return list((await self._call("CheckInvariants", pb.CheckInvariantsRequest())).violations)

    async def echo(self, payload: bytes) -> bytes:
        return (await self._call("Echo", pb.EchoRequest(payload=payload))).payload
