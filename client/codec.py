"""Request building and response decoding shared by the sync and asyncio clients."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from radixd.proto import cache_pb2 as pb
from radixd.server.pools.descriptor import BufferDesc, PoolDescriptor


def tokens_bytes(tokens: Any) -> bytes:
    """numpy / torch / list / bytes -> packed little-endian int32."""
    if type(tokens) is np.ndarray:
        return tokens.astype("<i4", copy=False).tobytes()
    if isinstance(tokens, (bytes, bytearray)):
        return bytes(tokens)
    if type(tokens) is list:  # an engine's prompt: struct packs a list 3x faster than numpy converts one
        try:
            return struct.pack(f"<{len(tokens)}i", *tokens)
        except struct.error as e:
            raise OverflowError(f"a token id does not fit int32: {e}") from None
    if hasattr(tokens, "detach"):  # torch
        tokens = tokens.detach().cpu().numpy()
    return np.asarray(tokens, dtype="<i4").tobytes()


def slots_bytes(indices: Any) -> bytes:
    """numpy / torch / list -> packed little-endian int64."""
    if isinstance(indices, (bytes, bytearray)):
        return bytes(indices)
    if hasattr(indices, "detach"):
        indices = indices.detach().cpu().numpy()
    return np.asarray(indices, dtype="<i8").tobytes()


def slots_array(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<i8")


@dataclass(slots=True)  # not frozen: a frozen dataclass pays object.__setattr__ per field on every match
class Match:
    """MatchPrefix result: device slot indices (int64), lengths, node handle and lock receipt (0 = none)."""

    indices: np.ndarray
    matched_len: int
    host_hit_len: int
    node_id: int
    receipt_id: int
    best_node_id: int = 0
    prefetch_len: int = 0  # tokens an L3 prefetch is fetching beyond the host prefix (at most)


@dataclass(frozen=True)
class Prefetched:
    """Prefetch result: tokens being fetched from L3, and (with wait) the cached prefix after the fetch."""

    prefetch_len: int
    host_len: int


def prefetch_request(keys: Sequence[Any], wait: bool, extra_key: str, cache_salt: str):
    return pb.PrefetchRequest(wait=wait, items=[
        pb.PrefetchItem(tokens=tokens_bytes(k), extra_key=extra_key, cache_salt=cache_salt) for k in keys])


def prefetched(resp) -> list[Prefetched]:
    return [Prefetched(r.prefetch_len, r.host_len) for r in resp.results]


@dataclass(frozen=True)
class Loaded:
    """LoadBack result: the whole path's device slots, what was loaded, its receipt and transfer."""

    indices: np.ndarray
    loaded_len: int
    receipt_id: int
    transfer_id: int
    reason: str
    ipc_event_handle: bytes = b""  # GPU: wait on it with radixd.client.pools.wait_ipc_event


def loaded(resp) -> list[Loaded]:
    return [Loaded(slots_array(r.device_indices), r.loaded_len, r.receipt_id, r.transfer_id, r.reason,
                   r.ipc_event_handle) for r in resp.results]


@dataclass(frozen=True)
class Inserted:
    prefix_len: int
    node_id: int
    freed_duplicates: int
    adopted: int
    backup_transfer_ids: tuple = ()
    mamba_exist: bool = False  # hybrid: the prefix kept its own state; the donated one was freed


def match_request(session_id: str, keys: Sequence[Any], lock: bool, extra_key: str, cache_salt: str):
    req = pb.MatchRequest(session_id=session_id)
    add = req.items.add  # in place: a list of items would be copied once more, tokens and all
    if lock or extra_key or cache_salt:
        for k in keys:
            add(tokens=tokens_bytes(k), extra_key=extra_key, cache_salt=cache_salt, lock=lock)
    else:
        for k in keys:
            add(tokens=tokens_bytes(k))
    return req


def matches(resp) -> list[Match]:
    return [Match(slots_array(r.device_indices), r.matched_len, r.host_hit_len, r.node_id, r.receipt_id,
                  r.best_node_id, r.prefetch_len) for r in resp.results]


def insert_request(cls: Any, session_id: str, items: Iterable[dict]):
    """An InsertRequest, CacheFinishedRequest or CacheUnfinishedRequest, its items added in place (a list of
    items would be copied once more, tokens and slots and all)."""
    req = cls(session_id=session_id)
    add = req.items.add
    finished = cls is not pb.InsertRequest
    for it in items:
        kw = dict(tokens=tokens_bytes(it["tokens"]), indices=slots_bytes(it["indices"]),
                  extra_key=it.get("extra_key", ""), cache_salt=it.get("cache_salt", ""),
                  prev_prefix_len=int(it.get("prev_prefix_len", 0)), priority=int(it.get("priority", 0)))
        if finished:
            kw["receipt_id"] = int(it.get("receipt_id", 0))
        if it.get("swa_evicted_seqlen"):
            kw["swa_evicted_seqlen"] = int(it["swa_evicted_seqlen"])
        if it.get("mamba_value") is not None:
            kw["mamba_value"] = int(it["mamba_value"])
        add(**kw)
    return req


def inserted(results) -> list[Inserted]:
    return [Inserted(r.prefix_len, r.node_id, r.freed_duplicates, r.adopted, tuple(r.backup_transfer_ids),
                     r.mamba_exist) for r in results]


