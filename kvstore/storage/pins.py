"""Pins: the pin flags of the index, and the pins file beside it that outlives the index.

A pinned record stays through every gc (`upkeep.evict`). The flags live in the index; a copy of
the pinned hashes is kept in the store folder (`index.pins`) and rewritten in the transaction
that changes them, so that a rebuild of a damaged or lost index (`upkeep.rebuild`) can pin them
again. The file is written atomically (temporary file, fsync, rename) and read without trust:
a damaged line is skipped and said, never an error that stops a rebuild.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

from kvstore import keys
from kvstore.records import CHECKPOINT
from kvstore.storage import schema
from kvstore.storage.evictsql import PINNED  # the one reader of the flag: see `PinSQL`
from kvstore.storage.storedir import write_own_file

log = logging.getLogger("kvstore")

_MAX_PARAMS = schema.MAX_PARAMS
_HEADER = "kvstore pins 1"
_MAX_FILE_BYTES = 1 << 30  # 30 M pinned records; a bigger file is not one kvstore wrote


class PinsFile(NamedTuple):
    """What a pins file holds: the hashes read, and what was wrong with it (None: nothing)."""

    hashes: set[bytes]
    problem: str | None


def write_pins_file(path: Path, hashes: Iterable[bytes]) -> None:
    """Replace the pins file at `path` with these hashes, atomically. Raises OSError."""
    lines = sorted(h.hex() for h in hashes)
    text = "\n".join([_HEADER, *lines, f"end {len(lines)}"]) + "\n"
    write_own_file(path, text)


def read_pins_file(path: Path) -> PinsFile | None:
    """The pins file at `path`, or None if there is none. Never raises: what cannot be read is
    the `problem` (the hashes of the lines that could are kept)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        return PinsFile(set(), f"it cannot be opened ({e.strerror or e})")
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    except OSError as e:
        return PinsFile(set(), f"it cannot be read ({e.strerror or e})")
    lines = data[:_MAX_FILE_BYTES].decode("ascii", errors="replace").splitlines()
    hashes, bad, end = set(), 0, None
    for i, line in enumerate(lines):
        if i == 0 and line == _HEADER:
            continue
        if line.startswith("end ") and end is None:
            end = line[4:]
            continue
        try:
            h = bytes.fromhex(line)
        except ValueError:
            h = b""
        if len(h) == keys.HASH_BYTES:
            hashes.add(h)
        else:
            bad += 1
    problems = []
    if not lines or lines[0] != _HEADER:
        problems.append("it does not start as a kvstore pins file")
    if bad:
        problems.append(f"{bad} of its lines {'is' if bad == 1 else 'are'} not record hashes")
    if end is None or end != str(len(hashes)):
        problems.append("it is cut short" if end is None else f"it names {end!r} pins but holds {len(hashes)}")
    return PinsFile(hashes, "; ".join(problems) or None)


