"""Explicit writes of a `ModelCache`: `prefill` (store a prompt, computing only what is missing),
pins (`unpin`; `prefill(..., pin=True)` pins) and roles (`mark`).

`ExplicitWrites` is mixed into `ModelCache`, which gives it `fetch`, `insert`, `stored_length`,
`_durable` (the records a prompt needs on disk) and `owns` (which of them its binding may write:
a tenant's own, never a shared one).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

from kvstore.errors import InvalidInputError, StoreOpenError
from kvstore.model.tokens import Tokens, arrays_of, as_tokens
from kvstore.upkeep.evict import role_class

#: Default for `prefill`: a recurrent-state checkpoint every this many chunks (docs/library.md).
CHECKPOINT_EVERY = 4
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
        computed so far. Recurrent layers get a checkpoint every `checkpoint_every` chunks and at
        the end. Returns (the cache, or None if nothing had to be computed; tokens reused; tokens
        computed).
        """
        toks = as_tokens(tokens)
        if len(toks) == 0:
            raise InvalidInputError("prefill needs at least one token")
        role = _role(cache_type)
        for _ in range(PIN_ATTEMPTS):
            # What this process holds in RAM may be gone from disk (gc in another process): a
            # prefill answers for the disk, so records the disk lost are forgotten and recomputed.
            self._forget_lost(toks)
            if self.stored_length(toks) < len(toks) or self._needs_end_checkpoint(toks):
                break
            if durable and self._held_back(toks):
                break  # in RAM only: restored from there and written by the insert below
            if not pin or self._pin(toks):
                if role:  # stored already: its type only
                    self.mark(toks, cache_type)
                return None, len(toks), 0
        cache, rest = self.fetch(toks)
        reused = pos = len(toks) - len(rest)
        C = self.chunk_size
        while pos < len(toks):
            end = min(len(toks), pos + step) if step else min(len(toks), (pos // C + 1) * C)
            self.model(mx.array(toks[pos:end])[None], cache=cache)
            mx.eval(arrays_of(cache))
            at_boundary = end % C == 0 and checkpoint_every > 0 and (end // C) % checkpoint_every == 0
            self.insert(toks[:end], cache, pin=pin and end == len(toks),
                        checkpoint=end == len(toks) or at_boundary, durable=durable, cache_type=cache_type)
            if progress is not None:
                progress(end - pos)
            pos = end
        return cache, reused, len(toks) - reused

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
        if not self.checkpointed:
            return False
        end = self._durable(toks)[-1]
        return end.hash not in self.backing.tiers.holds([end])

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
        wanted = [s.hash for s in self._durable(toks) if self.owns(s)]
        return b.index.pin(wanted) >= len(wanted)

    def unpin(self, tokens: Tokens) -> dict:
        """Unpin what pinning `tokens` pinned (`prefill(..., pin=True)`, `insert(..., pin=True)`):
        the prompt's chunks, its tail and (with recurrent layers) its end checkpoint, so that gc
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
        n, size = b.index.unpin([s.hash for s in self._durable(toks) if self.owns(s)])
        return {"records": n, "bytes": size}


def _role(cache_type: str) -> int:
    try:
        return role_class(cache_type)
    except ValueError as e:
        raise InvalidInputError(str(e)) from None
