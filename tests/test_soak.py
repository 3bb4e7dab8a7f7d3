"""The soak (bench/soak.py) in its four-minute version: real worker processes, a real vLLM engine when its venv is
there, a host tier and a Valkey L3 store, every fault kind injected once; it fails on any byte of a hit that its
tokens did not write, a changed engine token, a leak once the clients are gone, a failed invariant check or a hit
rate that does not come back after a fault."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"


def test_four_minutes_of_traffic_and_faults_lose_nothing_and_leak_nothing(tmp_path):
    out = tmp_path / "soak.json"
    p = subprocess.run([sys.executable, str(SOAK), "--minutes", "4", "--workers", "3", "--seed", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=900)
    print(p.stdout[-6000:], p.stderr[-3000:])
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert last.startswith("RESULT ") and "ok=1" in last.split(), p.stdout[-4000:] + p.stderr[-2000:]
    assert p.returncode == 0
    fields = dict(kv.split("=") for kv in last.split()[1:])
    assert int(fields["requests"]) > 0 and int(fields["hit_tokens"]) > 0 and fields["wrong"] == "0"
    assert int(fields["faults"]) >= 7  # every kind (the engine's too when .venv-vllm is there)
