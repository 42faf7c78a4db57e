"""`kvstore serve`: `mlx_lm.server` with a persistent prompt cache.

`main()` runs the unmodified `mlx_lm.server.main()`; what changes is that its `ResponseGenerator`
is handed a `PersistentPromptCache` (see `promptcache`) instead of the `LRUPromptCache` that
`run()` made, and its HTTP handler is kvstore's subclass (see `endpoints`: `/metrics`,
`/kvstore/stats`, a `/v1/models` that lists the served model, no cross-origin requests unless
allowed, no prompt text in the log).

Run it as `kvstore serve [--store DIR] [--store-max-bytes SIZE|auto|none] [--memory-bytes SIZE]
[--store-max-tokens N] [--allowed-origins LIST] [mlx_lm.server options]` or
`python -m kvstore.serve.server ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import io
import ipaddress
import logging
import os
import signal
import socket
import sys
import weakref
from typing import Any, Iterator, Sequence

from kvstore.errors import KVStoreError
from kvstore.serve.promptcache import PersistentPromptCache
from kvstore.sizes import parse_size
from kvstore.store import Store

log = logging.getLogger("kvstore")

__all__ = ["PersistentPromptCache", "main", "run"]

#: Default of --store-max-tokens: a longer request is served but not stored.
DEFAULT_MAX_STORED_TOKENS = 32768


# -- `kvstore serve` ---------------------------------------------------------------------------

PROG = "kvstore serve"
EPILOG = """\
Every other option goes to mlx_lm.server unchanged (--model, --host, --port, --prompt-cache-size,
--prompt-cache-bytes, --max-tokens, ...; see below). --model defaults to the built-in demo model;
--host defaults to 127.0.0.1 (kvstore warns when it listens on any other address).
--memory-bytes defaults to --prompt-cache-bytes when that is given.

Also served, read-only: GET /metrics (Prometheus) and GET /kvstore/stats (store.stats() as JSON).

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
    p.add_argument("--store-max-bytes", metavar="SIZE", type=_budget, default="auto",
                   help="bound the store on disk, e.g. 20GB; `auto` (the default): a quarter of "
                        "what it holds plus the disk's free space, at start; `none`: unbounded")
    p.add_argument("--memory-bytes", metavar="SIZE", type=_size,
                   help="bound the store's memory tier, e.g. 2GiB (default: 1 GiB)")
    p.add_argument("--store-max-tokens", metavar="N", type=_tokens, default=DEFAULT_MAX_STORED_TOKENS,
                   help="store the cache of a request only up to N tokens (prompt and generated "
                        f"together); longer ones are served, not stored (default: {DEFAULT_MAX_STORED_TOKENS}; "
                        "0: no cap)")
    p.add_argument("--allowed-origins", metavar="LIST", type=_origins, default=[],
                   help="comma-separated web origins whose requests are served, e.g. "
                        "http://localhost:3000, or `*` for every origin (default: none: a web page "
                        "cannot use the server)")
    p.add_argument("--remote", metavar="URL", default=os.environ.get("KVSTORE_REMOTE") or None,
                   help="share the cache through an S3 bucket, s3://BUCKET/PREFIX (default: $KVSTORE_REMOTE)")
    return p


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _budget(text: str) -> int | str | None:
    word = text.strip().lower()
    if word == "auto":
        return "auto"
    if word in ("none", "unbounded"):
        return None
    return _size(text)


def _tokens(text: str) -> int | None:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative: give a number of tokens, or 0 for no cap")
    return n or None


def _origins(text: str) -> list[str]:
    return [o.strip().rstrip("/") for o in text.split(",") if o.strip()]


