"""Native libraries (gRPC core, Mooncake) log to file descriptor 2 on their own; a refused start must stay one
line, so the calls that may fail at start run with that descriptor captured."""
from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from typing import Iterator


class Captured:
    """What a native library wrote to stderr meanwhile (its last line is often the reason)."""

    text = ""

    @property
    def last_line(self) -> str:
        lines = [ln.strip() for ln in self.text.splitlines() if ln.strip()]
        return lines[-1] if lines else ""


@contextmanager
def native_stderr() -> Iterator[Captured]:
    """Capture fd 2 (C-level writes included) for the duration; Python's own stderr is flushed first."""
    out = Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.text = tmp.read().decode(errors="replace")
