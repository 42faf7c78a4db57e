"""The `kvstore` command: warm, generate, gc, stats, verify, serve.

Each command opens the store, calls the library, prints. Failures the user can fix (a bad path, a
bad line, a store that cannot be opened) are one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvstore.errors import CorruptIndexError, KVStoreError
from kvstore.model import jsonl
from kvstore.sizes import format_age, format_size, parse_duration, parse_size

PROG = "kvstore"
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
DEFAULT_CONTEXT = 1 << 20  # when a model's config names no context length
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length",
                "seq_length", "n_ctx")


class CommandError(Exception):
    """A failure reported as one line on stderr, with an exit code."""

    def __init__(self, message: str, code: int = EXIT_PROBLEMS):
        super().__init__(message)
        self.code = code


def printable(text: Any) -> str:
    """`text` with every non-printable character escaped (`\\x1b`, `\\u202e`): ids, model ids,
    paths and field names come from users and files, and must not drive the terminal."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else _escape(c) for c in s)


def _escape(c: str) -> str:
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def say(*parts: Any) -> None:
    """One line on stderr, escaped."""
    print(*map(printable, parts), file=sys.stderr, flush=True)


def out(*parts: Any, **kw: Any) -> None:
    """One line on stdout, escaped (everything but generated text goes through here)."""
    print(*map(printable, parts), **kw)


# -- shared helpers ---------------------------------------------------------------------------

@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    model_id: str  # what the store records: an absolute folder or a repo id
    vocab_size: int | None
    context: int


def resolve_model(spec: str | None) -> str:
    """What to load for `--model`: a local folder (checked now), a repo id, or the demo model."""
    from kvstore.demo import DEMO_NOTE, ensure_demo_model

    if spec is None:
        path = ensure_demo_model()  # the same default as `kvstore serve`
        say(DEMO_NOTE)
        return str(path)
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise CommandError(f"model folder {spec} has no config.json: is it an mlx-lm model?")
        return str(path.resolve())
    if _looks_like_path(spec):
        raise CommandError(f"model path {spec} does not exist (pass a model folder or a Hugging Face repo id)")
    return spec


def load_model(model_id: str) -> LoadedModel:
    """Load a model with mlx-lm, with its vocabulary size and context length."""
    import mlx_lm

    try:
        model, tokenizer, config = mlx_lm.load(model_id, return_config=True)
    except Exception as e:  # mlx-lm raises many kinds; all mean "this model cannot be used"
        detail = " ".join(str(e).split())  # one line, whatever the library wrote
        raise CommandError(f"cannot load model {model_id}: {detail}") from e
    configs = [config, config.get("text_config") or {}]
    vocab = next((c["vocab_size"] for c in configs if isinstance(c.get("vocab_size"), int)), None)
    if vocab is None:
        try:
            vocab = len(tokenizer.get_vocab())
        except Exception:
            vocab = None
    context = next((c[k] for c in configs for k in CONTEXT_KEYS if isinstance(c.get(k), int)), DEFAULT_CONTEXT)
    return LoadedModel(model, tokenizer, model_id, vocab, context)


def _looks_like_path(spec: str) -> bool:
    """A Hugging Face repo id is `owner/name`; anything else that is not on disk is a bad path."""
    return spec.startswith((".", "/", "~")) or "\\" in spec or spec.count("/") != 1 or spec.endswith("/")


def read_prompts(path: str) -> list:
    """Every line of a prompt file, parsed (`jsonl.PromptLine` or `jsonl.LineError`)."""
    try:
        return list(jsonl.read(path))
    except OSError as e:
        raise CommandError(f"cannot read the prompt file {path}: {e.strerror or e}") from e


def store_path(args) -> Path:
    import kvstore

    return Path(args.store).expanduser() if args.store else kvstore.default_path()


def open_store(args, *, must_exist: bool = False, read_only: bool | None = False):
    """Open `--store` (default `$KVSTORE_DIR`, then `~/.cache/kvstore`). `must_exist`: create
    nothing (a folder that is not a store is refused either way); `read_only=None`: read-only
    when this user may not write the store."""
    import kvstore

    # A store whose index was lost still has its blobs: kvstore.open says how to rebuild it.
    return kvstore.open(store_path(args), create=not must_exist, read_only=read_only,
                        remote=remote_url(args))


