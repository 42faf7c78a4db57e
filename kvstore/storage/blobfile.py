"""Reading blob files: open one checked against its index row, and copy token ranges of its
tensors straight into memory the restore owns, each tensor checked against its own checksum.

Nothing here follows a link or waits on a FIFO: anything that is not a regular file of the size
the row says is damage (`BlobError`). Knows files, no SQL, no mlx.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import numpy as np
import xxhash

from kvstore.errors import BlobError
from kvstore.storage.blobformat import (
    DTYPES,
    HEAD_GUESS,
    MAX_BLOB_BYTES,
    Entry,
    parse,
    read_head,
    tensor_checksums,
    token_span,
    verify_bytes,
)
from kvstore.storage.blobtree import blob_file
from kvstore.storage.readplan import IOV_BATCH, ReadPlan, Target, read_plan


def open_regular(path: Path | str, *, dir_fd: int | None = None) -> int:
    """A read-only fd of a regular file at `path`, never through a symbolic link. A FIFO, device
    or socket in its place raises OSError at once (O_NONBLOCK: opening a FIFO never waits)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_checked(root: Path, h: bytes, *, size: int, checksum: int) -> tuple[bytearray, BlobFile]:
    """A whole blob's bytes, checked: its size, header and whole-file checksum, and (format 2)
    every tensor's checksum. The blob is returned closed, for its header. BlobError on damage."""
    with open_blob(root, h, size=size) as blob:
        buf = bytearray(size)
        blob.read_exact(memoryview(buf), 0)
    if xxhash.xxh3_64_intdigest(buf) != checksum:
        raise BlobError(f"{blob.path}: checksum mismatch")
    if blob.checksums is not None:
        verify_bytes(buf, h, blob.path)
    return buf, blob


class Layout:
    """A blob header's table of tensors (names, dtypes, shapes, offsets from the data start),
    one object shared by every blob that has the same table (every record of one cache shape).
    What is worked out from a table once is kept on it: read plans, by the copies they serve."""

    __slots__ = ("infos", "entries", "deltas", "reads", "__weakref__")

    def __init__(self, infos: dict[str, tuple[str, tuple[int, ...], int, int]]):
        self.infos = infos  # name -> (tag, shape, start, end), offsets from the data start
        self.entries = {name: Entry(tag, shape) for name, (tag, shape, _, _) in infos.items()}
        self.deltas = {name: e for name, e in self.entries.items() if name != "tokens"}
        self.reads: dict[int, tuple] = {}  # id(copies) -> (copies, target shapes, ReadPlan)


class _Header(NamedTuple):
    digest: int  # xxh3_128 of the header's bytes: a header read again is reused only if unchanged
    length: int  # 8 + the JSON's length
    layout: Layout
    metadata: dict[str, str]
    checksums: dict[str, int] | None  # name -> xxh3_64; None for a blob written by 0.1
    verdicts: dict  # what a trust tag check said of this header, by `kvstore.trust.Trust` (see `verdict`)


_LAYOUTS: dict[tuple, Layout] = {}
_HEADERS: "OrderedDict[tuple[int, int, int], _Header]" = OrderedDict()
_HEADERS_MAX = 4096  # parsed headers kept, a few KiB each (a 32k-token prompt of a 28-layer model: 128)
_CACHE_LOCK = threading.Lock()
_READS_MAX = 1024  # read plans kept per layout (one per record position of a cached plan)


def _layout_of(entries: dict[str, dict]) -> Layout:
    """The shared Layout of a parsed (and checked) header's tensor entries."""
    infos = {name: (info["dtype"], tuple(info["shape"]), *info["data_offsets"]) for name, info in entries.items()}
    key = tuple(infos.items())
    with _CACHE_LOCK:
        layout = _LAYOUTS.get(key)
        if layout is None:
            if len(_LAYOUTS) >= 1024:  # many shapes: start again (blobs hold their own)
                _LAYOUTS.clear()
            layout = _LAYOUTS[key] = Layout(infos)
    return layout


_TABLES: dict[tuple, dict[str, Entry]] = {}


def shared_entries(entries: dict[str, Entry]) -> dict[str, Entry]:
    """One dict object for every equal tensor table (records in RAM): the restore caches its
    plans by the tables' identity. The dict returned must not be changed."""
    key = tuple(entries.items())
    with _CACHE_LOCK:
        got = _TABLES.get(key)
        if got is None:
            if len(_TABLES) >= 1024:
                _TABLES.clear()
            got = _TABLES[key] = entries
    return got


