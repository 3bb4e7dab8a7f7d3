"""Ground truth for what the vLLM connector stored (run in vLLM's venv by tests/test_vllm_connector.py): the
test model's true K (after RoPE) and V, computed by transformers' own forward pass over the same weights,
against what radixd's pool holds for the prompt, read by radixd's own client in radixd's documented
[slots, kv_heads, head_dim] layout; for Mamba layers, the conv state (the last conv_kernel - 1 inputs, radixd's
[dim, kernel - 1]) and the SSM state radixd holds at the end of the prompt and at every block boundary before
it (--states-every), against transformers' cache after a forward pass over exactly those tokens. No vLLM code is
involved in either side of the comparison.

    python tests/vllm_true_kv.py MODEL_DIR TARGET PROMPT.json TOKENS [--states-every BLOCK]

Prints one JSON line: per layer the largest difference of K and of V and the largest |K|, the tokens
compared, and whether every layer matched.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from radixd.client import CacheClient


def main() -> None:
    model_dir, target, prompt_path, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    every = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[5] == "--states-every" else 0
    prompt = json.load(open(prompt_path))
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([prompt[:n]]), use_cache=True)
    cache = _cache(out)
    with CacheClient(target, name="true-kv-reader") as c:
        hybrid = c.info()["hybrid"]
        attention = hybrid["full_layers"] + hybrid["swa_layers"] if hybrid else range(len(model.model.layers))
        true_k = {i: cache.layers[i].keys[0].transpose(0, 1) for i in attention}  # [tokens, heads, dim]
        true_v = {i: cache.layers[i].values[0].transpose(0, 1) for i in attention}
        if hybrid:  # full-attention layers in the FULL pool, sliding-window layers in the SWA pool (their twins)
            m = c.match_hybrid([np.asarray(prompt[:n], dtype=np.int32)])[0]
        else:
            m = c.match_prefix(np.asarray(prompt[:n], dtype=np.int32))
        assert m.matched_len == n, f"radixd holds {m.matched_len} of the {n} tokens"
        pools = c.map_pools()
        res = {"tokens": n, "layers": []}
        ok = True
        if pools.device and pools.device[0].descriptor.mla:  # MLA: transformers caches each token's normalized latent (keys) and its
            # rotated key part (values), single-head; radixd's latent buffer holds both, in that order, per slot
            idx = torch.from_numpy(np.array(m.indices, dtype=np.int64))
            for i in attention:
                latent, pe = true_k[i][:, 0], true_v[i][:, 0]
                got = pools.device[0].kv_buffer[i][idx, 0].float()
                d_latent = float((got[:, :latent.shape[1]] - latent).abs().max())
                d_pe = float((got[:, latent.shape[1]:] - pe).abs().max())
                scale = max(float(latent.abs().max()), float(pe.abs().max()))
                ok &= max(d_latent, d_pe) <= 1e-4 * max(scale, 1.0)
                res["layers"].append(dict(latent=d_latent, rotary=d_pe, scale=scale, compared=len(latent), pool="mla"))
            attention = []
        for i in sorted(attention):
            if hybrid and i in hybrid["swa_layers"]:
                pool, at, slots = pools.swa, hybrid["swa_layers"].index(i), m.swa_indices
            else:
                pool, at, slots = pools.device[0], hybrid["full_layers"].index(i) if hybrid else i, m.indices
            tk, tv = true_k[i], true_v[i]
            pos = np.arange(n - len(tk), n)  # a sliding layer's cache may keep only its last tokens
            keep = slots[pos] >= 0  # SWA twins exist for the window before the end, at least
            idx = torch.from_numpy(np.array(slots[pos][keep], dtype=np.int64))
            sel = torch.from_numpy(keep)
            k, v = pool.k_buffer[at][idx].float(), pool.v_buffer[at][idx].float()
            scale = float(tk.abs().max())
            dk = float((k - tk[sel]).abs().max())
            dv = float((v - tv[sel]).abs().max())
            tol = 1e-4 * max(scale, 1.0)
            ok &= dk <= tol and dv <= tol and int(keep.sum()) > 0
            res["layers"].append(dict(k=dk, v=dv, scale=scale, compared=int(keep.sum()),
                                      pool="swa" if pool is pools.swa else "full"))
        if hybrid and hybrid["state_layers"]:
            ok &= _states(model, c, pools, prompt, hybrid["state_layers"],
                          [k * every for k in range(1, n // every)] + [n] if every else [n], res)
        pools.close()
    res["ok"] = bool(ok)
    print(json.dumps(res), flush=True)


def _cache(out):
    """transformers' cache of a forward (a pure Mamba model names it cache_params)."""
    cache = getattr(out, "past_key_values", None)
    return cache if cache is not None else out.cache_params


def _states(model, c: CacheClient, pools, prompt: list[int], layers: list[int], ends: list[int], res: dict) -> bool:
    """radixd's state at each end against transformers' cache after exactly that many tokens."""
    ok, res["states"] = True, []
    for n in ends:
        with torch.no_grad():
            cache = _cache(model(torch.tensor([prompt[:n]]), use_cache=True))
        m = c.match_hybrid([np.asarray(prompt[:n], dtype=np.int32)])[0]
        row = dict(tokens=n, matched=m.matched_len, slot=m.mamba_src, layers=[])
        ok &= m.matched_len == n and m.mamba_src >= 0
        for j, i in enumerate(layers):
            conv = cache.layers[i].conv_states[0][0]  # [dim, kernel]: the last kernel inputs
            ssm = cache.layers[i].recurrent_states[0][0]  # [heads, head_dim, d_state]
            rc = pools.state.conv_buffer[j][m.mamba_src].float()
            rs = pools.state.temporal_buffer[j][m.mamba_src].float()
            want = conv[:, conv.shape[1] - rc.shape[1]:]
            dc, ds = float((rc - want).abs().max()), float((rs - ssm).abs().max())
            sc, ss = float(want.abs().max()), float(ssm.abs().max())
            ok &= dc <= 1e-4 * max(sc, 1.0) and ds <= 1e-4 * max(ss, 1.0)
            row["layers"].append(dict(layer=i, conv=dc, conv_scale=sc, ssm=ds, ssm_scale=ss))
        res["states"].append(row)
    return ok


if __name__ == "__main__":
    main()