def remote_url(args) -> str | None:
    """`--remote URL`, else `$KVSTORE_REMOTE` (also for a bare `--remote`), else None."""
    import os

    url = getattr(args, "remote", None) or os.environ.get("KVSTORE_REMOTE") or None
    if url is None and getattr(args, "remote", None) is not None:
        raise CommandError("--remote needs a URL (s3://BUCKET/PREFIX) or $KVSTORE_REMOTE", EXIT_USAGE)
    return url


def prepare(items: list, loaded: LoadedModel) -> tuple[list, list]:
    """Tokenize the prompt lines and check them against the model: (good, errors)."""
    good, errors = [], []
    for item in items:
        if isinstance(item, jsonl.LineError):
            errors.append(item)
            continue
        too_long = jsonl.check_length(item, loaded.context)  # before tokenizing: cheap, bounded
        if too_long is not None:
            errors.append(jsonl.LineError(item.source, item.line, *too_long))
            continue
        try:
            tokens = jsonl.tokenize(item, loaded.tokenizer)
        except Exception as e:  # a chat template can raise anything (jinja errors, KeyError, ...)
            errors.append(jsonl.LineError(item.source, item.line, item.kind, f"cannot be tokenized: {e}"))
            continue
        problem = None
        if len(tokens) == 0:
            problem = (item.kind, "gives no tokens")
        elif loaded.vocab_size is not None:
            problem = jsonl.check_vocab(tokens, loaded.vocab_size)
        if problem is None and len(tokens) > loaded.context:
            problem = (item.kind, f"skipped: {len(tokens)} tokens is longer than the model's context "
                                  f"({loaded.context} tokens)")
        if problem is not None:
            errors.append(jsonl.LineError(item.source, item.line, *problem))
        else:
            good.append((item, tokens))
    return good, errors


# -- warm -------------------------------------------------------------------------------------

@contextlib.contextmanager
def _bound(args, items: list, command: str):
    """The store, the loaded model, its `ModelCache`, and the prompts tokenized: (item, tokens)
    pairs and the errors of the bad ones (already reported)."""
    model_id = resolve_model(args.model)
    with open_store(args) as store:
        loaded = load_model(model_id)
        mc = store.bind(loaded.model, loaded.model_id)
        work, errors = prepare(items, loaded)
        for e in errors:
            say(f"{PROG} {command}: {e}")
        yield store, loaded, mc, work, errors


class _Stop(Exception):
    """Ctrl-C was pressed: stop at the next chunk boundary."""


def cmd_warm(args) -> int:
    items = read_prompts(args.prompts)
    with _bound(args, items, "warm") as (store, loaded, mc, work, errors):
        totals = {"done": 0, "reused": 0, "computed": 0}
        started = time.perf_counter()
        interrupted = False
        stop_requested = False

        def on_sigint(signum, frame):
            nonlocal stop_requested
            if stop_requested:
                raise KeyboardInterrupt
            stop_requested = True
            say(f"{PROG} warm: stopping after the current chunk (Ctrl-C again to stop at once)")

        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            _warm_all(mc, work, totals, lambda: stop_requested)
        except (_Stop, KeyboardInterrupt):
            interrupted = True
        finally:
            signal.signal(signal.SIGINT, previous)
        store.flush()
        stats = store.stats()
        writer = stats["writer"]
        if interrupted:
            say(f"{PROG} warm: interrupted; everything stored so far is kept")
        print(f"prompts: {totals['done']} warmed, {len(errors)} skipped (bad lines), "
              f"{len(work) - totals['done']} not reached")
        print(f"tokens reused: {totals['reused']}")
        print(f"tokens computed: {totals['computed']}")
        print(f"bytes written: {writer['bytes_written']} ({format_size(writer['bytes_written'])}, "
              f"{writer['records_written']} records)")
        print(f"time: {time.perf_counter() - started:.1f} s")
        if writer["dropped_jobs"] or writer["write_errors"]:
            say(f"{PROG} warm: {writer['dropped_jobs']} inserts were dropped and {writer['write_errors']} "
                f"writes failed (last error: {writer['last_error'] or 'none'})")
            return EXIT_PROBLEMS
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_PROBLEMS if errors else 0


