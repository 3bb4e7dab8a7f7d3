"""Native parts, both optional (without OpenSSL headers radixd hashes and encodes in Python): the page-hash
chain and the KV event batch encoder."""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("radixd.server.tree._chain", ["server/tree/_chain.c"], libraries=["crypto"], optional=True),
    # KV event batches: resolve lazy digests and encode msgpack with the GIL released (server/events.py)
    Extension("radixd.server._kvevents", ["server/_kvevents.c"], libraries=["crypto"], optional=True),
])
