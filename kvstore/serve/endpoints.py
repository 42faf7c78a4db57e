"""What `kvstore serve` changes in mlx_lm.server's HTTP handler.

Added, read-only: `GET /metrics` (Prometheus text format), `GET /kvstore/stats` (`store.stats()`
as JSON, without paths unless asked) and a `GET /v1/models` that always lists the served model.
Added for routers: vLLM's render endpoints and `POST /kvstore/prefetch` (see `routing`).
Changed: a request addressed to a host name the server does not go by is refused (DNS
rebinding); requests from a web origin that was not allowed are refused before they reach the
model, and so are bodies sent as `text/plain` or as a form (a web page can send those to any
address without asking first); a malformed body is refused without writing it to the log.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import ipaddress
import json
import logging
import os
import socket
import time
from typing import Any, Callable
from urllib.parse import unquote

from kvstore.serve import routing
from kvstore.serve.bodies import body_problem
from kvstore.serve.metrics import ServerMetrics
from kvstore.serve.mlxserver import HIDE_COUNTS_ATTRIBUTE, TENANT_ATTRIBUTE, where_raised
from kvstore.serve.options import DEFAULT_MAX_BODY_BYTES
from kvstore.serve.promptcache import PersistentPromptCache
from kvstore.serve.tenancy.policy import Refused, TenantPolicy
from kvstore.sizes import printable

log = logging.getLogger("kvstore")

#: The POST paths of mlx_lm.server (others get its 404).
POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
#: What `--admin-token-file` keeps for the operator: they show every tenant's traffic as it changes.
ADMIN_PATHS = ("/metrics", "/kvstore/stats")
#: Content types a web page may POST to any origin without a CORS preflight.
SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
#: Names every server answers for, and the addresses that mean "listen on every address".
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")


class Hosts:
    """The names a request may be addressed to (its `Host` header, any port): the loopback
    names, the address the server listens on and `extra` (`*`: any). Listening on every address
    (0.0.0.0, ::) adds this machine's names and any IP address. A page whose own name was made to
    resolve to this machine (DNS rebinding) still sends that name, and is refused."""

    def __init__(self, listen: str | None, extra: list[str] = ()):
        listen = _bare_name(listen or "127.0.0.1")
        self.any_ip = listen in WILDCARD_ADDRESSES
        self.names = {*LOOPBACK_NAMES, listen, *map(_bare_name, extra)}
        if self.any_ip:
            self.names |= {_bare_name(socket.gethostname()), _bare_name(socket.getfqdn())}

    def allows(self, header: str) -> bool:
        name = _bare_name(header, port=True)
        return "*" in self.names or name in self.names or (self.any_ip and _is_ip(name))



def handler_class(base: type, cache: PersistentPromptCache, metrics: ServerMetrics,
                  allowed_origins: list[str], served_model: str | None, *,
                  hosts: Hosts | None = None, stats_paths: bool = False, tenants: TenantPolicy | None = None,
                  max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES, report_cached_tokens: bool = True,
                  admin_token: bytes | None = None) -> type:
    """A subclass of mlx_lm.server's `APIHandler` serving kvstore's endpoints and rules.

    `allowed_origins`: web origins whose requests are served and may read responses (`["*"]`:
    every origin; `[]`: none). `served_model`: the `--model` the server was started with.
    `hosts`: the names requests may be addressed to (default: the loopback names).
    `stats_paths`: `/kvstore/stats` shows paths (else they are left out). `tenants`: how a
    request's tenant is told (default: every request is the shared namespace's).
    `max_body_bytes`: a larger POST body is refused (413) unread (None: no limit).
    `report_cached_tokens`: False leaves `prompt_tokens_details.cached_tokens` out of every answer.
    `admin_token`: `/metrics` and `/kvstore/stats` answer only `Authorization: Bearer` it (None: anyone).
    """
    return type("KVStoreHandler", (KVStoreEndpoints, base), {
        "kvstore_cache": cache, "kvstore_metrics": metrics,
        "kvstore_allowed_origins": allowed_origins, "kvstore_served_model": served_model,
        "kvstore_hosts": hosts or Hosts(None), "kvstore_stats_paths": stats_paths,
        "kvstore_tenants": tenants or TenantPolicy(), "kvstore_max_body_bytes": max_body_bytes,
        "kvstore_report_cached_tokens": report_cached_tokens, "kvstore_admin_token": admin_token})


class KVStoreEndpoints:
    """kvstore's endpoints and refusals, put in front of mlx_lm.server's `APIHandler` by
    `handler_class` (which sets the `kvstore_` attributes). A new GET endpoint goes in
    `do_GET`; `super()` is mlx_lm.server's handler."""

    kvstore_cache: PersistentPromptCache
    kvstore_metrics: ServerMetrics
    kvstore_allowed_origins: list[str]
    kvstore_served_model: str | None
    kvstore_hosts: Hosts
    kvstore_stats_paths: bool
    kvstore_tenants: TenantPolicy
    kvstore_max_body_bytes: int | None
    kvstore_report_cached_tokens: bool
    kvstore_admin_token: bytes | None
    _kvstore_tenant: str | None = None  # this request's (set in do_POST)
    _kvstore_began = False  # whether this request's answer has begun (`end_headers`)

    def handle_one_request(self):
        """One request, as http.server serves it; but a client that hangs up before its answer
        is sent (a stream closed mid-way) is one log line, not a traceback, and anything else
        that fails in the handler is answered 500 if its answer had not begun (else the
        connection is closed), and logged by type and place: never its message, which may quote
        the prompt. (socketserver would print the traceback and drop the connection unanswered.)"""
        self._kvstore_began, self.command = False, None  # (parse_request sets the command once read)
        try:
            super().handle_one_request()
        except ConnectionError as e:  # BrokenPipeError, ConnectionResetError, ConnectionAbortedError
            self.close_connection = True
            log.info("kvstore serve: %s (%s)", f"the client of {self._kvstore_request()} hung up before the end of "
                     "its answer" if self.command else "a client hung up before its request was read", type(e).__name__)
        except Exception as e:
            self.close_connection = True
            # (--log-level DEBUG, which logs every body anyway, also logs the traceback)
            log.warning("kvstore serve: %s failed: %s at %s", self._kvstore_request(), type(e).__name__,
                        where_raised(e), exc_info=logging.getLogger().isEnabledFor(logging.DEBUG))
            if not self._kvstore_began:
                self._headers_buffer = []  # (a status line mlx_lm.server queued but never sent)
                with contextlib.suppress(Exception):
                    self._answer_json(500, {"error": f"the server failed on this request ({type(e).__name__})"})

    def _kvstore_request(self) -> str:
        """The request being served, in a log line's words: its method and path (never more)."""
        return f"{self.command} {_printable(self.path)}" if self.command else "a request not yet read"

    def end_headers(self):
        self._kvstore_began = True  # (from here on a status went out: no other can follow)
        super().end_headers()

    def validate_model_parameters(self):
        super().validate_model_parameters()
        # mlx_lm.server 0.32 reads stream_options["include_usage"] after the stream has begun: an
        # object without it (OpenAI's default, false) cut the answer short.
        if isinstance(self.stream_options, dict):
            self.stream_options = {**self.stream_options, "include_usage": bool(self.stream_options.get("include_usage"))}

    def parse_request(self) -> bool:
        """The request line and headers, as mlx_lm.server reads them; then a request addressed
        to a host this server does not answer for is refused before any method sees it."""
        return super().parse_request() and not self._refused_host()

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path in ADMIN_PATHS and not self._admin():
            self.close_connection = True
            return self._answer_json(401, {"error": f"{path} answers only the operator: send Authorization: "
                                                    "Bearer and the token of --admin-token-file"},
                                     headers={"WWW-Authenticate": 'Bearer realm="kvstore"'})
        try:
            if path == "/metrics":
                body, content_type = self.kvstore_metrics.render()
                return self._answer(200, body, content_type)
            if path == "/kvstore/stats":
                stats = self.kvstore_metrics.read(self.kvstore_cache.store.stats)
                return self._answer_json(200, stats if self.kvstore_stats_paths else without_paths(stats))
            if path == "/v1/models" or path.startswith("/v1/models/"):
                return self._models(path[len("/v1/models/"):] if path != "/v1/models" else None)
        except Exception as e:  # a scrape must never take the server down
            log.warning("kvstore serve: GET %s failed: %s: %s", path, type(e).__name__, e)
            return self._answer_json(500, {"error": f"{type(e).__name__}: {e}"})
        return super().do_GET()

    def do_POST(self):
        if self.path in (*routing.RENDER_PATHS, routing.PREFETCH_PATH):
            return self._routing_post()
        if self.path not in POST_PATHS:
            return super().do_POST()
        # (without a Content-Length, mlx_lm.server answers 411 / 400 without reading a body)
        raw = self._read_body(super().do_POST)
        if raw is None:
            return None
        body = json.loads(raw)
        try:
            self._kvstore_tenant = self.kvstore_tenants.tenant_of(self.headers, body)
            routing.check_fits(self.response_generator, "/v1/chat/completions" if "chat" in self.path else self.path,
                               body, self.kvstore_served_model)
        except Refused as e:
            return self._refused(e)
        except routing.RequestError as e:
            return self._answer_json(e.status, {"error": str(e)})
        # mlx_lm.server reads the body again: hand it the bytes it would have read.
        stream = self.rfile
        self.rfile = io.BytesIO(raw)
        try:
            return super().do_POST()
        finally:
            self.rfile = stream

    def _routing_post(self):
        """A render or prefetch request: answered here, nothing generated."""
        raw = self._read_body(lambda: self._answer_json(411, {"error": "Content-Length header is required"}))
        if raw is None:
            return None
        body, served = json.loads(raw), self.kvstore_served_model
        try:
            if self.path == routing.PREFETCH_PATH:
                # Within the caller's tenant: the shared prompts and its own, as its request will.
                tenant = self.kvstore_tenants.tenant_of(self.headers, body)
                tokens = routing.prompt_tokens(self.response_generator, body, served)
                key = getattr(self.response_generator.model_provider, "model_key", None)
                got = self.kvstore_cache.prefetch(key, tokens, tenant_id=tenant)
                if not self.kvstore_report_cached_tokens:  # (what is stored is not said, here either)
                    got = {k: v for k, v in got.items() if k in ("tokens", "refused")}
                return self._answer_json(200, got)
            return self._answer_json(200, routing.render(self.response_generator, self.path, body, served))
        except Refused as e:
            return self._refused(e)
        except routing.RequestError as e:
            return self._answer_json(e.status, {"error": str(e)})
        except Exception as e:  # never the server down, never the prompt in the log
            log.warning("kvstore serve: POST %s failed: %s", self.path, type(e).__name__)
            return self._answer_json(500, {"error": type(e).__name__})

    def _read_body(self, no_length: Callable[[], object]) -> bytes | None:
        """The request's body, read once it passed the origin, media type and size checks and
        checked to be a JSON object; None when the request was answered here instead (refused,
        malformed, or without a Content-Length: `no_length()` answers that)."""
        if self._refused_origin() or self._refused_media_type():
            return None
        try:
            length = int(self.headers.get("Content-Length"))
        except (TypeError, ValueError):
            no_length()
            return None
        if length < 0:  # (read as 0 it was "Invalid JSON", and what the client sent the next request)
            self.close_connection = True
            self._answer_json(400, {"error": f"Invalid Content-Length header: {length} is negative"})
            return None
        if self._refused_size(length):
            return None
        raw = self.rfile.read(length)
        problem = body_problem(self.path, raw)
        if problem is not None:
            self._malformed(*problem, len(raw))
            return None
        return raw

    def handle_chat_completions(self):
        return self._with_tenant(super().handle_chat_completions())

    def handle_text_completions(self):
        return self._with_tenant(super().handle_text_completions())

    def _with_tenant(self, request):
        """mlx_lm.server's request object, carrying this request's tenant to the generation thread
        (and, when cached tokens are not reported, that its progress must not tell them either)."""
        setattr(request, TENANT_ATTRIBUTE, self._kvstore_tenant)
        setattr(request, HIDE_COUNTS_ATTRIBUTE, not self.kvstore_report_cached_tokens)
        return request

    def generate_response(self, *args, **kwargs):
        return super().generate_response(*self._without_cached(args, 4, kwargs), **kwargs)

    def completion_usage_response(self, *args, **kwargs):
        return super().completion_usage_response(*self._without_cached(args, 2, kwargs), **kwargs)

    def _without_cached(self, args: tuple, at: int, kwargs: dict) -> tuple:
        """mlx_lm.server's arguments with its `prompt_cache_count` (positional `at`, or keyword)
        taken out when cached tokens are not reported: the usage then has no cached_tokens."""
        if self.kvstore_report_cached_tokens:
            return args
        kwargs.pop("prompt_cache_count", None)
        return args[:at] + (None,) + args[at + 1:] if len(args) > at else args

    def _refused(self, e: Refused):
        log.warning("kvstore serve: refused a request to %s: %s", self.path, e)
        challenge = {"WWW-Authenticate": 'Bearer realm="kvstore"'} if e.status == 401 else None  # (RFC 7235)
        return self._answer_json(e.status, {"error": str(e)}, challenge)

    def _admin(self) -> bool:
        """Whether this request may read the operator's endpoints (`admin_token`)."""
        if self.kvstore_admin_token is None:
            return True
        every = self.headers.get_all("Authorization") or []
        if len(every) != 1:  # none, or two (which one a proxy added cannot be told)
            return False
        scheme, _, token = every[0].strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.kvstore_admin_token)

    def _set_cors_headers(self):
        origin = self.headers.get("Origin")
        allowed_origins = self.kvstore_allowed_origins
        if "*" in allowed_origins:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin is not None and origin in allowed_origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        else:
            return  # no CORS headers: a browser neither sends the request nor shows the answer
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "*")

    # -- refusals (each answers the request itself and says True) ----------------------------

    def _refused_host(self) -> bool:
        header = self.headers.get("Host")
        if header is None and self.request_version == "HTTP/1.0":
            return False  # (HTTP/1.0 has no Host; every browser sends one)
        if header is not None and self.kvstore_hosts.allows(header):
            return False
        self.close_connection = True
        if header is None:
            self._answer_json(400, {"error": "the request has no Host header"})
            return True
        log.warning("kvstore serve: refused a request addressed to the host %s (allow it with "
                    "--allowed-hosts)", _printable(header))
        self._answer_json(421, {"error": f"this server does not answer for the host {_printable(header)!r}: "
                                         "only for localhost, 127.0.0.1, [::1], its --host and "
                                         "kvstore serve --allowed-hosts"})
        return True

    def _refused_origin(self) -> bool:
        origin = self.headers.get("Origin")
        if origin is None or _allowed(origin, self.kvstore_allowed_origins):
            return False
        log.warning("kvstore serve: refused a request from the web origin %s (allow it with "
                    "--allowed-origins)", _printable(origin))
        self._answer_json(403, {"error": f"requests from the web origin {origin!r} are "
                                         "not allowed (kvstore serve --allowed-origins)"})
        return True

    def _refused_size(self, length: int) -> bool:
        limit = self.kvstore_max_body_bytes
        if limit is None or length <= limit:
            return False
        # Never read: the connection closes, with what the client still sends unread.
        self.close_connection = True
        log.warning("kvstore serve: refused a request to %s: its body of %d bytes is over --max-body-bytes "
                    "(%d bytes)", self.path, length, limit)
        self._answer_json(413, {"error": f"the body is {length} bytes, more than this server takes "
                                         f"({limit} bytes: kvstore serve --max-body-bytes)"})
        return True

    def _refused_media_type(self) -> bool:
        media_type = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if media_type not in SIMPLE_TYPES:
            return False
        self._answer_json(415, {"error": f"the body is sent as {media_type}: send JSON "
                                         "with Content-Type: application/json"})
        return True

    def _malformed(self, why: str, error: str, nbytes: int):
        # Never the body itself: it is the user's prompt (mlx_lm.server logs it raw at ERROR).
        log.warning("kvstore serve: refused a request to %s: its body (%d bytes) cannot be "
                    "served: %s", self.path, nbytes, why)
        return self._answer_json(400, {"error": f"{error}: {why}"})

    # -- answers ------------------------------------------------------------------------------

    def _models(self, wanted: str | None):
        models = _listed_models(self.kvstore_served_model, int(getattr(self, "created", time.time())))
        if wanted is None:
            return self._answer_json(200, {"object": "list", "data": models})
        wanted = unquote(wanted).lstrip("/")
        for model in models:
            if model["id"].lstrip("/") == wanted:  # a local path's id starts with "/"
                return self._answer_json(200, model)
        return self._answer_json(404, {"error": {"message": f"no model {wanted!r} here",
                                                 "type": "invalid_request_error", "code": "model_not_found"}})

    def _answer_json(self, status: int, value: Any, headers: dict[str, str] | None = None):
        body = json.dumps(value, default=str).encode()
        return self._answer(status, body, "application/json", headers)

    def _answer(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self._set_cors_headers()
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()


def _allowed(origin: str, allowed: list[str]) -> bool:
    return "*" in allowed or origin in allowed


def _listed_models(served_model: str | None, created: int) -> list[dict]:
    """The served model first (under the `--model` it was started with: the name to send), then
    the mlx models in the Hugging Face cache that mlx_lm.server would list (if there is one)."""
    models = []
    if served_model:
        models.append({"id": served_model, "object": "model", "created": created, "owned_by": "kvstore serve"})
    seen = {m["id"] for m in models}
    for repo_id in _cached_mlx_models():
        if repo_id not in seen:
            seen.add(repo_id)
            models.append({"id": repo_id, "object": "model", "created": created, "owned_by": "huggingface cache"})
    return models


def _cached_mlx_models() -> list[str]:
    """Repo ids of downloaded models that look like mlx-lm models; none when there is no cache."""
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir()
    except Exception:  # no cache folder on a fresh machine (mlx-lm 0.32 then sends an empty body)
        return []
    wanted = {"config.json", "model.safetensors.index.json", "tokenizer_config.json"}
    out = []
    for repo in info.repos:
        try:
            if repo.repo_type != "model" or "main" not in repo.refs:
                continue
            if wanted <= {f.file_path.name for f in repo.refs["main"].files}:
                out.append(repo.repo_id)
        except Exception:
            continue
    return sorted(out)


def without_paths(stats: dict) -> dict:
    """`store.stats()` without the paths it names: the store's, the remote's URL, and a model
    id that is a folder (its last part is kept, wherever it shows: the KV events' topic names
    it too), and an `ipc://` endpoint's folder. Errors name them as STORE and REMOTE."""
    folders = {m["model_id"]: _last_part(m["model_id"]) for m in stats.get("models") or []
               if isinstance(m.get("model_id"), str) and _last_part(m["model_id"]) != m["model_id"]}
    stats = _replaced(stats, folders)
    out = {k: v for k, v in stats.items() if k != "path"}
    out["models"] = [{**m, "model_id": _last_part(m.get("model_id"))} for m in stats.get("models") or []]
    remote = stats.get("remote")
    if isinstance(remote, dict):
        out["remote"] = {k: v for k, v in remote.items() if k != "url"}
        if isinstance(remote.get("last_error"), str) and remote.get("url"):
            out["remote"]["last_error"] = remote["last_error"].replace(str(remote["url"]), "REMOTE")
    writer, store = stats.get("writer"), stats.get("path")
    if isinstance(writer, dict) and isinstance(writer.get("last_error"), str) and isinstance(store, str):
        out["writer"] = {**writer, "last_error": writer["last_error"].replace(store, "STORE")}
    return out


def _replaced(value: object, folders: dict[str, str]) -> object:
    """`value` (a stats answer, or part of one) with each of `folders` (path -> what to show)
    replaced in every string, longest path first, and an `ipc://` endpoint shown by its file name."""
    if isinstance(value, dict):
        return {k: _replaced(v, folders) for k, v in value.items()}
    if isinstance(value, list):
        return [_replaced(v, folders) for v in value]
    if isinstance(value, str):
        for path in sorted(folders, key=len, reverse=True):
            value = value.replace(path, folders[path])
        if value.startswith("ipc://"):
            value = "ipc://" + os.path.basename(value[len("ipc://"):])
    return value


def _last_part(model_id: object) -> object:
    """A model id that is a local folder as its last part; a Hugging Face repo id as it is."""
    if isinstance(model_id, str) and (os.path.isabs(model_id) or model_id.startswith(("~", "."))):
        return os.path.basename(model_id.rstrip("/")) or model_id
    return model_id


def _bare_name(host: str, port: bool = False) -> str:
    """A host name as compared: lower case, no brackets or final dot, and (`port`: it is a Host
    header) no port: `[::1]:8080` -> `::1`, `LocalHost.:80` -> `localhost`."""
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif port and name.count(":") == 1:
        name = name.partition(":")[0]
    return name.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _printable(text: str, limit: int = 200) -> str:
    """`text` safe for a log line: non-printable characters escaped, length bounded."""
    return printable(text[:limit])
