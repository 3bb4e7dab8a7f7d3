"""Decodes radixd's KV event payloads with an engine's own classes, in that engine's venv (run by
tests/test_service_events.py): vLLM 0.32.0's or SGLang 0.5.23's `KVEventBatch`, exactly as their routers do.

    python tests/engine_events_decode.py vllm|sglang PAYLOADS.msgpack

Prints JSON: the block multiset per medium rebuilt from what the engine's decoder returned (a hybrid model's
group g > 0 under "MEDIUM/g", where the engine's class has `group_idx`), the adapter (`lora_name`) each
stored block was published with, and the `kv_cache_spec_kind` seen per group. Any batch the decoder refuses
raises.
"""
from __future__ import annotations

import json
import sys

import msgspec


def main() -> None:
    engine, path = sys.argv[1], sys.argv[2]
    if engine == "vllm":
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    else:
        from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    with open(path, "rb") as f:
        payloads = msgspec.msgpack.decode(f.read())
    blocks: dict[str, dict[int, int]] = {}
    lora: dict[str, str | None] = {}
    kinds: dict[str, str | None] = {}
    stored = 0
    for payload in payloads:
        for ev in decoder.decode(payload).events:
            group = getattr(ev, "group_idx", None)
            key = ev.medium if not group else f"{ev.medium}/{group}"
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size, ev
                if group is not None:
                    kinds[str(group)] = ev.kv_cache_spec_kind
                per = blocks.setdefault(key, {})
                for h in ev.block_hashes:
                    per[h] = per.get(h, 0) + 1
                    lora[str(h)] = ev.lora_name
                stored += 1
            elif isinstance(ev, BlockRemoved):
                per = blocks.setdefault(key, {})
                for h in ev.block_hashes:
                    per[h] = per.get(h, 0) - 1
            else:
                assert isinstance(ev, AllBlocksCleared)
                blocks.clear()
    print(json.dumps({"stored_events": stored, "lora": lora, "kinds": kinds,
                      "blocks": {m: {str(h): n for h, n in per.items() if n} for m, per in blocks.items()}}))


if __name__ == "__main__":
    main()
