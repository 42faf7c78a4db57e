"""Keeping the bucket of a remote tier bounded (`collect_remote`) and whole (`verify_remote`).

Both work from one listing of `PREFIX/`: every record's key names (by MAC, `remote.seal`) its
namespace and parent, so the tree of records is known without reading any object. Only keys of
exactly the layout count (`layout.parse_key`): a nested prefix is another team's, never touched.
gc chooses what goes by local gc's rule (`upkeep.evict`); deletions go children first, a level
at a time, so at every instant each remaining record's parent is still there (the binary search
of a lookup relies on it). Records whose parents go round in a cycle are orphans.

Pins are known only to the node that pinned a prompt. Each node publishes them, sealed, as
`<ns>/pins/<node>` (the names of its pinned records, which include their ancestors): after it
uploads pinned records, and before it runs `gc --remote` or `verify --remote`. gc reads every
node's pins object and keeps those records, their ancestors and their checkpoints; one that does
not open with the fleet's key is ignored. A namespace is known from this node's index or from
its manifest (sealed under a key derived from its folder name), under any of the fleet's keys
(a rotation not finished); a namespace no key opens keeps nothing by its pins: its records age
out as any others do, and verify reports it without judging its records. A tenant's records
(`.tchunk`...) are sealed with their tenant's key, which gc and verify do not have: gc keeps
their tree by names as any other, verify counts them unopened. `drop_key` deletes every object
of the namespaces of an older key (the end of a rotation).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.errors import BlobError, InvalidInputError
from kvstore.records import CHECKPOINT, TAIL, RecordId
from kvstore.remote.bucket import MAX_OBJECT_BYTES, Bucket, RemoteError
from kvstore.remote.layout import ObjectKey, manifest_key, parse_key, parse_other, pins_key
from kvstore.remote.seal import Fleet, Sealer, Unauthenticated
from kvstore.storage.storedir import NODE_ID_NAME, write_own_file
from kvstore.upkeep import evict
from kvstore.upkeep.verify import Problem

if TYPE_CHECKING:
    from kvstore.storage.index import Index

NODE_FILE = NODE_ID_NAME


def node_id(store_dir: Path) -> str:
    """This store's name among the nodes of a bucket: random, made once, kept in the store."""
    path = Path(store_dir) / NODE_FILE
    try:  # the store's own entries are never read or written through a symbolic link
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "r") as f:
            text = f.read(64).strip()
        if len(text) == 32 and all(c in "0123456789abcdef" for c in text):
            return text
    except OSError:
        pass
    text = uuid.uuid4().hex
    write_own_file(path, text + "\n")
    return text


def publish_pins(bucket: Bucket, fleet: Fleet, index: "Index", node: str, namespaces=None) -> int:
    """Write this node's pins object for each namespace (`namespaces`, default all it knows).
    Returns how many pinned records were published."""
    total = 0
    for ns in sorted(namespaces if namespaces is not None else index.namespaces()):
        s = fleet.sealer(ns)
        names = sorted(s.name(h) for h in index.pinned(ns))
        body = json.dumps({"node": node, "updated": time.time(), "pinned": names}).encode()
        key = pins_key(s.folder, node)
        bucket.put(key, s.seal(key, body))
        total += len(names)
    return total


