"""The S3 backend of the bucket protocol: any S3-compatible store (AWS S3, MinIO, Ceph RGW,
Garage, R2, SeaweedFS), through obstore, with bounded timeouts and retries.

Endpoint, region and credentials come only from the standard AWS environment and config chain
(`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
`AWS_REGION`, `AWS_PROFILE` and the shared `~/.aws/credentials` / `~/.aws/config` files); they are
handed to the client and never logged or stored.
"""

from __future__ import annotations

import configparser
import logging
import os
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterator

from kvstore.errors import BlobError, InvalidInputError
from kvstore.remote.bucket import (
    MAX_OBJECT_BYTES,
    BucketMissing,
    RemoteAuthError,
    RemoteError,
    RemoteUnreachable,
    TooLarge,
    TooLate,
)

log = logging.getLogger("kvstore")

# -- the URL and the AWS configuration chain ---------------------------------------------------

BUCKET_CLASS = "S3Bucket"
#: What any S3 store may call a bucket (AWS's rules are narrower: lower case, 3 to 63; older
#: buckets and other stores allow capitals and underscores).
_BUCKET_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


def check_url(url: str) -> None:
    """InvalidInputError unless `url`, and the endpoint the AWS settings give, can be used."""
    parse_url(url)
    endpoint = aws_settings().get("endpoint")
    if endpoint:
        check_endpoint(endpoint)


def parse_url(url: str) -> tuple[str, str]:
    """`s3://BUCKET/PREFIX` -> (bucket, prefix without slashes at either end)."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise InvalidInputError(f"remote must be an s3://BUCKET/PREFIX URL, got {url!r}")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket or any(c in bucket for c in " ?#"):
        raise InvalidInputError(f"remote {url!r} names no bucket (expected s3://BUCKET/PREFIX)")
    if not _BUCKET_NAME.fullmatch(bucket):
        # (The store would answer such a name with an error that reads like refused credentials.)
        raise InvalidInputError(f"remote {url!r}: {bucket!r} is not a bucket name (letters, digits, '.', "
                                "'-' and '_' only, up to 255)")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise InvalidInputError(f"remote {url!r}: the prefix has an empty, '.' or '..' part")
    return bucket, prefix


def aws_settings(env: dict | None = None) -> dict[str, str]:
    """Endpoint, region and credentials from the environment, else from the AWS profile files.

    Environment variables win (as with the AWS CLI); a profile (`AWS_PROFILE`, default
    `default`) fills what they leave out. Returns S3Store config keys.
    """
    env = os.environ if env is None else env
    out: dict[str, str] = {}
    for key, names in (("access_key_id", ("AWS_ACCESS_KEY_ID",)),
                       ("secret_access_key", ("AWS_SECRET_ACCESS_KEY",)),
                       ("session_token", ("AWS_SESSION_TOKEN",)),
                       ("region", ("AWS_REGION", "AWS_DEFAULT_REGION")),
                       ("endpoint", ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))):
        value = next((env[n] for n in names if env.get(n)), None)
        if value:
            out[key] = value
    profile = env.get("AWS_PROFILE") or "default"
    home = Path(env.get("HOME", "~")).expanduser()
    files = ((Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials"), profile),
             (Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config"),
              profile if profile == "default" else f"profile {profile}"))
    for path, section in files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(path)
        except (OSError, configparser.Error):
            continue
        if not parser.has_section(section):
            continue
        for key, name in (("access_key_id", "aws_access_key_id"), ("secret_access_key", "aws_secret_access_key"),
                          ("session_token", "aws_session_token"), ("region", "region"),
                          ("endpoint", "endpoint_url")):
            if key not in out and parser.get(section, name, fallback=None):
                out[key] = parser.get(section, name)
    out.setdefault("region", "us-east-1")
    return out


def check_endpoint(endpoint: str) -> None:
    """InvalidInputError unless `endpoint` is an http(s) URL with a host (and a port that can be):
    the S3 client takes anything here and panics at the first request (a Rust panic, which is no
    Python Exception, so it would end the command in a traceback)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(endpoint)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        parts, port_ok = None, False
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
            or any(c.isspace() for c in endpoint):
        raise InvalidInputError(
            f"the object store's endpoint {endpoint!r} (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or "
            "endpoint_url in the AWS profile) is not a URL like http://HOST:PORT or https://HOST")


_said_aws: set[str] = set()


def _say_aws_once(url: str, region: str) -> None:
    """No endpoint is configured: requests go to AWS itself. Right for AWS users, a surprise for
    anyone who meant a local object store and forgot AWS_ENDPOINT_URL: said once per process."""
    if url not in _said_aws:
        _said_aws.add(url)
        log.warning("kvstore: remote %s: AWS_ENDPOINT_URL is not set (nor endpoint_url in the AWS "
                    "profile), so requests go to AWS S3 in %s", url, region)


