"""This node's side of a shared bucket: its uploads, its pins, its counters, and bucket upkeep.

`Remote` is made by the store for `kvstore.open(..., remote="s3://BUCKET/PREFIX")`. Reading from
the bucket is the remote tier's (`tiers.remote`); what is here is everything else a node does
with the bucket: write-behind of what its writer stored (`Uploader`), the manifest of each bound
model, publishing its pins (what gc on any node must keep), `gc` and `verify` of the bucket, and
the counters `stats` shows, kept in the store's index so they add up over processes.

Waits for uploads are bounded by one allowance per store (`flush_timeout`, default
`FLUSH_TIMEOUT_S`), not per call: however many times a command flushes, an endpoint that hangs
costs it at most that, once. The allowance comes back when every queued upload is done. What was
left is counted and said once, never waited out; no later process uploads it (the uploader is fed
only by this process's writer).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from kvstore import keys, settings
from kvstore.records import SizeBound
from kvstore.remote.bucket import Bucket
from kvstore.remote.health import Health, KeyCheck
from kvstore.remote.layout import LAYOUT_VERSION, pins_key
from kvstore.remote.pins import Ledger, node_id, publish, read_one
from kvstore.remote.seal import Fleet, Unauthenticated
from kvstore.remote.uploader import Uploader
from kvstore.storage.index import Index
from kvstore.trust import Trust
from kvstore.upkeep.anchors import REMOTE_SINCE, Anchors, note_keys

log = logging.getLogger("kvstore")

#: The longest `flush()` (and so a command's exit) waits for uploads, in seconds.
FLUSH_TIMEOUT_S: float = settings.BY_NAME["remote_flush_timeout"].default


class Remote:
    def __init__(self, bucket: Bucket, fleet: Fleet, index: Index, store_dir: Path, blob_root: Path, *,
                 deadline: float | None, health: Health | None = None, upload_threads: int = 4,
                 flush_timeout: float = FLUSH_TIMEOUT_S, prefetch: str = "timeout", trust: Trust | None = None):
        self.bucket, self.fleet, self.index, self.store_dir = bucket, fleet, index, store_dir
        self.url, self.deadline, self.flush_timeout = bucket.url, deadline, flush_timeout
        self.prefetch = prefetch  # the remote tier's policy (`tiers.remote`)
        self.health = health or Health()
        self.keys = KeyCheck(bucket, fleet, self.health)  # whether this node's key is the fleet's (asked again each minute)
        self.uploader = Uploader(bucket, self.health, fleet, blob_root, index.get, self.publish_pins,
                                 threads=upload_threads, keys=self.keys,  # `trust`: judges uploads (none: none go up)
                                 anchors=Anchors(trust, index, blob_root) if trust is not None else None)
        self._spent = 0.0  # seconds of the allowance waited out on uploads not done since
        self._said = False  # that the allowance ran out (said once until the uploads are all done)
        self._left = 0  # uploads left undone at close
        self.say_undone = True  # False: the caller says what was left undone (warm and generate end with it)
        self._lock = threading.Lock()
        try:  # when this store first had a remote: what it wrote before, under its own key, is trusted on first use
            if not index.marks(REMOTE_SINCE):
                index.raise_mark(REMOTE_SINCE, int(time.time()) + 1)
            if trust is not None:  # the fleet key its tags are made with (never a wrong one)
                note_keys(trust, index)
        except sqlite3.Error:  # read-only: nothing of it is uploaded anyway
            pass

    @property
    def counters(self) -> dict[str, int]:
        return self.health.counters

    def bind(self, ns: bytes, fingerprint: bytes, chunk_size: int, layout: dict, bound: SizeBound | None = None) -> None:
        """Remember a bound model's manifest, uploaded before the first record of its namespace.
        It names the model by its fingerprint only: never by its path on this node. `bound`: the
        model's geometry (the most bytes a record can be), which lets `verify --remote` judge
        sizes on a node without the model."""
        manifest = {"layout_version": LAYOUT_VERSION, "format": keys.FORMAT_VERSION, "namespace": ns.hex(),
                    "fingerprint": fingerprint.hex(), "chunk_size": chunk_size, "layout": layout}
        if bound is not None:
            manifest["geometry"] = bound.as_dict()
        self.uploader.manifests[ns] = json.dumps(manifest, sort_keys=True).encode()

    def stats(self) -> dict[str, Any]:
        """This process's counters, and `totals`: every process's on this store, so far."""
        try:
            stored = self.index.counters()
        except Exception:  # only statistics (the index may be busy)
            stored = {}
        return {"url": self.url, "key": self.fleet.key_id, "older_keys": [f.key_id for f in self.fleet.older],
                "prefetch": self.prefetch, "deadline_s": self.deadline, "pending_upload_bytes": self.uploader.pending_bytes,
                "pending_uploads": self.uploader.pending_uploads, "flush_timeout_s": self.flush_timeout,
                "undone_uploads": self.undone_uploads,
                "last_error": self.health.last_error, **self.health.counters,
                "totals": self.health.totals(stored)}

    @property
    def undone_uploads(self) -> int:
        """Uploads this store no longer waits for (its allowance ran out on them), or left at close."""
        with self._lock:
            spent = self._spent >= self.flush_timeout
        return self._left or (self.uploader.pending_uploads if spent else 0)

    def not_uploaded(self) -> dict[str, int]:
        """What this process's writer stored and this process did not upload, by why (each
        record counted once): still queued when the store stopped waiting (`left`, as
        `undone_uploads`), skipped while the remote was left alone after a failure (`down`),
        skipped because its parent is not in the bucket (`no_parent`: below one of the others,
        or a refused one), failed, dropped from a full queue, or skipped because this node's key
        is not the fleet's (`wrong_key`, `KeyCheck`). No later process uploads them."""
        c = self.health.counters
        return {"left": self.undone_uploads, "down": c["skipped_down_uploads"], "no_parent": c["skipped_no_parent"],
                "failed": c["upload_errors"], "dropped": c["dropped_uploads"], "wrong_key": c["skipped_wrong_key"]}

    def undone_now(self) -> int:
        """Uploads not done were this process to stop now: those still queued, and those
        `not_uploaded` counts for its other reasons."""
        why = self.not_uploaded()
        return self.uploader.pending_uploads + sum(n for k, n in why.items() if k != "left")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload is done (or dropped), for at most `timeout` seconds and
        what is left of the store's allowance (`flush_timeout`). False if the time ran out."""
        done = self._wait(self.flush_timeout if timeout is None else timeout)
        self.save_counters()
        return done

    def _wait(self, limit: float) -> bool:
        """`Uploader.flush` within `limit` and the allowance; the time waited in vain is spent."""
        with self._lock:
            allowance = max(0.0, self.flush_timeout - self._spent)
        wait = min(limit, allowance)
        t0 = time.monotonic()
        done = self.uploader.flush(wait)
        with self._lock:
            if done:  # the endpoint answers: the next wait has the whole allowance
                self._spent, self._said = 0.0, False
                return True
            self._spent = self.flush_timeout if wait >= allowance else self._spent + time.monotonic() - t0
            say = self._spent >= self.flush_timeout and not self._said
            self._said = self._said or say
        if say and self.say_undone:
            why = (f"did not take {self.uploader.pending_uploads} uploads within {self.flush_timeout:.1f} s; "
                   "this store waits for them no longer" if self.flush_timeout else  # the remote is not to blame
                   f"has {self.uploader.pending_uploads} uploads queued, not waited for (remote_flush_timeout is 0)")
            log.warning("kvstore: remote %s %s (they go on in the background while this process runs; what is "
                        "not uploaded by its exit stays on this machine only)", self.url, why)
        return False

    def close(self, timeout: float | None = None) -> None:
        """Upload what is queued (within what is left of the allowance), publish pins, stop; what
        was left is counted (`left_uploads`) and said, unless the allowance running out was."""
        if self._wait(self.flush_timeout if timeout is None else timeout):
            self.sync_pins()
        left = self.uploader.close(timeout=0.0)
        self._left = left
        if left and not self._said and self.say_undone:
            log.warning("kvstore: remote %s: %d uploads left undone at close (the endpoint did not answer "
                        "within %.1f s); they stay on this machine only", self.url, left, self.flush_timeout)
        self.save_counters()

    def gc(self, *, max_bytes: int | None = None, max_age: float | None = None, dry_run: bool = False,
           drop_unknown: bool = False) -> dict:
        """Bound the bucket (see `upkeep.collect_remote`); this node's pins are published after
        (gc itself keeps them from the index)."""
        from kvstore.remote.upkeep import collect_remote

        self.flush()
        ledger = self.ledger()
        result = collect_remote(self.bucket, self.fleet, self.index.namespaces(), max_bytes=max_bytes,
                                max_age=max_age, dry_run=dry_run, ledger=ledger, drop_unknown=drop_unknown,
                                keys=self.keys)
        if ledger.shared and not dry_run:  # another store publishes under this node's id: not any more
            ledger.renew()
        self.publish_pins()
        return result

    def drop_key(self, *, key_id: str, dry_run: bool = False) -> dict:
        """Delete what only the older fleet key `key_id` opens (see `upkeep.drop_key`)."""
        from kvstore.remote.upkeep import drop_key

        self.flush()
        return drop_key(self.bucket, self.fleet, self.index.namespaces(), key_id=key_id, dry_run=dry_run,
                        keys=self.keys)

    def verify(self, *, repair: bool = False) -> list:
        """Problems of the bucket's objects, and `notes` (see `upkeep.verify_remote`)."""
        from kvstore.remote.upkeep import verify_remote

        self.flush()
        return verify_remote(self.bucket, self.fleet, self.index.namespaces(), repair=repair, ledger=self.ledger(),
                             keys=self.keys)

    def ledger(self) -> Ledger:
        """What this node knows of pins that the bucket cannot tell it (`remote.pins.Ledger`)."""
        return Ledger(self.index, node_id(self.store_dir, self.index), self.store_dir)

    def publish_pins(self, namespaces=None) -> int:
        """Write this node's pins object(s): what gc on any node must keep; none with a key that is
        not the fleet's (`KeyCheck`: such a node writes nothing to the bucket)."""
        if self.keys.judge(self.index.namespaces(), claim=True):
            return 0
        return publish(self.bucket, self.fleet, self.ledger(),
                       self.index.namespaces() if namespaces is None else namespaces)

    def sync_pins(self) -> None:
        """Publish this node's pins of the models bound here if the bucket's copy differs (a
        prompt pinned without a new upload, like `warm` pinning what it downloaded) or is older
        than the last this node published (put back by a bucket writer)."""
        if self.health.down():
            return
        try:
            ledger = self.ledger()
            for ns in self.uploader.manifests:
                s = self.fleet.sealer(ns)
                mine = sorted(s.name(h) for h in ledger.pinned(ns))
                try:
                    theirs = read_one(self.bucket, s, pins_key(s.folder, ledger.node))
                except (Unauthenticated, ValueError):
                    theirs = None  # not ours (planted or damaged): written again
                if theirs is not None and ledger.foreign(s.folder, theirs[1]):  # another store's (a copy)
                    ledger.renew()
                    self.publish_pins()
                    return
                if theirs is None and not mine and not ledger.expected(s.folder, ledger.node):
                    continue  # (one published before and gone since was deleted: written again)
                if theirs is None or sorted(theirs[0]) != mine or theirs[1] < ledger.expected(s.folder, ledger.node):
                    self.publish_pins([ns])
        except Exception as e:
            self.health.error(e)

    def save_counters(self) -> None:
        """Add what was counted since the last call to the store's totals (`kvstore stats`)."""
        deltas = self.health.unsaved()
        if not deltas:
            return
        try:
            self.index.bump_counters(deltas)
            self.health.saved(deltas)
        except Exception:  # only statistics (the index may be busy or read-only)
            pass


def say_unused(resolved: dict[str, tuple[Any, str]]) -> None:
    """The remote tier's settings given to a store that has none do nothing: said once per open."""
    given = [name for name, (_, source) in resolved.items()
             if name.startswith("remote_") and source == settings.GIVEN]
    if given:
        log.warning("kvstore: %s given, but this store has no remote tier (--remote): %s nothing",
                    ", ".join(given), "it does" if len(given) == 1 else "they do")
