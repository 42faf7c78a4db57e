"""Object keys of the remote tier: where each record, manifest and pins object lives in the bucket.

Layout under `s3://BUCKET/PREFIX/` (every name is a MAC under the fleet secret, 32 or 16 hex
digits, see `remote.seal`; `pp` is the first two digits of `parent`):

    <ns>/manifest                                   model fingerprint, layout, geometry (no path)
    <ns>/<pp>/<parent>/<branch>/<record>.chunk.<n>.<marks>  a chunk: n == chunk size tokens
    <ns>/<pp>/<parent>/<branch>/<record>.tail.<n>.<marks>   a tail of n tokens
    <ns>/<pp>/<record>/ckpt/<checkpoint>.ckpt       the checkpoint at the end of <record>
    <ns>/pins/<node>                                what one node has pinned
    keys/<marker>                                   a key of the fleet of this prefix (`Fleet.marker_name`)

A tenant's record is `.tchunk.<n>`, `.ttail.<n>` or `.tckpt` (sealed with its tenant's key, its
`<branch>` named with its tenant's salt: `remote.seal.TenantSealer`): a listing tells that it is
some tenant's, never whose.

`<ns>` names the namespace, `<parent>` and `<record>` chain hashes (a root chunk's parent is
named `<ns>`), `<branch>` the pair (parent, first token). `<marks>` says how far a record's
tokens go along a prompt without giving them: a 4-hex-digit MAC of each prefix of its tokens at
the lengths `mark_lengths` gives (2, 3, 4, 6, 8, 12, 16, 24... below n), so a node that lists a
folder of children compares each with its prompt from the names alone, and downloads only the
one worth it (none at all when the local store holds it). A node that knows the prompt computes
every key: a HEAD finds a chunk, one listing of `<ns>/<pp>/<parent>/<branch>/` finds every child of
a chunk that starts with the next token, a checkpoint hangs under its record. The key names the
parent of every object, so gc keeps the tree whole from a listing alone. A key counts only if it
has exactly this shape: anything longer is under another team's prefix, and left alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kvstore.records import CHECKPOINT, CHUNK, TAIL, RecordId
from kvstore.remote.seal import MARK_HEX, Sealer

LAYOUT_VERSION = "kvstore-remote-3"
_KIND_NAMES = {CHUNK: "chunk", TAIL: "tail", CHECKPOINT: "ckpt"}
_KINDS = {v: k for k, v in _KIND_NAMES.items()}
TENANT_MARK = "t"  # before a tenant's record's kind name
_NAME = re.compile(r"[0-9a-f]{32}")
_BRANCH = re.compile(r"[0-9a-f]{16}")
_RECORD = re.compile(r"([0-9a-f]{32})\.(t?)(chunk|tail)\.([1-9][0-9]{0,8})(?:\.(?:[0-9a-f]{4}){0,64})?")
_CKPT = re.compile(r"([0-9a-f]{32})\.(t?)ckpt")


@dataclass(slots=True)
class ObjectKey(RecordId):
    """A record object as a listing shows it: its names (in place of the hashes: `hash`,
    `ns`, `parent`), its branch, where it is, its size and when it was last written."""

    path: str = ""
    size: int = 0
    modified: float = 0.0
    branch: str = ""
    owned: bool = False  # a tenant's (sealed with a key only that tenant's nodes derive)
    marks: tuple[str, ...] | None = None  # of its tokens at `mark_lengths(ntokens)`; None: not said (layout 2)


def mark_lengths(n: int) -> list[int]:
    """The prefix lengths a record of `n` tokens is marked at: 2, 3, 4, 6, 8, 12, 16, 24...
    below `n` (a step of at most half: a node knows how far a child goes along its prompt to
    within a third of it; 14 marks for a 256-token chunk)."""
    out, p = [], 2
    while p < n:
        out.append(p)
        if p * 3 // 2 < n:
            out.append(p * 3 // 2)
        p *= 2
    return out


def manifest_key(folder: str) -> str:
    return f"{folder}/manifest"


#: The folder of the fleet's key markers (`remote.health.KeyCheck`); no namespace is named so.
MARKERS = "keys/"


def marker_key(name: str) -> str:
    return f"{MARKERS}{name}"


def pins_key(folder: str, node: str) -> str:
    return f"{folder}/pins/{node}"


def children_prefix(s: Sealer, parent: bytes, first_token: int) -> str:
    """The folder of `parent`'s chunks and tails that start with `first_token`."""
    p = s.name(parent)
    return f"{s.folder}/{p[:2]}/{p}/{s.children(parent, first_token)}/"


