"""Build and run the server: pools, engine, gRPC (health, reflection, auth, TLS), metrics, signals."""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import socket
import stat
import uuid
import zlib
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from radixd.proto import cache_pb2, cache_pb2_grpc

from .config import Config, host_slots_for, source_of
from .events import EventHub
from .memory import retain_freed_memory
from .core import CacheCore
from .metrics import Metrics
from .pools.allocator import SlotAllocator
from .pools.cuda import cuda_available
from .pools.pool import KVPool
from .pools.shm import SHM_DIR, cleanup_stale, shm_room
from .pools.spec import total_bytes
from .pools.spec import PoolSpec
from .pressure import Pressure
from .quiet import native_stderr
from .service import RadixCacheService, TokenAuth
from .tiers import HostTier
from .transfer.engine import TransferEngine
from .tree import RadixTree

log = logging.getLogger("radixd")
SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["RadixCache"].full_name


def pick_backend(device: str, source: str = "--device") -> str:
    """auto -> cuda when a GPU is visible, else shm."""
    if device == "cpu":
        return "shm"
    if device == "cuda":
        if not cuda_available():
            raise StartupError(f"{source} cuda: no CUDA GPU visible (or cupy missing); use cpu or auto")
        return "cuda"
    return "cuda" if cuda_available() else "shm"


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class StartupError(Exception):
    """The configuration cannot be served on this machine; the message says what to change."""


START_STEPS = ("config", "pools", "host_pool", "storage", "events", "tls", "listen", "metrics", "serving")


def _step(name: str) -> None:
    """Tests force a failure (RADIXD_TEST_FAIL_AT) or a SIGTERM (RADIXD_TEST_TERM_AT) at one start-up step, to
    check that a start stopped there leaves nothing behind. `listen` is reached once per address."""
    if os.environ.get("RADIXD_TEST_FAIL_AT") == name:
        raise StartupError(f"injected failure at start-up step {name!r} (RADIXD_TEST_FAIL_AT)")
    if os.environ.get("RADIXD_TEST_TERM_AT") == name:
        os.kill(os.getpid(), signal.SIGTERM)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def _device_sources(cfg: Config) -> str:
    return f"{source_of(cfg, 'num_slots')} (or the KV geometry)"


def _host_sources(cfg: Config) -> str:
    given = [n for n in ("host_slots", "host_mem", "host_ratio") if getattr(cfg, n)]
    return " / ".join(source_of(cfg, n) for n in given) or "--host-slots"


def _check_shm(device_bytes: int, host_bytes: int, cfg: Config) -> None:
    """Refuse shared-memory pools that the shm mount or the machine's memory cannot back."""
    need = device_bytes + host_bytes
    free, avail = shm_room()
    room = min(free, avail)
    if need > room:
        which = _device_sources(cfg) if device_bytes >= host_bytes else _host_sources(cfg)
        raise StartupError(f"the pools need {_gb(need)} of shared memory (device {_gb(device_bytes)}, host "
                           f"{_gb(host_bytes)}), but {SHM_DIR} has {_gb(free)} free and {_gb(avail)} of memory is "
                           f"available: lower {which}")


def check_gpus(pool_bytes: int, gpus: list[int], free_of=None, what: str = "--num-slots (or the KV geometry)") -> None:
    """Refuse a device pool larger than what each GPU has free now (leaving 5% for the CUDA context)."""
    if free_of is None:
        from .pools.cuda import free_bytes as free_of
    for g in gpus:
        free = free_of(g)
        if pool_bytes > free * 0.95:
            raise StartupError(f"the device pool needs {_gb(pool_bytes)} on GPU {g}, which has {_gb(free)} free: "
                               f"lower {what}")


