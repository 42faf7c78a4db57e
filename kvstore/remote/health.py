"""This process's dealings with the remote: what was counted, the last error, and whether the
remote is left alone for a while after a failure (so a dead endpoint costs one failed request,
not one per fetch or upload). Shared by the remote tier (reads) and the uploader (writes).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time

from kvstore.remote.bucket import Bucket, RemoteError, RemoteSetupError
from kvstore.remote.layout import MARKERS, manifest_key, marker_key, parse_key, parse_other
from kvstore.remote.seal import Unauthenticated
from kvstore.sizes import printable

log = logging.getLogger("kvstore")

RETRY_AFTER_S = 5.0
COUNTERS = (
    "uploads", "upload_bytes", "already_there", "already_there_bytes", "upload_errors", "dropped_uploads", "dropped_upload_bytes",
    "skipped_old_format", "skipped_no_parent", "lookups", "heads", "lists", "downloads", "download_bytes",
    "remote_hits", "remote_tokens", "corrupt_objects", "errors", "deadline_misses", "skipped_down",
    "unauthenticated", "replaced", "oversized_objects", "skipped_down_uploads", "left_uploads",
    "downloads_used", "prefetched", "partial_restores", "truncated_lists", "dropped_prefetches",
    "foreign_namespaces", "refused_uploads", "tagged_records", "skipped_wrong_key", "skipped_unknown_tenant")
#: Counters are added to the store's index under this prefix, so `kvstore stats` shows every
#: process's totals.
COUNTER_PREFIX = "count.remote."
#: What an error keeps of its message: no URL, path or object key (a key names a chain hash and
#: a first token, enough to confirm a guessed prompt), no long hex, at most this many characters.
_WITH_SLASH = re.compile(r"\S*/\S*")
_LONG_HEX = re.compile(r"[0-9a-fA-F]{16,}")
ERROR_CHARS = 240


def short_error(e: BaseException) -> str:
    """`e` as stats and the log show it: its kind (the exception's class) and a short message
    from which every word naming a URL, path or key, and every long hash, is cut."""
    text = _LONG_HEX.sub("<hash>", _WITH_SLASH.sub("<key>", " ".join(str(e).split())))
    text = f"{type(e).__name__}: {text}"
    return printable(text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "...")


class Health:
    def __init__(self, retry_after: float = RETRY_AFTER_S):
        self.retry_after = retry_after
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.last_error = ""
        self._down_until = 0.0
        self.answered_at = 0.0  # when a request last got its answer (`monotonic`)
        self._lock = threading.Lock()
        self._persisted: dict[str, int] = {}
        self._said: set[str] = set()  # the kinds of setup mistakes said (each once)

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def error(self, e: BaseException, *, down: bool = False) -> None:
        """Count a failure; `down`: the remote itself failed, so leave it alone for a while.
        A setup mistake (credentials refused, endpoint down, no such bucket) is said once, in
        full: every request after the first fails the same way."""
        self.count("errors")
        setup = isinstance(e, RemoteSetupError)  # (its message is kvstore's own: the URL, never a key)
        self.last_error = printable(str(e)) if setup else short_error(e)
        if down or setup:
            self.mark_down()
        with self._lock:
            if setup and type(e).__name__ in self._said:
                return
            if setup:
                self._said.add(type(e).__name__)
        log.warning("kvstore: remote tier: %s", self.last_error)

    def answered(self) -> None:
        """A request got its answer: the endpoint is up, however slow."""
        self.answered_at = time.monotonic()

    def mark_down(self) -> None:
        self._down_until = time.monotonic() + self.retry_after

    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def unsaved(self) -> dict[str, int]:
        """What was counted since the last `saved`, under the index's counter names."""
        now = dict(self.counters)
        return {COUNTER_PREFIX + k: v - self._persisted.get(k, 0) for k, v in now.items()
                if v != self._persisted.get(k, 0)}

    def saved(self, deltas: dict[str, int]) -> None:
        for key, by in deltas.items():
            name = key[len(COUNTER_PREFIX):]
            self._persisted[name] = self._persisted.get(name, 0) + by

    def totals(self, stored: dict[str, int]) -> dict[str, int]:
        """Every process's counts: what the index holds (`stored`, its counters) plus what this
        process counted and has not saved yet."""
        out = dict.fromkeys(COUNTERS, 0)
        for key, value in stored.items():
            if key.startswith(COUNTER_PREFIX) and key[len(COUNTER_PREFIX):] in out:
                out[key[len(COUNTER_PREFIX):]] = value
        for key, value in self.counters.items():
            out[key] += value - self._persisted.get(key, 0)
        return out


#: The namespaces' manifests read at most to tell whether any opens with this node's keys.
KEY_CHECK_FOLDERS = 16
_NAME = re.compile(r"[0-9a-f]{32}")


class KeyCheck:
    """Whether this node's keys are the fleet's of the bucket, told by the fleet's key markers
    (`layout.marker_key`: a small sealed object per key, named by a MAC under that key, so only a
    holder of the key can name it). Asked before the node's first upload or pins object, after a
    fetch that found nothing, by gc and verify of the bucket; then again (a HEAD of this node's
    markers) when it judges once `RECHECK_S` have passed since it last asked: a node left running
    through a rotation whose old key `gc --remote --drop-key` dropped finds its marker gone and
    stops uploading under that key, instead of filling the bucket again with objects only the
    dropped key opens.

    - A marker of one of this node's keys is there (a HEAD each, the current key's first): the
      key is the fleet's. With `claim` the current key's marker is published if it is missing
      (a rotation: the older key's is there).
    - No marker at all (a new bucket, or one written before markers): the key is the fleet's
      unless the bucket holds namespaces and none opens with it (`_namespaces`); with `claim`
      its marker is published then, and the bucket is this fleet's from then on.
    - Markers, none of this node's keys': a wrong key.
    A wrong key is said once (`wrong_key_line`) and the namespaces its keys do not open are
    counted (`foreign_namespaces`). Such a node writes nothing to the bucket (no record, manifest,
    pins or marker: `Uploader`, `Remote`), so it never makes a namespace that would hide the
    mistake from the next node with that key; and gc --remote deletes no unknown namespace.
    RemoteError if the bucket cannot be asked (nothing is kept: asked again next time)."""

    RECHECK_S = 60.0

    def __init__(self, bucket: Bucket, fleet, health: Health):
        self.bucket, self.fleet, self.health = bucket, fleet, health
        self.wrong: bool | None = None  # None: not known yet
        self._asked = 0.0  # (time.monotonic) when the answer was last asked for
        self.foreign = 0  # namespaces of the bucket none of this node's keys opens (counted when wrong)
        self.markers = False  # the bucket held key markers when asked
        self._marked = False  # the current key's marker is in the bucket
        self._strangers: int | None = None  # markers none of this node's keys names (`strangers`)
        self._lock = threading.Lock()

    def judge(self, local=(), *, claim: bool = False) -> bool:
        """True if this node's keys are not the fleet's. `local`: namespaces this node has (its
        folders need no manifest to open). `claim`: this node is about to write to the bucket."""
        with self._lock:
            was = self.wrong
            if was is None or time.monotonic() - self._asked >= self.RECHECK_S:
                self._asked = time.monotonic()
                self.wrong = self._ask(local) if was is None else self._again(local, was)
                if self.wrong and not was:
                    self.health.count("foreign_namespaces", self.foreign)
                    log.warning("kvstore: %s; this node uploads nothing to it (no records, manifests or pins) "
                                "while its key is not the fleet's", self.line())
                elif was and not self.wrong:
                    log.info("kvstore: the bucket %s now holds the marker of this node's key %s: it is the "
                             "fleet's again, and this node uploads to it", self.bucket.url, self.fleet.key_id)
            if claim and not self.wrong and not self._marked:
                self.claim()
            return self.wrong

    def check(self, local=()) -> None:
        """`judge`, for a fetch: a bucket that cannot be asked (no such bucket, no answer...) is
        said once (`Health.error`), never raised."""
        try:
            self.judge(local)
        except RemoteError as e:
            self.health.error(e, down=True)

    def line(self) -> str:
        return wrong_key_line(self.bucket.url, self.foreign, self.fleet, markers=self.markers)

    def strangers(self) -> int:
        """The key markers of the bucket that none of this node's keys names (one bounded LIST,
        asked once): another key of the fleet's, which this node does not hold (a rotation under
        way, and this node not given the rotated key file yet), or another fleet's. Namespaces no
        key of this node opens may then be the fleet's under that key: gc drops none of them."""
        with self._lock:
            if self._strangers is None:
                own = {marker_key(f.marker_name()) for f in self.fleet.keyring()}
                found, _ = self.bucket.list_page(MARKERS, 1000)
                self._strangers = sum(1 for key, _, _ in found if key not in own)
            return self._strangers

    def claim(self) -> None:
        """Publish the current key's marker: the bucket is this fleet's."""
        key = marker_key(self.fleet.marker_name())
        body = json.dumps({"key": self.fleet.key_id, "written": time.time()}).encode()
        self.bucket.put_new(key, self.fleet.marker_box().seal(key, body))
        self._marked = True

    def _again(self, local, was: bool) -> bool:
        """The answer asked again, cheaply: a HEAD of this node's markers (one found: its key is
        the fleet's); none found, a node that was the fleet's asks in full only when the bucket
        now holds markers (of other keys: its own was dropped), else keeps its answer."""
        for f in self.fleet.keyring():
            if self.bucket.head(marker_key(f.marker_name())) is not None:
                self._marked = f is self.fleet
                return False
        self._marked = False  # (the current key's marker is gone: a claim publishes it again)
        if was or not self.bucket.list_page(MARKERS, 1)[0]:
            return was
        return self._ask(local)

    def _ask(self, local) -> bool:
        for f in self.fleet.keyring():
            if self.bucket.head(marker_key(f.marker_name())) is not None:
                self._marked = f is self.fleet
                return False
        self.markers = bool(self.bucket.list_page(MARKERS, 1)[0])
        self.foreign, opens = self._namespaces(local)
        return self.markers or (self.foreign > 0 and not opens)

    def _namespaces(self, local) -> tuple[int, bool]:
        """(the namespaces of the bucket none of this node's keys opens, whether one opens), by
        their manifests (names are MACs, so which model they are of cannot be told).

        A namespace is a folder that holds an object of the layout (the first it lists): object
        stores that keep folders (SeaweedFS) still list one after gc deleted its last object
        (`gc --remote --drop-key` empties the folders of a dropped key), and it is no namespace;
        nor is one that holds only objects kvstore does not write. It costs a listing of the
        folders, a listing of at most one key per folder, and a GET of the manifest of the first
        `KEY_CHECK_FOLDERS` that hold an object and are not this node's."""
        ring = self.fleet.keyring()
        own = {f.ns_name(ns) for f in ring for ns in local}
        foreign, opens, read = 0, False, 0
        for folder in (f for f in self.bucket.folders("") if _NAME.fullmatch(f)):
            first = self.bucket.list_page(folder + "/", 1)[0]
            if not first or parse_key(first[0][0]) is None and parse_other(first[0][0]) is None:
                continue  # (empty, or what it holds first is not kvstore's: no namespace)
            if folder in own:
                opens = True
                continue
            key = manifest_key(folder)
            read += 1
            body = self.bucket.get(key, max_bytes=1 << 20) if read <= KEY_CHECK_FOLDERS else None
            if body is not None and any(_opens(f.manifest_box(folder), key, body) for f in ring):
                opens = True  # a namespace of this fleet (another model's)
            else:
                foreign += 1
        return foreign, opens


def _opens(box, key: str, body) -> bool:
    try:
        box.open(key, body)
        return True
    except Unauthenticated:
        return False


def wrong_key_line(url: str, namespaces: int, fleet, *, markers: bool = False) -> str:
    """What is said when this node's keys (`fleet`) are not the fleet's of the bucket at `url`,
    which holds `namespaces` namespaces none of them opens (`markers`: and key markers of other
    keys only): by generate and serve, and by gc and verify of the bucket."""
    held = f"holds {namespaces} namespace{'' if namespaces == 1 else 's'} and none opens with this key"
    if markers:
        held = f"is kept by another fleet key (its key markers are not of this key){' and ' + held if namespaces else ''}"
    # (The question names where the key came from: what the user has to check.)
    return (f"the bucket {url} {held}: is {printable(fleet.where)} the fleet's? (this key is {fleet.key_id}; "
            "nothing stored by the nodes that wrote them can be reused here)")
