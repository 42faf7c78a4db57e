"""Moving a pack: `push` a pack folder to a place, `pull` it from there into a new folder.

A place is an S3 URL (`s3://BUCKET/PREFIX`, through the remote tier's own bucket transport, with
the AWS settings of the environment), a `file://` URL or a plain folder. A pack's objects are
its files under the place, as they are: they are not sealed with a fleet secret, because a pack
is public to whoever can read the place, and trusted only by its signature (checked on import).

Push goes only to a place that holds nothing (a new or empty folder, an S3 prefix with no object
under it): a pack pushed over another would merge with it, and keep the other's signature and
blobs. It uploads the blobs first, then the signature, then `manifest.json`; pull reads the manifest
first and then only the files it lists, each no larger than it says (the signature at most
`signing.MAX_SIGNATURE_BYTES`), into a temporary folder renamed to the target once whole. Pull
checks nothing else: `kvstore pack import` does.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import InvalidInputError, PackError
from kvstore.packs.manifest import BLOBS, MANIFEST, MAX_MANIFEST_BYTES, SIGNATURE, blob_name, parse
from kvstore.packs.signing import MAX_SIGNATURE_BYTES
from kvstore.packs.verify import check_blobs_folder, check_file, is_free, pack_folder, read_file, settle
from kvstore.remote.bucket import RemoteError, TooLarge, open_bucket
from kvstore.sizes import plural


class Folder:
    """A folder as a place (`file://PATH` or a plain path): the bucket calls push and pull make."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.url = str(self.path)

    def is_empty(self) -> bool:
        """Whether the folder holds nothing (or is not there yet)."""
        return is_free(self.path)

    def head(self, key: str) -> int | None:
        p = self.path / key
        return p.stat().st_size if p.is_file() and not p.is_symlink() else None

    def get(self, key: str, max_bytes: int, until: float | None = None) -> bytes | None:
        if self.head(key) is None:
            return None
        return read_file(self.path / key, max_bytes)

    def put(self, key: str, data: bytes) -> None:
        target = self.path / key
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, target)


def place(url: str):
    """The place `url` names: an S3 bucket and prefix, or a folder."""
    if url.startswith("s3://"):
        return open_bucket(url)
    if "://" in url and not url.startswith("file://"):
        raise InvalidInputError(f"a pack is pushed to and pulled from s3://BUCKET/PREFIX, file://PATH or a "
                                f"folder, not {url!r}")
    return Folder(Path(url[len("file://"):] if url.startswith("file://") else url).expanduser())


@dataclass
class Moved:
    files: int
    bytes: int
    signed: bool


def push(folder: Path, url: str) -> Moved:
    """Copy the pack in `folder` (its manifest, the blobs it lists, its signature) to `url`, which
    must hold nothing yet (PackError, and nothing written, if it holds anything)."""
    folder = pack_folder(folder)
    raw = read_file(folder / MANIFEST, MAX_MANIFEST_BYTES)
    m = parse(raw)
    target = place(url)
    names = [blob_name(h) for h in m.records]
    signed = os.path.lexists(folder / SIGNATURE)
    if signed:
        names.append(SIGNATURE)
    try:
        check_blobs_folder(folder)
    except PackError as e:
        raise PackError(f"{e}: nothing pushed") from None
    limits = {name: MAX_SIGNATURE_BYTES if name == SIGNATURE else m.records[Path(name).stem][0] for name in names}
    for name in names:  # the whole pack is there before anything is pushed: no part of it is left there
        _whole(folder, name, limits[name], exact=name != SIGNATURE)
    total = done = 0
    try:
        _holds_nothing(target, url)
        for name in names:  # the manifest last: a reader that finds it finds the rest
            data = read_file(folder / name, limits[name])
            target.put(name, data)
            total += len(data)
            done += 1
        target.put(MANIFEST, raw)
    except (RemoteError, PackError) as e:
        if not done:
            raise PackError(f"push to {url} failed: {e}" if isinstance(e, RemoteError) else str(e)) from None
        raise PackError(f"push to {url} failed after {plural(done, 'file')} of {len(names) + 1} reached it, "
                        f"without manifest.json ({e}): empty it before pushing there again") from None
    return Moved(len(names) + 1, total + len(raw), signed)


def _whole(folder: Path, name: str, limit: int, *, exact: bool) -> None:
    """PackError unless the pack's file `name` is a regular file of its manifest's size (`exact`),
    or of at most `limit` bytes."""
    try:
        check_file(folder / name, limit, exact=exact, name=name, listed=", which its manifest lists")
    except PackError as e:
        raise PackError(f"{e}: nothing pushed") from None


def _holds_nothing(target, url: str) -> None:
    """PackError unless the place holds nothing: a folder that is not there or is empty, an S3
    prefix with no object under it (one bounded LIST)."""
    if isinstance(target, Folder):
        if target.is_empty():
            return
        there = "exists and is not an empty folder"
    else:
        found, _ = target.list_page("", 1)
        if not found:
            return
        there = f"already holds objects ({found[0][0]} and maybe more)"
    raise PackError(f"{url} {there}: a pack is pushed to a new or empty place, never merged into another "
                    "(nothing pushed: push to another place, or empty this one first)")


def pull(url: str, folder: Path) -> Moved:
    """Copy the pack at `url` into the new folder `folder` (it must not exist, or be empty)."""
    said = folder
    folder = Path(os.path.abspath(folder))  # (`.` names no folder to pull into beside it)
    if not is_free(folder):
        raise PackError(f"{said} exists and is not an empty folder: a pack is pulled into a new folder")
    source = place(url)
    if isinstance(source, Folder) and not source.path.is_dir():  # a mistyped place, not a pack without a manifest
        raise PackError(f"no pack folder at {url}" if not source.path.exists() else
                        f"{url} is not a folder: a pack is a folder (manifest.json, blobs/, model.sig)")
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    (tmp / BLOBS).mkdir(parents=True)
    try:
        raw = _get(source, MANIFEST, MAX_MANIFEST_BYTES, url)
        m = parse(raw)
        total = len(raw)
        (tmp / MANIFEST).write_bytes(raw)
        for h, (size, _) in m.records.items():
            data = _get(source, blob_name(h), size, url)
            (tmp / blob_name(h)).write_bytes(data)
            total += len(data)
        signed = source.head(SIGNATURE) is not None
        if signed:
            data = _get(source, SIGNATURE, MAX_SIGNATURE_BYTES, url)
            (tmp / SIGNATURE).write_bytes(data)
            total += len(data)
        settle(tmp, folder)
    except RemoteError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PackError(f"pull from {url} failed: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Moved(len(m.records) + 1 + signed, total, signed)


def _get(source, key: str, limit: int, url: str) -> bytes:
    try:
        data = source.get(key, limit)
    except TooLarge:
        raise PackError(f"pull from {url} failed: {key} is larger than the {limit} bytes "
                        + ("the manifest gives it" if key != MANIFEST and key != SIGNATURE else "such a file may be")
                        + " (nothing pulled)") from None
    if data is None:
        if not isinstance(source, Folder):
            source.list_page("", 1)  # a bucket that is not there is said so (BucketMissing), not "no manifest"
        raise PackError(f"{url} has no {key}: is it a pack pushed with `kvstore pack push`?")
    return bytes(data)
