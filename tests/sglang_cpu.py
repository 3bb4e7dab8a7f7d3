"""Importing SGLang 0.5.23 on a CPU-only machine: its configs import torchvision at module level, and PyPI's
torchvision cannot load beside the CPU torch, so an inert stub stands in (the cache code never calls it)."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional


def stub_torchvision() -> None:
    """Install the stub; call before importing sglang (and after transformers decided it is absent)."""
    import transformers.utils.import_utils as iu
    iu.is_torchvision_available()  # decided "absent" before the stub exists

    class Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name == "torchvision" or name.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec):
            m = types.ModuleType(spec.name)
            m.__path__ = []
            return m

        def exec_module(self, m):
            pass

    sys.meta_path.insert(0, Stub())


@dataclass
class Kv:
    """The request's KV bookkeeping fields SGLang 0.5.23's RadixCache reads."""

    req_pool_idx: int
    cache_protected_len: int = 0
    cache_inserted_len: int = 0
    swa_evict_floor: int = 0
    kv_committed_len: int = 0


@dataclass
class Req:
    """The request fields SGLang 0.5.23's RadixCache reads (match, checkpoint, release)."""

    rid: str
    origin_input_ids: array  # array('q'), as SGLang's scheduler keeps token ids
    kv: Kv
    output_ids: array = field(default_factory=lambda: array("q"))
    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None
    priority: int = 0
    lock: Any = None
    last_node: Any = None
    done: bool = False

    def __post_init__(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        self.cache_request_handle = CacheRequestHandle(self.rid, 0)  # an attribute, as on SGLang's Req

    @property
    def full_untruncated_fill_ids(self) -> array:
        return self.origin_input_ids + self.output_ids

    def finished(self) -> bool:
        return self.done
