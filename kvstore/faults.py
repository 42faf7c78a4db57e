"""Fault injection for kvstore's own reliability tests (tests/test_faults*.py). Inert otherwise.

A few places in the write, index and gc paths call `hit("point")`. Unless a fault is armed that
is one comparison with None. A fault is armed either in-process with `arm(...)` (tests) or, for a
child process, with the environment variable

    KVSTORE_FAULT=<point>:<action>[:<n>]      e.g. KVSTORE_FAULT=after_rename:kill:3

read once at import. It fires on the n-th hit of that point (default 1); `enospc` keeps firing on
every later hit too (a disk stays full until `disarm()`). A value that does not name a known
point and action raises at import, so a typo never passes silently, and an armed fault is logged.

Points (in the order a write goes through them):
    blob_write     a blob's header is in its temporary file, its payload not yet
    blob_temp      the temporary file is complete and fsynced, not yet renamed
    after_rename   the blob is in place, its index row not yet inserted
    in_transaction the rows are inserted inside BEGIN IMMEDIATE, not yet committed
    gc_deleted     gc committed the deletion of rows, their files are still on disk
Actions: kill (SIGKILL to this process, like `kill -9`), exit (os._exit(137)), enospc (raise
OSError(ENOSPC), as a full disk does).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading

POINTS = ("blob_write", "blob_temp", "after_rename", "in_transaction", "gc_deleted")
ACTIONS = ("kill", "exit", "enospc")

_lock = threading.Lock()
_armed: tuple[str, str, int] | None = None  # (point, action, hits left before it fires)


def arm(point: str, action: str, nth: int = 1) -> None:
    """Fire `action` on the `nth` hit of `point` from now on (tests only)."""
    global _armed
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    if action not in ACTIONS:
        raise ValueError(f"unknown fault action {action!r}; known: {', '.join(ACTIONS)}")
    if not isinstance(nth, int) or nth < 1:
        raise ValueError(f"a fault fires on the n-th hit, n >= 1; got {nth!r}")
    with _lock:
        _armed = (point, action, nth)
    logging.getLogger("kvstore").warning("kvstore: fault injection armed: %s:%s:%d", point, action, nth)


def disarm() -> None:
    global _armed
    with _lock:
        _armed = None


def hit(point: str) -> None:
    """A fault point. Does nothing unless a fault is armed for `point`."""
    global _armed
    if _armed is None or _armed[0] != point:
        return
    with _lock:
        if _armed is None or _armed[0] != point:
            return
        _, action, left = _armed
        if left > 1:
            _armed = (point, action, left - 1)
            return
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {point})")
    if action == "exit":
        os._exit(137)
    os.kill(os.getpid(), signal.SIGKILL)


def _from_environment() -> None:
    spec = os.environ.get("KVSTORE_FAULT")
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].isdigit()):
        raise ValueError(f"KVSTORE_FAULT={spec!r}: expected <point>:<action>[:<n>], "
                         f"points {', '.join(POINTS)}; actions {', '.join(ACTIONS)}")
    arm(parts[0], parts[1], int(parts[2]) if len(parts) == 3 else 1)


_from_environment()
