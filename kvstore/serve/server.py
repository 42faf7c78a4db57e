"""`kvstore serve`: `mlx_lm.server` with a persistent prompt cache.

`main()` runs the unmodified `mlx_lm.server.main()`; what changes is that its `ResponseGenerator`
is handed a `PersistentPromptCache` (see `promptcache`) instead of the `LRUPromptCache` that
`run()` made, and its HTTP handler is kvstore's subclass (see `endpoints`: `/metrics`,
`/kvstore/stats`, a `/v1/models` that lists the served model, no cross-origin requests unless
allowed, no prompt text in the log). The options are in `options`, the reach into mlx_lm.server
in `mlxserver`, SIGTERM and Ctrl-C in `signals`; this module starts and stops the server.

Run it as `kvstore serve [--store DIR] [--store-max-bytes SIZE|auto|none] [--memory-bytes SIZE]
[--store-max-tokens N] [--allowed-origins LIST] [--allowed-hosts LIST] [--stats-paths]
[--kv-events-config JSON] [--kv-events-block-size N] [--warm-top N] [mlx_lm.server options]` or
`python -m kvstore.serve ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import io
import json
import logging
import os
import re
import socket
import sys
from typing import Sequence

from kvstore import settings
from kvstore.argv import option_strings, remote_url, unknown_options, unrecognized
from kvstore.errors import InvalidInputError, KVStoreError
from kvstore.serve.mlxserver import persistent, server_module
from kvstore.serve.options import (
    DEFAULT_MAX_STORED_TOKENS,
    PROG,
    build_parser,
    check_port,
    is_loopback,
    peek_mlx_options,
    server_settings,
    without_option,
)
from kvstore.serve.promptcache import PersistentPromptCache
from kvstore.serve.signals import Stopper
from kvstore.serve.tenancy.policy import (
    UNNAMED,
    SharedWrites,
    TenantPolicy,
    describe_tenants,
    mark_tenants,
    serves_tenants,
    shared_bytes,
)
from kvstore.sizes import format_size, plural
from kvstore.store import Store
from kvstore.write.placement import REASONS

log = logging.getLogger("kvstore")

__all__ = ["DEFAULT_MAX_STORED_TOKENS", "PersistentPromptCache", "main", "run"]

_parser = build_parser  # kvstore serve's options, under the name tests read them by


def main(argv: Sequence[str] | None = None) -> int:
    """`kvstore serve`: mlx_lm.server with a `PersistentPromptCache`. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        ours, passthrough = parser.parse_known_args(args)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        server = server_module()
    except KVStoreError as e:
        print(f"kvstore serve: {e}", file=sys.stderr)
        return 1
    if ours.help:
        return _print_help(parser, server)
    known = option_strings(parser) + _mlx_options(server)
    if unknown_options(passthrough, known):  # else mlx_lm.server's usage, which lists no --store
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: {unrecognized(passthrough, known)}", file=sys.stderr)
        return 2
    peek = peek_mlx_options(passthrough)
    served_model, passthrough = _with_defaults(peek, passthrough)
    store_settings = settings.given(ours)
    try:
        memory_bytes = _memory_bytes(store_settings.pop("memory_bytes", None), peek.prompt_cache_bytes)
        check_port(peek.port)
        served = server_settings(ours)
        kv_events = _kv_events(served, peek, served_model)
        ours.remote = remote_url(ours)  # (a bare --remote: $KVSTORE_REMOTE, as for every command)
    except (KVStoreError, ValueError) as e:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2

    import kvstore
    from kvstore.model.loading import resolve_model

    try:
        if peek.model is not None:
            resolve_model(peek.model)  # a path that is no model folder: said before anything starts
        remote_key = None
        if ours.remote and ours.remote_key_file:
            from kvstore.remote.seal import read_key_file

            remote_key = read_key_file(ours.remote_key_file)
        store = kvstore.open(ours.store, memory_bytes=memory_bytes, remote=ours.remote,
                             remote_key=remote_key, kv_events=kv_events, defaults=settings.serve_defaults(),
                             **store_settings)
    except KVStoreError as e:
        print(f"kvstore serve: {e}", file=sys.stderr)
        return 1
    return _serve(server, store, served, passthrough, served_model)


