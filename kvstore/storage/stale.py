"""Stale model versions: stored K/V of a model whose files are gone or changed since it was bound.

At bind, the store records each file the fingerprint covered with its size, mtime, inode, ctime
and digest (`Index.record_model_files`). Checking a version costs one `stat` per file:

- a file gone, or of another size, makes the version stale;
- a file whose other stamps changed (copied away and back, touched) may still hold the same
  bytes: its digest is looked up in the fingerprint memo, and with `rehash` the file is hashed
  again; until then the version is "changed since bound (not re-checked)", not stale.

One version may be bound from several folders (the same files copied: a hub cache and a local
folder): each copy's files are recorded, and the version is stale only when every copy is
(`status_of_copies`); a copy is a folder holding a `config.json` with its files, plus the files
of no such folder (an adapter's), which every copy shares.

Nothing stored for a stale version can ever be restored (a model loaded from the changed files
has another fingerprint, so another namespace); `gc --stale` evicts it and a budget evicts it
first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Optional

from kvstore import keys

Stamp = tuple[str, int, int, int, int]  # path, size, mtime_ns, inode, ctime_ns
RecordedFile = tuple[str, int, int, int, int, Optional[bytes]]  # a stamp and the file's digest
Lookup = Callable[[Path, os.stat_result], Optional[bytes]]
Remember = Callable[[Path, os.stat_result, bytes], None]

NOT_RECHECKED = "changed since bound (not re-checked)"


def stamp(path: Path) -> Stamp:
    st = os.stat(path)
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def stamps(files: Iterable[Path]) -> list[Stamp]:
    return [stamp(Path(f)) for f in files]


def status(recorded: Iterable[RecordedFile], lookup: Lookup | None = None, *, rehash: bool = False,
           remember: Remember | None = None) -> tuple[bool | None, str | None, list[RecordedFile] | None]:
    """(stale, why, the files as they are now) for a version with these recorded files.

    stale is True (a file is gone or holds other bytes), False (every file holds the recorded
    bytes; the files as they are now are then returned, to be recorded), or None (a file's
    stamps changed and its bytes were not re-checked: `rehash` hashes it, `remember` keeps the
    digest in the memo)."""
    now_files: list[RecordedFile] = []
    unsure = None
    for path, size, mtime_ns, ino, ctime_ns, digest in recorded:
        p = Path(path)
        try:
            st = os.stat(p)
        except OSError:
            return True, f"{path} is gone", None
        now = (path, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
        if now[1:] != (size, mtime_ns, ino, ctime_ns):
            if st.st_size != size or digest is None:  # other bytes, or nothing to compare with
                return True, f"{path} changed since it was stored", None
            current = lookup(p, st) if lookup else None
            if current is None and rehash:
                try:
                    current = keys.file_digests([p], None, remember)[0]
                except OSError as e:
                    return True, f"{path} cannot be read to re-check it ({e.strerror or e})", None
            if current is None:
                unsure = unsure or f"{path} {NOT_RECHECKED}"
            elif current != digest:
                return True, f"{path} changed since it was stored", None
        now_files.append((*now, digest))
    if unsure is not None:
        return None, unsure, None
    return False, None, now_files


def copies(recorded: Iterable[RecordedFile]) -> list[list[RecordedFile]]:
    """The recorded files of a version, by the copy they belong to: each folder that holds a
    `config.json`, with the files of folders that hold none (an adapter's) in every copy."""
    by_folder: dict[str, list[RecordedFile]] = {}
    for f in recorded:
        by_folder.setdefault(os.path.dirname(f[0]), []).append(f)
    models = [files for files in by_folder.values() if any(os.path.basename(f[0]) == "config.json" for f in files)]
    shared = [f for files in by_folder.values() if files not in models for f in files]
    return [files + shared for files in models] or [shared]


def status_of_copies(recorded: Iterable[RecordedFile], lookup: Lookup | None = None, *, rehash: bool = False,
                     remember: Remember | None = None) -> tuple[bool | None, str | None, list[RecordedFile] | None]:
    """`status` of a version bound from one folder or several: not stale when one copy is not
    (its files as they are now are returned), unsure when none is sure, else stale."""
    found = [status(files, lookup, rehash=rehash, remember=remember) for files in copies(recorded)]
    for result in found:
        if result[0] is False:
            return result
    return next((r for r in found if r[0] is None), found[0])
