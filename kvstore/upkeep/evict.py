"""Which records gc evicts, and in which order: the leaf-by-leaf LRU rule, for the whole store at once.

The one tree-eviction rule of kvstore: local gc, the write budget and `gc --remote` (on a bucket
listing, last-modified standing for last access) all choose with it. The rule: evict the least
recently used leaf, again and again; a record whose last child went becomes a leaf; pinned
records and their ancestors never go (but `stale` takes stale versions whole, pins and all). Run one leaf at a time it costs a heap operation per record
and a transaction per leaf. The same order comes out of one sort. Give every record two numbers,
from its subtree:

- `E(x)`: the latest (last access, hash) in the subtree of x, x included;
- `H(x)`: 1 for a leaf, else 1 + the largest H of its children (the round of leaf peeling that
  frees it).

Sorting the evictable records (those peeling reaches: not pinned, no pinned descendant) by (E, H)
gives exactly the order in which the one-leaf-at-a-time rule evicts them. (The record x that is
first by (E, H) among those left is a leaf, since a child c has E(c) <= E(x) and H(c) < H(x); and
its own (last access, hash) is the smallest of every leaf left, since a leaf y with a smaller one
would have E(y) < E(x), or share E with x through a common descendant, which makes y an ancestor
of x and so no leaf.) Ties between equal access times go by hash, as the old rule's heap broke
them. The proof holds for any total order of the records, and the rule's key is in fact
(class, last access, hash), where the class is the strongest role an insert that reached the
record gave it (`ROLES`: assistant < user < system, mlx-lm's `LRUPromptCache` order), or -1 for a
record last used before an age cutoff, so that everything too old goes before any role counts. Records of stale model versions (see `stale.py`) go before all others, and before them
records no lookup can reach: those under a parent that is gone (a gc that stopped half-way, or
raced a writer, leaves them), and quarantined records (a lookup stops at them: they failed a
read) with everything below them.

The rule says which records go; in which order their rows are deleted is the deleter's choice
(`in_key_order`): by hash, so that each transaction deletes neighbours in the table. A parent may
then go before its child; the child is unreachable from that moment (lookups walk down from the
root) and goes in a later transaction of the same gc.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import itemgetter
from typing import Collection, Iterable, Mapping

import numpy as np

# The role classes, weakest first: mlx-lm's `LRUPromptCache` evicts assistant turns, then user
# turns, then system prompts. A record keeps the strongest role of the inserts that reached it.
ROLES = ("assistant", "user", "system")


def role_class(cache_type: str) -> int:
    """The class of an insert's `cache_type` (ValueError for a name not in `ROLES`)."""
    try:
        return ROLES.index(cache_type)
    except ValueError:
        raise ValueError(f"cache_type must be one of {', '.join(map(repr, ROLES))}, got {cache_type!r}") from None


