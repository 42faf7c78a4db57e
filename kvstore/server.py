"""`mlx_lm.server` with a persistent prompt cache: `PersistentPromptCache` and `kvstore serve`.

`mlx_lm.server` keeps its prompt cache in an in-RAM `LRUPromptCache`. `PersistentPromptCache`
answers the same calls from a kvstore `Store`, so cached prompts survive restarts and are shared by
every process that opens the store. `main()` runs the unmodified `mlx_lm.server.main()`; the only
change is that its `ResponseGenerator` is handed this cache (and the `ModelProvider` it needs to
know which model a cache key means) instead of the `LRUPromptCache` that `run()` made.

Run it as `kvstore serve [--store DIR] [--store-max-bytes SIZE] [--memory-bytes SIZE] [mlx_lm.server
options]` or `python -m kvstore.server ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import signal
import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any, Hashable, Iterator, Sequence

import numpy as np

from . import keys
from .errors import KVStoreError
from .sizes import format_size, parse_size
from .modelcache import ModelCache
from .store import Store

log = logging.getLogger("kvstore")

#: How many recent system prompts the memory tier keeps fresh (see `_SystemPrompts`).
MAX_SYSTEM_PROMPTS = 32

# What `_resolve` returns for a key the store does not serve.
IN_RAM = "in RAM"  # mlx-lm's own LRUPromptCache, as stock mlx_lm.server
UNCACHED = "uncached"  # no prompt caching at all: even mlx-lm's in-RAM reuse would be wrong


class PersistentPromptCache:
    """A drop-in for `mlx_lm.models.cache.LRUPromptCache`, backed by a kvstore `Store`.

    Keys are whatever the server passes as `model` (mlx_lm.server uses its `ModelProvider.model_key`,
    `(model path or repo id, adapter path, draft model path)`). A key resolves to a bound
    `ModelCache` through `register()` or through an attached `ModelProvider`. A key that cannot be
    stored (image prompts, model files that cannot be fingerprinted) is served by an in-RAM
    `LRUPromptCache` exactly as stock mlx_lm.server would. One exception: with a draft model (speculative decoding)
    nothing is cached, because mlx-lm 0.32's own cache then restores caches that change the greedy
    output; a miss is slower but never wrong.

    The memory tier of the store stands for the server's RAM cache: `trim_to`, `nbytes` and
    `__len__` refer to it (plus the in-RAM fallback). `max_size` bounds the sequences of the in-RAM
    fallback (mlx_lm.server's `--prompt-cache-size`); `max_bytes`, when given, is enforced on what
    both hold in RAM after every insert. The disk is bounded by the store's own `max_bytes`.
    No call raises into the server: a failure is logged and served as a miss.
    """

    def __init__(self, store: Store, *, max_size: int = 10, max_bytes: int | None = None):
        self.store = store
        self.max_size = max_size
        self.max_bytes = max_bytes
        self._fallback_cache = None
        self._provider = None
        self._registered: dict[Hashable, _Binding] = {}
        self._bound: tuple[Hashable, Any, _Binding | None] | None = None
        self._warned: set[tuple[Hashable, str]] = set()
        self._system = _SystemPrompts(MAX_SYSTEM_PROMPTS)
        self._lock = threading.RLock()
        self.counters = {"requests": 0, "prompt_tokens": 0, "reused_tokens": 0, "fallback_requests": 0,
                         "inserts": 0, "errors": 0}

    # -- telling it which model a key means --------------------------------------------------

    def register(self, key: Hashable, model_cache: ModelCache) -> None:
        """Serve `key` from `model_cache` (from `store.bind(model, model_id)`): for own servers."""
        with self._lock:
            self._registered[key] = _Binding(model_cache)

    def attach(self, model_provider: Any) -> None:
        """Resolve keys through an `mlx_lm.server.ModelProvider` (its `model_key` and `model`).

        The provider's `reset` is wrapped so a model it unloads is released here too, before the
        next one is loaded (a binding holds a reference to its model).
        """
        with self._lock:
            self._provider = model_provider
            cli_args = getattr(model_provider, "cli_args", None)
            size = getattr(cli_args, "prompt_cache_size", None)
            if isinstance(size, int):
                self.max_size = size
        reset = getattr(model_provider, "reset", None)
        if callable(reset) and not getattr(reset, "_kvstore_wrapped", False):
            def reset_and_forget(*args, **kwargs):
                self._forget_binding()
                return reset(*args, **kwargs)

            reset_and_forget._kvstore_wrapped = True
            model_provider.reset = reset_and_forget

    # -- what mlx_lm.server calls ------------------------------------------------------------

    def fetch_nearest_cache(self, model: Hashable, tokens: Sequence[int]) -> tuple[list | None, list[int]]:
        """`(cache, tokens still to process)` for the longest stored prefix of `tokens`.

        A miss is `(None, tokens)`, as from `LRUPromptCache`; the server then makes a fresh cache.
        """
        tokens = list(tokens)
        with self._lock:
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(tokens)
            try:
                binding = self._resolve(model, tokens)
                if not isinstance(binding, _Binding):
                    return self._fetch_elsewhere(binding, model, tokens)
                cache, rest = binding.fetch(tokens)
                reused = len(tokens) - len(rest)
                self.counters["reused_tokens"] += reused
                log.info("kvstore: prompt %d tokens, %d reused from the store", len(tokens), reused)
                if reused == 0:
                    return None, tokens
                return cache, list(rest)
            except Exception as e:  # never into the generation loop
                self._error("fetch", e)
                return None, tokens

    def insert_cache(self, model: Hashable, tokens: Sequence[int], prompt_cache: list, *,
                     cache_type: str = "assistant") -> None:
        """Store the cache of `tokens` (queued for the background writer; returns at once)."""
        tokens = list(tokens)
        with self._lock:
            try:
                binding = self._resolve(model, tokens)
                if binding == IN_RAM:
                    self._fallback().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
                if not isinstance(binding, _Binding):
                    return
                if not tokens:
                    return
                tokens = self._held_tokens(tokens, prompt_cache)
                if tokens is None:
                    return
                mc = binding.for_cache(prompt_cache)
                mc.insert(tokens, prompt_cache)
                self.counters["inserts"] += 1
                if cache_type == "system":
                    self._system.remember(mc, tokens)
                else:
                    self.store.memory.touch(self._system.hashes())
            except Exception as e:
                self._error("insert", e)
            if self.max_bytes is not None:
                self.trim_to(n_bytes=self.max_bytes)

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Shrink what is held in RAM: the in-RAM fallback, then the store's memory tier."""
        with self._lock:
            try:
                if self._fallback_cache is not None:
                    self._fallback_cache.trim_to(n_sequences=n_sequences, n_bytes=n_bytes)
                if n_bytes is not None:
                    self.store.memory.trim_to(max(0, n_bytes - self._fallback_nbytes()))
            except Exception as e:
                self._error("trim", e)

    def __len__(self) -> int:
        """Records in the memory tier plus sequences in the in-RAM fallback."""
        return len(self.store.memory) + (len(self._fallback_cache) if self._fallback_cache else 0)

    @property
    def nbytes(self) -> int:
        """Bytes held in RAM: the memory tier, writes not yet on disk, the in-RAM fallback."""
        pending = getattr(self.store.writer, "pending_bytes", 0)
        return self.store.memory.nbytes + pending + self._fallback_nbytes()

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        """Per tier: `n_sequences` (records, for the store's tiers) and `n_bytes`."""
        out = {"kvstore memory": {"n_sequences": len(self.store.memory), "n_bytes": self.store.memory.nbytes}}
        index = self.store.index
        if index is not None:
            try:
                totals = index.totals()
                out["kvstore disk"] = {"n_sequences": totals["chunks"] + totals["tails"],
                                       "n_bytes": totals["bytes"]}
            except Exception as e:  # a busy or damaged index must not stop a request
                self._error("stats", e)
        if self._fallback_cache is not None and len(self._fallback_cache):
            for cache_type, stats in self._fallback_cache.stats_by_type().items():
                out[f"in-RAM only, {cache_type}"] = dict(stats)
        return out

    # -- start-up and shut-down --------------------------------------------------------------

    def describe(self) -> str:
        """One line: where the store is, how big, how many records."""
        store = self.store
        if store.index is None:
            return f"kvstore: RAM-only store, memory tier {format_size(store.memory.capacity)}"
        totals = store.index.totals()
        bound = f", bounded to {format_size(store.max_bytes)}" if store.max_bytes is not None else ""
        bound += " (auto: 1/4 of held + free disk)" if store.max_bytes_rule else ""
        return (f"kvstore: store {store.path}: {format_size(totals['bytes'])} in "
                f"{totals['chunks'] + totals['tails']} records ({totals['chunks']} chunks, "
                f"{totals['tails']} tails){bound}; memory tier {format_size(store.memory.capacity)}")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for pending writes (False if `timeout` ran out first)."""
        return self.store.flush(timeout)

    # -- internals ---------------------------------------------------------------------------

    def _resolve(self, key: Hashable, tokens: list) -> _Binding | str:
        """The bound model for `key`, else `IN_RAM` or `UNCACHED`."""
        if tokens and min(tokens) < 0:  # image placeholders (mlx_lm.server's vision cache keys)
            return self._unstorable(key, "image prompts are cached in RAM only")
        binding = self._registered.get(key)
        if binding is not None:
            return binding
        provider = self._provider
        if provider is None:
            return self._unstorable(key, "no model is registered for this key")
        model = getattr(provider, "model", None)
        if model is None or getattr(provider, "model_key", None) != key:
            return self._unstorable(key, "the server has another model loaded")
        if self._bound is not None and self._bound[0] == key and self._bound[1] is model:
            return self._bound[2]
        binding = self._bind(key, provider, model)
        self._bound = (key, model, binding)
        return binding

    def _bind(self, key: Hashable, provider: Any, model: Any) -> _Binding | str:
        model_id, adapter, draft = _split_key(key)
        if draft is not None or getattr(provider, "draft_model", None) is not None:
            return self._unstorable(key, "speculative decoding: with a draft model nothing is cached",
                                    UNCACHED)
        if model_id is None:
            return self._unstorable(key, f"cannot tell which model the key {key!r} means")
        try:
            plain = self.store.bind(model, model_id, adapter_path=adapter)
            quantized = self._bind_quantized(provider, model, model_id, adapter)
        except KVStoreError as e:
            return self._unstorable(key, str(e))
        binding = _Binding(plain, quantized)
        log.info("kvstore: serving %s (fingerprint %s) from the store", model_id, plain.fingerprint.hex()[:12])
        return binding

    def _bind_quantized(self, provider: Any, model: Any, model_id: Any, adapter: Any) -> ModelCache | None:
        """With `--kv-bits`, the server's caches turn into `QuantizedKVCache`s once they pass
        `--quantized-kv-start` tokens: those go to a second namespace, shorter ones to the plain one."""
        cli_args = getattr(provider, "cli_args", None)
        kv_bits = getattr(cli_args, "kv_bits", None)
        if kv_bits is None:
            return None
        group = getattr(cli_args, "kv_group_size", None) or 64
        return self.store.bind(model, model_id, adapter_path=adapter, kv_bits=kv_bits, kv_group_size=group)

    def _forget_binding(self) -> None:
        with self._lock:
            self._bound = None

    def _unstorable(self, key: Hashable, reason: str, where: str = IN_RAM) -> str:
        if (key, reason) not in self._warned:
            self._warned.add((key, reason))
            then = "they stay in RAM as in stock mlx_lm.server" if where == IN_RAM else "every prompt is computed"
            log.warning("kvstore: not storing prompt caches for %r (%s); %s", key, reason, then)
        return where

    def _fallback(self):
        if self._fallback_cache is None:
            from mlx_lm.models.cache import LRUPromptCache

            limits = {} if self.max_bytes is None else {"max_bytes": self.max_bytes}
            self._fallback_cache = LRUPromptCache(self.max_size, **limits)
        return self._fallback_cache

    def _fallback_nbytes(self) -> int:
        return self._fallback_cache.nbytes if self._fallback_cache is not None else 0

    def _fetch_elsewhere(self, where: str, key: Hashable, tokens: list) -> tuple[list | None, list[int]]:
        self.counters["fallback_requests"] += 1
        cache, rest = None, tokens
        if where == IN_RAM:
            cache, rest = self._fallback().fetch_nearest_cache(key, tokens)
        log.info("kvstore: prompt %d tokens, 0 reused from the store (%d from RAM)", len(tokens),
                 len(tokens) - len(rest))
        return cache, rest

    @staticmethod
    def _held_tokens(tokens: list, cache: list) -> list | None:
        """The tokens the cache really holds: `tokens`, or a prefix if every layer has fewer."""
        offsets = {getattr(layer, "offset", None) for layer in cache}
        if len(offsets) != 1:
            return tokens  # mixed or unknown offsets: let the store check each layer
        (offset,) = offsets
        if not isinstance(offset, int) or offset == len(tokens):
            return tokens
        if 0 < offset < len(tokens):
            return tokens[:offset]
        log.debug("kvstore: not stored: the cache holds %s tokens but %d were given", offset, len(tokens))
        return None

    def _error(self, what: str, e: Exception) -> None:
        self.counters["errors"] += 1
        log.warning("kvstore: %s failed, served without the store: %s: %s", what, type(e).__name__, e,
                    exc_info=log.isEnabledFor(logging.DEBUG))


class _Binding:
    """The store as one server model sees it: plain K/V, and with `--kv-bits` also quantized K/V."""

    def __init__(self, plain: ModelCache, quantized: ModelCache | None = None):
        self.plain, self.quantized = plain, quantized

    def fetch(self, tokens: list[int]) -> tuple[list, list[int]]:
        mc = self.plain
        if self.quantized is not None and self.quantized.stored_length(tokens) > mc.stored_length(tokens):
            mc = self.quantized
        return mc.fetch(tokens)

    def for_cache(self, cache: list) -> ModelCache:
        if self.quantized is not None and any(type(c).__name__ == "QuantizedKVCache" for c in cache):
            return self.quantized
        return self.plain


class _SystemPrompts:
    """Recent system prompts, whose records the memory tier keeps fresh.

    mlx_lm.server marks the cache at the end of a system prompt as "system". Those records are the
    ancestors of every turn that follows, so on disk they already outlive the turns (eviction takes
    leaves first). In RAM they are moved to the recent end of the memory tier's LRU after every other
    insert, so assistant and user records go first. Bounded: only the last `limit` system prompts.
    No pins: a pin is the operator's decision (`kvstore warm`), and unpinning here could undo it.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._prompts: OrderedDict[tuple[bytes, bytes], list[bytes]] = OrderedDict()

    def remember(self, mc: ModelCache, tokens: list[int]) -> None:
        toks = np.asarray(tokens, dtype=np.int32)
        hashes = keys.chain(mc.ns, toks, mc.chunk_size)
        start = len(hashes) * mc.chunk_size
        if start < len(toks):
            hashes.append(keys.tail_hash(hashes[-1] if hashes else mc.ns, toks[start:]))
        if not hashes:
            return
        key = (mc.ns, hashes[-1])
        self._prompts.pop(key, None)
        self._prompts[key] = hashes
        while len(self._prompts) > self.limit:
            self._prompts.popitem(last=False)

    def hashes(self) -> list[bytes]:
        return [h for hashes in self._prompts.values() for h in reversed(hashes)]


def _split_key(key: Hashable) -> tuple[Any, Any, Any]:
    """`(model_id, adapter_path, draft_model_path)` of a server key (a tuple, or a bare path)."""
    if isinstance(key, tuple):
        parts = list(key) + [None] * 3
        return parts[0], parts[1], parts[2]
    if isinstance(key, (str, os.PathLike)):
        return key, None, None
    return None, None, None


# -- `kvstore serve` ---------------------------------------------------------------------------

PROG = "kvstore serve"
EPILOG = """\
Every other option goes to mlx_lm.server unchanged (--model, --host, --port, --prompt-cache-size,
--prompt-cache-bytes, --max-tokens, ...; see below). --model defaults to the built-in demo model;
--host defaults to 127.0.0.1. --memory-bytes defaults to --prompt-cache-bytes when that is given.

example:
  kvstore serve --store ~/.cache/kvstore --model mlx-community/Qwen3-4B-4bit --port 8080
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, add_help=False, allow_abbrev=False, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run mlx_lm.server with a prompt cache that survives restarts and is shared "
                    "by every server on the same store.")
    p.add_argument("-h", "--help", action="store_true", help="show this help (and mlx_lm.server's) and exit")
    p.add_argument("--store", metavar="DIR",
                   help="store directory (default: $KVSTORE_DIR, else ~/.cache/kvstore)")
    p.add_argument("--store-max-bytes", metavar="SIZE", type=_budget,
                   help="bound the store on disk, e.g. 20GB, or `auto`: a quarter of what it holds "
                        "plus the disk's free space, at start (default: unbounded)")
    p.add_argument("--memory-bytes", metavar="SIZE", type=_size,
                   help="bound the store's memory tier, e.g. 2GiB (default: 1 GiB)")
    return p


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _budget(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else _size(text)


def _peek(args: list[str]) -> argparse.Namespace:
    """The mlx_lm.server options kvstore needs to look at (left in place for mlx_lm.server)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    p.add_argument("--host")
    p.add_argument("--prompt-cache-bytes")
    return p.parse_known_args(args)[0]


def _server_module():
    """mlx_lm.server, checked for the names this module relies on."""
    try:
        import mlx_lm.server as server
    except ImportError as e:
        raise KVStoreError(f"cannot import mlx_lm.server ({e}): install mlx-lm") from e
    missing = [name for name in ("main", "ResponseGenerator", "ModelProvider") if not hasattr(server, name)]
    if not missing:
        params = inspect.signature(server.ResponseGenerator.__init__).parameters
        missing = [f"ResponseGenerator({n}=...)" for n in ("model_provider", "prompt_cache") if n not in params]
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
def _persistent(server, cache: PersistentPromptCache, started: list,
                requests: weakref.WeakValueDictionary) -> Iterator[None]:
    """Within: mlx_lm.server's ResponseGenerator gets `cache` instead of its own prompt cache, and
    the generation context of every request is listed in `requests` (so shutdown can stop them)."""
    original = server.ResponseGenerator
    original_context = getattr(server, "GenerationContext", None)

    class ResponseGenerator(original):
        def __init__(self, model_provider, prompt_cache, *args, **kwargs):
            cache.attach(model_provider)
            log.info("%s", cache.describe())
            super().__init__(model_provider, cache, *args, **kwargs)
            started.append(self)

    server.ResponseGenerator = ResponseGenerator
    if isinstance(original_context, type) and callable(getattr(original_context, "stop", None)):
        class GenerationContext(original_context):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                requests[id(self)] = self

        server.GenerationContext = GenerationContext
    try:
        yield
    finally:
        server.ResponseGenerator = original
        if original_context is not None:
            server.GenerationContext = original_context


class _Stopper:
    """SIGTERM and Ctrl-C: the first one stops the requests being generated (as a client that hangs
    up would) and the HTTP server, the way mlx_lm.server handles Ctrl-C (a KeyboardInterrupt in its
    serve_forever); a second Ctrl-C flushes and exits at once."""

    def __init__(self, store: Store):
        self.store = store
        self.stopping = False
        self.previous: dict[int, Any] = {}
        self.requests: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                return

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self.stopping:
            self.stopping = True
            log.info("kvstore: %s: stopping the server, then flushing pending writes", name)
            for request in list(self.requests.values()):
                with contextlib.suppress(Exception):
                    request.stop()  # mlx_lm.server's sequential path would otherwise finish it first
            raise KeyboardInterrupt
        if signum == signal.SIGINT:
            log.warning("kvstore: second Ctrl-C: flushing pending writes and exiting now")
            self.store.flush(timeout=10)
            os._exit(0)
        log.info("kvstore: %s: already stopping", name)


def main(argv: Sequence[str] | None = None) -> int:
    """`kvstore serve`: mlx_lm.server with a `PersistentPromptCache`. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        ours, passthrough = parser.parse_known_args(args)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        server = _server_module()
    except KVStoreError as e:
        print(f"kvstore serve: {e}", file=sys.stderr)
        return 1
    if ours.help:
        parser.print_help()
        print("\nmlx_lm.server options:")
        return _run_mlx_server_main(server, ["--help"])
    peek = _peek(passthrough)
    if peek.model is None:
        from .demo import DEMO_NOTE, build_demo_model

        passthrough = ["--model", str(build_demo_model())] + passthrough
        print(DEMO_NOTE, file=sys.stderr)
    if peek.host is None:
        passthrough = ["--host", "127.0.0.1"] + passthrough
    memory_bytes = ours.memory_bytes
    if memory_bytes is None and peek.prompt_cache_bytes is not None:
        try:
            from mlx_lm.utils import _parse_size  # mlx_lm.server's own reading of it

            memory_bytes = int(_parse_size(peek.prompt_cache_bytes))
        except Exception:
            memory_bytes = None  # mlx_lm.server will say what is wrong with it

    import kvstore

    try:
        store = kvstore.open(ours.store, max_bytes=ours.store_max_bytes, memory_bytes=memory_bytes)
    except KVStoreError as e:
        print(f"kvstore serve: {e}", file=sys.stderr)
        return 1
    cache = PersistentPromptCache(store)
    stopper = _Stopper(store)
    started: list = []
    code = 0
    try:
        stopper.install()
        with _persistent(server, cache, started, stopper.requests):
            code = _run_mlx_server_main(server, passthrough)
    except KeyboardInterrupt:
        pass  # stopped before mlx_lm.server's own Ctrl-C handling was in place
    except OSError as e:  # mostly: the port is taken
        print(f"kvstore serve: cannot serve: {e}", file=sys.stderr)
        code = 1
    finally:
        stopper.stopping = True  # a signal from here on must not interrupt the flush
        for generator in started:  # its thread is not a daemon: left running, the process would hang
            generator.stop_and_join()
        log.info("kvstore: flushing pending writes")
        store.close()
        log.info("kvstore: %s", _final_counts(cache))
        stopper.uninstall()
    return code


def _run_mlx_server_main(server, args: list[str]) -> int:
    saved = sys.argv
    sys.argv = [PROG, *args]
    try:
        server.main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def _final_counts(cache: PersistentPromptCache) -> str:
    c = cache.counters
    return (f"stopped: {c['requests']} requests, {c['prompt_tokens']} prompt tokens, "
            f"{c['reused_tokens']} reused from the store")


def run(argv: Sequence[str] | None = None) -> None:
    """`main`, then exit the process without the interpreter's teardown.

    MLX 0.32 aborts at exit (SIGABRT) when a thread other than the main one evaluated arrays and
    did not clear its streams (ml-explore/mlx#3126); mlx_lm.server generates in such a thread.
    By the time `main` returns the store is flushed and closed, so skipping teardown loses nothing
    and the exit code stays the one `main` chose.
    """
    code = main(argv)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
