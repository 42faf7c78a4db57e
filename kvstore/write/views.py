"""An insert: the records a cache holds for a prompt, as a job for the background writer.

Nothing is copied on the caller's thread: a `KVCache`'s deltas are plain token ranges of its
arrays, handed over as second references to them (`second_ref`), whose numpy views the first thread
that reads the job takes; codecs that compute their deltas hand over lazy mlx views, scheduled
(not waited for). The writer copies each new record out of them.

The caller's thread takes no numpy view itself: mlx lets go of the GIL to hand out an array's
memory, even an evaluated one's, and a busy writer thread then takes it for up to Python's switch
interval; 56 views an insert made the insert wait up to 57 ms (1k tokens of a Qwen3-0.6B-shaped
cache, writer busy).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Callable

import mlx.core as mx
import numpy as np

from kvstore.canary import Canary, holder
from kvstore.errors import BlobError, InvalidInputError
from kvstore.records import CHECKPOINT, Span
from kvstore.restore.arrays import host_array, host_bits
from kvstore.restore.codecs import Codec
from kvstore.tenants import Tenant
from kvstore.write.jobs import Job


def second_ref(a: mx.array) -> mx.array:
    """A second reference to the same array: the layer's next update then writes a new buffer
    (mlx updates in place only an array nothing else holds), so what a view of it sees later never
    changes, and the memory lives as long as the reference. No op, nothing waited for."""
    return copy.copy(a)


class Views:
    """Every tensor a cache holds for `n` tokens, as the writer takes them: "layer.name" -> a view
    with its token axis 2, the token its element 0 holds, names carried as raw bits, and the
    checkpoint state (when one is wanted). A `deferred` codec's tensors are taken from `first` on
    (the first token any record of the job starts at) and encoded later (`encode`)."""

    def __init__(self, codecs: list[Codec], cache: list, n: int, *, checkpoint: bool, first: int = 0):
        self.arrays: dict = {}
        self.origins: dict[str, int] = {}
        self.views: dict[str, mx.Dtype] = {}
        self.saved: dict = {}
        self.deferred: list[tuple[str, str, Codec]] = []  # (tensor, its name in the layer, codec)
        self.ranges: dict[str, tuple[int, int]] = {}  # tensor -> tokens [lo, hi) of its held array
        lazy: list[mx.array] = []
        try:
            for i, (codec, layer) in enumerate(zip(codecs, cache)):
                names = self._layer(i, codec, layer, n, first if codec.deferred else 0, lazy)
                if codec.deferred:
                    self.deferred += [(f"{i}.{name}", name, codec) for name in names]
                if checkpoint:
                    for name, a in codec.checkpoint(layer).items():
                        self.saved[f"{i}.{name}"], view = host_bits(a)
                        lazy.append(self.saved[f"{i}.{name}"])
                        if view is not None:
                            self.views[f"{i}.{name}"] = view
        except (ValueError, BlobError) as e:
            raise InvalidInputError(f"cannot store this cache: {e}") from e
        # Lazy views (a codec that computes its deltas) are scheduled, not waited for: the writer
        # reads them later and waits if it must. Even scheduling them waits for mlx's thread
        # while the writer keeps the cores busy (milliseconds for 56 views), which is why plain
        # token ranges are held arrays instead. Those are scheduled here too, in the same call (an
        # array is evaluated on the thread whose stream made it; a cache's arrays usually are
        # already, and then this costs microseconds).
        lazy += [self.arrays[name] for name in self.ranges]
        if lazy:
            mx.async_eval(lazy)

    def _layer(self, i: int, codec: Codec, layer, n: int, first: int, lazy: list) -> list[str]:
        """Takes the layer's deltas from token `first` on; returns their names."""
        plain = codec.slices(layer, n)
        if plain is not None:  # plain ranges of the layer's arrays: held, viewed by the reader
            for name, (a, origin, end) in plain.items():
                start = max(origin, min(first, end))
                self.arrays[f"{i}.{name}"] = second_ref(a)
                self.ranges[f"{i}.{name}"] = (start, end)
                self.origins[f"{i}.{name}"] = start
                if a.dtype == mx.bfloat16:
                    self.views[f"{i}.{name}"] = mx.bfloat16
            return list(plain)
        deltas = codec.deltas(layer, n)
        for name, (a, origin) in deltas.items():
            if first > origin:
                a, origin = a[:, :, first - origin :], first
            self.arrays[f"{i}.{name}"], view = host_bits(a)
            lazy.append(self.arrays[f"{i}.{name}"])
            self.origins[f"{i}.{name}"] = origin
            if view is not None:
                self.views[f"{i}.{name}"] = view
        return list(deltas)

    def detach(self) -> None:
        """Copy what the job takes out of the cache now, its records' token ranges only, so that
        no reference to the cache's arrays is kept: the cache's next step then writes in place
        (a held reference makes mlx copy a whole array). A copy of the records' bytes on the
        caller's thread: for an insert held until a later step (`ModelCache.insert_later`)."""
        mx.eval([a for a in [*self.arrays.values(), *self.saved.values()] if isinstance(a, mx.array)])
        for name, a in list(self.arrays.items()):
            view = host_array(a)
            if name in self.ranges:
                lo, hi = self.ranges.pop(name)
                view = view[:, :, lo:hi]
            self.arrays[name] = np.array(view)
        for name, a in list(self.saved.items()):
            self.saved[name] = np.array(host_array(a))

    def prepare(self, job: Job) -> None:
        """Make `job`'s tensors what the writer reads: numpy views of the held token ranges,
        then the deferred codecs' encodings (`encode`). Run once, by the first thread that reads
        the job (`Job.ready`), never the caller's."""
        if self.ranges:
            arrays = dict(job.arrays)
            for name, (lo, hi) in self.ranges.items():
                arrays[name] = host_array(arrays[name])[:, :, lo:hi]  # evaluates it if it is not yet
            job.arrays = arrays  # swapped whole
        if self.deferred:
            self.encode(job)

    def encode(self, job: Job) -> None:
        """Replace the deferred codecs' tensors of `job` with what the store keeps of them
        (`Codec.encode`), evaluated. Run once by the first thread that reads the job, never the
        caller's: an mlx op there waits for mlx's own thread while the writer keeps the cores busy
        (scheduling 56 quantizations took 290 ms at 1k tokens of a Qwen3-0.6B-shaped cache)."""
        arrays, origins, views = dict(job.arrays), dict(job.origins), dict(job.views)
        made = []
        for full, name, codec in self.deferred:
            raw = np.ascontiguousarray(arrays.pop(full))  # numpy waits for a scheduled mlx view
            origin, dtype = origins.pop(full), views.pop(full, None)
            x = mx.array(raw) if dtype is None else mx.array(raw).view(dtype)
            prefix = full[: len(full) - len(name)]
            for coded, a in codec.encode(name, x).items():
                arrays[prefix + coded], view = host_bits(a)
                origins[prefix + coded] = origin
                made.append(arrays[prefix + coded])
                if view is not None:
                    views[prefix + coded] = view
        mx.eval(made)
        job.arrays, job.origins, job.views = arrays, origins, views  # each swapped whole

    def complete_from(self, start: int) -> bool:
        """Whether every tensor holds every token from `start` on (a sliding window may not)."""
        return all(o <= start for o in self.origins.values())

    def sizes(self, spans: list[Span], *, whole: bool = False) -> list[Span]:
        """These records, with the bytes each will take (its tokens, and
        what of its range each tensor holds; `whole`: every tensor holds all of it)."""
        per_token: dict[int, int] = {}  # origin -> bytes per token of the arrays starting there
        for name, a in self.arrays.items():  # a held array's bytes per token are its range's
            origin = self.origins[name]
            per_token[origin] = per_token.get(origin, 0) + a.nbytes // max(1, a.shape[2])
        checkpoint_bytes = sum(a.nbytes for a in self.saved.values())
        out = []
        for s in spans:
            if s.kind == CHECKPOINT:
                nbytes = checkpoint_bytes
            elif whole:
                nbytes = 4 * s.ntokens + sum(b * s.ntokens for b in per_token.values())
            else:
                nbytes = 4 * s.ntokens + sum(b * max(0, s.end - max(s.start, origin)) for origin, b in per_token.items())
            out.append(replace(s, nbytes=nbytes))
        return out


