"""Importing SGLang 0.5.23 on a CPU-only machine: its configs import torchvision at module level, and PyPI's
torchvision cannot load beside the CPU torch, so an inert stub stands in (the cache code never calls it)."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


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
