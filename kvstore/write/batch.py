"""Writing one job's records: files first, then rows.

Each blob is written to a temporary file and fsynced while no lock is held (gc never touches a
temporary file); then, under the shared tree lock, the blobs are renamed into place and their
rows inserted in one transaction, so a row never points to a file that is not complete. The
memory tier gets compact copies of what it keeps (with it off, nothing is copied for RAM).
Before any file is written, the store's `admission.Gate` says which records go to disk: what its
policy does not admit, or its write budget has no room for, is kept in RAM only and counted.
Explicit writes (a durable job: warmed, prefilled, pinned) are admitted and never refused by the
budget; they count in it.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

from kvstore import faults
from kvstore.records import CHECKPOINT, Span, prompt_records
from kvstore.storage import blobtree, blobwrite
from kvstore.storage.index import Index, Row
from kvstore.tiers.memory import Record
from kvstore.write import jobs
from kvstore.write.jobs import Destination, Hosts, Job, Parts
from kvstore.write.placement import REASONS

log = logging.getLogger("kvstore")
#: Left out because the disk budget evicted the record (or one above it) as soon as it was written.
_EVICTED = ("evicted", "under_evicted")
#: Left out because a restore from the job's own copy of the record (or one above it) was wrong.
QUARANTINED = ("quarantined", "under_quarantined")


@dataclass
class Batch:
    """What one job left: the records written (or, RAM only, kept), their rows, and the host
    views they were copied from (a refill copies from them again)."""

    written: list[Span]
    rows: list[Row]
    hosts: Hosts
    kept: set[bytes] = field(default_factory=set)  # of `written`, kept in RAM only (not on disk)
    due: list[Span] = field(default_factory=list)  # of those, the ones to write now (`Gate.kept`)


@dataclass
class _Staged:
    files: dict[bytes, blobwrite.Staged]
    parts: dict[bytes, Parts]  # of the records the memory tier keeps: copied once
    failed: tuple[bytes, OSError] | None  # the record whose file could not be written
    kept: dict[bytes, str] = field(default_factory=dict)  # record -> why it stays in RAM only
    taken: int = 0  # bytes of the write budget taken for the staged files
    taken_records: int = 0


def write(dest: Destination, job: Job,
          committed: Callable[[list[Row]], None] | None = None) -> Batch:
    """Write the records of `job` not stored yet; `committed` gets their rows once committed
    (still under the lock). A record whose file or row could not be written (its file removed
    again, the error counted) is kept in RAM only, "write_failed", with the records after it."""
    hosts = Hosts.of(job)
    if dest.index is not None and (job.specs or job.pin or job.reached):
        # A download being stored is not written again, and its row is there to pin and type.
        dest.landing(list(dict.fromkeys([*(spec.hash for spec in job.specs), *job.pin, *job.reached])))
    staged = _stage(dest, job, hosts)
    # Shared with other writers, exclusive of gc and repair: from "is it stored?" to the row.
    lock = blobtree.tree_lock(dest.root, exclusive=False) if dest.root is not None else nullcontext()
    with lock:
        todo = still_needed(dest.index, job) if dest.index is not None and job.specs else job.specs
        written, rows, copies = _place(dest, job, hosts, todo, staged)
        for st in staged.files.values():  # stored meanwhile by another writer, or after a failure
            blobwrite.discard(st)
        if rows and dest.index is not None:
            t = job.tenant  # (a salted tenant's owner, whose quota it shares: kept with its rows)
            inserted = _insert(dest, rows, {t.tag: t.owner} if t is not None and t.owner is not None else None)
            if len(inserted) < len(rows):  # a full disk took the rest: the chain ends at the last row in
                cut = next(i for i, s in enumerate(written) if s.hash == rows[len(inserted)].hash)
                for spec in written[cut:]:
                    staged.kept.setdefault(spec.hash, "write_failed")
                rows = inserted
            if committed is not None and rows:
                committed(rows)
        if job.pin and dest.index is not None:
            dest.index.pin(job.pin)
        if job.reached and dest.index is not None:
            dest.index.raise_role(job.reached, job.role)
        _give_back(dest, job, staged, rows)
        _settle(dest)  # under the lock, which its transaction would otherwise wait for again
    for row in rows:  # quarantined while its row was on its way: on disk now, quarantined there
        if (why := dest.quarantined_in(job, row.hash)) is not None:
            dest.damaged(row.hash, why)
    if copies:
        dest.memory.put(reversed(copies))
        # Quarantined meanwhile: gone from RAM again (`Writer.quarantine` marks, then discards).
        dest.memory.discard([c.hash for c in copies if dest.quarantined_in(job, c.hash) is not None])
    failed = [s for s in written if staged.kept.get(s.hash) == "write_failed"]
    _say_lost(dest, failed)
    dest.leave_out([s.hash for s in failed if s.hash in dest.memory], "write_failed")  # (the next insert writes them)
    for why in ("under_evicted", *QUARANTINED):
        dest.leave_out([s.hash for s in written if staged.kept.get(s.hash) == why], why)
    for row in rows:
        dest.left_out.pop(row.hash, None)
    kept = {s.hash for s in written if s.hash in staged.kept}
    in_ram = [s for s in written if s.hash in kept and s.kind != CHECKPOINT and s.hash in dest.memory]
    if in_ram:
        _say_kept(dest, in_ram, staged.kept)
    due = []
    if dest.gate is not None:
        due = [spec for spec in written if staged.kept.get(spec.hash) in ("not_admitted", "over_budget")
               and dest.gate.kept(spec, staged.kept[spec.hash], job.role)]
        dest.gate.written(row.hash for row in rows)
    return Batch(written, rows, hosts, kept, due)


def _say_kept(dest: Destination, spans: list[Span], why: dict[bytes, str]) -> None:
    """One log line for the tokens of a job that the writer keeps in RAM only, by reason, naming
    its last record (as `kvstore serve`'s line for the request that queued it does); a warning
    when a write failed, with the failure."""
    by_reason: dict[str, int] = {}
    for s in spans:
        by_reason[why[s.hash]] = by_reason.get(why[s.hash], 0) + s.ntokens
    failed = "write_failed" in by_reason
    if failed or log.isEnabledFor(logging.INFO):
        log.log(logging.WARNING if failed else logging.INFO, "kvstore: %s up to record %s stay in RAM only, not written",
                ", ".join(f"{n} tokens ({REASONS.get(r, r)}" + (f": {dest.stats.last_error})" if r == "write_failed"
                                                                   else ")") for r, n in by_reason.items()),
                spans[-1].hash.hex()[:8])


def _say_lost(dest: Destination, spans: list[Span]) -> None:
    """One log line for the tokens of a job a failed write left out (its file or its row: the
    records after it hang from it), which are neither on disk nor in RAM: `kvstore serve`'s line
    for the request said they were queued for disk."""
    spans = [s for s in spans if s.kind != CHECKPOINT and s.hash not in dest.memory]
    if spans:
        log.warning("kvstore: %d tokens up to record %s not stored (neither on disk nor in RAM): a write failed (%s)",
                    sum(s.ntokens for s in spans), spans[-1].hash.hex()[:8], dest.stats.last_error)


def say_unstored(dest: Destination, job: Job) -> None:
    """`_say_lost` for a job whose write failed as a whole (the store's lock or index could not be
    reached): its records not stored, all of them when the index cannot say."""
    try:
        present = dest.index.present([s.hash for s in job.specs]) if dest.index is not None else set()
    except Exception:
        present = set()
    _say_lost(dest, [s for s in job.specs if s.hash not in present])


def _give_back(dest: Destination, job: Job, staged: _Staged, rows: list[Row]) -> None:
    """Return to the write budget what was taken for files that were not stored after all."""
    unused = staged.taken - sum(row.size for row in rows)
    if dest.gate is not None and dest.gate.budget is not None and unused > 0:
        try:
            dest.gate.budget.give_back(unused, max(0, staged.taken_records - len(rows)), explicit=job.durable)
        except Exception as e:
            dest.count_error(e)


def _settle(dest: Destination) -> None:
    """Log the writes an unlimited budget counted (`WriteBudget.settle`)."""
    if dest.gate is not None and dest.gate.budget is not None:
        try:
            dest.gate.budget.settle()
        except Exception as e:  # only counts: kept for the next write
            dest.count_error(e)


def _stage(dest: Destination, job: Job, hosts: Hosts) -> _Staged:
    """Write and fsync the temporary files of the records still needed, holding no lock."""
    staged = _Staged({}, {}, None)
    if dest.root is None or dest.index is None or not job.specs:
        return staged
    for spec, parts in _admit(dest, job, hosts, still_needed(dest.index, job), staged):
        if dest.memory.keeps(spec.nbytes):
            staged.parts[spec.hash] = parts
        dest.between_records()
        try:
            staged.files[spec.hash] = blobwrite.stage(dest.root, spec.hash, *parts[1:], fsync=dest.fsync,
                                                          trust=dest.trust)
        except OSError as e:
            staged.failed = (spec.hash, e)  # later records hang from this one: stop there
            break
    return staged


def _admit(dest: Destination, job: Job, hosts: Hosts, specs: list[Span], staged: _Staged
           ) -> list[tuple[Span, Parts]]:
    """The records (with their blob parts) the gate lets go to disk, the write budget taken for
    them; the others are marked kept in `staged`, in RAM only."""
    for spec in specs:  # written and evicted at once, lately: the budget holds what is kept ahead of them
        if dest.quarantined_in(job, spec.hash) is not None:
            staged.kept[spec.hash] = "quarantined"
        elif staged.kept.get(spec.parent) in QUARANTINED:
            staged.kept[spec.hash] = "under_quarantined"
        elif dest.wasted(spec.hash, job.role):
            staged.kept[spec.hash] = "evicted"  # (not written again: it would be evicted again)
        elif staged.kept.get(spec.parent) in _EVICTED:
            staged.kept[spec.hash] = "under_evicted"
    specs = [s for s in specs if s.hash not in staged.kept]
    gate = dest.gate
    if gate is None:
        return [(spec, _parts(dest, job, hosts, spec)) for spec in specs]
    admitted = gate.admitted(specs, job.durable)
    chosen_hashes = {s.hash for s in admitted}
    staged.kept.update((s.hash, "not_admitted") for s in specs if s.hash not in chosen_hashes)
    chosen = [(spec, _parts(dest, job, hosts, spec)) for spec in admitted]
    sizes = [blobwrite.blob_size(tensors, meta) for _, (_, tensors, meta) in chosen]
    try:
        k = gate.budget.take(sizes, explicit=job.durable)
    except Exception as e:  # the write log cannot be read or written: automatic writes wait
        dest.count_error(e)
        k = len(sizes) if job.durable else 0
    staged.taken, staged.taken_records = sum(sizes[:k]), k
    for spec, parts in chosen[k:]:
        staged.kept[spec.hash] = "over_budget"
        if dest.memory.keeps(spec.nbytes):
            staged.parts[spec.hash] = parts
    return chosen[:k]


def _parts(dest: Destination, job: Job, hosts: Hosts, spec: Span) -> Parts:
    """The blob parts of one record (a copy of its tensors), after letting a restore go first."""
    dest.between_records()
    return hosts.parts(job, spec)


def _place(dest: Destination, job: Job, hosts: Hosts, todo: list[Span], staged: _Staged
           ) -> tuple[list[Span], list[Row], list[Record]]:
    """Rename each record's file into place (or write it now), in chain order: the records
    placed, their rows (not inserted yet) and the memory tier's copies of them."""
    written: list[Span] = []
    rows: list[Row] = []
    copies: list[Record] = []
    failed = False
    for spec in todo:
        st = staged.files.pop(spec.hash, None)
        keep = dest.memory.keeps(spec.nbytes)  # with memory_bytes=0 nothing is copied for RAM
        if dest.quarantined_in(job, spec.hash) is not None:  # (quarantined while its file was staged)
            staged.kept[spec.hash] = "quarantined"
        elif spec.parent in staged.kept:  # under a record kept in RAM: no row may hang from it
            above = staged.kept[spec.parent]
            staged.kept.setdefault(spec.hash, "under_evicted" if above in _EVICTED else
                                   "under_quarantined" if above in QUARANTINED else above)
        elif failed:  # after a failed write (a full disk, most often): no more tries in this job
            staged.kept.setdefault(spec.hash, "write_failed")
        # (Evicted by the disk budget as soon as written: in the deletion log, which every process's
        # memory tier follows, dropping what it names; so not kept in RAM either.)
        # (Quarantined, or below one: computed from what restored wrong, so not kept either.)
        keep = keep and staged.kept.get(spec.hash) not in (*_EVICTED, *QUARANTINED)
        if spec.hash in staged.parts:
            tokens, tensors, meta = staged.parts.pop(spec.hash)
        elif (st is not None or spec.hash in staged.kept) and not keep:  # only its token ids are needed
            tokens, tensors, meta = job.token_ids(spec), {}, {}
        else:
            tokens, tensors, meta = hosts.parts(job, spec)
        if spec.hash in staged.kept:
            if st is not None:
                blobwrite.discard(st)
        elif st is None and not _unstaged_allowed(dest, job, staged, spec, tensors, meta):
            staged.kept[spec.hash] = "over_budget"
        elif dest.root is not None:
            try:
                if staged.failed is not None and staged.failed[0] == spec.hash:
                    raise staged.failed[1]
                size, checksum = blobwrite.place(st) if st is not None else \
                    blobwrite.write(dest.root, spec.hash, tensors, meta, fsync=dest.fsync, trust=dest.trust)
            except OSError as e:
                # Kept in RAM, as records admission keeps out are: a later insert of the prompt
                # tries its write again. Later records hang from this one: they are kept too.
                dest.count_error(e)
                staged.kept[spec.hash], failed = "write_failed", True
            else:
                faults.hit("after_rename")
                rows.append(Row(spec.hash, spec.ns, spec.parent, spec.depth, spec.kind, spec.ntokens,
                                spec.first_token, size, checksum, pinned=int(spec.hash in job.pin),
                                role=job.role, tenant=spec.tenant))
        if keep:
            copies.append(jobs.compact(job, spec, tokens, tensors))
        written.append(spec)
        if spec.kind != CHECKPOINT and job.holds_all_layers(spec):
            dest.remember_complete(spec.hash)
    return written, rows, copies


def _unstaged_allowed(dest: Destination, job: Job, staged: _Staged, spec: Span, tensors, meta) -> bool:
    """A record found missing only under the lock (gc evicted an ancestor meanwhile) is written
    there and then: the gate and the budget decide for it as for the others."""
    gate = dest.gate
    if gate is None or dest.root is None or dest.index is None:
        return True
    if staged.failed is not None and staged.failed[0] == spec.hash:
        return True  # its budget is taken: the failure is raised where it is placed
    size = blobwrite.blob_size(tensors, meta)
    try:
        if gate.budget.take([size], explicit=job.durable) < 1:
            return False
    except Exception as e:
        dest.count_error(e)
        return job.durable
    staged.taken += size
    staged.taken_records += 1
    return True


def _insert(dest: Destination, rows: list[Row], owners: dict[str, str] | None = None) -> list[Row]:
    """Insert the rows of the files just placed, in one transaction, and return them. On a full
    disk (the files may have taken the room the index needs), the first half of them, and so on
    down to one: the files of those left out are removed first, to make room (a chain stored up
    to where the disk allowed, rather than nothing of it). Files of rows not inserted are orphans,
    removed; none inserted (another failure, or not even one): []."""
    n, said = len(rows), False
    while True:
        try:
            dest.index.insert(rows[:n], owners)
            break
        except Exception as e:
            full = _disk_full(e) and n > 1
            for row in rows[n // 2 if full else 0 : n]:
                blobtree.remove(dest.root, row.hash)
            if not said:
                said = True
                dest.count_error(e)
            if not full:
                return []
            n //= 2
    dest.stats.records_written += n
    dest.stats.bytes_written += sum(row.size for row in rows[:n])  # (counted once their rows are in)
    return rows[:n]


def _disk_full(e: BaseException) -> bool:
    """Whether `e` is SQLite's or the OS's "no space left"."""
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or (
        isinstance(e, sqlite3.OperationalError) and "full" in str(e))


def still_needed(index: Index, job: Job) -> list[Span]:
    """The job's records that are not stored yet, parents first. If gc (in any process)
    evicted a record the job hangs from after `insert` looked, the chain is written again
    from the job's own tokens and arrays where it holds them; the records it cannot hang from
    a stored parent are left out: no record is ever stored under a missing parent."""
    inside = {s.hash for s in job.specs}
    outside = {s.parent for s in job.specs if s.parent not in inside and s.parent != job.ns}
    present = index.present([s.hash for s in job.specs] + list(outside))
    specs = job.specs
    if outside - present:
        first = next((s for s in specs if s.kind != CHECKPOINT), None)
        if first is not None and first.parent != job.ns and first.parent not in present:
            C = int(job.metadata["chunk_size"])
            ancestors = prompt_records(job.ns, job.tokens[: (first.depth - 1) * C], C, tail=False,
                                       tenant=job.tenant, shared=job.shared)
            if job.tenant is not None:  # a tenant's insert never writes a shared record
                ancestors = [a for a in ancestors if a.tenant is not None]
            present |= index.present([a.hash for a in ancestors])
            if ancestors and job.holds_all_layers(ancestors[0]):  # (a record copied from RAM does not)
                specs = ancestors + specs
        have, hung = set(present), []
        for s in specs:  # parents first: a record under one left out is left out too
            if s.parent == job.ns or s.parent in have:
                hung.append(s)
                have.add(s.hash)
        specs = hung
    return [s for s in specs if s.hash not in present]