def _warm_all(mc, work: list, totals: dict, stop: Callable[[], bool]) -> None:
    """Prefill each prompt, with a progress bar on a terminal and a log line per prompt otherwise."""
    bars = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bars = (tqdm(total=len(work), desc="prompts", unit="prompt", position=0, file=sys.stderr, dynamic_ncols=True),
                tqdm(total=sum(len(t) for _, t in work), desc="tokens", unit="tok", unit_scale=True, position=1,
                     file=sys.stderr, dynamic_ncols=True))

    current = {"computed": 0}  # tokens computed for the prompt in progress

    def progress(n: int) -> None:
        totals["computed"] += n
        current["computed"] += n
        if bars:
            bars[1].update(n)
        if stop():
            raise _Stop

    try:
        for i, (item, tokens) in enumerate(work, start=1):
            if stop():
                raise _Stop
            t0 = time.perf_counter()
            current["computed"] = 0
            try:
                _, reused, computed = mc.prefill(tokens, progress=progress, pin=item.pin)
            except (_Stop, KeyboardInterrupt):
                # Stopped after the prompt's last chunk was inserted: it is stored whole, so it
                # counts as warmed, not as "not reached".
                if mc.stored_length(tokens) >= len(tokens):
                    totals["done"] += 1
                    totals["reused"] += len(tokens) - current["computed"]
                raise
            totals["done"] += 1
            totals["reused"] += reused
            if bars:
                bars[0].update(1)
                bars[1].update(reused)
            else:
                say(f"[{i}/{len(work)}] {item.where}: {len(tokens)} tokens, {reused} reused, "
                    f"{computed} computed{', pinned' if item.pin else ''} ({time.perf_counter() - t0:.1f} s)")
    finally:
        if bars:
            for bar in bars:
                bar.close()


# -- generate ---------------------------------------------------------------------------------

def cmd_generate(args) -> int:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    if args.prompt is not None:
        items = [jsonl.parse_object({"prompt": args.prompt}, "--prompt", None)]
    elif args.messages is not None:
        try:
            value = json.loads(args.messages)
        except json.JSONDecodeError as e:
            raise CommandError(f"--messages: not valid JSON ({e.msg} at column {e.colno})") from e
        # Always the list itself: a lone {"role": ...} object is an error that says so.
        items = [jsonl.parse_object({"messages": value}, "--messages", None)]
    else:
        items = read_prompts(args.prompts)
    if args.prompts is None and isinstance(items[0], jsonl.LineError):  # no model to load for nothing
        raise CommandError(str(items[0]))
    if args.max_tokens < 1:
        raise CommandError(f"--max-tokens must be at least 1, got {args.max_tokens}", EXIT_USAGE)
    with _bound(args, items, "generate") as (store, loaded, mc, work, errors):
        if args.seed is not None:
            mx.random.seed(args.seed)
        sampler = make_sampler(temp=args.temp)
        failed = 0
        for item, tokens in work:
            if args.prompts is not None:
                out(f"[{item.id if item.id is not None else item.where}]", flush=True)
            t0 = time.perf_counter()
            cache, rest, reused = _prompt_cache(mc, tokens)
            ttft, generated, finish = None, [], None
            for response in stream_generate(loaded.model, loaded.tokenizer, rest, max_tokens=args.max_tokens,
                                            prompt_cache=cache, sampler=sampler):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                print(response.text, end="", flush=True)
                generated.append(response.token)
                finish = response.finish_reason
            print(flush=True)
            before = _write_problems(store)
            stored = _insert_generated(mc, tokens, generated, cache)
            store.flush()  # to know whether it was stored, not only queued
            problem = _write_problems(store) != before
            if problem:
                failed += 1
                stored_text = f"not stored ({_write_error(store)})"
            else:
                stored_text = f"stored {stored} tokens"
            say(f"prompt: {len(tokens)} tokens, {reused} reused from the store, "
                f"{len(tokens) - reused} computed; time to first token: {ttft:.3f} s; "
                f"generated {len(generated)} tokens ({finish}); {stored_text}")
        if failed:
            say(f"{PROG} generate: {failed} of {len(work)} generations were not stored: "
                f"{_write_error(store)}")
    return EXIT_PROBLEMS if errors or failed else 0


