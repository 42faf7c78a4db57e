"""The errors kvstore raises. Every one is a `KVStoreError`; the message says what to do."""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class StoreOpenError(KVStoreError):
    """The store directory or its index cannot be opened or created."""


class NotAStoreError(StoreOpenError):
    """The folder is not a kvstore store (and kvstore will not make it one)."""


class SchemaTooNewError(StoreOpenError):
    """The index was written by a newer kvstore; this version will not touch it."""


class CorruptIndexError(StoreOpenError):
    """The SQLite index is damaged; `kvstore verify --repair` rebuilds it from the blobs."""


class IndexLostError(CorruptIndexError):
    """The index file is gone but the blobs are there; `kvstore verify --repair` rebuilds it."""


class InvalidInputError(KVStoreError, ValueError):
    """Tokens, caches or settings handed to kvstore are not what it needs."""


class UnknownTenantError(InvalidInputError):
    """A tenant tag named for deletion has no record in the store."""


class ModelFilesError(KVStoreError):
    """The files of a model (for its fingerprint) cannot be found or read."""


class BlobError(KVStoreError):
    """A blob file is missing, truncated, or does not match its checksum or name.

    Only the store catches this, and turns it into a cache miss.
    """


class TenantMismatchError(BlobError):
    """A record's blob states another tenant than the record was read as: never served.

    On the local disk it is the index row that is wrong (the blob's checksum vouches for its
    header): the record is not quarantined, and `kvstore verify --repair` mends the row.
    """


class WrongKeyError(BlobError):
    """A record read with a fleet secret that is not the one the store's trust tags were made
    with: never served nor uploaded, and never quarantined (the key is wrong, not the record)."""


class PackError(KVStoreError):
    """A KV pack cannot be made, moved or imported; nothing was imported, and the message says why."""


def check_flags(**flags: object) -> None:
    """Refuse (`InvalidInputError`, naming it) a flag that is not True or False: "no" reads as true,
    and would repair, evict or turn on what the caller meant to leave alone."""
    for name, flag in flags.items():
        numpy_bool = getattr(getattr(flag, "dtype", None), "kind", None) == "b" and getattr(flag, "ndim", 1) == 0
        if not (isinstance(flag, bool) or numpy_bool):
            raise InvalidInputError(f"{name}: give True or False, not {flag!r:.30}")
