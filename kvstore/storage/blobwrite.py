"""Writing blob files: a temporary file in the blob's own folder, fsync, atomic rename, fsync of
the folder. A reader sees nothing or the whole file, and an index row may point at a blob once
its write returned. Knows files, no SQL.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Mapping, NamedTuple

import numpy as np
import xxhash

from kvstore import faults
from kvstore.storage.blobformat import BLOB_FORMAT, Tensor, encode, tensor_checksum
from kvstore.storage.blobtree import TMP_PREFIX, blob_path
from kvstore.trust import Trust, unsigned


class Staged(NamedTuple):
    """A blob written to a temporary file of its folder and fsynced, not yet in place."""

    tmp: Path
    path: Path
    size: int
    checksum: int
    fsync: bool


def write(root: Path, h: bytes, tensors: Mapping[str, Tensor], metadata: Mapping[str, str],
          *, fsync: bool = True, trust: Trust | None = None) -> tuple[int, int]:
    """Write a blob atomically. Returns (size in bytes, checksum). Raises OSError (ENOSPC...)."""
    return place(stage(root, h, tensors, metadata, fsync=fsync, trust=trust))


def stage(root: Path, h: bytes, tensors: Mapping[str, Tensor], metadata: Mapping[str, str],
          *, fsync: bool = True, trust: Trust | None = None) -> Staged:
    """The first half of `write`: the blob in a temporary file in its folder, fsynced. `place`
    then renames it into place (or `discard` drops it). `trust`: the header is tagged with it
    (any tag in `metadata` is dropped: it was of other bytes). Raises OSError."""
    path = blob_path(root, h)
    _makedirs(path.parent)
    sums = {name: tensor_checksum(arr) for name, (_, arr) in tensors.items()}
    head, pieces = encode(tensors, _sealed(metadata, sums, tensors, trust))
    digest = xxhash.xxh3_64(head)

    def body(f) -> None:
        _write_all(f, head)
        faults.hit("blob_write")
        for piece in pieces:
            view = piece.reshape(-1).view(np.uint8)
            digest.update(view)
            _write_all(f, view)

    tmp, size = _stage_file(path, h, body, fsync=fsync)
    return Staged(tmp, Path(path), size, digest.intdigest(), fsync)


def blob_size(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> int:
    """The bytes `stage` will write for these tensors, without writing or checksumming them."""
    sums = {name: "0" * 16 for name in tensors}  # every checksum is 16 hex digits
    head, pieces = encode(tensors, _sealed(metadata, sums, tensors, _SIZE_ONLY))
    return len(head) + sum(p.nbytes for p in pieces)


_SIZE_ONLY = Trust([b"\0" * 32], fleet=False)  # a tag of the right length, for `blob_size`


def _sealed(metadata: Mapping[str, str], sums: Mapping[str, str], tensors: Mapping[str, Tensor],
            trust: Trust | None) -> dict[str, str]:
    """A blob's metadata: the caller's, its format, its tag (`trust`) and its tensors' checksums."""
    meta = dict(unsigned(metadata), blob_format=BLOB_FORMAT)
    if trust is not None:
        meta = trust.sign(meta, {name: (tag, arr.shape, int(sums[name], 16)) for name, (tag, arr) in tensors.items()})
    return dict(meta, checksums=json.dumps(sums, separators=(",", ":")))


def place(st: Staged) -> tuple[int, int]:
    """Rename a staged blob into place and fsync its folder: a row may point at it once this
    returns. Returns (size, checksum). Raises OSError (the temporary file is then gone)."""
    _place(st.tmp, st.path, fsync=st.fsync)
    return st.size, st.checksum


def discard(st: Staged) -> None:
    """Drop a staged blob that is not needed after all."""
    _unlink_quietly(st.tmp)


def write_bytes(root: Path, h: bytes, data: bytes | bytearray | memoryview, *, fsync: bool = True) -> int:
    """Put a whole blob already checked (a copy from the remote tier) at its place, atomically,
    as `write` does. Returns its size. Raises OSError."""
    path = blob_path(root, h)
    _makedirs(path.parent)
    return _publish(path, h, lambda f: _write_all(f, data), fsync=fsync)


def _publish(path: Path, h: bytes, body, *, fsync: bool) -> int:
    """Write a blob with `body(file)` into a temporary file in its folder, fsync, rename it into
    place and fsync the folder: a reader sees nothing or the whole file, and a row may point at
    it once this returns. Returns the size."""
    tmp, size = _stage_file(path, h, body, fsync=fsync)
    _place(tmp, path, fsync=fsync)
    return size


def _stage_file(path, h: bytes, body, *, fsync: bool) -> tuple[Path, int]:
    tmp = Path(path).parent / f"{TMP_PREFIX}{h.hex()}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            body(f)
            size = f.tell()
            if fsync:
                os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp, size


def _place(tmp: Path, path, *, fsync: bool) -> None:
    try:
        faults.hit("blob_temp")
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if fsync:  # the new name is durable only once its folder is: before any row points at it
        _fsync_dir(Path(path).parent)


def _unlink_quietly(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



def _makedirs(path: Path) -> None:
    """The two hex folders of a blob (`ab/cd`), each 0700 (os.makedirs gives the first one the
    umask's mode), and never a symbolic link, nor in a blob tree that is one: nothing is
    written outside the store."""
    root = path.parent.parent
    if os.path.islink(root):
        raise OSError(errno.ENOTDIR, f"{root} is a symbolic link: blobs are only written in real "
                                     "folders of the store")
    for folder in (path.parent, path):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            if os.path.islink(folder) or not folder.is_dir():
                raise OSError(errno.ENOTDIR, f"{folder} is a symbolic link or not a folder: "
                                             "blobs are only written in real folders of the store") from None


def _write_all(f, data) -> None:
    view = memoryview(data)
    while view:
        n = f.write(view)
        view = view[n:]
