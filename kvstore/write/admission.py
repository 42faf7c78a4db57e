"""What the writer puts on disk: the admission policy, the write budget, and what they kept out.

- `all` writes every new record (the default).
- `reused` writes a record once its prefix is asked for again: a fetch (in any process on the
  store) reaches a record key that an earlier fetch or insert saw. Until then it stays in the
  memory tier only; a fetch that restores from it there queues it for the writer, which writes
  it from the memory tier's copy (`Writer.write_held`), with nothing recomputed. One the writer
  kept out while a fetch restored from its queued job is queued so when the job is done. Seen
  keys are kept in the index (`seen_prefixes`).
- `pinned` writes only what is pinned or warmed (`insert(..., durable=True)`, `prefill`).

Warmed and pinned records are always admitted; the write budget (`budget.WriteBudget`) still
bounds them. A record kept out stays in RAM and is counted, `not_admitted` or `over_budget`, in
the store's write log (saved with the access times, every few seconds).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

from kvstore import settings
from kvstore.records import CHECKPOINT, Span
from kvstore.storage.index import Index
from kvstore.storage.writesql import hour_of
from kvstore.write.budget import DAY_S, WriteBudget

POLICIES = settings.BY_NAME["admit"].choices
DEFAULT_POLICY = settings.BY_NAME["admit"].default
#: Seen keys the index keeps: a week of them, at most this many (oldest go first).
SEEN_KEPT = 1_000_000
SEEN_MAX_AGE_S = 7 * DAY_S
# This process's memory of seen keys and of records held back in RAM (bounded, oldest go first).
_REMEMBERED = 200_000
_PRUNE_EVERY_S = 3600.0
KEPT_COUNTS = ("not_admitted", "not_admitted_bytes", "over_budget", "over_budget_bytes")


class _Bounded(OrderedDict):
    def remember(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > _REMEMBERED:
            self.popitem(last=False)


class Gate:
    """The writer's say over what goes to disk (one per open store; `index=None`: RAM only)."""

    def __init__(self, index: Index | None, policy: str = DEFAULT_POLICY, per_day: int | None = None,
                 clock: Callable[[], float] = time.time):
        self.index, self.policy, self.clock = index, settings.BY_NAME["admit"].parse(policy) or DEFAULT_POLICY, clock
        self.budget = WriteBudget(index, per_day, clock) if index is not None else None
        self._per_day = per_day
        self.counts = dict.fromkeys(KEPT_COUNTS, 0)  # this process's, since the store was opened
        self._unsaved = dict.fromkeys(KEPT_COUNTS, 0)
        self._seen: _Bounded = _Bounded()  # hash -> reused, as this process knows it
        self._held: _Bounded = _Bounded()  # records kept in RAM only -> (why, the role of its insert)
        self._new_seen: list[bytes] = []
        self._new_reused: list[bytes] = []
        self._lock = threading.Lock()
        self._last_prune = 0.0

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Tell time by `clock` from now on (a test lives a day in a second)."""
        self.clock = clock
        if self.budget is not None:
            self.budget.clock = clock

    @property
    def selective(self) -> bool:
        """Whether some record may be kept out of the disk (a policy but `all`, or a budget)."""
        return self.index is not None and (self.policy != "all" or self.per_day is not None)

    @property
    def per_day(self) -> int | None:
        """The write budget in bytes per day (None: no budget)."""
        return self._per_day

    # -- caller side ------------------------------------------------------------------------

    def sighted(self, chain: Sequence[bytes], reached: Sequence[bytes] = ()) -> list[bytes]:
        """A fetch asked for the prompt whose chunk keys are `chain` and restored from the
        records `reached` (parents first): keys seen before (by this process or another) are
        reused now; the rest are seen once. Only `reused` keeps count. Returns the records of
        `reached` kept in RAM only, in order: seen again, they are to be written now."""
        if self.policy != "reused" or self.index is None:
            return []
        order, reached = list(reached), set(reached)
        with self._lock:
            unknown = [h for h in chain if h not in self._seen and h not in reached]
        try:
            stored = self.index.seen_marks(unknown) if unknown else {}
        except Exception:  # the index is busy or unreadable: this sight counts as a first one
            stored = {}
        with self._lock:
            due = [h for h in order if h in self._held]
            for h in list(chain) + [h for h in order if h not in chain]:
                if h in reached or h in self._seen or h in stored:
                    if not self._seen.get(h):
                        self._new_reused.append(h)
                    self._seen.remember(h, True)
                else:
                    self._new_seen.append(h)
                    self._seen.remember(h, False)
        return due

    def rewrite(self, spans: Sequence[Span], held: set[bytes], durable: bool) -> set[bytes]:
        """Of `spans` some tier holds (`held`), those kept in RAM that may now be written: seen
        again since, or `durable`. The insert hands them to the writer again."""
        with self._lock:
            return {s.hash for s in spans if s.hash in held and s.hash in self._held
                    and (durable or self.policy == "all" or self._seen.get(s.hash))}

    def role_of(self, h: bytes) -> int:
        """The role class of the insert that left record `h` in RAM only (0 if it is not held)."""
        with self._lock:
            return self._held.get(h, (None, 0))[1]

    def kept_reason(self, h: bytes) -> str | None:
        """Why this record is kept in RAM only ("not_admitted", "over_budget"), or None."""
        with self._lock:
            return self._held.get(h, (None,))[0]

    def held(self, present: Callable[[bytes], bool]) -> dict[str, int]:
        """Records kept in RAM only that are still there (`present`), by why: what an exit loses."""
        with self._lock:
            held = list(self._held.items())
        out: dict[str, int] = {}
        for h, (why, _) in held:
            if present(h):
                out[why] = out.get(why, 0) + 1
        return out

    def holds_back(self, hashes: Iterable[bytes]) -> bool:
        """Whether any of these records is kept in RAM only (not on disk)."""
        with self._lock:
            return any(h in self._held for h in hashes)

    # -- writer side ------------------------------------------------------------------------

    def admitted(self, specs: list[Span], durable: bool) -> list[Span]:
        """The records of a job (parents first) the policy lets go to disk; a record under one
        that stays in RAM stays in RAM too (a row never hangs from a missing parent)."""
        if self.policy == "all" or durable:
            return specs
        if self.policy == "pinned":
            return []
        reused = self._reused([s.hash for s in specs if s.kind != CHECKPOINT])
        out, kept = [], set()
        for s in specs:  # a parent outside the job is on disk (`batch.still_needed`)
            if s.parent not in kept and (s.hash in reused or s.kind == CHECKPOINT):
                out.append(s)
            else:
                kept.add(s.hash)
        return out

    def _reused(self, hashes: list[bytes]) -> set[bytes]:
        with self._lock:
            known = {h for h in hashes if self._seen.get(h)}
            ask = [h for h in hashes if h not in known]
        if ask and self.index is not None:
            try:
                known |= {h for h, again in self.index.seen_marks(ask).items() if again}
            except Exception:
                pass
        return known

    def kept(self, spec: Span, reason: str, role: int = 0) -> bool:
        """A record stays in RAM only: `reason` is "not_admitted" or "over_budget"; `role`, its
        insert's. True if a fetch restored from it while it was queued (after `admitted` said
        no): it is to be written now, as a fetch that finds it held would have it."""
        with self._lock:
            if reason == "not_admitted" and spec.hash not in self._seen:
                self._seen.remember(spec.hash, False)
                self._new_seen.append(spec.hash)
            again = self._held.get(spec.hash, (None,))[0] == reason  # tried again and kept again
            self._held.remember(spec.hash, (reason, max(role, self._held.get(spec.hash, (None, 0))[1])))
            if not again:  # counted once
                for key, n in ((reason, 1), (reason + "_bytes", spec.nbytes)):
                    self.counts[key] += n
                    self._unsaved[key] += n
            return reason == "not_admitted" and bool(self._seen.get(spec.hash))

    def written(self, hashes: Iterable[bytes]) -> None:
        """These records are on disk now."""
        with self._lock:
            for h in hashes:
                self._held.pop(h, None)

    @property
    def dirty(self) -> bool:
        """Whether something counted or seen is not in the index yet."""
        return bool(self._new_seen or self._new_reused or any(self._unsaved.values()))

    def save(self) -> None:
        """Put what was counted and seen into the index (the writer's thread, every few seconds)."""
        if self.index is None:
            return
        with self._lock:
            counts, self._unsaved = self._unsaved, dict.fromkeys(KEPT_COUNTS, 0)
            seen, self._new_seen = self._new_seen, []
            reused, self._new_reused = self._new_reused, []
        now = self.clock()
        try:
            self.index.log_writes(hour_of(now), counts)
            self.index.mark_seen(seen, reused, now)
            if now - self._last_prune > _PRUNE_EVERY_S:
                self._last_prune = now
                self.index.prune_seen(now - SEEN_MAX_AGE_S, SEEN_KEPT)
        except Exception:  # kept for the next save
            with self._lock:
                for key, n in counts.items():
                    self._unsaved[key] += n
                self._new_seen[:0], self._new_reused[:0] = seen, reused
            raise

    def unsaved(self) -> dict[str, int]:
        """Counts not yet in the index (a `stats` adds them to what the index holds)."""
        with self._lock:
            return dict(self._unsaved)
