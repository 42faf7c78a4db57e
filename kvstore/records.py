"""Records: what every layer calls a stored chunk, tail or checkpoint, and how a prompt maps to them.

`RecordId` is a record's identity (its key, namespace, parent, depth, kind and tokens); index
rows, queued writes, records in RAM and remote object keys are all `RecordId`s with more fields.
`prompt_records` is the one place that turns a prompt into the records that store it, and
`check` the one check that stored bytes are the record they claim to be.

A record of a tenant (`tenants`) carries the tenant's `tenant` tag; its key hashes its `link` in
place of its parent. `prompt_records` makes a tenant's records from the end of the shared prefix on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from kvstore import keys, tenants
from kvstore.errors import BlobError, TenantMismatchError
from kvstore.tenants import Tenant

CHUNK, TAIL, CHECKPOINT = 0, 1, 2
KIND_NAMES = {CHUNK: "chunk", TAIL: "tail", CHECKPOINT: "checkpoint"}


@dataclass(slots=True)
class RecordId:
    """Which record: its key, and its place in a namespace's tree of chains.

    A chunk's or tail's `hash` is xxh3_128 of its parent and its token ids, so the key proves the
    tokens; a checkpoint's is made from the record it ends (`parent`) and holds no tokens.
    `depth` is the position in the chain (1 under the namespace; a checkpoint shares its
    record's); None where only a key was seen (an object key does not say how deep it is).

    `tenant` is the tag of the tenant whose record it is (None: shared); `link`, where known, is
    what its key hashes in place of its parent (a tenant's chunk or tail; None otherwise).

    Plain slots, not frozen: a lookup makes one per chunk of a prompt (128 at 32k tokens), and
    a frozen dataclass takes four times as long to make.
    """

    hash: bytes
    ns: bytes
    parent: bytes
    depth: int | None
    kind: int
    ntokens: int
    first_token: int | None  # None for a checkpoint
    tenant: str | None = field(default=None, kw_only=True)
    link: bytes | None = field(default=None, kw_only=True)

    def owner(self) -> dict:
        """Its `tenant` and `link`, as keywords for a record made from it."""
        return {"tenant": self.tenant, "link": self.link}


@dataclass(slots=True)
class Span(RecordId):
    """A record of one prompt: its identity and where its tokens start in the prompt (a
    checkpoint's span is empty, at the end of the record it follows)."""

    start: int = 0
    nbytes: int = 0  # the bytes it will take, when known

    @property
    def end(self) -> int:
        return self.start + self.ntokens


@dataclass(frozen=True)
class SizeBound:
    """The most bytes a record of one model can be (a remote GET reads no more, verify of the
    bucket calls a larger object not a record): its arrays at its tokens, its token ids, and
    room for its header, twice over. Worked out from the model's shapes; a bucket's manifest
    carries it (`as_dict`) so that a node without the model knows it too."""

    per_token: int  # bytes a chunk or tail holds per token, its token id included
    checkpoint: int  # bytes of a checkpoint's arrays
    tensors: int  # how many tensors a record holds at most

    def __call__(self, kind: int, ntokens: int) -> int:
        arrays = self.checkpoint if kind == CHECKPOINT else self.per_token * ntokens
        return 2 * (arrays + 512 * (self.tensors + 1)) + (1 << 20)

    def as_dict(self) -> dict[str, int]:
        return {"per_token": self.per_token, "checkpoint": self.checkpoint, "tensors": self.tensors}

    @classmethod
    def from_dict(cls, d: object) -> "SizeBound | None":
        """The bound a manifest states, or None if it states none (or nonsense)."""
        try:
            values = [d[k] for k in ("per_token", "checkpoint", "tensors")]  # type: ignore[index]
        except (TypeError, KeyError):
            return None
        if not all(type(v) is int and 0 <= v < 1 << 40 for v in values):
            return None
        return cls(*values)


def prompt_records(ns: bytes, tokens: np.ndarray, chunk_size: int, *, tail: bool = True,
                   checkpoint: bool = False, tenant: Tenant | None = None, shared: int = 0) -> list[Span]:
    """The records that store `tokens`, parents first: a chunk for every full chunk, then (with
    `tail`) a tail for what follows the last one, then (with `checkpoint`) the checkpoint at the
    end. The one place a prompt becomes record keys.

    With a `tenant`, the first `shared` chunks are the shared namespace's (the shared records
    found for this prompt) and every record after them is the tenant's: its key hashes the
    tenant's link of its parent (`keys.chain`). A tail is always the tenant's."""
    toks = np.asarray(tokens)
    C = chunk_size
    full = len(toks) // C
    shared = full if tenant is None else max(0, min(int(shared), full))
    chain = keys.chain(ns, toks[: shared * C], C)
    start = chain[-1] if chain else ns
    if tenant is not None:
        chain += keys.chain(start, toks[shared * C : full * C], C, tenant.link)
    firsts = toks[: full * C : C].tolist()
    parents = [ns, *chain[:-1]]
    out = [Span(h, ns, parents[i], i + 1, CHUNK, C, firsts[i], i * C) for i, h in enumerate(chain)]
    if tenant is not None:
        for s in out[shared:]:
            s.tenant, s.link = tenant.tag, tenant.link(s.parent)
    if tail and len(toks) % C:
        parent = chain[-1] if chain else ns
        rest = toks[full * C :]
        link = tenant.link(parent) if tenant is not None else None
        out.append(Span(keys.tail_hash(link or parent, rest), ns, parent, full + 1, TAIL, len(rest),
                        int(rest[0]), start=full * C, tenant=tenant and tenant.tag, link=link))
    if checkpoint and out:
        last = out[-1]
        out.append(checkpoint_of(last))
    return out


def checkpoint_of(record: Span) -> Span:
    """The checkpoint taken at the end of `record` (its tenant's, as the record is)."""
    return Span(keys.checkpoint_hash(record.hash), record.ns, record.hash, record.depth, CHECKPOINT, 0,
                None, start=record.end, tenant=record.tenant)


def check(rid: RecordId, metadata: Mapping[str, str], tokens: np.ndarray, *, chunk_size: int | None = None,
          where: object = "record") -> None:
    """Raise BlobError unless stored bytes are record `rid`: their header names it (hash,
    namespace, parent, kind, and depth and chunk size where known), their token count fits its
    kind, and its key is the hash of its parent and these tokens (so they are the prompt's own).

    A tenant's record states its tenant (as `rid.tenant` says) and the link its key hashes in
    place of its parent (as `rid.link` says, when the reader knows it); a shared one neither.

    Every reader of stored records goes through this: the disk tier, the remote tier, `verify`
    and the index rebuild."""
    base = _owner_base(rid, metadata, where)
    want = {"hash": rid.hash.hex(), "ns": rid.ns.hex(), "parent": rid.parent.hex(), "kind": str(rid.kind)}
    if rid.depth is not None:
        want["depth"] = str(rid.depth)
    if chunk_size is not None:
        want["chunk_size"] = str(chunk_size)
    for key, value in want.items():
        if metadata.get(key) != value:
            raise BlobError(f"{where}: its header says {key} {metadata.get(key)!r}, expected {value!r}")
    n = len(tokens)
    if n != rid.ntokens:
        raise BlobError(f"{where}: it holds {n} token ids, record {rid.hash.hex()} has {rid.ntokens}")
    if chunk_size is not None:
        fits = {CHUNK: n == chunk_size, TAIL: 0 < n < chunk_size, CHECKPOINT: n == 0}.get(rid.kind, False)
        if not fits:
            raise BlobError(f"{where}: a {KIND_NAMES.get(rid.kind, rid.kind)} cannot hold {n} tokens "
                            f"(chunk size {chunk_size})")
    if not keys.is_address(rid.hash, base, rid.kind, tokens):
        raise BlobError(f"{where}: its token ids are not those of record {rid.hash.hex()}")


def _owner_base(rid: RecordId, metadata: Mapping[str, str], where: object) -> bytes:
    """What the record's key hashes its tokens with (its parent, or its stated link); BlobError if
    its header states another tenant than `rid`'s, or a link where none may be."""
    try:
        tag, link = tenants.stated(metadata)
    except ValueError as e:
        raise BlobError(f"{where}: its tenant fields are not valid ({e})") from None
    if tag != rid.tenant:
        raise TenantMismatchError(f"{where}: its header says tenant {tag or 'none (shared)'}, expected "
                        f"{rid.tenant or 'none (shared)'}")
    if (link is None) != (tag is None or rid.kind == CHECKPOINT):
        what = "a shared record or a checkpoint states a" if link is not None else "a tenant's record states no"
        raise BlobError(f"{where}: {what} link")
    if link is not None and rid.link is not None and link != rid.link:
        raise BlobError(f"{where}: its link is not the one its tenant makes under its parent")
    return rid.parent if link is None else link
