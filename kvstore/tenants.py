"""Tenants: whose cache a record is, as the keys and the headers see it.

A tenant is a salt the store derives from the tenant's id with an HMAC under a server secret
(`derive`): the fleet secret when the store has a remote tier, else a key kept in the store. The
salt never leaves the process; what is shown of a tenant is its `tag`, a short HMAC of the salt.

A prompt's records follow the shared namespace (records the operator stored without a tenant) for
as many whole chunks as shared records cover; every record after that is the tenant's: its key is
the hash of its `link` (an HMAC of its parent under the salt) and its tokens, where a shared
record's is the hash of its parent and its tokens (`keys.chain`, `records.prompt_records`). So no
one without the salt can name a tenant's record, and a record of one tenant is never a key of
another's prompt. A tenant's record carries its tag and its link in its blob header (the header
fields `x-tenant` and `x-link`), so any reader can check that its tokens are its key's.

A tenant a request's `cache_salt` splits off another (`salted_id`) has that tenant as its `owner`:
it shares the owner's quota (`tenant_max_bytes`), so new salts never add disk to a tenant. The
index keeps each such tenant's owner tag (`tenant_owners`, written with its first records), and
its records state it in their header (`x-owner`), from which a rebuilt index takes it back.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field

from kvstore.errors import InvalidInputError

SALT_BYTES = 32
TAG_HEX = 16  # 64 bits: two tenants of a store never share a tag by chance
MAX_ID_BYTES = 4096
#: The blob header fields of a tenant's record (`storage.blobformat` registers them, with `x-`).
TAG_FIELD, LINK_FIELD, OWNER_FIELD = "tenant", "link", "owner"
HEADER_PREFIX = "x-"  # (blobformat.EXTENSION_PREFIX: records.check reads the fields without it)
_TAG = re.compile(r"[0-9a-f]{%d}" % TAG_HEX)
_LINK = re.compile(r"[0-9a-f]{32}")
_PURPOSE = b"kvstore tenant salt\0"
#: What joins a tenant's id and a request's `cache_salt` into the id of the tenant the salt splits
#: off (`salted_id`): a control character, which no tenant header or bearer token holds.
SALT_SEPARATOR = "\x1fcache_salt:"
#: The tenant of requests that name none where others do (`kvstore serve`'s, with tenants apart),
#: and so the owner of the tenants their `cache_salt`s split off. (No header or token holds "\x1f".)
UNNAMED = "\x1fno tenant named"


@dataclass(frozen=True)
class Tenant:
    """One tenant: its salt (secret) and its tag (what stats, metrics and headers show).
    `previous`: the same tenant under the keys a store still reads from after a key rotation
    (`remote.seal`): its old records are found under those salts until they go."""

    salt: bytes = field(repr=False)
    tag: str
    key_id: str = ""  # the server secret it was derived under ("" : the store's own key)
    owner: str | None = None  # the tag of the tenant whose quota it shares (`owner_id`; None: its own)
    previous: tuple["Tenant", ...] = field(default=(), repr=False)

    def link(self, parent: bytes) -> bytes:
        """What a record of this tenant under `parent` hashes its tokens with, in place of the
        parent: a keyed BLAKE2b of the parent (16 bytes)."""
        return hashlib.blake2b(parent, key=self.salt, digest_size=16, person=b"kvstore-link").digest()

    def variants(self) -> tuple["Tenant", ...]:
        """This tenant under the current key, then under each older key still read."""
        return (self, *self.previous)


def sees(tenant: Tenant | None, tag: str | None) -> bool:
    """Whether a record of tenant `tag` (None: shared) may serve `tenant` (None: the shared
    namespace, which sees shared records only)."""
    return tag is None or (tenant is not None and any(t.tag == tag for t in tenant.variants()))


def derive(secret: bytes, tenant_id: str, *, key_id: str = "") -> Tenant:
    """The tenant `tenant_id` under the server `secret` (ValueError for an id that is not one)."""
    raw = check_id(tenant_id).encode("utf-8")
    salt = hmac.new(secret, _PURPOSE + raw, hashlib.sha256).digest()
    owner = owner_id(tenant_id)
    return Tenant(salt, tag_of(salt), key_id, None if owner is None else derive(secret, owner).tag)


def owner_id(tenant_id: str) -> str | None:
    """The id of the tenant whose quota tenant `tenant_id` shares: for an id `salted_id` made, the
    tenant the salt split it off (`UNNAMED` for requests that name no tenant); None for any other."""
    owner, salted, _ = tenant_id.partition(SALT_SEPARATOR)  # (the first: a salt may hold it too)
    return (owner or UNNAMED) if salted else None


def salted_id(tenant_id: str | None, salt: str) -> str:
    """The id of the tenant a request's `cache_salt` of `salt` splits off tenant `tenant_id` (None:
    requests that name no tenant), as `kvstore serve --trust-client-salt` derives it and `kvstore gc
    --drop-tenant-salt` names it; ValueError if `salt` is not non-empty text, or the id is longer
    than MAX_ID_BYTES (`check_id`)."""
    if not isinstance(salt, str) or not salt:
        raise ValueError("a cache_salt is a non-empty string")
    return check_id((tenant_id or "") + SALT_SEPARATOR + salt)


def tag_of(salt: bytes) -> str:
    """A tenant's tag: 16 hex digits of an HMAC of its salt (tells nothing of the salt or the id)."""
    return hmac.new(salt, b"kvstore tenant tag", hashlib.sha256).hexdigest()[:TAG_HEX]


