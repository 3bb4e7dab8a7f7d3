"""vLLM 0.32.0's own CPU attention kernels against radixd's block conversion (run in vLLM's venv by
tests/test_vllm_connector.py): for every kernel this CPU can run and every dtype, the kernel's own
reshape_and_cache writes random K and V into blocks, the connector's probe learns the layout from the
kernel, and save_blocks must give back exactly the K and V the kernel was handed (load_blocks the reverse,
byte for byte into the kernel's layout), both through strided views of the block (aligned radixd pages, a kernel
whose block is one: vLLM's vec kernels; by client/_pagecopy.c's copy where built, and by numpy's) and through the
general gather (pages off alignment). Prints one line per
kernel and dtype, then `ok layouts N` (11; 9 on a CPU without AMX, which says so).
"""
from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from radixd.vllm import layout
from radixd.vllm.layout import _strided, geometry, load_blocks, probe_cpu_layout, save_blocks

BLOCK, HEADS, NB = 32, 2, 5


def check(isa: str, dtype: torch.dtype, head_dim: int) -> str:
    def write(key, value, kc, vc, slots):
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    kv = torch.zeros(NB, HEADS, BLOCK, 2 * head_dim, dtype=dtype)
    try:
        g = probe_cpu_layout(geometry(kv, BLOCK), write, isa)
    except ValueError as e:
        return f"refused: {e}"
    gen = torch.Generator().manual_seed(0)
    n = 3 * BLOCK
    key = torch.randn(n, HEADS, head_dim, generator=gen).to(dtype)
    value = torch.randn(n, HEADS, head_dim, generator=gen).to(dtype)
    blocks = torch.tensor([4, 1, 2])
    slots = (blocks.view(-1, 1) * BLOCK + torch.arange(BLOCK)).view(-1)
    kc, vc = kv.view(NB, HEADS, 2 * BLOCK, head_dim).chunk(2, dim=2)
    write(key, value, kc, vc, slots)  # the engine's forward writes its K and V
    native = layout._copy_kv_blocks
    for off, by in ((0, native), (0, None), (1, native)):  # aligned pages (strided views where the block is one:
        layout._copy_kv_blocks = by  # client/_pagecopy.c's copy where built, then numpy's), then off alignment
        size = 4 * BLOCK + off  # (the gather)
        k, v = torch.zeros(size, HEADS, head_dim, dtype=dtype), torch.zeros(size, HEADS, head_dim, dtype=dtype)
        pages = torch.tensor([BLOCK, 3 * BLOCK, 0]) + off
        save_blocks(kv, g, blocks, k, v, pages)
        for i, p in enumerate(pages.tolist()):
            assert torch.equal(k[p:p + BLOCK], key[i * BLOCK:(i + 1) * BLOCK]), (isa, dtype, off, by, "K")
            assert torch.equal(v[p:p + BLOCK], value[i * BLOCK:(i + 1) * BLOCK]), (isa, dtype, off, by, "V")
        again = torch.zeros_like(kv)
        load_blocks(again, g, blocks, k, v, pages)
        assert torch.equal(again[blocks], kv[blocks]), (isa, dtype, off, by, "load")
    layout._copy_kv_blocks = native
    return "exact" + (" (strided" + (", native" if native is not None else "") + ")" if _strided(g) is not None
                      else "")


def main() -> None:
    done = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for head_dim in (32, 64, 80):
            isa = _get_attn_isa(dtype, BLOCK, head_dim)  # the kernel vLLM picks on this CPU
            res = check(isa, dtype, head_dim)
            print(dtype, head_dim, isa, res, flush=True)
            assert res.startswith("exact"), (isa, dtype, head_dim, res)
            done += 1
    if not torch.cpu._is_amx_tile_supported():  # vLLM's own test for it: the kernel refuses AMX on this CPU
        print("amx: this CPU has no AMX tiles, its kernel not run", flush=True)
        print("ok layouts", done, flush=True)
        return
    for head_dim in (32, 64):  # AMX (bf16) on a CPU that has it; its block packing is plain data movement
        res = check("amx", torch.bfloat16, head_dim)
        print(torch.bfloat16, head_dim, "amx", res, flush=True)
        assert res.startswith("exact"), ("amx", head_dim, res)
        done += 1
    print("ok layouts", done, flush=True)


if __name__ == "__main__":
    main()