def _header(head: bytes, path: Path, size: int) -> _Header:
    """Parse and check a blob's header bytes, or reuse the parse of the same bytes."""
    entries, base, metadata = parse(head, path, size)
    sums = tensor_checksums(metadata, path)
    if sums is not None and set(sums) != set(entries):
        raise BlobError(f"{path}: its checksums do not name exactly its tensors")
    metadata.pop("checksums", None)  # kept parsed, as ints: the JSON string is most of a header
    return _Header(xxhash.xxh3_128_intdigest(head[:base]), base, _layout_of(entries), metadata,
                   {name: int(v, 16) for name, v in sums.items()} if sums is not None else None, {})


class BlobFile:
    """An open blob whose header was read and checked (size, header, the record it names).

    Tensors are read by name, each checked against its own checksum (blob format 2) as it is
    read, so they may be read in any order and on any thread. A blob written by 0.1 (no
    per-tensor checksums) is read whole when opened and checked by `checksum`, the old way.
    """

    def __init__(self, fd: int, path: Path | str, size: int, header: _Header, h: bytes, checksum: int | None,
                 whole=None):
        self.fd, self.path, self.size = fd, path, size
        self.layout, self.base, self.metadata = header.layout, header.length, header.metadata
        self.entries = self.layout.entries
        if self.metadata.get("hash") != h.hex():
            raise BlobError(f"{path}: its header names record {self.metadata.get('hash')!r}")
        self.checksums = header.checksums
        self._verdicts = header.verdicts
        self._whole = whole  # held whole in memory, and checked whole already (see `in_memory`)
        if self._whole is None and self.checksums is None:  # 0.1: no per-tensor sums, so the whole file is checked now
            if checksum is None:
                raise BlobError(f"{path}: a blob without tensor checksums needs its row's checksum")
            self._whole = bytearray(size)
            self.read_exact(memoryview(self._whole), 0)
            if xxhash.xxh3_64_intdigest(self._whole) != checksum:
                raise BlobError(f"{path}: checksum mismatch")

    def trust_table(self) -> dict[str, tuple[str, tuple[int, ...], int]] | None:
        """What a trust tag covers of the tensors (`kvstore.trust`); None for a 0.1 blob."""
        if self.checksums is None:
            return None
        return {name: (tag, shape, self.checksums[name]) for name, (tag, shape, _, _) in self.layout.infos.items()}

    def verdict(self, trust):
        """What `trust` says of this blob's trust tag (None for a 0.1 blob), worked out once per
        parsed header: a file opened again with the same header bytes reuses its parse, and so
        the verdict on it (every open of a record in a fetch checks it)."""
        got = self._verdicts.get(trust)
        if got is None:
            table = self.trust_table()
            if table is None:
                return None
            got = self._verdicts[trust] = trust.check(self.metadata, table)
        return got

    def __enter__(self) -> "BlobFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def cached(self) -> bool:
        """Whether the file's last byte is in the page cache (readahead fills a file in order, so
        then all of it most likely is): one non-blocking read. True when the kernel cannot say."""
        if self._whole is not None:
            return True
        cached = _last_byte_cached(self.fd, self.size)
        return True if cached is None else cached

    def read_exact(self, view: memoryview, offset: int) -> None:
        """Fill `view` from `offset` (finishing short reads); BlobError if the file ends early."""
        _preadv_all(self.fd, [view], offset, self.path)

    def tokens(self) -> np.ndarray:
        """The record's token ids (the entry `blobformat.token_span` names), checked."""
        info = self.layout.infos.get("tokens")
        entry = {"tokens": {"dtype": info[0], "shape": info[1], "data_offsets": info[2:]}} if info else {}
        token_span(entry, self.path)
        return self.array("tokens")

    def array(self, name: str) -> np.ndarray:
        """One whole tensor as numpy (bfloat16 as its uint16 bits), checked."""
        info = self.layout.infos.get(name)
        if info is None:
            raise BlobError(f"{self.path}: no tensor {name!r}")
        tag, shape, start, end = info
        out = np.empty(shape, dtype=DTYPES[tag])
        view = memoryview(out.reshape(-1).view(np.uint8))
        if self._whole is not None:  # 0.1 blob: already read and checked
            self._copy_whole([view], self.base + start)
            return out
        _preadv_all(self.fd, [view], self.base + start, self.path)
        if xxhash.xxh3_64_intdigest(view) != self.checksums[name]:
            raise BlobError(f"{self.path}: tensor {name!r} does not match its checksum")
        return out

    def read_copies(self, copies: Sequence, targets: Mapping[str, Target]) -> None:
        """Several tensors' token ranges at once: each copy `(name, lo, hi, dst)` puts tokens
        [lo, hi) of tensor `name` at tokens [dst, dst + hi - lo) of `targets[name]`, a C-contiguous
        (B, H, capacity, ...) array. Tensors that follow each other in the file are read with one
        `preadv`; each is checked against its own checksum. BlobError names the first bad one.

        The buffers and checks are worked out once per layout and `copies` object (the restore
        passes the same tuple for every record of a cached plan) and target shapes."""
        plan = self._read_plan(copies, targets)
        flats = [targets[name].flat for name in plan.names]
        scratch = memoryview(bytearray(plan.scratch)) if plan.scratch else None
        for start, nbytes, buffers, checks in plan.batches:
            views = [flats[t][a:b] if t >= 0 else scratch[a:b] for t, a, b in buffers]
            if self._whole is not None:  # 0.1 blob: already read and checked
                self._copy_whole(views, self.base + start)
                continue
            _preadv_all(self.fd, views, self.base + start, self.path, nbytes)
            for name, i, j, join in checks:
                if j - i == 1:
                    got = xxhash.xxh3_64_intdigest(views[i])
                elif join:
                    got = xxhash.xxh3_64_intdigest(b"".join(views[i:j]))
                else:
                    digest = xxhash.xxh3_64()
                    for v in views[i:j]:
                        digest.update(v)
                    got = digest.intdigest()
                if got != self.checksums[name]:
                    raise BlobError(f"{self.path}: tensor {name!r} does not match its checksum")

    def _read_plan(self, copies: Sequence, targets: Mapping[str, Target]) -> ReadPlan:
        reads = self.layout.reads
        hit = reads.get(id(copies))
        if hit is not None and hit[0] is copies and all(targets[n].array.shape == s for n, s in hit[1]):
            return hit[2]
        plan = read_plan(self.layout, copies, targets, self.path)
        if len(reads) >= _READS_MAX:
            reads.clear()
        reads[id(copies)] = (copies, [(n, targets[n].array.shape) for n in plan.names], plan)
        return plan

    def _copy_whole(self, views: list[memoryview], start: int) -> None:
        """Fill `views` in order from offset `start` of a 0.1 blob held whole in memory."""
        whole = memoryview(self._whole)
        for v in views:
            v[:] = whole[start : start + len(v)]
            start += len(v)



