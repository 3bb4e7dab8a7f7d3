"""`RadixdRadixCache`: radixd as the shared tier behind SGLang's own radix tree (SGLang 0.5.23, FlexKV style).

SGLang keeps its tree and KV pool; radixd is the tier behind them that outlives the engine and that every
engine on the node shares (one radixd session per engine: a dead engine loses its locks within a second).
  match_prefix     SGLang's own match, then radixd's (MatchPrefix with lock, after a LoadBack when radixd
                   holds more on its host tier); what radixd has beyond SGLang's device prefix is reported as
                   `host_hit_length`, so the scheduler calls init_load_back;
  init_load_back   all or nothing: SGLang slots (evicting locally if short), radixd's pages copied into
                   SGLang's k_buffer / v_buffer, the path inserted into SGLang's tree, radixd's lock released;
  checkpoint       SGLang's own bookkeeping; for a finished request its new whole pages are copied into
                   radixd slots (Alloc) and published (CacheFinished). On GPU the copy runs on a side stream
                   and is published once its event completed, the source node locked until then; SGLang has
                   no tick for a backend, so completions are drained in match_prefix, checkpoint and evict;
  on_release / release_aborted_request / reset  release every radixd lock the request (or cache) held.
Tensor parallelism: radixd's pool holds every rank's KV heads side by side; rank 0 alone talks to radixd and
broadcasts its decisions (SGLang's ranks call the cache in lockstep), every rank copies its own heads, and
a barrier orders the copies before rank 0 unlocks or publishes.
The namespace is SGLang's extra_key plus cache_salt; radixd's page size must equal SGLang's --page-size.
"""
from __future__ import annotations

import logging
import os
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from sglang.srt.mem_cache.base_prefix_cache import (EvictParams, EvictResult, InitLoadBackParams, InsertParams,
                                                    MatchPrefixParams, MatchResult)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from radixd.client import CacheClient, RadixdError
from radixd.server.config import DEFAULT_SOCKET

if TYPE_CHECKING:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

log = logging.getLogger("radixd.sglang")
SUPPORTED_SGLANG = "0.5.23"


def _ids(tokens: Any) -> np.ndarray:
    """Token ids as radixd's int32, from SGLang's array('q') without a per-token loop (or from a list)."""
    if isinstance(tokens, array):
        return np.frombuffer(tokens, dtype=f"i{tokens.itemsize}").astype(np.int32) if len(tokens) else np.zeros(0, np.int32)
    return np.asarray(tokens, dtype=np.int32)


def attached(cache: RadixCache, node: Any) -> bool:
    """Whether a node is still in the tree (a match's node may be evicted before its load-back)."""
    while node is not cache.root_node:
        parent = node.parent
        if parent is None or parent.children.get(node.key.child_key(cache.page_size)) is not node:
            return False
        node = parent
    return True


@dataclass
class _Marker:
    """From a match that found pages in radixd to its init_load_back: the lock and where the pages are."""

    receipt: int
    path: np.ndarray  # radixd device slots of the matched path, root first
    key: RadixKey  # snapshot of the matched key (the request's own key keeps growing)
    device_len: int  # SGLang's device prefix at match time


@dataclass
class _Store:
    """A finished request's pages on their way into radixd (GPU: waiting for the copy's event)."""

    event: Any
    node: Any
    item: dict