class PinSQL:
    """The index's statements about pins, and the pins file they keep up to date. They read the
    flag as gc does (`PINNED`: a damaged flag is no pin), so what `pins` lists, the pins file and
    the pins published to a remote are what gc keeps.

    Mixed into `Index` (which gives it `conn` and `transaction`)."""

    conn: sqlite3.Connection
    #: The pins file of the store folder, rewritten by every change of a pin (`LocalStore` sets
    #: it); None: no file (an index outside a store folder, or read-only).
    pins_file: Path | None = None

    def pin(self, hashes: Sequence[bytes], pinned: bool = True) -> int:
        """Set the pin flag of these records; returns how many of them exist (and so were set)."""
        with self.transaction() as conn:
            cur = conn.executemany(
                "UPDATE records SET pinned = ? WHERE hash = ?", [(int(pinned), h) for h in hashes]
            )
            self._keep_pins_file(conn)
            return cur.rowcount

    def unpin(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """Unpin these records: (how many were pinned, their bytes)."""
        return self._unpin("hash", list(hashes))

    def unpin_namespaces(self, namespaces: Iterable[bytes]) -> tuple[int, int]:
        """Unpin every record of these model versions: (how many were pinned, their bytes)."""
        return self._unpin("ns", sorted(namespaces))

    def unpin_tenants(self, tags: Iterable[str]) -> tuple[int, int]:
        """Unpin every record of these tenants: (how many were pinned, their bytes)."""
        return self._unpin("tenant", sorted(tags))

    def _unpin(self, column: str, values: list) -> tuple[int, int]:
        n = size = 0
        with self.transaction() as conn:
            for start in range(0, len(values), _MAX_PARAMS):
                part = values[start : start + _MAX_PARAMS]
                for (s,) in conn.execute(
                        f"UPDATE records SET pinned = 0 WHERE {column} IN ({','.join('?' * len(part))}) "
                        f"AND {PINNED} RETURNING size", part).fetchall():
                    n, size = n + 1, size + (s if type(s) is int else 0)
            if n:
                self._keep_pins_file(conn)
        return n, size

    def pinned(self, ns: bytes | None = None) -> set[bytes]:
        """Hashes of the pinned records of a namespace (published to a remote tier), or of all."""
        where, args = (f"ns = ? AND {PINNED}", (ns,)) if ns is not None else (PINNED, ())
        return {h for (h,) in self.conn.execute(f"SELECT hash FROM records WHERE {where}", args)}

    def pins_by_model(self) -> list[dict]:
        """One dict per model version that has pinned records: namespace, fingerprint, model_id,
        records, bytes and tokens (those the pinned chunks and tails hold), and `tenants`: tag ->
        the records and bytes of them that are a tenant's own."""
        rows = self.conn.execute(
            "SELECT r.ns, m.fingerprint, m.model_id, count(*), "
            "coalesce(sum(CASE WHEN typeof(r.size) = 'integer' THEN r.size END), 0), "
            f"coalesce(sum(CASE WHEN r.kind != {CHECKPOINT} AND typeof(r.ntokens) = 'integer' THEN r.ntokens END), 0) "
            f"FROM records r LEFT JOIN models m ON m.ns = r.ns WHERE {PINNED} GROUP BY r.ns ORDER BY m.model_id")
        tenants: dict[object, dict] = {}  # ns -> tenant tag -> its pinned records and bytes
        for ns, tag, n, size in self.conn.execute(
                "SELECT ns, tenant, count(*), coalesce(sum(CASE WHEN typeof(size) = 'integer' THEN size END), 0) "
                f"FROM records WHERE {PINNED} AND tenant IS NOT NULL GROUP BY ns, tenant ORDER BY tenant"):
            tenants.setdefault(ns, {})[str(tag)] = {"records": n, "bytes": size}
        held = {ns: (n, size) for ns, n, size in self.conn.execute(  # what gc keeps for them: their ancestors too
            f"WITH RECURSIVE up(hash) AS (SELECT hash FROM records WHERE {PINNED} "
            "UNION SELECT r.parent FROM records r JOIN up ON r.hash = up.hash) "
            "SELECT ns, count(*), coalesce(sum(CASE WHEN typeof(size) = 'integer' THEN size END), 0) "
            "FROM records WHERE hash IN (SELECT hash FROM up) GROUP BY ns")}
        return [{"namespace": ns.hex() if isinstance(ns, bytes) else "?",
                 "fingerprint": fp.hex() if isinstance(fp, bytes) else "?",
                 "model_id": "?" if model_id is None else str(model_id),
                 "records": n, "bytes": size, "tokens": tokens, "tenants": tenants.get(ns, {}),
                 "held_records": held.get(ns, (n, size))[0], "held_bytes": held.get(ns, (n, size))[1]}
                for ns, fp, model_id, n, size, tokens in rows]

    def keep_pins_file(self, *, missing_only: bool = False) -> None:
        """Write the pins file from the index (with `missing_only`: only if there is none, as
        in a new store or one last written by a kvstore that kept no such file)."""
        if self.pins_file is None or (missing_only and os.path.lexists(self.pins_file)):
            return
        with self.transaction() as conn:
            self._keep_pins_file(conn)

    def _keep_pins_file(self, conn: sqlite3.Connection) -> None:
        """Rewrite the pins file inside the caller's transaction (its write lock orders the
        writers of every process). A file that cannot be written is only a warning: the pins
        hold in the index, and a rebuild then restores what the file held last."""
        if self.pins_file is None:
            return
        try:
            write_pins_file(self.pins_file, (h for (h,) in conn.execute(f"SELECT hash FROM records WHERE {PINNED}")))
        except OSError as e:
            log.warning("kvstore: the pins file %s was not updated (%s); the index holds the pins",
                        self.pins_file, e.strerror or e)
