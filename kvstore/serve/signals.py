"""SIGTERM and Ctrl-C while `kvstore serve` runs: stop the requests and the server, then flush."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import weakref
from typing import Any

from kvstore.sizes import plural
from kvstore.store import Store

log = logging.getLogger("kvstore")
EXIT_FLUSH_S = 10.0  # how long a second Ctrl-C waits for queued writes


class Stopper:
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
            log.warning("kvstore: second Ctrl-C: flushing pending writes (at most %g s) and exiting now", EXIT_FLUSH_S)
            # This machine's disk only: the uploads are what the first stop was waiting for.
            done = self.store.writer.flush(timeout=EXIT_FLUSH_S)
            said = ("every queued write is on disk" if done else
                    f"the flush did not finish in {EXIT_FLUSH_S:g} s: what was still queued is not on disk")
            remote = self.store.remote
            undone = remote.undone_now() if remote is not None else 0
            if undone:
                said += f"; {plural(undone, 'upload')} to the remote not done: those records are on this machine's disk only"
            log.warning("kvstore: exiting: %s", said)
            os._exit(0 if done else 1)
        log.info("kvstore: %s: already stopping", name)
