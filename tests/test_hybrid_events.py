"""A hybrid tree's KV events on the wire: vLLM's own decoder reads each component as its KV cache group,
SGLang's reads them (its class has no group), and radixd's BlockIndex rebuilds every component's block set."""
from __future__ import annotations

import json
import random
import subprocess
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import pytest

from radixd.client.events import BlockIndex, decode_zmq_payload
from radixd.server.events import python_payload
from radixd.server.tree.hybrid import HybridTree

from .conftest import venv_python
from .test_tree_hybrid import tree_pages

DECODE = Path(__file__).resolve().parent / "engine_events_decode.py"
PAGE = 4


def _tree_blocks(t: HybridTree) -> dict[int, Counter]:
    return tree_pages(t, PAGE)


@pytest.fixture(scope="module")
def run():
    """A seeded run of requests, early SWA releases and evictions; one payload per operation."""
    rnd = random.Random(7)
    t = HybridTree(PAGE, window=8, mamba_chunk=4, events=True)
    free, mfree, payloads = list(range(4000)), list(range(100, 400)), []
    prompts = [[rnd.randrange(1, 9) for _ in range(rnd.randrange(1, 10) * PAGE)] for _ in range(5)]
    for step in range(300):
        base = rnd.choice(prompts)
        toks = base[:rnd.randrange(len(base) + 1)] + [rnd.randrange(1, 9) for _ in range(rnd.randrange(0, 12))]
        m = t.match_prefix(toks)
        rid = t.lock(m.node_id)
        total = len(toks) - len(toks) % PAGE
        new = [free.pop() for _ in range(total - m.matched_len)]
        mv = mfree.pop()
        r = t.insert(toks[:total], np.array(m.indices.tolist() + new), prev_prefix_len=m.matched_len,
                     swa_evicted_seqlen=min(rnd.randrange(0, 4) * PAGE, total), mamba_value=mv)
        free.extend(r.frees.full_slots().tolist())
        mfree.extend(r.frees.mamba)
        if r.mamba_exist:
            mfree.append(mv)
        if rnd.random() < 0.3:
            t.release_swa(rid)
        t.unlock(rid)
        if rnd.random() < 0.4:
            e = t.evict(full=rnd.randrange(0, 3) * PAGE, swa=rnd.randrange(0, 3) * PAGE, mamba=rnd.randrange(0, 2))
            free.extend(e.frees.full_slots().tolist())
            mfree.extend(e.frees.mamba)
        events = t.take_events()
        if events:
            payloads.append(python_payload(float(step), events))
    return t, payloads


def test_radixds_block_index_rebuilds_every_component(run):
    t, payloads = run
    index = BlockIndex(PAGE)
    for p in payloads:
        index.apply("n0", decode_zmq_payload(p)[1])
    want = _tree_blocks(t)
    assert all(want[g] for g in want), "the run left every component holding pages"
    for g in (0, 1, 2):
        assert index.blocks("n0", "GPU", g) == want[g], g


@pytest.mark.parametrize("engine,folder", [("vllm", ".venv-vllm"), ("sglang", ".venv-sglang")])
def test_the_engines_own_decoders_read_the_groups(run, engine, folder, tmp_path):
    py = venv_python(f"RADIXD_{engine.upper()}_PYTHON", folder)
    if py is None:
        pytest.skip(f"no {engine} venv (.ci/run builds {folder})")
    t, payloads = run
    f = tmp_path / "payloads.msgpack"
    f.write_bytes(msgspec.msgpack.encode(payloads))
    r = subprocess.run([py, "-W", "ignore", str(DECODE), engine, str(f)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    want = _tree_blocks(t)
    as_json = {g: {str(h): n for h, n in c.items()} for g, c in want.items()}
    if engine == "vllm":  # vLLM's BlockStored/BlockRemoved carry group_idx: one block set per component
        assert got["blocks"]["GPU"] == as_json[0]
        assert got["blocks"]["GPU/1"] == as_json[1] and got["blocks"]["GPU/2"] == as_json[2]
        assert got["kinds"] == {"0": "full_attention", "1": "sliding_window", "2": "mamba"}
    else:  # SGLang 0.5.23's classes have no group: it reads every component's pages as one multiset
        union = want[0] + want[1] + want[2]
        assert got["blocks"]["GPU"] == {str(h): n for h, n in union.items()}