class RadixdRadixCache(RadixCache):
    """SGLang RadixCache with radixd behind it (see the module docstring)."""

    def __init__(self, params: "CacheInitParams", tp_size: int = 1, tp_rank: int = 0, tp_group: Any = None,
                 target: Optional[str] = None, token: Optional[str] = None, load_back: bool = True):
        super().__init__(params)
        if tp_size > 1 and tp_group is None:
            raise ValueError("radixd backend: tensor parallelism needs the TP group (broadcast_object, barrier)")
        self.tp_size, self.tp_rank, self.group = tp_size, tp_rank, tp_group
        self.lead = tp_rank == 0  # the one rank that talks to radixd; the others follow its decisions
        self.target = target or os.environ.get("RADIXD_TARGET") or "unix://" + DEFAULT_SOCKET[len("unix:"):]
        self.load_back = load_back
        self.client = CacheClient(self.target, token=token or os.environ.get("RADIXD_TOKEN"),
                                  name=f"sglang-{os.getpid()}", attach=self.lead)
        info = self.client.info()
        if info["page_size"] != self.page_size:
            raise ValueError(f"radixd backend: radixd's page size {info['page_size']} != SGLang's --page-size "
                             f"{self.page_size}; start radixd with --page-size {self.page_size}")
        kv = self.token_to_kv_pool_allocator.get_kvcache()
        self.k, self.v = kv.k_buffer, kv.v_buffer
        self.pools = self.client.map_pools(self.k[0].device)
        dev = self.pools.device[0]
        d = dev.descriptor
        heads = self.k[0].shape[1]  # this rank's KV heads; radixd holds all ranks' side by side
        self.shard = slice(tp_rank * heads, (tp_rank + 1) * heads)
        want = (len(self.k), (heads * tp_size, self.k[0].shape[2]), self.k[0].dtype)
        have = (d.num_layers, (d.kv_heads, d.head_dim), dev.k_buffer[0].dtype if dev.k_buffer else None)
        if d.mla or want != have:
            raise ValueError(f"radixd backend: the KV geometry differs (layers, (kv heads of all TP ranks, head "
                             f"dim), dtype): SGLang "
                             f"has {want}, radixd has {have}; start radixd with matching --layers/--kv-heads/"
                             "--head-dim/--dtype (or --model-config)")
        self.rk, self.rv = dev.k_buffer, dev.v_buffer
        self.cuda = self.k[0].is_cuda
        self.stream = torch.cuda.Stream(device=self.k[0].device) if self.cuda else None
        self._markers: dict[Any, _Marker] = {}
        self._stores: list[_Store] = []
        self.loaded_tokens = 0  # tokens copied in from radixd (for tests and logs)
        self.stored_tokens = 0

    # ---------------------------------------------------------------- helpers
    def _ns(self, key: RadixKey) -> dict[str, str]:
        return dict(extra_key=key.extra_key or "", cache_salt=getattr(key, "cache_salt", None) or "")

    def _bcast(self, obj: Any) -> Any:
        """The lead rank's value on every rank (SGLang's TP ranks call the cache in lockstep)."""
        return obj if self.tp_size == 1 else self.group.broadcast_object(obj, src=0)

    def _barrier(self) -> None:
        if self.tp_size > 1:
            if self.cuda:
                torch.cuda.current_stream().synchronize()
            self.group.barrier()

    def _unlock(self, receipt: int) -> None:
        if receipt and self.lead:
            try:
                self.client.unlock([receipt])
            except RadixdError as e:
                log.warning("radixd unlock failed: %s", e)

    def _drop_marker(self, handle: Any) -> None:
        m = self._markers.pop(handle, None)
        if m is not None:
            self._unlock(m.receipt)

    def _drain(self, wait: bool = False) -> None:
        """Publish stores whose copy completed (all of them with wait)."""
        keep = []
        for st in self._stores:
            if st.event is not None and not wait and not st.event.query():
                keep.append(st)
                continue
            if st.event is not None:
                st.event.synchronize()
            self._publish(st.item)
            self.dec_lock_ref(st.node)
        self._stores = keep

    def _publish(self, item: dict) -> None:
        try:
            self.client.cache_finished([item])
        except RadixdError as e:  # radixd refused or is gone: the pages are simply not shared
            log.warning("radixd publish failed: %s", e)
            try:
                self.client.free(item["indices"][item["prev_prefix_len"]:])
                self._unlock(item["receipt_id"])
            except RadixdError:
                pass

    # ------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        super().reset()
        if hasattr(self, "_markers"):
            for h in list(self._markers):
                self._drop_marker(h)
            self._drain(wait=True)

    def shutdown(self) -> None:
        self._drain(wait=True)
        for h in list(self._markers):
            self._drop_marker(h)
        self.pools.close()
        self.client.close()

    # ----------------------------------------------------------------- match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        base = super().match_prefix(params)
        req = params.req
        if self.disable or req is None or not len(params.key):
            return base
        self._drain()
        key = params.key.page_aligned(self.page_size)
        device_len = base.device_prefix_len
        self._drop_marker(req.cache_request_handle)  # asked again: the newer answer wins
        if device_len >= len(key) or self.is_eagle:
            return base
        path, receipt = None, 0
        if self.lead:
            path, receipt = self._radixd_match(key, device_len)
        path = self._bcast(path)
        if path is None:
            return base
        hit = len(path) - device_len
        snap = key[:len(key)]  # a copy of the ids in the scheduler's own type (array('q')): SGLang's tree compares
        self._markers[req.cache_request_handle] = _Marker(receipt, path, snap, device_len)
        node = base.last_device_node
        return base._replace(last_host_node=node, best_match_node=node, host_hit_length=hit)

    def _radixd_match(self, key: RadixKey, device_len: int) -> tuple[Optional[np.ndarray], int]:
        """radixd's locked path for the key when it holds more than SGLang's device prefix (lead rank)."""
        tokens = _ids(key.raw_token_ids())
        try:
            m = self.client.match_prefix(tokens, lock=True, **self._ns(key))
            path, receipt = m.indices, m.receipt_id
            if self.load_back and m.host_hit_len:
                lb = self.client.load_back(receipt)
                if lb.loaded_len:
                    _, failed = self.client.wait_transfers([lb.transfer_id])
                    if failed:
                        raise RadixdError(f"load-back transfer {lb.transfer_id} failed")
                path, receipt = lb.indices, lb.receipt_id
        except RadixdError as e:  # radixd down or refusing: SGLang's own answer stands
            log.warning("radixd match failed: %s", e)
            return None, 0
        if len(path) <= device_len:
            self._unlock(receipt)
            return None, 0
        return np.asarray(path, dtype=np.int64), receipt

    def init_load_back(self, params: InitLoadBackParams):
        """Copy radixd's pages into fresh SGLang slots and insert them: all `host_hit_length` tokens or none."""
        req = params.req
        last = params.best_match_node
        marker = self._markers.pop(req.cache_request_handle, None) if req is not None else None
        if marker is None:
            return 0, last
        try:
            n = params.host_hit_length
            if n <= 0 or marker.device_len + n > len(marker.path) or not attached(self, last):
                return 0, last  # (a node evicted since the match: its prefix is gone, so is the hit)
            self.inc_lock_ref(last)  # making room must not evict the prefix the pages continue
            try:
                if self.token_to_kv_pool_allocator.available_size() < n:
                    self.evict(EvictParams(num_tokens=n))
                slots = self.token_to_kv_pool_allocator.alloc(n)
            finally:
                self.dec_lock_ref(last)
            if slots is None:
                return 0, last
            src = torch.from_numpy(marker.path[marker.device_len:marker.device_len + n].copy()).to(self.k[0].device)
            dst = slots.to(torch.int64)
            sh = self.shard
            for i in range(len(self.k)):
                self.k[i][dst] = self.rk[i][src][:, sh]
                self.v[i][dst] = self.rv[i][src][:, sh]
            if self.cuda:
                torch.cuda.current_stream().synchronize()  # radixd may evict its pages once unlocked
            self._barrier()  # every rank has its heads before the lead releases radixd's lock
            end = marker.device_len + n
            prefix = self.path_device_indices(last)[:marker.device_len].to(torch.int64)
            r = self.insert(InsertParams(key=marker.key[:end], value=torch.cat([prefix, dst]),
                                         inserted_len=marker.device_len, priority=getattr(last, "priority", 0)))
            if r.prefix_len > marker.device_len:  # inserted meanwhile by this engine: our copies are duplicates
                self.token_to_kv_pool_allocator.free(dst[:r.prefix_len - marker.device_len])
            self.loaded_tokens += n
            return n, r.last_device_node
        finally:
            self._unlock(marker.receipt)

    # ------------------------------------------------------------ checkpoint
    def checkpoint(self, req, *, up_to: int) -> None:
        """SGLang's own checkpoint; a finished request's new whole pages also go to radixd."""
        super().checkpoint(req, up_to=up_to)
        self._drain()
        if self.disable or not req.finished():
            return
        node = req.last_node
        indices = self.path_device_indices(node).to(torch.int64)
        n = len(indices) - len(indices) % self.page_size
        if n == 0:
            return
        tokens = _ids(req.full_untruncated_fill_ids[:n])
        ns = dict(extra_key=req.extra_key or "", cache_salt=req.cache_salt or "")
        plan, item = None, None
        if self.lead:
            plan, item = self._plan_store(tokens, n, ns)
        plan = self._bcast(plan)
        if plan is None:
            return
        have, slots = plan
        dst = torch.from_numpy(slots).to(self.k[0].device)
        src = indices[have:n]
        self.stored_tokens += n - have
        if self.tp_size > 1:  # every rank writes its heads, then the lead publishes
            sh = self.shard
            for i in range(len(self.k)):
                self.rk[i][dst, sh] = self.k[i][src]
                self.rv[i][dst, sh] = self.v[i][src]
            self._barrier()
            if self.lead:
                self._publish(item)
            return
        event = None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for i in range(len(self.k)):
                    self.rk[i][dst] = self.k[i][src]
                    self.rv[i][dst] = self.v[i][src]
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            for i in range(len(self.k)):
                self.rk[i][dst] = self.k[i][src]
                self.rv[i][dst] = self.v[i][src]
        self.inc_lock_ref(node)  # SGLang must not reuse the source slots before the copy is over
        self._stores.append(_Store(event, node, item))
        if event is None:
            self._drain()

    def _plan_store(self, tokens: np.ndarray, n: int, ns: dict) -> tuple[Optional[tuple], Optional[dict]]:
        """Lead rank: lock radixd's prefix and hold slots for the rest; ((have, slots), the publish item)."""
        m = None
        try:
            m = self.client.match_prefix(tokens, lock=True, **ns)
            have = m.matched_len
            if have >= n:
                self._unlock(m.receipt_id)
                return None, None
            slots = np.array(self.client.alloc(n - have), dtype=np.int64)  # writable: torch takes it as is
        except RadixdError as e:
            log.warning("radixd store skipped: %s", e)
            if m is not None:
                self._unlock(m.receipt_id)
            return None, None
        item = dict(tokens=tokens, indices=np.concatenate([m.indices, slots]), prev_prefix_len=have,
                    receipt_id=m.receipt_id, **ns)
        return (have, slots), item

    # ------------------------------------------------------ eviction, release
    def evict(self, params: EvictParams) -> EvictResult:
        self._drain(wait=self.token_to_kv_pool_allocator.available_size() < params.num_tokens)
        return super().evict(params)

    def check_hicache_events(self) -> None:
        self._drain()

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._drop_marker(req.cache_request_handle)

    def release_aborted_request(self, handle) -> None:
        super().release_aborted_request(handle)
        self._drop_marker(handle)


def factory(ctx) -> RadixdRadixCache:
    """`--radix-cache-backend radixd`: build the cache from SGLang's TreeCacheBuildContext."""
    return RadixdRadixCache(ctx.params, tp_size=ctx.tp_size, tp_rank=ctx.tp_rank, tp_group=ctx.tp_group)
