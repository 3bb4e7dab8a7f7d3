"""Regenerate the Python stubs from cache.proto: python proto/generate.py [--out DIR]."""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("cache_pb2.py", "cache_pb2_grpc.py", "cache_pb2.pyi")


def generate(out: Path) -> None:
    """Compile as radixd/proto/cache.proto so the stubs import each other as radixd.proto.*."""
    from grpc_tools import protoc
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "radixd" / "proto"
        pkg.mkdir(parents=True)
        shutil.copy(HERE / "cache.proto", pkg / "cache.proto")
        rc = protoc.main(["protoc", f"-I{tmp}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                          f"--grpc_python_out={tmp}", str(pkg / "cache.proto")])
        if rc:
            raise SystemExit(f"protoc failed with {rc}")
        out.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copy(pkg / name, out / name)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=HERE)
    generate(ap.parse_args().out)
