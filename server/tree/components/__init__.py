"""Auxiliary components of the hybrid tree (SWA, MAMBA): each plugs into the FULL backbone through hooks."""
from .base import FULL, MAMBA, SWA, Component, Lru
from .mamba import MambaComponent
from .swa import SwaComponent

__all__ = ["FULL", "SWA", "MAMBA", "Component", "Lru", "SwaComponent", "MambaComponent"]
