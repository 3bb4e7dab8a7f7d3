"""Build and run the server: pools, engine, gRPC (health, reflection, auth, TLS), metrics, signals."""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import uuid
import zlib

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from radixd.proto import cache_pb2, cache_pb2_grpc

from .config import Config, host_slots_for
from .events import EventHub
from .core import CacheCore
from .metrics import Metrics
from .pools.allocator import SlotAllocator
from .pools.cuda import cuda_available
from .pools.pool import KVPool
from .pools.shm import SHM_DIR, cleanup_stale, shm_room
from .pools.spec import total_bytes
from .pools.spec import PoolSpec
from .service import RadixCacheService, TokenAuth
from .tiers import HostTier
from .transfer.engine import TransferEngine
from .tree import RadixTree

log = logging.getLogger("radixd")
SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["RadixCache"].full_name


def pick_backend(device: str) -> str:
    """auto -> cuda when a GPU is visible, else shm."""
    if device == "cpu":
        return "shm"
    if device == "cuda":
        if not cuda_available():
            raise StartupError("--device cuda: no CUDA GPU visible (or cupy missing); use --device cpu or auto")
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


START_STEPS = ("pools", "storage", "events", "listen", "metrics", "serving")


def _step(name: str) -> None:
    """Tests force a failure at one start-up step (RADIXD_TEST_FAIL_AT) to check a failed start cleans up."""
    if os.environ.get("RADIXD_TEST_FAIL_AT") == name:
        raise StartupError(f"injected failure at start-up step {name!r} (RADIXD_TEST_FAIL_AT)")


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def _check_shm(device_bytes: int, host_bytes: int) -> None:
    """Refuse shared-memory pools that the shm mount or the machine's memory cannot back."""
    need = device_bytes + host_bytes
    free, avail = shm_room()
    room = min(free, avail)
    if need > room:
        which = ("--num-slots (or --layers / --kv-heads / --head-dim / --dtype)" if device_bytes >= host_bytes
                 else "--host-slots / --host-mem / --host-ratio")
        raise StartupError(f"the pools need {_gb(need)} of shared memory (device {_gb(device_bytes)}, host "
                           f"{_gb(host_bytes)}), but {SHM_DIR} has {_gb(free)} free and {_gb(avail)} of memory is "
                           f"available: lower {which}")


def check_gpus(pool_bytes: int, gpus: list[int], free_of=None) -> None:
    """Refuse a device pool larger than what each GPU has free now (leaving 5% for the CUDA context)."""
    if free_of is None:
        from .pools.cuda import free_bytes as free_of
    for g in gpus:
        free = free_of(g)
        if pool_bytes > free * 0.95:
            raise StartupError(f"the device pool needs {_gb(pool_bytes)} on GPU {g}, which has {_gb(free)} free: "
                               "lower --num-slots (or --layers / --kv-heads / --head-dim / --dtype)")


def build_core(cfg: Config, instance_id: str) -> CacheCore:
    """Pools, allocators and tree for a config; a failure leaves no pool behind."""
    backend = pick_backend(cfg.device)
    spec = PoolSpec(num_layers=cfg.layers, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype,
                    page_size=cfg.page_size, num_slots=cfg.num_slots, mla=cfg.mla)
    if backend != "cuda":
        cfg.gpus = []  # no GPU in use: say so in the start-up line instead of a misleading [0]
    gpus = cfg.gpus if backend == "cuda" else [0]
    host_slots = host_slots_for(cfg, spec.slot_bytes)
    if host_slots and len(gpus) > 1:
        raise StartupError("a host tier with more than one device pool (--gpus) is not supported yet")
    host_spec = spec.with_slots(host_slots, cfg.host_layout) if host_slots else None
    _check_shm(total_bytes(spec) * len(gpus) if backend == "shm" else 0, total_bytes(host_spec) if host_spec else 0)
    if backend == "cuda":
        check_gpus(total_bytes(spec), gpus)
    pools: list[KVPool] = []
    try:
        for i, g in enumerate(gpus):
            pools.append(KVPool(spec, "device", instance_id, backend, device_index=g, index=i))
        if host_spec is not None:
            pools.append(KVPool(host_spec, "host", instance_id, "shm", pin=backend == "cuda"))
        if cfg.prefault:
            for p in pools:
                p.prefault()
        _step("pools")
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
    if core.host is None:
        raise StartupError(f"--storage {cfg.storage}: L3 needs the host tier (give --host-slots, --host-mem or "
                           "--host-ratio)")
    if cfg.bigram:
        raise StartupError("--storage with --bigram is not supported (EAGLE bigram keys have no storage format)")
    try:
        store = open_store(cfg.storage, spec.slot_bytes * spec.page_size)
    except ValueError as e:
        raise StartupError(f"--storage: {e}") from None
    fmt = format_tag(spec, cfg.model_id)
    core.host.storage = core.storage = StorageTier(
        store, core.host, fmt, cfg.storage_write_policy, cfg.prefetch_threshold, cfg.prefetch_policy,
        cfg.prefetch_timeout_ms)
    core.storage_format = fmt
    log.info("storage %s format %s (%s)", store.describe(), fmt, format_descriptor(spec, cfg.model_id))
    if not cfg.model_id:
        log.warning("storage without --model-id: servers of different models with the same KV geometry would "
                    "share pages; name the model")


