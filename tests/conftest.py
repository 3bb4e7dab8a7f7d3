"""Fixtures that start a real radixd server process and talk gRPC to it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def venv_python(env_var: str, folder: str) -> str | None:
    """The interpreter of a third-party stack's own venv: $env_var, else ROOT/folder (built by .ci/run)."""
    for cand in (os.environ.get(env_var), Path(__file__).resolve().parent.parent / folder / "bin" / "python"):
        if cand and Path(cand).exists():
            return str(cand)
    return None


class ServerProc:
    """A `radixd serve` child process on a private unix socket."""

    def __init__(self, *extra: str, sock: str | None = None, env: dict | None = None):
        self.dir = tempfile.mkdtemp(prefix="radixd-test-")
        self.sock = sock or os.path.join(self.dir, "s.sock")
        self.args = extra
        self.env = env
        self.start()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "radixd.server.cli", "serve", "--listen", f"unix:{self.sock}",
               "--device", "cpu", "--metrics-addr", "127.0.0.1:0", "--grace-seconds", "1", *self.args]
        self.log_path = os.path.join(self.dir, "stderr.log")
        with open(self.log_path, "ab") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=self.env)
        line = self.proc.stdout.readline()  # the server prints one 'ready' line once it serves
        if "radixd ready" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r}")
        self.metrics_url = line.split("metrics=")[1].split()[0]
        self.instance_id = line.split("instance=")[1].strip()

    def log(self) -> str:
        """What the server wrote to stderr (its log) so far."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    @property
    def target(self) -> str:
        return f"unix://{self.sock}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def server():
    s = ServerProc("--num-slots", "4096")
    yield s
    s.stop()


@pytest.fixture
def client(server):
    from radixd.client import CacheClient
    c = CacheClient(server.target, name="test")
    yield c
    c.close()
