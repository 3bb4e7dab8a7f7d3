#!/usr/bin/env bash
# GPU checks for radixd: CUDA IPC pools across processes, pinned host pool, dtypes, and device<->host copy
# bandwidth. Needs what a GPU host's image has (python3 with torch, cupy, numpy, pytest, hypothesis) plus the
# wheels tests/gpu/fetch_wheels.sh saves in .whl/ (grpcio, protobuf, ...), installed here with --no-index
# when carried; radixd is put on the path from this checkout. Under 5 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/radixd-site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/radixd-site${PYTHONPATH:+:$PYTHONPATH}"
fi
shim=$(mktemp -d)
mkdir -p "$shim/radixd"
ln -s "$PWD/server" "$shim/radixd/server"
ln -s "$PWD/client" "$shim/radixd/client"
ln -s "$PWD/proto" "$shim/radixd/proto"
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'PY'
import torch, cupy
print(f"torch {torch.__version__} cuda={torch.cuda.is_available()} cupy {cupy.__version__} "
      f"gpus={cupy.cuda.runtime.getDeviceCount()} {torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}")
PY
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_tree.py tests/test_pools.py 2>&1 | tail -25
status=${PIPESTATUS[0]}
timeout 60 python3 - <<'PY'
import time, uuid, torch
from radixd.server.pools import KVPool, PoolSpec
from radixd.client.pools import map_pool
spec = PoolSpec(num_layers=32, kv_heads=8, head_dim=128, dtype="bfloat16", num_slots=65536, page_size=16)
dev = KVPool(spec, "device", uuid.uuid4().hex, backend="cuda")
host = KVPool(spec.with_slots(65536, "layer_first"), "host", dev.instance_id, backend="shm", pin=True)
d, h = map_pool(dev.descriptor), map_pool(host.descriptor)
n = 16384
idx = torch.randperm(65536 // 16, device="cuda")[: n // 16]
slots = (idx[:, None] * 16 + torch.arange(16, device="cuda")).reshape(-1)
print(f"{'copy':28} {'GB/s':>8}")
ref = {}
for name, fn in (
    ("device->host (gather)", lambda: [h.k_buffer[l][:n].copy_(d.k_buffer[l][slots], non_blocking=True) for l in range(32)]),
    ("host->device (scatter)", lambda: [d.k_buffer[l].index_copy_(0, slots, h.k_buffer[l][:n].to("cuda", non_blocking=True)) for l in range(32)]),
    ("device->host (contiguous)", lambda: [h.k_buffer[l][:n].copy_(d.k_buffer[l][:n], non_blocking=True) for l in range(32)]),
):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 5
    print(f"{name:28} {32 * n * 8 * 128 * 2 / dt / 1e9:8.1f}")
    ref[name] = dt
# radixd's own copy backend (server/transfer/cuda.py) on the same pages, against the contiguous copy
import numpy as np
from radixd.server.transfer.cuda import CudaPageCopier
src = (idx.cpu().numpy()[:, None] * 16 + np.arange(16)).reshape(-1)
dst = np.arange(n)
for name, cp, a, b in (("backup d2h (radixd)", CudaPageCopier(dev, host), src, dst),
                       ("load-back h2d (radixd)", CudaPageCopier(host, dev), dst, src)):
    cp.copy(a, b)
    t0 = time.perf_counter()
    for _ in range(5):
        cp.copy(a, b)
    dt = (time.perf_counter() - t0) / 5
    print(f"{name:28} {2 * 32 * n * 8 * 128 * 2 / dt / 1e9:8.1f}   x contiguous d2h {ref['device->host (contiguous)'] / dt * 2:5.2f}")
d.close(); h.close(); host.close(); dev.close()
PY
bw=$?
echo "SUMMARY tests_exit=$status bandwidth_exit=$bw"
exit $(( status || bw ))
