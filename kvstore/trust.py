"""Trust anchors: the MAC that says a node itself wrote (or checked) what decides its uploads.

Two things on a node's disk decide what it seals and uploads: the fingerprint memo (the digests
of the model's files, which make its namespace) and each blob's header (the record it names and
its tensors' checksums). A writer of the store folder could change either (plant a memo row for
another model's weights, or change a blob's K/V and fix its checksums) and an honest node would
seal the result for the whole fleet. So each memo row and each blob header carries a tag: an
HMAC-SHA256 under a key derived (HKDF-SHA256) from the fleet secret when the store has a remote
tier, else from the store's own random key (`trust.key` in the store folder). The fleet secret is
never in the folder: with a remote, a writer of the folder cannot make a tag that holds.

A tag is `<key id>:<64 hex digits>`. Checking one says `GOOD` (under one of the keys held:
the fleet's current or older secrets, or the store key), `WRONG` (a held key's id, a MAC that
does not hold: changed after it was tagged), `FOREIGN` (a key not held now: a store opened
without the remote it was tagged under) or `UNTAGGED`.

Knows bytes and strings only: no files, no SQL.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from enum import Enum
from typing import Mapping, Sequence

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvstore.errors import BlobError, WrongKeyError

#: The blob header field (`x-trust`, through `blobformat.register_extension`).
FIELD = "trust"
HEADER_KEY = "x-" + FIELD
KEY_BYTES = 32
_PURPOSE = b"kvstore-trust-1"
_TAG = re.compile(r"([0-9a-f]{8}):([0-9a-f]{64})")


class Verdict(Enum):
    GOOD = "good"
    WRONG = "wrong"
    FOREIGN = "foreign"
    UNTAGGED = "untagged"
    RETIRED = "retired"  # under a fleet key this store's tags were made with, dropped since (a rotation's end)


def parse_tag(text: str) -> str:
    """A tag's text, if it has a tag's shape (ValueError if not): a blob header validator."""
    if not _TAG.fullmatch(text):
        raise ValueError("a trust tag is <8 hex digits>:<64 hex digits>")
    return text


def key_id(secret: bytes) -> str:
    """A fleet secret's name (8 hex digits of an HMAC under it): what `stats`, `--drop-key` and a
    message about a key show. (Not the id in a tag, which names the key derived from it.)"""
    return hmac.new(secret, b"kvstore key id", hashlib.sha256).hexdigest()[:8]


def _derive(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=_PURPOSE + info).derive(secret)


class _Key:
    __slots__ = ("key_id", "_mac")

    def __init__(self, key: bytes):
        self._mac = key
        self.key_id = hmac.new(key, b"kvstore trust key id", hashlib.sha256).hexdigest()[:8]

    def tag(self, message: bytes) -> str:
        return f"{self.key_id}:{hmac.new(self._mac, message, hashlib.sha256).hexdigest()}"


class Trust:
    """The keys a node tags and checks its trust anchors with: it tags with the first, and checks
    with each. `fleet`: the keys come from the fleet secret (a writer of the folder cannot
    tag); else from the store key (kept in the folder: it only tells damage from intent).
    `names`: the fleet secrets' own ids (`key_id`); `mismatch`: why these are not the keys the
    store's tags were made with, or None (set by `upkeep.anchors.check_keys`)."""

    def __init__(self, keys: Sequence[bytes], *, fleet: bool, names: Sequence[str] = ()):
        if not keys:
            raise ValueError("trust needs a key")
        self._keys = [_Key(k) for k in keys]
        self.fleet = fleet
        self.names = list(names)
        self.mismatch: str | None = None
        self.retired: set[str] = set()  # key ids of the store's own tags from before a rotation ended

    @classmethod
    def for_fleet(cls, secrets: Sequence[bytes]) -> "Trust":
        """Keys derived from the fleet's secrets (the one objects are written with first)."""
        return cls([_derive(s, b" fleet") for s in secrets], fleet=True, names=[key_id(s) for s in secrets])

    @classmethod
    def for_store(cls, store_key: bytes) -> "Trust":
        """The key derived from a store's own key (a store without a remote tier)."""
        return cls([_derive(store_key, b" store")], fleet=False)

    @property
    def key_id(self) -> str:
        return self._keys[0].key_id

    @property
    def tag_ids(self) -> list[str]:
        """The key ids its tags carry, one per key."""
        return [k.key_id for k in self._keys]

    def holds(self, tag_key_id: str) -> bool:
        """Whether a tag's key id is one of these keys'."""
        return any(k.key_id == tag_key_id for k in self._keys)

    def __repr__(self) -> str:  # never shows a key
        return f"Trust(<{'fleet' if self.fleet else 'store'} {self.key_id}>)"

    def _check(self, message: bytes, tag: str | None) -> Verdict:
        if not tag:
            return Verdict.UNTAGGED
        kid = tag.split(":", 1)[0]
        key = next((k for k in self._keys if k.key_id == kid), None)
        if key is None:
            return Verdict.RETIRED if kid in self.retired else Verdict.FOREIGN
        return Verdict.GOOD if hmac.compare_digest(key.tag(message), tag) else Verdict.WRONG

    # -- the fingerprint memo -------------------------------------------------------------------

    def memo_tag(self, path: str, stamp: Sequence[int], digest: bytes, kind: str = "xxh3") -> str:
        """The tag of a memo row: a file's path, its stamp (size, mtime, device, inode, ctime)
        and the digest of its contents (`kind`: xxh3, or sha256: a row of one memo never holds
        as a row of the other)."""
        return self._keys[0].tag(_memo_message(path, stamp, digest, kind))

    def memo_ok(self, path: str, stamp: Sequence[int], digest: bytes, tag: str | None, kind: str = "xxh3") -> bool:
        return self._check(_memo_message(path, stamp, digest, kind), tag) is Verdict.GOOD

    # -- blob headers ---------------------------------------------------------------------------

    def sign(self, metadata: Mapping[str, str], tensors: Mapping[str, tuple[str, Sequence[int], int]]) -> dict[str, str]:
        """`metadata` (without its `checksums` entry, which `tensors` carry) with its tag: a MAC
        over every other field (the record it names, its format, its extension fields) and each
        tensor's name, dtype, shape and checksum. `tensors`: name -> (dtype tag, shape, xxh3_64)."""
        out = {k: v for k, v in metadata.items() if k != HEADER_KEY}
        out[HEADER_KEY] = self._keys[0].tag(_blob_message(out, tensors))
        return out

    def check(self, metadata: Mapping[str, str],
              tensors: Mapping[str, tuple[str, Sequence[int], int]]) -> Verdict:
        """What the tag of a blob header says (see `sign` for the arguments)."""
        return self._check(_blob_message(metadata, tensors), metadata.get(HEADER_KEY))

    def refusal(self, verdict: Verdict, created: float, epoch: float) -> str | None:
        """Why a record whose blob got `verdict` is not to be used (None: it may be). `created`:
        its row's time; `epoch`: when its store got tags (`Index.trust_epoch`). A record from
        before is taken as it is (it is tagged when the uploader checks it whole). With a
        remote tier a record since then must hold a fleet tag: a folder's writer can strip a
        tag or write one under a key of its own. Without one, only a wrong tag is refused."""
        if verdict is Verdict.WRONG:
            return "its trust tag does not hold (it changed after it was written)"
        if verdict in (Verdict.GOOD, Verdict.RETIRED) or created < epoch or not self.fleet:
            return None
        return f"it has no trust tag of this fleet ({verdict.value}, written after the store had tags)"

    def refuse(self, verdict: Verdict, created: float, epoch: float, where: object) -> None:
        """Raise BlobError (naming `where`) if a record whose blob got `verdict` is refused
        (`refusal`): damage. But while these keys are not the ones the store's tags were made
        with (`mismatch`: a wrong secret), a tag that is merely not theirs proves nothing: then
        WrongKeyError, a miss that leaves the record as it is."""
        why = self.refusal(verdict, created, epoch)
        if why is None:
            return
        if self.mismatch is not None and verdict is not Verdict.WRONG:
            raise WrongKeyError(f"{where}: {why}; {self.mismatch}")
        raise BlobError(f"{where}: {why}")


def _memo_message(path: str, stamp: Sequence[int], digest: bytes, kind: str) -> bytes:
    label = "memo" if kind == "xxh3" else f"memo-{kind}"  # (the xxh3 memo's rows from before kinds hold)
    return json.dumps([label, str(path), [int(v) for v in stamp], bytes(digest).hex()]).encode()


def _blob_message(metadata: Mapping[str, str], tensors: Mapping[str, tuple[str, Sequence[int], int]]) -> bytes:
    # Sorted pairs in JSON: one text for one header, however its dicts were ordered. (Checked on
    # every open of a blob: about twice as fast as JSON's own sort_keys over nested dicts.)
    meta = sorted((k, v) for k, v in metadata.items() if k not in ("checksums", HEADER_KEY))
    table = sorted((name, tag, shape, s) for name, (tag, shape, s) in tensors.items())
    return json.dumps(["blob", meta, table], separators=(",", ":")).encode()


def unsigned(metadata: Mapping[str, str]) -> dict[str, str]:
    """`metadata` without a tag (a header whose fields are about to change: its tag would not hold)."""
    return {k: v for k, v in metadata.items() if k != HEADER_KEY}
