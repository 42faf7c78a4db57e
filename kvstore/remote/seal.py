"""The fleet secret, and what it does to every object of the bucket: sealed, and named by MAC.

The nodes of one fleet share a 32-byte secret (`KVSTORE_REMOTE_KEY`, or `kvstore.open(...,
remote_key=...)`, or a key file in the CLI; `kvstore remote-key` prints a new one, in base64url).
Whoever lacks it (a bucket reader or writer, the network path) can neither read an object nor
make a node use one it wrote: every object is AES-256-GCM sealed, under a key derived per
namespace with HKDF-SHA256, with a fresh random 96-bit nonce, and with its key (its path
relative to the remote's prefix, so a fleet may move its whole prefix) as associated data, so an
object copied to another key fails to open.

Object keys hold no tokens either: a record is named by an HMAC-SHA256 (truncated to 128 bits)
of its chain hash under a per-namespace naming key, a children folder by one of (parent, first
token), a namespace by one of its hash under a fleet-wide key. A node that knows the prompt
computes every key it asks for; gc rebuilds the tree from the names alone.

A tenant's records (`kvstore.tenants`) are sealed under a key of the tenant's own (`TenantSealer`:
HKDF of the fleet secret, the namespace and the tenant's salt), and its children of any record go
in a folder whose name is an HMAC of the salt too: only a node serving that tenant can name, list
or open them. Tenants' salts are derived under a secret derived from the fleet secret
(`Fleet.tenant_secret`), so every node of a fleet gives one tenant the same salt.

Key rotation: a fleet may hold older secrets besides its own (`Fleet.older`): objects are written
with the first key only, and read with it, then with the older ones; `kvstore gc --remote
--drop-key ID` deletes what only an older key opens. A key is named by its `key_id`.

A sealed object is `MAGIC ‖ nonce (12 bytes) ‖ ciphertext ‖ tag (16 bytes)`; nothing else, no
object metadata.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
import struct
import threading
from collections import OrderedDict
from typing import Callable

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvstore.errors import BlobError, InvalidInputError
from kvstore.tenants import Tenant
from kvstore.trust import key_id  # a key's name: one for the fleet's seals and its trust tags

#: The environment variable that holds the fleet secret.
KEY_ENV = "KVSTORE_REMOTE_KEY"
#: The command that prints a new one.
KEY_COMMAND = "kvstore remote-key"
KEY_BYTES = 32
MAGIC = b"kvs2"
NONCE_BYTES = 12
TAG_BYTES = 16
#: What sealing adds to an object.
OVERHEAD = len(MAGIC) + NONCE_BYTES + TAG_BYTES
_PURPOSE = b"kvstore-remote-2"
_HEX = re.compile(r"[0-9a-fA-F]{64}")
_TENANTS_REMEMBERED = 1 << 16  # tenants a node seals uploads for (the least recent is forgotten)
_SEALERS_KEPT = 1 << 12
_BASE64URL = re.compile(r"[A-Za-z0-9_-]{43}=?")
MARK_HEX = 4  # hex digits of a mark: a false match (1 in 65,536) costs one download, caught by its check


class Unauthenticated(BlobError):
    """An object that does not open with the fleet's key (planted, copied, damaged or old)."""


