"""The radix tree core: pure data structure, no gRPC, no CUDA, no I/O."""
from .errors import ForeignHandle, InvalidInput, LocksHeld, StaleHandle, TreeError, UnknownReceipt
from .policies import POLICIES
from .tree import DEFAULT_NS, EvictResult, InsertResult, MatchResult, RadixTree, as_int32, bigram_keys

__all__ = [
    "RadixTree", "MatchResult", "InsertResult", "EvictResult", "DEFAULT_NS", "POLICIES", "as_int32",
    "bigram_keys", "TreeError", "InvalidInput", "StaleHandle", "UnknownReceipt", "ForeignHandle", "LocksHeld",
]
