"""The store, and the one place everything is built and wired: `kvstore.open`.

A `Store` is a store directory (`upkeep.local.LocalStore`: the index and the blob tree), the
tiers a lookup asks in order (memory, pending writes, local disk, and a remote bucket when one is
given), the background writer, and the models bound to it (`ModelCache`s). Each part is given
what it works with and holds no reference to the store or to any layer above its own. The events
that leave the parts are wired here, once (`Store._wire`).

`fetch` never raises for anything that went wrong on disk or remotely: a bad record is
quarantined and the caller gets the longest prefix that is still correct.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import difflib
import inspect
import logging
import os
import sqlite3
import weakref
from typing import TYPE_CHECKING, Any, Sequence

from kvstore import keys, settings, tenants
from kvstore.errors import InvalidInputError, check_flags
from kvstore.events import config as events_config
from kvstore.model import fingerprint as fingerprints
from kvstore.model.backing import Backing
from kvstore.model.cache import ModelCache
from kvstore.model.layout import describe, make_template
from kvstore.model.lookup import Tiers
from kvstore.remote.bucket import check_url, open_bucket
from kvstore.remote.node import Remote, say_unused
from kvstore.remote.seal import Fleet, fleet_keys
from kvstore.restore import buffers, selfcheck
from kvstore.storage.storedir import store_dir, tenant_key
from kvstore.tenants import Tenant
from kvstore.tiers.disk import DiskBudget, DiskTier, evict
from kvstore.tiers.memory import MemoryTier, MemoryTierView
from kvstore.tiers.remote import RemoteTier
from kvstore.upkeep.local import LocalStore
from kvstore.write import budget as write_budget
from kvstore.write.admission import Gate
from kvstore.write.pending import PendingTier
from kvstore.write.writer import Writer

if TYPE_CHECKING:
    from kvstore.certify import Report

log = logging.getLogger("kvstore")

MEMORY = ":memory:"
DEFAULT_MEMORY_BYTES = settings.BY_NAME["memory_bytes"].default
DEFAULT_PENDING_BYTES = settings.BY_NAME["max_pending_bytes"].default
AUTO = settings.AUTO

# Stores still open at interpreter exit get their queued writes flushed (bounded in time).
_OPEN_STORES: "weakref.WeakSet[Store]" = weakref.WeakSet()


@atexit.register
def _flush_open_stores() -> None:
    for store in list(_OPEN_STORES):
        try:
            store.flush(timeout=30)  # the uploads get their own bound within it, never the disk's
        except Exception:
            pass


class Store:
    """A prompt-cache store in one directory (or in RAM only, with `path=kvstore.MEMORY`).

    `create=False` opens only an existing store (nothing is created); `read_only=True` never
    writes to it (fetch and stats work, inserts are skipped and counted, gc and repair refuse);
    `read_only=None` is read-only exactly when this user may not write the store.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, max_bytes: int | str | None = None,
                 memory_bytes: int | str | None = None, chunk_size: int | None = None,
                 max_pending_bytes: int | str | None = None, fsync: bool = True,
                 create: bool = True, read_only: bool | None = False, remote: str | None = None,
                 remote_prefetch: str | None = None, remote_deadline: float | str | None = None,
                 remote_key: str | bytes | None = None, remote_flush_timeout: float | str | None = None,
                 admit: str | None = None, max_write_rate: int | str | None = None,
                 disk_kv_bits: int | str | None = None, buffer_cache_bytes: int | str | None = None,
                 tenant_max_bytes: int | str | None = None, exact_prefill: int | str | None = None,
                 kv_events: str | dict | None = None, defaults: dict[str, Any] | None = None):
        given = {k: v for k, v in dict(
            max_bytes=max_bytes, memory_bytes=memory_bytes, chunk_size=chunk_size,
            max_pending_bytes=max_pending_bytes, remote_prefetch=remote_prefetch, remote_deadline=remote_deadline,
            remote_flush_timeout=remote_flush_timeout, admit=admit, max_write_rate=max_write_rate,
            disk_kv_bits=disk_kv_bits, buffer_cache_bytes=buffer_cache_bytes,
            tenant_max_bytes=tenant_max_bytes, exact_prefill=exact_prefill, kv_events=kv_events).items()
            if v is not None}
        self._defaults = defaults  # an interface's own defaults (kvstore serve's): they read as defaults
        parsed = settings.resolve(given, {}, defaults=defaults)  # bad settings are an error before anything is opened
        settings.check_chunks(settings.BY_NAME["exact_prefill"], *parsed["exact_prefill"], parsed["chunk_size"][0])
        value = {name: v for name, (v, _) in parsed.items()}
        if remote:
            check_url(remote)
        events = None if value["kv_events"] is None else events_config.parse(value["kv_events"])
        if events is not None and events.publishes:
            events_config.check_block_size(events, value["chunk_size"])
        if value["buffer_cache_bytes"] is not None:  # (None keeps the bound another store set)
            buffers.set_bound(value["buffer_cache_bytes"])
        self.chunk_size = value["chunk_size"]
        self._max_bytes = None if value["max_bytes"] == AUTO else value["max_bytes"]
        self._max_bytes_rule: str | None = None  # how an automatic budget was found (at open)
        self.ram_only = str(path) == MEMORY
        if self.ram_only and value["memory_bytes"] == 0:
            raise InvalidInputError("a RAM-only store needs memory_bytes > 0")
        if self.ram_only and remote:
            raise InvalidInputError("a remote tier needs a store directory (not kvstore.MEMORY)")
        secrets = fleet_keys(remote_key) if remote else None  # refused before anything is created
        self.memory = MemoryTier(value["memory_bytes"])
        self.files = None if self.ram_only else LocalStore(
            store_dir(path), create=create, read_only=read_only)
        self.path = self.files.path if self.files else None
        self.read_only = self.files.read_only if self.files else False
        self.trust = self.files.trust(secrets) if self.files else None  # what tags its anchors (kvstore.trust)
        self.index, self.blob_root = (self.files.index, self.files.blob_root) if self.files else (None, None)
        if value["max_bytes"] == AUTO:
            self._max_bytes, self._max_bytes_rule = self.files.auto_budget() if self.files else (
                None, "auto: a RAM-only store writes no disk (memory_bytes bounds it)")
        writes = self.files is not None and not self.read_only
        self.settings = self._settings(given, writes)
        value = {name: v for name, (v, _) in self.settings.items()}
        self.disk_kv_bits = value["disk_kv_bits"]
        self.exact_prefill = value["exact_prefill"]
        self.tenant_max_bytes = value["tenant_max_bytes"]
        self.remote = self._open_remote(remote, secrets, value)
        self._tenant_secret: tuple[bytes, str] | None = None  # (secret, key id), made on first use
        self.events = self._publisher(events)
        self.gate = Gate(self.index if writes else None, value["admit"], value["max_write_rate"])
        budget = DiskBudget(self.files, self.memory, self._max_bytes, self.tenant_max_bytes,
                            self._max_bytes_rule) if writes and (self._max_bytes is not None or self.tenant_max_bytes is not None) else None
        disk = DiskTier(self.index, self.blob_root, budget, self.trust) if self.files is not None else None
        self.writer = Writer(self.index if writes else None, self.blob_root if writes else None, self.memory,
                             value["max_pending_bytes"], fsync=fsync, gate=self.gate,
                             disk=disk, trust=self.trust, exact=bool(self.exact_prefill))
        self._wire(budget, disk)
        if budget is not None:  # a store already past its budget is brought within it now, not at a first write
            budget.check()
        self.disk = disk
        self.tiers = self._tiers(disk)
        self.backing = Backing(self.tiers, self.memory, self.writer, self.index, read_only=self.read_only,
                               gate=self.gate, remote=self.remote, budget=budget)
        _OPEN_STORES.add(self)

    def _wire(self, budget: DiskBudget | None, disk: DiskTier | None) -> None:
        """The events that leave the parts (to the uploader, the disk budget, KV events), subscribed once."""
        writer, memory, events = self.writer, self.memory, self.events
        if self.remote is not None:
            writer.on_commit.append(self.remote.uploader.submit)
        if budget is not None:
            writer.follow_budget(budget)
        if events is not None:  # what reaches the disk or RAM (a queued record is in RAM), what leaves
            writer.on_commit.append(events.committed)
            memory.on_change.append(events.memory_changed)
            if memory.capacity:  # the memory tier takes a queued record once written
                writer.on_queue.append(events.queued)
                writer.on_unqueue.append(events.unqueued)
            if disk is not None:
                disk.on_store.append(events.committed)

    def _settings(self, given: dict, writes: bool) -> dict[str, tuple[Any, str]]:
        """Every setting's (value, source) for this open; given kept ones are kept (and said so)."""
        if self.index is None:
            return settings.resolve(given, {}, defaults=self._defaults)
        try:
            kept = self.index.settings()
        except sqlite3.DatabaseError as e:  # unreadable: the defaults, and limits closed (as if damaged)
            log.warning("kvstore: cannot read the store's kept settings (%s): using the defaults", e)
            kept = {s.name: "\0unreadable" for s in settings.KEPT_SETTINGS if s.damaged is not None}
        resolved = settings.resolve(given, kept, warn=lambda message: log.warning("kvstore: %s", message),
                                    chunk_size=self.chunk_size, defaults=self._defaults, store=self.path)
        for s in settings.KEPT_SETTINGS:
            value, source = resolved[s.name]
            if writes and source == settings.GIVEN and kept.get(s.name) != s.encode(value):
                try:
                    self.index.set_setting(s.name, s.encode(value))
                    log.warning("kvstore: %s", settings.now_kept(s, value, kept.get(s.name), self.path))
                except sqlite3.OperationalError as e:  # a full disk or a busy index: used, not kept
                    log.warning("kvstore: cannot keep %s=%s in the store (%s)", s.name, s.encode(value), e)
        return resolved

    # -- what the writer puts on disk -------------------------------------------------------

    def write_stats(self) -> dict:
        """`stats()["writes"]`: see `write.budget.summary`."""
        return write_budget.summary(self.index, policy=self.gate.policy, per_day=self.gate.per_day,
                                    unsaved=self.gate.unsaved(), now=self.gate.clock())

    def _open_remote(self, url: str | None, secrets: list[bytes] | None, value: dict) -> Remote | None:
        """This node's side of the bucket at `url` (its objects sealed with the first of the
        fleet's `secrets`, read with each; `value`: the settings), or None. Contacts nothing yet."""
        if not url:
            say_unused(self.settings)
            return None
        return Remote(open_bucket(url), Fleet.of(secrets), self.index, self.path, self.blob_root,
                      deadline=value["remote_deadline"], flush_timeout=value["remote_flush_timeout"],
                      prefetch=value["remote_prefetch"], trust=self.trust)

    def _publisher(self, config: events_config.EventsConfig | None):
        """The KV events publisher `kv_events` asks for (`kvstore.events.kvevents.start`), or None."""
        if config is None:
            return None
        from kvstore.events.kvevents import start

        try:
            return start(config, self.index, self.blob_root)
        except BaseException:  # the endpoint cannot be used: nothing is left open
            if self.files is not None:
                self.files.close()
            raise

    def _tiers(self, disk: DiskTier | None) -> Tiers:
        """Where fetch reads records from, in order."""
        tiers: list = [MemoryTierView(self.memory), PendingTier(self.writer)]
        if disk is not None:
            tiers.append(disk)
            if (r := self.remote) is not None:  # its downloads are stored through `disk`, within its budget
                tiers.append(remote := RemoteTier(r.bucket, r.health, disk, r.fleet, policy=r.prefetch,
                                                  deadline=r.deadline, reupload=r.uploader.submit, keys=r.keys))
                self.writer.landing(remote.stored.landed)
        return Tiers(tiers)

    # -- public surface ---------------------------------------------------------------------

    def tenant(self, tenant_id: str) -> Tenant:
        """The tenant `tenant_id` of this store (its salt derived under the fleet secret with a remote tier, else
        a key kept in the store). Errors name what is wrong with an id, never the id (it may be a bearer token)."""
        try:
            tenants.check_id(tenant_id)  # (before the key: a bad id is said as such, on a read-only store too)
            if self.remote is not None:
                fleets = self.remote.fleet.keyring()
                first, *older = [tenants.derive(f.tenant_secret(), tenant_id, key_id=f.key_id) for f in fleets]
                t = dataclasses.replace(first, previous=tuple(older))
                self.remote.fleet.remember(t)
                return t
            if self._tenant_secret is None:
                self._tenant_secret = (tenant_key(self.path, create=not self.read_only) if self.files is not None
                                       else os.urandom(32), "")
            return tenants.derive(self._tenant_secret[0], tenant_id)
        except ValueError as e:
            raise InvalidInputError(f"tenant: {e}") from None

    def bind(self, model: Any, model_id: str | os.PathLike, *, kv_bits: int | None = None,
             kv_group_size: int = 64, adapter_path: str | os.PathLike | None = None,
             fingerprint: bytes | None = None, tenant: str | None = None) -> ModelCache:
        """A `ModelCache` for a loaded mlx-lm model and the path or repo id it was loaded from.

        The model's files are fingerprinted (memoised in the index by path, size, mtime, inode
        and ctime), so changed weights at the same path never get old K/V. `kv_bits`/`kv_group_size`: the
        caller's caches are `QuantizedKVCache`s (mlx-lm's `--kv-bits`); part of the namespace.
        `fingerprint` skips hashing files (for models that were not loaded from a folder).
        `tenant`: the id of the tenant it serves (its salt is derived inside, `Store.tenant`): it
        reuses the shared prompts and its own, and stores what follows them as its own.
        """
        self._check_open()
        if fingerprint is not None and (not isinstance(fingerprint, bytes) or len(fingerprint) != 16):
            raise InvalidInputError(f"fingerprint must be kvstore's 16-byte fingerprint, not {fingerprint!r:.30}")
        layout, codecs = describe(model, make_template(model, kv_bits, kv_group_size), self.disk_kv_bits)
        chunk_size = self.chunk_size
        if self.exact_prefill:  # its own namespace, of records one step long (see kvstore.model.prefill)
            layout, chunk_size = {**layout, "exact_prefill": self.exact_prefill}, self.exact_prefill
        stamps = None
        with self.files.damage_is_an_error() if self.files is not None else contextlib.nullcontext():
            if fingerprint is None:
                fingerprint, stamps = fingerprints.fingerprint(model_id, adapter_path, self.index, model=model,
                                                               remember=not self.read_only, trust=self.trust)
            ns = keys.namespace(fingerprint, layout, chunk_size)
            mc = ModelCache(self.backing, model, str(model_id), ns, fingerprint, layout, codecs, chunk_size,
                            kv_bits=kv_bits, kv_group_size=kv_group_size, exact=self.exact_prefill)
            mc.registered = mc.register(stamps)
        if self.backing.budget is not None and mc.check.bound() is not None:  # (None: a model not traced)
            self.backing.budget.holds(mc.check.bound().per_token, chunk_size)
        if self.remote is not None:
            self.remote.bind(ns, fingerprint, chunk_size, layout, mc.check.bound())
        if self.events is not None:
            self.events.announce(ns)
        return mc.with_tenant(self.tenant(tenant)) if tenant is not None else mc

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every insert so far is durable (and uploaded, with a remote tier: without
        `timeout`, for at most `remote_flush_timeout`). False if the time ran out first."""
        return self.backing.flush(timeout)

    max_bytes = property(lambda self: self._budget()[0], doc="The disk budget now (an automatic one is derived "
                         "again as the writer checks it, `tiers.disk.AUTO_EVERY_S`).")
    max_bytes_rule = property(lambda self: self._budget()[1], doc="How an automatic budget was derived last.")

    def _budget(self) -> tuple[int | None, str | None]:
        b = self.backing.budget
        return (b.max_bytes, b.auto_rule) if b is not None and b.auto_rule else (self._max_bytes, self._max_bytes_rule)

    @property
    def counters(self) -> dict[str, int]:
        """This process's counters: records the disk tier quarantined, and the models' fetches
        and inserts (`model.backing.Counters`)."""
        return {"quarantined": self.disk.quarantined if self.disk is not None else 0, **self.backing.counters.as_dict()}

    def close(self) -> None:
        if self.backing.closed.is_set():
            return
        self.writer.close()
        if self.backing.budget is not None:  # a gc it runs now uses the index: let it finish
            self.backing.budget.settle()
        for tier in self.tiers:
            getattr(tier, "close", lambda: None)()
        if self.remote is not None:
            self.remote.close()
        if self.events is not None:  # after the writer: its last batches are published too
            self.events.close()
        _OPEN_STORES.discard(self)
        if self.files is not None:
            self.files.close()
        self.backing.closed.set()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """Totals (`bytes`, `chunks`, `tails`), `models` (one dict each), tiers and counters."""
        w = self.writer.stats
        out: dict[str, Any] = {
            "path": str(self.path) if self.path else MEMORY,
            "read_only": self.read_only,
            "chunk_size": self.chunk_size,
            "disk_kv_bits": self.disk_kv_bits,
            "settings": settings.report(self.settings),
            "max_bytes": self.max_bytes,
            "max_bytes_auto": self.max_bytes_rule is not None,
            "max_bytes_rule": self.max_bytes_rule,
            "memory": {"bytes": self.memory.nbytes, "records": len(self.memory),
                       "capacity": self.memory.capacity, "hits": self.memory.hits},
            "writer": {"pending_bytes": self.writer.pending_bytes, "records_written": w.records_written,
                       "bytes_written": w.bytes_written, "dropped_jobs": w.dropped_jobs,
                       "dropped_bytes": w.dropped_bytes, "write_errors": w.write_errors,
                       "last_error": w.last_error, "redundant_dropped": w.redundant_dropped,
                       "redundant_bytes": w.redundant_bytes, "refilled": w.refilled},
            **self.counters, "tenant_max_bytes": self.tenant_max_bytes,
            "remote": self.remote.stats() if self.remote is not None else None,
            "writes": self.write_stats(), "buffer_cache": buffers.held(),
            "restore_check": self.restore_check(),
            "events": self.events.stats() if self.events is not None else None,
        }
        if self.files is not None:
            out.update(self.files.stats())
        else:
            kinds, none = self.memory.kinds(), {"records": 0, "bytes": 0}  # (a damaged record in RAM is dropped)
            out.update(bytes=self.memory.nbytes, chunks=kinds.get(0, 0), tails=kinds.get(1, 0), quarantined_now=none,
                       checkpoints=kinds.get(2, 0), models=[], tenants=self.memory.tenants())
        return out

    def restore_check(self) -> dict:
        """What the backend self-check of this process found (`restore.selfcheck.state`): whether
        the first restore was compared with its records' bytes, and whether restores copy since
        a mismatch (then `copy_restores` counts them)."""
        return selfcheck.state()

    def gc(self, max_bytes: int | None = None, max_age: float | None = None, dry_run: bool = False,
           stale: bool = False, drop_tenants: Sequence[str] = ()) -> dict:
        """Evict down to `max_bytes` (and records unused for `max_age` seconds; with `stale`, every record of a
        model version whose files are gone or changed, and all of the tenants `drop_tenants` (tags), pinned ones
        too). A budget evicts stale versions first (their pins kept). See `upkeep.gc` and `upkeep.evict`."""
        self._check_open()
        check_flags(dry_run=dry_run, stale=stale)  # ("no" would evict stale models' pinned records)
        max_bytes, max_age = settings.gc_bounds(max_bytes, max_age)
        drop_tenants = tenants.tag_list(drop_tenants)
        if self.files is None:
            if drop_tenants:  # (a store in RAM keeps no tenant's records apart)
                raise InvalidInputError("drop_tenants needs a store on disk, not one in RAM: nothing deleted")
            return self.memory.gc(self.memory.nbytes if max_bytes is None else max_bytes, dry_run=dry_run)
        return evict(self.files, self.memory, max_bytes=max_bytes, max_age=max_age, dry_run=dry_run, stale=stale,
                     tenant_max_bytes=self.tenant_max_bytes, drop_tenants=drop_tenants)

    def pins(self) -> list[dict]:
        """What is pinned, one dict per model version (`upkeep.local.LocalStore.pins`); `[]` in RAM."""
        self._check_open()
        self.writer.flush()  # pins queued with inserts land first
        return self.files.pins() if self.files is not None else []

    def verify(self, repair: bool = False, force: bool = False) -> list:
        """Problems found (empty when clean); `repair=True` fixes them. See `upkeep.verify`. Repair deletes at
        most a small share of the blobs as orphans (no row, or a broken chain): more than that means the index,
        not the blobs, is wrong, and needs `force=True`."""
        self._check_open()
        check_flags(repair=repair, force=force)  # ("no" would repair)
        if self.files is None:
            return []
        self.flush()
        problems = self.files.verify(repair=repair, force=force, trust=self.trust)
        if repair:
            self.memory.clear()
        return problems

    def verify_exact(self, model: Any, model_id: str | os.PathLike, *, sample: int | None = 8,
                     **bind_options) -> "Report":
        """Check that this store restores what a cold run computes, for `sample` stored prompts of this model (all
        when None): K/V bit for bit (in exact mode; within bounds otherwise), next-step logits, 32 greedy tokens and
        the records' canaries (`kvstore.certify`). The shared prompts, or with `tenant=ID` (a `bind` option, as the
        others) that tenant's. It reads the store through a read-only opening of its directory, with no memory tier:
        it writes nothing (no access times, no admission rows). A `Report`: `ok`, `table()`, ...; docs/exact.md."""
        from kvstore.certify import verify_exact

        self._check_open()
        if bad := sorted(bind_options.keys() - set(list(inspect.signature(Store.bind).parameters)[3:])):
            raise TypeError(f"verify_exact() got an unexpected keyword argument {bad[0]!r} (it takes bind's options)")
        if self.files is None:
            raise InvalidInputError("verify_exact checks a store directory; a RAM-only store has nothing on disk")
        if not (self.read_only and self.memory.capacity == 0):
            self.flush()
            if bind_options.get("tenant") is not None and not self.read_only:  # its key, which the twin only reads
                self.tenant(bind_options["tenant"])
            with Store(self.path, read_only=True, create=False, memory_bytes=0, chunk_size=self.chunk_size,
                       exact_prefill=self.exact_prefill or "off", disk_kv_bits=self.disk_kv_bits or 0) as twin:
                return twin.verify_exact(model, model_id, sample=sample, **bind_options)
        mc = self.bind(model, model_id, **bind_options)
        return verify_exact(mc, self.index, self.blob_root, disk_kv_bits=self.disk_kv_bits, sample=sample,
                            anchors=self.disk.anchors if self.disk is not None else None)

    def _check_open(self) -> None:
        self.backing.check_open()


def open(path: str | os.PathLike | None = None, *, max_bytes: int | str | None = None,
         memory_bytes: int | str | None = None, chunk_size: int | None = None, remote: str | None = None,
         **options) -> Store:
    """Open (creating if needed) the store at `path`, `$KVSTORE_DIR` or `~/.cache/kvstore`.

    `max_bytes` bounds the disk (the writer evicts to stay within it); `max_bytes="auto"` sets it
    to a quarter of (what the store holds + its disk's free space), at open and again every 30 s
    as writes are checked against it: `stats()` shows the number and the rule.

    `path=kvstore.MEMORY` keeps everything in RAM (nothing is written); `memory_bytes=0` turns
    the memory tier off (every fetch reads the disk). A folder that is not a store (it holds
    files but no kvstore index) is refused, never used. `create=False` opens only an existing
    store; `read_only=True` (or `None`: when this user may not write it) writes nothing.
    `remote="s3://BUCKET/PREFIX"` shares the store with other nodes through an S3-compatible
    object store; how long a fetch waits for it is `remote_prefetch`'s (`"timeout"`,
    `"best_effort"`, `"wait_complete"`: see `kvstore.tiers.remote`), at most `remote_deadline`
    seconds when given. The fleet's secret is `remote_key` (32 bytes, or the base64url text
    `kvstore remote-key` prints), else `$KVSTORE_REMOTE_KEY`: a remote without one is refused.
    `remote_flush_timeout` (seconds, default 10) bounds `flush()` and `close()`'s wait for uploads.

    `admit` says which records go to disk: `"all"` (the default), `"reused"` (a prefix asked
    for a second time, or warmed or pinned) or `"pinned"` (warmed and pinned only); the others
    stay in the memory tier. `max_write_rate="20GB/day"` (or `"500MB/h"`, or bytes per day)
    bounds what is written in any rolling day by automatic writes (`off`: no limit; 0 is refused).
    Warmed, prefilled and pinned prompts are always written and count against it. Both are kept
    in the store for later opens; `stats()["writes"]` counts what was written and kept out.

    `disk_kv_bits=8` (or 4) stores the K/V of bf16/f16 attention layers quantized (lossy, about
    half the bytes of bf16 at 8 bits), restored as the model's own cache class and dtype; kept
    for later opens (`0` turns it off). See docs/kv8.md.

    `buffer_cache_bytes` bounds the freed restore memory mlx keeps for the next restore, process-
    wide (default: a quarter of RAM; 0: mlx's own limit). `kv_events` publishes the records as
    vLLM's KV events (ZMQ, msgpack) for routers: vLLM's `KVEventsConfig` JSON or a dict, with
    `block_size` (default 64, a divisor of `chunk_size`) and `encoding` ("map" or "legacy").

    Every setting is a row of `kvstore.settings.STORE_SETTINGS` (its kind, default, whether the
    store keeps it, what 0 means); sizes, rates and durations may be text ("2GiB", "20GB/day",
    "10s"); `stats()["settings"]` tells each one's value and source.
    `defaults` (`{name: value}`) are an interface's own defaults (`kvstore serve`'s automatic
    disk budget), used where a setting is neither given nor kept and reported as `default`.
    """
    known = inspect.signature(Store).parameters
    for name in options.keys() - known.keys():  # Store's own name would send the reader elsewhere
        near = difflib.get_close_matches(name, known, n=1)
        raise TypeError(f"kvstore.open() got an unexpected keyword argument {name!r}"
                        + (f": did you mean {near[0]!r}?" if near else ""))
    return Store(path, max_bytes=max_bytes, memory_bytes=memory_bytes, chunk_size=chunk_size,
                 remote=remote, **options)


# What `Store.stats()` counts: totals of the store on disk (the same in every process that opens
# it), or counters of this one process (its memory tier, its writer, what it fetched, and the
# settings it opened the store with). A key missing here is reported as "unknown", not guessed.
STORE_TOTALS = ("path", "bytes", "chunks", "tails", "checkpoints", "models", "quarantined_total",
                "quarantined_now", "quarantine_folder", "tenants")
PER_PROCESS = ("chunk_size", "max_bytes", "memory", "writer", "quarantined", "skipped_inserts",
               "fetches", "reused_tokens", "read_only", "max_bytes_auto", "max_bytes_rule",
               "disk_kv_bits", "buffer_cache", "tenant_max_bytes", "restore_check", "events")
# `remote`: this process's counters, and under `totals` the store's (kept in its index).
# `writes`: the store's write log (every process's), and the settings this process opened it with.
MIXED = {"remote": "process; its totals: store", "writes": "store; admit and max_write_rate: process",
         "settings": "process; kept ones: store"}


def stats_scope(stats: dict) -> dict[str, str]:
    """`{key: "store" | "process" | ... | "unknown"}` for every top-level key of `Store.stats()`."""
    return {key: "store" if key in STORE_TOTALS else "process" if key in PER_PROCESS
            else MIXED.get(key, "unknown") for key in stats}
