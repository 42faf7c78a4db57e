"""A store directory as maintenance sees it: its index and blob tree, and what needs no model.

`LocalStore` opens (or creates) the directory, checks that it is a store, and answers `stats`,
`gc` and `verify` from the index and the files alone: no mlx is imported, so `kvstore stats`,
`kvstore gc` and `kvstore verify` start fast. A serving `Store` holds one and adds the tiers, the
writer and the models on top.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sqlite3
import stat
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Sequence

from kvstore import settings
from kvstore.errors import InvalidInputError, StoreOpenError
from kvstore.storage import blobtree, schema
from kvstore.storage.index import Index, is_corruption
from kvstore.storage.stale import status_of_copies as model_status
from kvstore.storage.storedir import (
    BLOBS_NAME,
    INDEX_NAME,
    PINS_NAME,
    QUARANTINE_NAME,
    disk_full,
    full_disk_open,
    open_dir,
    trust_key,
)
from kvstore.trust import Trust
from kvstore.upkeep.anchors import check_keys

log = logging.getLogger("kvstore")

#: max_bytes="auto": 1/AUTO_SHARE of (what the store holds + the disk's free space)
AUTO_SHARE = 4


class LocalStore:
    """The index and blob tree of one store directory.

    `create=False` opens only an existing store; `read_only=True` never writes to it;
    `read_only=None` is read-only exactly when this user may not write the store. Refuses a
    folder that is not a store, symbolic links among its own entries, and a lost index (a new,
    empty one would orphan every blob).
    """

    def __init__(self, path: Path, *, create: bool = True, read_only: bool | None = False):
        for name, flag, allowed in (("create", create, (True, False)), ("read_only", read_only, (True, False, None))):
            if not any(flag is a for a in allowed):  # "no" is true: a store opened the opposite way
                raise InvalidInputError(f"{name}: give {' or '.join(map(str, allowed))}, not {flag!r:.30}")
        self.path, self.read_only = open_dir(Path(path), create=create, read_only=read_only)
        self.blob_root = self.path / BLOBS_NAME
        index_file = self.path / INDEX_NAME
        if not self.read_only:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
            os.close(os.open(index_file, flags, 0o600))
        try:
            self.index = Index(index_file, read_only=self.read_only)
        except StoreOpenError as e:  # a full disk: SQLite cannot make the index's -wal and -shm
            if self.read_only or not disk_full(self.path):
                raise
            with full_disk_open(self.path, e):
                self.index = Index(index_file, read_only=True)
            self.read_only = True
        if not self.read_only:  # the index's writes queue behind gc on the blob tree's lock
            self.index.write_gate = functools.partial(blobtree.write_turn, self.blob_root)
            self.index.pins_file = self.path / PINS_NAME  # kept for a rebuild of the index
            try:  # a new store, or one from before these copies
                self.index.keep_pins_file(missing_only=True)
                self.index.keep_settings_copy(missing_only=True)
            except (sqlite3.Error, OSError):
                pass  # only copies: a damaged index says so where it is used
        self.gc_lock = threading.Lock()  # one gc at a time in this process (the writer's budget too)

    def close(self) -> None:
        self.index.close()

    def __enter__(self) -> "LocalStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_writable(self, what: str) -> None:
        if self.read_only:
            raise StoreOpenError(f"the store {self.path} is open read-only: {what} needs to write "
                                 "to it (open it as a user who may write it)")

    @contextmanager
    def damage_is_an_error(self):
        """A damaged index found after open is a `CorruptIndexError` that says how to rebuild it."""
        try:
            yield
        except sqlite3.DatabaseError as e:
            if is_corruption(e):
                raise self.index.corrupt(e) from e
            raise

    def check_pages(self, *, whole: bool = True) -> None:
        """SQLite's own check of the index (`PRAGMA integrity_check`): a damaged page can read as
        rows of NULLs, as a table with no rows (stats said "models: 0"), or fail only the queries
        that reach it, so reading every row is not enough. `whole=False` checks the small tables
        only (models, totals, meta...: milliseconds at any size), for stats and gc. Either way,
        every table, index and trigger the migrations make must be there. Raises the index's
        `CorruptIndexError`, naming the first damage found; writes nothing."""
        missing = expected_schema() - {(t, n) for t, n in self.index.conn.execute(
            "SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")}
        if missing and not self.index.pending():  # (an older index lacks the newer ones until migrated)
            raise self.index.corrupt("it has no " + ", ".join(f"{n} {t}" for t, n in sorted(missing)))
        tables = [None] if whole else [t for t in SMALL_TABLES if ("table", t) not in missing]
        for table in tables:
            pragma = "PRAGMA integrity_check(3)" if table is None else f"PRAGMA integrity_check('{table}')"
            found = [line for (line,) in self.index.conn.execute(pragma)]
            if found != ["ok"]:
                said = (" ".join(line.replace("*** in database main ***", "").split()) for line in found[:3])
                raise self.index.corrupt("; ".join(said))

    def stats(self) -> dict[str, Any]:
        """What the directory holds: totals, one dict per model version (with whether its files
        changed), quarantined records and the files `verify --repair` moved aside."""
        with self.damage_is_an_error():
            self.check_pages(whole=False)
            out: dict[str, Any] = {"path": str(self.path), **self.index.totals()}
            out["models"] = self.index.models()
            found = self.model_status(rehash=False)  # no hashing here: stats stays fast
            for m in out["models"]:  # not found: bound with a fingerprint, or before files were recorded
                m["stale"], m["stale_reason"] = found.get(bytes.fromhex(m["namespace"]), (None, None))
            out["tenants"] = self.tenants()
            out["quarantined_total"] = self.index.counters().get("count.quarantined", 0)
            n, size = self.index.quarantined()
            out["quarantined_now"] = {"records": n, "bytes": size}
        out["quarantine_folder"] = folder_usage(self.path / QUARANTINE_NAME)
        return out

    def pins(self) -> list[dict]:
        """What is pinned, one dict per model version that has pinned records: `namespace`,
        `fingerprint`, `model_id`, `records`, `bytes`, `tokens` (those its pinned chunks and
        tails hold, shared ones once) and `stale` (as `stats` says it: True, False or None)."""
        with self.damage_is_an_error():
            out = self.index.pins_by_model()
            found = self.model_status(rehash=False)
        for m in out:
            m["stale"] = found.get(bytes.fromhex(m["namespace"]) if m["namespace"] != "?" else b"", (None, None))[0]
        return out

    def gc(self, max_bytes: int | None = None, max_age: float | None = None, dry_run: bool = False,
           stale: bool = False, tenant_max_bytes: int | None = None, drop_tenants: Sequence[str] = ()) -> dict:
        """Evict down to `max_bytes` (and records unused for `max_age` seconds; each tenant down to
        `tenant_max_bytes`; every record of the tenants `drop_tenants` (tags), pinned ones too;
        with `stale`, every record of a model version whose files are gone or
        changed, pinned ones too: the result's `stale_pins` counts those); see `gc.collect`. The
        result's `hashes` are the records evicted."""
        from kvstore.upkeep.gc import collect

        if not dry_run:
            self.check_writable("gc")
        with self.gc_lock, self.damage_is_an_error():
            self.check_pages(whole=False)  # (before anything is written: a damaged index is rebuilt, not written)
            old: set[bytes] = set()
            if stale or (max_bytes is not None and self.over_budget(max_bytes)):
                # Before anything is deleted, a changed file is hashed again: same bytes, not stale.
                found = self.model_status(rehash=True, record=not dry_run and not self.read_only)
                old = {ns for ns, (is_stale, _) in found.items() if is_stale}
            return collect(self.index, self.blob_root, max_bytes=max_bytes, max_age=max_age,
                           stale=stale, stale_namespaces=old, dry_run=dry_run, tenant_max_bytes=tenant_max_bytes,
                           drop_tenants=drop_tenants)

    def model_status(self, *, rehash: bool, record: bool = False) -> dict[bytes, tuple[bool | None, str | None]]:
        """ns -> (stale, why) of every version with recorded files (see `storage.stale.status`).
        `record`: a version whose files changed stamps but not bytes gets its new stamps, and
        digests hashed again are kept in the memo, so neither is hashed again next time."""
        remember = self._remember if record else None
        out = {}
        for ns, files in self.index.model_files().items():
            is_stale, why, now = model_status(files, self._memo, rehash=rehash, remember=remember)
            if record and now is not None and not set(now) <= set(files):  # (its copy's new stamps)
                self.index.record_model_files(ns, now)
            out[ns] = (is_stale, why)
        return out

    def _memo(self, path: Path, st: os.stat_result) -> bytes | None:
        """A memoised digest, for staleness only (it decides what gc keeps, never a namespace)."""
        found = self.index.file_digest(path, st)
        return found[0] if found else None

    def _remember(self, path: Path, st: os.stat_result, digest: bytes) -> None:
        try:
            self.index.remember_file_digest(path, st, digest)
        except sqlite3.OperationalError:  # only a memo (the disk may be full)
            pass

    def verify(self, repair: bool = False, force: bool = False, trust: Trust | None = None) -> list:
        """Problems found (empty when clean); `repair=True` fixes them. See `upkeep.verify`.
        `trust`: the keys blob tags are checked with (else the store's own key, if it has one)."""
        from kvstore.upkeep.verify import verify

        if repair:
            self.check_writable("verify --repair")
        with self.damage_is_an_error():
            self.check_pages()
            return verify(self.index, self.blob_root, repair=repair, force=force, read_only=self.read_only,
                          trust=trust or self.trust(create=False))

    def trust(self, fleet_secrets: list[bytes] | None = None, *, create: bool = True) -> Trust | None:
        """The keys this store tags its trust anchors with (`kvstore.trust`): from the fleet's
        secrets when it has a remote tier (with `mismatch` set if they are not the ones its tags
        were made with: `upkeep.anchors.check_keys`), else from its own key (made now with `create`, if it
        may write; None when it has none yet: then nothing is tagged under one)."""
        if fleet_secrets:  # (a wrong secret is told by the keys the store noted: `Trust.mismatch`)
            own = self.trust(create=False)
            return check_keys(Trust.for_fleet(fleet_secrets), self.index, self.blob_root, own and own.key_id)
        make = create and not self.read_only
        try:
            return Trust.for_store(trust_key(self.path, create=make))
        except StoreOpenError as e:
            if make:
                raise
            log.debug("kvstore: %s", e)
            return None

    def settings(self) -> dict[str, tuple[Any, str]]:
        """Every store setting as an open that gives none would have it: (value, source), from
        the settings the store keeps (a damaged one: the default, with a warning)."""
        return settings.resolve({}, self.index.settings(), warn=lambda m: log.warning("kvstore: %s", m),
                                store=self.index.path.parent)

    def auto_budget(self, now: bool = False) -> tuple[int, str]:
        """`max_bytes="auto"`: a quarter of the space the store could use (what it holds plus its
        disk's free space), at open, and again as a writer's budget checks (`now`: the rule then
        says so; `tiers.disk.DiskBudget`). Unlike "held + a quarter of free", it does not grow
        with every restart, and it shrinks when other files fill the disk."""
        held = self.index.totals()["bytes"]
        free = shutil.disk_usage(self.path).free
        budget = (held + free) // AUTO_SHARE
        when = time.strftime("at %H:%M:%S", time.localtime()) if now else "at open"
        return budget, (f"auto: 1/{AUTO_SHARE} of ({held} bytes held + {free} bytes free on the "
                        f"store's disk {when}) = {budget} bytes")

    def over_budget(self, max_bytes: int | None, tenant_max_bytes: int | None = None) -> bool:
        """Whether the store holds more than `max_bytes`, or a tenant (with the tenants that share
        its quota, `Index.tenant_owners`) more than `tenant_max_bytes`."""
        return ((max_bytes is not None and self.index.totals()["bytes"] > max_bytes)
                or (tenant_max_bytes is not None and bool(self.index.tenants_over(tenant_max_bytes))))

    def tenants(self) -> list[dict]:
        """One dict per tenant that has records: its `tenant` tag, `records` and `bytes`, and for
        a tenant that shares another's quota (a cache_salt's tenant), that one's tag, `owner`."""
        with self.damage_is_an_error():
            owners = self.index.tenant_owners()
            return [{"tenant": tag, "records": n, "bytes": size, **({"owner": owners[tag]} if tag in owners else {})}
                    for tag, (n, size) in self.index.tenant_totals().items()]


#: The tables `check_pages(whole=False)` checks: each a few rows per model, tenant or setting.
SMALL_TABLES = ("schema_migrations", "meta", "models", "totals", "tenant_totals", "model_files")


@functools.cache
def expected_schema() -> frozenset[tuple[str, str]]:
    """(type, name) of every table, index and trigger the migrations make, as SQLite names them
    after running them all on an empty index in memory (once per process)."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    try:
        schema.migrate(conn, Path(":memory:"))
        return frozenset(conn.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
    finally:
        conn.close()


def folder_usage(folder: Path) -> dict[str, int]:
    """{"files", "bytes"} of the regular files under a folder (no link is followed)."""
    files = size = 0
    if folder.is_symlink():
        return {"files": 0, "bytes": 0}
    for top, _, names in os.walk(folder):
        for name in names:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            files += 1
            size += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return {"files": files, "bytes": size}