def _write_problems(store) -> tuple[int, int, int]:
    """Counters that go up when an insert does not reach the disk (no SQL: they are this
    process's writer counters, the ones `stats()["writer"]` reports)."""
    w = store.writer.stats
    return w.write_errors, w.dropped_jobs, store.counters.get("skipped_inserts", 0)


def _write_error(store) -> str:
    """What went wrong with the last write, in a few words."""
    w = store.writer.stats
    if w.last_error:
        return f"the write failed: {w.last_error}"
    if w.dropped_jobs:
        return "the write queue was full"
    return "the store's index cannot be written"


def _prompt_cache(mc, tokens) -> tuple[list, list[int], int]:
    """(cache, tokens left for generation, tokens reused from the store) for a prompt.

    Recurrent layers restore only where a checkpoint was stored, and the final insert stores one
    after the generated text: so the prompt (but its last token) is prefilled and stored first,
    which lets the same prompt resume from the store next time.
    """
    if mc.checkpointed and len(tokens) > 1:
        cache, reused, _ = mc.prefill(tokens[:-1])
        if cache is not None:
            return cache, [int(tokens[-1])], reused
    cache, rest = mc.fetch(tokens)
    return cache, rest, len(tokens) - len(rest)


def _insert_generated(mc, prompt, generated: list[int], cache: list) -> int:
    """Insert exactly the tokens the cache has processed: the prompt and what was generated.

    mlx-lm feeds each token back before handing it out, so the cache usually holds them all; the
    layers that count their tokens say for sure (recurrent layers do not count).
    """
    import numpy as np

    sequence = np.concatenate([np.asarray(prompt, dtype=np.int32), np.asarray(generated, dtype=np.int32)])
    offsets = {codec.offset(layer) for codec, layer in zip(mc.codecs, cache)} - {None}
    held = offsets.pop() if len(offsets) == 1 else (len(sequence) if not offsets else None)
    if held is None or not 0 < held <= len(sequence):
        say(f"{PROG} generate: not stored: the cache holds {held} tokens, the sequence has {len(sequence)}")
        return 0
    mc.insert(sequence[:held], cache)
    return held


# -- gc, stats, verify ------------------------------------------------------------------------

def cmd_gc(args) -> int:
    if args.max_bytes is None and args.max_age is None and not args.stale:
        raise CommandError("gc needs --max-bytes and/or --max-age (or --stale)", EXIT_USAGE)
    if args.remote is not None:
        return _gc_remote(args)
    with open_store(args, must_exist=True) as store:
        result = store.gc(max_bytes=args.max_bytes, max_age=args.max_age, dry_run=args.dry_run,
                          stale=args.stale)
    verb, holds = ("would free", "would hold") if args.dry_run else ("freed", "holds")
    print(f"{verb} {format_size(result['freed_bytes'])} ({result['freed_bytes']} bytes, "
          f"{result['evicted']} records); the store {holds} {format_size(result['bytes'])} "
          f"(was {format_size(result.get('bytes_before', result['bytes'] + result['freed_bytes']))})")
    if args.max_bytes is not None and result["bytes"] > args.max_bytes:
        say(f"{PROG} gc: still above the budget of {args.max_bytes} bytes: pinned records and their ancestors are kept")
    return 0


def _gc_remote(args) -> int:
    """`gc --remote`: bound the bucket, deepest records first; pins of every node are kept."""
    with open_store(args) as store:
        result = store.remote.gc(max_bytes=args.max_bytes, max_age=args.max_age, dry_run=args.dry_run)
    verb, holds = ("would delete", "would hold") if args.dry_run else ("deleted", "holds")
    print(f"remote {store.remote.url}: {verb} {result['evicted']} objects ({format_size(result['freed_bytes'])}); "
          f"the bucket {holds} {result['records']} records, {format_size(result['bytes'])} "
          f"({result['kept_pinned']} pinned records kept)")
    return 0


