"""Native parts, all optional (without a C compiler, or OpenSSL's headers for the first two, radixd runs them in
Python): the page-hash chain, the KV event batch encoder, the trees' walks and an engine backend's whole-page KV
copies."""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("radixd.server.tree._chain", ["server/tree/_chain.c"], libraries=["crypto"], optional=True),
    # KV event batches: resolve lazy digests and encode msgpack with the GIL released (server/events.py)
    Extension("radixd.server._kvevents", ["server/_kvevents.c"], libraries=["crypto"], optional=True),
    Extension("radixd.server.tree._hwalk", ["server/tree/_hwalk.c"], optional=True),
    # an engine backend's CPU KV copies by whole pages, checked and copied in one call (integrations/sglang)
    Extension("radixd.client._pagecopy", ["client/_pagecopy.c"], optional=True),
])
