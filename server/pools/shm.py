"""POSIX shared-memory regions named per server instance, with stale-segment cleanup."""
from __future__ import annotations

import mmap
import os
import re

SHM_DIR = "/dev/shm"
PREFIX = "radixd-"
_NAME = re.compile(r"^radixd-(\d+)-[0-9a-f]+-\w+$")


def segment_name(instance_id: str, tier: str, index: int = 0) -> str:
    """Unique per server instance; the pid lets a later server spot segments of a dead one."""
    return f"{PREFIX}{os.getpid()}-{instance_id[:16]}-{tier}{index}"


class ShmRegion:
    """One shared-memory file in /dev/shm, mapped read-write (created 0600 by the server)."""

    def __init__(self, name: str, size: int = 0, create: bool = False):
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            raise FileNotFoundError(f"shared-memory segment {name} does not exist (server gone or restarted?)") from None
        try:
            if create:
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, self.size)
        except BaseException:
            if create:  # a failed start leaves no segment behind
                os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.owner = create

    def close(self) -> None:
        """Unmap; the creator also unlinks. Views still alive keep the mapping until they die."""
        try:
            self.mm.close()
        except BufferError:
            pass  # exported views keep it mapped; the kernel frees it when they go
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.owner = False


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62  # pragma: no cover - not Linux: trust the shm mount alone


def shm_room() -> tuple[int, int]:
    """(bytes free on the shm mount, bytes of memory available): what shared-memory pools can use."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize, _mem_available()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Unlink radixd segments whose creating process is dead; returns their names."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed
