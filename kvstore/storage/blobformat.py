"""The blob file format: one safetensors file per record, and the one reader of its header.

A blob is a safetensors file: an 8-byte header length, a JSON header (tensor table and string
`__metadata__`), then the tensors' bytes. Blob format 2 also puts in the metadata a
`"blob_format": "2"` and `"checksums"`: a JSON object (as a string) of every tensor's name
(`tokens` included) -> the 16-hex-digit xxh3_64 of its raw bytes, so each tensor can be checked on
its own, in any order, on any thread. Blobs written by 0.1 have no `checksums` and are checked by
the whole-file checksum their index row keeps.

`read_record` is the one reader of what a record's blob states: the record its header names, its
token ids and its tensor entries (the disk tier reads the same token entry from a file,
`token_span`). Fields later added to the header go through one extension point: a name
registered here (`register_extension`, with a validator of its text) is stored in the metadata as
`x-<name>` and checked by every reader; blobs without such fields are as they always were.

Knows bytes and numpy dtypes; no files, no SQL, no mlx.
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Callable, Mapping, NamedTuple

import numpy as np
import xxhash

from kvstore import canary, keys, tenants, trust
from kvstore.errors import BlobError
from kvstore.records import RecordId

HEADER_LIMIT = 100 << 20  # safetensors' own cap on header size
HEAD_GUESS = 64 << 10  # first read of a blob: its whole header, as a rule
_HEX16 = re.compile(r"[0-9a-f]{16}")
# No record kvstore writes comes near this (a 256-token chunk of a 405B model is ~130 MB): a
# blob-named file larger than this is refused before a byte of it is read.
MAX_BLOB_BYTES = 4 << 30
_MAX_DIM = 1 << 40  # bounds every dimension so that no product of them overflows int64
BLOB_FORMAT = "2"  # `blob_format` in the metadata of every blob written now; 0.1 wrote none
# Tensor data in a blob file starts on this many bytes (every tensor whose size is a multiple of it).
# The kernel's copy out of the page cache runs at full speed only when source and destination are
# aligned alike (bench/copy_alignment.py on an AMD EPYC: up to 1.6 times as long misaligned), so
# a restore into buffers that start on a page or a cache line (mlx's Metal buffers) copies
# aligned. mlx-cpu's buffers start 8 bytes past malloc's, at no fixed offset within 64 bytes.
ALIGN = 64

#: safetensors dtype tag -> the numpy dtype that carries its bytes (bfloat16 as uint16 bits)
DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "BOOL": np.dtype("?"),
}
TAG_OF_NUMPY = {npd: tag for tag, npd in DTYPES.items() if tag != "BF16"}

Tensor = tuple[str, np.ndarray]  # (safetensors dtype tag, bytes carried as numpy)


class Entry(NamedTuple):
    """A tensor of a record, as the restore plans it: safetensors dtype tag and shape."""

    tag: str
    shape: tuple[int, ...]


def nbytes(e: Entry) -> int:
    """The bytes of a tensor of this tag and shape."""
    n = DTYPES[e.tag].itemsize
    for d in e.shape:
        n *= d
    return n


def encode(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> tuple[bytes, list[np.ndarray]]:
    """The safetensors header and the contiguous payload pieces, in file order.

    The header is padded with spaces so that the data starts on `ALIGN` bytes, and tensors whose
    size is a multiple of `ALIGN` come first (in the order given; the others after them), so that
    each of them starts on `ALIGN` bytes too. Readers find tensors by the header's offsets."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    pieces: list[np.ndarray] = []
    offset = 0
    order = sorted(tensors.items(), key=lambda kv: kv[1][1].nbytes % ALIGN != 0)
    for name, (tag, arr) in order:
        data = np.ascontiguousarray(arr)
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        pieces.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # the data starts on ALIGN bytes
    return struct.pack("<Q", len(raw)) + raw, pieces



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



def parse_header(buf: bytes | bytearray, where: object = "blob", *,
                 size: int | None = None) -> tuple[dict[str, dict], int]:
    """The tensor entries of a safetensors header, checked against the buffer; and data start.

    `size`: the file's size, when `buf` holds only its first bytes (at least the whole header).
    """
    header, base, _ = parse(buf, where, size)
    return header, base


