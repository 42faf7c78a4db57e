"""A store's trust anchors on disk: the tags of its blobs' headers, judged and written.

`Anchors` holds what judging a blob needs (the store's `Trust`, its index and blob tree, and
the time it got tags, `Index.trust_epoch`). The uploader asks it about every record it is
about to seal (`judge`); a record from before the store had tags, checked whole, is tagged in
place (`tag_in_place`: the blob written again beside itself, fsynced and renamed over the old
one, and its row's size and checksum, under the exclusive tree lock, as a refill is); a record
from elsewhere (a download, an import), already checked whole, is tagged before it is stored
(`tagged`). Tagging changes the header's metadata only: every tensor's bytes stay as they were.
"""

from __future__ import annotations

import time
from pathlib import Path

import xxhash

from kvstore.errors import BlobError
from kvstore.storage import blobfile, blobformat, blobtree, blobwrite
from kvstore.storage.index import Index, Row
from kvstore.trust import HEADER_KEY, Trust, Verdict

#: The `meta` key of when the store was first opened with a remote tier (`remote.node.Remote`).
REMOTE_SINCE = "trust.remote_since"
#: `meta` keys `trust.fleet_key.<key id>`: the fleet secrets (`trust.key_id`) the store's tags were made with.
FLEET_KEYS = "trust.fleet_key."
#: The id in the tags (`trust._Key.key_id`) of each fleet key the store's tags were made with: after
#: a rotation's end those of the dropped key are the store's own, not foreign (`Verdict.RETIRED`).
FLEET_TAGS = "trust.fleet_tag."
#: Records whose tags are read to tell the key of a store that joined before keys were noted.
SAMPLE = 16


def trusted_before(trust: Trust, index: Index) -> float:
    """The time before which a record without a tag of `trust` is taken as it is (`Anchors.epoch`):
    when the store got tags and, under a fleet's keys, when it was first opened with a remote."""
    epoch = index.trust_epoch()
    if trust.fleet:
        epoch = max(epoch, float(index.marks(REMOTE_SINCE).get(REMOTE_SINCE, 0)))
    return epoch


def check_keys(trust: Trust, index: Index, root: Path, own: str | None = None) -> Trust:
    """`trust` with its `mismatch` set when its fleet keys are not those the store's tags were
    made with (a wrong secret: then a record's tag that is not theirs is no damage). Known from the
    keys the store noted (`note_keys`); for a store that joined a fleet before keys were noted,
    from the tags of its newest records (`own`: the tag key id of its own key, which proves
    nothing): none under these keys and some under another, a mismatch; else they are taken."""
    if not trust.fleet or not index.marks(REMOTE_SINCE):
        return trust
    noted = [k[len(FLEET_KEYS):] for k, _ in sorted(index.marks(FLEET_KEYS).items(), key=lambda kv: -kv[1])]
    if noted:
        if not set(noted) & set(trust.names):
            trust.mismatch = _mismatch(trust, f"key {', '.join(noted)}")
        else:  # its tags under a key dropped at a rotation's end are its own: taken, tagged again
            trust.retired = {k[len(FLEET_TAGS):] for k in index.marks(FLEET_TAGS)} - set(trust.tag_ids)
        return trust
    tags = set()
    for row in index.newest(SAMPLE):  # (a record from before it joined is fleet-tagged once uploaded)
        tag = (blobfile.peek_metadata(blobtree.blob_path(root, row.hash)) or {}).get(HEADER_KEY, "")
        tags.add(tag.split(":", 1)[0])
    if not any(trust.holds(t) for t in tags) and tags - {"", own}:
        trust.mismatch = _mismatch(trust, "another key (it joined before kvstore noted which)")
    return trust


def _mismatch(trust: Trust, theirs: str) -> str:
    given = trust.names[0] + (f" and {len(trust.names) - 1} older" if len(trust.names) > 1 else "")
    return (f"the fleet secret given (key {given}) is not the one this store's trust tags were made with "
            f"({theirs}): its records are kept as they are, but not used; give the fleet's secret")


