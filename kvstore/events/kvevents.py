"""`KVEvents`: a store's records published as vLLM's KV events, on a thread of their own.

The store (`kvstore/store.py`) subscribes its methods to the events of its parts: `committed`
to the writer's `on_commit` and the disk tier's `on_store` (records that reached the disk),
`memory_changed` to the memory tier's `on_change` and `queued`/`unqueued` to the writer's
`on_queue`/`on_unqueue` (records that came into RAM or left it: a record is in RAM from the
moment it is queued, and stays there when the writer hands its copy to the memory tier; it is
announced gone from RAM when neither the queue nor the memory tier holds it), and calls
`announce(ns)` for every model it binds. Each only queues what happened (the callers'
threads never hash, read or send); the thread turns it into events (`changes.Changes`), reads
the index's deletion and insertion logs every `POLL_S` for what any process removed or added
(`kvstore gc`, `kvstore warm`, another server), and publishes batches of at most `MAX_BATCH`
events (`publisher.Publisher`).

At start the thread waits (at most `START_WAIT_S`) for a first subscriber to reach the socket, so
that a router the node connects to gets the start batch (`publisher`), then sends
`AllBlocksCleared`; each bound namespace is then announced whole, from the index and the blobs,
in the background. On a bound endpoint, every subscriber that comes later (a router started
after the node, or restarted, or another beside it: Dynamo's indexer and vLLM's router do not ask
the replay socket) is answered with `AllBlocksCleared` and the store announced again, to all (what RAM holds
included: it is still there).
When more changes wait than `max_queue_size`, or the index's logs have forgotten entries not read
yet, what was announced can no longer be trusted: the thread sends `AllBlocksCleared` and
announces the store again (counted as a resync; the records it held in RAM are announced again as
they come back).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Iterable, Iterator

from kvstore.events import wire
from kvstore.events.changes import Changes
from kvstore.events.config import EventsConfig, binds
from kvstore.events.publisher import Publisher
from kvstore.records import RecordId
from kvstore.storage.index import Index

log = logging.getLogger("kvstore")

#: Events per batch, at most.
MAX_BATCH = 512
#: How often the index's deletion and insertion logs are read.
POLL_S = 0.5
#: The index's logs of what any process removed from it and added to it.
LOGS = ("deletions", "insertions")
#: How long the start batch waits for a first subscriber (then it is sent anyway: a router that
#: comes later to a bound endpoint gets the store announced again; to a router the node connects
#: to, it asks the replay socket for it, or starts from nothing).
START_WAIT_S = 3.0


def start(config: EventsConfig, index: Index | None, root) -> "KVEvents | None":
    """The publisher `config` asks for, started (None when it publishes nothing, as vLLM's
    `NullEventPublisher`)."""
    if not config.publishes:
        log.info("kvstore: kv_events: enable_kv_cache_events is not true: no KV events are published")
        return None
    return KVEvents(config, index, root)


class KVEvents:
    """The publisher of one open store (see the module docstring)."""

    def __init__(self, config: EventsConfig, index: Index | None, root, *, poll_s: float = POLL_S):
        self.config = config
        self.publisher = Publisher(config)
        self.changes = Changes(index, root, config.block_size)
        self.index, self.poll_s = index, poll_s
        self._ram: dict[str, set[bytes]] = {"queue": set(), "memory": set()}  # what holds which record
        self._in_ram: dict[bytes, tuple] = {}  # record in RAM -> (its identity, its token ids)
        self._cond = threading.Condition()
        self._queue: deque[tuple] = deque()
        self._queued = 0
        self._stop = self._lost = self._busy = False
        self._bound: list[bytes] = []  # namespaces announced (or to be), in order
        self._todo: deque[bytes] = deque()
        self._announcing: Iterator[list[dict]] | None = None
        # The last entry read of the index's deletion and insertion logs.
        self._seen = {log: getattr(index, f"{log}_end")() if index is not None else 0 for log in LOGS}
        self._polled = 0.0
        self._polls_asked = self._polls_done = 0  # reads of the logs asked for (`settle`), made
        self.counts = {"events": 0, "batches": 0, "dropped_changes": 0, "resyncs": 0,
                       "subscriber_announces": 0, "errors": 0}
        # A bound socket sees each router come and go; one the node connects to may not tell.
        self._greets = binds(config.endpoint)
        self.announce_started: float | None = None
        self.announced_at: float | None = None  # when the last namespace was announced whole
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    # -- what the store's parts tell (any thread; never waits) --------------------------------

    def committed(self, rows: list) -> None:
        """Rows the index has now: their records are on disk."""
        self._put(("disk", list(rows)), len(rows))

    def memory_changed(self, added: list, dropped: list) -> None:
        """Records the memory tier took in, and those it let go."""
        self._put(("memory", [(_identity(r), r.tokens) for r in added], [r.hash for r in dropped]),
                  len(added) + len(dropped))

    def queued(self, records: list) -> None:
        """Records queued for the writer, as (record, its token ids): in RAM from now on."""
        self._put(("queue", list(records), []), len(records))

    def unqueued(self, hashes: list[bytes]) -> None:
        """Records the writer is done with: gone from RAM unless the memory tier holds them."""
        self._put(("queue", [], list(hashes)), len(hashes))

    def announce(self, ns: bytes) -> None:
        """Announce every record of namespace `ns` on disk (once per namespace)."""
        with self._cond:
            if ns in self._bound:
                return
            self._bound.append(ns)
            self._todo.append(ns)
            self._cond.notify_all()

    def _put(self, item: tuple, n: int) -> None:
        with self._cond:
            if self._queued + n > self.config.max_queue_size:
                self._lost = True
                self.counts["dropped_changes"] += n
                return
            self._queue.append(item)
            self._queued += n
            self._cond.notify_all()

    # -- for tests, benchmarks and shutdown ----------------------------------------------------

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until everything told so far is published and every namespace announced whole
        (the index's logs read once more). False if `timeout` ran out first."""
        with self._cond:
            self._polls_asked += 1
            ticket = self._polls_asked if self.index is not None else 0
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._stop or (
                not self._queue and not self._todo and self._announcing is None and not self._busy
                and self._polls_done >= ticket), timeout)

    def close(self) -> None:
        """Publish what is queued, then stop the thread and close the sockets."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self.publisher.close()

    def stats(self) -> dict[str, Any]:
        announce_s = (self.announced_at - self.announce_started
                      if self.announced_at is not None and self.announce_started is not None else None)
        return {"endpoint": self.publisher.address, "topic": self.config.topic,
                "replay_endpoint": self.publisher.replay_address, "block_size": self.config.block_size,
                "encoding": self.config.encoding, "next_sequence": self.publisher.sent,
                "blocks": self.changes.blocks(), "announced": self.announced_at is not None,
                "announce_seconds": announce_s, "unreadable": self.changes.unreadable, **self.counts}

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.publisher.wait_for_subscriber(START_WAIT_S, stop=lambda: self._stop)
        except Exception as e:
            self._failed(e)
        self._publish([wire.cleared()])
        wait = 0.05 if self.config.replay_endpoint is not None else 0.25
        while True:
            with self._cond:
                if not (self._queue or self._todo or self._announcing or self._stop or self._lost
                        or self._polls_asked > self._polls_done):
                    self._cond.wait(wait)
                stopping = self._stop
            try:
                # The deletion log is read before the queue is taken: a commit that replaced a
                # record (a tail by the chunk that covers it) is then in the queue taken, and
                # applied before the deletion it logged (its blocks never look removed).
                logged = self._poll(final=stopping)
            except Exception as e:
                logged = {}
                self._failed(e)
            with self._cond:
                items, self._queue, self._queued = self._queue, deque(), 0
                lost, self._lost = self._lost, False
                final = self._stop and not stopping  # stopped meanwhile: the log is read once more
                stopping = self._stop
                self._busy = True
            try:
                self._step(items, lost, logged, final=final)
            except Exception as e:
                self._failed(e)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                if stopping and not self._queue:
                    return

    def _failed(self, e: Exception) -> None:
        """Never let the publisher die: count, say once, go on."""
        self.counts["errors"] += 1
        if self.counts["errors"] == 1:
            log.warning("kvstore: KV events: %s: %s (counted in stats()['events']['errors'])", type(e).__name__, e)

    def _poll(self, final: bool) -> dict[str, list]:
        """The new entries of the index's logs, by log, when it is due (every `poll_s`, when
        `settle` asks, at the end)."""
        now = time.monotonic()
        with self._cond:
            asked = self._polls_asked
        if self.index is None or not (final or now - self._polled >= self.poll_s or asked > self._polls_done):
            return {}
        events = {log: self._read(log) for log in LOGS}
        self._polled = now
        with self._cond:
            self._polls_done = asked
        return events

    def _step(self, items: Iterable[tuple], lost: bool, logged: dict[str, list], final: bool) -> None:
        """Publish what this turn took: the commits and RAM changes queued, then what the logs
        said was added and deleted, read before them (and, at the end, once more)."""
        self.publisher.serve_replay()
        came = self.publisher.take_subscriptions()
        events: list[dict] = []
        if lost:
            events += self._resync()
        elif came and self._greets:
            # A router that came (or came back) has not seen what was sent before it: all are
            # told AllBlocksCleared and the store again (a router's view stays whole throughout).
            self.counts["subscriber_announces"] += 1
            events += self._announce_again(keep_ram=True)
        for item in items:
            if item[0] == "disk":
                events += self.changes.stored_rows(item[1])
            else:
                events += self._ram_changed(*item)
        last = self._poll(final=True) if final else {}
        with self._cond:
            bound = set(self._bound)
        events += self.changes.inserted(logged.get("insertions", []) + last.get("insertions", []), bound)
        events += self.changes.deleted(logged.get("deletions", []) + last.get("deletions", []), self._ram["queue"])
        events += self._announce_step()
        self._publish(events)

    def _ram_changed(self, holder: str, added: list, dropped: list[bytes]) -> list[dict]:
        """Records that came into the queue or the memory tier, and those that left it: RAM holds
        a record while either of them does."""
        held, other = self._ram[holder], self._ram["memory" if holder == "queue" else "queue"]
        events = []
        for rec, tokens in sorted(added, key=lambda r: (r[0].depth or 0, r[0].kind)):  # parents first
            held.add(rec.hash)
            self._in_ram.setdefault(rec.hash, (rec, tokens))
            events += self.changes.stored(rec, tokens, wire.MEDIUM_RAM)
        held.difference_update(dropped)
        gone = [h for h in dropped if h not in other]
        for h in gone:
            self._in_ram.pop(h, None)
        return events + self.changes.dropped(gone, wire.MEDIUM_RAM)

    def _read(self, log: str) -> list:
        """The entries of one of the index's logs past what was read (a resync if it forgot some
        of them)."""
        since, end_of = getattr(self.index, f"{log}_since"), getattr(self.index, f"{log}_end")
        out: list = []
        while True:
            seen = self._seen[log]
            entries = since(seen)
            end = end_of() if not entries else entries[-1][0]
            if (entries and entries[0][0] > seen + 1) or end < seen:
                self._seen[log] = end  # forgotten (or a rebuilt index): announce again
                with self._cond:
                    self._lost = True
                return out
            if not entries:
                return out
            self._seen[log] = end
            out += entries

    def _resync(self) -> list[dict]:
        self.counts["resyncs"] += 1
        log.warning("kvstore: KV events: changes were lost (more than max_queue_size waited, or the "
                    "index's logs moved on): announcing the store again")
        return self._announce_again()

    def _announce_again(self, keep_ram: bool = False) -> list[dict]:
        """`AllBlocksCleared`, every bound namespace announced whole again (in steps), and, with
        `keep_ram` (nothing was lost: what RAM holds is known), the records announced in RAM
        again at once: they stay there, and would not be announced again until they left it."""
        self.announce_started = self.announced_at = None  # (the stats time this announcement)
        in_ram = [self._in_ram[h] for h in self.changes.held[wire.MEDIUM_RAM].records if h in self._in_ram]
        self.changes.clear()
        events = [wire.cleared()]
        if keep_ram:
            for rec, tokens in sorted(in_ram, key=lambda r: (r[0].depth or 0, r[0].kind)):  # parents first
                events += self.changes.stored(rec, tokens, wire.MEDIUM_RAM)
        else:
            for held in self._ram.values():
                held.clear()
            self._in_ram.clear()
        with self._cond:
            self._todo = deque(self._bound)
        self._announcing = None
        return events

    def _announce_step(self) -> list[dict]:
        """The next step of the namespace being announced (the next namespace once one is done)."""
        while True:
            if self._announcing is None:
                with self._cond:
                    if not self._todo:
                        return []
                    ns = self._todo.popleft()
                if self.announce_started is None:
                    self.announce_started = time.monotonic()
                self._announcing = self.changes.announce(ns)
            step = next(self._announcing, None)
            if step is not None:
                return step
            self._announcing = None
            with self._cond:
                if not self._todo:
                    self.announced_at = time.monotonic()

    def _publish(self, events: list[dict]) -> None:
        for start in range(0, len(events), MAX_BATCH):
            batch = _merged(events[start : start + MAX_BATCH])
            self.publisher.send(wire.encode(batch, self.config.encoding))
            self.counts["batches"] += 1
            self.counts["events"] += len(batch)


def _identity(record: RecordId) -> RecordId:
    """Which record `record` is, without its arrays (the queue keeps no memory-tier record)."""
    r = record
    return RecordId(r.hash, r.ns, r.parent, r.depth, r.kind, r.ntokens, r.first_token, **r.owner())


def _merged(events: list[dict]) -> list[dict]:
    """Removals in a row from one medium as one `BlockRemoved`."""
    out: list[dict] = []
    for e in events:
        last = out[-1] if out else None
        if (last is not None and e["type"] == "BlockRemoved" and last["type"] == "BlockRemoved"
                and last["medium"] == e["medium"]):
            last["block_hashes"] = last["block_hashes"] + e["block_hashes"]
        else:
            out.append(e)
    return out
