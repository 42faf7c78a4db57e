"""Importing a pack into a store: every check first (`packs.verify`), then the records, as any
record that comes from elsewhere is stored (`DiskTier.put`: blob, fsynced, then its row), then
their pins.

The checks run against the store opened read-only (or, where there is no store yet, a store in
RAM with the same settings), so a pack that is refused leaves the store exactly as it was: not
even the model version is recorded in it. Only then is the store opened to write.

A blob is stored with this store's own `model_id` in its header (the pack carries none), as the
writer would have written it; its tensors and their checksums are the pack's. Its trust tag is the
store's, or, in a fleet node's store opened without its remote, the fleet's (`_fleet_trust`).
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvstore.errors import BlobError, PackError, WrongKeyError
from kvstore.model.fingerprint import resolve_model_dir
from kvstore.packs import identity
from kvstore.packs.verify import Target, Verified, acting_disk_kv_bits, verify
from kvstore.remote.seal import KEY_ENV, fleet_keys
from kvstore.sizes import format_size
from kvstore.storage import blobformat
from kvstore.storage.index import Index, Row
from kvstore.storage.storedir import INDEX_NAME, is_absent
from kvstore.store import MEMORY, Store
from kvstore.trust import Trust
from kvstore.upkeep.anchors import REMOTE_SINCE, Anchors
from kvstore.upkeep.evict import role_class
from kvstore.upkeep.verify import check_blob


@dataclass
class Imported:
    """What an import did: the check (`verified`), records stored now and already stored, their
    bytes on disk, records pinned, and how many of the pack's records were pinned before it."""

    verified: Verified
    stored: int
    present: int
    bytes: int
    pinned: int
    pinned_before: int = 0  # (an earlier import's pins, kept whether or not this one pins)
    evicted: int = 0  # records of the pack gc took off the disk again at once (--no-pin, a small max_bytes)
    healed: int = 0  # of `stored`: records the store held damaged, quarantined and stored again from the pack