def cmd_stats(args) -> int:
    with open_store(args, must_exist=True, read_only=None) as store:
        stats = store.stats()
    if args.json:
        print(json.dumps({**stats, "scope": stats_scope(stats)}, indent=2, sort_keys=True, default=str))
        return 0
    out(f"store: {stats['path']}")
    print(f"bytes: {stats['bytes']} ({format_size(stats['bytes'])})   chunks: {stats['chunks']}   "
          f"tails: {stats['tails']}   models: {len(stats['models'])}   chunk size: {stats['chunk_size']}")
    remote = stats.get("remote")
    if remote:
        t = remote["totals"]
        print(f"remote: {remote['url']}   uploads: {t['uploads']} ({format_size(t['upload_bytes'])})   "
              f"downloads: {t['downloads']} ({format_size(t['download_bytes'])})   remote hits: {t['remote_hits']}   "
              f"errors: {t['errors']}   dropped uploads: {t['dropped_uploads']}   deadline misses: {t['deadline_misses']}")
    now_bad = stats.get("quarantined_now") or {}
    if stats.get("quarantined_total") or now_bad.get("records"):
        print(f"quarantined records: {now_bad.get('records', 0)} now ({format_size(now_bad.get('bytes', 0))}, "
              f"never served; any `{PROG} gc` drops those not pinned, storing the prompt again heals "
              f"it), {stats.get('quarantined_total', 0)} so far (run `{PROG} verify`)")
    moved = stats.get("quarantine_folder") or {}
    if moved.get("files"):
        out(f"{stats['path']}/quarantine: {moved['files']} file{'s' if moved['files'] != 1 else ''} "
            f"({format_size(moved['bytes'])}) that "
            f"`{PROG} verify --repair` moved aside (not kvstore's; never deleted by kvstore: look, then remove them)")
    if not stats["models"]:
        return 0
    now = time.time()
    header = ("fingerprint", "chunks", "tails", "bytes", "hits", "last use", "stale", "model")
    rows = [(m["fingerprint"][:12], str(m["chunks"]), str(m["tails"]), format_size(m["bytes"]), str(m["hits"]),
             f"{format_age(now - m['last_used'])} ago" if m.get("last_used") else "never",
             {True: "STALE", False: "no", None: "?"}[m.get("stale")], m["model_id"])
            for m in stats["models"]]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    print()
    for row in [header, *rows]:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out("  ".join(cells + [row[-1]]))
    held = sum(m["bytes"] for m in stats["models"] if m.get("stale"))
    if held:
        out(f"\nSTALE: {format_size(held)} of K/V whose model files changed or are gone since they were stored; "
              f"`{PROG} gc --stale` evicts it (pins aside)")
    return 0


# What `stats --json` counts: totals of the store on disk (the same in every process that opens
# it), or counters of this one process (the `kvstore stats` process itself: its memory tier, its
# writer, what it fetched, and the settings it opened the store with). A key missing here is
# reported as "unknown" rather than guessed.
STORE_TOTALS = ("path", "bytes", "chunks", "tails", "checkpoints", "models", "quarantined_total",
                "quarantined_now", "quarantine_folder")
PER_PROCESS = ("chunk_size", "max_bytes", "memory", "writer", "quarantined", "skipped_inserts",
               "fetches", "reused_tokens", "read_only", "max_bytes_auto", "max_bytes_rule")


# `remote`: this process's counters, and under `totals` the store's (kept in its index).
MIXED = {"remote": "process; its totals: store"}


def stats_scope(stats: dict) -> dict[str, str]:
    """`{key: "store" | "process" | ... | "unknown"}` for every top-level key of `store.stats()`."""
    return {key: "store" if key in STORE_TOTALS else "process" if key in PER_PROCESS
            else MIXED.get(key, "unknown") for key in stats}


def cmd_verify(args) -> int:
    rebuilt = None
    if args.remote is not None:
        return _verify_remote(args)
    try:
        with open_store(args, must_exist=True, read_only=None if not args.repair else False) as store:
            problems = store.verify(repair=args.repair, force=args.force)
    except CorruptIndexError as e:  # the index itself is unreadable (or lost): rebuild it from the blobs
        if not args.repair:
            raise
        from kvstore.upkeep.rebuild import rebuild_index

        say(f"{PROG} verify: {e}")
        rebuilt = rebuild_index(store_path(args))
        say(f"{PROG} verify: rebuilt the index from the blob files: {rebuilt['records']} records, "
            f"{len(rebuilt['skipped'])} files not taken back"
            + (f"; the damaged index is kept as {rebuilt['damaged_index']}" if rebuilt["damaged_index"] else ""))
        with open_store(args, must_exist=True) as store:
            problems = store.verify(repair=True, force=args.force)
    if args.json:
        print(json.dumps({"clean": not problems and rebuilt is None,
                          "repaired": bool(args.repair and (problems or rebuilt)),
                          "rebuilt": rebuilt, "problems": [p.to_dict() for p in problems]}, indent=2))
    else:
        for p in problems:
            out(p)
        if not problems:
            print("the store is clean")
        else:
            print(f"{len(problems)} problem{'s' if len(problems) != 1 else ''} found"
                  + ("; repaired" if args.repair else f"; run `{PROG} verify --repair` to fix them"))
    return EXIT_PROBLEMS if problems or rebuilt else 0


