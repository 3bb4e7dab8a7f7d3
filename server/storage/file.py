"""A directory as the L3 store: one file per page, written atomically (temp file + rename)."""
from __future__ import annotations

import os
import tempfile
from urllib.parse import unquote, urlsplit

import numpy as np

from .base import Store, StoreError


class FileStore(Store):
    """`file:///DIR`: pages under DIR/<last two hex digits>/<key>; readers never see a partial page."""

    scheme = "file"

    def __init__(self, url: str, page_bytes: int):
        super().__init__(page_bytes)
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"storage URL {url!r}: a file URL names a local directory (file:///DIR)")
        self.root = unquote(parts.path)
        if not self.root or not os.path.isabs(self.root):
            raise ValueError(f"storage URL {url!r}: give an absolute directory (file:///DIR)")
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise ValueError(f"storage URL {url!r}: cannot create {self.root} ({e.strerror})") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ValueError(f"storage URL {url!r}: {self.root} is not writable")

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key[-2:], key)

    def exists(self, keys: list[str]) -> list[bool]:
        try:
            return [os.path.exists(self._path(k)) for k in keys]
        except OSError as e:
            raise StoreError("io", f"{self.root}: {e}") from None

    def put(self, keys: list[str], pages: list[np.ndarray]) -> int:
        done = 0
        try:
            for key, page in zip(keys, pages):
                path = self._path(key)
                folder = os.path.dirname(path)
                os.makedirs(folder, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
                try:
                    with os.fdopen(fd, "wb") as fh:
                        fh.write(memoryview(page))
                    os.replace(tmp, path)
                except BaseException:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                    raise
                done += 1
        except OSError as e:
            raise StoreError("io", f"{self.root}: {e}") from None
        return done

    def get(self, keys: list[str], outs: list[np.ndarray]) -> int:
        got = 0
        for key, out in zip(keys, outs):
            try:
                with open(self._path(key), "rb", buffering=0) as fh:
                    n = fh.readinto(memoryview(out))
                    if n != self.page_bytes or fh.read(1):
                        break  # a page of another size is not ours: a miss
            except FileNotFoundError:
                break
            except OSError as e:
                if got:
                    break
                raise StoreError("io", f"{self.root}: {e}") from None
            got += 1
        return got

    def describe(self) -> str:
        return f"file://{self.root}"
