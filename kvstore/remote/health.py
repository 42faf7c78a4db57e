"""This process's dealings with the remote: what was counted, the last error, and whether the
remote is left alone for a while after a failure (so a dead endpoint costs one failed request,
not one per fetch or upload). Shared by the remote tier (reads) and the uploader (writes).
"""

from __future__ import annotations

import logging
import re
import threading
import time

from kvstore.remote.bucket import Bucket, RemoteError, RemoteSetupError
from kvstore.sizes import printable

log = logging.getLogger("kvstore")

RETRY_AFTER_S = 5.0
COUNTERS = (
    "uploads", "upload_bytes", "already_there", "upload_errors", "dropped_uploads", "dropped_upload_bytes",
    "skipped_old_format", "skipped_no_parent", "lookups", "heads", "lists", "downloads", "download_bytes",
    "remote_hits", "remote_tokens", "corrupt_objects", "errors", "deadline_misses", "skipped_down",
    "unauthenticated", "replaced", "oversized_objects", "skipped_down_uploads", "left_uploads",
    "downloads_used", "prefetched", "partial_restores", "truncated_lists", "dropped_prefetches",
    "foreign_namespaces", "refused_uploads", "tagged_records")
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


def say_if_no_namespace_opens(bucket: Bucket, fleet, ns: bytes, health: Health) -> None:
    """Whether the bucket exists, and whether it holds namespaces of which none opens with this
    node's keys (by their manifests; names are MACs, so which model they are of cannot be told):
    a wrong fleet secret. Said once (the remote tier asks once a process, after a lookup that
    found nothing of its prompt); a bucket that does not exist is said by `Health.error`.

    A namespace is a folder that holds an object: object stores that keep folders (SeaweedFS)
    still list one after gc deleted its last object (`gc --remote --drop-key` empties the folders
    of a dropped key), and it is no namespace. So this node's own folder counts only if it holds
    something (a node left with a dropped key is told), and the count is of folders that do. It
    costs a listing of the folders, a listing of at most one key per folder, and a GET of the
    manifest of the first `KEY_CHECK_FOLDERS` that hold an object: once a process."""
    from kvstore.remote.layout import manifest_key
    from kvstore.remote.seal import Unauthenticated

    def holds(folder: str) -> bool:
        return bool(bucket.list_page(folder + "/", 1)[0])

    try:
        folders = [f for f in bucket.folders("") if _NAME.fullmatch(f)]
        own = {f.ns_name(ns) for f in fleet.keyring()} & set(folders)
        if any(holds(folder) for folder in own):
            return
        live = 0  # folders that hold an object
        for folder in (f for f in folders if f not in own):
            if not holds(folder):
                continue
            live += 1
            key = manifest_key(folder)
            body = bucket.get(key, max_bytes=1 << 20) if live <= KEY_CHECK_FOLDERS else None
            for f in fleet.keyring() if body is not None else ():
                try:
                    f.manifest_box(folder).open(key, body)
                    return  # a namespace of this fleet (another model's)
                except Unauthenticated:
                    pass
    except RemoteError as e:  # no such bucket, no answer...: said once
        health.error(e, down=True)
        return
    if not live:
        return
    health.count("foreign_namespaces", live)
    log.warning("kvstore: %s", wrong_key_line(bucket.url, live, fleet))


def wrong_key_line(url: str, namespaces: int, fleet) -> str:
    """What is said when the bucket at `url` holds `namespaces` namespaces and none opens with
    this node's keys (`fleet`): by generate and serve, and by gc and verify of the bucket."""
    return (f"the bucket {url} holds {namespaces} namespace{'' if namespaces == 1 else 's'} and none opens with "
            f"this key ({fleet.key_id}, from {printable(fleet.where)}): is it the fleet's? (nothing stored by the "
            "nodes that wrote them can be reused here)")
