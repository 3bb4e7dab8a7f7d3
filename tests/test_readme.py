"""README.md's Python snippets, run as written against a live server at page size 16 (tokens that do not
fill their last page): nothing held afterwards, the cache consistent."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from radixd.client import CacheClient

from .conftest import ServerProc
from .test_service import conserved

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)
DEFAULT_TARGET = "unix:///tmp/radixd-0.sock"


def test_the_client_and_host_tier_snippets_run_as_written_at_page_16():
    client, host_tier = SNIPPETS[0], SNIPPETS[1]
    assert DEFAULT_TARGET in client and "load_back" in host_tier
    srv = ServerProc("--num-slots", "1024", "--page-size", "16", "--host-slots", "2048", "--layers", "2",
                     "--kv-heads", "2", "--head-dim", "8", "--load-back-threshold", "1", "--write-policy", "write_back")
    try:
        tokens = np.arange(1000, 1350, dtype=np.int32)  # 350 tokens: 22 pages, the last one not full
        exec(client.replace(DEFAULT_TARGET, srv.target), {"tokens": tokens})
        with CacheClient(srv.target, name="check") as c:
            s = conserved(c)
            assert (s["held_tokens"], s["receipts"]) == (0, 0), s  # the surplus of the last page went too
            assert s["cached_tokens"] == 336  # the 21 whole pages
            again = np.concatenate([tokens, [1, 2, 3]])
            exec(client.replace(DEFAULT_TARGET, srv.target), {"tokens": again})  # a hit, then the rest
            assert conserved(c)["held_tokens"] == 0
            assert c.evict(1 << 20) == 352  # written back, then demoted: both prompts are on host only
            assert c.stats()["host_cached_tokens"] == 352
            scope = {"c": c, "tokens": tokens}
            exec(host_tier, scope)
            assert len(scope["prefix"]) == 336 and scope["lb"].loaded_len == 336
            c.unlock([scope["receipt"]])
            s = conserved(c)
            assert (s["held_tokens"], s["receipts"], s["cached_tokens"]) == (0, 0, 336)
    finally:
        srv.stop()
