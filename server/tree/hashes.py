"""Page hashes: the one frozen scheme that KV events (and, later, L3 storage keys) name pages by.

FROZEN. External routers and stores depend on these bytes; never change them, add a new scheme instead.

* A page's tokens are hashed as unsigned 32-bit little-endian integers, in order. A bigram (EAGLE) key
  position (t[i], t[i+1]) contributes t[i] then t[i+1].
* digest(page) = SHA-256(prior || page bytes), where prior is the 32-byte digest of the previous page
  of the same path (the parent node's last page for a node's first page), or the chain's seed.
* Seeds (SPEC-tiers R6.2): the default namespace has none (prior is empty). A namespace with a
  cache_salt starts from SHA-256(b"sglang-cache-salt-v1\\x00" || utf-8 salt); extra_key never enters
  the digest chain (a LoRA or other extra key with no salt chains like the default namespace; its published
  hashes differ, below).
* A block hash, as events report it, is the first 8 bytes of the digest read big-endian as a signed
  64-bit integer (the first 16 hex digits of the hex digest, as SGLang's `hash_str_to_int64`).
* Namespaced block hashes (what events publish; SGLang 0.5.23's rule in its Dynamo event format): in a
  namespace with an extra_key (a LoRA adapter) or a cache_salt, each published block hash h is replaced by
  the first 8 bytes (big-endian, signed) of SHA-256(event_seed || h as 8 big-endian bytes), where
  event_seed = SHA-256(b"sglang-kv-event-namespace-v1" || part(extra_key) || part(cache_salt)) and
  part(x) = b"\x00" when absent, else b"\x01" || len(utf-8 x) as 8 bytes little-endian || utf-8 x. Every
  namespace's pages thus have their own block hashes; the digest chain (and L3 keys) stays as above.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from array import array
from typing import Optional

import numpy as np

try:  # the same chain in C, the GIL released while it hashes (setup.py builds it where OpenSSL's headers are)
    from ._chain import chain as _native_chain, first as _native_first
except ImportError:  # pragma: no cover - depends on the build machine
    _native_chain = _native_first = None

NATIVE = _native_chain is not None

SALT_SEED_PREFIX = b"sglang-cache-salt-v1\x00"
EVENT_SEED_TAG = b"sglang-kv-event-namespace-v1"


def salt_seed(cache_salt: str) -> Optional[bytes]:
    """The chain seed of a namespace: None without a cache_salt."""
    if not cache_salt:
        return None
    return hashlib.sha256(SALT_SEED_PREFIX + cache_salt.encode()).digest()


@functools.lru_cache(maxsize=4096)  # (asked per event record and per adapter request; namespaces are few)
def event_seed(extra_key: str = "", cache_salt: str = "") -> Optional[bytes]:
    """The seed that namespaces a namespace's published block hashes: None for the default namespace."""
    if not extra_key and not cache_salt:
        return None
    sha = hashlib.sha256(EVENT_SEED_TAG)
    for part in (extra_key, cache_salt):
        if not part:
            sha.update(b"\x00")
            continue
        raw = part.encode()
        sha.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
    return sha.digest()


def namespaced(hashes: list[int], seed: Optional[bytes]) -> list[int]:
    """Published block hashes of a namespace from its chain's block hashes (unchanged without a seed)."""
    if seed is None:
        return hashes
    sha = hashlib.sha256
    return [int.from_bytes(sha(seed + h.to_bytes(8, "big", signed=True)).digest()[:8], "big", signed=True)
            for h in hashes]


def span_seed(span: "Span") -> Optional[bytes]:
    """The event seed a span's namespace publishes its block hashes under (hashes.py: namespaced hashes)."""
    fmt = span[0][3]
    return fmt[2] if fmt is not None and len(fmt) > 2 else None


def page_bytes(key: bytes, bigram: bool) -> bytes:
    """Tree key bytes (int32 LE, or packed int64 bigrams) -> the u32 LE token bytes that are hashed."""
    if not bigram:
        return key  # the tree already stores int32 little-endian: the hashed bytes as they are
    pairs = np.frombuffer(key, dtype="<i8")
    out = np.empty((pairs.size, 2), dtype="<u4")
    out[:, 0] = (pairs >> 32) & 0xFFFFFFFF
    out[:, 1] = pairs & 0xFFFFFFFF
    return out.tobytes()


def chain(key: bytes, page_nbytes: int, prior: Optional[bytes], bigram: bool = False) -> bytes:
    """Digests of every page of `key` (concatenated, 32 bytes each), continuing from `prior`."""
    data = page_bytes(key, bigram)
    step = page_nbytes  # a bigram position is 8 key bytes and 8 hashed bytes alike
    if _native_chain is not None:
        return _native_chain(data, step, prior)
    return py_chain(data, step, prior)


def py_chain(data: bytes, step: int, prior: Optional[bytes]) -> bytes:
    """The chain in pure Python (the reference the native one is tested against)."""
    out = bytearray()
    sha = hashlib.sha256
    for off in range(0, len(data), step):
        prior = sha((prior or b"") + data[off:off + step]).digest()
        out += prior
    return bytes(out)