#: The parts a download is read in (obstore joins the network's pieces up to this size).
_PART_BYTES = 1 << 20


class S3Bucket:
    """One `s3://BUCKET/PREFIX`, through obstore, with bounded timeouts and retries.

    Reads (lookups, downloads) use short timeouts and one retry: a fetch has a deadline anyway.
    Writes (uploads, gc) run in the background and may take longer.
    """

    def __init__(self, url: str, *, connect_timeout: float = 1.0, read_timeout: float = 5.0,
                 write_timeout: float = 60.0):
        from obstore.store import S3Store

        self.url = url
        bucket, self.prefix = parse_url(url)
        settings = aws_settings()
        endpoint = settings.get("endpoint", "")
        if endpoint:
            check_endpoint(endpoint)
        else:
            _say_aws_once(url, settings["region"])
        base = {"allow_http": endpoint.startswith("http://"), "connect_timeout": timedelta(seconds=connect_timeout),
                "pool_idle_timeout": timedelta(seconds=30)}

        def make(timeout: float, retries: int, retry_timeout: float):
            retry = {"max_retries": retries, "retry_timeout": timedelta(seconds=retry_timeout),
                     "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=1),
                                 "base": 2}}
            try:
                return S3Store(bucket, prefix=self.prefix or None, config=settings,
                               client_options={**base, "timeout": timedelta(seconds=timeout)},
                               retry_config=retry)
            except Exception as e:  # obstore's message names the setting, never a secret value
                raise InvalidInputError(f"cannot configure the remote {url}: {e}") from None

        self._read = make(read_timeout, 1, 2.0)
        self._write = make(write_timeout, 2, 10.0)

    def __repr__(self) -> str:  # never shows credentials
        return f"S3Bucket({self.url!r})"

    def head(self, key: str) -> int | None:
        """The object's size, or None if there is none."""
        import obstore

        try:
            return int(obstore.head(self._read, key)["size"])
        except FileNotFoundError:
            return None
        except Exception as e:
            raise _error(self.url, "HEAD", key, e) from None

    def get(self, key: str, max_bytes: int = MAX_OBJECT_BYTES, until: float | None = None, into=None):
        """The object's bytes, or None if there is none. Its size is checked against `max_bytes`
        before its body is read (TooLarge), and the body is read into one buffer of that size,
        stopping once `time.monotonic()` passes `until` (TooLate). `into`: a function of the
        object's size that gives what its bytes are written to instead, part by part (its
        `write(part)`), returned once they all came (a download opened as it arrives:
        `seal.Box.opener`; a BlobError it raises is not the remote's error)."""
        import obstore

        try:
            result = obstore.get(self._read, key)
            size = int(result.meta["size"])
            if size > max_bytes:
                raise TooLarge(f"GET: {size} bytes, more than the record can be ({max_bytes})")
            sink = into(size) if into is not None else _Buffer(size)
            pos = 0
            for part in result.stream(min_chunk_size=_PART_BYTES):
                n = len(part)
                if pos + n > size:
                    raise TooLarge(f"GET: more bytes than its stated {size}")
                sink.write(part)
                pos += n
                if until is not None and time.monotonic() > until:
                    raise TooLate("GET: past the deadline, dropped")
            if pos != size:
                raise RemoteError(f"GET: {pos} of {size} bytes came")
            return sink if into is not None else sink.buf
        except FileNotFoundError:
            return None
        except (RemoteError, BlobError):
            raise
        except Exception as e:
            raise _error(self.url, "GET", key, e) from None

    def put_new(self, key: str, data: bytes) -> bool:
        """Create-only PUT (`If-None-Match: *`). False if the object exists (another node
        stored it first)."""
        import obstore
        from obstore.exceptions import AlreadyExistsError

        try:
            obstore.put(self._write, key, data, mode="create", use_multipart=False)
            return True
        except AlreadyExistsError:
            return False
        except Exception as e:
            raise _error(self.url, "PUT", key, e) from None

    def put(self, key: str, data: bytes) -> None:
        """An overwriting PUT (pins objects, which belong to one node)."""
        import obstore

        try:
            obstore.put(self._write, key, data, use_multipart=False)
        except Exception as e:
            raise _error(self.url, "PUT", key, e) from None

    def list(self, prefix: str) -> list[tuple[str, int, float]]:
        """(key, size, last modified as a Unix time) of every object under `prefix`."""
        return list(self.walk(prefix, reading=True))

    def list_page(self, prefix: str, limit: int) -> tuple[list[tuple[str, int, float]], bool]:
        """The first `limit` keys under `prefix` at most (S3 gives up to 1,000 a request), and
        whether there may be more: a folder flooded with keys costs one bounded request."""
        import obstore

        try:
            for batch in obstore.list(self._read, prefix or None, chunk_size=limit):
                got = [(m["path"], int(m["size"]), m["last_modified"].timestamp()) for m in batch[:limit]]
                return got, len(batch) >= limit
            return [], False
        except Exception as e:
            raise _error(self.url, "LIST", prefix, e) from None

    def folders(self, prefix: str) -> list[str]:
        """The names of the folders right under `prefix`."""
        import obstore

        try:
            found = obstore.list_with_delimiter(self._read, prefix or None)
        except Exception as e:
            raise _error(self.url, "LIST", prefix, e) from None
        return [p.rstrip("/").rpartition("/")[2] for p in found["common_prefixes"]]

    def walk(self, prefix: str, reading: bool = False) -> Iterator[tuple[str, int, float]]:
        import obstore

        try:
            for batch in obstore.list(self._read if reading else self._write, prefix or None, chunk_size=1000):
                for meta in batch:
                    yield meta["path"], int(meta["size"]), meta["last_modified"].timestamp()
        except Exception as e:
            raise _error(self.url, "LIST", prefix, e) from None

    def delete(self, keys: list[str]) -> None:
        import obstore

        for start in range(0, len(keys), 1000):
            try:
                obstore.delete(self._write, keys[start : start + 1000])
            except FileNotFoundError:
                pass
            except Exception as e:
                raise _error(self.url, "DELETE", keys[start], e) from None