def check_id(tenant_id: object) -> str:
    """A tenant id as given (text of 1 to 4096 bytes), or ValueError saying what is wrong (never
    quoting it: an id may be a bearer token)."""
    if not isinstance(tenant_id, str):
        raise ValueError(f"a tenant id is text, got {type(tenant_id).__name__}")
    n = len(tenant_id.encode("utf-8", "surrogatepass"))
    if not 0 < n <= MAX_ID_BYTES:
        raise ValueError(f"a tenant id is 1 to {MAX_ID_BYTES} bytes, this one is {n}")
    return tenant_id


def parse_tag(text: str) -> str:
    """A tag as a header or the index holds it (ValueError if it is not one)."""
    if not isinstance(text, str) or not _TAG.fullmatch(text):
        raise ValueError(f"a tenant tag is {TAG_HEX} hex digits")
    return text


def tag_list(tags) -> list:
    """`gc(drop_tenants=...)`'s tags as a list; one text alone is refused (it would read as one
    tag per character)."""
    if isinstance(tags, (str, bytes)):
        raise InvalidInputError(f"drop_tenants: give a list of tenant tags, as stats()['tenants'] names "
                                f"them, not one text: drop_tenants=[{tags!r:.40}]")
    return list(tags)


def parse_link(text: str) -> bytes:
    """A record's link as its header holds it: 32 hex digits (ValueError if not)."""
    if not isinstance(text, str) or not _LINK.fullmatch(text):
        raise ValueError("a link is 32 hex digits")
    return bytes.fromhex(text)


def header_fields(tag: str | None, link: bytes | None, owner: str | None = None) -> dict[str, str]:
    """The header fields a record of tenant `tag` carries (none for a shared record; no link for
    a checkpoint, whose key is made from its record's alone; the `owner` tag of a salted tenant)."""
    if tag is None:
        return {}
    return {TAG_FIELD: tag, **({LINK_FIELD: link.hex()} if link is not None else {}),
            **({OWNER_FIELD: owner} if owner is not None else {})}


def stated_owner(metadata) -> str | None:
    """The owner tag a blob header states (None: none); ValueError if it is not a tag."""
    owner = metadata.get(HEADER_PREFIX + OWNER_FIELD)
    return None if owner is None else parse_tag(owner)


def stated(metadata) -> tuple[str | None, bytes | None]:
    """(tag, link) a blob header states (None, None for a shared record); ValueError if bad."""
    tag = metadata.get(HEADER_PREFIX + TAG_FIELD)
    link = metadata.get(HEADER_PREFIX + LINK_FIELD)
    return (None if tag is None else parse_tag(tag)), (None if link is None else parse_link(link))