def parse(buf, where: object = "blob", size: int | None = None) -> tuple[dict[str, dict], int, dict[str, str]]:
    """Entries, data start and metadata of a safetensors header, from one JSON parse, every entry
    checked (a known dtype, plain int dimensions, offsets that fit the file). BlobError if not."""
    total = len(buf) if size is None else size
    if len(buf) < 8 or total < 8:
        raise BlobError(f"{where}: too short to be a safetensors file")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > min(HEADER_LIMIT, total - 8, len(buf) - 8):
        raise BlobError(f"{where}: header length {n} is impossible")
    header = _header_json(buf, n, where)
    meta = header.pop("__metadata__", None) or {}
    if not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise BlobError(f"{where}: header metadata is not a map of strings")
    base, payload = 8 + n, total - 8 - n
    for name, info in header.items():
        if not _good_entry(info, payload):
            raise BlobError(f"{where}: tensor {name!r} has a bad header entry")
    meta = {str(k): str(v) for k, v in meta.items()}
    extensions(meta, where)  # a registered field that is not valid is damage, as a bad entry is
    return header, base, meta


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
    if not isinstance(tag, str) or tag not in DTYPES:
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
    return 0 <= start <= end <= payload and end - start == count * DTYPES[tag].itemsize


def restamp(buf: bytes | bytearray | memoryview, metadata: Mapping[str, str], where: object = "blob") -> bytes:
    """The blob in `buf` with its header metadata replaced by `metadata`: the same tensor table
    and tensor bytes (offsets count from the data start, which stays on `ALIGN` bytes), so every
    tensor checksum still holds. BlobError if `buf` is not a safetensors file."""
    entries, base, _ = parse(buf, where)
    header: dict[str, object] = {"__metadata__": dict(metadata), **entries}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw + bytes(memoryview(buf)[base:])


#: Header fields that are the writing node's own: its local model path (`model_id`) and its
#: trust tag (a MAC under its keys). They stay out of what leaves it (packs, the bucket).
LOCAL_FIELDS = ("model_id", trust.HEADER_KEY)


def portable(metadata: Mapping[str, str]) -> dict[str, str]:
    """`metadata` without the writing node's own fields (`LOCAL_FIELDS`)."""
    return {k: v for k, v in metadata.items() if k not in LOCAL_FIELDS}


def header_metadata(buf: bytes | bytearray) -> dict[str, str]:
    """The `__metadata__` strings of a header (call `parse_header` first: this trusts it)."""
    (n,) = struct.unpack_from("<Q", buf, 0)
    meta = _header_json(buf, n, "blob").get("__metadata__") or {}
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}



def read_head(fd: int, size: int) -> bytes:
    """The header bytes of an open file of `size` bytes (the length, the JSON, and often a little
    more): one read as a rule, two for a header over `HEAD_GUESS`. `parse_header` checks them."""
    head = os.pread(fd, min(size, HEAD_GUESS), 0)
    if len(head) >= 8:
        (n,) = struct.unpack_from("<Q", head, 0)
        if len(head) < 8 + n <= min(size, HEADER_LIMIT + 8):
            head += os.pread(fd, 8 + n - len(head), len(head))
    return head


# -- fields later added to the header: one namespace, one registry ---------------------------

EXTENSION_PREFIX = "x-"
_EXTENSION_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
#: name -> validator of its text (raises ValueError if it is not valid; returns the value)
_EXTENSIONS: dict[str, Callable[[str], object]] = {}


def register_extension(name: str, validate: Callable[[str], object]) -> None:
    """Let blobs carry the field `name` (stored as `x-<name>` in the metadata). Every reader of a
    header checks it with `validate`; an `x-` field no one registered is kept and not read."""
    if not _EXTENSION_NAME.fullmatch(name):
        raise ValueError(f"a blob header extension is named by [a-z][a-z0-9_]*, got {name!r}")
    if _EXTENSIONS.get(name, validate) is not validate:
        raise ValueError(f"the blob header extension {name!r} is registered already")
    _EXTENSIONS[name] = validate


# A record's canary (`kvstore.canary`): the top of the logits one step gave from its K/V.
register_extension("canary", canary.parse)
# A tenant's record states its tenant's tag and the link its key hashes (`kvstore.tenants`).
register_extension(tenants.TAG_FIELD, tenants.parse_tag)
register_extension(tenants.LINK_FIELD, tenants.parse_link)
# A salted tenant's record states the tag of the tenant whose quota it shares (`tenants.owner_id`).
register_extension(tenants.OWNER_FIELD, tenants.parse_tag)
# The node's MAC over the header and its checksums (`kvstore.trust`): what decides its uploads.
register_extension(trust.FIELD, trust.parse_tag)