class _Buffer:
    """A download's bytes, copied into one buffer of the object's size as they arrive."""

    __slots__ = ("buf", "_view", "_pos")

    def __init__(self, size: int):
        self.buf = bytearray(size)
        self._view, self._pos = memoryview(self.buf), 0

    def write(self, part) -> None:
        n = len(part)
        self._view[self._pos : self._pos + n] = part
        self._pos += n


def _error(url: str, method: str, key: str, e: BaseException) -> RemoteError:
    """A one-line error naming the request; obstore's messages hold URLs and status codes only.
    Refused credentials are said as such, without the key: every request fails the same way."""
    from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    settings = aws_settings()
    if "NoSuchBucket" in str(e):
        bucket = parse_url(url)[0]
        return BucketMissing(f"the remote {url}: the bucket {bucket!r} does not exist ({_endpoint_note(settings)}): "
                             "create it, or fix the bucket's name in the URL")
    if method == "LIST" and "404 Not Found" in str(e):
        # An S3 store says NoSuchBucket; a bare 404 to a listing is another server at that
        # address (a web server, the object store's other port): not a bucket that is missing.
        return RemoteUnreachable(
            f"the remote {url}: the endpoint answers, but not as an S3 store (a listing of the bucket got "
            f"404 Not Found without S3's NoSuchBucket; {_endpoint_note(settings)}): is AWS_ENDPOINT_URL (or "
            "endpoint_url in the AWS profile) the object store's S3 address and port?")
    if "access_key_id" not in settings and any(host in str(e) for host in _CREDENTIAL_SERVICES):
        # No key in the environment or the profile: the client asked the instance's credential
        # service, which is not there (it is not the endpoint that failed).
        return RemoteAuthError(
            f"the remote {url}: no credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set "
            f"(nor in the AWS profile), and no instance credentials could be had ({method} failed): set them, "
            f"or AWS_PROFILE; {_endpoint_note(settings)}")
    unreachable = next((w for w in _UNREACHABLE if w in str(e)), None)
    if unreachable is not None:
        return RemoteUnreachable(f"the remote {url}: cannot reach the object store ({_endpoint_note(settings)}; "
                                 f"{method} failed: {_UNREACHABLE[unreachable]}): "
                                 "is it running, and is AWS_ENDPOINT_URL (or endpoint_url in the AWS profile) right?")
    if isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or any(
            code in str(e) for code in ("SignatureDoesNotMatch", "InvalidAccessKeyId")):
        return RemoteAuthError(
            f"the bucket {url} refused the credentials ({method} was denied): check "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and that they may use "
            f"this bucket; {_endpoint_note(settings)}")
    return RemoteError(f"{method} {key}: {type(e).__name__}: {first[:300]}")


#: Where the S3 client asks for credentials when none are set: the instance metadata service
#: (EC2) and the container credentials endpoint (ECS).
_CREDENTIAL_SERVICES = ("169.254.169.254", "169.254.170.2", "[fd00:ec2::254]")

#: What obstore's message says when the endpoint does not answer, and how kvstore says it.
_UNREACHABLE = {"Connection refused": "connection refused", "dns error": "no such host",
                "error sending request": "no answer"}


def _endpoint_note(settings: dict) -> str:
    endpoint = settings.get("endpoint")
    return f"the endpoint is {endpoint}" if endpoint else f"the endpoint is AWS S3 ({settings['region']})"
