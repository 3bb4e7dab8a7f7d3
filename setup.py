"""Native parts, all optional (without a C compiler, or OpenSSL's headers for the first two, radixd runs them in
Python): the page-hash chain, the KV event batch encoder and the trees' match and lock walks."""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("radixd.server.tree._chain", ["server/tree/_chain.c"], libraries=["crypto"], optional=True),
    # KV event batches: resolve lazy digests and encode msgpack with the GIL released (server/events.py)
    Extension("radixd.server._kvevents", ["server/_kvevents.c"], libraries=["crypto"], optional=True),
    Extension("radixd.server.tree._hwalk", ["server/tree/_hwalk.c"], optional=True),
])