def in_memory(buf, h: bytes, where: str) -> BlobFile:
    """A blob of record `h` held whole in memory, every tensor checked already (a download, see
    `remote.objects.check_object`): read from there, with nothing checked again."""
    view = memoryview(buf)
    if len(view) < 8:
        raise BlobError(f"{where}: {len(view)} bytes, no blob")
    (n,) = struct.unpack_from("<Q", view, 0)
    header = _header(bytes(view[: min(len(view), 8 + n)]), where, len(view))
    return BlobFile(-1, where, len(view), header, h, None, whole=view)


def open_blob(root: Path, h: bytes, *, size: int, checksum: int | None = None) -> BlobFile:
    """Open the blob of record `h` for reading, checked against its row's `size` (and, for a blob
    written by 0.1, `checksum`). Never follows a link, never blocks on a FIFO: anything that is
    not a regular file of that size is damage (BlobError).

    A header is parsed once: a file opened again (same device, inode and size) whose header
    bytes are unchanged (same length and xxh3_128) reuses the parse."""
    path = blob_file(root, h)
    if type(size) is not int or not 0 <= size <= MAX_BLOB_BYTES or (checksum is not None and type(checksum) is not int):
        raise BlobError(f"{path}: the index says {size!r:.40} bytes, which no blob has")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError as e:
        raise BlobError(f"{path}: missing") from e
    except OSError as e:  # ELOOP: a symbolic link planted in its place
        raise BlobError(f"{path}: cannot open ({e.strerror or e})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BlobError(f"{path}: not a regular file")
        if st.st_size != size:
            raise BlobError(f"{path}: {st.st_size} bytes on disk, the index says {size}")
        key = (st.st_dev, st.st_ino, size)
        with _CACHE_LOCK:
            known = _HEADERS.get(key)
        header = None
        if known is not None:
            head = os.pread(fd, known.length, 0)
            if len(head) == known.length and xxhash.xxh3_128_intdigest(head) == known.digest:
                header = known
        if header is None:
            header = _header(read_head(fd, size), path, size)
        with _CACHE_LOCK:
            _HEADERS[key] = header
            _HEADERS.move_to_end(key)
            while len(_HEADERS) > _HEADERS_MAX:
                _HEADERS.popitem(last=False)
        return BlobFile(fd, path, size, header, h, checksum)
    except OSError as e:
        os.close(fd)
        raise BlobError(f"{path}: cannot read ({e.strerror or e})") from e
    except BaseException:
        os.close(fd)
        raise


def prefetch(root: Path, hashes: Sequence[bytes]) -> None:
    """Ask the kernel to start reading these blobs now and to read them ahead as sequential
    files, so the reads that follow overlap with the disk instead of waiting on it one file
    at a time: first every file's header (opening them waits for those), then the rest.
    Best effort. Nothing is asked when the last and the first file are in the page cache
    already (the last of a chain is the least shared, the first to be evicted): opening every
    file of a 32k-token prompt only to hear that it is cached cost about 4 ms."""
    if not hasattr(os, "posix_fadvise") or not hashes:
        return
    if all(_cached(root, h) for h in {hashes[-1], hashes[0]}):
        return
    fds = []
    try:
        for h in hashes:
            try:
                fd = os.open(blob_file(root, h), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            fds.append(fd)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    os.posix_fadvise(fd, 0, HEAD_GUESS, os.POSIX_FADV_WILLNEED)
                else:
                    fds.pop()
                    os.close(fd)
            except OSError:
                pass
        for fd in fds:
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
    finally:
        for fd in fds:
            os.close(fd)


def _cached(root: Path, h: bytes) -> bool:
    """Whether the last byte of record `h`'s blob is in the page cache (False if unknown)."""
    try:
        fd = os.open(blob_file(root, h), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return bool(_last_byte_cached(fd, os.fstat(fd).st_size))
    except OSError:
        return False
    finally:
        os.close(fd)


def _last_byte_cached(fd: int, size: int) -> bool | None:
    """Whether the last byte of an open file of `size` bytes is in the page cache: one
    non-blocking read. None when the kernel cannot say (or the file is empty)."""
    if not size or not hasattr(os, "RWF_NOWAIT"):
        return None
    try:
        os.preadv(fd, [bytearray(1)], size - 1, os.RWF_NOWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _preadv_all(fd: int, views: list[memoryview], offset: int, path: Path, want: int = -1) -> int:
    """Fill `views` in order from `offset`, finishing short reads. Returns the bytes read.
    `want`: their total length, when the caller knows it (saves a pass over them)."""
    if want < 0:
        views = [v for v in views if len(v)]
        want = sum(map(len, views))
    try:
        n = os.preadv(fd, views[:IOV_BATCH], offset) if views else 0
        if n == want:
            return want
        done, i = 0, 0
        while True:  # a short read (or more buffers than one call takes): go on where it stopped
            done += n
            if done >= want:
                return want
            if n == 0:
                raise BlobError(f"{path}: short read (the file ends early)")
            views = list(views)
            while i < len(views) and n >= len(views[i]):
                n -= len(views[i])
                i += 1
            if n:
                views[i] = views[i][n:]
            n = os.preadv(fd, views[i : i + IOV_BATCH], offset + done)
    except OSError as e:
        raise BlobError(f"{path}: cannot read ({e.strerror or e})") from e



def read_file(path: Path, limit: int = MAX_BLOB_BYTES) -> bytearray:
    """The bytes of a blob-named regular file, its size checked before it is read."""
    try:
        fd = open_regular(path)
    except OSError as e:
        raise BlobError(f"{path}: cannot read ({e.strerror or e})") from e
    with open(fd, "rb", buffering=0) as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise BlobError(f"{path}: {size} bytes, larger than any blob kvstore writes ({limit})")
        buf = bytearray(size)
        try:
            got = f.readinto(buf)
        except OSError as e:
            raise BlobError(f"{path}: cannot read ({e.strerror or e})") from e
    if got != size:
        raise BlobError(f"{path}: short read ({got} of {size} bytes)")
    return buf


def peek_metadata(path: Path) -> dict[str, str] | None:
    """The header metadata of a blob-named file, reading only its header; None if it has none
    that parses (a regular file only, never a link or a FIFO)."""
    try:
        fd = open_regular(path)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        return parse(read_head(fd, size), path, size)[2]
    except (OSError, BlobError):
        return None
    finally:
        os.close(fd)

