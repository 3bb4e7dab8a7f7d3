"""The L3 tier: pages backed up to, and prefetched from, a store that many servers share."""
from .base import Store, StoreError, open_store
from .keys import format_descriptor, format_tag, page_keys
from .tier import PREFETCH_POLICIES, STORAGE_WRITE_POLICIES, Prefetch, StorageTier

__all__ = ["Store", "StoreError", "open_store", "format_descriptor", "format_tag", "page_keys", "StorageTier",
           "Prefetch", "PREFETCH_POLICIES", "STORAGE_WRITE_POLICIES"]