def _print_help(parser: argparse.ArgumentParser, server) -> int:
    """kvstore's options, then mlx_lm.server's (without the one kvstore takes over)."""
    parser.print_help()
    print("\nmlx_lm.server options (--allowed-origins is kvstore's, above):")
    code, mlx_help = _mlx_help(server)
    print(without_option(mlx_help, "--allowed-origins"), end="")
    return code


def _mlx_help(server) -> tuple[int, str]:
    """(exit code, text) of `mlx_lm.server --help`: its parser is made inside its `main`."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = _call_main(server, ["--help"])
    return code, text.getvalue()


def _mlx_options(server) -> list[str]:
    """The options mlx_lm.server takes, as its help lists them."""
    return sorted(set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", _mlx_help(server)[1])))


def _with_defaults(peek: argparse.Namespace, passthrough: list[str]) -> tuple[str, list[str]]:
    """`(served model, mlx_lm.server's arguments)` with kvstore's defaults for --model and --host
    (the demo model; 127.0.0.1), and a warning when the host is reachable from elsewhere."""
    served_model = peek.model
    if served_model is None:
        from kvstore.demo import DEMO_NOTE, ensure_demo_model

        served_model = str(ensure_demo_model())
        passthrough = ["--model", served_model] + passthrough
        print(DEMO_NOTE, file=sys.stderr)
    if peek.host is None:
        passthrough = ["--host", "127.0.0.1"] + passthrough
    elif not is_loopback(peek.host):
        print(f"kvstore serve: warning: listening on {peek.host}, not only on this machine: anyone who "
              "can reach this port can run the model and write to the store (mlx_lm.server has no "
              "authentication); use --host 127.0.0.1 unless that is what you want", file=sys.stderr)
    return served_model, passthrough


def _kv_events(served: dict, peek: argparse.Namespace, served_model: str) -> dict | None:
    """`kv_events` for the store, from --kv-events-config and --kv-events-block-size, with the
    topic llm-d's guides use, `kv@HOST:PORT@MODEL`, unless the config names one. Warns when the
    events can be read from beyond this machine: they carry every stored prompt's token ids."""
    from kvstore.events import config as events_config

    if served["kv_events_config"] is None:
        if "kv_events_block_size" in served.get("given", ()):
            raise InvalidInputError("--kv-events-block-size goes with --kv-events-config (it is the block size "
                                    "of the KV events, which that option turns on)")
        return None
    given, flag = dict(served["kv_events_config"]), served["kv_events_block_size"]
    if "kv_events_block_size" in served.get("given", ()) and given.get("block_size", flag) != flag:
        raise InvalidInputError(f"--kv-events-block-size {flag} and --kv-events-config's \"block_size\": "
                                f"{json.dumps(given['block_size'])} differ: give the block size once")
    given.setdefault("block_size", flag)
    config = events_config.parse(given, "--kv-events-config")
    events_config.check_block_size(  # (the chunk size kvstore serve stores in)
        config, settings.CHUNK_SIZE, "--kv-events-config's block_size" if "block_size" in served["kv_events_config"]
        else "--kv-events-block-size")
    host = peek.host or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    config = config.with_defaults(topic=f"kv@{host}:{peek.port or 8080}@{served_model}")
    if not config.publishes:  # (vLLM is silent here; a router would wait for events that never come)
        why = ('"publisher" is "null"' if config.enable_kv_cache_events
               else 'it does not say "enable_kv_cache_events": true')
        print(f"kvstore serve: warning: --kv-events-config publishes nothing: {why}", file=sys.stderr)
    exposed = [a for a in (config.endpoint, config.replay_endpoint) if events_config.beyond_loopback(a)]
    if config.publishes and exposed:
        print(f"kvstore serve: warning: KV events go to {' and '.join(exposed)}, not only to this machine: "
              "they carry the token ids of every prompt the store holds (tenants' too); give the "
              "router's loopback or private address unless that is what you want", file=sys.stderr)
    return config.as_dict()


