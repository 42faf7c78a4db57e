"""Where a prompt's records are now: on disk, queued for the writer, or in RAM only (and why).

Reports are built from this, never from what was asked for: `kvstore warm` and `generate` say
how many of a prompt's tokens reached the disk after their writes, `kvstore serve` how many were
queued and how many stay in RAM only when it stores a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Container, Iterable, Protocol

from kvstore.records import CHECKPOINT, Span
from kvstore.sizes import plural
from kvstore.storage.index import Index


class _Queue(Protocol):  # the writer (`write.writer.Writer`, which imports this module's batch)
    def is_pending(self, h: bytes) -> bool: ...

    def kept_out(self, h: bytes) -> str | None: ...


class _Gate(Protocol):  # `write.admission.Gate`
    def kept_reason(self, h: bytes) -> str | None: ...

#: Why a record is in RAM only, in a report's words.
REASONS = {"not_admitted": "not admitted", "over_budget": "over budget", "ram_only": "RAM-only store",
           "not_written": "not written", "evicted": "evicted since written", "write_failed": "the write failed",
           "under_evicted": "not written, below an evicted record",
           "holder_evicted": "evicted since written (held in a longer record)",
           "quarantined": "not written, quarantined: a restore from it was wrong",
           "under_quarantined": "not written, below a quarantined record"}
#: Reasons whose records never reached the disk and stay in RAM (the others were not written, or
#: were written and removed since: a gc under a disk budget, most often).
HELD = ("not_admitted", "over_budget", "ram_only")


@dataclass
class Placement:
    """Tokens of a prompt by where their records are (checkpoints hold no tokens of their own)."""

    tokens: int = 0
    on_disk: int = 0
    queued: int = 0
    in_ram: int = 0  # not on disk nor queued: `why` says why, by reason
    in_memory: int | None = None  # of those, the tokens the memory tier holds (None: all of them)
    why: dict[str, int] = field(default_factory=dict)
    last: bytes | None = None  # the prompt's last record: the writer's own line names it too
    # Where the queued records go is decided by the writer (admission or a write budget may keep
    # them in RAM): an automatic insert's, under a gate that may.
    undecided: bool = False
    # Why the records "not written" were not, when the caller knows (`the write failed: ...`).
    failure: str = ""
    # Tokens `found_on_disk` counted, and the records on disk that held them (a longer prompt's).
    held: int = 0
    held_by: list[bytes] = field(default_factory=list)

    def text(self) -> str:
        """`1065 on disk`; `0 on disk, 849 in RAM only (not admitted)`; `256 queued for disk`."""
        parts = [f"{self.on_disk} on disk"]
        if self.queued:
            parts.append(f"{self.queued} queued for the writer (admission or the write budget decides: disk or "
                         "RAM only)" if self.undecided else f"{self.queued} queued for disk")
        if self.in_ram:
            reasons = ", ".join(self.reason(r, n if len(self.why) > 1 else None) for r, n in self.why.items())
            kept = self.in_ram if self.in_memory is None else self.in_memory
            held = [f"{kept} in RAM only"] if kept else []
            held += [f"{self.in_ram - kept} not stored"] if kept < self.in_ram else []  # (no memory tier holds them)
            parts.append(f"{', '.join(held)} ({reasons})")
        return ", ".join(parts)

    def reason(self, why: str, count: int | None = None) -> str:
        """A reason in a report's words, with its count of tokens if given: `over budget: 256`,
        `not written; the write failed: ...` when the failure is known."""
        return (REASONS.get(why, why) + ("" if count is None else f": {count}")
                + (f"; {self.failure}" if why == "not_written" and self.failure else ""))

    def found_on_disk(self, n: int, whole: bool, held_by: Iterable[bytes] = ()) -> None:
        """Up to `n` tokens said to be held in RAM (or, when the disk restores the `whole` prompt,
        not written or evicted) are on disk after all, held by another record (of `held_by`)."""
        self.held_by = list(held_by)
        for reason in ("not_written", "evicted", "not_admitted", "over_budget")[0 if whole else 2:]:
            k = max(0, min(n, self.why.get(reason, 0)))
            if k:
                self.on_disk, self.in_ram, n = self.on_disk + k, self.in_ram - k, n - k
                if self.in_memory is not None:
                    self.in_memory = min(self.in_memory, self.in_ram)
                self.why[reason] -= k
                self.held += k
                if not self.why[reason]:
                    del self.why[reason]

    def since(self, before: Placement, index: Index) -> Placement:
        """This placement, where an earlier one of the prompt (`before`: what a report said then)
        found tokens on disk in another record that is gone now (a gc, here or in another process):
        up to that many tokens "not written" (the prompt's own record never was, as that record
        held its tokens) are said to be evicted since written, in that record."""
        k = min(before.held, self.why.get("not_written", 0))
        if k and set(index.logged_deleted(before.held_by)) - index.present(before.held_by):
            self.why["not_written"] -= k
            if not self.why["not_written"]:
                del self.why["not_written"]
            self.why["holder_evicted"] = self.why.get("holder_evicted", 0) + k
        return self

    def summary(self, *, named: bool = False) -> str:
        """`cache of 1065 tokens: 1065 on disk`: the same, of the whole prompt; `named`, with its
        last record's id (`cache of 743 tokens up to record 3f9a12bc: ...`), as the writer names
        the records it then keeps in RAM only (`batch`), so that a log ties the two lines."""
        at = f" up to record {self.last.hex()[:8]}" if named and self.last else ""
        return f"cache of {plural(self.tokens, 'token')}{at}: {self.text()}"


def place(spans: Iterable[Span], index: Index | None, writer: _Queue, gate: _Gate | None,
          memory: Container[bytes] | None = None, landing: Container[bytes] = ()) -> Placement:
    """Where the records `spans` (a prompt's, root first) are. A record queued for the writer
    counts as queued even if the writer will keep it in RAM: flush first to know. `memory`: the
    memory tier, to tell records kept in RAM from those not kept anywhere. `landing`: records
    downloaded from the bucket and being stored on the local disk (queued too)."""
    spans = [s for s in spans if s.kind != CHECKPOINT]
    out = Placement(tokens=sum(s.ntokens for s in spans), last=spans[-1].hash if spans else None,
                    in_memory=None if memory is None else 0)
    pending = {s.hash for s in spans if writer.is_pending(s.hash) or s.hash in landing}
    on_disk = index.present([s.hash for s in spans if s.hash not in pending]) if index is not None else set()
    kept = {s.hash: "ram_only" if index is None else ((gate.kept_reason(s.hash) if gate else None)
                                                     or writer.kept_out(s.hash))
            for s in spans if s.hash not in on_disk and s.hash not in pending}
    # Neither admission nor the budget kept it out: written and deleted since (the deletion log
    # has it: a gc under a disk budget), or never written.
    gone = index.logged_deleted([h for h, why in kept.items() if why is None]) if index is not None else set()
    for s in spans:
        if s.hash in on_disk:
            out.on_disk += s.ntokens
        elif s.hash in pending:
            out.queued += s.ntokens
        else:
            reason = kept[s.hash] or ("evicted" if s.hash in gone else "not_written")
            out.in_ram += s.ntokens
            out.why[reason] = out.why.get(reason, 0) + s.ntokens
            if memory is not None and s.hash in memory:
                out.in_memory += s.ntokens
    return out