def new_key() -> str:
    """A new random fleet secret, as `kvstore remote-key` prints it (base64url, 43 characters)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(KEY_BYTES)).rstrip(b"=").decode()


def parse_key(value: str | bytes, where: str) -> bytes:
    """The 32 bytes of a fleet secret given as base64url (or hex) text, or as raw bytes;
    InvalidInputError naming `where` (never the value) otherwise."""
    if isinstance(value, (bytes, bytearray, memoryview)) and len(value) == KEY_BYTES:
        return bytes(value)
    text = value.decode("ascii", "replace") if isinstance(value, (bytes, bytearray, memoryview)) else value
    if not isinstance(text, str):
        raise InvalidInputError(f"{where}: the fleet secret must be text or bytes, got {type(value).__name__}")
    text = text.strip()
    raw = b""
    if _HEX.fullmatch(text):
        raw = bytes.fromhex(text)
    elif _BASE64URL.fullmatch(text):
        raw = base64.urlsafe_b64decode(text.rstrip("=") + "=")
    if len(raw) != KEY_BYTES:
        raise InvalidInputError(f"{where}: a fleet secret is {KEY_BYTES} random bytes in base64url (43 characters) "
                                f"or hex (64); this is not one (make one with `{KEY_COMMAND}`)")
    return raw


class Keys(list):
    """The fleet's secrets (the one written with first), and `where` they came from (the
    environment variable, a key file, `remote_key`): what a message about the key names."""

    def __init__(self, keys, where: str):
        super().__init__(keys)
        self.where = where


def parse_keys(value, where: str) -> Keys:
    """The fleet's secrets in `value`: one key, or several (text separated by commas or lines, or
    a list), the one written with first and older ones, still read, after (key rotation)."""
    if isinstance(value, (list, tuple)):
        parts = list(value)
    elif isinstance(value, (bytes, bytearray, memoryview)) and len(value) == KEY_BYTES:
        parts = [bytes(value)]
    else:
        text = value.decode("ascii", "replace") if isinstance(value, (bytes, bytearray, memoryview)) else value
        if not isinstance(text, str):
            raise InvalidInputError(f"{where}: the fleet secret must be text or bytes, got {type(value).__name__}")
        parts = [p for p in re.split(r"[\s,]+", text) if p]
    keys = [parse_key(p, where) for p in parts]
    if not keys:
        raise InvalidInputError(f"{where}: holds no fleet secret (make one with `{KEY_COMMAND}`)")
    if len(set(keys)) != len(keys):
        raise InvalidInputError(f"{where}: holds the same fleet secret twice")
    return Keys(keys, where)


def fleet_keys(remote_key=None, env: dict | None = None) -> Keys:
    """The fleet's secrets (`parse_keys`): `remote_key` if given (`Keys` read from a key file keep
    its name), else `$KVSTORE_REMOTE_KEY`; a remote tier without one is refused."""
    if remote_key is not None:
        return parse_keys(remote_key, getattr(remote_key, "where", "remote_key"))
    value = (os.environ if env is None else env).get(KEY_ENV)
    if not value:
        raise InvalidInputError(
            f"a remote tier needs the fleet secret: set {KEY_ENV} (or pass remote_key=, or "
            f"--remote-key-file) to the key every node of the fleet shares; make one with `{KEY_COMMAND}`")
    return parse_keys(value, KEY_ENV)


def fleet_secret(remote_key: str | bytes | None = None, env: dict | None = None) -> bytes:
    """The fleet secret objects are written with (the first of `fleet_keys`)."""
    return fleet_keys(remote_key, env)[0]


def read_key_file(path: str) -> Keys:
    """The fleet's secrets in a key file (as `kvstore remote-key` prints one; after a rotation,
    the new one first, then the older ones, a line each)."""
    try:
        with open(path, "rb") as f:
            text = f.read(4096)
            mode = os.fstat(f.fileno()).st_mode
    except OSError as e:
        raise InvalidInputError(f"cannot read the remote key file {path}: {e.strerror or e}") from None
    if mode & 0o077 and not _warned_modes.get(path):  # as ssh says of a private key others can read
        _warned_modes[path] = True
        logging.getLogger("kvstore").warning(
            "kvstore: warning: the remote key file %s can be read by other users of this machine (mode %o): "
            "anyone who reads it reads every prompt of the bucket; `chmod 600 %s`", path, mode & 0o777, path)
    return parse_keys(text.decode("ascii", "replace"), f"the remote key file {path}")


_warned_modes: dict[str, bool] = {}  # key files whose mode this process warned of


def _derive(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


class Fleet:
    """What the fleet secret gives: a `Sealer` per namespace (and tenant), the namespaces' folder
    names, the secret tenants' salts are derived under; `older`: the fleets of the older secrets
    still read (a rotation not finished); `where`: where the secret came from, which a message
    that doubts it names (never the secret)."""

    def __init__(self, secret: bytes, older: list[bytes] | tuple = (), where: str = KEY_ENV):
        if not isinstance(secret, bytes) or len(secret) != KEY_BYTES:
            raise InvalidInputError(f"a fleet secret is {KEY_BYTES} bytes")
        self._secret = secret
        self.where = where
        self.key_id = key_id(secret)
        self.older = [Fleet(k) for k in older]
        self._ns_names = _derive(secret, _PURPOSE + b" namespace names")
        self._sealers: dict[tuple, Sealer] = {}
        self._tenants: OrderedDict[str, Tenant] = OrderedDict()  # tag -> tenant, for uploads
        self._lock = threading.Lock()

    @classmethod
    def of(cls, keys: list[bytes]) -> "Fleet":
        """The fleet of `fleet_keys`' secrets: written with the first, read with each."""
        return cls(keys[0], keys[1:], getattr(keys, "where", KEY_ENV))

    def __repr__(self) -> str:  # never shows the secret
        return f"Fleet(<secret {self.key_id}>)"

    def keyring(self) -> list["Fleet"]:
        """This fleet, then the older ones: the order keys are tried in."""
        return [self, *self.older]

    def by_key(self, kid: str) -> "Fleet | None":
        return next((f for f in self.keyring() if f.key_id == kid), None)

    def tenant_secret(self) -> bytes:
        """The server secret tenants' salts are derived under (`tenants.derive`)."""
        return _derive(self._secret, _PURPOSE + b" tenants")

    def remember(self, tenant: Tenant) -> None:
        """Know `tenant` by its tag (the uploader seals its rows, which name it by tag only)."""
        with self._lock:
            self._tenants[tenant.tag] = tenant
            self._tenants.move_to_end(tenant.tag)
            while len(self._tenants) > _TENANTS_REMEMBERED:
                self._tenants.popitem(last=False)

    def tenant_of(self, tag: str) -> Tenant | None:
        with self._lock:
            return self._tenants.get(tag)

    def ns_name(self, ns: bytes) -> str:
        """The folder of a namespace (32 hex digits)."""
        return hmac.new(self._ns_names, ns, hashlib.sha256).digest()[:16].hex()

    def marker_name(self) -> str:
        """The name of this key's marker in the bucket (`layout.marker_key`): a MAC of a constant
        under the key, so only a holder of the key can name it, and it tells nothing of the key."""
        return hmac.new(self._secret, b"kvstore key marker", hashlib.sha256).digest()[:16].hex()

    def marker_box(self) -> "Box":
        """The key a marker's body is sealed with."""
        return Box(_derive(self._secret, _PURPOSE + b" key marker"))

    def manifest_box(self, folder: str) -> "Box":
        """The key of a namespace's manifest, derived from its folder name: gc and verify open a
        manifest to learn which namespace a folder is before they know its hash."""
        return Box(_derive(self._secret, _PURPOSE + b" manifest " + folder.encode()))

    def sealer(self, ns: bytes, tenant: Tenant | None = None) -> "Sealer":
        """The keys of a namespace's shared objects, or (`tenant`) of that tenant's objects in it."""
        slot = (ns, tenant.salt if tenant is not None else None)
        with self._lock:
            s = self._sealers.get(slot)
            if s is None:
                if len(self._sealers) > _SEALERS_KEPT:
                    self._sealers.clear()
                s = self._sealers[slot] = Sealer(self, ns) if tenant is None else TenantSealer(self, ns, tenant)
            return s


