"""The shapes the writer works on: a queued `Job` and the records (`Span`) it holds, the host
copies a job's records are written from, and where they go (`Destination`, with its counters).

The caller's thread only builds a `Job` (its cache's arrays, no copy: second references to them,
or lazy mlx views where a codec computes its deltas); the first thread that reads the job makes
them numpy views (`Job.ready`), and the writer's thread turns those into blob tensors (`Hosts`)
and into compact copies for the memory tier (`compact`).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import mlx.core as mx
import numpy as np

from kvstore import tenants
from kvstore.records import CHECKPOINT, Span
from kvstore.restore.arrays import tag_of
from kvstore.storage import blobformat
from kvstore.storage.index import Index
from kvstore.tenants import Tenant
from kvstore.tiers.memory import MemoryTier, Record, held
from kvstore.trust import Trust

if TYPE_CHECKING:
    from kvstore.write.admission import Gate

_said_lock = threading.Lock()
log = logging.getLogger("kvstore")

# Records known to hold every layer's K/V, remembered so that a refill is not looked for again.
COMPLETE_REMEMBERED = 100_000
# A write that fails as the one before it did (a full disk fails every write) is said at most
# once in this many seconds, with how many were not said: each is counted all the same.
ERROR_QUIET_S = 60.0

Parts = tuple[np.ndarray, dict[str, blobformat.Tensor], dict[str, str]]  # tokens, tensors, metadata




@dataclass
class Job:
    """One insert, queued: the new records (`specs`) as views of the caller's cache."""

    ns: bytes
    tokens: np.ndarray
    # "layer.name" -> its tokens, token axis 2: after `ready`, a numpy view (or an mlx view,
    # scheduled); before it, possibly the whole array they are a range of (`prepare` cuts it)
    arrays: dict[str, np.ndarray | mx.array]
    origins: dict[str, int]  # "layer.name" -> the token element 0 of its view (after `ready`) holds
    views: dict[str, mx.Dtype]  # names carried as raw bits (bfloat16 as uint16) -> real dtype
    specs: list[Span]
    metadata: dict[str, str]
    checkpoint: dict[str, mx.array] = field(default_factory=dict)  # for the CHECKPOINT spec
    pin: list[bytes] = field(default_factory=list)
    nbytes: int = 0
    # Stored chunks and tails this job holds every layer's K/V for: a stored one that lacks some
    # (a sliding window had slid past them when it was written) is written again, complete.
    refill: list[Span] = field(default_factory=list)
    durable: bool = False  # warmed or pinned: written whatever the admission policy says
    # Work insert left for the first thread that reads the job (the writer's, or a fetch's from
    # the pending tier), never the caller's: it may replace `arrays`, `origins` and `views`.
    prepare: Callable[["Job"], None] | None = None
    _prepare_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def ready(self) -> None:
        """Run `prepare`, if that is not done yet (one thread does it; others wait for it)."""
        if self.prepare is not None:
            with self._prepare_lock:
                if self.prepare is not None:
                    self.prepare(self)
                    self.prepare = None
    # The insert's role class (`upkeep.evict.ROLES`) and, when above the weakest, every record it
    # reaches (stored ones too): their rows' role is raised to it.
    role: int = 0
    reached: list[bytes] = field(default_factory=list)
    # False: its records' arrays are not known to hold every layer's K/V (copied back from RAM
    # for a model with a sliding window): nothing is completed or dropped as redundant by them.
    whole: bool = True
    # Record key -> header extension fields of its blob (`storage.blobformat`: a canary).
    extensions: dict[bytes, dict[str, str]] = field(default_factory=dict)
    # The tenant that inserted it (None: shared) and how many chunks of its prompt were shared
    # (`records.prompt_records`): its records are remade from these if an ancestor went meanwhile.
    tenant: Tenant | None = None
    shared: int = 0
    # Its place in the writer's queue (1, 2, ...): a quarantine reaches the jobs queued before it.
    seq: int = 0

    def slices(self, spec: Span, arrays: dict) -> dict:
        """The part of each array that falls in the spec's tokens (always a suffix of them)."""
        out = {}
        for name, a in arrays.items():
            origin = self.origins[name]
            lo = max(spec.start, origin)
            if lo < spec.end:
                out[name] = a[:, :, lo - origin : spec.end - origin]
        return out

    def record(self, spec: Span) -> Record:
        """The record `spec` as zero-copy views of the queued arrays (visible before it is written)."""
        self.ready()
        return held(spec, self.tokens[spec.start : spec.end],
                    dict(self.checkpoint) if spec.kind == CHECKPOINT else self.slices(spec, self.arrays),
                    dict(self.views), nbytes=spec.nbytes, extensions=self.extensions.get(spec.hash))

    def token_ids(self, spec: Span) -> np.ndarray:
        """The spec's token ids as a blob stores them (little-endian int32)."""
        return np.ascontiguousarray(self.tokens[spec.start : spec.end], dtype="<i4")

    def holds_all_layers(self, spec: Span) -> bool:
        """Whether every layer's K/V for the spec's first token is in the job (no sliding
        window slid past it)."""
        return self.whole and all(origin <= spec.start for origin in self.origins.values())


