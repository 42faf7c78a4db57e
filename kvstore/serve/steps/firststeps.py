"""The first generation step of each request: its canary, and what waits for it.

mlx_lm.server runs a request's first step (the prompt's last token) in its generation loop, out of
the prompt cache's sight; `mlxserver` hooks that step and hands its log-probabilities here with
the request's prompt (`PersistentPromptCache.first_steps.seen`; an own server calls it after its
first step). No step is added: the logits are the ones the server computed for its first token. `FirstSteps` matches them to what waits:

- in exact mode, the insert of the prompt's end that `PersistentPromptCache` prepared while it
  prefilled the prompt (`model.prefill.prompt_cache`): it is queued now, with the canary;
- otherwise the insert of the request's cache after generation, whose record holding the
  prompt's last token keeps the canary (`canary_for`).

A request that restored a stored prompt whole (but its last token) ran its canary's step: the
step is compared with the canary (`certify.firststep`); when it does not reproduce, the records
the restore used are quarantined. A caller that then computes the request again from its whole
prompt (`seen(..., redo=True)`: `kvstore serve` does, `steps.hooks`) has its cache stored and
its reused tokens counted as computed; otherwise the request's cache, which holds the wrong K/V,
is not stored (`wrong`).

Prompts are known by a hash of their token ids. What waits is bounded: past `limit`, the oldest
exact-mode insert is queued without a canary, and the oldest canary is forgotten.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import xxhash

from kvstore.canary import Canary
from kvstore.certify.firststep import check_first_step
from kvstore.model.prefill import canary_of

log = logging.getLogger("kvstore")
LIMIT = 64


def _key(tokens: Sequence[int]) -> bytes:
    return xxhash.xxh3_128_digest(np.asarray(tokens, dtype="<i4").tobytes())


@dataclass(frozen=True)
class Fetch:
    """A request's lookup, as its first step is judged: its prompt, the model cache it was looked
    up in, its tenant's id (as the lookup was told it), and what the lookup restored
    (`ModelCache.last_restore`; None: nothing to compare the step with)."""

    tokens: list[int]
    mc: object = None
    tenant: object = None
    restore: tuple | None = None

    def cold(self) -> Fetch:
        """The same request computed from its whole prompt: nothing restored to check."""
        return replace(self, restore=None)


class FirstSteps:
    """Canaries of requests' first steps, and the exact-mode inserts waiting for them."""

    def __init__(self, limit: int = LIMIT):
        self.limit = limit
        self._lock = threading.Lock()
        self._holds: OrderedDict[bytes, tuple[int, object]] = OrderedDict()  # prompt -> (length, Pending)
        self._canaries: OrderedDict[bytes, tuple[int, Canary]] = OrderedDict()
        self.canaries = 0  # first steps seen (each one a canary)
        self.redone = 0  # requests whose restore missed its canary, computed again from their prompt
        self._fetched = threading.local()  # this thread's last lookup: (prompt, model cache, tenant)
        self._wrong: OrderedDict[bytes, int] = OrderedDict()  # prompts whose restore missed their canary
        # Exact mode: (tenant, prompt) -> tokens prefilled here, one count a request still to take it.
        self._computed: OrderedDict[tuple[object, bytes], list[int]] = OrderedDict()

    def fetched(self, prompt: list[int], mc=None, tenant: object = None) -> None:
        """This thread looked `prompt` up (in model cache `mc`, for the tenant whose id is
        `tenant`): a first step that only says its rest is of it, and whose restore it compares
        with the canary."""
        self._fetched.last = (prompt, mc, tenant)

    def current(self) -> Fetch | None:
        """This thread's last lookup, with what it restored (read now: after the fetch)."""
        last = getattr(self._fetched, "last", None)
        if last is None:
            return None
        prompt, mc, tenant = last
        restore = mc.last_restore() if mc is not None else None
        return Fetch(list(prompt), mc, tenant, restore)

    def expect(self, prompt: Sequence[int], hold) -> None:
        """Exact mode: `hold` (a `Pending` insert) stores `prompt`'s end once its first step ran."""
        late = []
        with self._lock:
            key = _key(prompt)
            if key in self._holds:  # the same prompt twice at once: the first waits no longer
                late.append(self._holds.pop(key)[1])
            self._holds[key] = (len(prompt), hold)
            while len(self._holds) > self.limit:
                late.append(self._holds.popitem(last=False)[1][1])
        for pending in late:
            pending.submit()

    def computed(self, prompt: Sequence[int], n: int, tenant: object = None) -> None:
        """Exact mode: `n` tokens of `prompt`, a request of `tenant` (its id), were prefilled here,
        in the cache the server was handed (its usage would count them as cached: `cached_tokens`).
        Kept per tenant and per request: the same prompt sent at once by two tenants (or twice by
        one) must not give one request's count to another, nor another tenant's to it."""
        with self._lock:
            self._computed.setdefault((tenant, _key(prompt)), []).append(n)
            while len(self._computed) > self.limit:
                self._computed.popitem(last=False)

    def take_computed(self, prompt: Sequence[int], tenant: object = None) -> int:
        """How many tokens of `prompt` were prefilled here for a request of `tenant` (0 if none,
        or each count already taken)."""
        if not self._computed:
            return 0
        with self._lock:
            key = (tenant, _key(prompt))
            counts = self._computed.get(key)
            if not counts:
                return 0
            n = counts.pop(0)
            if not counts:
                del self._computed[key]
            return n

    def seen(self, logprobs, *, prompt: Sequence[int] | None = None, rest: Sequence[int] | None = None,
             processed: bool = False, fetch: Fetch | None = None, redo: bool = False) -> bool:
        """The first step of a request gave these log-probabilities (an mlx or numpy array of the
        vocabulary's, or its logits: `model.prefill.host_logprobs`): its prompt is `prompt`, or
        the one looked up in `fetch` (this thread's last lookup if None) if `rest` (what the server
        was left to compute) ends it. `processed`: the request's logits processors (a logit bias,
        a repetition, presence or frequency penalty) changed them, so they are not the model's:
        neither kept as the prompt's canary nor compared with it (an exact-mode insert waiting
        for it is queued without one).

        True when the step did not give the canary of the stored prompt the request restored (the
        records it used are quarantined). `redo`: the caller then computes the request again from
        its whole prompt, cold, before answering: its cache is stored as any other, and the tokens
        the lookup said were reused are counted as computed (`take_computed`). Without it, none
        of that request's cache is stored (`wrong`). Never raises (a failure is logged: the
        canary is lost, the request goes on, and False)."""
        try:
            return self._seen(logprobs, prompt, rest, processed, fetch or self.current(), redo)
        except Exception as e:
            log.warning("kvstore: a first step was not kept as its prompt's canary (%s: %s)", type(e).__name__, e)
            return False

    def _seen(self, logprobs, prompt: Sequence[int] | None, rest: Sequence[int] | None, processed: bool,
              fetch: Fetch | None, redo: bool) -> bool:
        if prompt is None:
            if fetch is None or rest is None or fetch.tokens[len(fetch.tokens) - len(rest):] != list(rest):
                return False  # not the prompt this thread fetched last (an image prompt's cache key)
            prompt = fetch.tokens
        prompt = list(prompt)
        if not prompt:
            return False
        key = _key(prompt)
        if processed:
            with self._lock:
                held = self._holds.pop(key, None)
            if held is not None:
                held[1].submit()
            return False
        canary = canary_of(len(prompt) - 1, int(prompt[-1]), logprobs)
        moved = None
        if fetch is not None and fetch.mc is not None and fetch.restore is not None:
            then = "this request is computed again from its whole prompt before it is answered" if redo else None
            moved = check_first_step(fetch.mc, prompt, logprobs, restore=fetch.restore, then=then)
        if moved is not None and not moved.ok:
            if redo:  # (a check runs only on a restore of all but the last token: those were reused)
                with self._lock:
                    self.redone += 1
                self.computed(prompt, len(prompt) - 1, fetch.tenant)
                return True
            self._mark_wrong(prompt)
            return True
        with self._lock:
            self.canaries += 1
            held = self._holds.pop(key, None)
            if held is None:
                self._canaries[key] = (len(prompt), canary)
                while len(self._canaries) > self.limit:
                    self._canaries.popitem(last=False)
        if held is not None:
            held[1].submit(canary)
        return False

    def not_redone(self, prompt: Sequence[int], tenant: object, e: Exception) -> None:
        """A request `seen` with `redo` could not be computed again after all (`e`): it is answered
        from its restore, its reused tokens count as reused, and none of its cache is stored."""
        log.warning("kvstore: the request could not be computed again (%s: %s): it is answered from the "
                    "restore that missed its canary, and none of its cache is stored", type(e).__name__, e)
        self.take_computed(prompt, tenant)
        with self._lock:
            self.redone -= 1
        self._mark_wrong(prompt)

    def _mark_wrong(self, prompt: Sequence[int]) -> None:
        """None of the cache of the request of `prompt` is stored (`wrong`)."""
        with self._lock:
            self._wrong[_key(prompt)] = len(prompt)
            while len(self._wrong) > self.limit:
                self._wrong.popitem(last=False)

    def canary_for(self, tokens: Sequence[int]) -> Canary | None:
        """The canary of the prompt `tokens` begins with, taken (one insert keeps it)."""
        with self._lock:
            for key, (n, canary) in reversed(self._canaries.items()):
                if n <= len(tokens) and _key(tokens[:n]) == key:
                    del self._canaries[key]
                    return canary
        return None

    def wrong(self, tokens: Sequence[int]) -> bool:
        """Whether the request whose cache holds `tokens` restored a prompt that missed its canary
        (then none of the cache is stored); asked once."""
        with self._lock:
            for key, n in list(self._wrong.items()):
                if n <= len(tokens) and _key(tokens[:n]) == key:
                    del self._wrong[key]
                    return True
        return False

    def settle(self, tokens: Sequence[int]) -> None:
        """The request whose cache holds `tokens` is over: the insert of its prompt's end, if its
        first step was never seen, is queued without a canary."""
        with self._lock:
            done = [key for key, (n, _) in self._holds.items() if n <= len(tokens) and _key(tokens[:n]) == key]
            pending = [self._holds.pop(key)[1] for key in done]
        for p in pending:
            p.submit()

    def release(self) -> None:
        """Queue every insert still waiting, without its canary (the server stops)."""
        with self._lock:
            pending = [p for _, p in self._holds.values()]
            self._holds.clear()
        for p in pending:
            p.submit()
