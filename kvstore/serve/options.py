"""The command line of `kvstore serve`: kvstore's own options, and what it reads of mlx_lm.server's.

kvstore's options are parsed here; every other option is left for mlx_lm.server, which only
`peek_mlx_options` looks at (for `--model`, `--host`, `--port`, `--prompt-cache-bytes`).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket

from kvstore.argv import Parser, add_disk_kv_bits, rate, size

#: Default of --store-max-tokens: a longer request is served but not stored.
DEFAULT_MAX_STORED_TOKENS = 32768

PROG = "kvstore serve"
EPILOG = """\
Every other option goes to mlx_lm.server unchanged (--model, --host, --port, --prompt-cache-size,
--prompt-cache-bytes, --max-tokens, ...; see below). --model defaults to the built-in demo model;
--host defaults to 127.0.0.1 (kvstore warns when it listens on any other address).
--memory-bytes defaults to --prompt-cache-bytes when that is given.

Also served, read-only: GET /metrics (Prometheus) and GET /kvstore/stats (store.stats() as JSON,
without paths unless --stats-paths). Requests addressed to any other host than localhost,
127.0.0.1, [::1], --host and --allowed-hosts are refused (421).

example:
  kvstore serve --store ~/.cache/kvstore --model mlx-community/Qwen3-4B-4bit --port 8080
"""


def build_parser() -> argparse.ArgumentParser:
    """kvstore's options of `kvstore serve` (`parse_known_args` leaves mlx_lm.server's)."""
    p = Parser(
        prog=PROG, add_help=False, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run mlx_lm.server with a prompt cache that survives restarts and is shared "
                    "by every server on the same store.")
    p.add_argument("-h", "--help", action="store_true", help="show this help (and mlx_lm.server's) and exit")
    p.add_argument("--store", metavar="DIR",
                   help="store directory (default: $KVSTORE_DIR, else ~/.cache/kvstore)")
    p.add_argument("--store-max-bytes", metavar="SIZE", type=_budget, default="auto",
                   help="bound the store on disk, e.g. 20GB; `auto` (the default): a quarter of "
                        "what it holds plus the disk's free space, at start; `none`: unbounded")
    p.add_argument("--memory-bytes", metavar="SIZE", type=size,
                   help="bound the store's memory tier, e.g. 2GiB (default: 1 GiB)")
    p.add_argument("--buffer-cache-bytes", metavar="SIZE", type=size,
                   help="freed restore memory mlx may keep for the next restore, e.g. 4GiB "
                        "(default: a quarter of RAM; 0: mlx's own limit)")
    p.add_argument("--store-max-tokens", metavar="N", type=_tokens, default=DEFAULT_MAX_STORED_TOKENS,
                   help="store the cache of a request only up to N tokens (prompt and generated "
                        f"together); longer ones are served, not stored (default: {DEFAULT_MAX_STORED_TOKENS}; "
                        "0: no cap)")
    p.add_argument("--allowed-origins", metavar="LIST", type=_origins, default=[],
                   help="comma-separated web origins whose requests are served, e.g. "
                        "http://localhost:3000, or `*` for every origin (default: none: a web page "
                        "cannot use the server)")
    p.add_argument("--allowed-hosts", metavar="LIST", type=_hosts, default=[],
                   help="comma-separated host names requests may be addressed to (their Host header) "
                        "besides localhost, 127.0.0.1, [::1] and --host, e.g. a reverse proxy's name, "
                        "or `*` for any (default: none; others get 421, which stops DNS rebinding)")
    p.add_argument("--stats-paths", action="store_true",
                   help="show paths in GET /kvstore/stats (the store's, the models', the remote's URL); "
                        "by default they are left out")
    p.add_argument("--remote", metavar="URL", default=os.environ.get("KVSTORE_REMOTE") or None,
                   help="share the cache through an S3 bucket, s3://BUCKET/PREFIX (default: $KVSTORE_REMOTE)")
    p.add_argument("--remote-key-file", metavar="PATH",
                   help="file holding the fleet secret the remote's objects are sealed with (default: "
                        "$KVSTORE_REMOTE_KEY); `kvstore remote-key` prints a new one")
    # What the writer puts on disk (kept in the store; a later start without them uses them).
    p.add_argument("--admit", choices=("all", "reused", "pinned"),
                   help="which requests' caches are written to disk: all (the default), reused (a "
                        "prefix asked for a second time), pinned (warmed and pinned only)")
    p.add_argument("--max-write-rate", metavar="RATE", type=rate,
                   help="write at most this much to disk in any rolling day, e.g. 20GB/day or "
                        "500MB/h (`off`: no limit)")
    add_disk_kv_bits(p)
    return p


def _budget(text: str) -> int | str | None:
    word = text.strip().lower()
    if word == "auto":
        return "auto"
    if word in ("none", "unbounded"):
        return None
    return size(text)


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


def _hosts(text: str) -> list[str]:
    return [h.strip().lower().strip("[]").rstrip(".") for h in text.split(",") if h.strip()]


def peek_mlx_options(args: list[str]) -> argparse.Namespace:
    """The mlx_lm.server options kvstore needs to look at (left in place for mlx_lm.server)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    p.add_argument("--host")
    p.add_argument("--port")
    p.add_argument("--prompt-cache-bytes")
    return p.parse_known_args(args)[0]


def without_option(help_text: str, flag: str) -> str:
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


def is_loopback(host: str) -> bool:
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
