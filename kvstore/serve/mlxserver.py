"""mlx_lm.server, checked for what kvstore relies on, and with kvstore's cache and handler put in.

`persistent()` is the one place that reaches into mlx_lm.server: within it, its `ResponseGenerator`
is handed a `PersistentPromptCache`, its HTTP server uses kvstore's handler, its generation
loop survives a request that makes it fail, and each request's tenant reaches the cache
(`tenancy`): its lookup is told it as the request is tokenized, and the caches its batch
generator hands back for inserting are tagged with the tenant of the request they are of. The
first generation step of every request is shown to the cache (`steps.hooks`: the prompt's canary,
and a request computed again when its restore does not give it).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import threading
import traceback
import weakref
from typing import Callable, Iterator

from kvstore import settings
from kvstore.errors import KVStoreError, ModelFilesError
from kvstore.serve.promptcache import DISK_TYPE, PersistentPromptCache
from kvstore.serve.steps.hooks import first_step_batches, first_step_stream
from kvstore.serve.tenancy.policy import UNKNOWN, RequestTenants
from kvstore.sizes import format_size, plural
from kvstore.store import Store
from kvstore.upkeep.local import AUTO_SHARE

log = logging.getLogger("kvstore")

#: The attribute of mlx_lm.server's request object that carries its tenant's id (set by the handler).
TENANT_ATTRIBUTE = "_kvstore_tenant"
#: Set on a request whose progress reports must not tell how many of its tokens were cached:
#: mlx_lm.server streams `: keepalive processed/total` (total: the tokens left after the cache).
HIDE_COUNTS_ATTRIBUTE = "_kvstore_hide_counts"


def server_module():
    """mlx_lm.server, checked for the names this module relies on."""
    try:
        import mlx_lm.server as server
    except ImportError as e:
        raise KVStoreError(f"cannot import mlx_lm.server ({e}): install mlx-lm") from e
    names = ("main", "ResponseGenerator", "ModelProvider", "APIHandler", "_run_http_server")
    missing = [name for name in names if not hasattr(server, name)]
    if not missing:
        params = inspect.signature(server.ResponseGenerator.__init__).parameters
        missing = [f"ResponseGenerator({n}=...)" for n in ("model_provider", "prompt_cache") if n not in params]
        if "handler_class" not in inspect.signature(server._run_http_server).parameters:
            missing.append("_run_http_server(handler_class=...)")
    if missing:
        raise KVStoreError(
            f"this mlx-lm ({_mlx_lm_version()}) has no {', '.join(missing)} in mlx_lm.server, which "
            "kvstore serve needs to put its cache in place; use mlx-lm 0.28 to 0.32, or "
            "PersistentPromptCache from your own server")
    return server


def _mlx_lm_version() -> str:
    try:
        from importlib.metadata import version

        return "mlx-lm " + version("mlx-lm")
    except Exception:
        return "mlx-lm of unknown version"


@contextlib.contextmanager
def persistent(server, cache: PersistentPromptCache, started: list,
               requests: weakref.WeakValueDictionary, make_handler: Callable[[type], type], *,
               on_start: Callable[[PersistentPromptCache], None] | None = None,
               waiting: Waiting | None = None) -> Iterator[None]:
    """Within: mlx_lm.server's ResponseGenerator gets `cache` instead of its own prompt cache, its
    HTTP server uses `make_handler(APIHandler)` as its handler, and the generation context of every
    request is listed in `requests` (so shutdown can stop them). `on_start(cache)` runs once the
    model is loaded, before the server listens; `waiting` counts the requests not started yet."""
    original = server.ResponseGenerator
    original_context = getattr(server, "GenerationContext", None)
    original_http = server._run_http_server
    original_batch = getattr(server, "BatchGenerator", None)
    original_provider = getattr(server, "ModelProvider", None)
    server._run_http_server = _http_runner(server, original_http, make_handler)
    if isinstance(original_provider, type):
        server.ModelProvider = _restoring_provider(original_provider)
    server.ResponseGenerator = _response_generator(original, cache, started, on_start, waiting or Waiting())
    if isinstance(original_context, type) and callable(getattr(original_context, "stop", None)):
        server.GenerationContext = _listed_context(original_context, requests)
    tenants = getattr(cache, "tenants", None)
    if tenants is not None and tenants.active:
        server.BatchGenerator = _tenant_batches(original_batch, tenants)
    original_stream = getattr(server, "stream_generate", None)
    if callable(original_stream):
        server.stream_generate = first_step_stream(original_stream, cache.first_steps)
    if isinstance(getattr(server, "BatchGenerator", None), type):
        server.BatchGenerator = first_step_batches(server.BatchGenerator, cache.first_steps)
    try:
        yield
    finally:
        server.ResponseGenerator = original
        server._run_http_server = original_http
        if original_provider is not None:
            server.ModelProvider = original_provider
        if original_context is not None:
            server.GenerationContext = original_context
        if original_batch is not None:
            server.BatchGenerator = original_batch
        if original_stream is not None:
            server.stream_generate = original_stream


def _http_runner(server, original_http: Callable, make_handler: Callable[[type], type]) -> Callable:
    """mlx_lm.server's `_run_http_server`, with kvstore's handler and start-up's objects frozen."""

    def run_http_server(host, port, response_generator, *args, **kwargs):
        base = args[1] if len(args) > 1 else kwargs.pop("handler_class", server.APIHandler)
        # Everything made so far (the model, the tokenizer, the libraries: ~80k objects for the
        # demo model, more for a real one) lives as long as the server. Frozen, Python's full
        # collections stop walking it: a 15-20 ms pause at a random point of a request, gone.
        gc.collect()
        gc.freeze()
        return original_http(host, port, response_generator, *args[:1], handler_class=make_handler(base),
                             **kwargs)

    return run_http_server