@dataclass
class Graph:
    """Every record of the index, as columns (from `Index.eviction_graph`)."""

    hashes: np.ndarray  # V16
    parents: np.ndarray  # V16
    sizes: np.ndarray  # int64
    last: np.ndarray  # float64: last access
    pinned: np.ndarray  # bool
    stale: np.ndarray  # bool: of a stale model version
    root: np.ndarray | None = None  # bool: hangs from its namespace (None: every parentless record)
    bad: np.ndarray | None = None  # bool: quarantined (None: none is)
    role: np.ndarray | None = None  # int64: class in `ROLES` (None: all assistant)
    tenant: np.ndarray | None = None  # int64: which tenant, -1 shared (None: not read)
    tags: tuple = ()  # the tenant tag of each number in `tenant`

    @classmethod
    def from_index(cls, batches: Iterable[list[tuple]]) -> "Graph":
        """From `Index.eviction_graph`: lists of (hash + parent, last access, (size * 4 + role)
        * 16 + flags[, tenant tag]) tuples, flags 1 pinned, 2 stale, 4 hangs from its namespace,
        8 quarantined."""
        hps, lasts, sfs, tenants = [], [], [], []
        codes: dict[object, int] = {None: -1}  # tenant tags as numbers: -1 for a shared record
        for rows in batches:
            n = len(rows)
            # Each column in one C loop over the tuples (a structured np.array of them took 3x as
            # long at 1M rows). The query gives 32 bytes of hash + parent a row; a total of any
            # other length would misalign every row after it, so it is checked.
            hp = b"".join(map(itemgetter(0), rows))
            if len(hp) != 32 * n:
                raise ValueError(f"the eviction graph's hash and parent columns hold {len(hp)} bytes for {n} rows")
            hps.append(hp)
            lasts.append(np.fromiter(map(itemgetter(1), rows), np.float64, n))
            sfs.append(np.fromiter(map(itemgetter(2), rows), np.int64, n))
            if len(rows[0]) > 3:
                tenants.append(np.fromiter((codes.setdefault(r[3], len(codes) - 1) for r in rows), np.int64, n))
        if not hps:
            return cls.from_rows([])
        pairs = np.frombuffer(b"".join(hps), dtype=[("h", "V16"), ("p", "V16")])
        last, sf = np.concatenate(lasts), np.concatenate(sfs)
        tenant = np.concatenate(tenants) if tenants else None
        tags = tuple(tag for tag in codes if tag is not None)
        return cls(pairs["h"].copy(), pairs["p"].copy(), sf >> 6, last,
                   (sf & 1) > 0, (sf & 2) > 0, (sf & 4) > 0, (sf & 8) > 0, (sf >> 4) & 3, tenant, tags)

    @classmethod
    def from_rows(cls, rows: list[tuple]) -> "Graph":
        """From (hash, parent, size, last access, pinned, stale[, root[, role]]) tuples."""
        if not rows:
            empty = np.zeros(0, dtype="V16")
            return cls(empty, empty, np.zeros(0, np.int64), np.zeros(0), np.zeros(0, bool), np.zeros(0, bool))
        columns = list(zip(*rows))
        hashes, parents, sizes, last, pinned, stale = columns[:6]
        return cls(np.frombuffer(b"".join(hashes), dtype="V16"), np.frombuffer(b"".join(parents), dtype="V16"),
                   np.array(sizes, dtype=np.int64), np.array(last, dtype=np.float64),
                   np.array(pinned, dtype=bool), np.array(stale, dtype=bool),
                   np.array(columns[6], dtype=bool) if len(columns) > 6 else None,
                   role=np.array(columns[7], dtype=np.int64) if len(columns) > 7 else None)


@dataclass
class Victims:
    """The records to evict: in eviction order (children before parents), with H of each, and
    which are the tops of what goes (their parent does not go)."""

    keys: np.ndarray  # V16: their hashes
    sizes: np.ndarray
    heights: np.ndarray
    tops: np.ndarray | None = None  # bool; None: every record counts as a top
    index: np.ndarray | None = None  # where each is in the graph it was chosen from

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def hashes(self) -> list[bytes]:
        return _split(self.keys.tobytes())

    @property
    def top_hashes(self) -> list[bytes]:
        """The hashes of the tops: the records whose parent stays."""
        return self.hashes if self.tops is None else _split(self.keys[self.tops].tobytes())

    @classmethod
    def empty(cls) -> "Victims":
        return cls(np.zeros(0, "V16"), np.zeros(0, np.int64), np.zeros(0, np.int64), index=np.zeros(0, np.int64))