def _tenants_on(store: Store, tenants: TenantPolicy) -> TenantPolicy:
    """How this server tells tenants on `store`: a server serving tenants apart marks the store;
    a `--tenant-from none` server on a store that serves tenants serves its requests as one
    tenant of their own (the shared namespace would let every tenant reuse them), and says so.
    StoreOpenError when tenants are served and the store's tenant key cannot be read or made."""
    if tenants.active:
        store.tenant(UNNAMED)  # (the key, read now: one that cannot be would fail every request, one by one)
        mark_tenants(store)
        return tenants
    if not serves_tenants(store):
        return tenants
    store.tenant(UNNAMED)
    log.warning("kvstore: warning: this store serves tenants apart (it holds tenants' records, or a server "
                "with --tenant-from or --trust-client-salt has used it): this server's requests are stored "
                "as one tenant of their own, not as shared prompts every tenant would reuse; they still "
                "reuse the store's warmed and pinned prompts")
    return dataclasses.replace(tenants, unnamed=True)


def _memory_bytes(memory_bytes: int | None, prompt_cache_bytes: str | None) -> int | None:
    """--memory-bytes, else mlx_lm.server's --prompt-cache-bytes, else None (the store's default).
    A --prompt-cache-bytes that mlx_lm.server cannot read is a ValueError (it would stop with a
    traceback once the model is loaded)."""
    if prompt_cache_bytes is None:
        return memory_bytes
    from mlx_lm.utils import _parse_size  # mlx_lm.server's own reading of it

    try:
        parsed = int(_parse_size(prompt_cache_bytes))
    except Exception:
        raise ValueError(f"argument --prompt-cache-bytes: {prompt_cache_bytes!r} is not a size mlx_lm.server "
                         "reads: a number of bytes, or one with M, G, MB or GB (8GB, 500M)") from None
    return parsed if memory_bytes is None else memory_bytes


def _serve(server, store: Store, served: dict, passthrough: list[str], served_model: str) -> int:
    """Run mlx_lm.server on `store` until it stops; then stop its generation, flush and close."""
    from kvstore.serve import routing
    from kvstore.serve.endpoints import Hosts, handler_class
    from kvstore.serve.metrics import ServerMetrics
    from kvstore.serve.mlxserver import Waiting

    try:
        tenants = _tenants_on(store, served["tenants"])
    except KVStoreError as e:
        store.close()
        print(f"kvstore serve: cannot serve tenants: {e}", file=sys.stderr)
        return 1
    cache = PersistentPromptCache(store, max_insert_tokens=served["store_max_tokens"], tenants=tenants.active,
                                  shared_writes=None if tenants.active else SharedWrites())
    waiting = Waiting()
    metrics = ServerMetrics(cache, waiting, served_model)

    def on_start(cache: PersistentPromptCache) -> None:
        """Once the model is loaded, before the server listens (and once mlx_lm.server set up its
        logging: an info line before that is lost): say how tenants are served; with KV events,
        bind the model now (its records are announced at once, not at the first request), and
        warm the most-hit prompts (`--warm-top`)."""
        if tenants.active:
            shared = shared_bytes(store)
            log.info("kvstore: serving tenants apart (%s); shared prompts, which every tenant reuses, are what "
                     "the store holds without a tenant (%s: what `kvstore warm` and pins stored, and any request "
                     "a server without tenants stored here before)", describe_tenants(tenants),
                     "none" if not shared else format_size(shared))
            if served["admin_token"] is None:
                log.warning("kvstore: warning: GET /metrics and GET /kvstore/stats answer any client of this "
                            "port and show every tenant's requests, prompt tokens and bytes on disk (by tag) as "
                            "they change: keep them for the operator, with --admin-token-file or behind your proxy")
        if store.events is not None:
            cache.bind_served()
        if served["warm_top"]:
            routing.warm_top(cache, served["warm_top"])
    hosts = Hosts(peek_mlx_options(passthrough).host, served["allowed_hosts"])

    def make_handler(base: type) -> type:
        return handler_class(base, cache, metrics, served["allowed_origins"], served_model, hosts=hosts,
                             stats_paths=served["stats_paths"], tenants=tenants,
                             max_body_bytes=served["max_body_bytes"],
                             report_cached_tokens=served["report_cached_tokens"] == "on",
                             admin_token=served["admin_token"])

    stopper = Stopper(store)
    started: list = []
    code = 0
    try:
        stopper.install()
        with persistent(server, cache, started, stopper.requests, make_handler, on_start=on_start,
                        waiting=waiting):
            code = _run_mlx_server_main(server, passthrough)
    except KeyboardInterrupt:
        pass  # stopped before mlx_lm.server's own Ctrl-C handling was in place
    except KVStoreError as e:  # the model does not load
        print(f"kvstore serve: {e}", file=sys.stderr)
        code = 1
    except OSError as e:  # mostly: the port is taken
        print(f"kvstore serve: {_cannot_serve(e, passthrough)}", file=sys.stderr)
        code = 1
    finally:
        stopper.stopping = True  # a signal from here on must not interrupt the flush
        for generator in started:  # its thread is not a daemon: left running, the process would hang
            generator.stop_and_join()
        flushed, lost = True, {}
        if started:  # else nothing was served (the model did not load): no counts to give
            log.info("kvstore: flushing pending writes")
            # A flush that ran out of time on the remote's uploads has still put every write on
            # this machine's disk: only what the local writer still holds is not on disk.
            flushed = cache.flush() or store.writer.flush(0)
            lost = store.gate.held(lambda h: h in store.memory)
        metrics.close()
        store.close()
        if started:
            log.info("kvstore: %s", _final_counts(cache, flushed, lost))
        stopper.uninstall()
    return code