def _peek(args: list[str]) -> argparse.Namespace:
    """The mlx_lm.server options kvstore needs to look at (left in place for mlx_lm.server)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    p.add_argument("--host")
    p.add_argument("--prompt-cache-bytes")
    return p.parse_known_args(args)[0]


def _without_option(help_text: str, flag: str) -> str:
    """argparse help without the entry of `flag` (its line and the indented lines under it)."""
    out, skipping = [], False
    for line in help_text.splitlines(keepends=True):
        stripped = line.lstrip()
        if stripped.startswith("-"):
            skipping = stripped.split()[0].rstrip(",") == flag
        elif not line.startswith(" ") or not stripped:
            skipping = False
        if not skipping:
            out.append(line)
    return "".join(out)


def _loopback(host: str) -> bool:
    """True if every address `host` names is a loopback address."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False  # mlx_lm.server will say it cannot bind it
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def _server_module():
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
def _persistent(server, cache: PersistentPromptCache, started: list,
                requests: weakref.WeakValueDictionary, make_handler) -> Iterator[None]:
    """Within: mlx_lm.server's ResponseGenerator gets `cache` instead of its own prompt cache, its
    HTTP server uses `make_handler(APIHandler)` as its handler, and the generation context of every
    request is listed in `requests` (so shutdown can stop them)."""
    original = server.ResponseGenerator
    original_context = getattr(server, "GenerationContext", None)
    original_http = server._run_http_server

    def run_http_server(host, port, response_generator, *args, **kwargs):
        base = args[1] if len(args) > 1 else kwargs.pop("handler_class", server.APIHandler)
        # Everything made so far (the model, the tokenizer, the libraries: ~80k objects for the
        # demo model, more for a real one) lives as long as the server. Frozen, Python's full
        # collections stop walking it: a 15-20 ms pause at a random point of a request, gone.
        gc.collect()
        gc.freeze()
        return original_http(host, port, response_generator, *args[:1], handler_class=make_handler(base),
                             **kwargs)

    server._run_http_server = run_http_server

    class ResponseGenerator(original):
        def __init__(self, model_provider, prompt_cache, *args, **kwargs):
            cache.attach(model_provider)
            log.info("%s", cache.describe())
            self._kvstore_queues: weakref.WeakSet = weakref.WeakSet()  # answer queues of requests taken
            self._kvstore_taken = 0
            super().__init__(model_provider, cache, *args, **kwargs)
            started.append(self)

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
            taken = -1
            while True:
                try:
                    return self._generate()
                except Exception as e:
                    if self._stop or self._is_distributed or self._kvstore_taken == taken:
                        # With no request taken yet no prompt can be in the message (a model
                        # that does not load): then the whole traceback helps.
                        log.error("mlx_lm.server generation thread died: %s at %s", type(e).__name__,
                                  _where(e), exc_info=self._kvstore_taken == 0)
                        self._generation_failed = True
                        return
                    taken = self._kvstore_taken
                    log.error("kvstore serve: a request made mlx_lm.server's generation loop fail "
                              "(%s at %s); the requests in progress get an error and it starts again",
                              type(e).__name__, _where(e))
                    failure = RuntimeError("generation failed on a request in this batch; the server "
                                           "has recovered: send it again")
                    for answers in list(self._kvstore_queues):
                        answers.put(failure)
                    self._kvstore_queues = weakref.WeakSet()

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
        server._run_http_server = original_http
        if original_context is not None:
            server.GenerationContext = original_context


def _where(e: BaseException) -> str:
    """Where an exception was raised (file:line in function), never its message: messages can
    quote the prompt."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "an unknown place"
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"


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
        print("\nmlx_lm.server options (--allowed-origins is kvstore's, above):")
        mlx_help = io.StringIO()
        with contextlib.redirect_stdout(mlx_help):
            code = _run_mlx_server_main(server, ["--help"])
        print(_without_option(mlx_help.getvalue(), "--allowed-origins"), end="")
        return code
    peek = _peek(passthrough)
    served_model = peek.model
    if served_model is None:
        from kvstore.demo import DEMO_NOTE, ensure_demo_model

        served_model = str(ensure_demo_model())
        passthrough = ["--model", served_model] + passthrough
        print(DEMO_NOTE, file=sys.stderr)
    if peek.host is None:
        passthrough = ["--host", "127.0.0.1"] + passthrough
    elif not _loopback(peek.host):
        print(f"kvstore serve: warning: listening on {peek.host}, not only on this machine: anyone who "
              "can reach this port can run the model and write to the store (mlx_lm.server has no "
              "authentication); use --host 127.0.0.1 unless that is what you want", file=sys.stderr)
    memory_bytes = ours.memory_bytes
    if memory_bytes is None and peek.prompt_cache_bytes is not None:
        try:
            from mlx_lm.utils import _parse_size  # mlx_lm.server's own reading of it

            memory_bytes = int(_parse_size(peek.prompt_cache_bytes))
        except Exception:
            memory_bytes = None  # mlx_lm.server will say what is wrong with it

    import kvstore

    try:
        store = kvstore.open(ours.store, max_bytes=ours.store_max_bytes, memory_bytes=memory_bytes,
                             remote=ours.remote)
    except KVStoreError as e:
        print(f"kvstore serve: {e}", file=sys.stderr)
        return 1
    from kvstore.serve.endpoints import handler_class
    from kvstore.serve.metrics import ServerMetrics

    cache = PersistentPromptCache(store, max_insert_tokens=ours.store_max_tokens)
    metrics = ServerMetrics(cache)

    def make_handler(base: type) -> type:
        return handler_class(base, cache, metrics, ours.allowed_origins, served_model)

    stopper = _Stopper(store)
    started: list = []
    code = 0
    try:
        stopper.install()
        with _persistent(server, cache, started, stopper.requests, make_handler):
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
        metrics.close()
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