def note_keys(trust: Trust, index: Index) -> None:
    """Note that the store's tags are made with `trust`'s first fleet key (called when it is opened
    with a remote tier): not while its keys are not the store's (`mismatch`), so a wrong secret
    never becomes the store's own; and the ids its tags carry (`FLEET_TAGS`)."""
    if trust.fleet and trust.mismatch is None and FLEET_KEYS + trust.names[0] not in index.marks(FLEET_KEYS):
        index.raise_mark(FLEET_KEYS + trust.names[0], int(time.time()))
    # The tag ids are noted even under a wrong secret: what this store then writes is its own (its
    # model computed it), taken once the fleet's secret is back, as after a rotation (`RETIRED`).
    noted = index.marks(FLEET_TAGS) if trust.fleet else {}
    for tag_id in trust.tag_ids if trust.fleet else ():  # (the older keys' too: the store's tags may be theirs)
        if FLEET_TAGS + tag_id not in noted:
            index.raise_mark(FLEET_TAGS + tag_id, int(time.time()))


class Anchors:
    def __init__(self, trust: Trust, index: Index, root: Path):
        self.trust, self.index, self.root = trust, index, root
        self._epoch: float | None = None

    @property
    def epoch(self) -> float:
        """Records created before it are taken as they are (tagged once checked whole): those from
        before the store had tags and, under a fleet's keys, those it wrote (under its own key)
        before it was first opened with a remote tier, as with tags (trust on first use)."""
        if self._epoch is None:
            self._epoch = trusted_before(self.trust, self.index)
        return self._epoch

    def verdict(self, buf) -> Verdict:
        """What the tag of a whole blob in memory says (BlobError if it is not a format-2 blob)."""
        entries, _, meta = blobformat.parse(buf)
        sums = blobformat.tensor_checksums(meta)
        if sums is None:
            raise BlobError("a blob without tensor checksums (written before format 2)")
        return self.trust.check(meta, blobformat.trust_table(entries, sums))

    def judge(self, row: Row, buf) -> tuple[Verdict, str | None]:
        """(the verdict of record `row`'s whole blob `buf`, why it may not be uploaded or None).
        A blob without a tag of this trust is uploadable only if its record is from before the
        store had tags (its row in the index says when): then it is to be tagged first."""
        verdict = self.verdict(buf)
        if verdict in (Verdict.GOOD, Verdict.RETIRED):  # (a retired key's: tagged under the current one first)
            return verdict, None
        if verdict is Verdict.WRONG:
            return verdict, "its trust tag does not hold (it changed after it was written)"
        stored = self.index.get(row.hash)
        if stored is None or stored.created >= self.epoch:
            return verdict, f"it has no trust tag of this node ({verdict.value}) and was written after tags existed"
        return verdict, None

    def tagged(self, data) -> bytes:
        """A whole blob, already checked, with this trust's tag (as it is if it has one that holds)."""
        entries, _, meta = blobformat.parse(data)
        sums = blobformat.tensor_checksums(meta)
        if sums is None:
            return bytes(data)
        table = blobformat.trust_table(entries, sums)
        if self.trust.check(meta, table) is Verdict.GOOD:
            return bytes(data)
        return blobformat.restamp(data, self.trust.sign(meta, table))

    def tag_in_place(self, row: Row, buf) -> bytes | None:
        """Tag record `row`'s blob on disk, whose whole bytes `buf` were just checked: the new
        blob (same tensors, one more header field) replaces it atomically, then its row's size
        and checksum. None if the record changed or went meanwhile (nothing is written then).
        A crash between the two leaves a row whose size is not its blob's: a miss (quarantined
        when read), never other K/V."""
        data = self.tagged(buf)
        with blobtree.tree_lock(self.root, exclusive=True):
            now = self.index.get(row.hash)
            if now is None or now.bad or (now.size, now.checksum) != (len(buf), xxhash.xxh3_64_intdigest(buf)):
                return None
            blobwrite.write_bytes(self.root, row.hash, data, fsync=True)
            self.index.replace_blob(row.hash, len(data), xxhash.xxh3_64_intdigest(data))
        return data