@dataclass(slots=True)
class HybridMatch:
    """MatchPrefix on a hybrid model: the FULL slots of the usable prefix, their SWA twins (-1 where SWA keeps
    nothing), where the components want the next checkpoint, and the state: the tree's (`mamba_src`, read only)
    and, with mamba_cow, the request's own copy of it (`mamba_slot`). -1 / None where absent."""

    indices: np.ndarray
    matched_len: int
    node_id: int
    receipt_id: int
    full_hit_len: int
    swa_indices: np.ndarray
    swa_branching_seqlen: Optional[int]
    mamba_branching_seqlen: Optional[int]
    mamba_src: int
    mamba_slot: int


def hybrid_match_request(session_id: str, keys: Sequence[Any], lock: bool, mamba_cow: bool, skip_mamba: bool,
                         extra_key: str = "", cache_salt: str = ""):
    req = pb.MatchRequest(session_id=session_id)
    add = req.items.add
    for k in keys:
        add(tokens=tokens_bytes(k), lock=lock, mamba_cow=mamba_cow, skip_mamba=skip_mamba, extra_key=extra_key,
            cache_salt=cache_salt)
    return req


def hybrid_matches(resp) -> list[HybridMatch]:
    out = []
    for r in resp.results:
        out.append(HybridMatch(
            slots_array(r.device_indices), r.matched_len, r.node_id, r.receipt_id, r.full_hit_len,
            slots_array(r.swa_indices), r.swa_branching_seqlen if r.HasField("swa_branching_seqlen") else None,
            r.mamba_branching_seqlen if r.HasField("mamba_branching_seqlen") else None,
            r.mamba_src if r.HasField("mamba_src") else -1, r.mamba_slot if r.HasField("mamba_slot") else -1))
    return out


def alloc_hybrid_request(session_id: str, num_tokens: Sequence[int], mamba_states: int):
    return pb.AllocRequest(session_id=session_id, num_tokens=list(num_tokens), mamba_states=mamba_states)


def allocated(r) -> "Allocated":
    return Allocated([slots_array(a.indices) for a in r.allocations], [slots_array(a.swa_indices) for a in r.allocations],
                     slots_array(r.states), (r.evicted_tokens, r.swa_evicted_tokens, r.mamba_evicted))


def free_hybrid_request(session_id: str, indices: Any, states: Any, swa_only: bool):
    return pb.FreeRequest(session_id=session_id, indices=slots_bytes(indices), states=slots_bytes(states),
                          swa_only=swa_only)


@dataclass(frozen=True)
class Allocated:
    """Alloc on a hybrid model: FULL slots per size, their SWA twins (empty without SWA), the state slots."""

    full: list
    swa: list
    states: np.ndarray
    evicted: tuple  # (FULL tokens, SWA tokens, states) evicted to make room


def descriptor(msg) -> PoolDescriptor:
    return PoolDescriptor(
        instance_id=msg.instance_id, tier=msg.tier, backend=msg.backend, handle=msg.handle,
        size_bytes=msg.size_bytes, dtype=msg.dtype, num_layers=msg.num_layers, kv_heads=msg.kv_heads,
        head_dim=msg.head_dim, page_size=msg.page_size, num_slots=msg.num_slots, mla=msg.mla, layout=msg.layout,
        buffers=tuple(BufferDesc(b.name, b.offset, tuple(b.shape), b.dtype) for b in msg.buffers),
        gpu_uuid=msg.gpu_uuid,
        device_index=msg.device_index, pinned=msg.pinned)


def stats_dict(msg) -> dict[str, int]:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


def info_dict(msg) -> dict[str, Any]:
    return dict(instance_id=msg.instance_id, page_size=msg.page_size, eviction_policy=msg.eviction_policy,
                version=msg.version, capacity_tokens=msg.capacity_tokens, max_batch_tokens=msg.max_batch_tokens,
                write_policy=msg.write_policy, storage=msg.storage, storage_format=msg.storage_format,
                metrics_url=msg.metrics_url, pressure_segment=msg.pressure_segment,
                device_pools=[descriptor(p) for p in msg.device_pools],
                host_pool=descriptor(msg.host_pool) if msg.HasField("host_pool") else None,
                swa_pool=descriptor(msg.swa_pool) if msg.HasField("swa_pool") else None,
                state_pool=descriptor(msg.state_pool) if msg.HasField("state_pool") else None,
                hybrid=dict(sliding_window=msg.hybrid.sliding_window, mamba_chunk=msg.hybrid.mamba_chunk,
                            swa_capacity_tokens=msg.hybrid.swa_capacity_tokens, mamba_states=msg.hybrid.mamba_states,
                            full_layers=list(msg.hybrid.full_layers), swa_layers=list(msg.hybrid.swa_layers),
                            state_layers=list(msg.hybrid.state_layers)) if msg.HasField("hybrid") else None)


def channel_options(max_bytes: int = 256 << 20) -> list:
    return [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes),
            ("grpc.keepalive_time_ms", 10000), ("grpc.keepalive_permit_without_calls", 1)]


@dataclass
class MappedPools:
    """Every pool of a server mapped into this process."""

    device: list
    host: Optional[Any]
    swa: Optional[Any] = None  # hybrid models: the sliding-window KV pool
    state: Optional[Any] = None  # hybrid models: the recurrent-state pool (conv_buffer / temporal_buffer)

    def close(self) -> None:
        for p in self.device + [p for p in (self.host, self.swa, self.state) if p is not None]:
            p.close()
