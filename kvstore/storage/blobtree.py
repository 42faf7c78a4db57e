"""The blob tree: the names and folders of `blobs/ab/cd/<hash>.safetensors`, never its contents.

Walking the tree, deleting and moving its entries, and its lock. Nothing here follows a
symbolic link: every folder is opened relative to its parent with O_NOFOLLOW and every delete
or rename is relative to such a folder (`dir_fd`), so a link planted anywhere in the tree (or
as the tree itself) never lets a walk, a delete or a rename reach the folder it points to.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Sequence

SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp."


def blob_path(root: Path, h: bytes) -> Path:
    """Where the blob of record `h` lives: `root/ab/cd/<hash>.safetensors`."""
    name = h.hex()
    return root / name[:2] / name[2:4] / (name + SUFFIX)


def blob_file(root: Path | str, h: bytes) -> str:
    """`blob_path` as a string, for the read path (a Path costs microseconds per record)."""
    name = h.hex()
    return f"{os.fspath(root)}/{name[:2]}/{name[2:4]}/{name}{SUFFIX}"


def remove(root: Path, h: bytes) -> None:
    """Delete the blob of record `h`, never through a symbolic link (best effort)."""
    if not isinstance(h, bytes) or len(h) != 16:
        return  # a row of the wrong type (verify reports it) names no file of ours
    name = h.hex()
    remove_entry(root, (name[:2], name[2:4], name + SUFFIX))


def remove_all(root: Path, hashes: Sequence[bytes]) -> None:
    """`remove` for many blobs, each folder on the way opened once for all of its blobs (give
    the hashes sorted: then neighbours share folders)."""
    fds: dict[tuple[str, ...], int | None] = {}

    def folder(parts: tuple[str, ...]) -> int | None:
        if parts not in fds:
            if len(fds) > 64:  # sorted hashes never come back to a folder: close what is done
                for key in [k for k in fds if len(k) == len(parts)]:
                    if fds[key] is not None:
                        os.close(fds[key])
                    del fds[key]
            up = folder(parts[:-1]) if parts else None
            try:
                if not parts:
                    fds[parts] = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                elif up is None:
                    fds[parts] = None
                else:
                    fds[parts] = os.open(parts[-1], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=up)
            except OSError:
                fds[parts] = None  # no such folder (or a link): none of its blobs is there
        return fds[parts]

    try:
        for h in hashes:
            if not isinstance(h, bytes) or len(h) != 16:
                continue
            name = h.hex()
            fd = folder((name[:2], name[2:4]))
            if fd is None:
                continue
            try:
                os.unlink(name + SUFFIX, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError:
                remove(root, h)  # a folder in its place, say: the careful way
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)


def remove_entry(root: Path, parts: Sequence[str], *, directory_too: bool = True) -> bool:
    """Unlink `root/parts...` relative to folders opened with O_NOFOLLOW: a symbolic link
    anywhere on the way (the blob tree itself, a hex folder) stops it, so nothing outside the
    store is ever deleted. An empty folder where a blob should be goes too. True if removed."""
    try:
        fd = _open_folder(root, parts[:-1])
    except OSError:
        return False
    try:
        os.unlink(parts[-1], dir_fd=fd)
        return True
    except FileNotFoundError:
        return False
    except (IsADirectoryError, PermissionError):  # (Linux says EISDIR; macOS says EPERM)
        if directory_too:
            try:
                os.rmdir(parts[-1], dir_fd=fd)
                return True
            except OSError:
                pass
        return False
    finally:
        os.close(fd)


def move_entry(root: Path, parts: Sequence[str], dest: Path, new_name: str) -> bool:
    """Rename `root/parts...` (a file, link or anything else; never followed) into the folder
    `dest` as `new_name`, relative to folders opened with O_NOFOLLOW. True if moved."""
    try:
        src = _open_folder(root, parts[:-1])
    except OSError:
        return False
    try:
        try:
            os.mkdir(dest, 0o700)
        except FileExistsError:
            pass
        dst = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for n in range(100):
                name = new_name if n == 0 else f"{new_name}.{n}"
                try:
                    os.stat(name, dir_fd=dst, follow_symlinks=False)
                except FileNotFoundError:
                    os.rename(parts[-1], name, src_dir_fd=src, dst_dir_fd=dst)
                    return True
            return False
        finally:
            os.close(dst)
    except OSError:
        return False
    finally:
        os.close(src)


def _open_folder(root: Path, parts: Sequence[str]) -> int:
    """An fd of `root/parts...`, each step opened with O_NOFOLLOW (ELOOP/ENOTDIR on a link)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    for part in parts:
        try:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


_held = threading.local()  # how many tree locks this thread holds (`tree_lock`), by depth


