"""`ModelCache`: the store as one model version sees it — `fetch` and `insert` token sequences.

Bound with a tenant (`Store.bind(..., tenant=...)`, `with_tenant`), it sees the shared records and
the tenant's own: its records after the shared prefix are keyed under the tenant's salt
(`records.prompt_records`), and it never writes, pins or marks a shared record.

Fetch looks the prompt up in the tiers (`lookup.match`: memory, pending writes, disk, remote, in
that order), opens the records it needs, checked (`lookup.Opening`; records from beyond this
process are checked against the model's shapes too, `shapes.RecordCheck`), and hands them to the
restore pipeline (`restore`: plan, fill, build), always leaving at least one token to
process. Insert hands the new records to the background writer (`write.views`).

A `ModelCache` is made by `Store.bind` and given what it works through (`backing.Backing`); it
holds no reference to the store.
"""

from __future__ import annotations

import copy
import logging
import threading

import mlx.core as mx
import numpy as np

from kvstore import canary as canaries
from kvstore import keys
from kvstore.canary import Canary
from kvstore.errors import BlobError, InvalidInputError
from kvstore.model import blas
from kvstore.model import fingerprint as fingerprints
from kvstore.model.backing import Backing
from kvstore.model.explicit import CHECKPOINT_EVERY, PIN_ATTEMPTS, ExplicitWrites, insert_options
from kvstore.model.layout import make_template
from kvstore.model.lookup import Opening, Tiers, cover, kept_canary, match
from kvstore.model.shapes import RecordCheck
from kvstore.model.tokens import Tokens, as_tokens
from kvstore.records import CHECKPOINT, RecordId, Span, checkpoint_of, prompt_records
from kvstore.restore.build import build, checkpoint_arrays
from kvstore.restore.codecs import CacheListCodec, Codec, RotatingCodec
from kvstore.restore.fill import fill, host_slice
from kvstore.restore.plan import Plan, plan
from kvstore.sizes import format_size
from kvstore.storage.blobformat import nbytes
from kvstore.tenants import Tenant, sees
from kvstore.tiers.base import Lookup, Source, Where
from kvstore.tiers.memory import held
from kvstore.write.placement import Placement, place
from kvstore.write.views import Pending, Views, make_job

log = logging.getLogger("kvstore")

__all__ = ["CHECKPOINT_EVERY", "PIN_ATTEMPTS", "ModelCache"]
_ATTEMPTS = 3  # plans per fetch: each damaged record found while filling costs one more