class _Tree:
    """The records of one listing, as a tree per namespace (by names)."""

    def __init__(self, bucket: Bucket):
        self.objects: dict[bytes, ObjectKey] = {}
        self.pins_objects: list[tuple[str, str]] = []  # (key, namespace folder)
        self.manifests: list[str] = []
        self.foreign: list[str] = []
        for path, size, modified in bucket.walk(""):
            key = parse_key(path, size, modified)
            other = None if key is not None else parse_other(path)
            if key is not None:
                self.objects[key.hash] = key
            elif other is not None and other[0] == "pins":
                self.pins_objects.append((path, other[1]))
            elif other is not None:
                self.manifests.append(other[1])
            elif _NAME.fullmatch(path.partition("/")[0]):  # in a namespace folder, not of the layout
                self.foreign.append(path)  # (anything else may be a nested prefix: another team's)
        _break_cycles(self.objects)
        self.children: dict[bytes, list[bytes]] = {}
        for k in self.objects.values():
            self.children.setdefault(k.parent, []).append(k.hash)
        self._depth: dict[bytes, int] = {}

    def depth(self, h: bytes) -> int:
        """1 for a record under its namespace; a large number for one whose parent is gone, or
        that no namespace reaches (its parents go round in a cycle)."""
        path: list[bytes] = []
        seen: set[bytes] = set()
        while h not in self._depth:
            k = self.objects.get(h)
            if k is None or k.parent == k.ns:
                self._depth[h] = 0 if k is None else 1
                break
            if k.parent not in self.objects or h in seen:
                self._depth[h] = _UNREACHABLE  # an orphan: nothing reaches it, it goes first
                break
            seen.add(h)
            path.append(h)
            h = k.parent
        for p in reversed(path):
            if p not in self._depth:
                self._depth[p] = min(self._depth[self.objects[p].parent] + 1, _UNREACHABLE)
        return self._depth[path[0]] if path else self._depth[h]

    def orphans(self) -> list[ObjectKey]:
        return [k for k in self.objects.values() if k.parent != k.ns and k.parent not in self.objects]

    def subtree(self, roots) -> set[bytes]:
        out, todo = set(), list(roots)
        while todo:
            h = todo.pop()
            if h in out:
                continue
            out.add(h)
            todo += self.children.get(h, [])
        return out

    def ancestors(self, hashes: set[bytes]) -> set[bytes]:
        """`hashes` and every record above them in the listing (a cycle ends the walk)."""
        out = set(hashes) & set(self.objects)
        for h in list(out):
            k = self.objects[h]
            while k.parent in self.objects and k.parent not in out:
                out.add(k.parent)
                k = self.objects[k.parent]
        return out

    def delete(self, bucket: Bucket, hashes: set[bytes]) -> None:
        """Delete records a depth level at a time, deepest first."""
        levels: dict[int, list[str]] = {}
        for h in hashes:
            levels.setdefault(self.depth(h), []).append(self.objects[h].path)
        for depth in sorted(levels, reverse=True):
            bucket.delete(levels[depth])


_UNREACHABLE = 1 << 20
_NAME = re.compile(r"[0-9a-f]{32}")
#: The parent a record in a cycle of parents is given: none, so it is an orphan.
_NO_PARENT = b"\xff" * 16


def _break_cycles(objects: dict[bytes, ObjectKey]) -> None:
    """Records whose parents go round in a cycle (planted: a name is a MAC of a chain hash) lose
    their parent, so every walk ends and they are orphans."""
    done: set[bytes] = set()
    for start in list(objects):
        walk: dict[bytes, int] = {}
        h = start
        while h in objects and h not in done and h not in walk:
            walk[h] = len(walk)
            k = objects[h]
            h = k.parent if k.parent != k.ns else b""
        if h in walk:  # came back: the records from h on are a cycle
            cycle = list(walk)[walk[h]:]
            for c in cycle:
                objects[c] = dataclasses.replace(objects[c], parent=_NO_PARENT)
        done.update(walk)


def namespaces(bucket: Bucket, fleet: Fleet, folders, local=()) -> dict[str, tuple[bytes, int | None, Fleet]]:
    """Namespace folder -> (namespace, chunk size if its manifest says, the fleet key it is of)
    for the folders given: from this node's own namespaces (`local`) and from the manifests that
    open, under each key of the fleet."""
    out: dict[str, tuple[bytes, int | None, Fleet]] = {}
    for f in reversed(fleet.keyring()):  # the current key's names last: they win
        out.update((f.ns_name(ns), (ns, None, f)) for ns in local)
    for folder in folders:
        key = manifest_key(folder)
        try:
            body = bucket.get(key, max_bytes=1 << 20)
        except RemoteError:
            continue
        for f in fleet.keyring():
            try:
                m = json.loads(f.manifest_box(folder).open(key, body)) if body is not None else None
                ns = bytes.fromhex(m["namespace"])
                size = int(m["chunk_size"])
            except (Unauthenticated, ValueError, KeyError, TypeError):
                continue
            if f.ns_name(ns) == folder and size >= 1:
                out[folder] = (ns, size, f)
                break
    return out


