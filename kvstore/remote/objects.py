"""What a downloaded object must be before a node uses it.

An object is a record's blob file, byte for byte (blob format 2: a checksum per tensor). It is
used only if it is intact (every tensor matches its checksum) and it is the record it is fetched
as (`records.check`: its header names that place in the chain, and its tokens hash to its key,
which for a chunk of a prompt means they are the prompt's own tokens).
"""

from __future__ import annotations

import numpy as np

from kvstore import records
from kvstore.errors import BlobError
from kvstore.records import RecordId
from kvstore.remote.seal import Sealer
from kvstore.storage import blobformat


def check_object(buf: bytes, h: bytes, where: object = "blob") -> tuple[dict, dict[str, str]]:
    """The header entries and metadata of an intact format-2 blob named `h`; BlobError (naming it
    as `where`) if the bytes are damaged, are not that record, or have no per-tensor checksums
    (0.1 blobs)."""
    entries, meta = blobformat.verify_bytes(buf, h, where)
    if meta.get("blob_format") != "2" or not meta.get("checksums"):
        raise BlobError(f"record {h.hex()}: blob format {meta.get('blob_format')!r} has no tensor checksums")
    return entries, meta


def check_record(buf: bytes, rid: RecordId, chunk_size: int) -> np.ndarray:
    """Raise BlobError unless `buf` is record `rid`, intact; its token ids."""
    where = f"record {rid.hash.hex()}"
    check_object(buf, rid.hash, where)
    stored = blobformat.read_record(buf, where)
    records.check(rid, stored.metadata, stored.tokens, chunk_size=chunk_size, where=where)
    return stored.tokens


def open_record(s: Sealer, key: str, body, rid: RecordId, chunk_size: int, *,
                named: bool = False) -> tuple[bytes, np.ndarray, RecordId]:
    """(plaintext, token ids, record) of the sealed object at `key`, fetched as `rid`; BlobError
    (`seal.Unauthenticated` if it does not open) unless it is that record, intact. `named`: only
    the record's name is known (`rid.hash` holds it): its hash is the one its header states,
    which must be what the name is of."""
    plain = s.open(key, body)
    tokens, rid = check_opened(s, plain, rid, chunk_size, named=named)
    return plain, tokens, rid


def check_opened(s: Sealer, plain: bytes, rid: RecordId, chunk_size: int, *,
                 named: bool = False) -> tuple[np.ndarray, RecordId]:
    """(token ids, record) of an object already opened (see `open_record`)."""
    if named:
        rid = named_record(s, plain, rid)
    return check_record(plain, rid, chunk_size), rid


def named_record(s: Sealer, plain: bytes, rid: RecordId) -> RecordId:
    """`rid` with the hash the object's header states, if its name is of that hash."""
    try:
        h = bytes.fromhex(blobformat.header_metadata(plain).get("hash", ""))
    except Exception as e:  # garbage of any shape
        raise BlobError(f"its header names no record ({e})") from e
    if len(h) != 16 or s.name(h) != rid.hash.hex():
        raise BlobError("its header names another record than its key")
    return RecordId(h, rid.ns, rid.parent, rid.depth, rid.kind, rid.ntokens, rid.first_token, **rid.owner())