class ModelCache(ExplicitWrites):
    """Fetch and insert the caches of one model version (made by `Store.bind`); `tenant`: whose
    (None: the shared namespace's)."""

    def __init__(self, backing: Backing, model, model_id: str, ns: bytes, fingerprint: bytes, layout: dict,
                 codecs: list[Codec], chunk_size: int, kv_bits: int | None = None, kv_group_size: int = 64,
                 exact: int | None = None):
        self.backing, self.model, self.model_id = backing, model, model_id
        # Exact mode (`exact_prefill`): records of `exact` tokens (the chunk size), restored only
        # at their ends (see `model.prefill`); None: token-exact reuse.
        self.exact = exact
        self.ns, self.fingerprint, self.layout, self.codecs = ns, fingerprint, layout, codecs
        self.chunk_size, self.kv_bits, self.kv_group_size = chunk_size, kv_bits, kv_group_size
        self.checkpointed = any(c.checkpointed for c in codecs)
        self._windowed = any(map(_windowed, codecs))  # its records may be stored without some data
        self._metadata = {"format": str(keys.FORMAT_VERSION), "ns": ns.hex(),
                          "fingerprint": fingerprint.hex(), "model_id": model_id,
                          "chunk_size": str(chunk_size)}
        self.check = RecordCheck(model, codecs, self.new_cache, model_id)
        self.registered = True  # False while the index could not record this model (Store.bind)
        self.tenant: Tenant | None = None
        self._last = threading.local()  # this thread's last restore: (tokens asked, p, last record, its canary's text)

    def with_tenant(self, tenant: Tenant | None) -> "ModelCache":
        """This model version as `tenant` (None: shared) sees it, sharing store, model, checks."""
        mc = copy.copy(self)
        mc.tenant = tenant
        return mc

    def owns(self, record: RecordId) -> bool:
        """Whether this binding may write, pin or mark `record`: any without a tenant; with one,
        only the tenant's own (shared records are the operator's)."""
        return self.tenant is None or record.tenant is not None

    def records(self, toks: np.ndarray, *, tail: bool = True, checkpoint: bool = False) -> list[Span]:
        """The records that store `toks` for this binding (`records.prompt_records`): with a
        tenant, the shared ones this machine holds, then the tenant's."""
        C = self.chunk_size
        if self.tenant is None:
            return prompt_records(self.ns, toks, C, tail=tail, checkpoint=checkpoint)
        chain = prompt_records(self.ns, toks, C, tail=False)
        held = self.backing.tiers.holds(chain) if chain else set()
        shared = next((i for i, s in enumerate(chain) if s.hash not in held), len(chain))
        return prompt_records(self.ns, toks, C, tail=tail, checkpoint=checkpoint, tenant=self.tenant,
                              shared=shared)

    def register(self, stamps: list | None = None) -> bool:
        """Record this model version in the index (`stamps`: its files'); False while that
        cannot be done (a read-only store, a full disk): inserts wait until it can."""
        b = self.backing
        if b.index is None:
            return True
        if self.exact:  # exact only under what computed the records: keep it, say when it differs
            blas.check_exact_store(b.index, self.ns, record=not b.read_only)
        if b.read_only:
            return False
        return fingerprints.register(b.index, self.ns, self.fingerprint, self.model_id, self.layout,
                                     self.chunk_size, stamps)

    def last_restore(self) -> tuple | None:  # (what this thread's last fetch restored: None, nothing)
        return getattr(self._last, "restore", None)

    def restored_canary(self, tokens: Tokens, last: tuple | None = None) -> tuple[list[bytes], Canary] | None:
        """When this thread's last fetch (or the one `last_restore()` gave `last`) was of `tokens` and
        restored all but the last: the records it used (the last keeps the canary) and the canary."""
        last = last or self.last_restore()
        if last is None or last[1] != len(tokens) - 1 or last[3] is None or \
                not np.array_equal(last[0], np.asarray(tokens, dtype=np.int32)):
            return None
        try:  # read only now: a fetch keeps the header's text, most are never compared
            return last[2], canaries.parse(last[3])
        except ValueError:  # a header field that does not read failed the record's open already
            return None

    def quarantine(self, h: bytes, why: str) -> None:
        """Serve record `h` no more from this machine (what it restores is wrong): a miss from it
        on, counted as a damaged record is."""
        for tier in self.backing.tiers:
            if not getattr(tier, "shared", False):
                tier.damaged(h, BlobError(why), None)

    def new_cache(self) -> list:
        """Fresh, empty caches for this model (quantized when bound with `kv_bits`)."""
        return make_template(self.model, self.kv_bits, self.kv_group_size)

    # -- fetch ------------------------------------------------------------------------------

    def fetch(self, tokens: Tokens) -> tuple[list, list[int]]:
        """The cache of the longest restorable prefix of `tokens`, and the tokens still to process.

        At least one token is always left. On a miss: a fresh cache and all of `tokens`. The
        restored caches have room for at least 256 more tokens (the next decode step writes in
        place). A damaged record ends the prefix where it starts: quarantined and counted.
        """
        toks, b = as_tokens(tokens), self.backing
        b.check_open()
        b.counters.fetches += 1
        b.deleted_elsewhere.forget(b)  # (what gc in another process deleted is no longer served from RAM)
        self._last.restore = None
        if len(toks) < 2:
            return self.new_cache(), toks.tolist()
        reached: list[bytes] = []
        try:
            # (exact: the whole steps of what may be restored, so a step that ends on the last token
            # leaves room for a stored prompt's own tail, which ends just before it)
            chain = prompt_records(self.ns, toks[:-1] if self.exact else toks, self.chunk_size, tail=False)
            lookup = Lookup(self.ns, toks, self.chunk_size, [s.hash for s in chain],
                            object_bytes=self.check.bound(), tenant=self.tenant)
            try:
                with b.writer.reading():  # the writer waits between records while this restores
                    for _ in range(_ATTEMPTS):  # a damaged record found while filling: plan again without it
                        done = self._restore(toks, lookup, chain, reached)
                        if done is not None:
                            cache, p = done
                            if p <= 0:
                                break
                            b.counters.reused_tokens += p
                            return cache, toks[p:].tolist()
            finally:
                self._sighted(lookup, reached)
        except Exception as e:  # a broken disk or index is a miss, never an error in generation
            log.error("kvstore: fetch failed, serving a miss (%s: %s)", type(e).__name__, e)
            b.counters.fetch_errors += 1
        return self.new_cache(), toks.tolist()

    def _sighted(self, lookup: Lookup, reached: list[bytes]) -> None:
        """Tell the admission policy what this fetch asked for; what it restored from that was
        kept in RAM only is queued for the writer now (`admit="reused"`: seen again). Never
        raises into the fetch, never waits on disk."""
        b = self.backing
        if b.gate is not None:
            try:
                due = b.gate.sighted(lookup.chain, reached)
                if due:
                    b.writer.write_held(due, lookup.tokens, self._metadata, whole=not self._windowed)
            except Exception as e:
                log.warning("kvstore: a fetch was not counted for admission (%s: %s)", type(e).__name__, e)

    def _restore(self, toks: np.ndarray, lookup: Lookup, chain_records: list[Span],
                 reached: list[bytes]) -> tuple[list, int] | None:
        """One attempt: look up, open the records, plan, fill, build (`reached` gets the records
        it restored from). (cache, p), (None, 0) on a miss, or None when a record failed its checksum while filling (it is quarantined now) or
        left every tier between the lookup and its opening (the writer replaced a tail, or gc
        evicted it): the next attempt looks up again."""
        C = self.chunk_size
        chain, options, where = match(self.backing.tiers, lookup, self.ns, toks, C, chain_records)
        opening = Opening(self.backing.tiers, lookup, where, self._check)
        try:
            best = self._best_plan(toks, chain, options, opening)
            if opening.vanished:  # what the lookup chose is gone: another option may be what replaced it
                return None
            if best is None:
                return None, 0
            pl, sources = best
            ckpt = None
            if pl.checkpoint is not None:
                source = opening.one(pl.checkpoint)
                if source is None:
                    return None
                try:
                    ckpt = checkpoint_arrays(source)
                except BlobError as e:
                    opening.damaged(pl.checkpoint, e)
                    return None
            finals, errors = fill(pl, sources)
            if errors:
                for k, e in errors:
                    opening.damaged(pl.parts[k].hash, e)
                return None
            cache = build(pl, self.codecs, finals, ckpt)
            used = ([pl.checkpoint] if pl.checkpoint else []) + [q.hash for q in pl.parts]
            reached.extend(used)
            self._last.restore = (toks, pl.p, used, kept_canary(sources[-1])) if pl.parts else None
            self._keep_in_memory(pl, finals, sources, where)
            for tier in {t for t, _ in where.values() if t.name == "remote"}:  # what came from the bucket
                tier.restored(pl.tokens_from({h for h, (t, _) in where.items() if t is tier}))
            self.backing.tiers.touch(used)
            return cache, pl.p
        finally:
            opening.close()

    def _best_plan(self, toks: np.ndarray, chain: list[bytes], options, opening: Opening
                   ) -> tuple[Plan, list[Source]] | None:
        """The plan that restores the most tokens among the lookup's options (each a child of
        the chain's last chunk), with the sources of its parts."""
        C, cap = self.chunk_size, len(toks) - 1
        best: tuple[Plan, list[Source]] | None = None
        for child, matched in options:
            length = min(len(chain) * C + matched, cap)
            if length <= (best[0].p if best else 0):
                continue
            path = chain + ([child] if child is not None else [])
            parts, sources = opening.path(path[: -(-length // C)], C)
            stored = sum(q.ntokens for q in parts)
            length = min(length, stored)
            if self.exact and not length == stored == cap:  # whole steps, or a tail ending at the last token
                length = length // C * C
            pl = plan(parts, self.codecs, length, self._checkpoints(parts, length, opening))
            if pl is not None and pl.p > (best[0].p if best else 0):
                best = (pl, sources[: len(pl.parts)])
        return best

    def _check(self, source: Source) -> None:
        self.check(source.id.kind, source.id.ntokens, source.entries)

    def _checkpoints(self, parts, length: int, opening: Opening) -> dict[int, bytes]:
        """Position -> hash of the checkpoints some tier holds at the ends of these parts."""
        if not self.checkpointed:
            return {}
        wanted = {}
        for q in parts:
            if q.start + q.ntokens <= length:
                src = opening.opened[q.hash]
                wanted[keys.checkpoint_hash(q.hash)] = (checkpoint_of(_span(src, q.start)), q.start + q.ntokens)
        ids = [rid for h, (rid, _) in wanted.items() if h not in opening.where]
        opening.where.update(self.backing.tiers.find(opening.lookup, ids))
        return {end: h for h, (_, end) in wanted.items() if h in opening.where}

    def _keep_in_memory(self, pl: Plan, finals: dict[str, mx.array], sources: list[Source], where: Where) -> None:
        """Records read from beyond RAM go into the memory tier too, as copies (the restored arrays are written
        in place later). The last, which the restore may end inside (a prompt asked again), is kept whole from
        its source: a server's sequence ends in it, and one whose end is not in RAM is dropped from RAM."""
        memory = self.backing.memory
        if not memory.capacity:
            return
        kept = []
        for k, q in enumerate(pl.parts):
            tier = where.get(q.hash, (None,))[0]
            if tier is None or tier.in_process:
                continue
            got = {c.name: (c.lo, c.dst, c.hi) for c in pl.jobs.get(k, ())}
            if set(got) != set(q.entries) or any(lo != 0 for lo, _, _ in got.values()):
                continue  # only part of it was restored (a sliding window): nothing to keep
            whole = all(hi == q.entries[n].shape[2] for n, (_, _, hi) in got.items())
            if (not whole and k != len(pl.parts) - 1) or sum(map(nbytes, q.entries.values())) + 4 * q.ntokens > \
                    memory.capacity:
                continue
            arrays, views = {}, {}
            for name, (lo, dst, hi) in got.items():
                arrays[name] = mx.array(host_slice(finals[name], dst, dst + hi - lo) if whole
                                        else sources[k].array(name))
                if q.entries[name].tag == "BF16":
                    views[name] = mx.bfloat16
            r = sources[k].id
            kept.append(held(r, sources[k].tokens, arrays, views))
        if kept:
            mx.eval([a for r in kept for a in r.arrays.values()])
            memory.put(reversed(kept))

    def record_hashes(self, tokens: Tokens) -> list[bytes]:
        """The keys of the chunks and tail that `insert(tokens, ...)` stores, root first."""
        return [s.hash for s in self.records(as_tokens(tokens))]

    def placement(self, tokens: Tokens) -> Placement:
        """How many of the tokens of `tokens` have their records on disk, queued for the writer,
        or in RAM only (and why): what a report says was stored (flush first to know it all)."""
        b, toks = self.backing, as_tokens(tokens)
        b.check_open()  # (a store in RAM would still answer from what it held)
        out = place(self._durable(toks), b.index, b.writer, b.gate, b.memory, b.tiers.landing())
        if out.in_ram and not self.exact:
            # Tokens another record on disk holds (a tail the writer dropped for a longer one; a
            # warmed prompt's tail under an answer's kept in RAM): the disk restores them anyway.
            disk = [t for t in b.tiers if t.name == "disk"]
            lookup = Lookup(self.ns, toks, self.chunk_size, tenant=self.tenant)
            stored, held = cover(Tiers(disk), lookup, toks, self.chunk_size) if disk else (0, [])
            out.found_on_disk(stored - out.on_disk - out.queued, whole=stored >= out.tokens, held_by=held)
        return out

    def stored_length(self, tokens: Tokens, tiers: Tiers | None = None) -> int:
        """How many leading tokens of `tokens` this machine has stored K/V for (no cap, nothing
        is loaded, nothing remote is asked; `tiers`: in those only)."""
        toks = as_tokens(tokens)
        self.backing.check_open()  # (a store in RAM would still answer from what it held)
        if len(toks) == 0:
            return 0
        lookup = Lookup(self.ns, toks, self.chunk_size, tenant=self.tenant)
        return cover(tiers or self.backing.tiers, lookup, toks, self.chunk_size)[0]

    def ram_length(self, tokens: Tokens) -> int:
        """How many leading tokens of `tokens` the records in RAM (memory tier or write queue)
        cover: what a fetch of them reuses without reading the disk."""
        toks, C = as_tokens(tokens), self.chunk_size
        memory, writer = self.backing.memory, self.backing.writer
        covered, parent = 0, self.ns
        links = [None] if self.tenant is None else [None, self.tenant.link]  # shared chunks, then the tenant's
        for link in links:
            for h in keys.chain(parent, toks[covered : len(toks) // C * C], C, link):
                if h not in memory and not writer.is_pending(h):
                    break
                covered, parent = covered + C, h
        rest = toks[covered:]
        children = [r.tokens for r in memory.children(parent) if sees(self.tenant, r.tenant)]
        children += [t for _, t, tag in writer.pending_children(parent) if sees(self.tenant, tag)]
        return covered + max((keys.common_prefix(t, rest) for t in children), default=0)

    def load_into_ram(self, tokens: Tokens) -> dict:
        """Restore the stored records of `tokens` into the memory tier, whole, ahead of a request
        that will need them: `{"tokens", "stored", "in_ram", "loaded"}` (tokens stored on this
        machine, downloads included; held in RAM after; loaded by this call), and `"refused"`
        (why) when they alone are larger than the memory tier (they would push themselves out).
        It counts as a fetch."""
        toks = as_tokens(tokens)
        out = {"tokens": len(toks), "stored": self.stored_length(toks), "in_ram": 0, "loaded": 0}
        whole, index, memory = self.through_record_end(toks), self.backing.index, self.backing.memory
        need = sum(r.size for r in index.rows_of(self.record_hashes(whole)).values()) if index else 0
        if need > memory.capacity:
            return {**out, "refused": f"its stored cache ({format_size(need)}) is larger than the "
                                      f"memory tier ({format_size(memory.capacity)})"}
        before = self.ram_length(toks)
        self.fetch(np.append(whole, 0))  # one token more: every record restored whole
        out["stored"] = max(out["stored"], self.stored_length(toks))  # (with what came from the bucket)
        out["in_ram"] = min(len(toks), self.ram_length(toks))
        out["loaded"] = max(0, out["in_ram"] - before)
        return out

    def through_record_end(self, tokens: Tokens) -> np.ndarray:
        """`tokens` and the rest of the stored record their last tokens lie in, as far as this
        machine holds it: a prompt stored with its answer ends inside a tail, and a fetch of the
        prompt alone restores only part of that record (what is kept in RAM is whole records)."""
        toks = as_tokens(tokens)
        lookup = Lookup(self.ns, toks, self.chunk_size, tenant=self.tenant)
        chain, options, where = match(self.backing.tiers, lookup, self.ns, toks, self.chunk_size, local=True)
        rest = toks[len(chain) * self.chunk_size :]
        child, shared = options[0] if options else (None, 0)
        if child is None or not len(rest) or shared < len(rest):
            return toks
        tier, ref = where[child]
        source = tier.open(child, ref)
        try:
            return np.concatenate([toks, np.asarray(source.tokens[len(rest) :], dtype=toks.dtype)])
        finally:
            source.close()

    # -- insert -----------------------------------------------------------------------------

    def insert(self, tokens: Tokens, cache: list, *, pin: bool = False, checkpoint: bool = True,
               durable: bool = False, cache_type: str = "assistant", canary: Canary | None = None) -> int:
        """Store the cache of `tokens` (it must hold exactly `len(tokens)` processed tokens).

        Returns at once: new chunks, the tail and (for recurrent layers, when `checkpoint`) a
        checkpoint at the end are queued for the background writer and visible to `fetch`
        immediately. Returns how many new records were queued (0 when the write queue, full
        past `max_pending_bytes`, dropped them). The store's admission policy
        (`kvstore.open(admit=...)`) says which go to disk; `durable` (as `pin`) writes them
        whatever it says, within the write budget.

        `cache_type` is mlx-lm's (`LRUPromptCache.insert_cache`): "assistant" (the default, as
        there), "user" or "system". Every record the insert reaches, stored ones too, keeps the
        strongest type that reached it; a budget evicts assistant-only records first, then
        user-reached ones, then system prompts (LRU inside each).

        `canary` (`kvstore.canary.of`): the top of the logits of a step of `tokens` from this cache,
        kept in the header of the new record that holds its token (or ends just before it)."""
        canaries.for_tokens(canary, toks := as_tokens(tokens))  # (another prompt's would fail every restore)
        return self._taken(toks, cache, pin=pin, checkpoint=checkpoint, durable=durable, cache_type=cache_type,
                           detach=False).submit(canary)

    def insert_later(self, tokens: Tokens, cache: list, *, pin: bool = False, checkpoint: bool = True,
                     durable: bool = False, cache_type: str = "assistant") -> Pending:
        """`insert`, in two halves: the new records' K/V are copied out of `cache` now (the cache
        may then move on: no reference to its arrays is kept), and `submit(canary)` queues them,
        once the next step's logits are known. Returns the `Pending` insert."""
        return self._taken(tokens, cache, pin=pin, checkpoint=checkpoint, durable=durable,
                           cache_type=cache_type, detach=True)

    def _taken(self, tokens: Tokens, cache: list, *, pin: bool, checkpoint: bool, durable: bool,
               cache_type: str, detach: bool) -> Pending:
        toks = as_tokens(tokens)
        b = self.backing
        b.check_open()
        role = insert_options(cache_type, pin=pin, checkpoint=checkpoint, durable=durable)
        if len(toks) == 0:
            raise InvalidInputError("insert needs at least one token")
        self.check.caller(cache, len(toks), self.kv_bits)
        if not self.registered:  # rows need their model's row, which bind could not write
            self.registered = self.register()
            if not self.registered:
                b.counters.skipped_inserts += 1
                return Pending(None, None, [])
        try:
            spans = self.records(toks, checkpoint=self.checkpointed and checkpoint)
            held = b.tiers.holds(spans)
        except Exception as e:  # the index is unreachable: drop this insert, keep serving
            log.error("kvstore: insert dropped (%s: %s)", type(e).__name__, e)
            b.counters.skipped_inserts += 1
            return Pending(None, None, [])
        durable = durable or pin
        # Records kept in RAM that may go to disk now (seen again, durable, or whose write failed).
        again = (b.gate.rewrite(spans, held, durable) if b.gate is not None else set()) | b.writer.unwritten(held)
        owner = {"tenant": self.tenant, "shared": sum(s.tenant is None and s.kind != CHECKPOINT for s in spans)}
        spans = [s for s in spans if self.owns(s)]  # a tenant's insert never writes a shared record
        new = [s for s in spans if s.hash not in held or s.hash in again]
        # Stored records a sliding window may have been missing data for (see the writer's refill).
        stored = [s for s in spans if s.kind != CHECKPOINT and s.hash in held
                  and not b.writer.known_complete(s.hash)] if self._windowed else []
        pins = [s.hash for s in spans] if pin else []
        reached = [s.hash for s in spans] if role else []  # the weakest type raises nothing
        views = None
        if new or stored:
            first = min((s.start for s in new + stored if s.kind != CHECKPOINT), default=len(toks))
            views = Views(self.codecs, cache, len(toks), checkpoint=any(s.kind == CHECKPOINT for s in new),
                          first=first)
            if detach:
                views.detach()
        refill = [s for s in stored if views.complete_from(s.start)] if stored else []
        job = None
        if new or refill:
            job = make_job(self.ns, toks, views, new, refill, self._metadata, pins, role, reached,
                           durable=durable, **owner)
        elif pins or reached:  # nothing to write: the pins and roles of stored records only
            job = make_job(self.ns, toks, None, [], [], self._metadata, pins, role, reached, **owner)
        return Pending(b.writer.submit if job is not None else None, job, new)

    def stored_part(self, toks: np.ndarray) -> np.ndarray:
        """What of a prompt is stored: all of it, or in exact mode all but its last token (which
        is the first generation step's: none of a one-token prompt)."""
        return toks[:-1] if self.exact else toks

    def stored_whole(self, tokens: Tokens) -> bool:
        """Whether this machine stores all of `tokens` (in exact mode, all but the last one: the
        first generation step's), as `prefill` stores a prompt: in exact mode, its own records,
        since a restore ends only at a step or at a stored prompt's own end, never inside a tail."""
        toks = as_tokens(tokens)
        if self.exact:
            need = self._durable(toks)
            return {s.hash for s in need} <= self.backing.tiers.holds(need)
        part = self.stored_part(toks)
        return self.stored_length(part) >= len(part)

    def _durable(self, toks: np.ndarray) -> list[Span]:
        """The records that must be on disk for `toks` to be stored whole (with the end checkpoint
        a recurrent model restores from)."""
        return self.records(self.stored_part(toks), checkpoint=self.checkpointed)


def _windowed(c: Codec) -> bool:
    return isinstance(c, RotatingCodec) or (isinstance(c, CacheListCodec) and any(map(_windowed, c.subs)))


def _span(source: Source, start: int) -> Span:
    """A record that was opened, as a span of the prompt starting at `start`."""
    r = source.id
    return Span(r.hash, r.ns, r.parent, r.depth, r.kind, r.ntokens, r.first_token, start=start,
                tenant=r.tenant)