@dataclass
class WriterStats:
    """What the writer did and dropped, since the store was opened."""

    jobs: int = 0
    records_written: int = 0
    bytes_written: int = 0
    dropped_jobs: int = 0
    dropped_bytes: int = 0
    write_errors: int = 0
    last_error: str = ""
    redundant_dropped: int = 0  # older tails dropped because a newer record holds their tokens
    redundant_bytes: int = 0
    refilled: int = 0  # stored records written again with the window data they lacked


@dataclass
class Destination:
    """Where the writer puts records: the index and blob tree (both None: RAM only), the memory
    tier, and what it counts."""

    index: Index | None
    root: Path | None
    memory: MemoryTier
    fsync: bool = True
    stats: WriterStats = field(default_factory=WriterStats)
    complete: dict[bytes, None] = field(default_factory=dict)  # insertion-ordered, bounded
    # Records the writer left out of the disk lately, and why: "write_failed" (kept in RAM: the
    # next insert of them writes them again), "under_evicted" (below a record the disk budget
    # evicted as soon as it was written), "quarantined" (its restore from RAM failed a check
    # while it was queued) or "under_quarantined" (below one). Bounded as `complete` is; one
    # written since leaves it.
    left_out: dict[bytes, str] = field(default_factory=dict)
    # Records quarantined lately (a restore from RAM of them was wrong: `Writer.quarantine`) ->
    # (the last job queued then, why). The jobs queued until then hold the same wrong arrays: they
    # write none of them, nor what hangs below them; a later insert computed them again. Bounded
    # as `complete` is.
    quarantined: dict[bytes, tuple[int, str]] = field(default_factory=dict)
    # Quarantines a record on disk (`DiskTier.damaged`): one whose row went in after it was
    # quarantined (set where the store is built; RAM only: nothing to mark).
    damaged: Callable[[bytes, str], None] = lambda h, why: None
    # Whether the disk budget evicted a record as soon as it was written, lately (`DiskBudget`).
    wasted: Callable[[bytes, int], bool] = lambda h, role: False  # (record, the insert's role class)
    gate: "Gate | None" = None  # what may go to disk (None: everything)
    # Called before each record's copy and file: waits (bounded) while a restore runs, so that
    # the restore has the cores and the memory bandwidth (see `Writer.reading`).
    between_records: Callable[[], None] = lambda: None
    trust: Trust | None = None  # what tags every blob's header (`kvstore.trust`)
    # Called with a job's record hashes before what it still needs is decided: waits (bounded)
    # for those a download is storing on the local disk (`tiers.writethrough`), so none is
    # written twice; set where the store is built, when it has a remote tier.
    landing: Callable[[list[bytes]], None] = lambda hashes: None
    # Exact mode: an older tail is never dropped for a newer one that holds its tokens, since an
    # exact restore ends only at a step or at a stored prompt's own end (`write.dedup`).
    keep_prefixes: bool = False
    said: dict[str, tuple[float, int]] = field(default_factory=dict)  # failure -> (when last said, not said since)

    def remember_complete(self, h: bytes) -> None:
        _remember(self.complete, [h], None)

    def leave_out(self, hashes: list[bytes], why: str) -> None:
        _remember(self.left_out, hashes, why)

    def quarantine(self, h: bytes, last_job: int, why: str) -> None:
        _remember(self.quarantined, [h], (last_job, why))

    def quarantined_in(self, job: Job, h: bytes) -> str | None:
        """Why record `h` of `job` is not to be written (quarantined after the job was queued), or None."""
        seq, why = self.quarantined.get(h, (0, ""))
        return why if job.seq <= seq else None

    def count_error(self, e: BaseException) -> None:
        """A write that failed and was dropped: counted and logged, never raised to a caller; the
        same failure again within `ERROR_QUIET_S` is counted, and said with the next one after."""
        self.stats.write_errors += 1
        said = self.stats.last_error = f"{type(e).__name__}: {e}"
        level = logging.WARNING if isinstance(e, OSError) and e.errno == errno.ENOSPC else logging.ERROR
        now = time.monotonic()
        with _said_lock:
            last, quiet = self.said.get(said, (None, 0))
            if last is not None and now - last < ERROR_QUIET_S:
                self.said[said] = (last, quiet + 1)
                return
            if len(self.said) > 64:  # (failures that name a file each: bounded)
                self.said.clear()
            self.said[said] = (now, 0)
        more = f"; {quiet} more like it since it was last said" if quiet else ""
        log.log(level, "kvstore: a write was dropped (%s)%s", said, more)


