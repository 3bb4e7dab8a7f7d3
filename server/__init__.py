"""radixd server: tree, pools, service."""
__version__ = "0.1.0"
