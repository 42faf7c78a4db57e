"""Pins objects: what each node has pinned, published in the bucket, and what gc may trust of them.

Pins are known only to the node that pinned a prompt. Each node publishes them, sealed, as
`<ns>/pins/<node>`: the names of its pinned records (which include their ancestors) and a
`serial` that grows with every publish (`max(last + 1, microseconds since the epoch)`, so it
keeps growing over a store whose index was rebuilt). A bucket writer cannot forge one, but can
put an older copy back at its key (a rollback: what was pinned since drops out of it). What
holds against that:

- This node's own pins: its index is the truth. gc keeps the records its index has pinned,
  whatever the bucket holds. The serial of its last pins object is kept in the index (`meta`
  `remote.pins.<folder>`): an object of its own with a lower one is a rollback, which verify
  reports (`rolled_back_pins`; `--repair` publishes again) and gc warns of.
- Another node's: its last serial cannot be known here, only the highest this node has seen
  (`meta` `remote.pins_seen.<folder>.<node>`, raised by every gc and verify). A lower one is a
  rollback: gc deletes nothing of that namespace (what the older copy lacks is not known) and
  says so, until that node publishes again; so does an object that does not open in the place
  of one seen, and a pins object seen that is gone (deleted: what it kept is not known either)
  while its namespace folder still holds objects. A copy put back before this node ever read a
  newer one is not detected: run gc from the same node (one cron job), which then has seen them
  all. A node retired for good whose pins object was deleted on purpose holds its namespace
  until `verify --remote --repair` forgets it (`Ledger.forget`).
- A pins object of a namespace none of the fleet's keys opens keeps nothing.

Two stores must never publish under one node id: a copy of a store folder (`cp -a`, a restore
from backup) would otherwise publish over the original's pins with a higher serial, and another
node's gc would delete what the original pins. The id is bound (in the index) to the inode of the
folder it was first used in; a folder with another inode takes a new id (`node_id`). A copy that
keeps the inode (a cloned disk image) is caught in the bucket: this node's own pins object with a
serial it never wrote (`Pins.shared`) makes it take a new id when it next publishes (at close,
after gc, or by `verify --remote --repair`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from kvstore.errors import KVStoreError
from kvstore.remote.bucket import Bucket, TooLarge
from kvstore.remote.layout import pins_key
from kvstore.remote.seal import Fleet, Sealer, Unauthenticated
from kvstore.storage.storedir import NODE_ID_NAME, write_own_file

if TYPE_CHECKING:
    from kvstore.storage.index import Index

log = logging.getLogger("kvstore")

NODE_FILE = NODE_ID_NAME
MAX_PINS_BYTES = 64 << 20
_OWN, _SEEN = "remote.pins.", "remote.pins_seen."
_BOUND = "remote.node_folder."  # + node id: the inode of the store folder the id belongs to
_NAME = re.compile(r"[0-9a-f]{32}")


def node_id(store_dir: Path, index: "Index | None" = None, *, renew: bool = False) -> str:
    """This store's name among the nodes of a bucket: random, made once, kept in the store
    (`remote-node-id`). With `index`, bound to the inode of the store folder: a folder with
    another inode (a copy, or a restore from backup) takes a new id, said once, and hands the
    serials of its own pins objects over as another node's (the old id is the original's now).
    A folder renamed or moved on its filesystem keeps its inode and its id. `renew`: take a new
    id whatever the inode (another store was seen publishing under this one)."""
    path = Path(store_dir) / NODE_FILE
    old = _read_id(path)
    if old is None:
        old = uuid.uuid4().hex
        write_own_file(path, old + "\n")
    if index is None:
        return old
    try:
        here = os.stat(store_dir).st_ino & ((1 << 63) - 1)  # (a meta mark is a signed 64-bit integer)
        bound = index.marks(_BOUND + old).get(_BOUND + old)
        if bound is None and not renew:  # first used since ids were bound (or the index was rebuilt)
            index.raise_mark(_BOUND + old, here)
        if not renew and bound in (None, here):
            return old
        new = uuid.uuid4().hex
        write_own_file(path, new + "\n")
        for key, serial in index.marks(_OWN).items():
            index.raise_mark(f"{_SEEN}{key[len(_OWN):]}.{old}", serial)
            index.drop_mark(key)
        index.drop_mark(_BOUND + old)
        index.raise_mark(_BOUND + new, here)
    except (sqlite3.Error, KVStoreError, OSError) as e:  # a store that cannot be written keeps its id
        log.debug("kvstore: cannot bind the node id to the store folder (%s)", e)
        return _read_id(path) or old
    if renew:
        log.warning("kvstore: %s: this store takes a new node id, %s (it was %s), and publishes its pins under it",
                    store_dir, new, old)
    else:
        log.warning("kvstore: %s is not the folder its node id %s was made in (a copy, or restored from a backup): "
                    "it takes a new one, %s, so that it never publishes its pins over the other store's",
                    store_dir, old, new)
    return new


def _read_id(path: Path) -> str | None:
    try:  # the store's own entries are never read or written through a symbolic link
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "r") as f:
            text = f.read(64).strip()
        return text if _NAME.fullmatch(text) else None
    except OSError:
        return None


class Ledger:
    """What this node knows of pins that the bucket cannot tell it: who it is (`node`), what it
    pinned (its index), the serial of its own last pins object per namespace folder and the
    highest seen of each other node's. With no store (`index` None) it knows none of it.
    `shared`: the folders where its own pins object holds a serial it never wrote (read_all)."""

    def __init__(self, index: "Index | None" = None, node: str | None = None, store_dir: Path | None = None):
        self.index, self.node, self.store_dir = index, node, store_dir
        self.shared: set[str] = set()
        self._marks: dict[str, int] = {}
        if index is not None:
            self._marks = {**index.marks(_OWN), **index.marks(_SEEN)}

    def foreign(self, folder: str, serial: int) -> bool:
        """A pins object of this node's id with `serial` was not written by this store: its
        serial is above the last this store published (read again: another process of this
        store may have published since). Unknown (no serial kept, as after a rebuild): False."""
        key = self._key(folder, self.node or "")
        mark = self._marks.get(key, 0)
        if self.index is not None and serial > mark > 0:
            try:
                mark = self.index.marks(key).get(key, mark)
            except sqlite3.Error:
                pass
        return serial > mark > 0

    def renew(self) -> None:
        """Take a new node id (`node_id`, renew): another store publishes under this one."""
        if self.store_dir is None or self.index is None:
            return
        self.node = node_id(self.store_dir, self.index, renew=True)
        self._marks = {**self.index.marks(_OWN), **self.index.marks(_SEEN)}
        self.shared.clear()

    def pinned(self, ns: bytes) -> list[bytes]:
        """The records this node has pinned in namespace `ns`."""
        return [] if self.index is None else list(self.index.pinned(ns))

    def expected(self, folder: str, node: str) -> int:
        """The lowest serial a pins object of `node` may have: this node's last published one,
        or the highest seen of another node's (0: none known)."""
        return self._marks.get(self._key(folder, node), 0)

    def next_serial(self, folder: str) -> int:
        return max(self.expected(folder, self.node or "") + 1, time.time_ns() // 1000)

    def remember(self, folder: str, node: str, serial: int) -> None:
        """Raise the mark of `node`'s pins in `folder` to `serial` (only bookkeeping: a store that
        cannot be written now loses the mark, never the command)."""
        key = self._key(folder, node)
        if serial <= self._marks.get(key, 0):
            return
        self._marks[key] = serial
        if self.index is not None:
            try:
                self.index.raise_mark(key, serial)
            except (sqlite3.Error, KVStoreError, OSError) as e:
                log.debug("kvstore: cannot remember the serial of a pins object (%s)", e)

    def seen(self, folder: str) -> dict[str, int]:
        """Node -> the highest serial seen of its pins in `folder` (other nodes only)."""
        prefix = f"{_SEEN}{folder}."
        return {k[len(prefix):]: v for k, v in self._marks.items() if k.startswith(prefix) and v > 0}

    def forget(self, folder: str, node: str) -> None:
        """Take another node's pins in `folder` as retired: its pins object is no longer expected."""
        self._marks.pop(self._key(folder, node), None)
        if self.index is not None:
            self.index.drop_mark(self._key(folder, node))

    def _key(self, folder: str, node: str) -> str:
        return f"{_OWN}{folder}" if node == self.node else f"{_SEEN}{folder}.{node}"


def publish(bucket: Bucket, fleet: Fleet, ledger: Ledger, namespaces: Iterable[bytes]) -> int:
    """Write this node's pins object for each namespace; how many pinned records were published."""
    total = 0
    for ns in sorted(namespaces):
        s = fleet.sealer(ns)
        names = sorted(s.name(h) for h in ledger.pinned(ns))
        serial = ledger.next_serial(s.folder)
        body = json.dumps({"node": ledger.node, "serial": serial, "updated": time.time(), "pinned": names}).encode()
        key = pins_key(s.folder, ledger.node or "")
        bucket.put(key, s.seal(key, body))
        ledger.remember(s.folder, ledger.node or "", serial)
        total += len(names)
    return total


def read_one(bucket: Bucket, s: Sealer, key: str) -> tuple[list[str], int] | None:
    """(pinned names, serial) of the pins object at `key` (serial 0: written before serials
    were); None if there is none; Unauthenticated if it does not open, ValueError if it opens
    and is not pins."""
    try:
        body = bucket.get(key, max_bytes=MAX_PINS_BYTES)
    except TooLarge:
        raise Unauthenticated("it is larger than any pins object") from None
    if body is None:
        return None
    data = json.loads(s.open(key, body))
    names, serial = data.get("pinned", []), data.get("serial", 0)
    if not isinstance(names, list) or not all(isinstance(n, str) and _NAME.fullmatch(n) for n in names) \
            or type(serial) is not int:
        raise ValueError("its pinned names or serial are not what a pins object holds")
    return names, serial


@dataclass
class Rollback:
    """A pins object older than one this node published or saw: put back by a bucket writer."""

    path: str
    node: str
    serial: int
    expected: int
    own: bool
    missing: bool = False  # deleted

    def __str__(self) -> str:
        whose = "this node's" if self.own else f"node {self.node}'s"
        by = "published" if self.own else "seen"
        if self.missing:
            return f"{whose} pins object is gone, after serial {self.expected} ({by} by this node): it was deleted"
        found = f"has serial {self.serial}, older than" if self.serial >= 0 else "does not open, after"
        return f"{whose} pins object {found} {self.expected} ({by} by this node): an older copy, or another object, " \
            "was put in its place"


@dataclass
class Pins:
    """What the pins objects of a bucket keep: the names of pinned records (and their ancestors,
    once the tree adds them), the namespace folders gc must keep whole this time, and why."""

    names: set[bytes] = field(default_factory=set)
    held: set[str] = field(default_factory=set)  # another node's pins rolled back: nothing of it goes
    rollbacks: list[Rollback] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (key, why): opened, not pins
    shared: list[tuple[str, int, int]] = field(default_factory=list)  # this node's, another store's serial, its own
    behind: list[tuple[str, int]] = field(default_factory=list)  # this node's, lacking n records it pins


def read_all(bucket: Bucket, objects: list[tuple[str, str]], sealers: dict[str, Sealer], ledger: Ledger,
             live: set[str] = frozenset()) -> Pins:
    """What the pins objects at `objects` ((key, namespace folder)) keep, with this node's own
    pins from its index; folders not in `sealers` (no key of the fleet opens them) keep nothing.
    A pins object this node published or saw that is not among them, in a folder of `live` (that
    holds objects), was deleted: a rollback too."""
    out = Pins()
    listed = {(folder, path.rpartition("/")[2]) for path, folder in objects}
    for folder in sorted(live & set(sealers)):
        nodes = {**ledger.seen(folder), **({ledger.node: ledger.expected(folder, ledger.node)} if ledger.node else {})}
        for node, serial in nodes.items():
            if serial > 0 and (folder, node) not in listed:
                out.rollbacks.append(Rollback(pins_key(folder, node), node, -1, serial, node == ledger.node, True))
                if node != ledger.node:
                    out.held.add(folder)
    for folder, s in sealers.items():
        out.names.update(bytes.fromhex(s.name(h)) for h in ledger.pinned(s.ns))
    for path, folder in objects:
        s = sealers.get(folder)
        if s is None:
            continue
        node = path.rpartition("/")[2]
        expected = ledger.expected(folder, node)
        own = node == ledger.node
        try:
            found = read_one(bucket, s, path)
        except (ValueError, AttributeError) as e:
            out.unreadable.append((path, str(e)))
            continue
        except Unauthenticated:  # not a fleet node's: ignored, unless it took the place of one seen
            found = None if expected == 0 else ([], -1)
        if found is None:
            continue
        names, serial = found
        if serial < expected:
            out.rollbacks.append(Rollback(path, node, serial, expected, own))
            if not own:  # what it lacks is not known: its namespace is kept whole
                out.held.add(folder)
            continue
        if own and ledger.foreign(folder, serial):  # another store (a copy of this one) publishes here
            out.shared.append((path, serial, expected))
            ledger.shared.add(folder)
        elif own and (lacking := {s.name(h) for h in ledger.pinned(s.ns)} - set(names)):
            out.behind.append((path, len(lacking)))  # pinned since, and not published (no remote then)
        if not own:  # (this node's own are its index's, above)
            ledger.remember(folder, node, serial)
        out.names.update(bytes.fromhex(n) for n in names)
    return out
