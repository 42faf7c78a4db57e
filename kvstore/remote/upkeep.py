"""Keeping the bucket of a remote tier bounded (`collect_remote`) and whole (`verify_remote`).

Both work from one listing of `PREFIX/`: every record's key names (by MAC, `remote.seal`) its
namespace and parent, so the tree of records is known without reading any object. Only keys of
exactly the layout count (`layout.parse_key`): a nested prefix is another team's, never touched.
gc chooses what goes by local gc's rule (`upkeep.evict`); deletions go children first, a level
at a time, so at every instant each remaining record's parent is still there (the binary search
of a lookup relies on it). Records whose parents go round in a cycle are orphans.

Nothing a bucket writer can put in the bucket steers either (it holds no fleet secret):
- A namespace folder is known from this node's index or from its manifest (sealed under a key
  derived from its folder name), under any of the fleet's keys (a rotation not finished). One no
  key opens is an unknown namespace: verify notes it (not a problem: another fleet's, or a key
  since dropped) and checks nothing in it; gc counts none of its bytes against `max_bytes`, and
  deletes it only when told (`drop_unknown`) or once its newest object is `UNKNOWN_MAX_AGE`
  old. Its pins keep nothing. None is deleted while this node's key is not the fleet's (by the
  bucket's key markers, `remote.health.KeyCheck`): verify reports `wrong_key` then.
- An object in a namespace folder that is not of the layout cannot be told to be kvstore's:
  verify notes it, and neither verify's repair nor gc deletes it.
- The most bytes a record can be comes from the model's geometry, which the sealed manifest
  states (written by a node that has the model), never from the sizes the bucket holds. A
  namespace whose manifest states none (written before it did) is judged by its contents only.
- Pins (`remote.pins`) carry a serial: an older copy put back, or one seen deleted, is detected,
  and gc keeps this node's pinned records from its index.
A tenant's records (`.tchunk`...) are sealed with their tenant's key, which gc and verify do not
have: gc keeps their tree by names as any other, verify counts them unopened. `drop_key` deletes
every object of the namespaces of an older key (the end of a rotation).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from kvstore.errors import BlobError, InvalidInputError
from kvstore.records import CHECKPOINT, RecordId, SizeBound
from kvstore.remote.bucket import MAX_OBJECT_BYTES, Bucket, RemoteError
from kvstore.remote.health import Health, KeyCheck
from kvstore.remote.layout import ObjectKey, manifest_key, marker_key
from kvstore.remote.pins import Ledger, Pins, publish, read_all
from kvstore.remote.seal import OVERHEAD, Fleet, Sealer, Unauthenticated
from kvstore.remote.tree import Listing, Tree
from kvstore.sizes import format_size
from kvstore.upkeep import evict
from kvstore.upkeep.verify import Problem

log = logging.getLogger("kvstore")

#: An unknown namespace goes at the first gc --remote after its newest object is this old (seconds).
UNKNOWN_MAX_AGE = 30 * 86400.0


@dataclasses.dataclass(frozen=True)
class Space:
    """A namespace folder this node can read: its namespace, the key that opens it, and what its
    manifest states (None: no manifest that opens, or one written before it said so)."""

    ns: bytes
    fleet: Fleet
    chunk_size: int | None = None
    bound: SizeBound | None = None  # the most bytes a record of it can be

    def sealer(self) -> Sealer:
        return self.fleet.sealer(self.ns)

    def cap(self, k: ObjectKey) -> int | None:
        """The most bytes the record at `k` can be (its sealing included), or None if not known."""
        if self.bound is None or self.chunk_size is None:
            return None
        return min(MAX_OBJECT_BYTES, self.bound(k.kind, min(k.ntokens, self.chunk_size)) + OVERHEAD)


class Findings(list):
    """What `verify_remote` found: a list of problems; `notes`, what it leaves alone (unknown
    namespaces, objects in a namespace folder that are not of the layout: nothing in them is
    judged, nothing needs doing, and they do not make the bucket unclean); `repairable`, the
    problems repair deals with (with `repair`: dealt with), and `deletes`, the objects it deletes
    for them (with `repair`: deleted), the damaged ones and everything below them. The other
    problems are left by repair (each one's detail says why)."""

    def __init__(self, problems=(), notes=(), repairable=(), deletes: int = 0):
        super().__init__(problems)
        self.notes: list[Problem] = list(notes)
        self.repairable: list[Problem] = list(repairable)
        self.deletes = deletes



def namespaces(bucket: Bucket, fleet: Fleet, folders, local=()) -> dict[str, Space]:
    """Namespace folder -> `Space` for the folders given that this node can read: its own
    namespaces (`local`) and those whose manifest opens, under each key of the fleet."""
    out: dict[str, Space] = {}
    for f in reversed(fleet.keyring()):  # the current key's names last: they win
        out.update((f.ns_name(ns), Space(ns, f)) for ns in local)
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
                out[folder] = Space(ns, f, size, SizeBound.from_dict(m.get("geometry")))
                break
    return out


def collect_remote(bucket: Bucket, fleet: Fleet, local=(), *, max_bytes: int | None = None,
                   max_age: float | None = None, dry_run: bool = False, now: float | None = None,
                   ledger: Ledger | None = None, drop_unknown: bool = False, keys: KeyCheck | None = None) -> dict:
    """Delete records of the bucket older than `max_age` seconds, then until it holds at most
    `max_bytes`, by the rule local gc follows (`upkeep.evict`: least recently used leaf first,
    an object's last-modified time standing for its last access; records whose parent is gone
    first); never a pinned record, its ancestors or its checkpoints, and never a record before
    its children. Only namespaces this node can read count; unknown ones are deleted whole
    when `drop_unknown`, or once their newest object is `UNKNOWN_MAX_AGE` old, and never while
    this node's key is not the fleet's (`KeyCheck`: they may be the fleet's). `ledger`: what
    this node knows of pins (`remote.pins`; default: nothing, with no store)."""
    started = time.perf_counter()
    now = time.time() if now is None else now
    keys = keys or KeyCheck(bucket, fleet, Health())
    wrong_key = keys.judge(local, claim=not dry_run)  # then the unknown may be the fleet's: none goes
    listing = Listing(bucket)
    spaces = namespaces(bucket, fleet, listing.folders(), local)
    tree, strays = listing.split(spaces)
    keep = _kept(bucket, listing, tree, spaces, ledger or Ledger())
    objects = list(tree.objects.values())
    total = sum(k.size for k in objects)
    cutoff = None if max_age is None else now - max_age
    planted = _oversized(tree, spaces)  # no record: they go first, and never count against the budget
    p = evict.Victims.empty()
    if cutoff is not None or (max_bytes is not None and total > max_bytes) or planted:  # as local gc: when asked
        graph = evict.Graph.from_rows([(k.hash, k.parent, k.size, k.modified, k.hash in keep.kept and k.hash
                                        not in planted, k.hash in planted, k.parent == k.ns) for k in objects])
        p = evict.choose_victims(graph, max_bytes=max_bytes, cutoff=cutoff, stale=bool(planted))
    freed = int(p.sizes.sum()) if len(p) else 0
    if not dry_run and len(p):
        _delete_in_rounds(bucket, tree, p)
    unknown = _unknown(listing, strays, set(spaces), now)
    # A key marker none of this node's keys names: a key of the fleet this node lacks (a rotation
    # it was not given) may open them, so none goes, as with a wrong key.
    strangers = keys.strangers() if unknown and not wrong_key else 0
    dropped = {f: u for f, u in unknown.items()
               if not wrong_key and not strangers and (drop_unknown or now - u["newest"] >= UNKNOWN_MAX_AGE)}
    if not dry_run:
        for folder in dropped:
            _drop_folder(bucket, listing, strays.get(folder, []), folder)
    return {"evicted": len(p), "freed_bytes": freed, "bytes_before": total, "bytes": total - freed,
            "records": len(objects) - len(p), "kept_pinned": len(keep.pinned), "dry_run": dry_run,
            "kept_held": len(keep.kept - keep.pinned), "held": [str(r) for r in keep.rollbacks if not r.own],
            "held_namespaces": len(keep.held), "rollbacks": [str(r) for r in keep.rollbacks],
            "unknown_namespaces": len(unknown), "unknown_bytes": sum(u["bytes"] for u in unknown.values()),
            "dropped_namespaces": len(dropped), "dropped_objects": sum(u["objects"] for u in dropped.values()),
            "dropped_bytes": sum(u["bytes"] for u in dropped.values()), "wrong_key": wrong_key,
            "oversized": len(planted), "oversized_bytes": sum(tree.objects[h].size for h in planted),
            "other_key_markers": strangers,
            "no_namespace_opens": keys.foreign if wrong_key else 0,
            "seconds": time.perf_counter() - started}


def _oversized(tree: Tree, spaces: dict[str, Space]) -> set[bytes]:
    """The objects larger than a record of their namespace can be (by its manifest's geometry),
    with nothing below them but such objects: planted, not records (a bucket writer's junk would
    otherwise count against `max_bytes` and make gc delete the fleet's records). One with a
    record below it is left to `verify --remote --repair` (which deletes it and what is below)."""
    big = set()
    for h, k in tree.objects.items():
        cap = spaces[k.ns.hex()].cap(k)
        if cap is not None and k.size > cap:
            big.add(h)
    return {h for h in big if tree.subtree({h}) <= big}


@dataclasses.dataclass
class _Kept(Pins):
    kept: set[bytes] = dataclasses.field(default_factory=set)  # every record gc must keep
    pinned: set[bytes] = dataclasses.field(default_factory=set)  # of them, pinned (ancestors, checkpoints)


def _kept(bucket: Bucket, listing: Listing, tree: Tree, spaces: dict[str, Space], ledger: Ledger) -> _Kept:
    """The records the pins keep: every node's pinned (this node's from its index), their
    ancestors and their checkpoints; every record of a namespace whose pins were rolled back by
    another node's (said). A pins object that opens and is not one stops gc."""
    pins = read_all(bucket, listing.pins_objects, {f: s.sealer() for f, s in spaces.items()}, ledger, listing.folders())
    if pins.unreadable:
        path, why = pins.unreadable[0]
        raise RemoteError(f"a pins object of the bucket is unreadable ({why}): fix or delete it before gc ({path})")
    for r in pins.rollbacks:
        log.warning("kvstore: remote %s: %s; %s", bucket.url, r, "gc keeps this node's pinned records (its index "
                    "says which), and publishes its pins again" if r.own else "gc deletes nothing of that "
                    "namespace until that node publishes its pins again")
    pinned = tree.ancestors(pins.names)
    pinned |= {c for h in pinned for c in tree.children.get(h, []) if tree.objects[c].kind == CHECKPOINT}
    keep = pinned | {h for h, k in tree.objects.items() if k.ns.hex() in pins.held}
    return _Kept(**vars(pins), kept=keep, pinned=pinned)


def _unknown(listing: Listing, strays: dict[str, list[ObjectKey]], known: set[str], now: float) -> dict[str, dict]:
    """Folder -> {objects, bytes, newest, age} of every namespace folder no key of the fleet opens."""
    out = {}
    for folder in sorted(listing.folders() - known):
        found = [(k.size, k.modified) for k in strays.get(folder, [])] + [(s, m) for _, s, m in listing.others[folder]]
        newest = max(m for _, m in found)
        out[folder] = {"objects": len(found), "bytes": sum(s for s, _ in found), "newest": newest, "age": now - newest}
    return out


def _drop_folder(bucket: Bucket, listing: Listing, records: list[ObjectKey], folder: str) -> None:
    """Delete every object of the layout in a namespace folder: records deepest first, then pins
    and manifest. Objects not of the layout are left (they may be a nested prefix's)."""
    tree = Tree(records)
    tree.delete(bucket, set(tree.objects))
    bucket.delete([k.path for k in records if tree.objects.get(k.hash) is not k])  # a name listed twice
    bucket.delete([path for path, _, _ in listing.others[folder]])


def _delete_in_rounds(bucket: Bucket, tree: Tree, p: evict.Victims) -> None:
    """Delete the plan a round of leaf peeling at a time (its H): every child of a record is in
    an earlier round, so at every instant each remaining record's parent is still there."""
    rounds: dict[int, list[str]] = {}
    for h, height in zip(p.hashes, p.heights.tolist()):
        rounds.setdefault(height, []).append(tree.objects[h].path)
    for height in sorted(rounds):
        bucket.delete(rounds[height])


def verify_remote(bucket: Bucket, fleet: Fleet, local=(), *, repair: bool = False, threads: int = 8,
                  ledger: Ledger | None = None, now: float | None = None, keys: KeyCheck | None = None) -> Findings:
    """Download and check every record of the namespaces this node can read (sealed by the fleet
    for its key, no larger than its manifest's geometry allows, checksums, header, tokens against
    its names), the tree (no record without its parent) and the pins (no older copy put back).
    `repair` deletes the bad records and, to keep every chain a prefix, everything below them,
    publishes this node's pins again if they were rolled back (or deleted), and forgets another
    node's whose pins object was deleted (taken as retired: gc holds its namespace no longer). What it leaves alone are
    notes, not problems: unknown namespaces, and objects that are not of the layout (kvstore
    deletes only what it can tell is its own). With a key that is not the fleet's (`KeyCheck`)
    it reports `wrong_key` and publishes nothing."""
    ledger = ledger or Ledger()
    keys = keys or KeyCheck(bucket, fleet, Health())
    wrong_key = keys.judge(local, claim=repair)
    listing = Listing(bucket)
    spaces = namespaces(bucket, fleet, listing.folders(), local)
    tree, strays = listing.split(spaces)
    problems, bad = _check_records(bucket, tree, spaces, threads)
    if wrong_key:  # what is the fleet's was not checked, and may be all of it: not clean
        problems.append(Problem("wrong_key", bucket.url, f"{keys.line()}; nothing in the namespaces this node's "
                                "keys do not open was checked, gc --remote deletes none of them, and this node "
                                "uploads nothing: give the fleet's secret (--remote-key-file, or KVSTORE_REMOTE_KEY)"))
    pins = read_all(bucket, listing.pins_objects, {f: s.sealer() for f, s in spaces.items()}, ledger, listing.folders())
    pinned, republish, forget = _pins_problems(pins, spaces, fleet, ledger)
    problems += pinned
    for path, why in pins.unreadable:
        problems.append(Problem("corrupt_object", path, f"a pins object that opens and is not one ({why})"))
    for k in tree.orphans():
        problems.append(Problem("orphan_object", k.path, "its parent is not in the bucket", k.hash.hex()))
        bad.add(k.hash)
    gone = tree.subtree(bad) & set(tree.objects)  # what repair deletes
    if repair and gone:
        tree.delete(bucket, gone)
    again = {spaces[p.path.partition("/")[0]].ns for p in republish}
    if repair and pins.shared and not wrong_key:  # a new id: every namespace of this node is published under it
        ledger.renew()
        again |= set(local)
    if repair and again and not wrong_key:
        publish(bucket, fleet, ledger, again)
    for p, node in forget if repair else ():
        ledger.forget(p.path.partition("/")[0], node)
    mended = republish + [p for p, _ in forget]
    repairable = [p for p in problems if any(p is q for q in mended) or (p.hash and bytes.fromhex(p.hash) in gone)]
    unknown = _unknown(listing, strays, set(spaces), time.time() if now is None else now)
    strangers = keys.strangers() if unknown and not wrong_key else 0
    notes = [Problem("unknown_namespace", folder, _unknown_note(u, listing, folder, bool(wrong_key), strangers))
             for folder, u in unknown.items()]
    # Not kvstore's to delete (a writer of the bucket put them there): listed, not judged.
    # (Those in an unknown namespace's folder are counted in its note.)
    notes += [Problem("foreign_object", path, "not a kvstore object: left alone (kvstore deletes only what it "
                      "can tell is its own)")
              for path in listing.foreign
              if path.partition("/")[0] in spaces or path.partition("/")[0] not in listing.folders()]
    return Findings(problems, notes, repairable, len(gone))


def _pins_problems(pins: Pins, spaces: dict[str, Space], fleet: Fleet, ledger: Ledger):
    """verify's problems with the pins objects: (problems, those repair publishes again, (those
    it forgets, the node))."""
    problems: list[Problem] = []
    republish: list[Problem] = []  # this node's own pins put back: repair publishes them again
    forget: list[tuple[Problem, str]] = []  # another node's deleted: repair takes that node as retired
    for r in pins.rollbacks:
        problems.append(Problem("rolled_back_pins", r.path, f"{r}; " + (
            "gc keeps this node's pinned records (its index says which); --repair publishes them again" if r.own
            else "gc deletes nothing of this namespace until that node publishes its pins again" + (
                "; if that node is retired for good, --repair forgets its pins on this node" if r.missing else ""))))
        if r.own and ledger.node is not None and spaces[r.path.partition("/")[0]].fleet is fleet:
            republish.append(problems[-1])
        elif not r.own and r.missing:
            forget.append((problems[-1], r.node))
    for path, serial, mine in pins.shared:
        problems.append(Problem("foreign_pins", path, f"this node's pins object has serial {serial}, which this "
                                f"store never wrote (its last is {mine}): another store publishes under this node's "
                                "id (a copy of this store folder?), and gc on other nodes goes by what it pins; "
                                "--repair gives this node a new id and publishes its pins under it"))
    for path, n in pins.behind:
        problems.append(Problem("unpublished_pins", path, f"this node's pins object lacks {n} of the records it "
                                "pins, which gc on other nodes may delete; --repair publishes its pins again"))
    republish += [p for p in problems if p.kind in ("foreign_pins", "unpublished_pins")
                  and spaces[p.path.partition("/")[0]].fleet is fleet]
    return problems, republish, forget


def _unknown_note(u: dict, listing: Listing, folder: str, wrong_key: bool, strangers: int = 0) -> str:
    foreign = sum(1 for p in listing.foreign if p.partition("/")[0] == folder)
    days = max(0, int((UNKNOWN_MAX_AGE - u["age"]) // 86400))
    kept = "gc --remote deletes it neither with --drop-unknown nor by its age while "
    if wrong_key:
        goes = kept + "this node's key is not the fleet's"
    elif strangers:
        goes = kept + f"the bucket holds {other_markers(strangers)}"
    else:
        goes = (f"it goes with `gc --remote --drop-unknown`, or by any gc --remote in {days} days (once its newest "
                f"object is {int(UNKNOWN_MAX_AGE // 86400)} days old)")
    return (f"{u['objects']} objects ({format_size(u['bytes'])}{f', and {foreign} not of the layout' if foreign else ''})"
            " that none of this node's keys opens (another fleet's, a key since dropped, or planted): not "
            f"checked, and not counted by gc --remote; {goes}")


def other_markers(n: int) -> str:
    """What the bucket holds when `n` key markers are of keys this node does not hold."""
    return (f"{n} key marker{'' if n == 1 else 's'} of {'a key' if n == 1 else 'keys'} this node does not hold (a "
            "rotation this node was not given the key file of, or another fleet)")


def _check_records(bucket: Bucket, tree: Tree, spaces: dict[str, Space], threads: int) -> tuple[list, set]:
    """The problems of the records of `tree` (downloaded on `threads`), and the bad ones."""
    def check(k: ObjectKey) -> tuple[str, str, bool] | None:
        space = spaces[k.ns.hex()]
        if k.owned:
            return None  # a tenant's: sealed with a key only its nodes derive
        cap = space.cap(k)
        if cap is not None and k.size > cap:  # planted: never read
            return "corrupt_object", f"{k.size} bytes, more than a record of its namespace is ({cap})", True
        if cap is None and k.size > MAX_OBJECT_BYTES:  # no geometry to judge it by: its size alone deletes nothing
            return ("oversized_object", f"{k.size} bytes, more than any record is ({MAX_OBJECT_BYTES}); its "
                    "namespace's manifest states no geometry, so it is left (gc --remote ages it out)", False)
        try:
            buf = bucket.get(k.path, max_bytes=cap or MAX_OBJECT_BYTES)
        except RemoteError as e:
            return "corrupt_object", f"cannot download: {e}", False
        if buf is None:
            return None  # deleted since the listing
        depth = None  # (unknown below an orphan: its records are judged by all else they state)
        if k.parent == k.ns or k.parent in tree.objects:
            depth = tree.known_depth(k.parent) if k.kind == CHECKPOINT else tree.known_depth(k.hash)
        try:
            _check_listed(space.sealer(), k, buf, depth, space.chunk_size)
        except Unauthenticated as e:
            return "unauthenticated_object", str(e), True
        except BlobError as e:
            return "corrupt_object", str(e), True
        return None

    problems: list[Problem] = []
    bad: set[bytes] = set()
    keys_ = list(tree.objects.values())
    with ThreadPoolExecutor(threads) as pool:
        for k, found in zip(keys_, pool.map(check, keys_)):
            if found is not None:
                problems.append(Problem(found[0], k.path, found[1], k.hash.hex()))
                if found[2]:
                    bad.add(k.hash)
    return problems, bad


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


def drop_key(bucket: Bucket, fleet: Fleet, local=(), *, key_id: str, dry_run: bool = False,
             keys: KeyCheck | None = None) -> dict:
    """Delete every object of the namespaces of the older key `key_id` of `fleet` (records deepest
    first, then pins and manifests), and that key's marker (the current key's is published
    first if missing, `KeyCheck`): what only that key opens. The end of a key rotation."""
    kid = key_id
    old = next((f for f in fleet.older if f.key_id == kid), None)
    if old is None:
        known = ", ".join(f.key_id for f in fleet.older) or "none"
        raise InvalidInputError(f"--drop-key {kid}: not an older key of this fleet (older keys: {known}; the key "
                                f"written with, {fleet.key_id}, cannot be dropped)")
    (keys or KeyCheck(bucket, fleet, Health())).judge(local, claim=not dry_run)
    marker = marker_key(old.marker_name())
    marker_size = bucket.head(marker)
    marked = marker_size is not None
    listing = Listing(bucket)
    spaces = namespaces(bucket, fleet, listing.folders(), local)
    tree, _ = listing.split(spaces)
    mine = {folder for folder, space in spaces.items() if space.fleet is old}
    records = {h for h, k in tree.objects.items() if k.ns.hex() in mine}
    others = [(path, size) for f in mine for path, size, _ in listing.others[f]]
    # Every object it deletes counts: a namespace of manifests and pins alone is not 0 B.
    size = sum(tree.objects[h].size for h in records) + sum(n for _, n in others) + (marker_size or 0)
    if not dry_run:
        tree.delete(bucket, records)
        bucket.delete([path for path, _ in others] + [marker] * marked)
    return {"key": kid, "namespaces": len(mine), "records": len(records),
            "objects": len(records) + len(others) + marked,
            "bytes": size, "dry_run": dry_run}
