"""`RadixdConnector`: radixd as the shared, external KV tier of vLLM engines (vLLM 0.32.0's KV connector API).

vLLM keeps its own block pool; radixd is the tier behind it that outlives engines and is shared by them.
Scheduler side (one radixd session per engine, so a dead engine loses its locks and slots within a second).
No radixd call blocks vLLM's scheduler thread in the steady state:
  on_new_request              a miss at once, with no round trip, when the local index (below) shows radixd
                              holds not even the prompt's first page; otherwise starts the lookup:
                              MatchPrefix(lock) on the prompt's whole pages, batched with every request that
                              arrived meanwhile, on the lookup thread (a LoadBack first, and its copy waited
                              for there, when radixd holds more on its host tier);
  get_num_new_matched_tokens  the pages beyond vLLM's own hit (never the last prompt token); None ("ask
                              again next step") while the lookup is out and the engine has other requests;
                              with nothing else to run it waits for the answer; past `lookup_deadline_ms`
                              it is a miss;
  update_state_after_alloc    remembers which tokens to load (or nothing);
  build_connector_meta        loads (radixd pages -> the request's new blocks) and stores: prompt pages
                              computed by this step beyond what radixd has get slots from a stock of held
                              radixd slots the store thread keeps filled (one Alloc here when it is short);
  update_connector_output     the workers report stores done: the store thread publishes them, one
                              CacheUnfinished for all (it frees duplicates and re-locks the longer prefix);
  request_finished            the store thread releases the request's lock after its last publish.
Worker side: maps radixd's device pool, checks the geometry, and copies whole pages, converting layouts exactly:
loads in `start_load_kv` before the forward, stores by `wait_for_save` after it, both waited for. On GPU the copies
run on a side stream. On CPU, with client/_pagecopy.c built and a plain model, each layer's store starts on the copy
queue (a native thread that never takes the GIL, on a CPU the forward's threads are not bound to) as soon as the
forward has written the layer (`save_kv_layer`; the thread is woken every eight layers and at the last, as each
wake costs the forward's thread), so `wait_for_save` waits only for the last layers' copies (a miss's store at 1k
tokens on this project's 2-core bench: ~90 us of the forward thread's time, from ~230 us copying after the
forward). With `async_save` the stores are not waited for (their own stream on GPU; on CPU the copy queue, else a
copy thread): a store is reported (then published) once it has landed, `request_finished` keeps a finished
request's blocks until its copies have landed (`get_finished`), and `handle_preemptions` waits for a preempted
request's copies before its blocks go to others. The engine learns of landed copies at its next step: an offline
`LLM.generate` leaves its last step's stores to the next call, and stores still out when the engine shuts down are
dropped. Hybrid models always copy synchronously (vLLM lets sliding-window and state blocks go while a request
runs).
Hybrid models (sliding window): `RadixdHybridConnector` is the same connector with vLLM's `SupportsHMA`, so
vLLM keeps its hybrid KV cache manager (a block table per KV cache group, null blocks outside a window) and
radixd, started with `--hybrid-cache --model-config` of the same model, holds the full-attention layers in its
FULL pool and the sliding-window layers in its SWA pool. A hit loads FULL pages into the full-attention
groups' blocks and the SWA twins of the window into the sliding-window groups' non-null blocks; a store
copies both. Mamba2 hybrids (vLLM's "align" mode: the state as of each block boundary in its own block) keep
their states in radixd's state pool: a store at a step that ends on a block boundary donates the state of
that boundary (radixd keeps a copy), and a hit, which radixd ends where it has a state, loads that state into
the hit's last state block and into the block the step's forward runs on (vLLM filled that one from the hit's
block before the connector's load). The lookup covers the prompt up to its last loadable page only. States are
published every radixd `--mamba-chunk` tokens (rounded to whole blocks) and at the prompt's last block boundary.
Tensor and pipeline parallelism: radixd holds every KV head of a page whatever the engine's split (start it with the
whole model's geometry), so engines of any TP size share pages. The scheduler side (one per engine) makes the radixd
calls; each worker rank maps radixd's pool and copies its own heads of each page (`layout.head_share`: with fewer KV
heads than ranks, a head's first replica writes it and every replica reads it), each pipeline stage its own layers
(found by the layer index in their names), and a Mamba layer's rank its own x channels and heads of the state (B and
C of a single group, which vLLM replicates, written by rank 0). An MLA model's latent (radixd's --mla pool) is every
rank's whole: rank 0 writes it, all read it. Every worker reports each store it has copied; vLLM
sums the reports (`RadixdWorkerMetadata.aggregate`) and a store is published once all `world_size` workers have
reported it, any failure dropping it. A rank that dies takes its engine down (vLLM's executor), and the engine's
radixd session with it. On GPU the pages must sit in one device pool (radixd with one `--gpus` ordinal), which ranks
on other GPUs copy to and from across GPUs.
The relay (`radixd_relay`, default true): the scheduler side's session, its calls and the events stream live in a
helper process (client/relay.py, started on the connector's CPUs); the engine's threads hand it each call's bytes
over a socket of their own and wait without the GIL. gRPC's threads and the Python of each call and each events batch
thus leave the engine's process, whose forward shares the GIL with every thread in it (each time another thread
takes it mid-forward the forward's thread waits to be woken). The relay exits with the engine (its socket closes, or
its parent is gone: checked twice a second), and its session with it. Where it cannot start, the connector calls
radixd from its own process.
The local index: with radixd started with --kv-events (and no L3 tier, whose pages no event names), the scheduler
follows radixd's KV events (WatchEvents with a snapshot) into an index of the pages radixd holds: through the relay,
the first pages only, kept by the relay in a hash table in shared memory (client/firsts.py) that the scheduler reads
with no thread of its own; without it, a BlockIndex on a thread here. It is used only while it is current: its
snapshot applied, its stream live, and every batch up to this engine's own last store (CacheUnfinished's event_seq)
applied. A page another engine stored a moment ago may not be in it yet: a lost hit, never a wrong load, as a hit
is always looked up and locked by radixd itself.
Configure with `kv_connector_extra_config`: `radixd_target` (default `$RADIXD_TARGET` or the default
socket), `radixd_token`, `load_back` (default true), `lookup_deadline_ms` (default 200),
`slot_stock_tokens` (the most slots held ready for stores, default 8192), `local_index` (default true),
`async_save` (default false, see RadixdConnector.__init__; on this project's 2-core CPU bench/vllm_bench.py, each
engine's requests following one another, a miss at 1024 tokens read 1.044-1.061x the engine without a connector
with it, 1.032-1.048x without, 4 runs each with the relay and a 5 ms store tick: with the copy queue it no longer
gains on CPU; with the relay and the 20 ms tick, the defaults, 1.020-1.036x, median 1.026 over 7 runs),
`radixd_cpus` (the CPUs of the connector's threads, its relay and gRPC's, default "auto": off the forward's, see
`helper_cpus`; on that bench, the forward bound as vLLM's CPU executor binds it, a miss read 1.160-1.180x with "all",
which leaves them on the forward's CPU), `radixd_relay` (default true), `store_tick_ms` (how often the store thread
looks for publishes and releases, default 20: each look takes the GIL from the forward; a publish waits up to that
long, a lookup never does: its thread is woken when one is submitted).
"""
from __future__ import annotations

import functools
import logging
import math
import os
import re
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Collection, Optional, Sequence

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorWorkerMetadata,
                                                               SupportsHMA)

from radixd.client import CacheClient, RadixdError, Unavailable
from radixd.client.relay import RelayedClient
from radixd.client.background import EMPTY, Lookups, Stores
from radixd.client.events import MEDIA, LocalIndex
from radixd.client.pools import populate_in_background
from radixd.server.config import DEFAULT_SOCKET

from .layout import (CopyQueue, CpuViews, Geometry, Ticket, aligned_pages, cpu_views, geometry, head_share,
                     load_blocks, probe_cpu_layout, save_blocks)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request
    from radixd.server.layouts import ModelLayout

log = logging.getLogger("radixd.vllm")
SUPPORTED_VLLM = "0.32.0"


@dataclass
class RadixdConnectorMetadata(KVConnectorMetadata):
    """One step's copies: loads (vLLM blocks per KV cache group, radixd page first slots, their SWA twins' first
    slots, radixd's state slot, each group's running state block) and stores (id, blocks per group, pages, SWA
    twin pages, the state slot to fill); the twins are empty for a plain model, the state -1 without state
    layers. A state is copied between radixd's slot and the last block of each Mamba group's span (vLLM keeps
    the state as of block p's end in block p); a load also fills the block the step's forward runs on, as vLLM
    copied the hit's state block into it before the connector's load."""

    loads: list[tuple[list[list[int]], list[int], list[int], int, list[int]]] = field(default_factory=list)
    stores: list[tuple[int, str, list[list[int]], list[int], list[int], int]] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # their blocks go to others this step: saves must land first
    instance: str = ""  # the radixd instance whose slots the loads and stores name (a restart: map its pools)


@dataclass
class RadixdWorkerMetadata(KVConnectorWorkerMetadata):
    """Store ids copied into radixd since the last report, each with how many workers copied it (a tensor- or
    pipeline-parallel engine's ranks each copy their own heads and layers: vLLM sums the workers' reports and the
    scheduler publishes a store once every worker has reported it), and ids whose copy failed on any worker."""

    stored: dict[int, int] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, RadixdWorkerMetadata)
        counts = dict(self.stored)
        for sid, n in other.stored.items():
            counts[sid] = counts.get(sid, 0) + n
        return RadixdWorkerMetadata(counts, self.failed | other.failed)


