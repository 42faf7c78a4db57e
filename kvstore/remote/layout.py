"""Object keys of the remote tier: where each record, manifest and pins object lives in the bucket.

Layout under `s3://BUCKET/PREFIX/` (hashes in hex; `pp` is the first two hex digits of `parent`):

    <ns>/manifest.json                                 model fingerprint, layout, model id
    <ns>/<pp>/<parent>/<first token>/<hash>.chunk.<n>  a chunk: n == chunk size tokens
    <ns>/<pp>/<parent>/<first token>/<hash>.tail.<n>   a tail of n tokens
    <ns>/<pp>/<record>/ckpt/<hash>.ckpt                the checkpoint at the end of <record>
    <ns>/pins/<node>.json                              what one node has pinned

Every key is computed from the chain: a chunk's parent and first token are known from the prompt,
so a HEAD finds it; one listing of `<ns>/<pp>/<parent>/<token>/` finds every child of a chunk
that starts with the next token; a checkpoint hangs under its record. The key names the parent of
every object, so gc can keep the tree whole from a listing alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.records import CHECKPOINT, CHUNK, TAIL, RecordId

LAYOUT_VERSION = "kvstore-remote-1"
_KIND_NAMES = {CHUNK: "chunk", TAIL: "tail", CHECKPOINT: "ckpt"}
_KINDS = {v: k for k, v in _KIND_NAMES.items()}


@dataclass(slots=True)
class ObjectKey(RecordId):
    """A record object as a listing shows it: what its key says (no depth), where it is, its
    size and when it was last written."""

    path: str = ""
    size: int = 0
    modified: float = 0.0


def manifest_key(ns: bytes) -> str:
    return f"{ns.hex()}/manifest.json"


def pins_key(ns: bytes, node: str) -> str:
    return f"{ns.hex()}/pins/{node}.json"


def children_prefix(ns: bytes, parent: bytes, first_token: int) -> str:
    """The folder of `parent`'s chunks and tails that start with `first_token`."""
    p = parent.hex()
    return f"{ns.hex()}/{p[:2]}/{p}/{int(first_token)}/"


def key_of(r: RecordId) -> str:
    """The object key of a record."""
    p = r.parent.hex()
    if r.kind == CHECKPOINT:
        return f"{r.ns.hex()}/{p[:2]}/{p}/ckpt/{r.hash.hex()}.ckpt"
    if r.first_token is None or r.kind not in (CHUNK, TAIL):
        raise ValueError(f"a {r.kind} record needs its first token for its key")
    return f"{children_prefix(r.ns, r.parent, r.first_token)}{r.hash.hex()}.{_KIND_NAMES[r.kind]}.{int(r.ntokens)}"


def parse_key(path: str, size: int = 0, modified: float = 0.0) -> ObjectKey | None:
    """The record an object key names, or None if it is not a record's key (manifest, pins,
    anything foreign)."""
    parts = path.split("/")
    if len(parts) < 5:
        return None
    ns_hex, pp, parent_hex, folder, name = parts[-5:]
    try:
        ns, parent = bytes.fromhex(ns_hex), bytes.fromhex(parent_hex)
        pieces = name.split(".")
        h = bytes.fromhex(pieces[0])
    except ValueError:
        return None
    if len(ns) != 16 or len(parent) != 16 or len(h) != 16 or pp != parent_hex[:2]:
        return None
    if folder == "ckpt":
        if pieces[1:] != ["ckpt"]:
            return None
        return ObjectKey(h, ns, parent, None, CHECKPOINT, 0, None, path=path, size=size, modified=modified)
    if len(pieces) != 3 or pieces[1] not in ("chunk", "tail") or not folder.isdigit() or not pieces[2].isdigit():
        return None
    return ObjectKey(h, ns, parent, None, _KINDS[pieces[1]], int(pieces[2]), int(folder), path=path, size=size,
                     modified=modified)
