"""The command line of `kvstore serve`: kvstore's own options, and what it reads of mlx_lm.server's.

kvstore's options are parsed here; every other option is left for mlx_lm.server, which only
`peek_mlx_options` looks at (for `--model`, `--host`, `--port`, `--prompt-cache-bytes`).
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
from pathlib import Path

from kvstore import settings
from kvstore.argv import Parser, add_store_options
from kvstore.errors import InvalidInputError
from kvstore.remote.bucket import check_url_form
from kvstore.serve.tenancy.policy import TenantPolicy, parse_source
from kvstore.settings import Setting
from kvstore.tenants import check_id

#: Default of --store-max-tokens: a longer request is served but not stored.
DEFAULT_MAX_STORED_TOKENS = 32768
#: Default of --max-body-bytes: a larger POST body is refused (413), never read.
DEFAULT_MAX_BODY_BYTES = 64 << 20

#: The settings only `kvstore serve` has (not kept in the store), built like the store's.
SERVE_SETTINGS: tuple[Setting, ...] = (
    Setting("store_max_tokens", "count", DEFAULT_MAX_STORED_TOKENS, zero="no cap", off=True,
            help="store the cache of a request only up to N tokens (prompt and generated together); "
                 "longer ones are served, not stored; off: no cap; 0: no cap"),
    Setting("allowed_origins", "list", [], default_text="none: a web page cannot use the server",
            help="comma-separated web origins whose requests are served, e.g. http://localhost:3000, "
                 "or `*` for every origin"),
    Setting("allowed_hosts", "list", [], default_text="none; others get 421, which stops DNS rebinding",
            help="comma-separated host names requests may be addressed to (their Host header) besides "
                 "localhost, 127.0.0.1, [::1] and --host, e.g. a reverse proxy's name, or `*` for any"),
    Setting("stats_paths", "flag", False,
            help="show paths in GET /kvstore/stats (the store's, the models', the remote's URL); "
                 "by default they are left out"),
    Setting("tenant_from", "text", "none", check=parse_source,
            help="serve tenants apart, telling a request's tenant by header:NAME (the value of that "
                 "header), bearer (its Authorization: Bearer token) or none (one tenant: every request "
                 "shares the store); a tenant reuses the shared prompts (warmed, pinned) and its own, "
                 "never another tenant's; a request without it is refused unless --default-tenant"),
    Setting("default_tenant", "text", None, default_text="none: such a request is refused (400; 401 for bearer)",
            help="the tenant of a request that names none, with --tenant-from header:NAME or bearer"),
    Setting("trust_client_salt", "flag", False,
            help="let a request's cache_salt field (vLLM's, on /v1/chat/completions and /v1/completions) "
                 "split its tenant further (with --tenant-from none, requests without it are one tenant of "
                 "their own, never the shared namespace); without this flag the field is ignored"),
    Setting("admin_token_file", "text", None, default_text="none: any client of the port reads them",
            help="a file holding a secret token: GET /metrics and GET /kvstore/stats then answer only "
                 "requests with Authorization: Bearer TOKEN (401 else), so that tenants of a shared server "
                 "cannot watch each other's traffic there (e.g. a Prometheus scrape with its bearer token)"),
    Setting("report_cached_tokens", "choice", "on", choices=("on", "off"),
            help="on: usage.prompt_tokens_details.cached_tokens says how many prompt tokens came from "
                 "the store (only ever the shared prompts and the request's tenant's own); off: never said"),
    Setting("max_body_bytes", "size", DEFAULT_MAX_BODY_BYTES, off=True, zero=None,
            refuse_zero="0 would refuse every request: use off for no limit",
            help="refuse a POST body larger than this with 413, unread, e.g. 16MiB; off: no limit; "
                 "0 is refused"),
    Setting("kv_events_config", "json", None, default_text="none: nothing is published",
            help="publish vLLM's KV events for cache-aware routers, with vLLM's JSON, e.g. "
                 "'{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\"}'; "
                 "the topic defaults to kv@HOST:PORT@MODEL; events carry prompts' token ids (docs/serve.md)"),
    Setting("kv_events_block_size", "count", 64, zero=None, refuse_zero="a block needs at least one token",
            help="tokens per block in KV events; it must divide the store's chunk size (256), and a "
                 "router such as Dynamo's uses the events only when it equals its own block size; a "
                 "different block_size in --kv-events-config is refused; 0 is refused"),
    Setting("warm_top", "count", 0, zero="warm nothing",
            help="before /health says ready, load the N most-hit prompts (or shared system prompts) "
                 "of the store into the memory tier, as far as it holds them; 0: warm nothing"),
)

PROG = "kvstore serve"
EPILOG = """\
Every other option goes to mlx_lm.server unchanged (--model, --host, --port, --prompt-cache-size,
--prompt-cache-bytes, --max-tokens, ...; see below). --model defaults to the built-in demo model;
--host defaults to 127.0.0.1 (kvstore warns when it listens on any other address).
--memory-bytes defaults to --prompt-cache-bytes when that is given.