def memory_bound() -> int:
    """The most blob bytes an import holds in memory while it checks them: half of RAM."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        return 8 << 30


def import_pack(folder: Path, path: Path, model, model_id: str, tokenizer, *, trust_key: Path | None = None,
                replay: bool = True, pin: bool = True, **options) -> Imported:
    """Check the pack in `folder` for `model` (an mlx-lm model loaded from `model_id`, with its
    `tokenizer`) and store its records in the store at `path` (opened with `options`, as
    `kvstore.open` takes them), pinned unless `pin=False`. PackError, with the store unchanged,
    if any check fails."""
    model_dir = resolve_model_dir(str(model_id))
    with _checking(Path(path), options) as store:
        fleet = _fleet_trust(store, options)  # (refused here, before the pack is read, without the secret)
        # The model's files are hashed once (or not at all, where the store's memo holds them):
        # their SHA-256s and, from the same reads, the fingerprint the store binds the model with.
        ident = identity.identity(model_dir, tokenizer, identity.memo_of(store, remember=False))
        mc = store.bind(model, model_id, fingerprint=ident.fingerprint)
        target = Target(mc, model_dir, tokenizer, acting_disk_kv_bits(mc.layout, store.disk_kv_bits), ident)
        verified = verify(folder, target, trust_key=trust_key, replay_canaries=replay, max_bytes=memory_bound())
    with Store(path, **options) as store:
        if store.read_only:
            raise PackError(f"the store {store.path} is read-only here: nothing imported")
        memo = identity.memo_of(store, remember=True)
        if memo is not None:  # then the bind finds the files' digests in the memo, and reads none
            identity.remember(memo, ident.fresh)
        mc = store.bind(model, model_id)
        if mc.ns != target.mc.ns or not mc.registered:
            raise PackError("the store changed while the pack was checked, or its index cannot be written "
                            "now (full disk, busy): nothing imported")
        return _store(store, mc, verified, pin, fleet)


def _fleet_trust(store: Store, options: dict) -> Trust | None:
    """The fleet's keys to tag the records with, when the store has joined a fleet (it has been
    opened with a remote tier) but is not opened with it now: its records must carry the fleet's
    tags, or the node quarantines them when it reads them with the remote. None when the store's
    own trust does. PackError (nothing imported) without the fleet secret, or with another one."""
    if options.get("remote") or store.files is None or not store.index.marks(REMOTE_SINCE):
        return None
    if options.get("remote_key") is None and not os.environ.get(KEY_ENV):
        raise PackError(f"the store {store.path} is a fleet node's (it has been used with a remote tier), so "
                        f"its records must carry the fleet's trust tags: give the fleet secret (--remote-key-file "
                        f"or {KEY_ENV}): nothing imported")
    trust = store.files.trust(fleet_keys(options.get("remote_key")))
    if trust.mismatch is not None:
        raise PackError(f"{trust.mismatch}: nothing imported")
    return trust


def _checking(path: Path, options: dict) -> Store:
    """The store at `path` opened read-only to check a pack against, or a RAM-only store with the
    same settings where there is no store yet."""
    options = {k: v for k, v in options.items() if k not in ("remote", "remote_key")}
    if is_absent(path):
        return Store(MEMORY, **options)
    index = path / INDEX_NAME
    if index.is_file() and os.access(index, os.W_OK):  # an older kvstore's index is upgraded first,
        Index(index).close()  # as any open to write does: read-only, it could not be read
    return Store(path, read_only=True, create=False, **options)


def _store(store: Store, mc, verified: Verified, pin: bool, fleet: Trust | None) -> Imported:
    """Store the checked records, parents first (a row never hangs under one that is not there),
    tagged with the store's trust or (`fleet`) the fleet's keys."""
    role = role_class("user")  # as a warmed prompt: evicted after assistant-only records
    stored = present = nbytes = 0
    hashes = [c.span.hash for c in verified.records]
    pinned_before = sum(1 for r in store.index.rows_of(hashes).values() if r.pinned)
    healed = _damaged_copies(store, mc, hashes, fleet)  # (the pack's checked copy replaces each)
    for c in verified.records:
        s = c.span
        blob = blobformat.restamp(c.blob, dict(c.metadata, model_id=mc.model_id))
        row = Row(s.hash, s.ns, s.parent, s.depth, s.kind, s.ntokens, s.first_token, len(blob),
                  xxhash.xxh3_64_intdigest(blob), pinned=int(pin), role=role)
        try:
            put = store.disk.put(row, blob, fsync=True, explicit=True, trust=fleet)
        except (OSError, sqlite3.Error) as e:  # a full disk, most often: say what did land
            raise PackError(_cut_short(store, e, stored, nbytes, present, len(hashes), pin)) from e
        if put:
            stored += 1
            nbytes += len(blob)
        else:
            present += 1
    pinned = store.index.pin(hashes) if pin else 0
    if store.disk.budget is not None:  # gc keeps the disk within max_bytes as records land: unpinned, they may go
        store.disk.budget.settle()
    evicted = len(hashes) - len(store.index.rows_of(hashes))
    return Imported(verified, stored, present, nbytes, pinned, pinned_before, evicted, healed)


def _damaged_copies(store: Store, mc, hashes: list[bytes], fleet: Trust | None) -> int:
    """Quarantine the store's copies of the pack's records that do not read (a flipped byte, a
    record changed after it was written), as a restore would on first use; how many. Each is then
    stored again from the pack, not counted as stored already: the first request after the import
    restores the whole prompt."""
    disk = store.disk
    anchors = Anchors(fleet, store.index, disk.root) if fleet is not None else disk.anchors
    damaged = 0
    for h, row in store.index.rows_of(hashes).items():
        if row.bad:
            continue
        try:
            check_blob(disk.root, row, mc.chunk_size, trust=anchors.trust if anchors is not None else None,
                       epoch=anchors.epoch if anchors is not None else 0.0)
        except WrongKeyError:  # (a tag that is not this secret's proves no damage: kept as it is)
            continue
        except BlobError as e:
            disk.damaged(h, e, row)
            damaged += 1
    return damaged


def _cut_short(store: Store, e: BaseException, stored: int, nbytes: int, present: int, total: int, pin: bool) -> str:
    """What an import that failed part way left in the store: the records stored before the
    failure stay (each with its parents, so each restores), the rest are not imported."""
    what = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    kept = (f"the {stored} stored before it ({format_size(nbytes)}) stay{'s' if stored == 1 else ''}"
            f"{', pinned' if pin else ''}" if stored else "none of its records was stored")
    already = f" ({present} {'was' if present == 1 else 'were'} stored already)" if present else ""
    rest = total - stored - present
    return (f"the import stopped at record {stored + present + 1} of {total} ({what}): {kept}{already}, "
            f"the other {rest} {'is' if rest == 1 else 'are'} not imported; free some space on the disk of "
            f"{store.path} and import the pack again (what is stored is not written twice)")
