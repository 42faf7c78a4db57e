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

from pathlib import Path

import xxhash

from kvstore.errors import BlobError
from kvstore.storage import blobformat, blobtree, blobwrite
from kvstore.storage.index import Index, Row
from kvstore.trust import Trust, Verdict

#: The `meta` key of when the store was first opened with a remote tier (`remote.node.Remote`).
REMOTE_SINCE = "trust.remote_since"


def trusted_before(trust: Trust, index: Index) -> float:
    """The time before which a record without a tag of `trust` is taken as it is (`Anchors.epoch`):
    when the store got tags and, under a fleet's keys, when it was first opened with a remote."""
    epoch = index.trust_epoch()
    if trust.fleet:
        epoch = max(epoch, float(index.marks(REMOTE_SINCE).get(REMOTE_SINCE, 0)))
    return epoch


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
        if verdict is Verdict.GOOD:
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
