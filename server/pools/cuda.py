"""GPU backend: one cudaMalloc per device pool exported by IPC handle; pinned shared-memory host pool."""
from __future__ import annotations

from typing import Any

ROUND = 2 << 20  # allocation granularity for IPC-exported device memory


def cuda_available() -> bool:
    """True when cupy imports and sees at least one GPU."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def free_bytes(device_index: int) -> int:
    """Free memory of one GPU now (cudaMemGetInfo)."""
    import cupy
    with cupy.cuda.Device(device_index):
        return int(cupy.cuda.runtime.memGetInfo()[0])


def gpu_uuid(device_index: int) -> str:
    """The GPU's UUID, stable across processes whatever CUDA_VISIBLE_DEVICES says."""
    import cupy
    raw = cupy.cuda.runtime.getDeviceProperties(device_index)["uuid"]
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def uuid_to_ordinal(uuid: str) -> int:
    """Local ordinal of the GPU with this UUID in this process's view."""
    import cupy
    for i in range(cupy.cuda.runtime.getDeviceCount()):
        if gpu_uuid(i) == uuid:
            return i
    raise LookupError(f"GPU {uuid} is not visible to this process (check CUDA_VISIBLE_DEVICES)")


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
        with cupy.cuda.Device(device_index):
            self.ptr = cupy.cuda.runtime.malloc(self.size)
            cupy.cuda.runtime.memset(self.ptr, 0, self.size)
            self.ipc_handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self.ptr))
        self.uuid = gpu_uuid(device_index)

    def as_uint8(self) -> Any:
        """A cupy uint8 view of the whole allocation."""
        return _uint8_view(self.ptr, self.size, self, self.device_index)

    def free(self) -> None:
        import cupy
        if self.ptr:
            with cupy.cuda.Device(self.device_index):
                cupy.cuda.runtime.free(self.ptr)
            self.ptr = 0


def pin_host(address: int, size: int) -> None:
    """Register host memory as pinned and portable so every context can DMA it."""
    import cupy
    cupy.cuda.runtime.hostRegister(address, size, 1)  # cudaHostRegisterPortable


def unpin_host(address: int) -> None:
    import cupy
    try:
        cupy.cuda.runtime.hostUnregister(address)
    except Exception:
        pass


class IpcMapping:
    """A client's import of a device pool; closed exactly once."""

    def __init__(self, handle: bytes, uuid: str, size: int):
        import cupy
        self.device_index = uuid_to_ordinal(uuid)
        self.size = size
        with cupy.cuda.Device(self.device_index):
            try:
                self.ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle, 1)  # cudaIpcMemLazyEnablePeerAccess
            except cupy.cuda.runtime.CUDARuntimeError as e:
                raise RuntimeError(f"cannot open the device pool's IPC handle (server gone or restarted?): {e}") from e

    def as_uint8(self) -> Any:
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
