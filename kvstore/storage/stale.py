"""Stale model versions: stored K/V of a model whose files are gone or changed since it was bound.

At bind, the store records each file the fingerprint covered with its size, mtime, inode and
ctime (`Index.record_model_files`). A version is stale when one of those files is gone or differs
in any of them now: nothing is hashed again, so checking costs one `stat` per file. Nothing stored
for a stale version can ever be restored (a model loaded from the changed files has another
fingerprint, so another namespace); `gc --stale` evicts it and a budget evicts it first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

Stamp = tuple[str, int, int, int, int]  # path, size, mtime_ns, inode, ctime_ns


def stamp(path: Path) -> Stamp:
    st = os.stat(path)
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def stamps(files: Iterable[Path]) -> list[Stamp]:
    return [stamp(Path(f)) for f in files]


def changed(recorded: Iterable[Stamp]) -> str | None:
    """Why a version with these recorded files is stale (a file gone or changed), or None."""
    for path, *was in recorded:
        try:
            now = stamp(Path(path))[1:]
        except OSError:
            return f"{path} is gone"
        if tuple(now) != tuple(was):
            return f"{path} changed since it was stored"
    return None


def stale_namespaces(recorded: dict[bytes, list[Stamp]]) -> dict[bytes, str]:
    """ns -> why it is stale, for the stale ones among those with recorded files."""
    out = {}
    for ns, files in recorded.items():
        why = changed(files)
        if why is not None:
            out[ns] = why
    return out
