"""Blob files: one safetensors file per record, at `blobs/ab/cd/<hash>.safetensors`.

Knows files and bytes, no SQL. A blob is written to a temporary file in its final folder, fsynced
and renamed into place, so a reader sees either nothing or the whole file. The index row's
`checksum` is xxh3_64 of the whole file; every read checks the header's own hash and sizes before
any array is made.

Blob format 2 also puts in the header's `__metadata__` a `"blob_format": "2"` and `"checksums"`: a
JSON object (as a string) of every tensor's name (`tokens` included) -> the 16-hex-digit xxh3_64 of
its raw bytes, so each tensor can be checked on its own, in any order, on any thread. Blobs written
by 0.1 have no `checksums` and are checked the old way, by the whole-file checksum.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import mlx.core as mx
import numpy as np
import xxhash

from kvstore import faults
from kvstore.storage.blobtree import (  # noqa: F401 -- the tree's names and folders, re-exported for callers of blobs
    SUFFIX,
    TMP_PREFIX,
    hash_of,
    is_temp_name,
    move_entry,
    remove,
    remove_entry,
    stale_temp,
    tree_lock,
    walk,
)
from kvstore.errors import BlobError

_HEADER_LIMIT = 100 << 20  # safetensors' own cap on header size
_HEAD_GUESS = 64 << 10  # first read of a blob: its whole header, as a rule
_IOV_BATCH = 512  # buffers per preadv call (the kernel takes at most IOV_MAX = 1024)
_HEX16 = re.compile(r"[0-9a-f]{16}")
# No record kvstore writes comes near this (a 256-token chunk of a 405B model is ~130 MB): a
# blob-named file larger than this is refused before a byte of it is read.
MAX_BLOB_BYTES = 4 << 30
_MAX_DIM = 1 << 40  # bounds every dimension so that no product of them overflows int64
BLOB_FORMAT = "2"  # `blob_format` in the metadata of every blob written now; 0.1 wrote none

# safetensors dtype tag -> (numpy dtype used to carry the bytes, mlx dtype of the array)
_DTYPES: dict[str, tuple[np.dtype, mx.Dtype]] = {
    "F32": (np.dtype("<f4"), mx.float32),
    "F16": (np.dtype("<f2"), mx.float16),
    "BF16": (np.dtype("<u2"), mx.bfloat16),
    "F64": (np.dtype("<f8"), mx.float64) if hasattr(mx, "float64") else (np.dtype("<f8"), mx.float32),
    "I8": (np.dtype("i1"), mx.int8),
    "U8": (np.dtype("u1"), mx.uint8),
    "I16": (np.dtype("<i2"), mx.int16),
    "U16": (np.dtype("<u2"), mx.uint16),
    "I32": (np.dtype("<i4"), mx.int32),
    "U32": (np.dtype("<u4"), mx.uint32),
    "I64": (np.dtype("<i8"), mx.int64),
    "U64": (np.dtype("<u8"), mx.uint64),
    "BOOL": (np.dtype("?"), mx.bool_),
}
_TAG_OF_MX = {mxd: tag for tag, (_, mxd) in _DTYPES.items() if tag != "F64"}
_TAG_OF_NP = {npd: tag for tag, (npd, _) in _DTYPES.items() if tag != "BF16"}

Tensor = tuple[str, np.ndarray]  # (safetensors dtype tag, bytes carried as numpy)


def tag_of(dtype: mx.Dtype | np.dtype) -> str:
    """The safetensors dtype tag of an mlx dtype (or of a numpy one: bfloat16 travels as uint16
    bits and is tagged by whoever knows it is bfloat16)."""
    tag = _TAG_OF_MX.get(dtype) if isinstance(dtype, mx.Dtype) else _TAG_OF_NP.get(np.dtype(dtype))
    if tag is None:
        raise BlobError(f"cannot store arrays of dtype {dtype}")
    return tag


def mx_dtype(tag: str) -> mx.Dtype:
    """The mlx dtype of a safetensors dtype tag."""
    return _DTYPES[tag][1]


def host_bits(a: mx.array) -> tuple[mx.array, mx.Dtype | None]:
    """`a` in a dtype numpy can hold, as a lazy zero-copy view, and the dtype to view it back as.

    bfloat16 has no numpy dtype, so it travels as uint16 and is tagged BF16: bits stay exact.
    """
    tag_of(a.dtype)
    if a.dtype == mx.bfloat16:
        return a.view(mx.uint16), mx.bfloat16
    return a, None


def host_array(a: mx.array) -> np.ndarray:
    """An mlx array's memory as numpy, no copy (bfloat16 as its uint16 bits): through its buffer,
    since a `view` op would have to be scheduled and waited for (per tensor, per record).
    A numpy array (a record queued by `insert` holds views of the caller's arrays) is itself."""
    if isinstance(a, np.ndarray):
        return a
    if a.dtype == mx.bfloat16:
        m = memoryview(a)
        if m.c_contiguous:
            return np.frombuffer(m.cast("B"), dtype=np.uint16).reshape(a.shape)
        return np.asarray(a.view(mx.uint16))
    return np.asarray(a)


def blob_path(root: Path, h: bytes) -> Path:
    name = h.hex()
    return root / name[:2] / name[2:4] / (name + SUFFIX)


def _blob_file(root: Path | str, h: bytes) -> str:
    """`blob_path` as a string, for the read path (a Path costs microseconds per record)."""
    name = h.hex()
    return f"{os.fspath(root)}/{name[:2]}/{name[2:4]}/{name}{SUFFIX}"


def encode(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> tuple[bytes, list[np.ndarray]]:
    """The safetensors header and the contiguous payload pieces, in file order."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    pieces: list[np.ndarray] = []
    offset = 0
    for name, (tag, arr) in tensors.items():
        data = np.ascontiguousarray(arr)
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        pieces.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keeps every tensor 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, pieces


class Staged(NamedTuple):
    """A blob written to a temporary file of its folder and fsynced, not yet in place."""

    tmp: Path
    path: Path
    size: int
    checksum: int
    fsync: bool


def write(root: Path, h: bytes, tensors: Mapping[str, Tensor], metadata: Mapping[str, str],
          *, fsync: bool = True) -> tuple[int, int]:
    """Write a blob atomically. Returns (size in bytes, checksum). Raises OSError (ENOSPC...)."""
    return place(stage(root, h, tensors, metadata, fsync=fsync))


def stage(root: Path, h: bytes, tensors: Mapping[str, Tensor], metadata: Mapping[str, str],
          *, fsync: bool = True) -> Staged:
    """The first half of `write`: the blob in a temporary file in its folder, fsynced. `place`
    then renames it into place (or `discard` drops it). Raises OSError."""
    path = blob_path(root, h)
    _makedirs(path.parent)
    sums = {name: tensor_checksum(arr) for name, (_, arr) in tensors.items()}
    metadata = dict(metadata, blob_format=BLOB_FORMAT, checksums=json.dumps(sums, separators=(",", ":")))
    head, pieces = encode(tensors, metadata)
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


def tensor_checksum(data) -> str:
    """The 16-hex-digit xxh3_64 of a tensor's raw bytes (C order), as blob format 2 records it."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return xxhash.xxh3_64_hexdigest(data)


def tensor_checksums(metadata: Mapping[str, str], where: object = "blob") -> dict[str, str] | None:
    """The per-tensor checksums a blob's metadata lists, or None for a blob written by 0.1.

    Raises BlobError if the metadata claims format 2 (or has a `checksums` entry) that is unusable.
    """
    raw = metadata.get("checksums")
    if raw is None:
        if metadata.get("blob_format", "1") not in ("1", ""):
            raise BlobError(f"{where}: blob format {metadata.get('blob_format')!r} lists no tensor checksums")
        return None
    try:
        sums = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        raise BlobError(f"{where}: its tensor checksums are not JSON ({e})") from e
    if not isinstance(sums, dict) or not all(isinstance(v, str) and _HEX16.fullmatch(v) for v in sums.values()):
        raise BlobError(f"{where}: its tensor checksums are not a map of 16-hex-digit strings")
    return {str(k): v for k, v in sums.items()}


def verify_bytes(buf: bytes | bytearray | memoryview, h: bytes,
                 where: object = "blob") -> tuple[dict[str, dict], dict[str, str]]:
    """Check a whole blob held in memory (format 2): its header, that it names record `h`, and every
    tensor's checksum. Returns (tensor entries: name -> dtype, shape, data_offsets; metadata);
    the data of a tensor starts at `8 + header length + data_offsets[0]`. Raises BlobError on
    anything wrong, including a blob with no per-tensor checksums (one written by 0.1)."""
    view = memoryview(buf).cast("B")
    header, base = parse_header(view, where)
    try:
        metadata = header_metadata(view)
    except (ValueError, AttributeError) as e:
        raise BlobError(f"{where}: its metadata is not a JSON object ({e})") from e
    if metadata.get("hash") != h.hex():
        raise BlobError(f"{where}: its header names record {metadata.get('hash')!r}, not {h.hex()}")
    sums = tensor_checksums(metadata, where)
    if sums is None:
        raise BlobError(f"{where}: no per-tensor checksums (a blob written before format 2)")
    if set(sums) != set(header):
        raise BlobError(f"{where}: its checksums name {sorted(set(sums) ^ set(header))} "
                        "that are not its tensors, or miss some")
    for name, info in header.items():
        start, end = info["data_offsets"]
        if tensor_checksum(view[base + start : base + end]) != sums[name]:
            raise BlobError(f"{where}: tensor {name!r} does not match its checksum")
    return header, metadata


def read(root: Path, h: bytes, *, size: int, checksum: int) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Read and check a whole blob (verify); its arrays and metadata. Any damage raises BlobError."""
    with open_blob(root, h, size=size) as blob:
        buf = bytearray(size)
        blob.read_exact(memoryview(buf), 0)
    if xxhash.xxh3_64_intdigest(buf) != checksum:
        raise BlobError(f"{blob.path}: checksum mismatch")
    if blob.checksums is not None:
        verify_bytes(buf, h, blob.path)
    arrays, metadata = decode(buf, blob.path)
    return arrays, metadata


class Entry(NamedTuple):
    """A tensor of a record, as the restore plans it: safetensors dtype tag and shape."""

    tag: str
    shape: tuple[int, ...]


class Layout:
    """A blob header's table of tensors (names, dtypes, shapes, offsets from the data start),
    one object shared by every blob that has the same table (every record of one cache shape).
    What is worked out from a table once is kept on it: read plans, by the copies they serve."""

    __slots__ = ("infos", "entries", "deltas", "reads", "__weakref__")

    def __init__(self, infos: dict[str, tuple[str, tuple[int, ...], int, int]]):
        self.infos = infos  # name -> (tag, shape, start, end), offsets from the data start
        self.entries = {name: Entry(tag, shape) for name, (tag, shape, _, _) in infos.items()}
        self.deltas = {name: e for name, e in self.entries.items() if name != "tokens"}
        self.reads: dict[int, tuple] = {}  # id(copies) -> (copies, target shapes, _ReadPlan)


class _Header(NamedTuple):
    digest: int  # xxh3_128 of the header's bytes: a header read again is reused only if unchanged
    length: int  # 8 + the JSON's length
    layout: Layout
    metadata: dict[str, str]
    checksums: dict[str, int] | None  # name -> xxh3_64; None for a blob written by 0.1


class _ReadPlan(NamedTuple):
    """How to read a set of copies from one layout into targets of given shapes: batches of
    (offset from the data start, bytes, buffers as (target index or -1 for scratch, start, end),
    checks as (tensor name, first buffer, end buffer, join small buffers before hashing)),
    the targets' names and the scratch bytes needed (tokens read only to be checked)."""

    batches: list[tuple[int, int, list[tuple[int, int, int]], list[tuple[str, int, int, bool]]]]
    names: list[str]
    scratch: int


_LAYOUTS: dict[tuple, Layout] = {}
_HEADERS: "OrderedDict[tuple[int, int, int], _Header]" = OrderedDict()
_HEADERS_MAX = 4096  # parsed headers kept, a few KiB each (a 32k-token prompt of a 28-layer model: 128)
_CACHE_LOCK = threading.Lock()
_JOIN_BELOW = 16 << 10  # buffers smaller than this are hashed joined: one call beats many
# A batch read in one preadv stops at this size, so that its tensors are hashed while still in
# the CPU's caches (a larger batch is read to memory, then read again from it to be hashed).
_BATCH_BYTES = 256 << 10
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
    entries, base, metadata = _parse(head, path, size)
    sums = tensor_checksums(metadata, path)
    if sums is not None and set(sums) != set(entries):
        raise BlobError(f"{path}: its checksums do not name exactly its tensors")
    metadata.pop("checksums", None)  # kept parsed, as ints: the JSON string is most of a header
    return _Header(xxhash.xxh3_128_intdigest(head[:base]), base, _layout_of(entries), metadata,
                   {name: int(v, 16) for name, v in sums.items()} if sums is not None else None)


class BlobFile:
    """An open blob whose header was read and checked (size, header, the record it names).

    Tensors are read by name, each checked against its own checksum (blob format 2) as it is
    read, so they may be read in any order and on any thread. A blob written by 0.1 (no
    per-tensor checksums) is read whole when opened and checked by `checksum`, the old way.
    """

    def __init__(self, fd: int, path: Path | str, size: int, header: _Header, h: bytes, checksum: int | None):
        self.fd, self.path, self.size = fd, path, size
        self.layout, self.base, self.metadata = header.layout, header.length, header.metadata
        self.entries = self.layout.entries
        if self.metadata.get("hash") != h.hex():
            raise BlobError(f"{path}: its header names record {self.metadata.get('hash')!r}")
        self.checksums = header.checksums
        self._whole: bytearray | None = None
        if self.checksums is None:  # 0.1: no per-tensor sums, so the whole file is checked now
            if checksum is None:
                raise BlobError(f"{path}: a blob without tensor checksums needs its row's checksum")
            self._whole = bytearray(size)
            self.read_exact(memoryview(self._whole), 0)
            if xxhash.xxh3_64_intdigest(self._whole) != checksum:
                raise BlobError(f"{path}: checksum mismatch")

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

    def array(self, name: str) -> np.ndarray:
        """One whole tensor as numpy (bfloat16 as its uint16 bits), checked."""
        info = self.layout.infos.get(name)
        if info is None:
            raise BlobError(f"{self.path}: no tensor {name!r}")
        tag, shape, start, end = info
        out = np.empty(shape, dtype=_DTYPES[tag][0])
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

    def _read_plan(self, copies: Sequence, targets: Mapping[str, Target]) -> _ReadPlan:
        reads = self.layout.reads
        hit = reads.get(id(copies))
        if hit is not None and hit[0] is copies and all(targets[n].array.shape == s for n, s in hit[1]):
            return hit[2]
        plan = _read_plan(self.layout, copies, targets, self.path)
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


def _read_plan(layout: Layout, copies: Sequence, targets: Mapping[str, Target], path: Path) -> _ReadPlan:
    """The buffers (in file order) and checks of `copies`; BlobError if a copy does not fit."""
    todo = []
    for c in copies:
        info = layout.infos.get(c.name)
        if info is None:
            raise BlobError(f"{path}: no tensor {c.name!r}")
        tag, shape, start, end = info
        itemsize = _DTYPES[tag][0].itemsize
        t = targets[c.name].array
        if (len(shape) < 3 or t.ndim != len(shape) or t.dtype.itemsize != itemsize
                or t.shape[:2] != shape[:2] or t.shape[3:] != shape[3:]
                or not 0 <= c.lo <= c.hi <= shape[2] or c.dst < 0 or c.dst + c.hi - c.lo > t.shape[2]):
            raise BlobError(f"{path}: tensor {c.name!r} {list(shape)} has no tokens [{c.lo}, {c.hi}) "
                            f"for a {list(t.shape)} array")
        todo.append((start, end, c, shape, itemsize, t.shape[2]))
    todo.sort(key=lambda x: x[0])
    names: dict[str, int] = {}
    batches: list = []
    buffers: list[tuple[int, int, int]] = []
    checks: list[tuple[str, int, int, bool]] = []
    scratch = 0
    batch_start = batch_end = -1
    for start, end, c, shape, itemsize, cap in todo:
        ti = names.setdefault(c.name, len(names))
        pieces, scratch = _pieces(shape, itemsize, c.lo, c.hi, ti, cap, c.dst, scratch)
        if start != batch_end or len(buffers) + len(pieces) > _IOV_BATCH or end - batch_start > _BATCH_BYTES:
            if buffers:
                batches.append((batch_start, batch_end - batch_start, buffers, checks))
            buffers, checks, batch_start = [], [], start
        small = len(pieces) > 1 and (end - start) < _JOIN_BELOW * len(pieces)
        checks.append((c.name, len(buffers), len(buffers) + len(pieces), small))
        buffers += pieces
        batch_end = end
    if buffers:
        batches.append((batch_start, batch_end - batch_start, buffers, checks))
    return _ReadPlan(batches, list(names), scratch)


def _pieces(shape: tuple[int, ...], itemsize: int, lo: int, hi: int, ti: int, cap: int, dst: int,
            scratch: int) -> tuple[list[tuple[int, int, int]], int]:
    """Buffers in file order for tokens [lo, hi) of a (B, H, T, ...) tensor going to tokens
    [dst, ...) of target `ti`, a flat (B, H, cap, ...) array; scratch (index -1, from byte
    `scratch` on) for the tokens around them. Heads whose tokens follow each other in the
    target (the whole capacity is read) become one buffer. Returns them and the scratch used."""
    row = itemsize * math.prod(shape[3:])
    T, heads = shape[2], shape[0] * shape[1]
    before, after, take = lo * row, (T - hi) * row, (hi - lo) * row
    out: list[tuple[int, int, int]] = []
    if not before and not after and dst == 0 and hi - lo == cap:  # the target is the tensor
        return ([(ti, 0, heads * take)] if take * heads else []), scratch
    for head in range(heads):
        if before:
            out.append((-1, scratch, scratch + before))
            scratch += before
        if take:
            at = (head * cap + dst) * row
            out.append((ti, at, at + take))
        if after:
            out.append((-1, scratch, scratch + after))
            scratch += after
    return out, scratch


class Target(NamedTuple):
    """Memory a read copies tensors into: a C-contiguous (B, H, capacity, ...) array, and the
    same memory as a flat byte view (cut into per-head buffers by arithmetic, not by numpy)."""

    array: np.ndarray
    flat: memoryview


def target(array: np.ndarray) -> Target:
    if not (array.flags.c_contiguous and array.flags.writeable):
        raise ValueError("a read target must be C-contiguous and writable")
    return Target(array, memoryview(array.reshape(-1).view(np.uint8)))


def open_blob(root: Path, h: bytes, *, size: int, checksum: int | None = None) -> BlobFile:
    """Open the blob of record `h` for reading, checked against its row's `size` (and, for a blob
    written by 0.1, `checksum`). Never follows a link, never blocks on a FIFO: anything that is
    not a regular file of that size is damage (BlobError).

    A header is parsed once: a file opened again (same device, inode and size) whose header
    bytes are unchanged (same length and xxh3_128) reuses the parse."""
    path = _blob_file(root, h)
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
            head = os.pread(fd, min(size, _HEAD_GUESS), 0)
            if len(head) >= 8:
                (n,) = struct.unpack_from("<Q", head, 0)
                if len(head) < 8 + n <= min(size, _HEADER_LIMIT + 8):
                    head += os.pread(fd, 8 + n - len(head), len(head))
            header = _header(head, path, size)
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
                fd = os.open(_blob_file(root, h), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            fds.append(fd)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    os.posix_fadvise(fd, 0, _HEAD_GUESS, os.POSIX_FADV_WILLNEED)
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
        fd = os.open(_blob_file(root, h), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
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
        n = os.preadv(fd, views[:_IOV_BATCH], offset) if views else 0
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
            n = os.preadv(fd, views[i : i + _IOV_BATCH], offset + done)
    except OSError as e:
        raise BlobError(f"{path}: cannot read ({e.strerror or e})") from e


def decode(buf: bytes | bytearray, where: object = "blob") -> tuple[dict[str, mx.array], dict[str, str]]:
    """Parse safetensors bytes into mlx arrays (one copy per tensor) and the metadata."""
    header, base = parse_header(buf, where)
    arrays: dict[str, mx.array] = {}
    for name, info in header.items():
        tag, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
        np_dtype, mx_dtype = _DTYPES[tag]
        count = (end - start) // np_dtype.itemsize
        host = np.frombuffer(buf, dtype=np_dtype, count=count, offset=base + start).reshape(shape)
        arr = mx.array(host)
        arrays[name] = arr.view(mx_dtype) if arr.dtype != mx_dtype else arr
    return arrays, header_metadata(buf)


def parse_header(buf: bytes | bytearray, where: object = "blob", *,
                 size: int | None = None) -> tuple[dict[str, dict], int]:
    """The tensor entries of a safetensors header, checked against the buffer; and data start.

    `size`: the file's size, when `buf` holds only its first bytes (at least the whole header).
    """
    header, base, _ = _parse(buf, where, size)
    return header, base


def _parse(buf, where: object, size: int | None) -> tuple[dict[str, dict], int, dict[str, str]]:
    """Entries, data start and metadata of a safetensors header, from one JSON parse."""
    total = len(buf) if size is None else size
    if len(buf) < 8 or total < 8:
        raise BlobError(f"{where}: too short to be a safetensors file")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > min(_HEADER_LIMIT, total - 8, len(buf) - 8):
        raise BlobError(f"{where}: header length {n} is impossible")
    header = _header_json(buf, n, where)
    meta = header.pop("__metadata__", None) or {}
    if not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise BlobError(f"{where}: header metadata is not a map of strings")
    base, payload = 8 + n, total - 8 - n
    for name, info in header.items():
        if not _good_entry(info, payload):
            raise BlobError(f"{where}: tensor {name!r} has a bad header entry")
    return header, base, {str(k): str(v) for k, v in meta.items()}


def _header_json(buf: bytes | bytearray, n: int, where: object) -> dict:
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise BlobError(f"{where}: header is not JSON ({e})") from e  # (or nested too deep)
    if not isinstance(header, dict):
        raise BlobError(f"{where}: header is not an object")
    return header


def _good_entry(info: object, payload: int) -> bool:
    """One tensor entry: a known dtype, a shape and offsets of plain ints that agree."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        return False
    tag, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(tag, str) or tag not in _DTYPES:
        return False

    def plain(v: object) -> bool:  # bool is an int subclass: True is not a dimension
        return type(v) is int and 0 <= v <= _MAX_DIM

    if not isinstance(shape, list) or len(shape) > 8 or not all(plain(d) for d in shape):
        return False
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        return False
    start, end = offsets
    count = 1
    for d in shape:
        count *= d  # Python ints: no overflow; bounded below by the payload check
        if count > payload:
            return False
    return 0 <= start <= end <= payload and end - start == count * _DTYPES[tag][0].itemsize


def header_metadata(buf: bytes | bytearray) -> dict[str, str]:
    """The `__metadata__` strings of a header (call `parse_header` first: this trusts it)."""
    (n,) = struct.unpack_from("<Q", buf, 0)
    meta = _header_json(buf, n, "blob").get("__metadata__") or {}
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def read_unchecked(path: Path) -> tuple[dict[str, mx.array], dict[str, str], int, int]:
    """Read a blob with no index row to compare with (verify, rebuild): arrays, meta, size, sum.

    Never follows a link, never waits on a FIFO, never reads a file larger than any blob."""
    buf = read_file(path)
    arrays, meta = decode(buf, path)
    return arrays, meta, len(buf), xxhash.xxh3_64_intdigest(buf)


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
        head = os.pread(fd, min(size, _HEAD_GUESS), 0)
        if len(head) >= 8:
            (n,) = struct.unpack_from("<Q", head, 0)
            if len(head) < 8 + n <= min(size, _HEADER_LIMIT + 8):
                head += os.pread(fd, 8 + n - len(head), len(head))
        parse_header(head, path, size=size)
        return header_metadata(head)
    except (OSError, BlobError, struct.error):
        return None
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
