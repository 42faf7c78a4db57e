"""This node's side of a shared bucket: its uploads, its pins, its counters, and bucket upkeep.

`Remote` is made by the store for `kvstore.open(..., remote="s3://BUCKET/PREFIX")`. Reading from
the bucket is the remote tier's (`tiers.remote`); what is here is everything else a node does
with the bucket: write-behind of what its writer stored (`Uploader`), the manifest of each bound
model, publishing its pins (what gc on any node must keep), `gc` and `verify` of the bucket, and
the counters `stats` shows, kept in the store's index so they add up over processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstore import keys
from kvstore.remote.bucket import Bucket
from kvstore.remote.health import Health
from kvstore.remote.layout import LAYOUT_VERSION, pins_key
from kvstore.remote.uploader import Uploader
from kvstore.storage.index import Index


class Remote:
    def __init__(self, bucket: Bucket, index: Index, store_dir: Path, blob_root: Path, *, deadline: float,
                 health: Health | None = None, upload_threads: int = 4):
        self.bucket, self.index, self.store_dir = bucket, index, store_dir
        self.url, self.deadline = bucket.url, deadline
        self.health = health or Health()
        self.uploader = Uploader(bucket, self.health, blob_root, index.get, self.publish_pins,
                                 threads=upload_threads)

    @property
    def counters(self) -> dict[str, int]:
        return self.health.counters

    def bind(self, ns: bytes, fingerprint: bytes, model_id: str, chunk_size: int, layout: dict) -> None:
        """Remember a bound model's manifest, uploaded before the first record of its namespace."""
        self.uploader.manifests[ns] = json.dumps({
            "layout_version": LAYOUT_VERSION, "format": keys.FORMAT_VERSION, "namespace": ns.hex(),
            "fingerprint": fingerprint.hex(), "model_id": model_id, "chunk_size": chunk_size,
            "layout": layout}, sort_keys=True).encode()

    def stats(self) -> dict[str, Any]:
        """This process's counters, and `totals`: every process's on this store, so far."""
        try:
            stored = self.index.counters()
        except Exception:  # only statistics (the index may be busy)
            stored = {}
        return {"url": self.url, "deadline_s": self.deadline, "pending_upload_bytes": self.uploader.pending_bytes,
                "last_error": self.health.last_error, **self.health.counters,
                "totals": self.health.totals(stored)}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload is done (or dropped). False if `timeout` ran out."""
        done = self.uploader.flush(timeout)
        self.save_counters()
        return done

    def close(self, timeout: float = 30.0) -> None:
        self.uploader.flush(timeout)
        self.sync_pins()
        self.uploader.close(timeout=1.0)
        self.save_counters()

    def gc(self, *, max_bytes: int | None = None, max_age: float | None = None, dry_run: bool = False) -> dict:
        """Bound the bucket (see `upkeep.collect_remote`); this node's pins are published first."""
        from kvstore.remote.upkeep import collect_remote

        self.flush(60)
        self.publish_pins()
        return collect_remote(self.bucket, max_bytes=max_bytes, max_age=max_age, dry_run=dry_run)

    def verify(self, *, repair: bool = False) -> list:
        """Problems of the bucket's objects (see `upkeep.verify_remote`)."""
        from kvstore.remote.upkeep import verify_remote

        self.flush(60)
        return verify_remote(self.bucket, repair=repair)

    def publish_pins(self, namespaces=None) -> int:
        """Write this node's pins object(s): what gc on any node must keep."""
        from kvstore.remote.upkeep import node_id, publish_pins

        return publish_pins(self.bucket, self.index, node_id(self.store_dir), namespaces)

    def sync_pins(self) -> None:
        """Publish this node's pins of the models bound here if the bucket's copy differs (a
        prompt pinned without a new upload, like `warm` pinning what it downloaded)."""
        from kvstore.remote.upkeep import node_id

        if self.health.down():
            return
        try:
            node = node_id(self.store_dir)
            for ns in self.uploader.manifests:
                mine = sorted(h.hex() for h in self.index.pinned(ns))
                body = self.bucket.get(pins_key(ns, node))
                theirs = json.loads(body).get("pinned") if body else []
                if mine != theirs:
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