def _verify_remote(args) -> int:
    """`verify --remote`: download and check every object of the bucket."""
    with open_store(args) as store:
        problems = store.remote.verify(repair=args.repair)
    if args.json:
        print(json.dumps({"clean": not problems, "repaired": bool(args.repair and problems),
                          "problems": [p.to_dict() for p in problems]}, indent=2))
    else:
        for p in problems:
            print(p)
        print(f"remote {store.remote.url}: " + ("clean" if not problems else
              f"{len(problems)} problem{'s' if len(problems) != 1 else ''} found"
              + ("; repaired" if args.repair else f"; run `{PROG} verify --remote --repair` to delete them")))
    return EXIT_PROBLEMS if problems else 0


# -- serve ------------------------------------------------------------------------------------

SERVE_HELP = """usage: kvstore serve [--store DIR] [mlx_lm.server options]

Run mlx_lm.server with a prompt cache kept in the store. Everything after `serve` goes to
kvstore.serve.server, whose help lists its options.

example:
  kvstore serve --store ~/.cache/kvstore --model mlx-community/Qwen3-4B-4bit --port 8080
"""


def cmd_serve(argv: list[str]) -> int:
    """Hand the arguments to `kvstore.serve.server.main`, which owns the server's options."""
    try:
        from kvstore.serve import server
    except ImportError as e:
        if any(a in ("-h", "--help") for a in argv):
            print(SERVE_HELP)
            return 0
        raise CommandError(f"kvstore serve is not available: cannot import kvstore.serve.server ({e})", EXIT_USAGE) from e
    code = server.run(argv)  # exits the process itself (see kvstore.serve.server.run)
    return code if isinstance(code, int) else 0


# -- argument parsing -------------------------------------------------------------------------

def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