def collect_remote(bucket: Bucket, fleet: Fleet, local=(), *, max_bytes: int | None = None,
                   max_age: float | None = None, dry_run: bool = False, now: float | None = None) -> dict:
    """Delete records of the bucket older than `max_age` seconds, then until it holds at most
    `max_bytes`, by the rule local gc follows (`upkeep.evict`: least recently used leaf first,
    an object's last-modified time standing for its last access; records whose parent is gone
    first); never a pinned record, its ancestors or its checkpoints, and never a record before
    its children."""
    started = time.perf_counter()
    tree = _Tree(bucket)
    keep = _kept(bucket, fleet, tree, local)
    objects = list(tree.objects.values())
    total = sum(k.size for k in objects)
    cutoff = None if max_age is None else (time.time() if now is None else now) - max_age
    p = evict.Victims.empty()
    if cutoff is not None or (max_bytes is not None and total > max_bytes):  # as local gc: only when asked
        graph = evict.Graph.from_rows([(k.hash, k.parent, k.size, k.modified, k.hash in keep, False, k.parent == k.ns)
                                       for k in objects])
        p = evict.choose_victims(graph, max_bytes=max_bytes, cutoff=cutoff, stale=False)
    freed = int(p.sizes.sum()) if len(p) else 0
    if not dry_run and len(p):
        _delete_in_rounds(bucket, tree, p)
    return {"evicted": len(p), "freed_bytes": freed, "bytes_before": total, "bytes": total - freed,
            "records": len(objects) - len(p), "kept_pinned": len(keep), "dry_run": dry_run,
            "seconds": time.perf_counter() - started}


def _kept(bucket: Bucket, fleet: Fleet, tree: _Tree, local) -> set[bytes]:
    """The records every node's pins object keeps: the pinned, their ancestors and their
    checkpoints. The pins of a namespace no key of the fleet opens (not this node's, no manifest
    that opens) keep nothing: nothing could ever be read from it."""
    spaces = namespaces(bucket, fleet, {folder for _, folder in tree.pins_objects}, local)
    pinned: set[bytes] = set()
    for path, folder in tree.pins_objects:
        if folder not in spaces:
            continue
        ns, _, f = spaces[folder]
        s = f.sealer(ns)
        try:
            body = bucket.get(path, max_bytes=64 << 20)
            names = json.loads(s.open(path, body)).get("pinned", []) if body is not None else []
            pinned.update(bytes.fromhex(h) for h in names)
        except Unauthenticated:  # not a fleet node's: ignored
            continue
        except (ValueError, AttributeError, TypeError) as e:
            raise RemoteError(f"a pins object of the bucket is unreadable ({e}): fix or delete it before gc") from e
    keep = tree.ancestors(pinned)
    return keep | {c for h in keep for c in tree.children.get(h, []) if tree.objects[c].kind == CHECKPOINT}


def _delete_in_rounds(bucket: Bucket, tree: _Tree, p: evict.Victims) -> None:
    """Delete the plan a round of leaf peeling at a time (its H): every child of a record is in
    an earlier round, so at every instant each remaining record's parent is still there."""
    rounds: dict[int, list[str]] = {}
    for h, height in zip(p.hashes, p.heights.tolist()):
        rounds.setdefault(height, []).append(tree.objects[h].path)
    for height in sorted(rounds):
        bucket.delete(rounds[height])


def verify_remote(bucket: Bucket, fleet: Fleet, local=(), *, repair: bool = False,
                  threads: int = 8) -> list[Problem]:
    """Download and check every record of the bucket (sealed by the fleet for its key, checksums,
    header, tokens against its names) and the tree (no record without its parent). `repair`
    deletes the bad records and, to keep every chain a prefix, everything below them."""
    tree = _Tree(bucket)
    spaces = namespaces(bucket, fleet, {k.ns.hex() for k in tree.objects.values()}, local)
    caps = _size_caps(tree.objects.values())
    problems: list[Problem] = []
    bad: set[bytes] = set()

    def check(k: ObjectKey) -> tuple[str, str] | None:
        known = spaces.get(k.ns.hex())
        if known is None or k.owned:
            return None  # said once per namespace below; a tenant's: sealed with a key only its nodes derive
        cap = caps[(k.ns, k.kind == CHECKPOINT)]
        if k.size > cap:  # planted: never read
            return "corrupt_object", f"{k.size} bytes, more than a record of its namespace is ({cap})"
        try:
            buf = bucket.get(k.path, max_bytes=cap)
        except RemoteError as e:
            return "corrupt_object", f"cannot download: {e}"
        if buf is None:
            return None  # deleted since the listing
        depth = None
        if k.parent == k.ns or k.parent in tree.objects:
            depth = tree.depth(k.parent) if k.kind == CHECKPOINT else tree.depth(k.hash)
        try:
            _check_listed(known[2].sealer(known[0]), k, buf, depth, known[1])
        except Unauthenticated as e:
            return "unauthenticated_object", str(e)
        except BlobError as e:
            return "corrupt_object", str(e)
        return None

    keys_ = list(tree.objects.values())
    with ThreadPoolExecutor(threads) as pool:
        for k, found in zip(keys_, pool.map(check, keys_)):
            if found is not None:
                problems.append(Problem(found[0], k.path, found[1], k.hash.hex()))
                if not found[1].startswith("cannot download"):
                    bad.add(k.hash)
    for folder in sorted({k.ns.hex() for k in keys_} - set(spaces)):
        problems.append(Problem("unknown_namespace", folder, "no manifest that opens with the fleet's keys, and "
                                "not a namespace of this store: its records are not checked, and gc keeps "
                                "none of them for its pins (they age out)"))
    for k in tree.orphans():
        problems.append(Problem("orphan_object", k.path, "its parent is not in the bucket", k.hash.hex()))
        bad.add(k.hash)
    for path in tree.foreign:
        problems.append(Problem("foreign_object", path, "not a kvstore object (left alone)"))
    if repair and bad:
        tree.delete(bucket, tree.subtree(bad) & set(tree.objects))
    return problems


