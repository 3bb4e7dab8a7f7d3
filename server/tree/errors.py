"""Typed errors of the tree; the service maps each to one gRPC status."""


class TreeError(Exception):
    """Base of every error the tree raises; raising one never mutates the tree."""


class InvalidInput(TreeError):
    """Malformed keys, values or arguments (gRPC INVALID_ARGUMENT)."""


class StaleHandle(TreeError):
    """A node handle whose node was evicted or split away (gRPC NOT_FOUND)."""


class UnknownReceipt(TreeError):
    """A lock receipt that was never issued or was already released (gRPC NOT_FOUND)."""


class ForeignHandle(TreeError):
    """A handle or receipt minted by another server instance (gRPC FAILED_PRECONDITION)."""


class LocksHeld(TreeError):
    """An operation that needs an unlocked tree found locks (gRPC FAILED_PRECONDITION)."""


class StateConflict(TreeError):
    """The node is not in the state the operation needs, e.g. a transfer changed it (FAILED_PRECONDITION)."""


class InFlight(TreeError):
    """The receipt or operation still has a transfer in flight (FAILED_PRECONDITION)."""
