"""Packaging: generated stubs are current; the wheel installs only radixd.* (no bare server/client)."""
from __future__ import annotations

import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_not_stale(tmp_path):
    sys.path.insert(0, str(ROOT / "proto"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    generate.generate(tmp_path)
    for name in generate.FILES:
        assert (tmp_path / name).read_bytes() == (ROOT / "proto" / name).read_bytes(), \
            f"proto/{name} is stale: run python proto/generate.py"


def test_wheel_installs_into_a_fresh_venv(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    str(wheels), str(ROOT)], check=True)
    (whl,) = wheels.glob("radixd-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names}
    assert "server" not in tops and "client" not in tops and "radixd" in tops
    if os.environ.get("RADIXD_REQUIRE_NATIVE"):  # CI installs OpenSSL's headers: the native parts must be in
        for ext in ("radixd/server/tree/_chain", "radixd/server/_kvevents", "radixd/server/tree/_hwalk"):
            assert any(n.startswith(ext) and n.endswith(".so") for n in names), (ext, names)
    # The wheel alone, beside the dependencies of the interpreter running the tests (a venv's or the system's:
    # its own site-packages, read without their .pth files, so an editable radixd there stays invisible).
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"),
                    str(whl)], check=True)
    deps = os.pathsep.join(site.getsitepackages())
    code = ("import sys; sys.path[:0] = [sys.argv[1]]; sys.path += sys.argv[3].split(':'); "
            "import radixd.server.tree as t, radixd.client, "
            "radixd.proto.cache_pb2; assert sys.argv[1] in t.__file__, t.__file__; "
            "import importlib.util as u; assert u.find_spec('server') is None and u.find_spec('client') is None; "
            "from radixd.server.tree import hashes; from radixd.server import events; "
            "from radixd.server.tree import hybrid; hybrid.HybridTree(1, window=2, mamba_chunk=1); "
            "import radixd.server.pools.hybrid, radixd.server.layouts; "
            "assert (hashes.NATIVE and events.NATIVE and hybrid.NATIVE) or not sys.argv[2]; "
            "print(t.RadixTree().insert([1, 2], [3, 4]).adopted_len)")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(tmp_path / "site"),
                          os.environ.get("RADIXD_REQUIRE_NATIVE", ""), deps], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"
