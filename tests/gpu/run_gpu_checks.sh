#!/usr/bin/env bash
# GPU checks for radixd, one command on a GPU host: the pytest GPU suite (CUDA IPC pools across processes, pinned
# host pool, dtypes, the copy backend, load-back through an interprocess event), then tests/gpu/gpu_check.py (strict:
# where nvidia-smi sees a GPU, a missing or CPU-only torch or CuPy fails; UUIDs, another process's GPU order, the
# event making a reader wait, copies for every dtype and a >2 GiB host buffer, bandwidth >= 80% of a plain pinned
# copy). Needs what a GPU host's image has (python3 with torch, cupy, numpy, pytest, hypothesis) plus the wheels
# tests/gpu/fetch_wheels.sh saves in .whl/ (grpcio, protobuf, ...), installed here with --no-index when carried;
# radixd is put on the path from this checkout. Prints one SUMMARY line last.
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
ln -s "$PWD/integrations/vllm" "$shim/radixd/vllm"
ln -s "$PWD/integrations/sglang" "$shim/radixd/sglang"
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "UUID: GPU-")
if [ "$gpus" -gt 0 ]; then
  # a GPU is here: the suite must not skip for want of CUDA (its skip condition is CuPy seeing a GPU)
  python3 -c "import cupy, torch; assert torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0" \
    || { echo "SUMMARY tests_exit=1 gpu_check_exit=1 (nvidia-smi lists $gpus GPU(s) but torch or CuPy cannot use them)"; exit 1; }
fi
# (the ini's addopts ask for pytest-xdist, which a GPU host's image may lack: one process here)
timeout 300 python3 -m pytest -q -o addopts="-ra" -p no:cacheprovider tests/gpu tests/test_tree.py tests/test_pools.py \
  tests/test_gpu_paths.py 2>&1 | tail -25
status=${PIPESTATUS[0]}
timeout 400 python3 tests/gpu/gpu_check.py 2>&1 | tail -40
check=${PIPESTATUS[0]}
echo "SUMMARY tests_exit=$status gpu_check_exit=$check gpus=$gpus"
exit $(( status || check ))