# Lazy digests. A node records its pages' digests without hashing them; they are computed when first read
# (by the event publisher's thread, usually). Plain lists and tuples, not classes: one is made per inserted
# node on the request path, and a class instance costs three times as much.
#   Run  = [value, key, prior, fmt]: value (the digests, None until computed), key (the page bytes, dropped
#          once hashed), prior (the digest the run continues from: bytes or None, or (Run, page index) while
#          that run is unresolved), fmt = (page_nbytes, bigram), shared.
#   Span = (Run, lo, hi): pages [lo, hi) of a run, what a node holds; a split slices it, nothing changes.
# Any thread may resolve (the values are equal); the value is stored before the inputs are dropped, so a
# reader that finds the key gone finds the value set.
Run = list
Span = tuple


def lazy_span(key: bytes, fmt: tuple[int, bool], prior) -> Span:
    """The digests of `key`'s pages, continuing `prior`, to be computed when first read."""
    return ([None, key, prior, fmt], 0, len(key) // fmt[0])


def known_span(digests: bytes, fmt: Optional[tuple] = None) -> Span:
    """Digests computed elsewhere (e.g. fetched from storage with their pages); fmt names its namespace's seed."""
    return ([digests, None, None, fmt], 0, len(digests) // 32)


def resolve(run: Run) -> bytes:
    """All digests of a run, hashing it (and any unresolved run it continues) on first call."""
    v = run[0]
    if v is not None:
        return v
    todo, r = [], run
    while r[0] is None:
        todo.append(r)
        pr = r[2]
        if type(pr) is not tuple:
            break
        r = pr[0]
    for q in reversed(todo):
        pr, key, fmt = q[2], q[1], q[3]
        if key is None:  # resolved by another thread meanwhile
            continue
        if type(pr) is tuple:
            src, i = pr
            pr = src[0][i * 32:(i + 1) * 32]
        q[0] = chain(key, fmt[0], pr, fmt[1])
        q[2] = pr
        q[1] = None
    return run[0]


def span_digests(span: Span) -> bytes:
    """A span's digests, 32 bytes each (hashing on first read)."""
    run, lo, hi = span
    return resolve(run)[lo * 32:hi * 32]


def span_last(span: Span) -> bytes:
    """The digest of a span's last page: what the next page chains from."""
    run, _, hi = span
    return resolve(run)[(hi - 1) * 32:hi * 32]


def span_split(span: Span, pages: int) -> tuple[Span, Span]:
    """The first `pages` pages of a span and the rest."""
    run, lo, hi = span
    return (run, lo, lo + pages), (run, lo + pages, hi)


def span_pages(span: Span) -> int:
    return span[2] - span[1]


def block_hash(digest: bytes) -> int:
    """The signed 64-bit block hash events carry for one page digest."""
    return int.from_bytes(digest[:8], "big", signed=True)


_HEAD = struct.Struct(">q24x")  # a digest's block hash: its first 8 bytes, big-endian signed


def block_hashes(digests: bytes) -> list[int]:
    """Block hashes of concatenated 32-byte digests, in order."""
    if len(digests) <= 16 * 32:  # a few pages (an arrival's check): struct's C loop, no numpy call path
        return [h for (h,) in _HEAD.iter_unpack(digests)]
    return np.frombuffer(digests, dtype=">i8").reshape(-1, 4)[:, 0].tolist()


def first_block_hash(tokens, page_size: int, cache_salt: str = "", extra_key: str = "") -> int:
    """The block hash of the first page alone, in one native call where it can: the check an engine makes on each
    arriving request, on a scheduler thread whose caches the forward left cold (each call costs microseconds there)."""
    if _native_first is not None and type(tokens) in (list, array):
        h = _native_first(tokens, page_size, salt_seed(cache_salt) if cache_salt else None)
        return namespaced([h], event_seed(extra_key, cache_salt))[0] if extra_key or cache_salt else h
    return token_block_hashes(tokens[:page_size], page_size, cache_salt, extra_key)[0]


def token_block_hashes(tokens, page_size: int, cache_salt: str = "", extra_key: str = "") -> list[int]:
    """Published block hashes of the whole pages of a token sequence, as a router computes them to look pages up."""
    if type(tokens) is list:  # an engine's prompt: struct packs a list 3x faster than numpy converts one
        n = len(tokens) - len(tokens) % page_size
        try:
            data = struct.pack(f"<{n}I", *tokens[:n])
        except struct.error as e:
            raise OverflowError(f"a token id does not fit uint32: {e}") from None
    else:
        arr = np.asarray(tokens, dtype="<u4")
        n = arr.size - arr.size % page_size
        data = arr[:n].tobytes()
    return namespaced(block_hashes(chain(data, page_size * 4, salt_seed(cache_salt))), event_seed(extra_key, cache_salt))
