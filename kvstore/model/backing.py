"""What every `ModelCache` of one store works through (`Backing`), and the counters they share.

The store builds one `Backing` of its parts and gives it to each model it binds; nothing in it
refers back to the store. The store's `flush` is `Backing.flush`, and a closed store is a flag
the store sets here (`closed`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvstore.errors import InvalidInputError, StoreOpenError
from kvstore.model.lookup import Tiers
from kvstore.remote.node import Remote
from kvstore.storage.index import Index
from kvstore.tiers.disk import DiskBudget
from kvstore.tiers.memory import MemoryTier
from kvstore.write.admission import Gate
from kvstore.write.writer import Writer


@dataclass
class Counters:
    """What the models of one store fetched and inserted (in this process)."""

    fetches: int = 0
    reused_tokens: int = 0
    skipped_inserts: int = 0  # inserts dropped: the index could not take them
    fetch_errors: int = 0  # fetches served as a miss because the disk or index failed
    canary_mismatches: int = 0  # first steps after a restore that did not give the record's canary

    def as_dict(self) -> dict[str, int]:
        """As `Store.stats()` shows them (`fetch_errors` and `canary_mismatches` only once there is one)."""
        out = {"skipped_inserts": self.skipped_inserts, "fetches": self.fetches,
               "reused_tokens": self.reused_tokens}
        if self.fetch_errors:
            out["fetch_errors"] = self.fetch_errors
        if self.canary_mismatches:
            out["canary_mismatches"] = self.canary_mismatches
        return out


class DeletedElsewhere:
    """Records another process deleted from disk (a gc, `gc --drop-tenant`, a quarantine), read
    from the index's deletion log at most every `EVERY_S` and dropped from this process's memory
    tier, which would otherwise go on serving them: a dropped tenant's prompts too."""

    EVERY_S = 1.0

    def __init__(self):
        self._lock = threading.Lock()
        self._seq: int | None = None  # the last deletion read (None: the log not read yet)
        self._read = 0.0

    def begin(self, index: Index) -> None:
        """Read the log from its end now: what is deleted later may be held in RAM by then. (Not
        at the first fetch: inserts, `--warm-top` and prefetches fill RAM before one, and what
        another process deleted meanwhile would go on being served.)"""
        try:
            self._seq = index.deletions_end()
        except Exception:  # the index is unreachable now: the first fetch reads the log's end
            pass

    def forget(self, b: "Backing") -> None:
        if b.index is None or not b.memory.capacity:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._read < self.EVERY_S:
                return
            self._read = now
            try:
                if self._seq is None:  # (what went before this process held anything)
                    self._seq = b.index.deletions_end()
                    return
                rows = b.index.deletions_since(self._seq)
                if rows:
                    self._seq = rows[-1][0]
                gone = [h for _, h, _ in rows if h in b.memory and not b.writer.is_pending(h)]
                if gone:  # (a record stored again since stays)
                    still = b.index.present(gone)
                    b.memory.discard([h for h in gone if h not in still])
            except Exception:  # the index is unreachable now: the next fetch reads the log again
                self._read = 0.0


@dataclass(frozen=True)
class Backing:
    """What a `ModelCache` reads and writes through, from the store that bound it."""

    tiers: Tiers
    memory: MemoryTier
    writer: Writer
    index: Index | None  # None for a store in RAM only
    read_only: bool = False  # nothing is written to the index (model versions are not recorded)
    gate: Gate | None = None  # the admission policy: told what each fetch asked for
    remote: Remote | None = None  # uploads, which `flush` waits for too
    budget: DiskBudget | None = None  # the disk's byte budget, which `flush` lets settle
    counters: Counters = field(default_factory=Counters)
    closed: threading.Event = field(default_factory=threading.Event)  # set by the store's close
    deleted_elsewhere: DeletedElsewhere = field(default_factory=DeletedElsewhere)

    def __post_init__(self) -> None:
        if self.index is not None and self.memory.capacity:
            self.deleted_elsewhere.begin(self.index)

    def check_open(self) -> None:
        if self.closed.is_set():
            raise StoreOpenError("this store is closed")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every insert so far is durable (and every download stored locally), within
        the disk budget (and uploaded, with a remote tier: without `timeout`, for at most
        `remote_flush_timeout`). False if the time ran out first."""
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)):
            raise InvalidInputError(f"timeout: give seconds (a number) or None to wait for all, not {timeout!r:.30}")
        end = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if end is None else max(0.0, end - time.monotonic())

        done = self.writer.flush(timeout)
        for tier in self.tiers:  # downloads being stored on the local disk
            settle = getattr(tier, "settle", None)
            if settle is not None:
                done = settle(left()) and done
        if self.budget is not None:
            done = self.budget.settle(left()) and done
        if self.remote is not None:
            done = self.remote.flush(left()) and done
        return done
