"""Explicit writes of a `ModelCache`: `prefill` (store a prompt, computing only what is missing:
`model.prefill` processes it), pins (`unpin`; `prefill(..., pin=True)` pins) and roles (`mark`).

`ExplicitWrites` is mixed into `ModelCache`, which gives it `fetch`, `insert`, `stored_length`,
`_durable` (the records a prompt needs on disk) and `owns` (which of them its binding may write:
a tenant's own, never a shared one).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kvstore.errors import InvalidInputError, StoreOpenError, check_flags
from kvstore.model.prefill import CHECKPOINT_EVERY
from kvstore.model.prefill import prefill as prefill_prompt
from kvstore.model.tokens import Tokens, as_tokens
from kvstore.records import Span
from kvstore.upkeep.evict import role_class

# A pin that finds its records evicted under it (by another process) stores them again, this often.
PIN_ATTEMPTS = 3


class ExplicitWrites:
    """`prefill`, `mark`, `unpin` and what they need, for `ModelCache`."""

    def prefill(self, tokens: Tokens, *, step: int | None = None, checkpoint_every: int = CHECKPOINT_EVERY,
                pin: bool = False, progress: Callable[[int], None] | None = None,
                durable: bool = True, cache_type: str = "assistant") -> tuple[list | None, int, int]:
        """Make sure the cache of `tokens` is stored, computing only what is missing.

        It is written to disk whatever the admission policy says (`durable=False`: as the
        policy says, and a record kept in RAM counts as stored).

        Processes the missing tokens up to each chunk boundary (or `step` at a time) and inserts
        after each (with `cache_type`, as `insert`), so a crash or Ctrl-C keeps everything
        computed so far; the last token is a step of its own, whose logits are kept as the
        prompt's canary (`kvstore.canary`). Recurrent layers get a checkpoint every
        `checkpoint_every` chunks and at the end. In exact mode (`exact_prefill`) the steps are
        the store's, and the prompt but its last token is stored (`model.prefill`). Returns (the
        cache, or None if nothing had to be computed; tokens reused; tokens computed). A store
        open read-only refuses it (`StoreOpenError`): it would compute and store nothing.
        """
        self.backing.check_open()  # (a store in RAM would say its prompt is stored, as it held it)
        if self.backing.read_only:
            raise StoreOpenError("this store is open read-only: prefill needs to write to it (fetch works)")
        return prefill_prompt(self, tokens, step=step, checkpoint_every=checkpoint_every, pin=pin,
                              progress=progress, durable=durable, cache_type=cache_type)

    def already_stored(self, toks: np.ndarray, *, pin: bool, durable: bool, cache_type: str) -> bool:
        """Whether a prefill of `toks` has nothing to compute: the prompt is stored (then it is
        pinned and typed as asked)."""
        role = insert_options(cache_type, pin=pin, durable=durable)
        for _ in range(PIN_ATTEMPTS):
            # What this process holds in RAM may be gone from disk (gc in another process): a
            # prefill answers for the disk, so records the disk lost are forgotten and recomputed.
            self._forget_lost(toks)
            if not self.stored_whole(toks) or self._needs_end_checkpoint(toks):
                return False
            if durable and self._held_back(toks):
                return False  # in RAM only: restored from there and written by the insert
            if not pin or self._pin(toks):
                if role:  # stored already: its type only
                    self.mark(toks, cache_type)
                # A use, as a fetch of it is: a budget evicts the least recently used first, and
                # warming a prompt again (from cron, say) is how it is kept fresh.
                self.backing.tiers.touch([s.hash for s in self._durable(toks) + self.resume_records(toks)])
                return True
        return False

    def mark(self, tokens: Tokens, cache_type: str, *, first: int | None = None) -> None:
        """Raise to `cache_type` the role of the stored records of `tokens` that hold any of its
        first `first` tokens (all of them by default), as an insert of that type would, without
        writing K/V: `warm` marks a prompt's system messages this way. Waits for queued writes."""
        role, b = _role(cache_type), self.backing
        toks = as_tokens(tokens)
        if not role or b.index is None or len(toks) == 0:
            return
        first = len(toks) if first is None else first
        b.writer.flush()  # the rows, on this machine: uploads are the command's to wait for, once
        b.index.raise_role([s.hash for s in self._durable(toks) if s.start < first and self.owns(s)], role)

    def _needs_end_checkpoint(self, toks: np.ndarray) -> bool:
        ends = (self._durable(toks)[-1:] if self.checkpointed else []) + self.resume_records(toks)[-1:]
        return len(self.backing.tiers.holds(ends)) < len(ends)

    def resume_records(self, toks: np.ndarray) -> list[Span]:
        """The records `prefill` stores at the prompt's last token but one, besides the prompt's,
        where the same prompt asked again resumes (a fetch leaves the last token to compute):
        with recurrent layers, which restore only at a checkpoint, its tail and checkpoint; with
        sliding-window layers and a prompt that ends on a chunk boundary, its tail (the chunk,
        stored after the last step, lacks the window's first token there). Exact mode: none."""
        C = self.chunk_size
        if self.exact or len(toks) < 2 or not (self.checkpointed or (self._windowed and len(toks) % C == 0)):
            return []
        have = {s.hash for s in self._durable(toks)}
        return [s for s in self.records(toks[:-1], checkpoint=self.checkpointed) if s.hash not in have]

    def _held_back(self, toks: np.ndarray) -> bool:
        """Whether admission or the write budget keeps some record of `toks` in RAM only (once
        the writer has decided on what is queued)."""
        gate = self.backing.gate
        if gate is None or not gate.selective:
            return False
        self.backing.writer.flush()
        return gate.holds_back(s.hash for s in self._durable(toks))

    def _forget_lost(self, toks: np.ndarray) -> None:
        """Drop from the memory tier the records of `toks` that are neither queued nor on disk."""
        b = self.backing
        if b.index is None:
            return
        kept = b.gate.holds_back if b.gate is not None else (lambda hashes: False)
        held = [s.hash for s in self._durable(toks) if s.hash in b.memory and not b.writer.is_pending(s.hash)
                and not kept([s.hash])]  # kept in RAM by admission or budget: not lost
        if held:
            on_disk = b.index.present(held)
            b.memory.discard([h for h in held if h not in on_disk and not b.writer.is_pending(h)])

    def _pin(self, toks: np.ndarray) -> bool:
        """Pin what is stored for `toks` (and so keep it through gc). False if some record is not
        on disk to be pinned (another process evicted it): the caller stores it again."""
        b = self.backing
        if b.index is None:
            return True
        b.writer.flush()  # the rows, on this machine (as `mark`)
        wanted = [s.hash for s in self._durable(toks) + self.resume_records(toks) if self.owns(s)]
        return b.index.pin(wanted) >= len(wanted)

    def unpin(self, tokens: Tokens) -> dict:
        """Unpin what pinning `tokens` pinned (`prefill(..., pin=True)`, `insert(..., pin=True)`):
        the prompt's chunks, its tail and (with recurrent layers) its checkpoints, so that gc
        may evict them again. Returns {"records": how many were pinned, "bytes": their size}.

        Every record of the prompt is unpinned, shared ones too (bound with a tenant: the
        tenant's own only). Another pinned prompt that goes on past a shared record still keeps
        it (gc keeps what a pin hangs from); one that ends on it (a whole number of chunks, on a
        model with no recurrent layers) loses its pin: pin it again. Waits for queued writes
        first (their pins land before this)."""
        toks = as_tokens(tokens)
        b = self.backing
        b.check_open()
        if b.index is None or len(toks) == 0:
            return {"records": 0, "bytes": 0}
        if b.index.read_only:
            raise StoreOpenError("this store is open read-only: unpin needs to write to it")
        b.writer.flush()
        n, size = b.index.unpin([s.hash for s in self._durable(toks) + self.resume_records(toks) if self.owns(s)])
        return {"records": n, "bytes": size}


def insert_options(cache_type: str, **flags) -> int:
    """An insert's options checked (each flag True or False: "no" would read as true), and the
    class of its `cache_type`."""
    check_flags(**flags)
    return _role(cache_type)


def _role(cache_type: str) -> int:
    try:
        return role_class(cache_type)
    except ValueError as e:
        raise InvalidInputError(str(e)) from None
