"""Tenants of `kvstore serve`: which tenant a request is (`TenantPolicy`, on the HTTP handler's
thread), and carrying that to the cache lookup and inserts of mlx_lm.server's generation thread
(`RequestTenants`), which calls the prompt cache knowing nothing of the request.

The handler reads the tenant from the request (`--tenant-from header:NAME | bearer | none`, and
with `--trust-client-salt` vLLM's `cache_salt` field) and puts its id on the request object mlx-lm
queues for the generation thread. There, `begin` is told it just before the request's lookup
(mlx_lm.server tokenizes each request right before it looks its prompt up, in its batched path
and its one-at-a-time path alike); the lookup `take`s it. The caches mlx_lm.server later inserts
come from its batch generator (`mlxserver` tags them with the tenant of the request they are of)
or, one request at a time, from the request being served (`single`). An insert whose tenant is
not known is not stored: it can never land in another tenant's namespace.

A request is written to the shared namespace (which every tenant's lookup follows) only on a
server that serves every request alike (`--tenant-from none`) on a store no tenant uses: with
`--trust-client-salt`, requests without a `cache_salt` are the tenant `UNNAMED`, and so are a
`--tenant-from none` server's on a store that serves tenants (`serves_tenants`; one that finds
out later stores nothing more, `SharedWrites`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from kvstore.tenants import MAX_ID_BYTES, UNNAMED, check_id, salted_id

log = logging.getLogger("kvstore")

# `UNNAMED` (`kvstore.tenants`) is the tenant of requests that name none where others do: they
# reuse the shared prompts and each other's, and write nothing into the shared namespace.
#: The `meta` mark a server serving tenants apart sets on its store (see `serves_tenants`).
TENANTS_MARK = "serve.tenants_apart"
#: A tenant not known (no request told it): nothing is reused or stored for it.
UNKNOWN = object()
#: Tags of caches kept for inserts still to come, at most (the oldest are dropped: not stored).
MAX_TAGS = 4096


class Refused(Exception):
    """A request whose tenant cannot be told: answered with `status` and this message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TenantPolicy:
    """How `kvstore serve` tells a request's tenant: `source` is "none", "bearer" or a header
    name; `default` the tenant of a request that names none (None: such a request is refused);
    `trust_client_salt`: a request's `cache_salt` splits its tenant further (vLLM's field);
    `unnamed`: a request that names no tenant is the tenant `UNNAMED`, not the shared namespace
    (so it is too with `trust_client_salt` and no `cache_salt`)."""

    source: str = "none"
    default: str | None = None
    trust_client_salt: bool = False
    unnamed: bool = False

    @classmethod
    def parse(cls, text: str, default: str | None = None, trust_client_salt: bool = False) -> "TenantPolicy":
        return cls(parse_source(text), default, trust_client_salt)

    @property
    def active(self) -> bool:
        """Whether requests may have tenants at all (else every request is the shared namespace's)."""
        return self.source != "none" or self.trust_client_salt or self.unnamed

    def tenant_of(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
        """The tenant id of a request (None: the shared namespace); Refused if it has none and
        there is no default, or its `cache_salt` is not text (null is no salt, as clients send an
        optional field they leave unset). Messages never quote a value."""
        tenant = self._named(headers)
        if not self.trust_client_salt or body.get("cache_salt") is None:  # (null: an optional field unset)
            unnamed = tenant is None and (self.trust_client_salt or self.unnamed)
            return UNNAMED if unnamed else tenant
        salt = body["cache_salt"]
        if not isinstance(salt, str) or not salt:
            raise Refused(400, "cache_salt must be a non-empty string")
        try:
            return salted_id(tenant, salt)
        except ValueError:  # (was a 500 "ValueError")
            raise Refused(400, f"cache_salt is too long: with the request's tenant it takes more than "
                               f"{MAX_ID_BYTES} bytes") from None

    def _named(self, headers: Mapping[str, str]) -> str | None:
        if self.source == "none":
            return None
        if self.source == "bearer":
            auth = _once(headers, "Authorization")
            what, status = "an Authorization: Bearer header", 401
        else:
            auth = _once(headers, self.source)
            what, status = f"the {self.source} header", 400
        # Control characters (C0, DEL, C1) are refused before anything is stripped: str.strip
        # takes some of them (and other Unicode spaces) off, which made several values one tenant.
        if any(ord(c) < 32 and c != "\t" or 127 <= ord(c) < 160 for c in auth):
            raise Refused(400, f"the tenant in {what} holds control characters")
        if self.source == "bearer":
            scheme, _, token = auth.strip(" \t").partition(" ")
            value = token.strip(" \t") if scheme.lower() == "bearer" else ""
        else:
            value = auth.strip(" \t")
        if "\t" in value:  # (around it, a tab is the header's whitespace; within it, a control character)
            raise Refused(400, f"the tenant in {what} holds control characters")
        if not value:
            if self.default is not None:
                return self.default
            raise Refused(status, f"this server serves each tenant apart and takes the tenant from {what}, "
                                  "which this request does not have")
        try:
            return check_id(value)
        except ValueError as e:
            raise Refused(400, f"the tenant in {what}: {e}") from None


def _once(headers: Mapping[str, str], name: str) -> str:
    """The value of header `name` ("" if absent); Refused if the request has it more than once: a
    proxy that adds the tenant's header after the client's own would let the client choose its
    tenant (the first of two is what a plain lookup reads)."""
    every = headers.get_all(name) if hasattr(headers, "get_all") else None
    if every is not None and len(every) > 1:
        raise Refused(400, f"this request has the {name} header {len(every)} times: a tenant is named once "
                           "(a proxy that sets it must replace the client's, not add to it)")
    return headers.get(name) or ""


def parse_source(text: str) -> str:
    """`--tenant-from`: "none", "bearer" or "header:NAME" (-> the header name); ValueError if not."""
    word = str(text).strip()
    if word.lower() in ("none", "bearer"):
        return word.lower()
    kind, _, name = word.partition(":")
    if kind.lower() == "header" and name.strip() and all(c.isalnum() or c in "-_" for c in name.strip()):
        return name.strip()
    raise ValueError(f"must be header:NAME (a header name of letters, digits, - and _), bearer or none, got {text!r}")


class RequestTenants:
    """The tenant of each request on mlx_lm.server's generation thread (see the module docstring).
    With `active` False every request is the shared namespace's (None)."""

    def __init__(self, active: bool):
        self.active = active
        self._local = threading.local()
        self._tags: dict[int, tuple[weakref.ref, object]] = {}
        self._lock = threading.Lock()
        self.unknown = 0  # lookups and inserts served without the store: no tenant known

    def begin(self, tenant: str | None) -> None:
        """The next lookup on this thread is for a request of `tenant`."""
        self._local.next = tenant

    def take(self) -> object:
        """The tenant of the lookup now being made on this thread (told by `begin`, else the
        request this thread serves alone, `single`; `UNKNOWN` when neither); it is then this
        thread's last lookup's (`last`)."""
        if not self.active:
            return None
        tenant = getattr(self._local, "next", UNKNOWN)
        if tenant is UNKNOWN:  # (every lookup within `for_tenant` is its tenant's, not the first alone)
            tenant = getattr(self._local, "single", UNKNOWN)
        self._local.next = UNKNOWN
        self._local.last = tenant
        return tenant

    def last(self) -> object:
        """The tenant of this thread's last lookup."""
        return getattr(self._local, "last", UNKNOWN) if self.active else None

    @contextlib.contextmanager
    def single(self, tenant: object) -> Iterator[None]:
        """Within: this thread serves one request of `tenant`, whose lookup and inserts are its."""
        before = getattr(self._local, "single", UNKNOWN)
        self._local.single = tenant
        self.begin(tenant)
        try:
            yield
        finally:  # (a block that made no lookup must not leave its tenant to the next one, outside it)
            self._local.single, self._local.next = before, UNKNOWN

    def tag(self, cache: Any, tenant: object) -> None:
        """`cache` (a list of cache layers) belongs to a request of `tenant`."""
        if not self.active or not cache or tenant is UNKNOWN:
            return
        try:
            ref = weakref.ref(cache[0])
        except TypeError:
            return
        with self._lock:
            if len(self._tags) >= MAX_TAGS:
                self._tags = {k: v for k, v in self._tags.items() if v[0]() is not None}
                while len(self._tags) >= MAX_TAGS:
                    self._tags.pop(next(iter(self._tags)))
            self._tags[id(cache)] = (ref, tenant)

    def of_cache(self, cache: Any) -> object:
        """The tenant of the request `cache` is of: as tagged, else the request this thread serves
        alone, else `UNKNOWN`."""
        if not self.active:
            return None
        with self._lock:
            found = self._tags.pop(id(cache), None)
        if found is not None and cache and found[0]() is cache[0]:
            return found[1]
        return getattr(self._local, "single", UNKNOWN)


def describe_tenants(policy: TenantPolicy) -> str:
    """How a server tells tenants, in a log line's words (never a value)."""
    if policy.source == "none":  # (requests name no tenant: a header's server refuses them, or takes the default)
        if policy.trust_client_salt:
            return ("the tenant is a request's cache_salt; requests without one are one tenant of their own, "
                    "never the shared prompts")
        return ("this server's requests are one tenant of their own, never the shared prompts (the store "
                "serves tenants)") if policy.unnamed else "one tenant"
    how = "the tenant is the bearer token" if policy.source == "bearer" else f"the tenant is the {policy.source} header"
    if policy.default is not None:
        how += ", a default tenant for requests without it"
    if policy.trust_client_salt:
        how += ", a request's cache_salt splits it further"
    return how


def serves_tenants(store) -> bool:
    """Whether `store` holds tenants' records or a server serving tenants apart has used it: then
    a request written to its shared namespace would be reused (and so detectable) by every tenant."""
    index = store.index
    return index is not None and bool(index.tenant_totals() or index.marks(TENANTS_MARK))


def shared_bytes(store) -> int | None:
    """Bytes of the records `store` holds without a tenant (what every tenant reuses), or None."""
    if store.index is None:
        return None
    return store.index.totals()["bytes"] - sum(size for _, size in store.index.tenant_totals().values())


def mark_tenants(store) -> None:
    """Record in `store` that a server serving tenants apart uses it (see `serves_tenants`)."""
    if store.index is not None and not store.read_only:
        store.index.raise_mark(TENANTS_MARK, 1)


class SharedWrites:
    """Whether a server that stores every request in the shared namespace (`--tenant-from none`)
    may go on doing so: not once its store serves tenants (looked at every `EVERY_S` seconds),
    whose requests would reuse this server's clients' prompts as shared ones."""

    EVERY_S = 2.0

    def __init__(self):
        self._looked = -self.EVERY_S
        self.stopped = False

    def allowed(self, store) -> bool:
        now = time.monotonic()
        if not self.stopped and now - self._looked >= self.EVERY_S:
            self._looked = now
            self.stopped = serves_tenants(store)
            if self.stopped:
                log.warning("kvstore: warning: a server serving tenants apart now uses this store; this "
                            "server (--tenant-from none) stores none of its requests from now on, since "
                            "every tenant would reuse them as shared prompts: restart it to store them as "
                            "a tenant of their own")
        return not self.stopped