class Pending:
    """An insert whose records are taken from their cache and not queued yet
    (`model.cache.ModelCache.insert_later`): `submit` queues its job, once."""

    def __init__(self, queue: Callable[[Job], object] | None, job: Job | None, new: list[Span]):
        self._queue, self._job, self.new = queue, job, new

    def submit(self, canary: Canary | None = None) -> int:
        """Queue the records, with `canary` in the header of the new record that holds its token
        (or ends just before it; no new record there: no canary). How many new records were
        queued: 0 when the write queue was full and dropped them (`Writer.submit`)."""
        queue, job, self._queue, self._job = self._queue, self._job, None, None
        if queue is None or job is None:
            return 0
        if canary is not None:
            spans = [s for s in self.new if s.kind != CHECKPOINT]
            at = holder([(s.start, s.end) for s in spans], canary.at)
            if at is not None:
                job.extensions = {spans[at].hash: {"canary": canary.text()}}
        return len(self.new) if queue(job) else 0


def make_job(ns: bytes, toks: np.ndarray, views: Views | None, new: list[Span], refill: list[Span],
             metadata: dict[str, str], pin: list[bytes], role: int = 0, reached: list[bytes] = (), *,
             durable: bool = False, tenant: Tenant | None = None, shared: int = 0) -> Job:
    """The writer's job: the new records, and stored ones to write again, complete; with no
    `views`, only the pins and the role of stored records. `durable`: written whatever the
    admission policy says. `tenant`, `shared`: whose records they are (`Job.tenant`)."""
    if views is None:
        return Job(ns, toks, {}, {}, {}, [], metadata, pin=pin, role=role, reached=list(reached),
                   tenant=tenant, shared=shared)
    specs = views.sizes(new)
    again = views.sizes(refill, whole=True)
    return Job(ns, toks, views.arrays, views.origins, views.views, specs, metadata, checkpoint=views.saved,
               pin=pin, nbytes=sum(s.nbytes for s in specs) + sum(s.nbytes for s in again), refill=again,
               durable=durable, prepare=views.prepare if views.deferred or views.ranges else None, role=role,
               reached=list(reached), tenant=tenant, shared=shared)