async def serve(cfg: Config, ready: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT; then NOT_SERVING, graceful stop, pools unlinked."""
    swept = len(cleanup_stale())  # reported once serving: a refused start says only why it was refused
    instance_id = uuid.uuid4().hex
    core = build_core(cfg, instance_id)
    sockets: list[str] = []
    try:
        await _run(cfg, core, instance_id, sockets, ready, swept)
    finally:  # every exit, a failed start included, leaves no segment and no socket file behind
        if core.storage is not None:
            await core.storage.drain()
            core.storage.close()
        if core.host is not None:
            await core.host.engine.drain()
            core.host.engine.close()
        if core.events is not None:
            await core.events.close()
        for p in core.device_pools + ([core.host_pool] if core.host_pool else []):
            p.close()
        for path in sockets:
            if os.path.exists(path):
                os.unlink(path)


async def _run(cfg: Config, core: CacheCore, instance_id: str, sockets: list[str],
               ready: asyncio.Event | None, swept: int = 0) -> None:
    """Start gRPC, health, reflection and metrics over a built core; return after a graceful stop."""
    metrics = Metrics(core)
    if core.tree.events_enabled:
        try:
            core.attach_events(EventHub(core.tree.take_records, core.tree.raw_events, cfg.kv_events_buffer,
                                        cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, cfg.kv_events_topic,
                                        cfg.kv_events_watcher_queue))
            await core.events.start()
        except ValueError as e:
            raise StartupError(str(e)) from None
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
               ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000)]
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
            raise StartupError(f"--tls-cert / --tls-key: cannot read {e.filename} ({e.strerror})") from None
    for addr in cfg.listen:
        if addr.startswith("unix:"):
            path = addr[5:]
            path = path[2:] if path.startswith("//") else path  # unix:///abs and unix:/abs
            if os.path.exists(path):
                os.unlink(path)  # a leftover socket of a dead server
            old = os.umask(0o177)
            try:
                server.add_insecure_port(f"unix:{path}")
            except RuntimeError as e:
                raise StartupError(f"--listen {addr}: cannot listen there ({e})") from None
            finally:
                os.umask(old)
            sockets.append(path)
        else:
            host = addr.rsplit(":", 1)[0]
            if not cfg.token and not cfg.allow_remote and not _is_loopback(host):
                raise StartupError(f"--listen {addr}: refusing to listen beyond loopback without --token "
                                   "(pass --allow-remote to insist)")
            try:
                port = server.add_secure_port(addr, creds) if creds else server.add_insecure_port(addr)
            except RuntimeError as e:
                raise StartupError(f"--listen {addr}: cannot bind ({e})") from None
            if port == 0:
                raise StartupError(f"--listen {addr}: cannot bind")
    _step("listen")
    metrics_at = ""
    if cfg.metrics_addr:
        mhost, mport = cfg.metrics_addr.rsplit(":", 1)
        try:
            metrics_at = metrics.serve(mhost.strip("[]"), int(mport))
        except OSError as e:
            raise StartupError(f"--metrics-addr {cfg.metrics_addr}: cannot serve metrics there ({e.strerror or e})") \
                from None
    _step("metrics")
    await server.start()
    try:
        _step("serving")
    except BaseException:
        await server.stop(0)  # a started server must be stopped, or its finaliser complains at exit
        raise
    for path in sockets:
        os.chmod(path, 0o600)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    if swept:
        log.info("removed %d stale shared-memory segments of dead servers", swept)
    pools = ",".join(f"{p.backend}:{p.tier}" for p in core.device_pools + ([core.host_pool] if core.host_pool else []))
    log.info("radixd %s instance=%s pools=%s metrics=http://%s/metrics %s", __import__("radixd.server").server.__version__,
             instance_id, pools, metrics_at, cfg.summary())
    host_tokens = core.host_alloc.capacity if core.host_alloc is not None else 0
    print(f"radixd ready listen={','.join(cfg.listen)} metrics=http://{metrics_at}/metrics "
          f"device_tokens={cfg.num_slots} host_tokens={host_tokens} "
          f"bytes_per_token={core.device_pools[0].spec.slot_bytes} instance={instance_id}", flush=True)
    loop = asyncio.get_running_loop()
    lease_task = loop.create_task(_leases(core, cfg.lock_lease_seconds)) if cfg.lock_lease_seconds else None
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    if ready is not None:
        ready.set()
    await done.wait()
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
    try:
        import uvloop
        uvloop.run(serve(cfg))
    except ImportError:  # pragma: no cover
        asyncio.run(serve(cfg))
