"""SGLang 0.5.23's own publisher beside radixd's (run in SGLang's venv by tests/test_service_events.py):
one seeded sequence of inserts (with splits) and evictions on SGLang's `RadixCache` with KV events on and on
radixd's tree, keys built as SGLang's scheduler builds them (`array('q')`, bigram pairs for EAGLE), in the
default namespace and, with SGLang's Dynamo event format, under adapters (extra_key) and salts; after
every step the two event streams, as msgpack a router receives, must be equal (SGLang's own encoder on
one side, radixd's Python and native encoders on the other).

    python tests/sglang_events_check.py
"""
from __future__ import annotations

import os
import random
import sys
from array import array

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.sglang_cpu import stub_torchvision  # noqa: E402

stub_torchvision()
import msgspec  # noqa: E402
import torch  # noqa: E402
from sglang.srt.disaggregation.kv_events import KVEventBatch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from radixd.server import events as hub  # noqa: E402
from radixd.server.tree import RadixTree  # noqa: E402


class Allocator:
    """What SGLang's cache asks of its allocator when nothing is pooled."""

    device = "cpu"

    def free(self, _slots) -> None:
        pass

    def free_segment(self, _slots, start_pos: int = 0) -> None:
        pass


def sglang_view(events) -> list:
    """SGLang's events as a router decodes them; removals as sets (the two trees may order ties apart)."""
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events)))[1]
    return _normal(raw)


def _normal(events: list) -> list:
    out = []
    for ev in events:
        ev = dict(ev)
        if ev["type"] == "BlockRemoved":
            ev["block_hashes"] = sorted(ev["block_hashes"])
            if out and out[-1]["type"] == "BlockRemoved" and out[-1]["medium"] == ev["medium"]:
                out[-1]["block_hashes"] = sorted(out[-1]["block_hashes"] + ev["block_hashes"])
                continue
        ev.pop("lora_name", None)  # radixd names the adapter (nil here); SGLang omits a nil one
        out.append(ev)
    return out


NAMESPACES = ((None, None), ("adapter-a", None), ("adapter-b", None), (None, "tenant"), ("adapter-a", "tenant"))


def run(page: int, bigram: bool, seed: int, steps: int, namespaces: bool = False) -> int:
    rng = random.Random(seed)
    sgl = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=Allocator(),
                                     page_size=page, is_eagle=bigram, enable_kv_cache_events=True,
                                     dynamo_kv_event_format=namespaces))
    sgl.take_events()  # its reset's AllBlocksCleared
    mine = RadixTree(page_size=page, bigram=bigram, events=True)
    prompts = [[rng.randrange(1, 40) for _ in range(rng.randrange(2, 12) * page + bigram)] for _ in range(10)]
    slot = compared = 0
    for step in range(steps):
        if rng.random() < 0.8:
            p = rng.choice(prompts)[:rng.randrange(1 + bigram, len(prompts[0]) + 1)]
            p = p + [rng.randrange(1, 40) for _ in range(rng.randrange(0, 2 * page))]
            extra, salt = rng.choice(NAMESPACES) if namespaces else (None, None)
            key = RadixKey(array("q", p), extra, is_bigram=bigram, cache_salt=salt).page_aligned(page)
            n = len(key)
            if not n:
                continue
            value = torch.arange(slot, slot + n, dtype=torch.int64)
            slot += n
            sgl.insert(InsertParams(key=key, value=value))
            raw = list(key.raw_token_ids()) if hasattr(key, "raw_token_ids") else list(key.token_ids)
            mine.insert(raw[:n + bigram], value.tolist(), namespace=(extra or "", salt or ""))
        else:
            total = sgl.evictable_size()  # everything: the two may break ties between equal leaves apart
            sgl.evict(EvictParams(num_tokens=total))
            mine.evict(total)
        theirs = sglang_view(sgl.take_events())
        raw, _ = mine.take_raw_events()
        ours = _normal(msgspec.msgpack.decode(hub.python_payload(0.0, raw.materialize()))[1])
        assert ours == theirs, (page, bigram, step, ours, theirs)
        native = hub.native_payload(raw, 0.0)
        if native is not None:
            assert _normal(msgspec.msgpack.decode(native)[1]) == theirs, (page, bigram, step)
        compared += len(theirs)
    return compared


if __name__ == "__main__":
    for page, bigram in ((1, False), (4, False), (1, True), (4, True)):
        n = run(page, bigram, seed=page * 10 + bigram, steps=400)
        assert n > 100, n
        print("ok", page, bigram, n, flush=True)
    for page in (1, 4):  # the same tokens under adapters and salts: each namespace's hashes are its own
        n = run(page, False, seed=page * 7, steps=400, namespaces=True)
        assert n > 100, n
        print("ok namespaces", page, n, flush=True)
    print("ok events_match_sglang")
