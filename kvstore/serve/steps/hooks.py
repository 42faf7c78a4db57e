"""mlx_lm.server's generation, seen at each request's first step, and a wrong restore computed again.

mlx_lm.server runs a request's first generation step in `stream_generate` (a request served
alone) or in its `BatchGenerator` (requests served together). Both are wrapped here so that the
step's log-probabilities reach `FirstSteps.seen` with the request's prompt and its lookup: the
prompt's canary, or the check of a restore against the canary its record keeps.

When that check fails, the restored K/V are not what was stored, and the step just computed from
them is not what a cold run computes. Nothing of it has reached the client yet (the step's token is
held back here), so the request starts again from its whole prompt on a fresh cache, as a miss
would, and its first token and all after it come from that: the answer is the cold run's. The
records the restore used are quarantined by the check; the request's usage counts the prompt as
computed (`cached_tokens` 0), and its cache, computed cold, is stored as any other. A request that
cannot be started again here (a draft model, image embeddings, an mlx-lm that passes other
arguments) is answered from the restore, as before, and none of its cache is stored.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable

from kvstore.model.prefill import prompt_cache
from kvstore.serve.steps.firststeps import Fetch, FirstSteps

log = logging.getLogger("kvstore")

#: The per-request options of `BatchGenerator.insert_segments` a request is inserted again with.
_OPTIONS = ("max_tokens", "samplers", "logits_processors", "stop_sequences")


def first_step_stream(original: Callable, steps: FirstSteps) -> Callable:
    """mlx_lm.server's `stream_generate` (a request served alone), showing `steps` its first step
    and computing the request again, cold, when its restore did not give its canary."""

    def stream_generate(*args, **kwargs):
        processed = bool(kwargs.get("logits_processors"))  # (a logit bias or a penalty: not the model's)
        fetch = steps.current()
        cache = kwargs.get("prompt_cache")
        can = (fetch is not None and fetch.mc is not None and isinstance(cache, list) and "prompt" in kwargs
               and kwargs.get("draft_model") is None and kwargs.get("input_embeddings") is None)
        gens = original(*args, **kwargs)
        try:
            gen = next(gens, None)
            if gen is None:
                return
            wrong = steps.seen(getattr(gen, "logprobs", None), rest=kwargs.get("prompt"), processed=processed,
                               fetch=fetch, redo=can)
            start = _cold_or_none(steps, fetch) if wrong and can else None
            if start is not None:
                gens.close()  # (its step is dropped: no token of it was handed on)
                cache[:] = start.cache  # (in place: the server stores this list after, the cold K/V)
                gens = original(*args, **{**kwargs, "prompt": start.rest})
                gen = next(gens, None)
                if gen is None:
                    return
                steps.seen(getattr(gen, "logprobs", None), prompt=fetch.tokens, processed=processed,
                           fetch=fetch.cold())
            yield gen
            yield from gens
        finally:
            gens.close()

    return stream_generate


def _cold_or_none(steps: FirstSteps, fetch: Fetch):
    """`_cold`, or None when it fails: the request is then answered from its restore after all,
    and none of its cache is stored (`FirstSteps.not_redone`)."""
    try:
        return _cold(steps, fetch)
    except Exception as e:
        steps.not_redone(fetch.tokens, fetch.tenant, e)
        return None


def _cold(steps: FirstSteps, fetch: Fetch):
    """A request's start as a cold run's (`prefill.prompt_cache` from a fresh cache: in exact
    mode the prompt but its last token computed in the store's steps and stored, its end
    waiting for the first step's canary)."""
    start = prompt_cache(fetch.mc, fetch.tokens, restore=False)
    if start.hold is not None:
        steps.expect(fetch.tokens, start.hold)
    # (the request's lookup logged what it restored: say what this request computes instead)
    computed = len(fetch.tokens) - len(start.rest)
    log.info("kvstore: prompt %d tokens, computed again: 0 reused from the store%s", len(fetch.tokens),
             f", {computed} computed in exact steps and stored" if getattr(fetch.mc, "exact", None) else "")
    return start


@dataclass
class _Started:
    """A request in the batch until its first step: its whole prompt, whether its logits are
    processed, its lookup, and how to insert it again (None: it cannot be)."""

    prompt: list[int]
    processed: bool
    fetch: Fetch
    again: dict | None


def first_step_batches(original: type, steps: FirstSteps) -> type:
    """mlx_lm.server's `BatchGenerator` (requests served in a batch), showing `steps` the first
    generation step of each request (`_FirstStepBatches`)."""
    return type("BatchGenerator", (_FirstStepBatches, original), {"_kvstore_steps": steps})


class _FirstStepBatches:
    """Put in front of mlx_lm.server's `BatchGenerator` by `first_step_batches` (which sets
    `_kvstore_steps`): the first generation step of each request, with its whole prompt (the
    cached tokens and the segments), reaches `FirstSteps.seen`, and a request whose restore did
    not give its canary is inserted again, cold.

    A request inserted again gets a new uid from the generator; the server knows it by its first,
    so uids are translated both ways (`next`'s responses; `extract_cache` and `remove`)."""

    _kvstore_steps: FirstSteps

    def insert_segments(self, segments, *args, **kwargs):
        fetch = self._kvstore_steps.current()
        uids = super().insert_segments(segments, *args, **kwargs)
        with contextlib.suppress(Exception):
            done = kwargs.get("all_tokens") or [[] for _ in segments]
            # (a request's logit bias or penalties: its first step's logits are not the model's)
            processors = kwargs.get("logits_processors", args[4] if len(args) > 4 else None)
            processed = [bool(p) for p in processors] if processors else [False] * len(segments)
            started = self.__dict__.setdefault("_kvstore_started", {})
            for i, (uid, parts, cached) in enumerate(zip(uids, segments, done)):
                prompt = [*cached, *(t for part in parts for t in part)]
                mine = fetch if fetch is not None and fetch.tokens == prompt else Fetch(prompt)
                again = None
                if not args and parts:  # (segments still to compute: the cached tokens go first)
                    again = {k: [kwargs[k][i]] for k in _OPTIONS if kwargs.get(k) is not None}
                    again["segments"] = [[[*cached, *parts[0]], *parts[1:]]]
                started[uid] = _Started(prompt, processed[i], mine, again)
        return uids

    def next(self, *args, **kwargs):
        prompts, generated = super().next(*args, **kwargs)
        with contextlib.suppress(Exception):
            first = self.__dict__.get("_kvstore_first", {})
            for r in (*prompts, *generated):
                r.uid = first.get(r.uid, r.uid)
                if getattr(r, "finish_reason", None) is not None:
                    self._kvstore_forget(r.uid)
        started = self.__dict__.get("_kvstore_started")
        if not started:
            return prompts, generated
        dropped = set()
        for r in generated:
            s = started.pop(getattr(r, "uid", None), None)
            if s is None:
                continue
            wrong = self._kvstore_steps.seen(getattr(r, "logprobs", None), prompt=s.prompt, processed=s.processed,
                                             fetch=s.fetch, redo=s.again is not None)
            if wrong and s.again is not None:
                start = _cold_or_none(self._kvstore_steps, s.fetch)
                if start is not None:
                    self._kvstore_again(r.uid, s, start)
                    dropped.add(id(r))
        return prompts, [r for r in generated if id(r) not in dropped] if dropped else generated

    def _kvstore_again(self, uid: int, s: _Started, start) -> None:
        """Insert request `uid` again from its whole prompt on `start`'s fresh cache (its first
        step is dropped), then take its restored run out of the batch."""
        now = self.__dict__.setdefault("_kvstore_now", {})  # the server's uid -> the generator's
        first = self.__dict__.setdefault("_kvstore_first", {})  # and back
        current = now.get(uid, uid)
        options = dict(s.again)
        segments = options.pop("segments")
        done = s.prompt[:len(s.prompt) - len(start.rest)]  # (exact mode: computed in the store's steps)
        if done:
            segments = [[start.rest]]
        (new,) = super().insert_segments(segments, caches=[start.cache], all_tokens=[done], **options)
        tenants = self.__dict__.get("_kvstore_tenants")  # (`_tenant_batches`: whose cache it is)
        if tenants is not None and current in tenants:
            tenants[new] = tenants[current]
        super().remove([current])
        first.pop(current, None)
        now[uid], first[new] = new, uid
        self._kvstore_started[uid] = _Started(s.prompt, s.processed, s.fetch.cold(), None)

    def _kvstore_forget(self, uid: int) -> None:
        first = self.__dict__.get("_kvstore_first", {})
        first.pop(self.__dict__.get("_kvstore_now", {}).pop(uid, None), None)

    def _kvstore_uids(self, uids) -> list:
        now = self.__dict__.get("_kvstore_now", {})
        return [now.get(uid, uid) for uid in uids]

    def extract_cache(self, uids):
        found = super().extract_cache(self._kvstore_uids(uids))
        first = self.__dict__.get("_kvstore_first", {})
        return {first.get(uid, uid): v for uid, v in found.items()}

    def remove(self, uids, *args, **kwargs):
        out = super().remove(self._kvstore_uids(uids), *args, **kwargs)
        if isinstance(out, dict):
            first = self.__dict__.get("_kvstore_first", {})
            out = {first.get(uid, uid): v for uid, v in out.items()}
        for uid in uids:
            self._kvstore_forget(uid)
            self.__dict__.get("_kvstore_started", {}).pop(uid, None)
        return out
