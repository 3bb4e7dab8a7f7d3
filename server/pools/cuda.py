"""GPU backend: one cudaMalloc per device pool exported by IPC handle; pinned shared-memory host pool.

GPUs are named by UUID, never by ordinal: ordinals depend on each process's CUDA_VISIBLE_DEVICES (containers,
engine launchers), the UUID does not. UUIDs are read through the driver API into a 16-byte buffer
(`cuDeviceGetUuid`): CuPy's `getDeviceProperties()["uuid"]` converts the `char[16]` as a C string and cuts a
UUID at its first zero byte. Every CuPy call on a pool runs with that pool's GPU current.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional

ROUND = 2 << 20  # allocation granularity for IPC-exported device memory


def cuda_available() -> bool:
    """True when cupy imports and sees at least one GPU."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def need_cupy() -> Any:
    """CuPy, or one line that says which wheel maps radixd's GPU pools here (matching torch's CUDA)."""
    try:
        import cupy
        return cupy
    except ImportError:
        major = "12"
        try:
            import torch
            major = (torch.version.cuda or "12").split(".")[0]
        except ImportError:
            pass
        raise RuntimeError(f"mapping radixd's GPU pools needs CuPy: pip install cupy-cuda{major}x "
                           f"(the CUDA {major} build, as this process's torch)") from None


def free_bytes(device_index: int) -> int:
    """Free memory of one GPU now (cudaMemGetInfo)."""
    import cupy
    with cupy.cuda.Device(device_index):
        return int(cupy.cuda.runtime.memGetInfo()[0])


def format_uuid(raw: bytes) -> str:
    """nvidia-smi's form of a GPU's 16 UUID bytes: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID is 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


_driver: Optional[Any] = None


def _libcuda() -> Any:
    """The CUDA driver library (every NVIDIA driver installs it), initialised once."""
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise LookupError(f"no NVIDIA driver in this process (libcuda.so.1: {e})") from None
        rc = lib.cuInit(0)
        if rc != 0:
            raise LookupError(f"the CUDA driver did not initialise (cuInit error {rc})")
        _driver = lib
    return _driver


def uuid_from_driver(lib: Any, device_index: int) -> str:
    """A GPU's UUID through the driver API: cuDeviceGet, then cuDeviceGetUuid into 16 bytes (zeros included)."""
    dev = ctypes.c_int()
    rc = lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(device_index))
    if rc != 0:
        raise LookupError(f"no GPU {device_index} in this process (cuDeviceGet error {rc})")
    buf = (ctypes.c_ubyte * 16)()
    rc = lib.cuDeviceGetUuid(buf, dev)
    if rc != 0:
        raise LookupError(f"cannot read GPU {device_index}'s UUID (cuDeviceGetUuid error {rc})")
    return format_uuid(bytes(buf))


def visible_uuids(lib: Any) -> list[str]:
    """UUIDs of the GPUs this process sees, by ordinal."""
    n = ctypes.c_int()
    rc = lib.cuDeviceGetCount(ctypes.byref(n))
    if rc != 0:
        raise LookupError(f"cannot count GPUs (cuDeviceGetCount error {rc})")
    return [uuid_from_driver(lib, i) for i in range(n.value)]


def gpu_uuid(device_index: int) -> str:
    """The GPU's UUID, stable across processes whatever CUDA_VISIBLE_DEVICES says."""
    return uuid_from_driver(_libcuda(), device_index)


def uuid_to_ordinal(uuid: str, uuids: Optional[Callable[[], list[str]]] = None) -> int:
    """Local ordinal of the GPU with this UUID in this process's view."""
    seen = (uuids or (lambda: visible_uuids(_libcuda())))()
    if uuid in seen:
        return seen.index(uuid)
    raise LookupError(f"radixd's pool is on GPU {uuid}, which this process cannot see (it sees "
                      f"{', '.join(seen) or 'no GPU'}; check CUDA_VISIBLE_DEVICES or the container's GPUs)")


def _uint8_view(ptr: int, size: int, owner: Any, device_index: int) -> Any:
    """A cupy uint8 array over raw device memory that keeps `owner` alive."""
    import cupy
    mem = cupy.cuda.UnownedMemory(ptr, size, owner, device_index)
    return cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


class DeviceAllocation:
    """Plain cudaMalloc (no pool, no managed memory); freed only when the server shuts down."""

    def __init__(self, size: int, device_index: int):
        import cupy
        self.device_index = device_index
        self.size = -(-size // ROUND) * ROUND
        self.uuid = gpu_uuid(device_index)
        with cupy.cuda.Device(device_index):
            self.ptr = cupy.cuda.runtime.malloc(self.size)
            try:
                cupy.cuda.runtime.memset(self.ptr, 0, self.size)
                self.ipc_handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self.ptr))
            except Exception:
                cupy.cuda.runtime.free(self.ptr)
                raise

    def as_uint8(self) -> Any:
        """A cupy uint8 view of the whole allocation."""
        return _uint8_view(self.ptr, self.size, self, self.device_index)

    def free(self) -> None:
        import cupy
        if self.ptr:
            with cupy.cuda.Device(self.device_index):
                cupy.cuda.runtime.free(self.ptr)
            self.ptr = 0


def pin_host(address: int, size: int, device_index: int = 0) -> None:
    """Register host memory as pinned and portable so every context can DMA it (with a GPU of ours current)."""
    cupy = need_cupy()
    with cupy.cuda.Device(device_index):
        cupy.cuda.runtime.hostRegister(address, size, 1)  # cudaHostRegisterPortable


def unpin_host(address: int, device_index: int = 0) -> None:
    import cupy
    try:
        with cupy.cuda.Device(device_index):
            cupy.cuda.runtime.hostUnregister(address)
    except Exception:
        pass


class IpcMapping:
    """A client's import of a device pool; the memory is unmapped when the last view of it is gone."""

    def __init__(self, handle: bytes, uuid: str, size: int):
        cupy = need_cupy()
        self.device_index = uuid_to_ordinal(uuid)
        self.size = size
        with cupy.cuda.Device(self.device_index):
            try:
                self.ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle, 1)  # cudaIpcMemLazyEnablePeerAccess
            except cupy.cuda.runtime.CUDARuntimeError as e:
                raise RuntimeError(f"cannot open the device pool's IPC handle (server gone or restarted, or "
                                   f"opened in the process that exported it?): {e}") from e

    def as_uint8(self) -> Any:
        """A view that keeps this mapping alive: torch tensors made from it (dlpack) hold it until they die."""
        return _uint8_view(self.ptr, self.size, self, self.device_index)

    def close(self) -> None:
        import cupy
        if self.ptr:
            with cupy.cuda.Device(self.device_index):
                cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)
            self.ptr = 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
