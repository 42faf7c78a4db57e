"""Keeping the bucket of a remote tier bounded (`collect_remote`) and whole (`verify_remote`).

Both work from one listing of `PREFIX/`: every record's key names its namespace and parent, so
the tree of records is known without reading any object. gc chooses what goes by local gc's rule
(`upkeep.evict`); deletions go children first, a level at a time, so at every instant each
remaining record's parent is still there (the binary search of a lookup relies on it).

Pins are known only to the node that pinned a prompt. Each node publishes them as
`<ns>/pins/<node>.json` (the hashes of its pinned records, which include their ancestors):
after it uploads pinned records, and before it runs `gc --remote` or `verify --remote`. gc reads
every node's pins object and keeps those records, their ancestors and their checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.errors import BlobError
from kvstore.records import CHECKPOINT
from kvstore.remote.bucket import Bucket, RemoteError
from kvstore.remote.layout import ObjectKey, parse_key, pins_key
from kvstore.storage.storedir import NODE_ID_NAME
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
    tmp = path.with_name(f".{NODE_FILE}.{os.getpid()}")
    try:
        os.unlink(tmp)  # a leftover of a dead process with this pid
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
    return text


def publish_pins(bucket: Bucket, index: "Index", node: str, namespaces=None) -> int:
    """Write this node's pins object for each namespace (`namespaces`, default all it knows).
    Returns how many pinned records were published."""
    total = 0
    for ns in sorted(namespaces if namespaces is not None else index.namespaces()):
        hashes = sorted(h.hex() for h in index.pinned(ns))
        body = json.dumps({"node": node, "updated": time.time(), "pinned": hashes}).encode()
        bucket.put(pins_key(ns, node), body)
        total += len(hashes)
    return total


class _Tree:
    """The records of one listing, as a tree per namespace."""

    def __init__(self, bucket: Bucket):
        self.objects: dict[bytes, ObjectKey] = {}
        self.pins_objects: list[str] = []
        self.foreign: list[str] = []
        for path, size, modified in bucket.walk(""):
            key = parse_key(path, size, modified)
            if key is not None:
                self.objects[key.hash] = key
            elif "/pins/" in path and path.endswith(".json"):
                self.pins_objects.append(path)
            elif not path.endswith("/manifest.json"):
                self.foreign.append(path)
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


def collect_remote(bucket: Bucket, *, max_bytes: int | None = None, max_age: float | None = None,
                   dry_run: bool = False, now: float | None = None) -> dict:
    """Delete records of the bucket older than `max_age` seconds, then until it holds at most
    `max_bytes`, by the rule local gc follows (`upkeep.evict`: least recently used leaf first,
    an object's last-modified time standing for its last access; records whose parent is gone
    first); never a pinned record, its ancestors or its checkpoints, and never a record before
    its children."""
    started = time.perf_counter()
    tree = _Tree(bucket)
    keep = _kept(bucket, tree)
    objects = list(tree.objects.values())
    total = sum(k.size for k in objects)
    cutoff = None if max_age is None else (time.time() if now is None else now) - max_age
    p = evict.Plan.empty()
    if cutoff is not None or (max_bytes is not None and total > max_bytes):  # as local gc: only when asked
        graph = evict.Graph.from_rows([(k.hash, k.parent, k.size, k.modified, k.hash in keep, False, k.parent == k.ns)
                                       for k in objects])
        p = evict.plan(graph, max_bytes=max_bytes, cutoff=cutoff, stale=False)
    freed = int(p.sizes.sum()) if len(p) else 0
    if not dry_run and len(p):
        _delete_in_rounds(bucket, tree, p)
    return {"evicted": len(p), "freed_bytes": freed, "bytes_before": total, "bytes": total - freed,
            "records": len(objects) - len(p), "kept_pinned": len(keep), "dry_run": dry_run,
            "seconds": time.perf_counter() - started}


def _kept(bucket: Bucket, tree: _Tree) -> set[bytes]:
    """The records every node's pins object keeps: the pinned, their ancestors and their checkpoints."""
    pinned: set[bytes] = set()
    for path in tree.pins_objects:
        body = bucket.get(path)
        try:
            pinned.update(bytes.fromhex(h) for h in json.loads(body or b"{}").get("pinned", []))
        except (ValueError, AttributeError, TypeError) as e:
            raise RemoteError(f"pins object {path} is unreadable ({e}): fix or delete it before gc") from e
    keep = tree.ancestors(pinned)
    return keep | {c for h in keep for c in tree.children.get(h, []) if tree.objects[c].kind == CHECKPOINT}


def _delete_in_rounds(bucket: Bucket, tree: _Tree, p: evict.Plan) -> None:
    """Delete the plan a round of leaf peeling at a time (its H): every child of a record is in
    an earlier round, so at every instant each remaining record's parent is still there."""
    rounds: dict[int, list[str]] = {}
    for h, height in zip(p.hashes, p.heights.tolist()):
        rounds.setdefault(height, []).append(tree.objects[h].path)
    for height in sorted(rounds):
        bucket.delete(rounds[height])


def verify_remote(bucket: Bucket, *, repair: bool = False, threads: int = 8) -> list[Problem]:
    """Download and check every record of the bucket (checksums, header, tokens against its key)
    and the tree (no record without its parent). `repair` deletes the bad records and, to keep
    every chain a prefix, everything below them."""
    from kvstore.remote.objects import check_record

    tree = _Tree(bucket)
    problems: list[Problem] = []
    bad: set[bytes] = set()

    def check(k: ObjectKey) -> str | None:
        try:
            buf = bucket.get(k.path)
        except RemoteError as e:
            return f"cannot download: {e}"
        if buf is None:
            return None  # deleted since the listing
        depth = None
        if k.parent == k.ns or k.parent in tree.objects:
            depth = tree.depth(k.parent) if k.kind == CHECKPOINT else tree.depth(k.hash)
        try:
            tokens = check_record(buf, dataclasses.replace(k, depth=depth), _chunk_size(buf))
        except BlobError as e:
            return str(e)
        if k.kind != CHECKPOINT and int(tokens[0]) != k.first_token:
            return f"its key says its first token is {k.first_token}, it holds {int(tokens[0])}"
        return None

    keys_ = list(tree.objects.values())
    with ThreadPoolExecutor(threads) as pool:
        for k, detail in zip(keys_, pool.map(check, keys_)):
            if detail is not None:
                problems.append(Problem("corrupt_object", k.path, detail, k.hash.hex()))
                if not detail.startswith("cannot download"):
                    bad.add(k.hash)
    for k in tree.orphans():
        problems.append(Problem("orphan_object", k.path, "its parent is not in the bucket", k.hash.hex()))
        bad.add(k.hash)
    for path in tree.foreign:
        problems.append(Problem("foreign_object", path, "not a kvstore object (left alone)"))
    if repair and bad:
        tree.delete(bucket, tree.subtree(bad) & set(tree.objects))
    return problems


def _chunk_size(buf: bytes) -> int:
    """The chunk size a blob's header states (checked against its tokens by `check_record`)."""
    from kvstore.storage import blobformat

    try:
        return int(blobformat.header_metadata(buf).get("chunk_size", ""))
    except Exception as e:  # garbage of any shape
        raise BlobError(f"its header states no chunk size ({e})") from e