def trust_table(entries: Mapping[str, dict], sums: Mapping[str, object]) -> dict[str, tuple[str, list, int]]:
    """What a header's trust tag covers of its tensors (`kvstore.trust`): name -> (dtype, shape,
    checksum as an int), from its entries and its checksums (hex text or ints)."""
    return {name: (info["dtype"], info["shape"], int(sums[name], 16) if isinstance(sums[name], str) else sums[name])
            for name, info in entries.items()}


def with_extensions(metadata: Mapping[str, str], fields: Mapping[str, str]) -> dict[str, str]:
    """`metadata` with these registered extension fields added, each checked first."""
    out = dict(metadata)
    for name, text in fields.items():
        if name not in _EXTENSIONS:
            raise ValueError(f"no blob header extension {name!r} is registered")
        _EXTENSIONS[name](text)
        out[EXTENSION_PREFIX + name] = text
    return out


def extensions(metadata: Mapping[str, str], where: object = "blob") -> dict[str, object]:
    """The registered extension fields a header holds, validated: name -> value. BlobError if one
    is not valid."""
    out = {}
    for key, text in metadata.items():
        name = key[len(EXTENSION_PREFIX):] if key.startswith(EXTENSION_PREFIX) else None
        if name in _EXTENSIONS:
            try:
                out[name] = _EXTENSIONS[name](text)
            except (ValueError, TypeError) as e:
                raise BlobError(f"{where}: its header field {key!r} is not valid ({e})") from e
    return out


# -- a record's blob: the one reader of what it states ---------------------------------------

def token_span(entries: Mapping[str, dict], where: object = "blob") -> tuple[int, int]:
    """Where a record's token ids lie, from the data start: a 1-D int32 tensor `tokens`."""
    info = entries.get("tokens")
    if info is None or info["dtype"] != "I32" or len(info["shape"]) != 1:
        raise BlobError(f"{where}: no int32 token ids")
    start, end = info["data_offsets"]
    return start, end


def meta_field(metadata: Mapping[str, str], name: str, parse: Callable[[str], object], where: object = "blob"):
    """A metadata field, parsed; BlobError if it is missing or `parse` refuses it."""
    try:
        return parse(metadata[name])
    except (KeyError, ValueError) as e:
        raise BlobError(f"{where}: metadata field {name!r} is missing or bad") from e


def hash16(text: str) -> bytes:
    """A record or namespace hash from its hex (ValueError unless it is 16 bytes)."""
    b = bytes.fromhex(text)
    if len(b) != keys.HASH_BYTES:
        raise ValueError(text)
    return b


class StoredRecord(NamedTuple):
    """A record's blob as `read_record` reads it: token ids (a view of the buffer), tensor entries
    (name -> dtype, shape, data_offsets), metadata; `identity` is the record its header names."""

    tokens: np.ndarray
    entries: dict[str, dict]
    metadata: dict[str, str]
    where: object

    @property
    def identity(self) -> RecordId:
        """The record the header names (BlobError if a field is missing or bad), its tenant's
        too: compare it with what the record was asked for as, with `records.check`."""
        meta, where = self.metadata, self.where
        try:
            tenant, link = tenants.stated(meta)
        except ValueError as e:
            raise BlobError(f"{where}: its tenant fields are not valid ({e})") from None
        return RecordId(meta_field(meta, "hash", hash16, where), meta_field(meta, "ns", hash16, where),
                        meta_field(meta, "parent", hash16, where), meta_field(meta, "depth", int, where),
                        meta_field(meta, "kind", int, where), len(self.tokens), keys.first_token(self.tokens),
                        tenant=tenant, link=link)

    @property
    def extensions(self) -> dict[str, object]:
        return extensions(self.metadata, self.where)


def read_record(buf: bytes | bytearray | memoryview, where: object = "blob") -> StoredRecord:
    """The one reader of a whole record's blob in memory: its header checked (entries, metadata,
    extension fields) and its token ids. BlobError if it is not a blob of a record."""
    entries, base, metadata = parse(buf, where)
    start, end = token_span(entries, where)
    tokens = np.frombuffer(buf, dtype="<i4", count=(end - start) // 4, offset=base + start)
    return StoredRecord(tokens, entries, metadata, where)