@contextmanager
def gc_lock(root: Path, *, exclusive: bool) -> Iterator[None]:
    """A lock on the blob tree's folder itself (flock; a dead process's is gone): every gc holds
    it shared while it deletes, since between its two sweeps the index holds edges into rows it
    deleted, and `verify` exclusive while it confirms what it found, so that it waits for the gcs
    running instead of reporting their work in flight as damage. No folder: nothing to lock."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@contextmanager
def tree_lock(root: Path, *, exclusive: bool, create: bool = True) -> Iterator[None]:
    """An advisory lock on the blob tree (`<store>/blobs.lock`, flock: a dead process's is gone).

    A writer holds it shared from "is this record stored?" until its row is committed; gc and
    `verify --repair` hold it exclusive while rows and files disagree, so neither ever sees a
    half-written record, nor deletes a file a row is about to point to. Take it before any
    index transaction, never inside one. `create=False` (a read-only store) takes the lock only
    if its file is already there, and never makes it.
    """
    lock = root.parent / (root.name + ".lock")
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK if create else \
        os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(lock, flags, 0o600)
    except OSError as e:
        if create or e.errno == errno.ELOOP:
            raise OSError(e.errno, f"cannot take the store's lock ({e.strerror})", str(lock)) from e
        yield  # read-only and no lock file: nothing this process does needs one
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "the store's lock is not a regular file", str(lock))
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        _held.depth = getattr(_held, "depth", 0) + 1
        try:
            yield
        finally:
            _held.depth -= 1
    finally:
        os.close(fd)


@contextmanager
def write_turn(root: Path) -> Iterator[None]:
    """Around an index transaction that needs no lock for its own sake (a setting, the write log,
    access times): the tree lock, shared, unless this thread holds one already. While gc runs
    transactions back to back (each under the lock, exclusive), this waits on the lock and is
    woken the moment one commits, instead of in SQLite's busy handler, whose sleeps of up to
    100 ms kept missing the gaps between them: a write-budget reservation waited up to 1.5 s
    during a gc of half of 1M rows. Best effort: without a lock file to take, it goes ahead."""
    with ExitStack() as stack:
        if not getattr(_held, "depth", 0):  # else inside this thread's own lock (flock would wait for itself)
            try:
                stack.enter_context(tree_lock(root, exclusive=False, create=False))
            except OSError:
                pass
        yield


def walk(root: Path) -> Iterator[Path]:
    """Every entry under the blob tree that is not a real folder: blobs, temporaries, anything
    foreign (FIFOs, devices), and every symbolic link (listed, never entered). Folders are
    opened relative to their parent with O_NOFOLLOW, so a link swapped in is never followed;
    a blob tree that is itself a link yields nothing. A folder deeper than blobs ever go
    (`ab/cd/x/`) is yielded whole, not entered."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    yield from _walk_fd(fd, root, 0)


def _walk_fd(fd: int, where: Path, depth: int) -> Iterator[Path]:
    try:
        names = sorted(os.listdir(fd))
        folders = []
        for name in names:
            try:
                mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(mode) and depth < 2:
                folders.append(name)
            else:
                yield where / name
        for name in folders:
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                continue  # gone, or swapped for a link since it was listed
            yield from _walk_fd(sub, where / name, depth + 1)
    finally:
        os.close(fd)


def hash_of(path: Path, root: Path | None = None) -> bytes | None:
    """The record hash a blob file is named for, or None if the name is not a blob's (in its
    own `ab/cd/` folder; with `root`, exactly two folders below it)."""
    name = path.name
    if not name.endswith(SUFFIX) or len(name) != 32 + len(SUFFIX):
        return None
    if root is not None and path.parent.parent.parent != root:
        return None
    if any(c not in "0123456789abcdef" for c in name[:32]):
        return None
    h = bytes.fromhex(name[:32])
    return h if path.parent.name == name[2:4] and path.parent.parent.name == name[:2] else None


def is_temp_name(name: str) -> bool:
    """A name a blob writer gives its temporary file: `.tmp.<hash>.<pid>.<random>`."""
    parts = name.split(".")
    return name.startswith(TMP_PREFIX) and len(parts) == 5 and parts[3].isdigit()


def stale_temp(path: Path, min_age_s: float = 3600.0) -> bool:
    """A temporary file (a regular file, not a link) left by a writer that is gone (dead pid)
    or is very old."""
    if not is_temp_name(path.name):
        return False
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    try:
        os.kill(int(path.name.split(".")[3]), 0)
        alive = True
    except (ValueError, ProcessLookupError, OverflowError):
        alive = False
    except PermissionError:
        alive = True
    return not alive or time.time() - st.st_mtime > min_age_s
