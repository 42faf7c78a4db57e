"""What a remote object must be before a node uses it, and how a verified one is stored locally.

An object is a record's blob file, byte for byte (blob format 2: a checksum per tensor). It is
used only if it is intact, its header names the place in the chain it is fetched for, and its
tokens hash to its own key, which for a chunk of a prompt means they are the prompt's tokens.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from kvstore import keys
from kvstore.errors import BlobError
from kvstore.keys import checkpoint_hash
from kvstore.storage import blobformat, blobwrite
from kvstore.storage.index import CHUNK, TAIL


def check_object(buf: bytes, h: bytes) -> tuple[dict, dict[str, str]]:
    """The header entries and metadata of an intact format-2 blob named `h`; BlobError if the
    bytes are damaged, are not that record, or have no per-tensor checksums (0.1 blobs)."""
    entries, meta = blobformat.verify_bytes(buf, h)
    if meta.get("blob_format") != "2" or not meta.get("checksums"):
        raise BlobError(f"record {h.hex()}: blob format {meta.get('blob_format')!r} has no tensor checksums")
    if meta.get("hash") != h.hex():
        raise BlobError(f"record {h.hex()}: its header names record {meta.get('hash')!r}")
    return entries, meta


def check_record(buf: bytes, h: bytes, ns: bytes, parent: bytes, depth: int | None, kind: int,
                 chunk_size: int) -> bytes:
    """Raise BlobError unless `buf` is record `h` at that place of the chain: intact, its header
    agreeing, and its tokens hashing to `h` (so they are the prompt's own). Its tokens' bytes."""
    entries, meta = check_object(buf, h)
    want = {"ns": ns.hex(), "parent": parent.hex(), "kind": str(kind), "chunk_size": str(chunk_size)}
    if depth is not None:
        want["depth"] = str(depth)
    for key, value in want.items():
        if meta.get(key) != value:
            raise BlobError(f"record {h.hex()}: its header says {key} {meta.get(key)!r}, expected {value!r}")
    info = entries.get("tokens")
    if not info or info.get("dtype") != "I32":
        raise BlobError(f"record {h.hex()}: it holds no int32 tokens")
    (n,) = struct.unpack_from("<Q", buf, 0)
    start, stop = (8 + n + o for o in info["data_offsets"])
    tokens = bytes(buf[start:stop])
    ntok = len(tokens) // 4
    if kind == CHUNK:
        ok = ntok == chunk_size and keys.chain(parent, np.frombuffer(tokens, "<i4"), chunk_size) == [h]
    elif kind == TAIL:
        ok = 0 < ntok < chunk_size and keys.tail_hash(parent, np.frombuffer(tokens, "<i4")) == h
    else:
        ok = ntok == 0 and checkpoint_hash(parent) == h
    if not ok:
        raise BlobError(f"record {h.hex()}: its tokens do not hash to its key")
    return tokens


def write_blob(root: Path, h: bytes, buf: bytes, *, fsync: bool = True) -> None:
    """Put verified bytes at the blob's path the way `blobwrite.write` does (temporary file, fsync,
    atomic rename, fsync of the folder)."""
    blobwrite.write_bytes(root, h, buf, fsync=fsync)