def _restoring_provider(original: type) -> type:
    """mlx_lm.server's `ModelProvider`, which loads the model it had again when a request names
    one that does not load. Stock, it unloads its model first and is left with none: the request
    gets 404 with the loader's message (for `"model": "gpt-4"`, a Hub connection error), render
    and prefetch answer 503 until a later request loads the served model back, and that request
    pays for the load."""

    class ModelProvider(original):
        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            had = self.model_key
            try:
                return super()._load(model_path, adapter_path, draft_model_path)
            except Exception as e:
                if had is None or had == (model_path, adapter_path, draft_model_path):
                    raise
                detail = " ".join(str(e).split()) or type(e).__name__
                served = getattr(self.cli_args, "model", None)
                what, name, advice = _failed_part((model_path, adapter_path, draft_model_path), had)
                log.warning("kvstore serve: a request named the %s %r, which does not load (%s); "
                            "%s is loaded again", what, name, type(e).__name__, had[0])
                super()._load(*had)
                raise ModelFilesError(
                    f"the {what} {name!r} cannot be loaded here ({type(e).__name__}: {detail}); "
                    f"this server serves {served!r} (GET /v1/models): {advice}") from e

    return ModelProvider


def _failed_part(wanted: tuple, had: tuple) -> tuple[str, object, str]:
    """`(what, name, advice)` for the part of `wanted` (model, adapter, draft model) that `had`
    did not load already: the part a failed load is to be blamed on."""
    if wanted[0] != had[0]:
        return "model", wanted[0], "send that id, or leave model out"
    if wanted[2] != had[2]:
        return "draft model", wanted[2], "leave draft_model out"
    return "adapter", wanted[1], "leave adapters out"


def _response_generator(original: type, cache: PersistentPromptCache, started: list,
                        on_start: Callable | None, waiting: Waiting) -> type:
    """A subclass of mlx_lm.server's `ResponseGenerator` that serves from `cache` and lists itself
    in `started` (see `_RecoveringGenerator`)."""
    return type("ResponseGenerator", (_RecoveringGenerator, original),
                {"_kvstore_cache": cache, "_kvstore_started": started,
                 "_kvstore_on_start": staticmethod(on_start) if on_start is not None else None,
                 "_kvstore_waiting": waiting})


