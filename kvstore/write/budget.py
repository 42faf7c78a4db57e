"""The write budget: at most so many bytes written to the store's disk in any rolling day.

It is a token bucket whose tokens come back as the day rolls on: what was written (by every
process on the store, and what the remote tier downloaded to it) counts for 24 hours, in the
store's hourly write log (`storage.writesql`), and the writer takes from what is left before it
writes a file, in one transaction. Counting by the hour, the window reaches 24 to 25 hours back,
so no 24 hours ever hold more than the budget. Downloads are counted, never refused: a fetch
needs them. Explicit writes (warmed, prefilled and pinned prompts, durable inserts) are counted
too, and logged apart (`explicit`), but never refused: they use up what automatic writes may
write, never the other way round. Rates are given per day, per hour, per week (parsed by the
`max_write_rate` row of `kvstore.settings`) and kept as bytes per day.

The log is checked where it is read, and damage fails closed for as long as it is in the window
and no longer: an hour whose bytes or downloads are not a whole number of 0 to
`writesql.MAX_HOUR_BYTES` (negative, text, NULL, fractional, huge) counts as the whole day's
budget, so nothing automatic is written until that hour has left the window (25 hours at most),
and then the budget is whole again. A damaged kept `max_write_rate` reads as 0 (no automatic
writes) until it is given again or `kvstore settings` keeps a value (`verify --repair` keeps the 0).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from kvstore.storage.index import Index
from kvstore.storage.writesql import WINDOW_HOURS, count_ok, hour_of, window_bytes

DAY_S = 86400
class WriteBudget:
    """`per_day` bytes (None: no limit, only counted) in any rolling day of `index`'s store.
    `clock` gives unix time (a test passes its own to live a day without waiting)."""

    def __init__(self, index: Index, per_day: int | None, clock: Callable[[], float] = time.time):
        self.index, self.per_day, self.clock = index, per_day, clock
        # Without a limit nothing is refused, so nothing is reserved before a write: what is
        # taken and given back is summed here and logged by `settle`, which the writer calls
        # while it holds the blob tree's lock for the rows (an index transaction of its own
        # would wait for gc's lock once more, per write).
        self._lock = threading.Lock()
        self._unsettled = [0, 0, 0]  # bytes, records, explicit bytes

    def take(self, sizes: Sequence[int], explicit: bool = False) -> int:
        """Count as written the leading `sizes` the budget has room for (all of them when the
        write is `explicit`: counted, never refused); how many. The caller writes exactly those
        (and gives back what it did not write: `give_back`)."""
        if not sizes:
            return 0
        if self.per_day is None:
            self._add(sum(sizes), len(sizes), sum(sizes) if explicit else 0)
            return len(sizes)
        if explicit:
            self.index.log_writes(hour_of(self.clock()), {"bytes": sum(sizes), "records": len(sizes),
                                                          "explicit": sum(sizes)})
            return len(sizes)
        return self.index.reserve_writes(list(sizes), hour_of(self.clock()), WINDOW_HOURS, self.per_day)

    def settle(self) -> None:
        """Log what was taken (and given back) without a limit since the last call. Raises what
        the index raises, keeping the counts for the next call."""
        with self._lock:
            (nbytes, records, explicit), self._unsettled = self._unsettled, [0, 0, 0]
        if nbytes or records or explicit:
            try:
                self.index.log_writes(hour_of(self.clock()), {"bytes": nbytes, "records": records,
                                                              "explicit": explicit})
            except BaseException:
                self._add(nbytes, records, explicit)
                raise

    def _add(self, nbytes: int, records: int, explicit: int = 0) -> None:
        with self._lock:
            self._unsettled[0] += nbytes
            self._unsettled[1] += records
            self._unsettled[2] += explicit

    def count(self, nbytes: int, records: int = 1) -> None:
        """Count a write the budget does not gate (a record completed again in place)."""
        self.index.log_writes(hour_of(self.clock()), {"bytes": nbytes, "records": records})

    def give_back(self, nbytes: int, records: int, explicit: bool = False) -> None:
        """What was taken and then not written (a failed write, or a record another process
        stored meanwhile)."""
        if self.per_day is None:
            self._add(-nbytes, -records, -nbytes if explicit else 0)
        elif nbytes or records:
            self.index.log_writes(hour_of(self.clock()), {"bytes": -nbytes, "records": -records,
                                                          "explicit": -nbytes if explicit else 0})

    def used(self) -> int:
        """Bytes written (and downloaded) in the budget's window."""
        hour = hour_of(self.clock())
        return window_bytes(((h[0], h[1], h[3]) for h in self.index.write_hours(hour - WINDOW_HOURS + 1)),
                            hour, WINDOW_HOURS, self.per_day, self.index.closed_hour())

    def left(self) -> int | None:
        """Bytes the writer may still write now (None: no limit)."""
        return None if self.per_day is None else max(0, self.per_day - self.used())


def summary(index: Index | None, *, policy: str, per_day: int | None, unsaved: dict[str, int] | None = None,
            now: float | None = None, days: int = 7) -> dict:
    """`stats()["writes"]`: the settings, the bytes written in the last day (24 to 25 hours:
    the budget's window) and over the store's life (with the remote tier's downloads, as an
    SSD's counter), what admission and the budget kept in RAM (records, and `_bytes`), and the
    last `days` UTC days (oldest first). `unsaved`: this process's counts not in the index yet."""
    now = time.time() if now is None else now
    hour = hour_of(now)
    hours = index.write_hours((hour // 24 - days + 1) * 24) if index is not None else []
    totals = index.write_totals() if index is not None else {}
    kept = {k: totals.get(k, 0) + (unsaved or {}).get(k, 0)
            for k in ("not_admitted", "not_admitted_bytes", "over_budget", "over_budget_bytes")}
    window = [(h[0], h[1], h[3]) for h in hours]
    last_day = window_bytes(window, hour, WINDOW_HOURS, None)  # damaged hours left out; the budget counts them full
    # (a part of an hour's bytes: never more than them, none of a damaged hour's)
    explicit_last_day = window_bytes([(h[0], min(h[8], h[1]) if count_ok(h[1]) and count_ok(h[8]) else None, 0)
                                      for h in hours], hour, WINDOW_HOURS, None)
    by_day = {d: dict(bytes=0, explicit=0, downloaded=0, records=0, not_admitted=0, over_budget=0)
              for d in range(hour // 24 - days + 1, hour // 24 + 1)}
    for h, nbytes, records, downloaded, not_admitted, _, over_budget, _, explicit in hours:
        day = by_day.get(h // 24)
        if day is not None:
            for key, n in (("bytes", nbytes), ("records", records), ("downloaded", downloaded),
                           ("not_admitted", not_admitted), ("over_budget", over_budget), ("explicit", explicit)):
                day[key] += n if isinstance(n, int) else 0  # damaged: left out here, checked by verify
    return {
        "admit": policy, "max_write_rate": per_day,
        "budget_left": None if per_day is None else max(0, per_day - window_bytes(
            window, hour, WINDOW_HOURS, per_day, index.closed_hour() if index is not None else None)),
        "bytes_last_day": last_day, "explicit_last_day": explicit_last_day,
        "bytes_lifetime": totals.get("bytes", 0) + totals.get("downloaded", 0),
        "downloaded_lifetime": totals.get("downloaded", 0), "records_lifetime": totals.get("records", 0),
        "explicit_lifetime": totals.get("explicit", 0),
        **kept,
        "days": [{"day": time.strftime("%Y-%m-%d", time.gmtime(d * DAY_S)), **v} for d, v in by_day.items()],
    }
