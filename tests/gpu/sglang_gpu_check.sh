#!/usr/bin/env bash
# A real SGLang server with radixd as its radix-cache backend, on a GPU (issue: SGLang backend). Sends a
# prompt, flushes SGLang's own cache, sends it again: the second answer must come from radixd's pages
# (cached tokens reported, radixd's hit counter up) and be the same greedy output.
#
# Needs what the device machines lent here cannot have (no registry there, 64 MiB carried): a python with
# CUDA SGLang 0.5.23 and radixd installed (SGLANG_PYTHON), and a small model (MODEL: a local path or a name
# in the Hugging Face cache; default Qwen/Qwen2.5-0.5B-Instruct). About 2 minutes on one GPU.
#   SGLANG_PYTHON=/opt/sglang/bin/python MODEL=/models/qwen2.5-0.5b bash tests/gpu/sglang_gpu_check.sh
set -euo pipefail
PY=${SGLANG_PYTHON:-python3}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
PORT=${PORT:-30123}
dir=$(mktemp -d)
cleanup() { kill "${sgl:-}" "${rdx:-}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT

"$PY" -c "import sglang, radixd.sglang; assert sglang.__version__ == '0.5.23', sglang.__version__"
if [ -f "$MODEL/config.json" ]; then cfg="$MODEL/config.json"; else
  cfg=$(HF_HUB_OFFLINE=1 "$PY" -c "import sys; from huggingface_hub import hf_hub_download as h; print(h(sys.argv[1], 'config.json'))" "$MODEL")
fi
"$PY" -m radixd.server.cli serve --device cuda --listen "unix:$dir/r.sock" --model-config "$cfg" \
  --dtype bfloat16 --page-size 16 --num-slots 65536 --metrics-addr 127.0.0.1:0 > "$dir/radixd.log" 2>&1 &
rdx=$!
for _ in $(seq 120); do grep -q "radixd ready" "$dir/radixd.log" && break; sleep 1; done
grep "radixd ready" "$dir/radixd.log"

SGLANG_PLUGINS=radixd RADIXD_TARGET="unix://$dir/r.sock" "$PY" -m sglang.launch_server --model-path "$MODEL" \
  --radix-cache-backend radixd --page-size 16 --port "$PORT" --mem-fraction-static 0.4 \
  --disable-cuda-graph > "$dir/sglang.log" 2>&1 &
sgl=$!
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done

"$PY" - "$PORT" "unix://$dir/r.sock" <<'PY'
import json, sys, urllib.request
port, target = sys.argv[1], sys.argv[2]
def post(path, body=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read() or b"{}") if path != "/flush_cache" else None
prompt = "radixd keeps the KV cache of many engines in one place. " * 40
ask = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 48}}
first = post("/generate", ask)
from radixd.client import CacheClient
with CacheClient(target) as c:
    stored = c.stats()["cached_tokens"]  # may lag: the backend publishes copies at its next call
post("/flush_cache")  # SGLang forgets; radixd still has the pages
second = post("/generate", ask)
with CacheClient(target) as c:
    hits = c.stats()["hit_tokens_total"]
cached = second["meta_info"].get("cached_tokens", 0)
prompt_tokens = second["meta_info"]["prompt_tokens"]
print(f"prompt_tokens={prompt_tokens} radixd_cached={stored} second_cached={cached} radixd_hits={hits}")
assert cached >= prompt_tokens // 16 * 16 - 16 and hits > 0, "the second request did not hit radixd"
assert first["text"] == second["text"], (first["text"], second["text"])
print("SGLANG_GPU_CHECK ok: same greedy output, prefix served from radixd")
PY