def _cannot_serve(e: OSError, passthrough: list[str]) -> str:
    """What an OSError from the HTTP server means, naming the address when it is about that."""
    unknown_host = isinstance(e, socket.gaierror)  # a --host that names no address
    if e.errno not in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL) and not unknown_host:
        return f"cannot serve: {e}"
    peek = peek_mlx_options(passthrough)
    where = f"{peek.host or '127.0.0.1'}:{peek.port or 8080}"  # mlx_lm.server's defaults
    hint = ""
    if e.errno == errno.EADDRINUSE:
        hint = "; another process is using that port: stop it, or pick another with --port"
    elif unknown_host:
        hint = "; give --host an IP address, or a name that resolves to one"
    return f"cannot listen on {where}: {e.strerror or e}{hint}"


def _run_mlx_server_main(server, args: list[str]) -> int:
    """Serve: mlx_lm.server's `main` with `args` (its help and options go through `_call_main`)."""
    return _call_main(server, args)


def _call_main(server, args: list[str]) -> int:
    saved = sys.argv
    sys.argv = [PROG, *args]
    try:
        server.main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def _final_counts(cache: PersistentPromptCache, flushed: bool, lost: dict[str, int]) -> str:
    """The last line: what was served, what this run wrote to disk (and failed to), what it did
    not upload to the remote, and what it kept in RAM only, which the exit loses."""
    c, w = cache.counters, cache.store.writer.stats
    said = [f"stopped: {plural(c['requests'], 'request')}, {plural(c['prompt_tokens'], 'prompt token')}, "
            f"{c['reused_tokens']} reused from the store; written to disk: {plural(w.records_written, 'record')} "
            f"({format_size(w.bytes_written)})"]
    if w.write_errors or w.dropped_jobs:
        said.append(f"{plural(w.write_errors, 'write')} failed and {plural(w.dropped_jobs, 'insert')} dropped "
                    f"(a full queue), not on disk" + (f" (last: {w.last_error})" if w.last_error else ""))
    if not flushed:
        said.append("the flush did not finish: what was still queued is not on disk")
    remote = cache.store.remote
    undone = sum(remote.not_uploaded().values()) if remote is not None else 0
    if undone:  # no later process uploads them
        said.append(f"{plural(undone, 'upload')} to the remote not done: those records are on this machine's disk only")
    if lost:
        n = sum(lost.values())
        said.append(f"{plural(n, 'record')} kept in RAM only {'is' if n == 1 else 'are'} not on disk, lost now ("
                    + ", ".join(f"{REASONS.get(k, k)}: {n}" for k, n in lost.items()) + ")")
    return "; ".join(said)


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