class Box:
    """Sealing and opening objects under one AES-256-GCM key."""

    __slots__ = ("_aead", "_key")

    def __init__(self, key: bytes):
        self._aead, self._key = AESGCM(key), key

    def seal(self, key: str, data) -> bytes:
        """`data` sealed for the object key `key` (relative to the prefix)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        return MAGIC + nonce + self._aead.encrypt(nonce, data, key.encode())

    def open(self, key: str, body) -> bytes:
        """The plaintext of the object at `key`; Unauthenticated if it was not sealed for that
        key by a holder of the fleet secret (or is damaged). (A download is opened as it
        arrives instead: `opener`.)"""
        view = memoryview(body)
        if len(view) < OVERHEAD or view[: len(MAGIC)] != MAGIC:
            raise Unauthenticated("it is not a sealed object of this layout")
        nonce = bytes(view[len(MAGIC): len(MAGIC) + NONCE_BYTES])
        try:
            return self._aead.decrypt(nonce, view[len(MAGIC) + NONCE_BYTES:], key.encode())
        except InvalidTag:
            raise Unauthenticated("it does not open with the fleet's key (planted, copied or damaged)") from None

    def opener(self, key: str) -> Callable[[int], "Opening"]:
        """What a download of the object at `key` writes its bytes to as they arrive (a
        `Bucket.get`'s `into`): they are opened part by part into one buffer, with no copy of the
        sealed bytes, and authenticated at the end (`Opening.done`)."""
        return lambda size: Opening(self._key, key.encode(), size)


class Opening:
    """A sealed object opened as its bytes arrive, in order (`write`), into one buffer of its
    size; `done` authenticates it and gives the plaintext (a view of that buffer). Nothing of
    what was written may be used unless `done` returns: until the tag is checked it is only
    what someone sent."""

    __slots__ = ("_key", "_aad", "size", "_pos", "_head", "_tag", "_view", "_done", "_opener")

    def __init__(self, key: bytes, aad: bytes, size: int):
        if size < OVERHEAD:
            raise Unauthenticated("it is not a sealed object of this layout")
        self._key, self._aad, self.size = key, aad, size
        self._pos = 0  # bytes of the object written so far
        self._head, self._tag = bytearray(), bytearray()
        # update_into wants room for a block more than it writes: the overhead's bytes give it.
        self._view = memoryview(bytearray(size))
        self._done = 0  # plaintext bytes written
        self._opener = None

    def write(self, part) -> None:
        part = memoryview(part)
        head, tag_at = len(MAGIC) + NONCE_BYTES, self.size - TAG_BYTES
        start, end = self._pos, self._pos + len(part)
        if end > self.size:
            raise Unauthenticated("more bytes than its stated size")
        if start < head:  # magic and nonce
            self._head += part[: head - start]
            if len(self._head) == head:
                if self._head[: len(MAGIC)] != MAGIC:
                    raise Unauthenticated("it is not a sealed object of this layout")
                opener = Cipher(algorithms.AES(self._key), modes.GCM(bytes(self._head[len(MAGIC):]))).decryptor()
                opener.authenticate_additional_data(self._aad)
                self._opener = opener
        lo, hi = max(start, head), min(end, tag_at)
        if lo < hi:
            self._done += self._opener.update_into(part[lo - start : hi - start], self._view[self._done :])
        if end > tag_at:
            self._tag += part[max(start, tag_at) - start :]
        self._pos = end

    def done(self) -> memoryview:
        """The plaintext, once every byte came and the tag holds; Unauthenticated if not."""
        if self._pos != self.size or self._opener is None:
            raise Unauthenticated(f"{self._pos} of its {self.size} bytes came")
        try:
            self._opener.finalize_with_tag(bytes(self._tag))
        except (InvalidTag, ValueError):
            raise Unauthenticated("it does not open with the fleet's key (planted, copied or damaged)") from None
        return self._view[: self._done]


class Sealer(Box):
    """One namespace's keys: sealing its objects and naming its records."""

    __slots__ = ("ns", "folder", "key_id", "_names", "_mark_key")
    owned = False  # a tenant's objects (`TenantSealer`)

    def __init__(self, fleet: Fleet, ns: bytes):
        super().__init__(_derive(fleet._secret, _PURPOSE + b" seal " + ns))
        self.ns = ns
        self.key_id = fleet.key_id
        self.folder = fleet.ns_name(ns)
        self._names = _derive(fleet._secret, _PURPOSE + b" names " + ns)
        self._mark_key = self._names

    def name(self, h: bytes) -> str:
        """A record's name (32 hex digits); the namespace itself is named by its folder, so a
        root chunk's parent reads as its namespace."""
        if h == self.ns:
            return self.folder
        return hmac.new(self._names, b"r" + h, hashlib.sha256).digest()[:16].hex()

    def children(self, parent: bytes, first_token: int) -> str:
        """The name of the folder of `parent`'s children that start with `first_token`."""
        msg = b"c" + parent + struct.pack("<i", int(first_token))
        return hmac.new(self._names, msg, hashlib.sha256).digest()[:8].hex()

    def marks(self, parent: bytes, tokens: np.ndarray, lengths: list[int]) -> list[str]:
        """A short MAC (4 hex digits) of each prefix of a child of `parent`'s tokens, one per
        length in `lengths` (`layout.mark_lengths`): what a key says of its tokens, so a node
        that knows a prompt tells how far a child shares it without downloading it."""
        data = memoryview(parent + np.ascontiguousarray(tokens, dtype="<i4").tobytes())
        base = hmac.new(self._mark_key, b"m", hashlib.sha256)
        out = []
        for n in lengths:
            h = base.copy()
            h.update(data[: len(parent) + 4 * n])
            out.append(h.hexdigest()[:MARK_HEX])
        return out


class TenantSealer(Sealer):
    """One tenant's keys in a namespace: its objects are sealed under a key of its own, and its
    children folders are named with its salt; records are named as the namespace names them, so
    gc, which sees names only, keeps the tree whole."""

    __slots__ = ("tenant", "_branches")
    owned = True

    def __init__(self, fleet: Fleet, ns: bytes, tenant: Tenant):
        super().__init__(fleet, ns)
        self._key = _derive(fleet._secret, _PURPOSE + b" tenant seal " + ns + tenant.salt)
        self._aead = AESGCM(self._key)
        self._branches = _derive(fleet._secret, _PURPOSE + b" tenant branches " + ns + tenant.salt)
        self._mark_key = self._branches  # what a tenant's keys say of its tokens, only its nodes read
        self.tenant = tenant

    def children(self, parent: bytes, first_token: int) -> str:
        msg = b"t" + parent + struct.pack("<i", int(first_token))
        return hmac.new(self._branches, msg, hashlib.sha256).digest()[:8].hex()