class _Req:
    """One request's bookkeeping (a plain class with slots: built on every arrival, where a dataclass's default
    factories cost calls on a cache-cold scheduler thread)."""

    __slots__ = ("tokens", "ns", "prefix", "firsts", "swa", "state", "local", "load", "blocks", "planned",
                 "inflight", "finished", "storing", "pending", "saved", "asked")

    def __init__(self, tokens: Sequence[int], ns: dict[str, str]):
        self.tokens = tokens  # the prompt as vLLM holds it (a list, which only grows: a streaming session): lookups,
        # publishes and the release hand it over whole, and the thread that makes the call cuts and converts it
        self.ns = ns
        self.prefix: np.ndarray = EMPTY  # radixd's hit (locked), for loads
        self.firsts: list[int] = []  # its pages' first slots (listed on the lookup thread)
        self.swa: np.ndarray = EMPTY  # hybrid: the hit's SWA twins
        self.state = -1  # state layers: radixd's state slot as of the hit's end (pinned by the lock)
        self.local = 0  # vLLM's own computed tokens when matched
        self.load: Optional[tuple[int, int]] = None  # (first token, tokens) to load this step
        self.blocks: list[list[int]] = []  # vLLM's block ids, per KV cache group
        self.planned = 0  # tokens whose store has been planned (published or in flight)
        self.inflight: set[int] = set()
        self.finished = False
        self.storing = True
        self.pending = False  # its lookup is still on the lookup thread
        self.saved = False  # a store of its blocks was planned (asynchronous saves: its blocks wait for the copies)
        self.asked = 0.0  # when the lookup was started (a lookup older than the deadline is a miss)


_PLAIN = dict(extra_key="", cache_salt="")  # most requests' namespace, shared (nothing writes to a namespace)


def _namespace(request: "Request") -> dict[str, str]:
    lora = getattr(request, "lora_request", None)
    if lora is None and not request.cache_salt:
        return _PLAIN
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
        self.slot_stock = int(extra.get("slot_stock_tokens", 8192))  # most slots held ready for stores
        self.local_index = str(extra.get("local_index", "true")).lower() not in ("0", "false", "no")
        self.hma = isinstance(self, SupportsHMA)
        # stores copied after wait_for_save returns (a finished request's blocks wait for them); off by default: an
        # offline LLM.generate leaves its last step's stores to its next call (an online engine keeps stepping until
        # they land: has_pending_push_work), and on GPU it is unmeasured yet. On CPU the copy queue already runs a
        # store beside the forward, and async_save gains nothing measurable there (module docstring). A hybrid
        # model's sliding-window and state blocks go while the request runs: never there
        self.async_save = not self.hma and str(extra.get("async_save", "false")).lower() in ("1", "true", "yes")
        self.block_size = vllm_config.cache_config.block_size
        self.cache_dtype = vllm_config.cache_config.cache_dtype
        self.model_dtype = vllm_config.model_config.dtype
        self.mla = bool(vllm_config.model_config.use_mla)  # (one latent per token: radixd's --mla pool)
        par = vllm_config.parallel_config
        if par.decode_context_parallel_size > 1 or par.prefill_context_parallel_size > 1:
            raise ValueError("radixd connector: context parallelism (decode_context_parallel_size, "
                             "prefill_context_parallel_size) is not supported; tensor and pipeline parallelism are")
        self.tp, self.pp = par.tensor_parallel_size, par.pipeline_parallel_size
        self.workers = par.world_size  # (every worker reports each store it copied: its heads, its layers)
        self.groups = _group_kinds(kv_cache_config) if self.hma else ["full"]
        # the model's layers as its own config class (vLLM's hf_config) reads them: radixd's must be the same
        self.layout = _engine_layout(vllm_config) if self.hma else None
        self.cpus = helper_cpus(str(extra.get("radixd_cpus", "auto")), vllm_config)
        # the scheduler side's calls and events through a relay process: gRPC's threads and each call's Python out of
        # the process whose forward shares the GIL with them
        self.relay = str(extra.get("radixd_relay", "true")).lower() not in ("0", "false", "no")
        # how often the store thread looks for publishes and releases: each look takes the GIL from the forward, and
        # a publish can wait that long (another engine finds the pages that much later; this one has them in vLLM)
        self.store_tick = float(extra.get("store_tick_ms", 20)) / 1000
        if self.cpus:
            log.info("radixd connector (%s): its threads run on CPUs %s", role.name.lower(),
                     ",".join(map(str, sorted(self.cpus))))
        self._sched: Optional[_Scheduler] = None
        self._worker: Optional[_Worker] = None
        if role == KVConnectorRole.SCHEDULER:  # (its threads, and gRPC's if its is the first channel, off the forward)
            self._sched = beside(self.cpus, lambda: _Scheduler(self))
        else:
            self._worker = _Worker(self)

    # ------------------------------------------------------------ scheduler side
    def on_new_request(self, request: "Request") -> None:
        t = time.perf_counter()
        self._sched.arrived(request)
        self._sched.meter.charge("on_new_request", request.request_id, t)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        t = time.perf_counter()
        n = self._sched.matched(request, num_computed_tokens)
        self._sched.meter.charge("get_num_new_matched_tokens", request.request_id, t)
        return n, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        t = time.perf_counter()
        self._sched.allocated(request, num_external_tokens)
        self._sched.meter.charge("update_state_after_alloc", request.request_id, t)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        t = time.perf_counter()
        meta = self._sched.build(scheduler_output)
        self._sched.meter.step(scheduler_output.num_scheduled_tokens, t, self._sched)
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        t = time.perf_counter()
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, RadixdWorkerMetadata):
            self._sched.stored(meta.stored, meta.failed, self.workers)
        self._sched.meter.charge_step(t)

    def has_pending_push_work(self) -> bool:
        """Stores planned whose copies the workers have not reported yet: vLLM keeps stepping until they are (as it
        does for its own offloading connector), so an engine that goes idle still publishes its last stores."""
        return self._sched is not None and bool(self._sched.stores)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        t = time.perf_counter()
        delay = self._sched.finished(request.request_id) and self.async_save
        self._sched.meter.charge("request_finished", request.request_id, t, last=True)
        return delay, None  # delayed: its blocks are freed once the workers' copies of them have landed

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, RadixdConnectorMetadata)
        self._worker.preempted(kv_connector_metadata.preempted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished(finished_req_ids), None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RadixdConnectorMetadata)
        self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        # (CPU, native: the layer's store starts now; else every store is copied in wait_for_save)
        self._worker.layer_written(layer_name, self._get_connector_metadata())

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


class RadixdHybridConnector(RadixdConnector, SupportsHMA):
    """RadixdConnector for hybrid models: vLLM keeps its hybrid KV cache manager (see the module docstring)."""

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])