EXAMPLES = {
    "warm": """examples:
  kvstore warm --prompts examples/prompts.jsonl
  kvstore warm --prompts prompts.jsonl --model mlx-community/Qwen3-4B-4bit --store ~/kv
  cat prompts.jsonl | kvstore warm --prompts -

Each line is {"prompt": "..."}, {"messages": [{"role": ..., "content": ...}]} or {"tokens": [...]},
with optional "id" and "pin": true. Exit code 1 if a line was bad (it is skipped, the others are
stored), 130 after Ctrl-C (everything stored so far is kept).""",
    "generate": """examples:
  kvstore generate --prompt "You are a helpful assistant. What is a KV cache?"
  kvstore generate --messages '[{"role": "user", "content": "Hello"}]' --max-tokens 64
  kvstore generate --prompts examples/prompts.jsonl --model ./my-model

Run it twice: the second run reuses the stored prompt (see "reused from the store" on stderr).""",
    "gc": """examples:
  kvstore gc --max-bytes 2GiB
  kvstore gc --max-bytes 500MB --max-age 7d --dry-run
  kvstore gc --remote s3://team-cache/kv --max-age 7d     # the shared bucket, deepest first

SIZE: bytes, or a number with KB/MB/GB/TB (x1000) or K/M/G/T, KiB/MiB/GiB/TiB (x1024).
DURATION: a number with s, m, h, d or w, like 30m, 12h, 7d. Pinned prompts are never evicted.""",
    "stats": """examples:
  kvstore stats
  kvstore stats --store ~/kv --json""",
    "verify": """examples:
  kvstore verify
  kvstore verify --repair
  kvstore verify --remote --repair                         # check every object of $KVSTORE_REMOTE

Exit code 0 when the store is clean, 1 when problems were found (also when they were repaired).""",
}


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=raw,
        description="A persistent, on-disk prompt-cache store for MLX language models.",
        epilog="""examples:
  kvstore warm --prompts examples/prompts.jsonl      # store the KV cache of known prompts
  kvstore generate --prompt "Hello"                  # generate, reusing and growing the store
  kvstore stats                                      # what is stored, per model
  kvstore gc --max-bytes 2GiB                        # keep the store within a budget

`kvstore COMMAND --help` shows each command's options. Without --model, commands use a built-in
demo model with random weights (meaningless text).""")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    store_opts = argparse.ArgumentParser(add_help=False)
    store_opts.add_argument("--store", metavar="DIR",
                            help="store directory (default: $KVSTORE_DIR, else ~/.cache/kvstore)")
    store_opts.add_argument("--remote", metavar="URL", nargs="?", const="",
                            help="share the store through an S3 bucket, s3://BUCKET/PREFIX (default: "
                                 "$KVSTORE_REMOTE); gc and verify act on the bucket when it is given")
    model_opts = argparse.ArgumentParser(add_help=False)
    model_opts.add_argument("--model", metavar="M",
                            help="model folder or Hugging Face repo id, as mlx_lm.load takes "
                                 "(default: the built-in demo model, random weights)")

    def add(name: str, handler, help_text: str, parents: list) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=parents, help=help_text, description=help_text,
                           epilog=EXAMPLES[name], formatter_class=raw)
        p.set_defaults(handler=handler)
        return p

    p = add("warm", cmd_warm, "store the KV cache of every prompt in a JSONL file", [store_opts, model_opts])
    p.add_argument("--prompts", metavar="FILE.jsonl", required=True, help="prompt file, or - for standard input")

    p = add("generate", cmd_generate, "generate text, reusing the store and adding to it", [store_opts, model_opts])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="prompt text, tokenized as is")
    source.add_argument("--messages", metavar="JSON",
                        help='chat messages as JSON, like \'[{"role": "user", "content": "Hi"}]\' (chat template applied)')
    source.add_argument("--prompts", metavar="FILE.jsonl", help="generate for every line of a prompt file (- for stdin)")
    p.add_argument("--max-tokens", metavar="N", type=int, default=128, help="tokens to generate at most (default: 128)")
    p.add_argument("--temp", metavar="T", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    p.add_argument("--seed", metavar="S", type=int, help="random seed for sampling")

    p = add("gc", cmd_gc, "evict least recently used records down to a size (and age) budget", [store_opts])
    p.add_argument("--max-bytes", metavar="SIZE", type=_size, help="keep at most this many bytes, like 500MB or 2GiB")
    p.add_argument("--max-age", metavar="DURATION", type=_duration, help="also evict records unused for this long, like 7d")
    p.add_argument("--stale", action="store_true",
                   help="evict model versions whose files are gone or changed (pins aside); a budget evicts them first anyway")
    p.add_argument("--dry-run", action="store_true", help="only report what would be freed")

    p = add("stats", cmd_stats, "show totals and a table per model", [store_opts])
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (bytes, chunks, tails, models, ...); its \"scope\" map says "
                        "which keys are totals of the store and which count this process only")

    p = add("verify", cmd_verify, "check every record against its file, and every file against the index", [store_opts])
    p.add_argument("--repair", action="store_true",
                   help="drop damaged records and stray files; rebuild an unreadable index from the blobs")
    p.add_argument("--force", action="store_true",
                   help="with --repair: delete orphan blobs even when they are more than 10%% of the store")
    p.add_argument("--json", action="store_true", help="print the problems as JSON")

    # `serve` is dispatched before parsing (its options belong to the server); listed here for --help.
    sub.add_parser("serve", help="run an mlx-lm server backed by the store (kvstore serve --help)", add_help=False)
    return parser


def _version() -> str:
    from kvstore import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        return _run(lambda: cmd_serve(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return _run(lambda: args.handler(args))


def _run(command: Callable[[], int]) -> int:
    try:
        return command()
    except CommandError as e:
        say(f"{PROG}: error: {e}")
        return e.code
    except KVStoreError as e:
        say(f"{PROG}: error: {e}")
        return EXIT_PROBLEMS
    except BrokenPipeError:  # the reader of our output went away (`kvstore stats | head`): go quiet
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_PROBLEMS
    except OSError as e:
        say(f"{PROG}: error: {_os_message(e)}")
        return EXIT_PROBLEMS
    except KeyboardInterrupt:
        say(f"{PROG}: interrupted")
        return EXIT_INTERRUPTED


def _os_message(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
