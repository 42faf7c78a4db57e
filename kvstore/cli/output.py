"""What every command prints through, and how it fails: exit codes and `CommandError`.

Ids, model ids, paths and field names come from users and files: everything but generated text
is printed with non-printable characters escaped, so none of it can drive the terminal.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

from kvstore.sizes import format_size, plural, printable  # noqa: F401 -- the commands print through here
from kvstore.upkeep.local import AUTO_SHARE

PROG = "kvstore"
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_NOTHING_CHECKED = 3  # verify --exact: no stored prompt of the model was put to the test
EXIT_INTERRUPTED = 130


class CommandError(Exception):
    """A failure reported as one line on stderr, with an exit code."""

    def __init__(self, message: str, code: int = EXIT_PROBLEMS):
        super().__init__(message)
        self.code = code


class FirstCtrlC:
    """A SIGINT handler: while it is installed, a first Ctrl-C asks the command to stop at its next
    safe point (`requested`: after the chunk or prefill step in progress, whose cache is whole), a
    second stops at once."""

    def __init__(self, command: str, until: str):
        self.command, self.until, self.requested = command, until, False

    def __call__(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        say(f"{PROG} {self.command}: stopping after {self.until} (Ctrl-C again to stop at once)")


def say(*parts: Any) -> None:
    """One line on stderr, escaped."""
    print(*map(printable, parts), file=sys.stderr, flush=True)


def out(*parts: Any, **kw: Any) -> None:
    """One line on stdout, escaped (everything but generated text goes through here)."""
    print(*map(printable, parts), **kw)


def on_store(args) -> str:
    """` --store PATH` for a command a message suggests, when this one was given `--store`: without
    it the suggestion would act on another store (`$KVSTORE_DIR`, else `~/.cache/kvstore`)."""
    store = getattr(args, "store", None)
    return f" --store {shlex.quote(str(Path(store).expanduser()))}" if store else ""


def disk_budget(store, where: str = "") -> str | None:
    """The disk budget a command ran under, in one line: what the store holds against it, what
    `auto` came to, and what its gc evicted (None: no budget). Said because a budget given as
    `auto` is a size only the store knows, and what it evicted is what the next run recomputes."""
    budget = store.backing.budget
    if store.max_bytes is None or budget is None:
        return None
    budget.settle()  # (what is on disk once its gc has run)
    held = store.index.totals()["bytes"]
    rule = store.max_bytes_rule or ""  # ("... free on the store's disk at open) = ...", or "at 14:02:11)")
    when = re.search(r"disk (at [^)]+)\)", rule)
    how = (f" (auto: 1/{AUTO_SHARE} of what the store held plus its disk's free space "
           f"{when[1] if when else 'at open'})" if rule else "")
    wasted = (f", {budget.wasted_records} of them as soon as written (their writes wasted: what it holds is kept "
              "ahead of them)" if budget.wasted_records else "")
    evicted = (f"; its gc evicted {plural(budget.evicted_records, 'record')} ({format_size(budget.evicted_bytes)}) "
               f"to stay within it{wasted}" if budget.evicted_records else "; nothing evicted")
    over = (f"; over it by {format_size(held - store.max_bytes)}: pinned prompts and the records they hang "
            f"from stay (`kvstore pins{where}` lists them)" if held > store.max_bytes else "")
    return f"disk budget: {format_size(held)} held of {format_size(store.max_bytes)}{how}{evicted}{over}"


def uploads_undone(store) -> str | None:
    """What a command's uploads left undone, in one line with the count of each reason (None
    when nothing was, or no remote): queued when the store stopped waiting, skipped while the
    remote was down or for want of their parent, failed, dropped. Said because no later process
    uploads them: without it, a command run while the endpoint is down ends as if all went up."""
    remote = store.remote
    if remote is None:
        return None
    why = remote.not_uploaded()
    n = sum(why.values())
    if not n:
        return None
    left = (f"still queued when the remote did not answer in {remote.flush_timeout:g} s" if remote.flush_timeout
            else "still queued at exit, not waited for (remote_flush_timeout 0)")
    reasons = {"left": left,
               "down": "skipped while the remote failed (said above)", "no_parent": "skipped for want of their parent in the bucket",
               "failed": "failed", "dropped": "dropped from a full upload queue",
               "wrong_key": "skipped because this node's key is not the fleet's (said above)"}
    parts = ", ".join(f"{why[k]} {text}" for k, text in reasons.items() if why[k])
    return (f"{plural(n, 'upload')} not done ({parts}); those records are stored on this machine only: "
            "no later process uploads them")


# -- what a command's report says of the store's writes ------------------------------------------

def remote_tokens(store) -> int:
    """Tokens this process has restored from the bucket so far (0 without a remote tier)."""
    return store.remote.counters["remote_tokens"] if store.remote is not None else 0


def write_problems(store) -> tuple[int, int, int]:
    """Counters that go up when an insert does not reach the disk (no SQL: they are this
    process's writer counters, the ones `stats()["writer"]` reports)."""
    w = store.writer.stats
    return w.write_errors, w.dropped_jobs, store.counters.get("skipped_inserts", 0)


def write_error(store) -> str:
    """What went wrong with the last write, in a few words."""
    w = store.writer.stats
    if w.last_error:
        return f"the write failed: {w.last_error}"
    if w.dropped_jobs:
        return "the write queue was full"
    return "the store's index cannot be written"
