"""What every command prints through, and how it fails: exit codes and `CommandError`.

Ids, model ids, paths and field names come from users and files: everything but generated text
is printed with non-printable characters escaped, so none of it can drive the terminal.
"""

from __future__ import annotations

import sys
from typing import Any

from kvstore.sizes import plural, printable  # noqa: F401 -- the commands print through here

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


def say(*parts: Any) -> None:
    """One line on stderr, escaped."""
    print(*map(printable, parts), file=sys.stderr, flush=True)


def out(*parts: Any, **kw: Any) -> None:
    """One line on stdout, escaped (everything but generated text goes through here)."""
    print(*map(printable, parts), **kw)



def uploads_undone(store) -> str | None:
    """What a command's uploads left undone, in one line (None when nothing was, or no remote)."""
    remote = store.remote
    n = remote.undone_uploads if remote is not None else 0
    if not n:
        return None
    return (f"{plural(n, 'upload')} not done (the remote did not answer in {remote.flush_timeout:g} s); "
            "those records are stored on this machine only: no later process uploads them")