class Waiting:
    """Requests handed to the generation loop whose prompt processing has not started yet:
    vLLM's `num_requests_waiting`. A request served alone stops waiting when the generation
    thread takes it up (`start`); one that joins a batch, at its first progress report or token:
    it may wait inside the batch for a free slot, and mlx-lm tells no more than that, at the end
    of each prefill step (`--prefill-step-size` tokens)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._waiting: dict[int, object] = {}  # id(request) -> request, until it starts
        self.count = 0

    def add(self, request: object) -> None:
        with self._lock:
            self._waiting[id(request)] = request
            self.count = len(self._waiting)

    def start(self, request: object) -> None:
        """`request` is taken up (at once, or when it ends: each time after the first does nothing)."""
        with self._lock:
            if self._waiting.get(id(request)) is request:
                del self._waiting[id(request)]
            self.count = len(self._waiting)

    def watch(self, request: object, progress: Callable | None, tokens: Iterator) -> tuple[Callable, Iterator]:
        """`(progress callback, token iterator)` of one request, each ending its wait when first used."""
        def on_progress(*args):
            self.start(request)
            if progress is not None:
                progress(*args)

        def watched():
            try:
                for item in tokens:
                    self.start(request)
                    yield item
            finally:
                self.start(request)

        return on_progress, watched()


def _reused_only(ctx, tokens: Iterator, first_steps, tenant: object) -> Iterator:
    """`tokens`, with `ctx.prompt_cache_count` (the usage's `cached_tokens`) made what was reused
    once the lookup is done: in exact mode the server is handed a cache that holds the tokens
    kvstore prefilled too, which mlx_lm.server would count as cached. `tenant`: the request's."""
    fixed = False

    def fix() -> None:
        nonlocal fixed
        if not fixed and getattr(ctx, "prompt_cache_count", -1) > 0:
            fixed = True
            ctx.prompt_cache_count -= first_steps.take_computed(getattr(ctx, "prompt", None) or [], tenant)

    try:
        for item in tokens:
            fix()
            yield item
    finally:
        fix()


class _RecoveringGenerator:
    """Put in front of mlx_lm.server's `ResponseGenerator` by `_response_generator` (which sets
    the two class attributes): its prompt cache is ours, and its generation loop starts again
    after a request made it fail."""

    _kvstore_cache: PersistentPromptCache
    _kvstore_started: list
    _kvstore_on_start: Callable | None
    _kvstore_waiting: Waiting

    def __init__(self, model_provider, prompt_cache, *args, **kwargs):
        cache = self._kvstore_cache
        cache.attach(model_provider)
        log.info("%s", describe_store(cache.store))
        _load_default(model_provider)
        if self._kvstore_on_start is not None:
            self._kvstore_on_start(cache)
        self._kvstore_queues: weakref.WeakSet = weakref.WeakSet()  # answer queues of requests taken
        self._kvstore_taken = 0
        super().__init__(model_provider, cache, *args, **kwargs)
        self._kvstore_started.append(self)

    def generate(self, request, generation_args, progress_callback=None):
        """mlx_lm.server's `generate`, the request counted as waiting until it starts."""
        waiting = self._kvstore_waiting
        waiting.add(request)
        holder: list = []

        def progress(*args):
            holder[0](*args) if holder else None

        try:
            ctx, tokens = super().generate(request, generation_args, progress_callback=progress)
        except BaseException:
            waiting.start(request)
            raise
        if progress_callback is not None and getattr(request, HIDE_COUNTS_ATTRIBUTE, False):
            told = progress_callback

            def progress_callback(processed, total):  # (no count: prompt - total = cached; nor a share of it)
                told(0, 0)

        on_progress, watched = waiting.watch(request, progress_callback, tokens)
        holder.append(on_progress)
        return ctx, _reused_only(ctx, watched, self._kvstore_cache.first_steps, getattr(request, TENANT_ATTRIBUTE, None))

    def _tokenize(self, tokenizer, request, *args, **kwargs):
        # mlx_lm.server looks a request's prompt up right after it tokenizes it, on this thread.
        self._kvstore_cache.tenants.begin(getattr(request, TENANT_ATTRIBUTE, None))
        return super()._tokenize(tokenizer, request, *args, **kwargs)

    def _serve_single(self, request, *args, **kwargs):
        # One request at a time: its lookup and its insert are its tenant's.
        tenant = getattr(request[1], TENANT_ATTRIBUTE, None) if isinstance(request, tuple) else UNKNOWN
        if isinstance(request, tuple):  # served alone: its prompt processing starts now
            self._kvstore_waiting.start(request[1])
        with self._kvstore_cache.tenants.single(tenant):
            return super()._serve_single(request, *args, **kwargs)

    def _next_request(self, *args, **kwargs):
        request = super()._next_request(*args, **kwargs)
        if request is not None:
            self._kvstore_taken += 1
            with contextlib.suppress(TypeError):
                self._kvstore_queues.add(request[0])
        return request

    def _run_generate(self):
        """mlx_lm.server's generation loop, started again after a request made it fail.

        Stock, one request it does not check (e.g. an empty prompt) ends the loop, and every
        later request fails with "generation thread died". Here the requests being served get
        an error and the loop starts again; a failure before any request was taken (the model
        does not load) still ends it."""
        taken = 0  # a failure with no request taken since the last one ends the loop
        while True:
            try:
                return self._generate()
            except Exception as e:
                if self._stop or self._is_distributed or self._kvstore_taken == taken:
                    # With no request taken yet no prompt can be in the message (a model
                    # that does not load): then the whole traceback helps.
                    log.error("mlx_lm.server generation thread died: %s at %s", type(e).__name__,
                              where_raised(e), exc_info=self._kvstore_taken == 0)
                    self._generation_failed = True
                    return
                taken = self._kvstore_taken
                self._kvstore_fail_taken(e)

    def _log_cache_stats(self):
        """mlx_lm.server's cache log, in the right words: what the disk holds is records (chunks
        and tails), not sequences."""
        cache = self.prompt_cache
        log.info("Prompt Cache: %s in RAM, %.2f GB", plural(len(cache), "sequence"), cache.nbytes / 1e9)
        for cache_type, stats in cache.stats_by_type().items():
            unit = "record" if cache_type == DISK_TYPE else "sequence"
            log.info("- %s: %s, %.2f GB", cache_type, plural(stats["n_sequences"], unit), stats["n_bytes"] / 1e9)

    def _kvstore_fail_taken(self, e: Exception) -> None:
        """Answer the requests taken so far with an error (the loop is about to start again)."""
        log.error("kvstore serve: a request made mlx_lm.server's generation loop fail "
                  "(%s at %s); the requests in progress get an error and it starts again",
                  type(e).__name__, where_raised(e))
        failure = RuntimeError("generation failed on a request in this batch; the server "
                               "has recovered: send it again")
        for answers in list(self._kvstore_queues):
            answers.put(failure)
        self._kvstore_queues = weakref.WeakSet()


def _tenant_batches(original: type | None, tenants: RequestTenants) -> type:
    """mlx_lm.server's `BatchGenerator`, tagging each cache it hands back with the tenant of the
    request it is of (the tenant of the lookup just made when the request was inserted)."""
    if not isinstance(original, type):
        raise KVStoreError("this mlx-lm has no BatchGenerator in mlx_lm.server, which kvstore serve needs to "
                           "serve tenants apart; use mlx-lm 0.31 or 0.32, or --tenant-from none")

    class BatchGenerator(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._kvstore_tenants: dict[int, object] = {}  # uid -> tenant

        def insert_segments(self, *args, **kwargs):
            uids = super().insert_segments(*args, **kwargs)
            for uid in uids:
                self._kvstore_tenants[uid] = tenants.last()
            return uids

        def extract_cache(self, uids):
            found = super().extract_cache(uids)
            for uid, (cache, _) in found.items():
                tenants.tag(cache, self._kvstore_tenants.get(uid, UNKNOWN))
            return found

        def next(self, *args, **kwargs):
            prompts, generated = super().next(*args, **kwargs)
            for r in generated:
                if getattr(r, "prompt_cache", None) is not None:
                    tenants.tag(r.prompt_cache, self._kvstore_tenants.get(r.uid, UNKNOWN))
                if getattr(r, "finish_reason", None) is not None:
                    self._kvstore_tenants.pop(r.uid, None)
            return prompts, generated

        def remove(self, uids, *args, **kwargs):
            out = super().remove(uids, *args, **kwargs)
            for uid in uids:
                self._kvstore_tenants.pop(uid, None)
            return out

    return BatchGenerator


def _load_default(model_provider) -> None:
    """Load the served model before the HTTP server starts: mlx_lm.server loads it in its
    generation thread, and a model that does not load then leaves a server that answers 503
    for ever. Here it is one line naming the model, and the process exits 1."""
    model = getattr(getattr(model_provider, "cli_args", None), "model", None)
    try:
        model_provider.load_default()
    except Exception as e:  # mlx-lm raises many kinds; all mean "this model cannot be used"
        detail = " ".join(str(e).split()) or type(e).__name__
        raise ModelFilesError(f"cannot load model {model}: {detail}") from e


def _listed_context(original_context: type, requests: weakref.WeakValueDictionary) -> type:
    """mlx_lm.server's `GenerationContext`, each one listed in `requests` as it is made."""

    class GenerationContext(original_context):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            requests[id(self)] = self

    return GenerationContext


def where_raised(e: BaseException) -> str:
    """Where an exception was raised (file:line in function), never its message: messages can
    quote the prompt."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "an unknown place"
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"


def describe_store(store: Store) -> str:
    """The start line: where the store is, how big, how many records, the remote tier, and the
    settings that are not the defaults."""
    if store.index is None:
        return f"kvstore: RAM-only store, memory tier {format_size(store.memory.capacity)}"
    totals = store.index.totals()
    bound = f", bounded to {format_size(store.max_bytes)}" if store.max_bytes is not None else ""
    bound += f" (auto: 1/{AUTO_SHARE} of held + free disk)" if getattr(store, "max_bytes_rule", None) else ""
    remote = getattr(store, "remote", None)
    below = (f"; remote tier {remote.url} (read through, written behind; prefetch {remote.prefetch}"
             + (f", at most {remote.deadline:g} s a fetch)" if remote.deadline is not None else ")")
             ) if remote is not None else "; no remote tier"
    changed = settings.not_default(settings.report(store.settings))
    return (f"kvstore: store {store.path}: {format_size(totals['bytes'])} in "
            f"{plural(totals['chunks'] + totals['tails'], 'record')} ({plural(totals['chunks'], 'chunk')}, "
            f"{plural(totals['tails'], 'tail')}){bound}; memory tier {format_size(store.memory.capacity)}{below}"
            f"; settings: {changed or 'defaults'}")