def key_of(s: Sealer, r: RecordId, tokens: np.ndarray | None = None) -> str:
    """The object key of a record (a tenant's record: with its tenant's sealer); a chunk's or a
    tail's is made from its `tokens` too (its marks)."""
    if (r.tenant is not None) != s.owned:
        raise ValueError("a tenant's record is named by its tenant's sealer, a shared one by the namespace's")
    mark = TENANT_MARK if s.owned else ""
    if r.kind == CHECKPOINT:
        p = s.name(r.parent)
        return f"{s.folder}/{p[:2]}/{p}/ckpt/{s.name(r.hash)}.{mark}ckpt"
    if r.first_token is None or r.kind not in (CHUNK, TAIL):
        raise ValueError(f"a {r.kind} record needs its first token for its key")
    if tokens is None or len(tokens) != r.ntokens:
        raise ValueError(f"the key of a {_KIND_NAMES[r.kind]} of {r.ntokens} tokens is made from its tokens")
    marks = "".join(s.marks(r.parent, tokens, mark_lengths(r.ntokens)))
    return (f"{children_prefix(s, r.parent, r.first_token)}{s.name(r.hash)}.{mark}{_KIND_NAMES[r.kind]}."
            f"{int(r.ntokens)}.{marks}")


def parse_key(path: str, size: int = 0, modified: float = 0.0) -> ObjectKey | None:
    """The record an object key names (by names, not hashes), or None if it is not a record's
    key of exactly this layout (manifest, pins, a nested prefix's object, anything foreign)."""
    parts = path.split("/")
    if len(parts) != 5:
        return None
    ns_name, pp, parent_name, branch, name = parts
    if not (_NAME.fullmatch(ns_name) and _NAME.fullmatch(parent_name) and pp == parent_name[:2]):
        return None
    ns, parent = bytes.fromhex(ns_name), bytes.fromhex(parent_name)
    if branch == "ckpt":
        m = _CKPT.fullmatch(name)
        if m is None:
            return None
        return ObjectKey(bytes.fromhex(m[1]), ns, parent, None, CHECKPOINT, 0, None, path=path, size=size,
                         modified=modified, branch=branch, owned=bool(m[2]))
    m = _RECORD.fullmatch(name)
    if m is None or not _BRANCH.fullmatch(branch):
        return None
    n, marks = int(m[4]), None
    if name.count(".") == 3:  # layout 3: its marks, one per length
        text = name.rpartition(".")[2]
        marks = tuple(text[i : i + MARK_HEX] for i in range(0, len(text), MARK_HEX))
        if len(marks) != len(mark_lengths(n)):
            return None
    return ObjectKey(bytes.fromhex(m[1]), ns, parent, None, _KINDS[m[3]], n, None, path=path, size=size,
                     modified=modified, branch=branch, owned=bool(m[2]), marks=marks)


def parse_other(path: str) -> tuple[str, str] | None:
    """("manifest", ns name) or ("pins", ns name) for those keys of exactly this layout."""
    parts = path.split("/")
    if len(parts) == 2 and parts[1] == "manifest" and _NAME.fullmatch(parts[0]):
        return "manifest", parts[0]
    if len(parts) == 3 and parts[1] == "pins" and _NAME.fullmatch(parts[0]) and _NAME.fullmatch(parts[2]):
        return "pins", parts[0]
    return None
