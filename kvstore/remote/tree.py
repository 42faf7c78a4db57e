"""One listing of a bucket's prefix, and the tree of records its keys make.

Every record's key names (by MAC, `remote.seal`) its namespace and parent, so the tree of
records is known without reading any object. Only keys of exactly the layout count
(`layout.parse_key`); a nested prefix is another team's. Records whose parents go round in a
cycle (planted: a name is a MAC of a chain hash) lose their parent, so they are orphans.
Used by bucket upkeep (`remote.upkeep`): knows names, sizes and times, never an object's body.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from kvstore.remote.bucket import Bucket
from kvstore.remote.layout import ObjectKey, parse_key, parse_other


class Listing:
    """One listing of the bucket: its records, pins objects, manifests, and the objects in a
    namespace folder that are not of the layout."""

    def __init__(self, bucket: Bucket):
        self.records: list[ObjectKey] = []
        self.pins_objects: list[tuple[str, str]] = []  # (key, namespace folder)
        self.manifests: list[str] = []
        self.others: dict[str, list[tuple[str, int, float]]] = defaultdict(list)  # folder -> pins, manifest
        self.foreign: list[str] = []
        for path, size, modified in bucket.walk(""):
            key = parse_key(path, size, modified)
            other = None if key is not None else parse_other(path)
            if key is not None:
                self.records.append(key)
                continue
            if other is not None:
                (self.pins_objects.append((path, other[1])) if other[0] == "pins" else self.manifests.append(other[1]))
                self.others[other[1]].append((path, size, modified))
            elif _NAME.fullmatch(path.partition("/")[0]):  # in a namespace folder, not of the layout
                self.foreign.append(path)  # (anything else may be a nested prefix: another team's)

    def folders(self) -> set[str]:
        return {k.ns.hex() for k in self.records} | set(self.others)

    def split(self, known) -> tuple["Tree", dict[str, list[ObjectKey]]]:
        """The tree of the records of the `known` folders, and the records of each other folder."""
        strays: dict[str, list[ObjectKey]] = defaultdict(list)
        for k in self.records:
            if k.ns.hex() not in known:
                strays[k.ns.hex()].append(k)
        return Tree([k for k in self.records if k.ns.hex() in known]), strays


class Tree:
    """Records of a listing, as a tree per namespace (by names; the first of a name listed wins)."""

    def __init__(self, records):
        self.objects: dict[bytes, ObjectKey] = {}
        for k in records:
            self.objects.setdefault(k.hash, k)
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

    def known_depth(self, h: bytes) -> int | None:
        """`depth(h)`, or None when no namespace reaches it (it hangs below an orphan, or in a cycle)."""
        depth = self.depth(h)
        return depth if depth < _UNREACHABLE else None

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
