"""Keeping the bucket of a remote tier bounded (`collect_remote`) and whole (`verify_remote`).

Both work from one listing of `PREFIX/`: every record's key names its namespace and parent, so
the tree of records is known without reading any object. Deletions go deepest first, a level at a
time, so at every instant each remaining record's parent is still there (the binary search of a
lookup relies on it).

Pins are known only to the node that pinned a prompt. Each node publishes them as
`<ns>/pins/<node>.json` (the hashes of its pinned records, which include their ancestors):
after it uploads pinned records, and before it runs `gc --remote` or `verify --remote`. gc reads
every node's pins object and keeps those records, their ancestors and their checkpoints.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.errors import BlobError
from kvstore.remote.bucket import Bucket, RemoteError
from kvstore.remote.layout import ObjectKey, parse_key, pins_key
from kvstore.storage.index import CHECKPOINT
from kvstore.upkeep.maintenance import Problem

if TYPE_CHECKING:
    from kvstore.storage.index import Index

NODE_FILE = "remote-node-id"


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
        """1 for a record under its namespace; a large number for one whose parent is gone."""
        path = []
        while h not in self._depth:
            k = self.objects.get(h)
            if k is None or k.parent == k.ns:
                self._depth[h] = 0 if k is None else 1
                break
            if k.parent not in self.objects:
                self._depth[h] = 1 << 20  # an orphan: nothing reaches it, it goes first
                break
            path.append(h)
            h = k.parent
        for p in reversed(path):
            k = self.objects[p]
            self._depth[p] = self._depth[k.parent] + 1
        return self._depth[h] if not path else self._depth[path[0]]

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

    def delete(self, bucket: Bucket, hashes: set[bytes]) -> None:
        """Delete records a depth level at a time, deepest first."""
        levels: dict[int, list[str]] = {}
        for h in hashes:
            levels.setdefault(self.depth(h), []).append(self.objects[h].path)
        for depth in sorted(levels, reverse=True):
            bucket.delete(levels[depth])


def collect_remote(bucket: Bucket, *, max_bytes: int | None = None, max_age: float | None = None,
                   dry_run: bool = False, now: float | None = None) -> dict:
    """Delete records of the bucket older than `max_age` seconds, then the deepest (oldest first)
    until it holds at most `max_bytes`; never a pinned record, its ancestors or its checkpoints,
    and never a record before its children."""
    started = time.perf_counter()
    tree = _Tree(bucket)
    keep: set[bytes] = set()
    for path in tree.pins_objects:
        body = bucket.get(path)
        try:
            pinned = json.loads(body or b"{}").get("pinned", [])
            keep.update(bytes.fromhex(h) for h in pinned)
        except (ValueError, AttributeError, TypeError) as e:
            raise RemoteError(f"pins object {path} is unreadable ({e}): fix or delete it before gc") from e
    for h in list(keep):  # ancestors of pinned records
        k = tree.objects.get(h)
        while k is not None and k.parent in tree.objects and k.parent not in keep:
            keep.add(k.parent)
            k = tree.objects[k.parent]
    keep |= {c for h in list(keep) for c in tree.children.get(h, []) if tree.objects[c].kind == CHECKPOINT}
    keep &= set(tree.objects)
    total = sum(k.size for k in tree.objects.values())
    remaining = {h: len(c) for h, c in tree.children.items()}
    gone: set[bytes] = set()

    def leaf(h: bytes) -> bool:
        return h not in keep and h not in gone and remaining.get(h, 0) == 0

    def drop(h: bytes) -> None:
        gone.add(h)
        parent = tree.objects[h].parent
        if parent in remaining:
            remaining[parent] -= 1

    now = time.time() if now is None else now
    if max_age is not None:
        old = sorted((h for h, k in tree.objects.items() if k.modified < now - max_age),
                     key=tree.depth, reverse=True)
        for h in old:  # children come first, so a parent goes only if every child went
            if leaf(h):
                drop(h)
    freed = sum(tree.objects[h].size for h in gone)
    if max_bytes is not None and total - freed > max_bytes:
        heap = [(-tree.depth(h), k.modified, h) for h, k in tree.objects.items() if leaf(h)]
        heapq.heapify(heap)
        while heap and total - freed > max_bytes:
            _, _, h = heapq.heappop(heap)
            if not leaf(h):
                continue
            drop(h)
            freed += tree.objects[h].size
            parent = tree.objects[h].parent
            if parent in tree.objects and leaf(parent):
                heapq.heappush(heap, (-tree.depth(parent), tree.objects[parent].modified, parent))
    if not dry_run and gone:
        tree.delete(bucket, gone)
    return {"evicted": len(gone), "freed_bytes": freed, "bytes_before": total, "bytes": total - freed,
            "records": len(tree.objects) - len(gone), "kept_pinned": len(keep), "dry_run": dry_run,
            "seconds": time.perf_counter() - started}


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