Also served, read-only: GET /metrics (Prometheus) and GET /kvstore/stats (store.stats() as JSON,
without paths unless --stats-paths); vLLM's POST /v1/chat/completions/render and
/v1/completions/render (the token ids a request would prefill); POST /kvstore/prefetch (a
prompt's stored cache into RAM ahead of its request). Requests addressed to any other host than localhost,
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
    add_store_options(p, check_url_form)
    settings.add_options(p.add_argument_group("store settings (see `kvstore settings`)"), serve=True)
    settings.add_options(p.add_argument_group("server settings"), SERVE_SETTINGS, serve=True)
    return p


def server_settings(args: argparse.Namespace) -> dict:
    """The `SERVE_SETTINGS` of the parsed arguments, defaults filled in and normalised (origins
    without a trailing slash, host names lower-case without brackets; a cap of 0 is None)."""
    given = settings.given(args, SERVE_SETTINGS)
    out = {s.name: given.get(s.name, s.default) for s in SERVE_SETTINGS}
    for s in SERVE_SETTINGS:
        if s.off and out[s.name] in settings.OFF_WORDS:
            out[s.name] = None
    out["allowed_origins"] = [o.rstrip("/") for o in out["allowed_origins"]]
    out["allowed_hosts"] = [h.lower().strip("[]").rstrip(".") for h in out["allowed_hosts"]]
    out["store_max_tokens"] = out["store_max_tokens"] or None
    out["given"] = frozenset(given)  # the settings the command line named
    out["tenants"] = TenantPolicy.parse(out["tenant_from"], out["default_tenant"], out["trust_client_salt"])
    if out["default_tenant"] is not None and out["tenants"].source == "none":
        raise InvalidInputError("--default-tenant names the tenant of requests that name none: it needs "
                                "--tenant-from header:NAME or bearer")
    if out["default_tenant"] is not None:  # (else each request without a tenant fails its lookup and insert)
        try:
            check_id(out["default_tenant"])
        except ValueError as e:
            raise InvalidInputError(f"--default-tenant: {e}") from None
    out["admin_token"] = admin_token(out["admin_token_file"])
    return out


def admin_token(path: str | None) -> bytes | None:
    """The token in `--admin-token-file` (its first line, at least 16 characters), or None."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8").strip().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInputError(f"--admin-token-file {path}: cannot read it ({e})") from None
    token = text[0].strip() if text else ""
    if len(token) < 16 or any(ord(c) <= 32 or ord(c) == 127 for c in token):
        raise InvalidInputError(f"--admin-token-file {path}: its first line must be a token of 16 or more "
                                "printable characters without spaces (e.g. from `openssl rand -hex 32`)")
    return token.encode()


def peek_mlx_options(args: list[str]) -> argparse.Namespace:
    """The mlx_lm.server options kvstore needs to look at (left in place for mlx_lm.server)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    p.add_argument("--host")
    p.add_argument("--port")
    p.add_argument("--prompt-cache-bytes")
    return p.parse_known_args(args)[0]


def check_port(port: str | None) -> None:
    """Refuse a `--port` past 65535: mlx_lm.server would take it modulo 65536 (99999 listens on
    34463) and log the number it was given."""
    try:
        number = int(port) if port is not None else None
    except ValueError:
        return  # mlx_lm.server's own parser says it is not a number
    if number is not None and not 0 <= number <= 65535:
        raise ValueError(f"argument --port: {number} is no TCP port: give 1 to 65535")


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