def _group_kinds(kv_cache_config: "KVCacheConfig") -> list[str]:
    """Each KV cache group's kind: "full", "swa" (with the window) or "mamba" (Mamba2 states in vLLM's align
    mode, one state per block boundary); anything else is refused in one line."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
    kinds = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            kinds.append(f"swa:{spec.sliding_window}")
        elif isinstance(spec, FullAttentionSpec) and not getattr(spec, "sliding_window", None):
            kinds.append("full")
        elif isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align" or spec.num_speculative_blocks:
                raise ValueError(f"radixd connector: Mamba state caching needs vLLM's mamba_cache_mode 'align' "
                                 f"(prefix caching on) without speculative blocks; this engine has "
                                 f"'{spec.mamba_cache_mode}' with {spec.num_speculative_blocks} speculative blocks")
            if len(spec.shapes) != 2:
                raise ValueError(f"radixd connector: a Mamba layer with {len(spec.shapes)} state tensors (layers "
                                 f"{g.layer_names[:2]}...); radixd keeps a conv and a temporal state")
            kinds.append("mamba")
        else:
            raise ValueError(f"radixd connector: KV cache group {type(spec).__name__} (layers {g.layer_names[:2]}...) "
                             "is not supported yet: only full-attention, sliding-window and Mamba groups")
    return kinds


def scheduler_stats(connector: RadixdConnector) -> dict[str, Any]:
    """What a scheduler-side connector cost vLLM's scheduler thread: per finished request, and radixd calls per
    step (a function, not a method: every public method of the connector is one of vLLM's hooks)."""
    sched = connector._sched
    relay = getattr(sched.client, "proc", None)
    return dict(sched.meter.summary(), local_misses=sched.index.misses if sched.index else 0,
                lookup_rpcs=sched.lookups.rpcs, index_current=sched.index is not None and sched.index.current(),
                relay_pid=relay.pid if relay is not None else None)


def worker_stats(connector: RadixdConnector) -> dict[str, Any]:
    """A worker-side connector's copies: stores copied through the copy queue layer by layer beside the forward."""
    w = connector._worker
    return dict(copy_queue=w.queue is not None, queued_stores=w.queued_stores)


class _Meter:
    """Time the scheduler thread spends in the connector's hooks, per request (a step-wide hook's time is
    shared by the step's requests), and radixd calls per scheduler step; two clock reads per hook."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.waited: dict[str, float] = {}  # of which waiting for a lookup with nothing else to run
        self.done: deque[tuple[float, float]] = deque(maxlen=100_000)  # finished requests' (total, waited)
        self.steps: deque[tuple[int, int, int]] = deque(maxlen=100_000)  # (requests, scheduler rpcs, lookup rpcs)
        self._last: list[str] = []
        self._rpcs = (0, 0)
        self.hooks: dict[str, list[float]] = {}  # hook -> [calls, seconds]

    def _hook(self, name: str, t0: float) -> float:
        took = time.perf_counter() - t0
        h = self.hooks.setdefault(name, [0, 0.0])
        h[0] += 1
        h[1] += took
        return took

    def charge(self, name: str, rid: str, t0: float, last: bool = False) -> None:
        took = self._hook(name, t0)  # first: the meter's own work is not the hook's
        spent = self.spent.get(rid, 0.0) + took
        if last:
            self.spent.pop(rid, None)
            self.done.append((spent, self.waited.pop(rid, 0.0)))
        else:
            self.spent[rid] = spent

    def idle(self, rid: str, seconds: float) -> None:
        self.waited[rid] = self.waited.get(rid, 0.0) + seconds

    def _share(self, name: str, rids: Collection[str], t0: float) -> None:
        took = self._hook(name, t0)
        if rids:
            each = took / len(rids)
            for rid in rids:
                if rid in self.spent:
                    self.spent[rid] += each

    def step(self, rids: Collection[str], t0: float, sched: "_Scheduler") -> None:
        self._share("build_connector_meta", rids, t0)
        rids = self._last = list(rids)
        now = (sched.rpcs, sched.lookups.rpcs)
        self.steps.append((len(rids), now[0] - self._rpcs[0], now[1] - self._rpcs[1]))
        self._rpcs = now

    def charge_step(self, t0: float) -> None:
        self._share("update_connector_output", self._last, t0)

    def summary(self) -> dict[str, Any]:
        total = sorted(t for t, _ in self.done)
        busy = sorted(t - w for t, w in self.done)  # what it kept the scheduler from other work
        steps = [s for s in self.steps if s[0]]

        def pct(xs: list[float], q: float) -> float:
            return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6 if xs else 0.0
        return dict(requests=len(total), p50_us=pct(total, 0.5), p99_us=pct(total, 0.99),
                    busy_p50_us=pct(busy, 0.5), busy_p99_us=pct(busy, 0.99),
                    steps=len(steps), max_rpcs_per_step=max((s[1] for s in steps), default=0),
                    max_lookup_rpcs_per_step=max((s[2] for s in steps), default=0),
                    mean_rpcs_per_step=sum(s[1] for s in steps) / max(len(steps), 1),
                    mean_lookup_rpcs_per_step=sum(s[2] for s in steps) / max(len(steps), 1),
                    hooks_us={k: [n, t / max(n, 1) * 1e6] for k, (n, t) in self.hooks.items()})




class _Scheduler:
    """Per-engine bookkeeping: what each request found in radixd, loads, and stores in flight. The scheduler
    thread makes no radixd call in the steady state: lookups run on `Lookups`; slots for stores come from a
    stock `Stores` keeps filled (an Alloc here only when it runs short), and publishes and releases go to
    `Stores` too, batched over every request."""

    def __init__(self, conn: RadixdConnector):
        self.conn = conn
        self.page = conn.block_size
        self.client = _client(conn, f"vllm-scheduler-{os.getpid()}")
        info = self.client.info()
        if info["page_size"] != self.page:
            raise ValueError(f"radixd connector: radixd's page size {info['page_size']} != vLLM's block size "
                             f"{self.page}; start radixd with --page-size {self.page}")
        self.hybrid = conn.hma
        self.swa = any(k.startswith("swa") for k in conn.groups)
        # the group whose block table decides what is stored (every group's table spans the request's blocks, with
        # null blocks outside a window: a model with no full-attention layer has another group first)
        self.full = conn.groups.index("full") if "full" in conn.groups else 0
        if self.hybrid:
            _check_hybrid_server(info, conn.groups, conn.layout)
        # states are published where radixd wants its checkpoints (--mamba-chunk, on block boundaries) and at the
        # prompt's last block boundary: a longer chunk, fewer publishes on a miss, coarser hits inside a prefix
        chunk = (info.get("hybrid") or {}).get("mamba_chunk") or self.page
        self.checkpoint = self.page * chunk // math.gcd(self.page, chunk)
        self.reqs: dict[str, _Req] = {}
        self.stores: dict[int, tuple] = {}  # id -> (request, start, end, slots as rows of pages, swa floor, state)
        self.copied: dict[int, int] = {}  # store id -> the workers that reported its copy (until all have)
        self._next = 0
        self.running = 0  # requests past their lookup that vLLM has not finished: the engine has other work
        self.hits = 0  # tokens loaded from radixd (for tests and logs)
        self.rpcs = 0  # calls made on the scheduler thread
        self.mamba = "mamba" in conn.groups  # state layers: every store carries the state as of its end
        self.meter = _Meter()
        self.reattached = 0  # radixd restarts this engine went on through (tests, logs)
        self._retry_at = 0.0
        self._attach(info)

    def _attach(self, info: dict) -> None:
        """The threads and index that talk to radixd through `self.client` (again after a radixd restart)."""
        conn = self.conn
        self.instance = info["instance_id"]  # the workers map this instance's pools (the metadata names it)
        # each poll of these threads takes the GIL from the forward in mid-step: the lookup thread does not poll (a
        # submitted lookup wakes it), and the store thread polls every `store_tick_ms`
        self.background = Stores(self.client, self.page, conn.slot_stock, hybrid=self.hybrid,
                                 states=8 if self.mamba else 0, capacity=info["capacity_tokens"],
                                 tick=conn.store_tick, pressure=info.get("pressure_segment", ""))
        self.lookups = Lookups(self.client, conn.load_back and not self.hybrid, self.background, hybrid=self.hybrid,
                               hand_over=True, firsts=self.page, poll=False)
        self.background.first = self.lookups
        self.index: Optional[LocalIndex] = None  # misses answered with no round trip (radixd with --kv-events)
        if conn.local_index and not info["storage"]:  # an L3 tier holds pages the events do not name
            self.index = LocalIndex(self.client, conn.target, self.page, conn.token,
                                    MEDIA if conn.load_back or self.hybrid else ("GPU",))

    def _reattach(self) -> None:
        """radixd restarted (its sessions, locks and slots are gone): attach to the new instance, at most once a
        second, while the engine goes on. Requests in flight keep what they hold in vLLM but neither load nor store
        anything more (their plans name the old instance's slots); the workers map the new pools at the next
        step, as its metadata names the new instance (this step's loads still read the old pools, which the workers
        keep mapped until then). Until radixd answers again every lookup is a miss."""
        now = time.monotonic()
        if now < self._retry_at:
            return
        self._retry_at = now + 1.0
        try:
            client = _client(self.conn, f"vllm-scheduler-{os.getpid()}")
        except RadixdError:
            return
        try:
            info = client.info()
            if info["page_size"] != self.page or info["capacity_tokens"] <= 0:
                raise RadixdError(f"radixd's page size is now {info['page_size']}, vLLM's block {self.page}")
            if self.hybrid:
                _check_hybrid_server(info, self.conn.groups, self.conn.layout)
        except (RadixdError, ValueError) as e:
            log.warning("radixd connector: radixd is back but cannot serve this engine (%s)", e)
            client.close()
            return
        if info["instance_id"] == self.instance:  # the same radixd: the session was lost, not the server
            client.close()
            self.client.lost = False
            return
        old = (self.index, self.lookups, self.background, self.client)
        self.client = client
        self._attach(info)
        for rid, st in self.reqs.items():
            self.background.refused.add(rid)  # its held prefix and slots were the old instance's
            st.inflight.clear()
            st.prefix, st.firsts, st.swa, st.state = EMPTY, [], EMPTY, -1  # a hit no step loaded yet: gone
            if st.pending:  # its lookup went to the old instance: a miss
                st.pending = False
                self.running += 1
        self.stores.clear()  # copies the workers may still report: their slots are gone with the old instance
        self.copied.clear()
        for rid in [rid for rid, st in self.reqs.items() if st.finished]:
            self.reqs.pop(rid)
        self.reattached += 1
        log.warning("radixd connector: radixd restarted (instance %s): attached again; requests in flight store "
                    "nothing more", self.instance)

        def close_old() -> None:  # their last calls fail at once (the session is unknown): off this thread
            for part in old:
                if part is not None:
                    try:
                        part.close()
                    except Exception:
                        pass
        threading.Thread(target=close_old, name="radixd-old-session", daemon=True).start()

    def _align(self, n: int) -> int:
        return max(n, 0) - max(n, 0) % self.page

    def arrived(self, request: "Request") -> None:
        """A request was queued: start its lookup now, so its answer is there when it is scheduled."""
        rid = request.request_id
        if rid in self.reqs or request.prompt_token_ids is None:
            return
        toks = request.prompt_token_ids
        st = _Req(toks, _namespace(request))
        self.reqs[rid] = st
        # every whole page: what radixd has need not be stored again; with state layers only up to the last
        # loadable token, as the state radixd hands back sits exactly at the hit's end
        n = self._align(len(toks) - 1) if self.mamba else self._align(len(toks))
        index = self.index
        if n and self._align(len(toks) - 1) and \
                (index is None or not index.known_miss(toks, st.ns["cache_salt"], st.ns["extra_key"])):
            st.pending, st.asked = True, time.monotonic()
            self.lookups.submit(rid, st.tokens, st.ns, upto=n)
        else:
            self.running += 1

    def matched(self, request: "Request", num_computed: int) -> Optional[int]:
        """Tokens radixd holds beyond vLLM's own (never the last prompt token, which the engine computes); None
        while the lookup is on its way and the engine has other requests to run (asked again next step); with
        nothing else to run it waits for the answer, up to the deadline that turns a lookup into a miss."""
        rid = request.request_id
        st = self.reqs.get(rid)
        if st is None:
            self.arrived(request)
            st = self.reqs.get(rid)
            if st is None:
                return 0
        if st.pending:
            left = self.conn.lookup_deadline - (time.monotonic() - st.asked)
            t = time.perf_counter()
            res = self.lookups.take(rid, left if self.running == 0 else 0.0)
            if self.running == 0:
                self.meter.idle(rid, time.perf_counter() - t)
            if res is None:
                if time.monotonic() - st.asked < self.conn.lookup_deadline:
                    return None
                self.lookups.drop(rid)
                log.info("radixd lookup for %s took longer than %.0f ms: a miss", rid,
                         self.conn.lookup_deadline * 1e3)
                res = (EMPTY, 0, [])
            st.pending = False
            self.running += 1
            st.prefix, st.firsts = res[0], res[-1]  # its lock went to the store thread with the result
            if self.hybrid:
                st.swa = res[2] if len(res) > 3 else EMPTY
                st.state = res[3] if len(res) > 4 else -1
            st.planned = len(st.prefix)
        st.local = num_computed
        if self.mamba and st.state < 0:  # no state to resume from: nothing is loadable
            return 0
        return max(min(len(st.prefix), self._align(len(st.tokens) - 1)) - num_computed, 0)

    def allocated(self, request: "Request", num_external: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is not None and num_external > 0:
            st.load = (st.local, num_external)

    def build(self, so: "SchedulerOutput") -> RadixdConnectorMetadata:
        meta = RadixdConnectorMetadata(preempted=set(so.preempted_req_ids or ()), instance=self.instance)
        self._plans: list[tuple[str, _Req, int, int]] = []
        for nr in so.scheduled_new_reqs:
            st = self.reqs.get(nr.req_id)
            if st is None:
                continue
            st.blocks = [list(b) for b in nr.block_ids]
            if st.load is not None:
                start, n = st.load
                pages = st.firsts[start // self.page:(start + n) // self.page]
                twins = st.swa[start:start + n:self.page].tolist() if self.hybrid else []
                running = []
                if self.mamba:  # the block vLLM runs this step's state in (align mode: the last one it reaches)
                    at = -(-(nr.num_computed_tokens + so.num_scheduled_tokens[nr.req_id]) // self.page) - 1
                    running = [b[at] if k == "mamba" and at < len(b) else 0 for k, b in zip(self.conn.groups, st.blocks)]
                meta.loads.append(([b[start // self.page:(start + n) // self.page] for b in st.blocks], pages, twins,
                                   st.state if self.mamba else -1, running))
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
                st.blocks = [list(b) for b in nb] if nb else []
            elif nb:
                for have, new in zip(st.blocks, nb):
                    have.extend(new)
            self._plan(rid, st, cr.num_computed_tokens[i] + so.num_scheduled_tokens[rid], meta)
        self._allocate(meta)
        if self.client.lost:  # (after this step's loads: vLLM counts on them, from the instance they were found in)
            self._reattach()
        return meta

    def _plan(self, rid: str, st: _Req, computed_after: int, meta: RadixdConnectorMetadata) -> None:
        """Note the prompt pages this step completes beyond what radixd has (slots come in `_allocate`)."""
        end = min(self._align(computed_after), self._align(len(st.tokens)))
        start = st.planned
        if not st.storing or st.finished or st.pending or end <= start or not st.blocks or \
                end // self.page > len(st.blocks[self.full]):
            return
        if rid in self.background.refused:  # an earlier publish of it failed: its pages cannot attach
            st.storing = False
            return
        if self.mamba and (computed_after != end or any(len(b) < end // self.page or b[end // self.page - 1] == 0
                                                        for k, b in zip(self.conn.groups, st.blocks) if k == "mamba")
                           or (end % self.checkpoint and end != self._align(len(st.tokens)))):
            return  # the state as of `end` is only there when the step ends on it (vLLM's align mode)
        self._plans.append((rid, st, start, end))

    def _allocate(self, meta: RadixdConnectorMetadata) -> None:
        """Slots for every page the step stores: from the stock, or one Alloc when it runs short."""
        plans, self._plans = self._plans, []
        if not plans:
            return
        need = [(end - start) // self.page for _, _, start, end in plans]
        nstates = len(plans) if self.mamba else 0
        got = self.background.take_pages(sum(need), states=nstates, firsts=True)
        pages, firsts, twins, states = None, [], None, []
        if got is not None:
            pages, firsts = got
            if self.hybrid:
                pages, twins, states = pages
        if pages is None:
            try:
                self.rpcs += 1
                if self.hybrid:
                    a = self.client.alloc_hybrid([sum(need) * self.page], mamba_states=nstates)
                    pages = a.full[0].reshape(-1, self.page).astype(np.int64)
                    twins = a.swa[0].reshape(-1, self.page).astype(np.int64) if a.swa[0].size else None
                    states = a.states
                else:
                    pages = self.client.alloc(sum(need) * self.page).reshape(-1, self.page).astype(np.int64)
                firsts = pages[:, 0].tolist()
            except RadixdError as e:  # radixd is full of locked pages: this step's pages are not cached there
                log.info("radixd alloc failed (%s); not storing %d requests", e, len(plans))
                for _, st, _, _ in plans:
                    st.storing = False
                return
        at = 0  # firsts: each page's first slot, what the workers copy to (listed by the store thread: each numpy call
        # costs microseconds on the scheduler thread, cold after the forward; rows go to the store thread as they are)
        for i, ((rid, st, start, end), n) in enumerate(zip(plans, need)):
            rows = pages if len(plans) == 1 else pages[at:at + n]
            heads = twins[at:at + n, 0].tolist() if twins is not None and self.swa else []
            state = int(states[i]) if self.mamba else -1
            self._next += 1
            floor = self._swa_floor(st, start, end) if self.swa else 0
            self.stores[self._next] = (rid, start, end, rows, floor, state)
            st.inflight.add(self._next)
            st.planned, st.saved = end, True
            meta.stores.append((self._next, rid, [b[start // self.page:end // self.page] for b in st.blocks],
                                firsts[at:at + n], heads, state))
            at += n

    def _swa_floor(self, st: _Req, start: int, end: int) -> int:
        """Hybrid: the end of the last page in [start, end) whose block a sliding-window group has already let go
        (a null block): radixd must not keep SWA KV below it."""
        floor = 0
        for kind, blocks in zip(self.conn.groups, st.blocks):
            if kind.startswith("swa"):
                span = blocks[start // self.page:end // self.page]
                nulls = [i for i, b in enumerate(span) if b == 0]
                if nulls:
                    floor = max(floor, start + (nulls[-1] + 1) * self.page)
        return floor

    def stored(self, ids: Collection[int] | dict[int, int], failed: Collection[int] = frozenset(),
               workers: int = 1) -> None:
        """Workers copied these stores (with how many of the engine's `workers` did, where counted): a store every
        worker has copied goes to the store thread to publish, then requests that waited on it finish. A failed copy's
        slots go back, and its request stores nothing more."""
        counts = ids if isinstance(ids, dict) else dict.fromkeys(ids, 1)
        done = set()
        for sid, n in counts.items():
            n += self.copied.pop(sid, 0)
            if n >= workers:
                done.add(sid)
            elif sid not in failed:
                self.copied[sid] = n  # (the other ranks' copies are reported at a later step)
        for sid in failed:
            self.copied.pop(sid, None)
        failed = set(failed)
        for sid in sorted(done | failed):
            entry = self.stores.pop(sid, None)
            if entry is None:
                continue
            rid, start, end, slots, floor, state = entry
            st = self.reqs.get(rid)
            if st is None or sid in failed:
                self.background.free(slots, state)
                if st is not None:
                    st.inflight.discard(sid)
                    st.storing = False
                continue
            st.inflight.discard(sid)
            self.background.publish(rid, st.tokens, start, slots, st.ns,  # cut to `end` there
                                    swa_floor=floor, state=state)
        for rid in [rid for rid, st in self.reqs.items() if st.finished and not st.inflight]:
            self._finish(rid)

    def finished(self, rid: str) -> bool:
        """The request is done: its lock goes once its stores are published. Whether any store of its blocks was
        planned (with asynchronous saves its blocks must wait for the workers' copies)."""
        st = self.reqs.get(rid)
        if st is None or st.finished:  # (close() after vLLM's own request_finished)
            return st is not None and st.saved
        st.finished = True
        if st.pending:  # finished (or aborted) before its lookup came back
            st.pending = False
            self.lookups.drop(rid)
        else:  # vLLM has one request fewer to run (its stores may still be landing: the engine need not wait)
            self.running -= 1
        if not st.inflight:  # otherwise the workers' report of this step's stores finishes it
            self._finish(rid)
        return st.saved

    def _finish(self, rid: str) -> None:
        st = self.reqs.pop(rid)
        self.background.release(rid, st.tokens, st.ns)  # as finished: hits counted and host backups started

    def close(self) -> None:
        for rid in list(self.reqs):
            self.finished(rid)
            if rid in self.reqs:
                self.reqs[rid].inflight.clear()
                self._finish(rid)
        if self.index is not None:
            self.index.close()
        self.lookups.close()
        self.background.close()
        self.client.close()


def _client(conn: RadixdConnector, name: str) -> CacheClient:
    """The scheduler side's client: relayed (`radixd_relay`), or a plain one where the relay cannot start."""
    if conn.relay:
        try:
            return RelayedClient(conn.target, token=conn.token, name=name)
        except Unavailable as e:
            log.warning("radixd connector: no relay process (%s); calling radixd from this process", e)
    return CacheClient(conn.target, token=conn.token, name=name)


def _numbers(names: list[str]) -> list[int]:
    """Each vLLM layer's index in the model, as vLLM reads it from the layer's name (a pipeline stage holds some)."""
    from vllm.model_executor.models.utils import extract_layer_index
    numbers = []
    for n in names:
        try:
            numbers.append(extract_layer_index(n))
        except (AssertionError, ValueError):
            numbers.append(-1)
    if min(numbers, default=0) < 0 or len(set(numbers)) != len(numbers):
        raise ValueError(f"radixd connector: cannot tell the model's layers apart by their names: {names[:4]}...")
    return numbers


def _engine_layout(vllm_config: "VllmConfig") -> "ModelLayout":
    """The model's layer layout as the engine's own config object (transformers' class, built by vLLM) gives it."""
    from radixd.server.layouts import LayoutError, config_dict, model_layout
    hf = vllm_config.model_config.hf_config
    try:
        return model_layout(config_dict(hf))
    except LayoutError as e:
        raise ValueError(f"radixd connector (hybrid): radixd cannot read the layers of {type(hf).__name__}: {e}") \
            from None


def _check_hybrid_server(info: dict, groups: list[str], layout: Optional["ModelLayout"] = None) -> None:
    """The radixd server must hold this model's layers the hybrid way, as the engine's config class lays them out,
    with the same window."""
    h = info.get("hybrid")
    if not h or not (h["swa_layers"] or h["state_layers"]):
        raise ValueError("radixd connector (hybrid): the radixd server holds a plain model; start it with "
                         "--hybrid-cache --model-config <this model's config.json>")
    if layout is not None:
        theirs = (list(layout.full_layers), list(layout.swa_layers), list(layout.state_layers))
        mine = (list(h["full_layers"]), list(h["swa_layers"]), list(h["state_layers"]))
        if mine != theirs:
            def kinds(lists) -> str:
                return "; ".join(f"{what} {_ranges(x)}" for what, x in zip(("full", "sliding", "state"), lists) if x)
            raise ValueError(f"radixd connector (hybrid): radixd's layers ({kinds(mine)}) differ from the engine's "
                             f"model ({kinds(theirs)}, its config class); start radixd with --model-config <this "
                             "model's config.json>")
    for what, have, want in (("full-attention", bool(h["full_layers"]), "full" in groups),
                             ("sliding-window", bool(h["swa_layers"]), any(k.startswith("swa") for k in groups)),
                             ("Mamba state", bool(h["state_layers"]), "mamba" in groups)):
        if have != want:
            raise ValueError(f"radixd connector (hybrid): radixd's model {'has' if have else 'has no'} {what} "
                             f"layers, vLLM's {'has' if want else 'has none'}; start radixd with --model-config "
                             "<this model's config.json>")
    windows = {int(k.split(":")[1]) for k in groups if k.startswith("swa:")}
    if windows and windows != {h["sliding_window"]}:
        raise ValueError(f"radixd connector (hybrid): vLLM's sliding window {sorted(windows)} != radixd's "
                         f"{h['sliding_window']}")


_LAYER = re.compile(r"(\d+)")


def _ranges(layers: list[int]) -> str:
    """Layer indices in short form: 0-3,8,10-11."""
    out, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        out.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ",".join(out)


def _probe_cpu_kernel(geo: Geometry, conn: RadixdConnector) -> Geometry:
    """The block layout of the CPU attention kernel this engine runs, learnt from the kernel itself."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(conn.model_dtype, geo.block_size, geo.head_dim, conn.cache_dtype)

    def write(key, value, key_cache, value_cache, slots) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype=conn.cache_dtype)

    return probe_cpu_layout(geo, write, f"vLLM's CPU attention kernel '{isa}' (kv cache dtype {conn.cache_dtype})")


class _Pairs:
    """One group's (vLLM block, radixd page) pairs of a copy, in the forms the two copy paths take, each built once
    when first asked for: numpy block and page numbers (None when a page is not aligned), torch blocks and slots."""

    def __init__(self, blocks: Sequence[int], starts: Sequence[int], device: torch.device, block_size: int):
        self._blocks, self._starts, self._device, self._block_size = blocks, starts, device, block_size

    @functools.cached_property
    def blocks_np(self) -> np.ndarray:
        return np.asarray(self._blocks, dtype=np.int64)

    @functools.cached_property
    def pages(self) -> Optional[np.ndarray]:
        return aligned_pages(self._starts, self._block_size)

    @functools.cached_property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor(self._blocks, dtype=torch.long, device=self._device),
                torch.tensor(self._starts, dtype=torch.long, device=self._device))


def _cpu_list(text: str) -> set[int]:
    """'0,3-5' -> {0, 3, 4, 5}: Linux's CPU list, as taskset -c and VLLM_CPU_OMP_THREADS_BIND write it."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _allowed_cpus() -> set[int]:
    """The CPUs this process may run on at all: its cgroup's cpuset (a container's --cpuset-cpus), else every CPU."""
    try:
        for line in open("/proc/self/cgroup"):
            _, ctrl, path = line.rstrip("\n").split(":", 2)
            if ctrl == "":  # cgroup v2
                where = f"/sys/fs/cgroup{path.rstrip('/')}/cpuset.cpus.effective"
            elif "cpuset" in ctrl.split(","):
                where = f"/sys/fs/cgroup/cpuset{path.rstrip('/')}/cpuset.effective_cpus"
            else:
                continue
            if os.path.exists(where):
                cpus = _cpu_list(open(where).read().strip())
                if cpus:
                    return cpus
    except (OSError, ValueError):
        pass
    return set(range(os.cpu_count() or 1))


def _vllm_forward_cpus(vllm_config: Optional["VllmConfig"]) -> set[int]:
    """The CPUs vLLM binds its CPU workers' forwards to, as its multiprocess executor will compute them (its
    VLLM_CPU_OMP_THREADS_BIND, "auto" by default); empty when it binds none (another platform or executor, nobind)."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind not in ("auto", "nobind", ""):
        return set().union(*(_cpu_list(s) for s in bind.split("|")))
    if bind != "auto" or vllm_config is None or vllm_config.parallel_config.distributed_executor_backend != "mp":
        return set()
    try:
        from vllm.platforms import current_platform
        from vllm.utils.ompmultiprocessing import OMPProcessManager
        if not current_platform.is_cpu():
            return set()
        return set().union(*map(set, OMPProcessManager(vllm_config).cpu_lists))
    except Exception as e:  # (vLLM's helper moved, or the machine's topology is unreadable)
        log.info("radixd connector: vLLM's CPU binding unknown (%s)", e)
        return set()


def helper_cpus(setting: str, vllm_config: Optional["VllmConfig"] = None) -> Optional[set[int]]:
    """The CPUs for the connector's own threads and gRPC's (`radixd_cpus`): off the forward's, so that a publish, a
    lookup or a copy does not take turns with the forward on its CPU. "auto": those the calling thread is not bound
    to (vLLM's CPU worker binds its forward's OpenMP threads, OMP_PROC_BIND, the engine's thread among them, and a
    thread inherits its creator's CPUs), else those vLLM's CPU binding leaves free (an engine core process beside
    its workers); None (the system's choice) when nothing names the forward's CPUs or they are all of them. "all":
    None. Else a CPU list ("3,6-7")."""
    setting = setting.strip().lower()
    if setting == "all":
        return None
    if setting != "auto":
        return _cpu_list(setting) or None
    every = _allowed_cpus()
    forward = os.sched_getaffinity(0)
    if forward >= every:
        forward = _vllm_forward_cpus(vllm_config)
    if not forward:
        return None
    return (every - forward) or None


def _bind(cpus: Optional[set[int]]) -> None:
    """The calling thread on `cpus` from now on (None: left as it is)."""
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:  # (none of them allowed here)
            pass


def beside(cpus: Optional[set[int]], make: Any) -> Any:
    """make(), the calling thread on `cpus` meanwhile: the threads it starts inherit them (gRPC starts its own with the
    process's first channel)."""
    if not cpus:
        return make()
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:  # (none of them allowed here)
        return make()
    try:
        return make()
    finally:
        os.sched_setaffinity(0, mine)


_WAKE_EVERY = 8  # layers whose stores the copy queue takes before its thread is woken (and at the last layer)


class _Layerwise:
    """A step's stores on the copy queue (CPU, a plain model, every layer native): their vLLM blocks and radixd pages'
    first slots, and each layer's ticket, its copy queued once the forward has written the layer (queued: False
    when the queue refused the pages, which then go the general way)."""

    __slots__ = ("blocks", "firsts", "saved", "queued", "started")

    def __init__(self, blocks: list[int], firsts: list[int]):
        self.blocks, self.firsts = blocks, firsts
        self.saved: dict[str, int] = {}
        self.queued = True
        self.started = False  # whether the copy thread was woken after the last submit


def _tp_rank(tp: int) -> int:
    """This worker's tensor-parallel rank, as vLLM's process groups have it."""
    if tp == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    return get_tensor_model_parallel_rank()


def _state_rows(conv_dim: int, temporal: tuple, local_dim: int, tp: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """A Mamba2 rank's conv channels among radixd's `conv_dim` (x, then the B and C groups) and those it writes: vLLM
    shards x, B and C each by rank, or, with one group, gives every rank the whole of B and C (replicas: rank 0 writes
    them). radixd's temporal state [heads, head_dim, d_state] gives x's width and the groups' state size."""
    heads, head_dim, d_state = temporal
    x = heads * head_dim
    gn = (conv_dim - x) // 2
    if gn <= 0 or (conv_dim - x) % 2 or gn % d_state or x % tp:
        raise ValueError(f"radixd connector (hybrid): a conv state of {conv_dim} channels is not a Mamba2 state of "
                         f"{heads} heads of {head_dim} (x) and two groups of state {d_state} (B, C)")
    groups = gn // d_state
    part = x // tp
    own = np.arange(rank * part, (rank + 1) * part)
    if groups % tp == 0:
        g = gn // tp
        bc = np.concatenate([np.arange(x + rank * g, x + (rank + 1) * g),
                             np.arange(x + gn + rank * g, x + gn + (rank + 1) * g)])
        writes = np.ones(len(own) + len(bc), dtype=bool)
    elif groups == 1:  # (vLLM replicates a single group on every rank)
        bc = np.arange(x, conv_dim)
        writes = np.concatenate([np.ones(len(own), dtype=bool), np.full(len(bc), rank == 0)])
    else:
        raise ValueError(f"radixd connector (hybrid): {groups} Mamba groups do not split over {tp} ranks")
    rows = np.concatenate([own, bc])
    if len(rows) != local_dim:
        raise ValueError(f"radixd connector (hybrid): rank {rank} of {tp} holds {local_dim} conv channels; radixd's "
                         f"state of {conv_dim} gives it {len(rows)}")
    return rows, writes


class _Worker:
    """Maps radixd's pools and copies pages between them and vLLM's blocks, each layer in its own group; a tensor-
    parallel rank copies its own KV heads and state channels, a pipeline stage its own layers."""

    def __init__(self, conn: RadixdConnector):
        self.conn = conn
        self.layers: list[torch.Tensor] = []
        self.geo: Optional[Geometry] = None
        self.done: set[int] = set()
        self.failed: set[int] = set()  # stores whose copy raised (reported, so their slots go back)
        self._saves: list[tuple[list[int], set[str], Any]] = []  # (stores, requests, copy handle) in flight: a Future,
        # a CUDA event or a native task (the last two polled alike)
        self._waiting: dict[str, int] = {}  # request -> its copies in flight
        self._saved: set[str] = set()  # requests with a copy launched here that have not finished
        self._finishing: set[str] = set()  # finished requests whose blocks wait for their copies
        self._pool: Optional[ThreadPoolExecutor] = None
        self.pools = None
        self._old_pools = None  # the pools of the radixd instance before a restart (copies may still use them)
        self.instance = ""  # the radixd instance whose pools are mapped
        # kv, group, radixd's k and v (every head), swa, this rank's first head there, whether this rank writes it
        self.plan: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, bool, int, bool]] = []
        self.views: list[Optional[CpuViews]] = []  # per plan entry: its numpy views (a CPU vec-kernel layout)
        # state layers: (group, vLLM's conv and temporal views [blocks, ...], radixd's [slots, ...], conv transposed,
        # this rank's conv channels and temporal heads in radixd's (None: all), the channels it writes)
        self.states: list[tuple] = []
        self.rank = 0  # tensor-parallel rank
        self.queue: Any = None  # CPU, native: the copy queue (register)
        self._spec_of: dict[str, np.ndarray] = {}  # layer name -> its copy_kv_blocks spec
        self._last_layer = ""
        self._step: Optional[_Layerwise] = None
        self._meta: Optional[RadixdConnectorMetadata] = None  # the step `_step` is of
        self.queued_stores = 0  # stores copied through the copy queue, layer by layer (tests, stats)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=lambda n: [int(x) for x in _LAYER.findall(n)] or [0])
        kinds = self.conn.groups
        if self.conn.hma:
            group_of = {n: g for g, grp in enumerate(self.conn._kv_cache_config.kv_cache_groups)
                        for n in grp.layer_names}
            state_names = [n for n in names if kinds[group_of[n]] == "mamba"]
            names = [n for n in names if kinds[group_of[n]] != "mamba"]
        self.layers = [kv_caches[n] for n in names]  # attention layers (none: a pure Mamba model)
        self.device = next(iter(kv_caches.values())).device
        self.rank = _tp_rank(self.conn.tp)
        self.geo = geometry(self.layers[0], self.conn.block_size, self.conn.mla) if self.layers else None
        if self.geo is not None and self.geo.layout == "cpu":
            self.geo = _probe_cpu_kernel(self.geo, self.conn)
        cpus = self.conn.cpus
        self._layout = (names, state_names if self.conn.hma else [], kv_caches, group_of if self.conn.hma else {})
        self._map()
        if self.geo is not None and self.geo.layout == "cpu":
            log.info("radixd connector: %d of %d layers copy through numpy views of the blocks (the rest: the "
                     "general gather)", sum(x is not None for x in self.views), len(self.views))
        dv = self.device
        self.stream = torch.cuda.Stream(device=dv) if dv.type == "cuda" else None  # copies off the compute stream
        # asynchronous stores get their own stream: a load (waited for) must not queue behind them
        self.save_stream = torch.cuda.Stream(device=dv) if dv.type == "cuda" and self.conn.async_save else None
        if self.stream is None and self.conn.async_save:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixd-save",  # (its thread starts at its first job)
                                            initializer=_bind, initargs=(cpus,))
        # CPU, a plain model whose every layer copies natively: stores run on a native thread (the copy queue), a layer
        # at a time beside the forward, each queued as soon as the forward has written the layer (save_kv_layer).
        # Loads run before the forward, half of the layers on the queue's thread and half here at once (_load_split):
        # through the queue layer by layer beside the forward, a hit's TTFT measured worse (the first layer has
        # little forward to overlap, and the hand-over costs a wake)
        if CopyQueue is not None and not self.conn.hma and self.stream is None and self.views and \
                all(v is not None and v.spec is not None for v in self.views) and all(p[6] for p in self.plan):
            self.queue = beside(self.conn.cpus, CopyQueue)
            self._spec_of = {name: v.spec for name, v in zip(names, self.views)}
            self._last_layer = names[-1]  # (the forward's last: names are in layer order)

    def _map(self) -> None:
        """Map radixd's pools (of the instance that answers now) and plan each layer's copies into them."""
        names, state_names, kv_caches, group_of = self._layout
        cpus = self.conn.cpus
        client = beside(cpus, lambda: CacheClient(self.conn.target, token=self.conn.token, attach=False))
        try:
            info = client.info()
            if self.conn.tp > 1 and len(info["device_pools"]) > 1:
                raise ValueError(f"radixd connector: a tensor-parallel engine needs radixd's pages in one device pool "
                                 f"(every rank copies its heads of each page there); radixd has "
                                 f"{len(info['device_pools'])}: start it with one --gpus ordinal")
            # (a rank on another GPU than radixd's pool maps it all the same: its copies go between the GPUs)
            self.pools = client.map_pools(self.device, host=False, elsewhere=self.conn.tp > 1)
        finally:
            client.close()
        self.instance = info["instance_id"]
        beside(cpus, lambda: populate_in_background(
            self.pools.device + [p for p in (self.pools.swa, self.pools.state) if p is not None]))
        dev = self.pools.device[0] if self.pools.device else None  # (None: a model with no full-attention layer)
        if self.conn.hma:
            self.plan = self._hybrid_plan(names, info)
            self.states = self._state_plan(state_names, kv_caches, info, group_of)
        else:
            numbers = _numbers(names) if self.conn.pp > 1 else list(range(len(names)))
            first, writes = self._check(dev, numbers, "")
            ks, vs = (dev.kv_buffer, [None] * len(dev.kv_buffer)) if dev.descriptor.mla else \
                (dev.k_buffer, dev.v_buffer)
            self.plan = [(kv, 0, ks[n], vs[n], False, first, writes) for n, kv in zip(numbers, self.layers)]
        pool = dev or self.pools.swa or self.pools.state
        where = (pool.conv_buffer if pool is self.pools.state else pool.kv_buffer or pool.k_buffer)[0].device
        if where.type != self.device.type:
            raise ValueError(f"radixd connector: radixd's pool is on {where}, vLLM's KV on {self.device}")
        self.views = [cpu_views(kv, self.geo, k, v, first) for kv, _, k, v, _, first, _ in self.plan]

    def _remap(self, instance: str) -> None:
        """radixd restarted and the scheduler attached to `instance`: map its pools. The old mapping is kept until
        the next restart (an asynchronous store of an earlier step may still be copying into it)."""
        old = self.pools
        try:
            self._map()
        except Exception as e:  # radixd went again: the scheduler attaches anew, and this runs at its next step
            log.warning("radixd connector: mapping the pools of radixd instance %s failed: %s", instance, e)
            return
        self._old_pools = old
        if self._spec_of:  # the copy queue's per-layer specs name the pool's addresses
            self._spec_of = {name: v.spec for name, v in zip(self._layout[0], self.views)}
        log.warning("radixd connector worker: mapped the pools of radixd instance %s", self.instance)

    def _check(self, pool, numbers: list[int], what: str) -> tuple[int, bool]:
        """radixd's pool against this worker's layers (their indices in the pool: a pipeline stage has some of them)
        and its share of the KV heads (radixd holds every head; a tensor-parallel rank copies its own): the rank's
        first head in radixd's and whether it writes it."""
        d, tp = pool.descriptor, self.conn.tp
        total = d.kv_heads
        share = total // tp if total % tp == 0 else 1 if tp % total == 0 else 0  # (head_share's, as vLLM shards)
        layers = len(numbers) if self.conn.pp == 1 else d.num_layers  # (a stage: its layers are in range, below)
        vllm = (layers, self.geo.kv_heads, self.geo.head_dim, self.geo.block_size, self.geo.dtype)
        bufs = pool.kv_buffer or pool.k_buffer
        radixd = (d.num_layers, share, d.head_dim, d.page_size, bufs[0].dtype if bufs else None)
        if d.mla != (self.geo.layout == "mla") or vllm != radixd or max(numbers) >= d.num_layers:
            per = f" per rank of {tp}" if tp > 1 else ""
            mla = f" MLA: vLLM {self.geo.layout == 'mla'}, radixd {d.mla};"
            raise ValueError(f"radixd connector: the {what}KV geometry differs (layers, kv heads{per}, head dim, "
                             f"page size, dtype):{mla} vLLM has {vllm}, radixd has {radixd} (layers {sorted(numbers)} "
                             "here); start radixd with the whole model's --layers/--kv-heads/--head-dim/--page-size/"
                             "--dtype (or --model-config, without --tp-size)")
        first, _, writes = head_share(total, self.geo.kv_heads, tp, self.rank)
        return first, writes

    def _hybrid_plan(self, names: list[str], info: dict) -> list:
        """Each vLLM layer -> its KV cache group and its buffers in radixd's FULL or SWA pool."""
        _check_hybrid_server(info, self.conn.groups, self.conn.layout)  # (the workers map before a scheduler exists)
        h = info["hybrid"]
        group_of = {n: g for g, grp in enumerate(self.conn._kv_cache_config.kv_cache_groups) for n in grp.layer_names}
        full, swa = h["full_layers"], h["swa_layers"]
        numbers = _numbers(names)
        shares = {}
        for pool, kind, what in ((self.pools.device[0] if full else None, full, "full-attention "),
                                 (self.pools.swa, swa, "sliding-window ")):
            mine = [kind.index(n) for n in numbers if n in kind]
            if mine:
                shares[id(pool)] = self._check(pool, mine if self.conn.pp > 1 else list(range(len(kind))), what)
        plan = []
        for n, name, kv in zip(numbers, names, self.layers):
            if n in full:
                pool, i, is_swa = self.pools.device[0], full.index(n), False
            elif n in swa:
                pool, i, is_swa = self.pools.swa, swa.index(n), True
            else:
                raise ValueError(f"radixd connector (hybrid): layer {name} is neither full-attention nor "
                                 "sliding-window in radixd's layout of the model")
            if is_swa != self.conn.groups[group_of[name]].startswith("swa"):
                raise ValueError(f"radixd connector (hybrid): layer {name} is {'not ' if is_swa else ''}sliding-"
                                 "window in vLLM but the other way round in radixd's layout")
            plan.append((kv, group_of[name], pool.k_buffer[i], pool.v_buffer[i], is_swa, *shares[id(pool)]))
        return plan

    def _state_plan(self, names: list[str], kv_caches: dict[str, torch.Tensor], info: dict,
                    group_of: dict[str, int]) -> list:
        """Each vLLM Mamba layer -> views of its conv and temporal state per block (vLLM packs both into one raw
        page per block) and its buffers in radixd's state pool, with the conv state's orientation and, for a
        tensor-parallel rank, its conv channels and temporal heads there (radixd holds the whole state)."""
        if not names:
            return []
        h, pool = info["hybrid"], self.pools.state
        if pool is None:
            raise ValueError("radixd connector (hybrid): the radixd server has no state pool")
        groups = self.conn._kv_cache_config.kv_cache_groups
        numbers, layers = _numbers(names), h["state_layers"]
        if not set(numbers) <= set(layers) and self.conn.pp == 1 and len(numbers) == len(layers):
            # (vLLM numbers a layer's second mixer past the model's layers: Falcon-H1's Mamba of layer i is
            # "model.{layers + i}.mixer"; the whole model's Mamba layers, in vLLM's order, are radixd's in its own)
            numbers = [layers[k] for k in np.argsort(np.argsort(numbers))]
        plan = []
        for name, n in zip(names, numbers):
            if n not in layers:
                raise ValueError(f"radixd connector (hybrid): layer {name} is a Mamba layer in vLLM but not a state "
                                 "layer in radixd's layout of the model")
            i = layers.index(n)
            spec = groups[group_of[name]].kv_cache_spec
            pages = kv_caches[name].reshape(kv_caches[name].shape[0], -1)
            views, off = [], 0
            for shape, dtype in zip(spec.shapes, spec.dtypes):
                nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
                views.append(pages[:, off:off + nbytes].view(dtype).view(-1, *shape))
                off += nbytes
            conv, temporal = views
            rconv, rtemp = pool.conv_buffer[i], pool.temporal_buffer[i]
            (dim, width), mine, tp = tuple(rconv.shape[1:]), tuple(conv.shape[1:]), self.conn.tp
            if mine == (dim, width) or (tp > 1 and mine[1] == width):
                flip, local = False, mine[0]
            elif mine == (width, dim) or (tp > 1 and mine[0] == width):
                flip, local = True, mine[1]  # vLLM's default (state_len, dim) against radixd's (dim, state_len)
            else:
                raise ValueError(f"radixd connector (hybrid): the conv state of {name} is {mine} in vLLM and "
                                 f"{(dim, width)} in radixd")
            rows = wsel = wrows = None
            heads = slice(None)
            if tp > 1:  # (radixd's state is the whole model's; this rank's channels and heads of it)
                at, writes = _state_rows(dim, tuple(rtemp.shape[1:]), local, tp, self.rank)
                rows = torch.from_numpy(at).to(rconv.device)
                wsel = torch.from_numpy(np.flatnonzero(writes)).to(rconv.device)
                wrows = rows[wsel]
                per = rtemp.shape[1] // tp
                heads = slice(self.rank * per, (self.rank + 1) * per)
            if tuple(temporal.shape[1:]) != tuple(rtemp[:, heads].shape[1:]) or conv.dtype != rconv.dtype or \
                    temporal.dtype != rtemp.dtype:
                raise ValueError(f"radixd connector (hybrid): the state of {name} differs: vLLM has conv "
                                 f"{conv.dtype}, temporal {tuple(temporal.shape[1:])} {temporal.dtype}; radixd has "
                                 f"conv {rconv.dtype}, temporal {tuple(rtemp.shape[1:])} {rtemp.dtype} (config's "
                                 "torch_dtype / mamba_ssm_cache_dtype)")
            plan.append((group_of[name], conv, temporal, rconv, rtemp, flip, rows, wsel, wrows, heads))
        return plan

    def _copy_states(self, groups: list[list[int]], slot: int, load: bool, running: Optional[list[int]] = None) -> None:
        """radixd's state slot <-> the last block of each Mamba group's span (a load: and the running block)."""
        if slot < 0:
            return
        for g, conv, temporal, rconv, rtemp, flip, rows, wsel, wrows, heads in self.states:
            block = groups[g][-1] if groups[g] else 0
            if block == 0:
                raise RuntimeError(f"radixd connector: no state block in Mamba group {g} ({groups[g]})")
            if load:
                src = rconv[slot] if rows is None else rconv[slot].index_select(0, rows)  # [channels, width]
                for b in {block, running[g] if running else 0} - {0}:
                    conv[b].copy_(src.t() if flip else src)
                    temporal[b].copy_(rtemp[slot][heads])
            else:
                mine = conv[block].t() if flip else conv[block]
                if rows is None:
                    rconv[slot].copy_(mine)
                else:  # (channels another rank holds too are written by rank 0 only)
                    rconv[slot].index_copy_(0, wrows, mine.index_select(0, wsel))
                rtemp[slot][heads].copy_(temporal[block])

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

    def _pairs(self, groups: list[list[int]], pages: list[int], twins: list[int]) -> dict:
        """(group, swa) -> (vLLM blocks, radixd page first slots), leaving out null blocks (outside a window)
        and pages without an SWA twin."""
        out = {}
        for _, g, _, _, swa, _, _ in self.plan:
            if (g, swa) in out:
                continue
            src = twins if swa else pages
            kept = [(b, p) for b, p in zip(groups[g], src) if b != 0 and p >= 0] if swa else list(zip(groups[g], src))
            if kept:
                b, p = zip(*kept)
                out[(g, swa)] = _Pairs(b, p, self.device, self.geo.block_size)
        return out

    def _each_layer(self, pairs: dict, load: bool) -> None:
        """Copy every layer's pages: through the layer's numpy views where it has them, else by torch's gather."""
        for (kv, g, k, v, swa, first, writes), views in zip(self.plan, self.views):
            pr = pairs.get((g, swa))
            if pr is None or not (load or writes):  # (a head another rank writes: it holds the same values)
                continue
            if views is not None and pr.pages is not None:
                if load:
                    views.load(pr.blocks_np, pr.pages)
                else:
                    views.save(pr.blocks_np, pr.pages)
            else:
                blocks, starts = pr.tensors
                (load_blocks if load else save_blocks)(kv, self.geo, blocks, k, v, starts, first)

    def _step_for(self, meta: RadixdConnectorMetadata) -> Optional[_Layerwise]:
        """The step's stores on the copy queue, set up at its first save_kv_layer (lists as vLLM's scheduler sent
        them: the queue converts them in one call); None when the step stores nothing."""
        if self._meta is not meta:
            self._meta = meta
            stores = meta.stores
            if not stores:
                self._step = None
            elif len(stores) == 1:
                self._step = _Layerwise(stores[0][2][0], stores[0][3])
            else:
                self._step = _Layerwise([x for _, _, groups, _, _, _ in stores for x in groups[0]],
                                        [x for _, _, _, firsts, _, _ in stores for x in firsts])
        return self._step

    def layer_written(self, name: str, meta: RadixdConnectorMetadata) -> None:
        """The forward has written the layer's KV: its store starts on the copy queue (where the queue takes the
        step's pages; else every layer is stored the general way in wait_for_save)."""
        if self.queue is None or (meta.instance and meta.instance != self.instance):
            return
        step = self._step_for(meta)
        if step is None or not step.queued or name in step.saved:
            return
        spec = self._spec_of.get(name)
        if spec is not None:  # (the thread is woken every few layers and at the last: each wake costs this thread)
            start = name == self._last_layer or len(step.saved) % _WAKE_EVERY == _WAKE_EVERY - 1
            t = self.queue.submit(spec, step.blocks, step.firsts, False, self.geo.block_size, start)
            if t is None:  # (unaligned pages or an index out of range: the same at every layer)
                step.queued = False
            else:
                step.saved[name], step.started = t, start

    def load(self, meta: RadixdConnectorMetadata) -> None:
        if meta.instance and meta.instance != self.instance:
            self._remap(meta.instance)
            if self.instance != meta.instance and meta.loads:  # (radixd went again before its pools were mapped)
                raise RuntimeError(f"radixd connector: this step loads from radixd instance {meta.instance}, whose "
                                   "pools could not be mapped")

        def run() -> None:
            for groups, pages, twins, state, running in meta.loads:
                self._each_layer(self._pairs(groups, pages, twins), load=True)
                self._copy_states(groups, state, load=True, running=running)
        if meta.loads and self.queue is not None:
            self._load_split(meta)
        elif meta.loads:
            self._copy(run)

    def _load_split(self, meta: RadixdConnectorMetadata) -> None:
        """A plain model's load on two CPUs: the later layers on the copy queue's thread (beside the forward's CPU,
        idle while the engine waits for its loads), the earlier ones here at the same time; both done before the
        forward, which reads every layer. A load is the conversion to vLLM's block layout, bound by a CPU rather
        than by memory, so two halves take about half the time."""
        specs = list(self._spec_of.values())
        half = len(specs) // 2
        last = 0
        for groups, pages, _, _, _ in meta.loads:
            for spec in specs[half:]:
                t = self.queue.submit(spec, groups[0], pages, True, self.geo.block_size)
                if t is None:  # (a page out of range: every layer the general way, which raises)
                    self.queue.wait(last)
                    return self._copy(lambda: [self._each_layer(self._pairs(g, p, tw), load=True)
                                               for g, p, tw, _, _ in meta.loads])
                last = t
        for groups, pages, twins, _, _ in meta.loads:
            pairs = self._pairs(groups, pages, twins)
            for (kv, g, k, v, swa, first, _), views in zip(self.plan[:half], self.views[:half]):
                pr = pairs[(g, swa)]
                if pr.pages is not None:
                    views.load(pr.blocks_np, pr.pages)
                else:  # (radixd pages not whole blocks' worth: the general gather, as _each_layer does)
                    blocks, starts = pr.tensors
                    load_blocks(kv, self.geo, blocks, k, v, starts, first)
        self.queue.wait(last)

    def save(self, meta: RadixdConnectorMetadata) -> None:
        """Copy this step's stores into radixd, waited for here: on the copy queue, where each layer's copy was queued
        as the forward wrote it (only the last layers' are left to wait for), else all at once (on the side stream on
        GPU); or, with async_save, reported when they have landed (on CPU the copy queue or the copy thread, on GPU
        the save stream), so the step's outputs do not wait for them."""
        def run() -> None:
            for _, _, groups, pages, twins, state in meta.stores:
                self._each_layer(self._pairs(groups, pages, twins), load=False)
                self._copy_states(groups, state, load=False)
        step = self._step_for(meta) if self.queue is not None else None
        self._meta = self._step = None
        if not meta.stores:
            return
        sids, rids = [x[0] for x in meta.stores], {x[1] for x in meta.stores}
        if meta.instance and meta.instance != self.instance:  # slots of pools not mapped here: never written
            self.failed.update(sids)
            return
        handle: Any = None
        if step is not None and step.queued:
            for name, spec in self._spec_of.items():  # (layers the forward did not report written)
                if name not in step.saved:
                    t = self.queue.submit(spec, step.blocks, step.firsts, False, self.geo.block_size)
                    if t is None:
                        break
                    step.saved[name], step.started = t, True
            last = max(step.saved.values(), default=0)
            if len(step.saved) == len(self._spec_of):
                self.queued_stores += len(sids)
                if not self.conn.async_save:
                    self.queue.wait(last)
                    self.done.update(sids)
                    return
                if not step.started:  # (a Ticket is polled, never waited for: its jobs must be under way)
                    self.queue.start()
                handle = Ticket(self.queue, last)
            else:  # not every layer's pages went: they all go the general way, after the queue's copies of them
                self.queue.wait(last)
        if handle is None:
            if not self.conn.async_save:
                self._copy(run)
                self.done.update(sids)
                return
            if self.save_stream is None:
                handle = self._pool.submit(run)
            else:
                self.save_stream.wait_stream(torch.cuda.current_stream())  # after the forward's writes
                with torch.cuda.stream(self.save_stream):
                    run()
                handle = torch.cuda.Event()
                handle.record(self.save_stream)
        self._saves.append((sids, rids, handle))
        for r in rids:
            self._waiting[r] = self._waiting.get(r, 0) + 1
        self._saved |= rids

    def _poll(self, wait_for: set[str] = frozenset()) -> None:
        """Collect the copies that have landed, waiting for those of the requests in `wait_for` (in launch order:
        the copy thread and the side stream run them in that order)."""
        left = []
        for sids, rids, h in self._saves:
            if rids & wait_for:
                err = h.exception() if isinstance(h, Future) else h.synchronize()
            elif isinstance(h, Future) and h.done():
                err = h.exception()
            elif not isinstance(h, Future) and h.query():
                err = None
            else:
                left.append((sids, rids, h))
                continue
            if err is not None:  # the pages hold garbage: never published, their slots go back
                log.error("radixd connector: a store copy failed (%r); stores %s are dropped", err, sids)
                self.failed.update(sids)
            else:
                self.done.update(sids)
            for r in rids:
                n = self._waiting.pop(r) - 1
                if n:
                    self._waiting[r] = n
        self._saves = left

    def finished(self, finished_req_ids: set[str]) -> Optional[set[str]]:
        """Finished requests whose blocks vLLM kept for the copies (request_finished said so: every request with
        a store planned) and whose copies have all landed: vLLM frees their blocks now."""
        if not self.conn.async_save:
            return None
        for r in finished_req_ids & self._saved:
            self._saved.discard(r)
            self._finishing.add(r)
        self._poll()
        out = {r for r in self._finishing if r not in self._waiting}
        self._finishing -= out
        return out or None

    def preempted(self, rids: set[str]) -> None:
        """Preempted requests' blocks are handed to others in this very step: their copies must land first."""
        if rids & self._waiting.keys():
            self._poll(wait_for=rids)

    def report(self) -> Optional[RadixdWorkerMetadata]:
        self._poll()
        if not (self.done or self.failed):
            return None
        out = RadixdWorkerMetadata(dict.fromkeys(self.done, 1), self.failed)
        self.done, self.failed = set(), set()
        return out

    def close(self) -> None:
        if self._saves:
            self._poll(wait_for=set(self._waiting))
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.queue is not None:
            self.queue.close()
        self.plan, self.states, self.views = [], [], []  # (views and addresses of the pools about to be unmapped)
        if self.pools is not None:
            self.pools.close()
            self.pools = None
