"""`kvstore warm`: store the KV cache of every prompt of a JSONL file."""

from __future__ import annotations

import signal
import sys
import time
from typing import Callable

from kvstore.cli.options import PROMPT_FILE, add_store_settings, bound, read_prompts
from kvstore.cli.output import (
    EXIT_INTERRUPTED,
    EXIT_PROBLEMS,
    PROG,
    FirstCtrlC,
    disk_budget,
    on_store,
    plural,
    remote_tokens,
    say,
    uploads_undone,
    write_error,
    write_problems,
)
from kvstore.model.blas import long_prefill_note
from kvstore.model.jsonl import cache_types
from kvstore.sizes import format_size

EXAMPLES = """examples:
  kvstore warm --prompts examples/prompts.jsonl
  kvstore warm --prompts prompts.jsonl --model mlx-community/Qwen3-4B-4bit --store ~/kv
  cat prompts.jsonl | kvstore warm --prompts -

Each line is {"prompt": "..."}, {"messages": [{"role": ..., "content": ...}]} or {"tokens": [...]},
with optional "id" and "pin": true ("pin": false unpins a prompt pinned before; a line with no
"pin" leaves its pins as they are). A messages line's leading system messages are stored as a
"system" prompt, which a disk budget evicts last. Exit code 1 if a line was bad (it is skipped, the others are
stored), 130 after Ctrl-C (everything stored so far is kept)."""


def register(add, store_opts, model_opts) -> None:
    p = add("warm", cmd_warm, "store the KV cache of every prompt in a JSONL file", [store_opts, model_opts],
            EXAMPLES)
    p.add_argument("--prompts", metavar="FILE.jsonl", required=True, type=PROMPT_FILE, help="prompt file, or - for standard input")
    add_store_settings(p)


class _Stop(Exception):
    """Ctrl-C was pressed: stop at the next chunk boundary."""


def cmd_warm(args) -> int:
    items = read_prompts(args.prompts)
    with bound(args, items, "warm") as (store, loaded, mc, work, errors):
        if store.remote is not None:  # what uploads were left undone is said once, in the last lines
            store.remote.say_undone = False
        totals = {"done": 0, "reused": 0, "computed": 0, "warmed": [], "from_bucket": 0}
        started = time.perf_counter()
        interrupted = False
        ctrl_c = FirstCtrlC("warm", "the current chunk")
        previous = signal.signal(signal.SIGINT, ctrl_c)
        try:
            _warm_all(mc, work, totals, lambda: ctrl_c.requested, loaded.tokenizer, lambda: _write_failure(store),
                      lambda: remote_tokens(store))
        except (_Stop, KeyboardInterrupt):
            interrupted = True
        finally:
            signal.signal(signal.SIGINT, previous)
        store.flush()
        writer = store.stats()["writer"]
        if interrupted:
            say(f"{PROG} warm: interrupted; everything stored so far is kept")
        placed = placed_now(mc, totals, _write_failure(store))
        if totals.get("cut") is not None:  # (nothing of it stored: not reached, as the others)
            cut = mc.placement(totals["cut"])
            stored = cut.on_disk + cut.queued
            totals["cut"] = f", 1 cut short ({stored} of its {cut.tokens} tokens stored)" if stored else ""
        _summary(totals, len(errors), len(work), writer, time.perf_counter() - started, placed,
                 store.remote.url if store.remote is not None else None)
        budget = disk_budget(store, on_store(args))
        if budget:
            print(budget)
        if store.remote is not None:
            print(_bucket_traffic(store.remote))
        undone = uploads_undone(store)
        if undone:
            print(f"remote: {undone}")
        if writer["dropped_jobs"] or writer["write_errors"]:
            lost = [f"{plural(writer['write_errors'], 'write')} failed (last error: {writer['last_error']})"
                    if writer["write_errors"] else "",
                    f"{plural(writer['dropped_jobs'], 'insert')} dropped (the write queue was full)"
                    if writer["dropped_jobs"] else ""]
            say(f"{PROG} warm: {' and '.join(filter(None, lost))}: what they held is not on disk")
            return EXIT_PROBLEMS
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_PROBLEMS if errors else 0


def _summary(totals: dict, skipped: int, planned: int, writer: dict, seconds: float, placed: list,
             url: str | None = None) -> None:
    cut = totals.get("cut") or ""
    print(f"prompts: {totals['done']} warmed, {skipped} skipped (bad lines){cut}, "
          f"{planned - totals['done'] - bool(cut)} not reached")
    bucket = totals.get("from_bucket", 0)
    print(f"tokens reused: {totals['reused']}" + (f" ({bucket} from the bucket {url}, {totals['reused'] - bucket} "
                                                  "from the local store)" if url and bucket else ""))
    print(f"tokens computed: {totals['computed']}")
    whole = sum(p.on_disk == p.tokens for p in placed)
    print(f"on disk: {whole} of {len(placed)} warmed prompts whole; "
          f"{sum(p.on_disk for p in placed)} of {sum(p.tokens for p in placed)} tokens"
          + ("" if whole == len(placed) else
             f" ({sum(p.in_ram for p in placed)} not on disk: {_reasons(placed)})"))
    print(f"bytes written: {writer['bytes_written']} ({format_size(writer['bytes_written'])}, "
          f"{plural(writer['records_written'], 'record')})")
    print(f"time: {seconds:.1f} s")


