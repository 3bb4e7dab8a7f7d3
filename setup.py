"""The one native part: the page-hash chain (optional: without OpenSSL headers, hashes.py hashes in Python)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("radixd.server.tree._chain", ["server/tree/_chain.c"], libraries=["crypto"],
                             optional=True)])
