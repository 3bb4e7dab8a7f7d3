"""KV pools: geometry, slot allocators, shared-memory and CUDA IPC backends."""
from .allocator import FREE, HELD, IN_FLIGHT, TREE, OutOfSlots, SlotAllocator, SlotError
from .descriptor import BufferDesc, PoolDescriptor
from .pool import KVPool
from .spec import DTYPES, PRESETS, PoolSpec

__all__ = ["SlotAllocator", "SlotError", "OutOfSlots", "FREE", "TREE", "HELD", "IN_FLIGHT", "PoolSpec",
           "PRESETS", "DTYPES", "KVPool", "PoolDescriptor", "BufferDesc"]