def _halves(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """16-byte hashes as two uint64 (first and last 8 bytes, big-endian): sorting by the pair is
    sorting by the bytes, and numpy sorts and searches integers many times faster than bytes."""
    u = np.frombuffer(hashes.tobytes(), dtype=">u8").reshape(-1, 2).astype(np.uint64)
    return u[:, 0], u[:, 1]


def parents(g: Graph) -> tuple[np.ndarray, np.ndarray]:
    """(index of each record's parent, -1 if none is stored; the argsort of the hashes)."""
    n = len(g.hashes)
    if not n:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    hi, lo = _halves(g.hashes)
    by_hash = np.argsort(hi)  # (a quarter of lexsort's time; it is needed only where first halves repeat)
    shi = hi[by_hash]
    repeats = bool((shi[1:] == shi[:-1]).any())
    if repeats:
        by_hash = np.lexsort((lo, hi))
        shi = hi[by_hash]
    slo = lo[by_hash]
    phi, plo = _halves(g.parents)
    # Searched in sorted order (then put back): each search starts where the last one ended,
    # reading the sorted keys once from end to end instead of at random.
    by_parent = np.argsort(phi)
    needles = phi[by_parent]
    left = np.empty(n, np.int64)
    left[by_parent] = np.searchsorted(shi, needles, "left")
    at = left.clip(0, n - 1)
    found = (shi[at] == phi) & (slo[at] == plo)
    if not repeats:
        return np.where(found, by_hash[at], -1), by_hash
    right = np.empty(n, np.int64)
    right[by_parent] = np.searchsorted(shi, needles, "right")
    for i in np.nonzero(right - left > 1)[0]:  # hashes sharing their first 8 bytes: rare
        j = left[i] + int(np.searchsorted(slo[left[i] : right[i]], plo[i]))
        if j < right[i] and slo[j] == plo[i]:
            at[i], found[i] = j, True
    return np.where(found, by_hash[at], -1), by_hash


def unreachable(g: Graph, parent: np.ndarray) -> np.ndarray:
    """Records whose parent is not stored (and is not their namespace), quarantined records
    (a lookup stops at them), and all below them."""
    lost = (parent < 0) & ~g.root if g.root is not None else np.zeros(len(g.hashes), bool)
    if g.bad is not None:
        lost |= g.bad
    has_parent = parent >= 0
    while True:  # one round per level of the deepest lost subtree; none when nothing is lost
        below = has_parent & ~lost
        below[below] = lost[parent[below]]
        if not below.any():
            return lost
        lost |= below


def classes(g: Graph, cutoff: float | None) -> np.ndarray:
    """Each record's class: its role, or -1 if it was last used before `cutoff`."""
    out = g.role.copy() if g.role is not None else np.zeros(len(g.hashes), np.int64)
    if cutoff is not None:
        out[g.last < cutoff] = -1
    return out


def order(g: Graph, parent: np.ndarray | None = None, by_hash: np.ndarray | None = None,
          cls: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(indices of the evictable records in eviction order, H of every record, 0 if never),
    with each record's class by `classes` (None: all of one class)."""
    n = len(g.hashes)
    if parent is None or by_hash is None:
        parent, by_hash = parents(g)
    if cls is None:
        cls = np.zeros(n, np.int64)
    children = np.bincount(parent[parent >= 0], minlength=n)
    # Rank of (class, last access, hash): the heap's key of the leaf-by-leaf rule.
    rank = np.empty(n, dtype=np.int64)
    hash_rank = np.empty(n, dtype=np.int64)
    hash_rank[by_hash] = np.arange(n)
    keys = (hash_rank, g.last, cls) if cls.any() else (hash_rank, g.last)  # one class: one key less
    rank[np.lexsort(keys)] = np.arange(n)
    top = rank.copy()  # E, as a rank
    height = np.zeros(n, dtype=np.int64)
    frontier = np.nonzero((children == 0) & ~g.pinned)[0]
    round_ = 0
    while len(frontier):
        round_ += 1
        height[frontier] = round_
        up = parent[frontier]
        keep = up >= 0
        up, below = up[keep], frontier[keep]
        np.maximum.at(top, up, top[below])
        np.subtract.at(children, up, 1)
        up = np.unique(up)
        frontier = up[(children[up] == 0) & ~g.pinned[up] & (height[up] == 0)]
    evictable = np.nonzero(height > 0)[0]
    # By (E, H) as one integer key: no two records share both (two with the same E are on one
    # path from a root, and the upper one is higher), so this is lexsort's order at 1/8 its time.
    key = top[evictable] * (round_ + 1) + height[evictable]  # (round_: the greatest H)
    return evictable[np.argsort(key)], height


def choose_victims(g: Graph, *, max_bytes: int | None, cutoff: float | None, stale: bool,
                   tenant_max_bytes: int | None = None, drop_tenants: Collection[str] = (),
                   owners: Mapping[str, str] | None = None) -> Victims:
    """`store_victims`, after each owner's tenants over `tenant_max_bytes` together have been
    brought down to it by the same rule among their own records (`tenant_victims`; `owners`: tag
    -> the tag whose quota it shares, `Index.tenant_owners`), and every record of the tenants
    `drop_tenants` (tags) taken, their pins too: the store's budget then counts what is left."""
    dropped = {i for i, tag in enumerate(g.tags) if tag in drop_tenants}
    if dropped:
        g = replace(g, pinned=g.pinned & ~np.isin(g.tenant, list(dropped)))
    quota = tenant_victims(g, tenant_max_bytes, dropped, owners) \
        if (tenant_max_bytes is not None or dropped) and g.tenant is not None else np.zeros(0, np.int64)
    if not len(quota):
        return store_victims(g, max_bytes=max_bytes, cutoff=cutoff, stale=stale)
    left = np.ones(len(g.hashes), bool)
    left[quota] = False
    rest_idx = np.nonzero(left)[0]
    more = store_victims(_subgraph(g, rest_idx), max_bytes=max_bytes, cutoff=cutoff, stale=stale)
    idx = np.concatenate([quota, rest_idx[more.index]]) if more.index is not None else quota
    planned = ~left
    planned[idx] = True
    up = parents(g)[0][idx]
    tops = (up < 0) | ~planned[np.maximum(up, 0)]
    heights = np.concatenate([np.zeros(len(quota), np.int64), more.heights])
    return Victims(g.hashes[idx], g.sizes[idx], heights, tops, idx)


def tenant_victims(g: Graph, max_bytes: int | None, emptied: Collection[int] = (),
                   owners: Mapping[str, str] | None = None) -> np.ndarray:
    """Indices of the records that bring every owner's tenants within `max_bytes` together (None:
    no bound), and the tenants numbered `emptied` to nothing. A tenant's owner is `owners[tag]`
    (the salted tenants of one tenant share its quota), else itself. For each owner over its
    bound, the leaf-by-leaf LRU rule runs among the records of its tenants (those not emptied)
    alone, its pins kept. A tenant's records hang below shared ones (or its namespace): to the
    rule, a record whose parent is not among them is a root."""
    out = []
    tenant = g.tenant
    parent, _ = parents(g)
    owners = owners or {}
    codes: dict[str, int] = {}  # owner tag -> its number
    group_of = np.array([codes.setdefault(owners.get(tag, tag), len(codes)) for tag in g.tags] + [-1], np.int64)
    group = group_of[tenant]  # (a shared record's -1 picks the last: -1)
    if emptied:
        gone = np.isin(tenant, list(emptied))
        out.append(np.nonzero(gone)[0])  # every record, even one of 0 bytes (a damaged size reads as 0)
        group[gone] = -1
    for t in np.unique(group[group >= 0]):
        mine = np.nonzero(group == t)[0]
        if max_bytes is None or int(g.sizes[mine].sum()) <= max_bytes:
            continue
        up = parent[mine]
        root = (up < 0) | (group[np.maximum(up, 0)] != t)  # hangs from outside the owner's records
        sub = replace(_subgraph(g, mine), root=root, stale=np.zeros(len(mine), bool))
        p = store_victims(sub, max_bytes=max_bytes, cutoff=None, stale=False)
        if len(p):
            out.append(mine[p.index])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _subgraph(g: Graph, idx: np.ndarray) -> Graph:
    """The records `idx` of `g`, as a graph of their own (a record whose parent is left out is
    not told from an orphan unless `root` says so)."""
    def pick(a):
        return None if a is None else a[idx]
    return Graph(g.hashes[idx], g.parents[idx], g.sizes[idx], g.last[idx], g.pinned[idx], g.stale[idx],
                 pick(g.root), pick(g.bad), pick(g.role), pick(g.tenant))


def store_victims(g: Graph, *, max_bytes: int | None, cutoff: float | None, stale: bool) -> Victims:
    """The records to evict so that the store holds at most `max_bytes`, nothing last used
    before `cutoff` (a time) is left and, with `stale`, nothing of a stale model version, pins
    and all (no lookup can use them again).

    Records of stale versions go first (in their own LRU order), then the others: each part is
    evicted up to the first record that neither the budget, the age nor `stale` asks for, where
    the leaf-by-leaf rule would stop. Inside a part, records last used before `cutoff` go first
    (by last access alone: age does not look at roles), then the budget takes records by role
    class, weakest first, LRU inside each. Unreachable records (`unreachable`) go first, all
    of them but the pinned. The parts' trees are disjoint, so each part alone keeps children
    before parents."""
    if stale:
        g = replace(g, pinned=g.pinned & ~g.stale)
    parent, by_hash = parents(g)
    lost = unreachable(g, parent)
    if max_bytes is None and cutoff is None and not (stale and g.stale.any()) and not lost.any():
        return Victims.empty()
    idx, height = order(g, parent, by_hash, classes(g, cutoff))
    left = int(g.sizes.sum())
    taken = []
    gone, old = lost[idx], g.stale[idx] & ~lost[idx]
    for part, drop_all in ((idx[gone], True), (idx[old], stale), (idx[~gone & ~old], False)):
        sizes = g.sizes[part]
        before = left - np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        wanted = np.full(len(part), drop_all)
        if max_bytes is not None:
            wanted |= before > max_bytes
        if cutoff is not None:
            wanted |= g.last[part] < cutoff
        stop = len(part) if wanted.all() else int(np.argmin(wanted))
        taken.append(part[:stop])
        left -= int(sizes[:stop].sum())
    idx = np.concatenate(taken)
    planned = np.zeros(len(g.hashes), bool)
    planned[idx] = True
    up = parent[idx]
    tops = (up < 0) | ~planned[np.maximum(up, 0)]
    return Victims(g.hashes[idx], g.sizes[idx], height[idx], tops, idx)


def in_key_order(p: Victims) -> list[bytes]:
    """The victims' hashes sorted: the order of the table's primary key."""
    return _split(np.sort(p.keys).tobytes()) if len(p) else []


def _split(raw: bytes) -> list[bytes]:
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]
