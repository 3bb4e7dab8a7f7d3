"""The radix tree core: pure data structure, no gRPC, no CUDA, no I/O."""
from .errors import (ForeignHandle, InFlight, InvalidInput, LocksHeld, StaleHandle, StateConflict, TreeError,
                     UnknownReceipt)
from .policies import POLICIES
from .results import BackupAction, EvictResult, FreedSlots, HostInsertResult, InsertResult, LoadBackPlan, MatchResult
from .tree import DEFAULT_NS, WRITE_POLICIES, RadixTree, as_int32, bigram_keys

__all__ = [
    "RadixTree", "MatchResult", "InsertResult", "HostInsertResult", "EvictResult", "BackupAction", "LoadBackPlan", "FreedSlots",
    "DEFAULT_NS", "WRITE_POLICIES", "POLICIES", "as_int32", "bigram_keys", "TreeError", "InvalidInput",
    "StaleHandle", "UnknownReceipt", "ForeignHandle", "LocksHeld", "StateConflict", "InFlight",
]