def _size_caps(objects) -> dict[tuple[bytes, bool], int]:
    """(namespace, is a checkpoint) -> the most bytes verify reads of one object: twice the
    median size of the namespace's chunks (a tail is smaller), or checkpoints (all one size),
    and 1 MiB. A bucket writer would have to plant more objects than the fleet wrote to raise it."""
    sizes: dict[tuple[bytes, bool], list[int]] = {}
    for k in objects:
        if k.kind != TAIL:
            sizes.setdefault((k.ns, k.kind == CHECKPOINT), []).append(k.size)
    caps = {key: min(MAX_OBJECT_BYTES, 2 * sorted(v)[(len(v) - 1) // 2] + (1 << 20)) for key, v in sizes.items()}
    return defaultdict(lambda: MAX_OBJECT_BYTES, caps)


def _check_listed(s: Sealer, k: ObjectKey, buf, depth: int | None, chunk_size: int | None) -> None:
    """Raise BlobError unless the object at `k` opens and is the record its names say."""
    from kvstore.remote.objects import check_record, named_record
    from kvstore.storage import blobformat

    plain = s.open(k.path, buf)
    try:
        meta = blobformat.header_metadata(plain)
        parent = bytes.fromhex(meta.get("parent", ""))
        stated = int(meta.get("chunk_size", ""))
    except Exception as e:  # garbage of any shape
        raise BlobError(f"its header states no parent or chunk size ({e})") from None
    if chunk_size is None:
        chunk_size = stated
    if chunk_size < 1 or s.name(parent) != k.parent.hex():
        raise BlobError(f"its header states chunk size {stated} and a parent its key does not name")
    rid = named_record(s, plain, RecordId(k.hash, s.ns, parent, depth, k.kind, k.ntokens, None))
    tokens = check_record(plain, rid, chunk_size)
    if k.kind != CHECKPOINT and s.children(parent, int(tokens[0])) != k.branch:
        raise BlobError("its key's branch is not that of its first token")


def drop_key(bucket: Bucket, fleet: Fleet, local=(), *, key_id: str, dry_run: bool = False) -> dict:
    """Delete every object of the namespaces of the older key `key_id` of `fleet` (records deepest
    first, then pins and manifests): what only that key opens. The end of a key rotation."""
    kid = key_id
    old = next((f for f in fleet.older if f.key_id == kid), None)
    if old is None:
        known = ", ".join(f.key_id for f in fleet.older) or "none"
        raise InvalidInputError(f"--drop-key {kid}: not an older key of this fleet (older keys: {known}; the key "
                                f"written with, {fleet.key_id}, cannot be dropped)")
    tree = _Tree(bucket)
    folders = {k.ns.hex() for k in tree.objects.values()} | set(tree.manifests) | {f for _, f in tree.pins_objects}
    mine = {folder for folder, (_, _, f) in namespaces(bucket, fleet, folders, local).items() if f is old}
    records = {h for h, k in tree.objects.items() if k.ns.hex() in mine}
    others = [manifest_key(f) for f in mine if f in tree.manifests] + [p for p, f in tree.pins_objects if f in mine]
    size = sum(tree.objects[h].size for h in records)
    if not dry_run:
        tree.delete(bucket, records)
        bucket.delete(others)
    return {"key": kid, "namespaces": len(mine), "records": len(records), "objects": len(records) + len(others),
            "bytes": size, "dry_run": dry_run}