def _remember(found: dict, keys: list, value) -> None:
    """Add `keys` to `found` (insertion-ordered), the oldest forgotten past `COMPLETE_REMEMBERED`."""
    for k in keys:
        found[k] = value
    while len(found) > COMPLETE_REMEMBERED:
        del found[next(iter(found))]


@dataclass
class Hosts:
    """A job's arrays as plain numpy views (already numpy, or mlx views insert scheduled: numpy
    waits for those if they are not done yet), so no mlx computation runs on the writer's thread."""

    tags: dict[str, str]  # safetensors dtype of every array
    arrays: dict[str, np.ndarray]
    checkpoint: dict[str, np.ndarray]

    @classmethod
    def of(cls, job: Job) -> "Hosts":
        job.ready()
        tags = {name: "BF16" if name in job.views else tag_of(a.dtype)
                for name, a in {**job.arrays, **job.checkpoint}.items()}
        return cls(tags, {name: np.asarray(a) for name, a in job.arrays.items()},
                   {name: np.asarray(a) for name, a in job.checkpoint.items()})

    def parts(self, job: Job, spec: Span) -> Parts:
        """The tensors and metadata of the blob of `spec` (copied out of the views)."""
        tokens = job.token_ids(spec)
        tensors: dict[str, blobformat.Tensor] = {"tokens": ("I32", tokens)}
        arrays = self.checkpoint if spec.kind == CHECKPOINT else job.slices(spec, self.arrays)
        for name, arr in arrays.items():
            tensors[name] = (self.tags[name], np.ascontiguousarray(arr))
        meta = dict(job.metadata, hash=spec.hash.hex(), parent=spec.parent.hex(),
                    depth=str(spec.depth), kind=str(spec.kind))
        if spec.tenant is not None:
            owner = job.tenant.owner if job.tenant is not None and job.tenant.tag == spec.tenant else None
            meta = blobformat.with_extensions(meta, tenants.header_fields(spec.tenant, spec.link, owner))
        return tokens, tensors, blobformat.with_extensions(meta, job.extensions.get(spec.hash, {}))


def compact(job: Job, spec: Span, tokens: np.ndarray, tensors: dict[str, blobformat.Tensor]) -> Record:
    """A copy of the record that owns its memory (the caller's cache can then be freed)."""
    arrays, views = {}, {}
    for name, (tag, arr) in tensors.items():
        if name == "tokens":
            continue
        arrays[name] = mx.array(arr)
        if tag == "BF16":
            views[name] = mx.bfloat16
    return held(spec, tokens, arrays, views, extensions=job.extensions.get(spec.hash))


def from_memory(rec: Record, start: int, prefix: np.ndarray, metadata: dict[str, str], *,
                role: int = 0, whole: bool = True) -> Job:
    """A job that writes `rec`, a record held in RAM, from its own arrays: its tokens start at
    `start` of a prompt that begins with `prefix`. Nothing is copied here (the writer copies
    them into the blob); its parent must be stored, or the writer leaves it out."""
    spec = Span(rec.hash, rec.ns, rec.parent, rec.depth, rec.kind, rec.ntokens, rec.first_token,
                start=start, nbytes=rec.nbytes, **rec.owner())
    tokens = np.concatenate([np.asarray(prefix[:start], dtype=rec.tokens.dtype), rec.tokens])
    if rec.kind == CHECKPOINT:
        arrays, checkpoint = {}, dict(rec.arrays)
    else:
        arrays, checkpoint = dict(rec.arrays), {}
    return Job(rec.ns, tokens, arrays, dict.fromkeys(arrays, start), dict(rec.views), [spec], metadata,
               checkpoint=checkpoint, nbytes=rec.nbytes, role=role, whole=whole,
               extensions={rec.hash: dict(rec.extensions)} if rec.extensions else {})
