"""Copies between pools (device <-> host); the tree only says what to copy."""
from .copy import copy_slots

__all__ = ["copy_slots"]