def build_hybrid_core(cfg: Config, instance_id: str, backend: str) -> CacheCore:
    """A hybrid model's three pools (FULL KV, SWA KV, states), their allocators and the hybrid tree."""
    from .hybrid_core import HybridCore
    from .hybrid_tiers import HybridHostTier
    from .pools.hybrid import StatePool, SwaTranslation, state_pool_bytes
    from .tree.events import CPU
    from .tree.hybrid import HybridTree
    lay = cfg._layout
    if len(cfg.gpus) > 1:
        raise StartupError(f"{source_of(cfg, 'hybrid_cache')}: a hybrid model on more than one GPU is not supported yet")
    # no full-attention layer (every layer sliding, pure Mamba2): the FULL slots are the tree's keys with no KV pool
    spec = PoolSpec(num_layers=cfg.layers, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype,
                    page_size=cfg.page_size, num_slots=cfg.num_slots, mla=cfg.mla) if lay.full_layers else None
    swa_spec = None
    if lay.swa_layers:
        swa_slots = int(cfg.num_slots * cfg.swa_ratio) // cfg.page_size * cfg.page_size
        if swa_slots < cfg.page_size:
            raise StartupError(f"{source_of(cfg, 'swa_ratio')}: {cfg.swa_ratio} of {cfg.num_slots} slots is less "
                               "than one page of SWA KV")
        swa_spec = PoolSpec(num_layers=len(lay.swa_layers), kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                            dtype=cfg.dtype, page_size=cfg.page_size, num_slots=swa_slots, mla=cfg.mla)
    state_bytes = state_pool_bytes(len(lay.state_layers), lay.state, cfg.mamba_states) if lay.state_layers else 0
    # the host tier keeps the device's proportions: SWA slots per FULL slot, state slots per FULL slot
    per_token = (spec.slot_bytes if spec else 0) + (swa_spec.slot_bytes * cfg.swa_ratio if swa_spec else 0) + (
        state_bytes / cfg.num_slots)
    host_slots = host_slots_for(cfg, max(1, int(per_token + 0.999)))
    host_swa = int(host_slots * cfg.swa_ratio) // cfg.page_size * cfg.page_size if swa_spec and host_slots else 0
    host_states = max(1, cfg.mamba_states * host_slots // cfg.num_slots) if lay.state_layers and host_slots else 0
    if host_slots and swa_spec and host_swa < cfg.page_size:
        raise StartupError(f"{_host_sources(cfg)}: {host_slots} host slots leave less than one page of SWA KV")
    host_bytes = 0
    if host_slots:
        host_bytes = (total_bytes(spec.with_slots(host_slots, cfg.host_layout)) if spec else 0) + (
            total_bytes(swa_spec.with_slots(host_swa, cfg.host_layout)) if swa_spec else 0) + (
            state_pool_bytes(len(lay.state_layers), lay.state, host_states) if host_states else 0)
    device_bytes = (total_bytes(spec) if spec else 0) + (total_bytes(swa_spec) if swa_spec else 0) + state_bytes
    if backend == "shm":
        _check_shm(device_bytes, host_bytes, cfg)
    else:
        _check_shm(0, host_bytes, cfg)
        check_gpus(device_bytes, cfg.gpus or [0], what=_device_sources(cfg))
    device_index = (cfg.gpus or [0])[0]
    pools: list = []
    try:
        if spec is not None:
            pools.append(KVPool(spec, "device", instance_id, backend, device_index=device_index))
        if swa_spec is not None:
            pools.append(KVPool(swa_spec, "swa", instance_id, backend, device_index=device_index))
        if lay.state_layers:
            pools.append(StatePool(cfg.mamba_states, len(lay.state_layers), lay.state, instance_id, backend=backend,
                                   device_index=device_index))
        host_pools: list = []
        if host_slots:
            pin = backend == "cuda"
            if spec is not None:
                host_pools.append(KVPool(spec.with_slots(host_slots, cfg.host_layout), "host", instance_id, "shm",
                                         pin=pin))
            if swa_spec is not None:
                host_pools.append(KVPool(swa_spec.with_slots(host_swa, cfg.host_layout), "host-swa", instance_id,
                                         "shm", pin=pin))
            if host_states:
                host_pools.append(StatePool(host_states, len(lay.state_layers), lay.state, instance_id, index=1))
            pools += host_pools
        if cfg.prefault:
            for p in pools:
                if hasattr(p, "prefault"):
                    p.prefault()
        _step("pools")
    except BaseException:
        for p in pools:
            p.close()
        raise
    window = lay.window if lay.swa_layers else None
    chunk = cfg.mamba_chunk if lay.state_layers else None
    events = bool(cfg.kv_events or cfg.kv_events_endpoint or cfg.kv_events_replay_endpoint)
    full_kv = bool(lay.full_layers)
    # a hybrid host tier is write-back unless a write-through policy is asked for (the plain tier's default is not)
    policy = cfg.write_policy if host_slots and "write_policy" in getattr(cfg, "_origin", {}) else "write_back"
    threshold = None if policy == "write_back" else cfg.write_through_threshold or (
        1 if policy == "write_through" else 2)
    tree = HybridTree(cfg.page_size, window=window, mamba_chunk=chunk, events=events, victims=bool(host_slots),
                      full_kv=full_kv, write_through_threshold=threshold)
    full_pools = pools[:1] if spec is not None else []
    swa_pool = pools[len(full_pools)] if swa_spec is not None else None
    state_pool = pools[len(full_pools) + (swa_spec is not None)] if lay.state_layers else None
    host_tier = None
    if host_slots:
        host_tier = HybridHostTier(
            HybridTree(cfg.page_size, window=window, mamba_chunk=chunk, events=events, medium=CPU, full_kv=full_kv,
                       victims=bool(cfg.storage) and cfg.storage_write_policy == "write_back"),
            SlotAllocator(host_slots, cfg.page_size),
            host_pools[0] if spec is not None else None,
            swa=SwaTranslation(host_slots, host_swa, cfg.page_size) if swa_spec else None,
            swa_pool=host_pools[int(spec is not None)] if swa_spec is not None else None,
            states=SlotAllocator(host_states) if host_states else None,
            state_pool=host_pools[-1] if host_states else None, load_back_threshold=cfg.load_back_threshold)
        _step("host_pool")
    core = HybridCore(tree, SlotAllocator(cfg.num_slots, cfg.page_size), instance_id, full_pools,
                      swa=SwaTranslation(cfg.num_slots, swa_spec.num_slots, cfg.page_size) if swa_spec else None,
                      swa_pool=swa_pool, states=SlotAllocator(cfg.mamba_states) if state_pool else None,
                      state_pool=state_pool, layout=lay, max_batch_tokens=cfg.num_slots, host_tier=host_tier)
    if host_tier is not None:
        host_tier.prepare(core)
    if cfg.storage:
        try:
            attach_component_storage(cfg, core, spec, swa_spec)
        except BaseException:
            if core.storage is not None:
                core.storage.close()
            for p in core.all_pools():
                p.close()
            raise
        _step("storage")
    return core


def attach_component_storage(cfg: Config, core: CacheCore, spec: Optional[PoolSpec],
                             swa_spec: Optional[PoolSpec]) -> None:
    """A hybrid model's L3 tier: one store per component (FULL pages, SWA pages, states) on the URL given, each
    under a format tag of its own."""
    import hashlib

    from .storage import format_tag, open_store
    from .storage.components import ComponentStorage
    where = source_of(cfg, "storage")
    host = core.host_tier
    if host is None:
        raise StartupError(f"{where} {cfg.storage}: L3 needs the host tier (give --host-slots, --host-mem or "
                           "--host-ratio)")
    lay = cfg._layout
    sizes, fmts = {}, {}
    if spec is not None:
        sizes["full"], fmts["full"] = spec.slot_bytes * spec.page_size, format_tag(spec, cfg.model_id)
    if swa_spec is not None:
        sizes["swa"] = swa_spec.slot_bytes * swa_spec.page_size
        fmts["swa"] = format_tag(swa_spec, f"{cfg.model_id}|component=swa|window={lay.window}")
    if lay.state_layers:
        sizes["mamba"] = lay.state_bytes()
        what = f"model={cfg.model_id}|state={lay.state}|layers={len(lay.state_layers)}|object=state-v1"
        fmts["mamba"] = hashlib.sha256(what.encode()).hexdigest()[:16]
    stores = {}
    try:
        for kind, size in sizes.items():
            stores[kind] = open_store(cfg.storage, size)
    except ValueError as e:
        for st in stores.values():
            st.close()
        raise StartupError(f"{where}: {e}") from None
    core.storage = host.storage = ComponentStorage(stores, host, fmts, cfg.prefetch_threshold, cfg.prefetch_policy,
                                                   cfg.prefetch_timeout_ms, cfg.storage_write_policy)
    core.storage_format = ",".join(f"{k}:{v}" for k, v in fmts.items())
    log.info("storage %s formats %s", core.storage.store.describe(), core.storage_format)
    if not cfg.model_id:
        log.warning("storage without --model-id: servers of different models with the same KV geometry would "
                    "share pages; name the model")


def build_core(cfg: Config, instance_id: str) -> CacheCore:
    """Pools, allocators and tree for a config; a failure leaves no pool behind."""
    backend = pick_backend(cfg.device, source_of(cfg, "device"))
    if cfg.hybrid_cache:
        if backend != "cuda":
            cfg.gpus = []
        return build_hybrid_core(cfg, instance_id, backend)
    spec = PoolSpec(num_layers=cfg.layers, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype,
                    page_size=cfg.page_size, num_slots=cfg.num_slots, mla=cfg.mla)
    if backend != "cuda":
        cfg.gpus = []  # no GPU in use: say so in the start-up line instead of a misleading [0]
    gpus = cfg.gpus if backend == "cuda" else [0]
    host_slots = host_slots_for(cfg, spec.slot_bytes)
    if host_slots and len(gpus) > 1:
        raise StartupError(f"{source_of(cfg, 'gpus')}: a host tier with more than one device pool is not supported "
                           "yet")
    host_spec = spec.with_slots(host_slots, cfg.host_layout) if host_slots else None
    _check_shm(total_bytes(spec) * len(gpus) if backend == "shm" else 0, total_bytes(host_spec) if host_spec else 0,
               cfg)
    if backend == "cuda":
        check_gpus(total_bytes(spec), gpus, what=_device_sources(cfg))
    pools: list[KVPool] = []
    try:
        for i, g in enumerate(gpus):
            pools.append(KVPool(spec, "device", instance_id, backend, device_index=g, index=i))
        if cfg.prefault:
            for p in pools:
                p.prefault()
        _step("pools")
        if host_spec is not None:
            pools.append(KVPool(host_spec, "host", instance_id, "shm", pin=backend == "cuda"))
            if cfg.prefault:
                pools[-1].prefault()
            _step("host_pool")
    except BaseException:
        for p in pools:
            p.close()
        raise
    device_pools = pools[:len(gpus)]
    host_pool = pools[-1] if host_spec is not None else None
    host_alloc = host = None
    if host_slots:
        host_alloc = SlotAllocator(host_slots, cfg.page_size)
    tag = zlib.crc32(instance_id.encode()) & 0xFFFF
    tree = RadixTree(page_size=cfg.page_size, policy=cfg.eviction_policy, bigram=cfg.bigram, instance_tag=tag,
                     write_policy=cfg.write_policy if host_slots else None,
                     write_through_threshold=cfg.write_through_threshold,
                     load_back_threshold=cfg.load_back_threshold,
                     events=bool(cfg.kv_events or cfg.kv_events_endpoint or cfg.kv_events_replay_endpoint))
    alloc = SlotAllocator(cfg.num_slots, cfg.page_size)
    if host_slots:
        engine = TransferEngine()
        engine.prepare(device_pools[0], host_pool)
        engine.fail_next = int(os.environ.get("RADIXD_TEST_FAIL_COPIES", "0"))  # tests: the first N copies fail
        host = HostTier(tree, alloc, device_pools[0], host_alloc, host_pool, engine)
    core = CacheCore(tree, alloc, instance_id, device_pools, host_pool, host_alloc, max_batch_tokens=cfg.num_slots,
                     host=host)
    if cfg.storage:
        try:
            attach_storage(cfg, core, spec)
            _step("storage")
        except BaseException:
            if core.storage is not None:
                core.storage.close()
            for p in pools:
                p.close()
            raise
    return core


def attach_storage(cfg: Config, core: CacheCore, spec: PoolSpec) -> None:
    """Open the L3 store and put the storage tier behind the host tier (a bad URL fails the start)."""
    from .storage import StorageTier, format_descriptor, format_tag, open_store
    where = source_of(cfg, "storage")
    if core.host is None:
        raise StartupError(f"{where} {cfg.storage}: L3 needs the host tier (give --host-slots, --host-mem or "
                           "--host-ratio)")
    if cfg.bigram:
        raise StartupError(f"{where} with {source_of(cfg, 'bigram')}: not supported (EAGLE bigram keys have no "
                           "storage format)")
    try:
        store = open_store(cfg.storage, spec.slot_bytes * spec.page_size)
    except ValueError as e:
        raise StartupError(f"{where}: {e}") from None
    fmt = format_tag(spec, cfg.model_id)
    core.host.storage = core.storage = StorageTier(
        store, core.host, fmt, cfg.storage_write_policy, cfg.prefetch_threshold, cfg.prefetch_policy,
        cfg.prefetch_timeout_ms)
    core.storage_format = fmt
    log.info("storage %s format %s (%s)", store.describe(), fmt, format_descriptor(spec, cfg.model_id))
    if not cfg.model_id:
        log.warning("storage without --model-id: servers of different models with the same KV geometry would "
                    "share pages; name the model")


class Terminated(BaseException):
    """SIGTERM or SIGINT during start-up: the start is abandoned, everything built so far is removed."""


async def serve(cfg: Config, ready: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT; then NOT_SERVING, graceful stop, pools unlinked. A signal during start-up
    abandons the start at the next step, and nothing built so far is left behind."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    stop = asyncio.Event()
    state = {"serving": False}

    def on_signal() -> None:
        if not state["serving"] and not stop.is_set():
            main.cancel()  # once: the clean-up that follows must run to its end
        stop.set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    core = None
    sockets: list[str] = []
    try:
        swept = len(cleanup_stale())  # reported once serving: a refused start says only why it was refused
        instance_id = uuid.uuid4().hex
        core = build_core(cfg, instance_id)
        core.pressure = Pressure(instance_id)
        await asyncio.sleep(0)  # a signal that came while the pools were built lands here
        await _run(cfg, core, instance_id, sockets, ready, swept, stop, state)
    except asyncio.CancelledError:
        if not stop.is_set():
            raise
        raise Terminated() from None
    finally:  # every exit, a failed or stopped start included, leaves no segment and no socket file behind
        if core is not None:
            if core.storage is not None:
                await core.storage.drain()
                core.storage.close()
            if core.host is not None:
                await core.host.engine.drain()
                core.host.engine.close()
            if core.events is not None:
                await core.events.close()
            for p in core.all_pools():
                p.close()
            core.pressure.close()
        for path in sockets:
            if os.path.exists(path):
                os.unlink(path)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def claim_unix_path(path: str, where: str) -> None:
    """Only a stale socket (nobody answers on it) may be replaced: a live server's socket, a regular file or a
    directory at the path, a missing directory or a path too long for a socket refuse the start."""
    if len(path.encode()) > 107:
        raise StartupError(f"{where}: the path is {len(path.encode())} bytes; a unix socket path has at most 107")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise StartupError(f"{where}: the directory {folder} does not exist")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a file that is not a socket"
        raise StartupError(f"{where}: {path} is {kind}; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # a dead server's socket
        return
    except OSError as e:
        raise StartupError(f"{where}: cannot tell whether a server still uses {path} ({e.strerror or e}); "
                           "refusing to replace it") from None
    finally:
        probe.close()
    raise StartupError(f"{where}: a server is listening on {path}; stop it first or pick another path")


def _bind(server, addr: str, where: str, creds=None) -> int:
    """add_port with gRPC core's own log lines kept out of stderr: a refusal is one line of ours."""
    with native_stderr() as said:
        try:
            port = server.add_secure_port(addr, creds) if creds else server.add_insecure_port(addr)
        except RuntimeError as e:
            port, err = 0, str(e)
        else:
            err = ""
    if port == 0 or err:
        text = said.text + err
        reason = next((why for known, why in _BIND_ERRORS if known in text), "gRPC could not bind it")
        raise StartupError(f"{where}: cannot listen there ({reason})")
    return port


_BIND_ERRORS = (("Address already in use", "the address is in use"),
                ("Cannot assign requested address", "not an address of this machine"),
                ("Permission denied", "permission denied"), ("No such file or directory", "no such directory"),
                ("Name or service not known", "unknown host"), ("not known", "unknown host"))


async def _run(cfg: Config, core: CacheCore, instance_id: str, sockets: list[str],
               ready: asyncio.Event | None, swept: int, stop: asyncio.Event, state: dict) -> None:
    """Start gRPC, health, reflection and metrics over a built core; return after a graceful stop."""
    metrics = Metrics(core)
    if core.tree.events_enabled:
        try:
            both = getattr(core, "host_tier", None) is not None  # a hybrid core's two trees
            take = core.take_records if both else core.tree.take_records
            core.attach_events(EventHub(take, core.tree.raw_events, cfg.kv_events_buffer,
                                        cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, cfg.kv_events_topic,
                                        cfg.kv_events_watcher_queue,
                                        snapshot=core.snapshot_records if both else core.tree.snapshot_records))
            await core.events.start()
        except ValueError as e:
            msg = str(e)
            for name in ("kv_events_replay_endpoint", "kv_events_endpoint"):
                flag = f"--{name.replace('_', '-')}"
                if msg.startswith(flag):
                    msg = source_of(cfg, name) + msg[len(flag):]
                    break
            raise StartupError(msg) from None
    _step("events")
    if core.storage is not None and core.events is not None:
        core.storage.on_change = core.events.flush  # prefetched pages are published as they land
    stopping = asyncio.Event()
    msg_limit = max(64 << 20, cfg.num_slots * 16 + (1 << 20))
    options = [("grpc.max_receive_message_length", msg_limit), ("grpc.max_send_message_length", msg_limit),
               ("grpc.keepalive_time_ms", 10000), ("grpc.keepalive_timeout_ms", 5000),
               ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 1),
               # clients ping every 10 s to detect a dead server; accept that (the default floor is 5 min,
               # and a client pinging faster is sent GOAWAY too_many_pings, ending its session)
               ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
               # a client's flow-control (BDP) pings come on top of its keepalives and count as strikes; with
               # the default limit (2) an idle client was sent GOAWAY and lost its session, locks and slots
               ("grpc.http2.max_ping_strikes", 0)]
    interceptors = [TokenAuth(cfg.token)] if cfg.token else []
    server = grpc.aio.server(options=options, interceptors=interceptors)
    cache_pb2_grpc.add_RadixCacheServicer_to_server(
        RadixCacheService(core, metrics, stopping, cfg.eviction_policy), server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    creds = None
    if cfg.tls_cert and cfg.tls_key:
        try:
            with open(cfg.tls_key, "rb") as k, open(cfg.tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        except OSError as e:
            raise StartupError(f"{source_of(cfg, 'tls_cert')} / {source_of(cfg, 'tls_key')}: cannot read "
                               f"{e.filename} ({e.strerror})") from None
        _step("tls")
    where = source_of(cfg, "listen")
    for addr in cfg.listen:
        if addr.startswith("unix:"):
            path = addr[5:]
            path = path[2:] if path.startswith("//") else path  # unix:///abs and unix:/abs
            claim_unix_path(path, f"{where} {addr}")
            old = os.umask(0o177)
            try:
                _bind(server, f"unix:{path}", f"{where} {addr}")
            finally:
                os.umask(old)
            sockets.append(path)
        else:
            host = addr.rsplit(":", 1)[0]
            if not cfg.token and not cfg.allow_remote and not _is_loopback(host):
                raise StartupError(f"{where} {addr}: refusing to listen beyond loopback without a token "
                                   "(--token; or --allow-remote to insist)")
            _bind(server, addr, f"{where} {addr}", creds)
        _step("listen")
        await asyncio.sleep(0)  # a signal during this step lands here
    metrics_at = ""
    if cfg.metrics_addr:
        mhost, mport = cfg.metrics_addr.rsplit(":", 1)
        try:
            metrics_at = metrics.serve(mhost.strip("[]"), int(mport))
        except OSError as e:
            raise StartupError(f"{source_of(cfg, 'metrics_addr')} {cfg.metrics_addr}: cannot serve metrics there "
                               f"({e.strerror or e})") from None
    _step("metrics")
    await asyncio.sleep(0)
    starting = asyncio.ensure_future(server.start())
    try:
        await asyncio.shield(starting)  # a signal now must not cut gRPC's own start in half
        _step("serving")
        for path in sockets:
            os.chmod(path, 0o600)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        if swept:
            log.info("removed %d stale shared-memory segments of dead servers", swept)
        if cfg.model_config:
            lay = getattr(cfg, "_layout", None)
            log.info("model config %s read %s%s", cfg.model_config, getattr(cfg, "_config_source", "?"),
                     f": {lay.describe()}" if lay is not None else "")
        pools = ",".join(f"{p.descriptor.backend}:{p.descriptor.tier}" for p in core.all_pools())
        log.info("radixd %s instance=%s pools=%s metrics=http://%s/metrics %s", __import__("radixd.server").server.__version__,
                 instance_id, pools, metrics_at, cfg.summary())
        host_tokens = core.host_alloc.capacity if core.host_alloc is not None else 0
        print(f"radixd ready listen={','.join(cfg.listen)} metrics=http://{metrics_at}/metrics "
              f"device_tokens={cfg.num_slots} host_tokens={host_tokens} "
              f"bytes_per_token={core.device_pools[0].spec.slot_bytes if core.device_pools else 0} "
              f"instance={instance_id}", flush=True)
        state["serving"] = True  # from here a signal is a graceful stop, not an abandoned start
    except BaseException:
        await asyncio.wait([starting])
        await server.stop(0)  # a started server must be stopped, or its finaliser complains at exit
        raise
    loop = asyncio.get_running_loop()
    lease_task = loop.create_task(_leases(core, cfg.lock_lease_seconds)) if cfg.lock_lease_seconds else None
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("shutting down: NOT_SERVING, grace %.1fs", cfg.grace_seconds)
    if lease_task is not None:
        lease_task.cancel()
    await health_servicer.enter_graceful_shutdown()
    stopping.set()
    await server.stop(cfg.grace_seconds)


async def _leases(core: CacheCore, lease: float) -> None:
    """Every quarter lease (at most a second), release receipts older than the lease."""
    while True:
        await asyncio.sleep(min(lease / 4, 1.0))
        if core.expire_leases(lease) and core.events is not None:
            core.events.flush()


def run(cfg: Config) -> None:
    """Run the server on uvloop when available (one event loop owns everything)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    retain_freed_memory(cfg.heap_retain_mb << 20, prefault=cfg.prefault)
    try:
        import uvloop
        uvloop.run(serve(cfg))
    except ImportError:  # pragma: no cover
        asyncio.run(serve(cfg))
