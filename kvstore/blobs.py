"""Blob files: one safetensors file per record, at `blobs/ab/cd/<hash>.safetensors`.

Knows files and bytes, no SQL. A blob is written to a temporary file in its final folder, fsynced
and renamed into place, so a reader sees either nothing or the whole file. The checksum is xxh3_64
of the whole file; every read checks it, and the header's own hash, before any array is made.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import time
from pathlib import Path
from typing import Iterator, Mapping

import mlx.core as mx
import numpy as np
import xxhash

from .errors import BlobError

SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp."
_HEADER_LIMIT = 100 << 20  # safetensors' own cap on header size

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

Tensor = tuple[str, np.ndarray]  # (safetensors dtype tag, bytes carried as numpy)


def tag_of(dtype: mx.Dtype) -> str:
    """The safetensors dtype tag of an mlx dtype."""
    tag = _TAG_OF_MX.get(dtype)
    if tag is None:
        raise BlobError(f"cannot store arrays of dtype {dtype}")
    return tag


def host_bits(a: mx.array) -> tuple[mx.array, mx.Dtype | None]:
    """`a` in a dtype numpy can hold, as a lazy zero-copy view, and the dtype to view it back as.

    bfloat16 has no numpy dtype, so it travels as uint16 and is tagged BF16: bits stay exact.
    """
    tag_of(a.dtype)
    if a.dtype == mx.bfloat16:
        return a.view(mx.uint16), mx.bfloat16
    return a, None


def blob_path(root: Path, h: bytes) -> Path:
    name = h.hex()
    return root / name[:2] / name[2:4] / (name + SUFFIX)


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


def write(root: Path, h: bytes, tensors: Mapping[str, Tensor], metadata: Mapping[str, str],
          *, fsync: bool = True) -> tuple[int, int]:
    """Write a blob atomically. Returns (size in bytes, checksum). Raises OSError (ENOSPC...)."""
    path = blob_path(root, h)
    _makedirs(path.parent)
    head, pieces = encode(tensors, metadata)
    digest = xxhash.xxh3_64(head)
    tmp = path.parent / f"{TMP_PREFIX}{h.hex()}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            _write_all(f, head)
            for piece in pieces:
                view = memoryview(piece).cast("B")
                digest.update(view)
                _write_all(f, view)
            size = f.tell()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return size, digest.intdigest()


def read(root: Path, h: bytes, *, size: int, checksum: int) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Read and check a blob; its arrays and metadata. Any damage raises BlobError."""
    path = blob_path(root, h)
    try:
        with open(path, "rb", buffering=0) as f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                raise BlobError(f"{path}: {actual} bytes on disk, the index says {size}")
            buf = bytearray(size)
            got = f.readinto(buf)
    except FileNotFoundError as e:
        raise BlobError(f"{path}: missing") from e
    except OSError as e:
        raise BlobError(f"{path}: cannot read ({e})") from e
    if got != size:
        raise BlobError(f"{path}: short read ({got} of {size} bytes)")
    if xxhash.xxh3_64_intdigest(buf) != checksum:
        raise BlobError(f"{path}: checksum mismatch")
    arrays, metadata = decode(buf, path)
    if metadata.get("hash") != h.hex():
        raise BlobError(f"{path}: its header names record {metadata.get('hash')!r}")
    return arrays, metadata


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


def parse_header(buf: bytes | bytearray, where: object = "blob") -> tuple[dict[str, dict], int]:
    """The tensor entries of a safetensors header, checked against the buffer; and data start."""
    if len(buf) < 8:
        raise BlobError(f"{where}: too short to be a safetensors file")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > min(_HEADER_LIMIT, len(buf) - 8):
        raise BlobError(f"{where}: header length {n} is impossible")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BlobError(f"{where}: header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise BlobError(f"{where}: header is not an object")
    header.pop("__metadata__", None)
    base, payload = 8 + n, len(buf) - 8 - n
    for name, info in header.items():
        try:
            tag, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            itemsize = _DTYPES[tag][0].itemsize
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            ok = 0 <= start <= end <= payload and end - start == count * itemsize
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise BlobError(f"{where}: tensor {name!r} has a bad header entry")
    return header, base


def header_metadata(buf: bytes | bytearray) -> dict[str, str]:
    (n,) = struct.unpack_from("<Q", buf, 0)
    meta = json.loads(bytes(buf[8 : 8 + n])).get("__metadata__") or {}
    return {str(k): str(v) for k, v in meta.items()}


def read_unchecked(path: Path) -> tuple[dict[str, mx.array], dict[str, str], int, int]:
    """Read a blob with no index row to compare with (verify, rebuild): arrays, meta, size, sum."""
    try:
        buf = path.read_bytes()
    except OSError as e:
        raise BlobError(f"{path}: cannot read ({e})") from e
    arrays, meta = decode(buf, path)
    return arrays, meta, len(buf), xxhash.xxh3_64_intdigest(buf)


def remove(root: Path, h: bytes) -> None:
    try:
        os.unlink(blob_path(root, h))
    except FileNotFoundError:
        pass


def walk(root: Path) -> Iterator[Path]:
    """Every file under the blob tree (blobs, temporaries and anything foreign)."""
    if not root.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames:
            yield Path(dirpath) / name


def hash_of(path: Path) -> bytes | None:
    """The record hash a blob file is named for, or None if the name is not a blob's."""
    name = path.name
    if not name.endswith(SUFFIX) or len(name) != 32 + len(SUFFIX):
        return None
    try:
        h = bytes.fromhex(name[:32])
    except ValueError:
        return None
    return h if path.parent.name == name[2:4] and path.parent.parent.name == name[:2] else None


def stale_temp(path: Path, min_age_s: float = 3600.0) -> bool:
    """A temporary file left by a writer that is gone (dead pid) or is very old."""
    if not path.name.startswith(TMP_PREFIX):
        return False
    parts = path.name.split(".")
    try:
        pid = int(parts[3])
        os.kill(pid, 0)
        alive = True
    except (IndexError, ValueError, ProcessLookupError):
        alive = False
    except PermissionError:
        alive = True
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return False
    return not alive or age > min_age_s


def _makedirs(path: Path) -> None:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError as e:
        raise OSError(errno.ENOTDIR, f"{path} exists and is not a folder") from e


def _write_all(f, data) -> None:
    view = memoryview(data)
    while view:
        n = f.write(view)
        view = view[n:]
