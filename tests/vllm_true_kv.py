"""Ground truth for what the vLLM connector stored (run in vLLM's venv by tests/test_vllm_connector.py): the
test model's true K (after RoPE) and V, computed by transformers' own forward pass over the same weights,
against what radixd's pool holds for the prompt, read by radixd's own client in radixd's documented
[slots, kv_heads, head_dim] layout. No vLLM code is involved in either side of the comparison.

    python tests/vllm_true_kv.py MODEL_DIR TARGET PROMPT.json TOKENS

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
    prompt = json.load(open(prompt_path))
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([prompt[:n]]), use_cache=True)
    cache = out.past_key_values
    layers = len(model.model.layers)
    true_k = [cache.layers[i].keys[0].transpose(0, 1) for i in range(layers)]  # [tokens, heads, dim]
    true_v = [cache.layers[i].values[0].transpose(0, 1) for i in range(layers)]
    with CacheClient(target, name="true-kv-reader") as c:
        m = c.match_prefix(np.asarray(prompt[:n], dtype=np.int32))
        assert m.matched_len == n, f"radixd holds {m.matched_len} of the {n} tokens"
        pools = c.map_pools()
        dev = pools.device[0]
        idx = torch.from_numpy(np.array(m.indices, dtype=np.int64))
        res = {"tokens": n, "layers": []}
        ok = True
        for i in range(layers):
            k, v = dev.k_buffer[i][idx].float(), dev.v_buffer[i][idx].float()
            scale = float(true_k[i].abs().max())
            dk = float((k - true_k[i]).abs().max())
            dv = float((v - true_v[i]).abs().max())
            tol = 1e-4 * max(scale, 1.0)
            ok &= dk <= tol and dv <= tol
            res["layers"].append(dict(k=dk, v=dv, scale=scale))
        pools.close()
    res["ok"] = bool(ok)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
