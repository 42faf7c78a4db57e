"""Records: what every layer calls a stored chunk, tail or checkpoint, and how a prompt maps to them.

`RecordId` is a record's identity (its key, namespace, parent, depth, kind and tokens); index
rows, queued writes, records in RAM and remote object keys are all `RecordId`s with more fields.
`prompt_records` is the one place that turns a prompt into the records that store it, and
`check` the one check that stored bytes are the record they claim to be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from kvstore import keys
from kvstore.errors import BlobError

CHUNK, TAIL, CHECKPOINT = 0, 1, 2
KIND_NAMES = {CHUNK: "chunk", TAIL: "tail", CHECKPOINT: "checkpoint"}


@dataclass(slots=True)
class RecordId:
    """Which record: its key, and its place in a namespace's tree of chains.

    A chunk's or tail's `hash` is xxh3_128 of its parent and its token ids, so the key proves the
    tokens; a checkpoint's is made from the record it ends (`parent`) and holds no tokens.
    `depth` is the position in the chain (1 under the namespace; a checkpoint shares its
    record's); None where only a key was seen (an object key does not say how deep it is).

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


@dataclass(slots=True)
class Span(RecordId):
    """A record of one prompt: its identity and where its tokens start in the prompt (a
    checkpoint's span is empty, at the end of the record it follows)."""

    start: int = 0
    nbytes: int = 0  # the bytes it will take, when known

    @property
    def end(self) -> int:
        return self.start + self.ntokens


def prompt_records(ns: bytes, tokens: np.ndarray, chunk_size: int, *, tail: bool = True,
                   checkpoint: bool = False) -> list[Span]:
    """The records that store `tokens`, parents first: a chunk for every full chunk, then (with
    `tail`) a tail for what follows the last one, then (with `checkpoint`) the checkpoint at the
    end. The one place a prompt becomes record keys."""
    toks = np.asarray(tokens)
    C = chunk_size
    chain = keys.chain(ns, toks, C)
    firsts = toks[: len(chain) * C : C].tolist()
    parents = [ns, *chain[:-1]]
    out = [Span(h, ns, parents[i], i + 1, CHUNK, C, firsts[i], i * C) for i, h in enumerate(chain)]
    if tail and len(toks) % C:
        parent = chain[-1] if chain else ns
        rest = toks[len(chain) * C :]
        out.append(Span(keys.tail_hash(parent, rest), ns, parent, len(chain) + 1, TAIL, len(rest),
                        int(rest[0]), start=len(chain) * C))
    if checkpoint and out:
        last = out[-1]
        out.append(checkpoint_of(last))
    return out


def checkpoint_of(record: Span) -> Span:
    """The checkpoint taken at the end of `record`."""
    return Span(keys.checkpoint_hash(record.hash), record.ns, record.hash, record.depth, CHECKPOINT, 0,
                None, start=record.end)


def check(rid: RecordId, metadata: Mapping[str, str], tokens: np.ndarray, *, chunk_size: int | None = None,
          where: object = "record") -> None:
    """Raise BlobError unless stored bytes are record `rid`: their header names it (hash,
    namespace, parent, kind, and depth and chunk size where known), their token count fits its
    kind, and its key is the hash of its parent and these tokens (so they are the prompt's own).

    Every reader of stored records goes through this: the disk tier, the remote tier, `verify`
    and the index rebuild."""
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
    if not keys.is_address(rid.hash, rid.parent, rid.kind, tokens):
        raise BlobError(f"{where}: its token ids are not those of record {rid.hash.hex()}")