def placed_now(mc, totals: dict, failure: str = "") -> list:
    """Where each warmed prompt's records are now, for the summary. Tokens a prompt's own line
    found on disk in a longer record that a gc (of another process, say) evicted since are said to
    be evicted, not "not written" (`Placement.since`): its own record never was, as that one held them."""
    lines, index, placed = totals.get("lines", {}), mc.backing.index, []
    for i, tokens in enumerate(totals["warmed"]):
        p = mc.placement(tokens)
        if i in lines and index is not None:
            p.since(lines[i], index)
        p.failure = failure
        placed.append(p)
    return placed


def _bucket_traffic(remote) -> str:
    """What this process sent to the bucket and took from it: without it, a node that downloaded
    what it warmed reads "bytes written: 0", and one that uploaded it is not told so."""
    c = remote.counters
    there = (f", {plural(c['already_there'], 'record')} already there ({format_size(c['already_there_bytes'])} "
             "sent and read back)" if c["already_there"] else "")
    return (f"bucket {remote.url}: uploaded {plural(c['uploads'], 'record')} ({format_size(c['upload_bytes'])})"
            f"{there}; downloaded {plural(c['downloads'], 'record')} ({format_size(c['download_bytes'])}, "
            "not in the bytes written)")


def _write_failure(store) -> str:
    """What went wrong with this process's writes, in a few words ("" when nothing did)."""
    return write_error(store) if any(write_problems(store)) else ""


def _reasons(placed: list) -> str:
    from kvstore.write.placement import HELD

    why: dict[str, int] = {}
    for p in placed:
        for reason, n in p.why.items():
            why[reason] = why.get(reason, 0) + n
    # The count of each reason only when there are several: with one, it is the count just said.
    text = ", ".join(placed[0].reason(r, n if len(why) > 1 else None) for r, n in why.items()) or "queued"
    return text + ("; those in RAM are lost at exit" if any(r in HELD for r in why) else "")


def _bars(work: list):
    """A progress bar of prompts and one of tokens, on a terminal only."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    common = {"file": sys.stderr, "dynamic_ncols": True}
    return (tqdm(total=len(work), desc="prompts", unit="prompt", position=0, **common),
            tqdm(total=sum(len(t) for _, t in work), desc="tokens", unit="tok", unit_scale=True, position=1,
                 **common))


def _prefill(mc, item, tokens, progress, tokenizer) -> tuple[int, int, str]:
    """Prefill the prompt with its cache type, then mark the records that hold a messages line's
    system prompt as "system", and unpin it if the line says `"pin": false`; (tokens reused,
    tokens computed, what happened to its pins, in words)."""
    cache_type, system = cache_types(item, tokenizer, tokens) if tokenizer is not None else ("user", 0)
    _, reused, computed = mc.prefill(tokens, progress=progress, pin=bool(item.pin), cache_type=cache_type)
    if system:
        mc.mark(tokens, "system", first=system)
    pins = ", pinned" if item.pin else ""
    if item.pin is False:
        unpinned = mc.unpin(tokens)
        pins = f", unpinned {plural(unpinned['records'], 'record')}" if unpinned["records"] else ", not pinned"
    return reused, computed, pins


def _warm_all(mc, work: list, totals: dict, stop: Callable[[], bool], tokenizer=None,
              failure: Callable[[], str] = lambda: "", from_bucket: Callable[[], int] = lambda: 0) -> None:
    """Prefill each prompt, with a progress bar on a terminal and a log line per prompt otherwise."""
    bars = _bars(work)
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
            slow = long_prefill_note(lambda: len(tokens) - mc.stored_length(tokens))
            if slow:
                say(slow)
            t0 = time.perf_counter()
            current["computed"] = 0
            downloaded = from_bucket()
            try:
                reused, computed, pins = _prefill(mc, item, tokens, progress, tokenizer)
            except (_Stop, KeyboardInterrupt):
                # Stopped after the prompt's last chunk was inserted: it is stored whole, so it
                # counts as warmed, not as "not reached".
                if mc.stored_whole(tokens):
                    totals["done"] += 1
                    totals["warmed"].append(tokens)
                    totals["reused"] += len(tokens) - current["computed"]
                else:  # part of it stored: said apart, not as "not reached"
                    totals["cut"] = tokens
                raise
            totals["done"] += 1
            totals["warmed"].append(tokens)
            totals["reused"] += reused
            bucket = min(reused, from_bucket() - downloaded)
            totals["from_bucket"] += bucket
            if bars:
                bars[0].update(1)
                bars[1].update(reused)
            else:
                if mc.backing.budget is not None:  # what a disk budget's gc (running now) leaves on disk
                    mc.backing.budget.settle()
                placed = totals.setdefault("lines", {})[len(totals["warmed"]) - 1] = mc.placement(tokens)
                placed.failure = failure()
                if item.pin and placed.on_disk + placed.queued < placed.tokens:
                    pins = ", not pinned: not all on disk"
                where = f" ({bucket} from the bucket)" if bucket else ""
                text = placed.text() if len(mc.stored_part(tokens)) else (
                    "nothing to store (in exact mode a prompt's last token is the first generation step's)")
                say(f"[{i}/{len(work)}] {item.where}: {plural(len(tokens), 'token')}, {reused} reused{where}, "
                    f"{computed} computed, {text}{pins} ({time.perf_counter() - t0:.1f} s)")
    finally:
        for bar in bars or ():
            bar.close()
