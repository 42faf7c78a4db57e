"""The bucket protocol: the nine calls the remote tier makes of an object store.

A backend is one module with a class that answers these (see `s3.S3Bucket`), taking the URL, a
`parse_url(url)` and a `check_url(url)` (with the endpoint settings too) that raise
InvalidInputError for a URL it cannot use; it is chosen by the
URL's scheme (`BACKENDS`). Batching, deadlines and checking what comes back are the remote
tier's, not the backend's. Every method raises `RemoteError` when the store cannot be reached or
answers with an error; a missing object is None (or False), never an error.
"""

from __future__ import annotations

import importlib
from typing import Iterator, Protocol

from kvstore.errors import InvalidInputError, KVStoreError

#: URL scheme -> the module of its backend (which has `check_url` and the class `BUCKET_CLASS` names).
BACKENDS = {"s3": "kvstore.remote.s3"}

#: No record object is larger (a chunk of a 70B model is under 100 MB): a larger one is refused.
MAX_OBJECT_BYTES = 1 << 30


class RemoteError(KVStoreError):
    """The object store could not be reached or answered with an error; the caller goes local."""


class TooLarge(RemoteError):
    """The object is larger than what was asked for could be: it is not read."""


class TooLate(RemoteError):
    """A download ran past the time it was given: what it read is dropped."""


class RemoteSetupError(RemoteError):
    """A mistake in how the remote is set up, not a passing failure: every request fails the same
    way until it is fixed. Its message is kvstore's own (it names the URL and what to check, never
    a secret) and is said once."""


class RemoteAuthError(RemoteSetupError):
    """The object store refused the credentials (wrong key or secret, or no right to the bucket)."""


class RemoteUnreachable(RemoteSetupError):
    """The endpoint does not answer (down, or the wrong address)."""


class BucketMissing(RemoteSetupError):
    """The endpoint answers, and has no such bucket."""


class Bucket(Protocol):
    url: str

    def head(self, key: str) -> int | None:
        """The object's size, or None if there is none."""

    def get(self, key: str, max_bytes: int = MAX_OBJECT_BYTES, until: float | None = None, into=None):
        """The object's bytes (a bytearray), or None if there is none; TooLarge (read no further)
        if it is over `max_bytes`; TooLate once `time.monotonic()` passes `until` (what was read
        is dropped). `into`: a function of the object's size giving what the bytes are written
        to as they arrive (its `write(part)`), which is returned instead of a buffer."""

    def put_new(self, key: str, data: bytes) -> bool:
        """Create-only PUT: False if the object exists already (another node stored it)."""

    def put(self, key: str, data: bytes) -> None:
        """An overwriting PUT (objects that belong to one node, like its pins)."""

    def list(self, prefix: str) -> list[tuple[str, int, float]]:
        """(key, size, last modified as a Unix time) of every object under `prefix`, quickly."""

    def list_page(self, prefix: str, limit: int) -> tuple[list[tuple[str, int, float]], bool]:
        """The first `limit` of `list(prefix)` at most, in one request, and whether there may be more."""

    def folders(self, prefix: str) -> list[str]:
        """The names of the folders right under `prefix` (a listing with a delimiter);
        BucketMissing if the bucket does not exist."""

    def walk(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """The same as `list`, lazily, for a whole bucket (maintenance)."""

    def delete(self, keys: list[str]) -> None:
        """Delete these objects (missing ones are no error)."""


def _backend(url: str):
    _refuse_credentials(url)
    scheme = url.partition("://")[0] if isinstance(url, str) and "://" in url else None
    if scheme not in BACKENDS:
        known = ", ".join(f"{k}://BUCKET/PREFIX" for k in BACKENDS)
        raise InvalidInputError(f"remote must be a URL like {known}, got {url!r}")
    return importlib.import_module(BACKENDS[scheme])


def _refuse_credentials(url: object) -> None:
    """A URL with `KEY:SECRET@` before the bucket is refused, and never shown: it would be in
    every log line, error and `stats` that names the remote."""
    if not isinstance(url, str) or "://" not in url:
        return
    scheme, _, rest = url.partition("://")
    authority = rest.partition("/")[0]
    # (A secret may hold "/": then a ":" before the first "/", which no bucket name has, tells.)
    if "@" in authority or (":" in authority and "@" in rest):
        shown = f"{scheme}://...@{rest.rpartition('@')[2]}"
        raise InvalidInputError(
            f"the remote URL holds credentials before the bucket ({shown}): remove them, and give "
            "them as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the "
            "environment instead; kvstore never takes them from a URL")


def check_url_form(url: str) -> None:
    """Raise InvalidInputError unless `url` itself is well formed (its scheme, bucket and prefix;
    not the endpoint the environment gives): what a command line's `--remote` is checked for."""
    _backend(url).parse_url(url)


def check_url(url: str) -> None:
    """Raise InvalidInputError unless a backend can use `url` (nothing is contacted)."""
    _backend(url).check_url(url)


def open_bucket(url: str) -> Bucket:
    """The bucket at `url`, through the backend of its scheme (nothing is contacted yet)."""
    module = _backend(url)
    return getattr(module, module.BUCKET_CLASS)(url)
