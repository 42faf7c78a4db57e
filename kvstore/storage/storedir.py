"""The store directory: which entries are kvstore's own, and the checks made before any is used.

A directory is a store only if it holds kvstore's own index (its schema checked) or is new and
empty. Anything else (a Hugging Face cache folder, a home directory) is refused before a file in
it is read as an index, written or deleted. The store's own entries are refused when they are
symbolic links or not the kind of file kvstore makes, so nothing is ever read, written or
deleted outside the store through them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import stat
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from kvstore.errors import (
    CorruptIndexError,
    IndexLostError,
    InvalidInputError,
    NotAStoreError,
    SchemaTooNewError,
    StoreOpenError,
)
from kvstore.storage.blobtree import SUFFIX
from kvstore.storage.schema import connect_read_only, is_corruption

log = logging.getLogger("kvstore")

INDEX_NAME = "index.sqlite"
BLOBS_NAME = "blobs"
LOCK_NAME = BLOBS_NAME + ".lock"
QUARANTINE_NAME = "quarantine"  # where `verify --repair` moves files that kvstore did not write
NODE_ID_NAME = "remote-node-id"  # this store's name among the nodes of a shared bucket
PINS_NAME = "index.pins"  # the pinned records, for a rebuild of the index (`storage.pins`)
SETTINGS_NAME = "index.settings"  # the kept settings, for a rebuild of the index (`WriteLogSQL.set_setting`)
SETTINGS_FORMAT = "kvstore kept settings 1"  # the one key of `index.settings`: {name: value as kept}
TENANT_KEY_NAME = "tenant.key"  # the secret tenants' salts are derived under, without a remote tier
TRUST_KEY_NAME = "trust.key"  # the store's own key for trust tags, without a remote tier (`kvstore.trust`)
#: Less free space than this, and an index that cannot be opened to write: the disk is full.
FULL_DISK_BYTES = 1 << 20
INDEX_FILES = tuple(INDEX_NAME + s for s in ("", "-wal", "-shm", "-journal"))
# Left beside the index by a rebuild, or when a stale journal is moved aside.
_INDEX_LEFTOVERS = (".damaged-", ".rebuilding", "-wal.stale-", "-shm.stale-", "-journal.stale-")
# What may still open a store this process cannot write: named in the refusals of the others.
_READERS = "`kvstore stats`, `kvstore verify` and, in Python, `kvstore.open(path, read_only=True)`"
_IGNORABLE = {".DS_Store"}  # a folder opened in the macOS Finder is still empty
_NO_TABLES = "it holds no tables"
_TABLES = {"schema_migrations", "meta", "records", "models", "file_digests", "totals"}


def default_path() -> Path:
    """Where a store lives unless told: `$KVSTORE_DIR`, else `~/.cache/kvstore`."""
    env = os.environ.get("KVSTORE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvstore"


def store_dir(path) -> Path:
    """`path` as a Path (`default_path()` for None); an empty one is refused, as `Path("")` would
    be the current folder."""
    if path is None:
        return default_path()
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise InvalidInputError(f"path: the store's path is a folder's name (text or a Path), or None for "
                                f"$KVSTORE_DIR (else ~/.cache/kvstore), not {type(path).__name__} {path!r:.40}")
    path = os.fsdecode(path)
    if not path.strip():
        raise InvalidInputError("the store's path is empty: give a folder, or None for $KVSTORE_DIR "
                                "(else ~/.cache/kvstore)")
    return Path(path)


def is_absent(path: Path) -> bool:
    """No store at `path` and nothing there to refuse: no folder, or an empty one."""
    try:
        return all(n in _IGNORABLE for n in os.listdir(path))
    except FileNotFoundError:
        return not os.path.lexists(path)  # (a dangling link is not absent: opening it says so)
    except OSError:
        return False


def own_name(name: str) -> bool:
    """An entry kvstore itself makes at the top of a store directory."""
    return (name in INDEX_FILES or name in (BLOBS_NAME, LOCK_NAME, QUARANTINE_NAME, NODE_ID_NAME, PINS_NAME,
                                            SETTINGS_NAME, TENANT_KEY_NAME, TRUST_KEY_NAME)
            or any(name.startswith(INDEX_NAME + x) for x in _INDEX_LEFTOVERS)
            or name.startswith((f".{NODE_ID_NAME}.", f".{PINS_NAME}.", f".{SETTINGS_NAME}.", f".{TENANT_KEY_NAME}.",
                                f".{TRUST_KEY_NAME}.")))  # written aside, then renamed


def write_own_file(path: Path, text: str) -> None:
    """Replace one of the store's own small files (`.NAME.<pid>` beside it, fsync, rename, fsync
    of the folder): a reader sees the old file or the new one whole. Raises OSError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        os.unlink(tmp)  # a leftover of a dead process with this pid
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def tenant_key(path: Path, *, create: bool) -> bytes:
    """The store's own secret for tenants' salts (`kvstore.tenants`): 32 random bytes kept in
    `tenant.key` (0600), made on first use (`create`). StoreOpenError if it cannot be read or made."""
    return _own_key(path, TENANT_KEY_NAME, "a tenant key", "every tenant's stored prompts are then lost to it",
                    "to bind a tenant", create=create)


def trust_key(path: Path, *, create: bool) -> bytes:
    """The store's own key for trust tags (`kvstore.trust`) when it has no remote tier: 32 random
    bytes kept in `trust.key` (0600), made once (`create`). StoreOpenError if it cannot be read or made."""
    return _own_key(path, TRUST_KEY_NAME, "a trust key", "the model's files are then hashed again once",
                    "to tag its records", create=create)


def _own_key(path: Path, name: str, what: str, lost: str, why: str, *, create: bool) -> bytes:
    """32 random bytes kept in the store's file `name`, never read through a symbolic link nor
    from a FIFO, made once: the first process to make it wins (a hard link, never a rename over)."""
    file = path / name
    try:  # never through a symbolic link, never a FIFO
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "r") as f:
            text = f.read(128).strip()
        key = bytes.fromhex(text)
        if len(key) == 32:
            return key
        raise StoreOpenError(f"{file} does not hold {what} (64 hex digits): remove it to make a new "
                             f"one ({lost})")
    except FileNotFoundError:
        if not create:
            raise StoreOpenError(f"the store {path} has no {what[2:]} yet and is open read-only: open it "
                                 f"once to write {why}") from None
    except (OSError, ValueError) as e:
        raise StoreOpenError(f"cannot read {file}: {e}") from None
    tmp = file.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}")  # (threads of one process open stores too)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, file)  # never over another process's key: the first one made is the key
        except FileExistsError:
            pass
    except OSError as e:
        raise StoreOpenError(f"cannot write {file}: {e.strerror or e}") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return _own_key(path, name, what, lost, why, create=False)


def open_dir(path: Path, *, create: bool, read_only: bool | None) -> tuple[Path, bool]:
    """Check (or, with `create`, make) the store directory at `path`: (its real path, read-only).

    `read_only=None` opens read-only exactly when this user may not write the store. Raises
    `NotAStoreError` for a folder that is not a store, `IndexLostError` when the index is gone
    but the blobs are there (with the command that rebuilds it), `StoreOpenError` otherwise.
    """
    path = path.expanduser().resolve()  # `a/../s` is `s`: no folder `a` is made on the way
    _refuse_inside_a_store(path)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # (ENOTDIR: a file on the way)
        if not create or read_only:
            raise NotAStoreError(f"no kvstore store at {path} (commands that store prompts, like "
                                 "`kvstore warm`, create one)") from None
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(path, 0o700)
        except OSError as e:
            raise StoreOpenError(f"cannot create the store directory {path}: {e.strerror or e}") from e
        st = os.stat(path)
    except OSError as e:
        raise StoreOpenError(f"cannot open the store directory {path}: {e.strerror or e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise StoreOpenError(f"store path {path} exists and is not a directory")
    _check_own_entries(path)
    writable = os.access(path, os.W_OK | os.X_OK) and all(_writable(path / n) for n in INDEX_FILES)
    if read_only is None:
        read_only = not writable or st.st_uid != os.geteuid()
    if not read_only:
        if not writable:
            why = "is on a read-only file system" if _read_only_mount(path) else "is not writable by this user"
            raise StoreOpenError(f"the store {path} {why}: this needs to "
                                 f"write to it ({_READERS} read it without writing)")
        if st.st_uid != os.geteuid():
            raise StoreOpenError(f"the store {path} belongs to user id {st.st_uid}, not to you: "
                                 f"kvstore only writes to a store you own ({_READERS} read this one)")
    try:
        _check_is_store(path, create=create and not read_only, read_only=read_only)
    except StoreOpenError as e:  # a full disk: SQLite cannot make the index's -wal and -shm
        if read_only or isinstance(e, (CorruptIndexError, SchemaTooNewError)) or not disk_full(path):
            raise
        if isinstance(e, NotAStoreError) and not os.path.lexists(path / INDEX_NAME):  # (none was begun here)
            raise
        with full_disk_open(path, e):
            _check_is_store(path, create=False, read_only=True)
        read_only = True
    _check_mode(path, st, read_only)  # only once it is known to be a store: nothing else changes
    return path, read_only


def _refuse_inside_a_store(path: Path) -> None:
    """Refuse a path that is one of a store's own entries, or in its blob tree: a store made
    there would be moved to `quarantine/` by the outer store's `verify --repair`."""
    for inside in (path, *path.parents):
        outer = inside.parent
        if inside.name == BLOBS_NAME and os.path.lexists(outer / INDEX_NAME):
            break
    else:
        outer = path.parent
        if not (own_name(path.name) and os.path.lexists(outer / INDEX_NAME)):
            return
    raise NotAStoreError(f"{path} is inside the store {outer} (its own {path.relative_to(outer).parts[0]}), "
                         f"not a store: pass {outer}, or a folder outside it for a new store")


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def disk_full(path: Path) -> bool:
    """Whether the disk of `path` has less than `FULL_DISK_BYTES` free."""
    try:
        return shutil.disk_usage(path).free < FULL_DISK_BYTES
    except OSError:
        return False


def say_full(path: Path, e: BaseException) -> None:
    log.warning("kvstore: the disk of the store %s is full (%s): it is open read-only, and nothing is "
                "stored until space is freed and it is opened again", path, e)


@contextmanager
def full_disk_open(path: Path, e: BaseException):
    """Open the store read-only, as a full disk leaves it, and say so; when even that fails (a
    store this disk left half made: an index with no tables yet, or one that needs an upgrade),
    the error says the disk is full, not what the half-made index looks like."""
    try:
        yield
    except (CorruptIndexError, SchemaTooNewError):
        raise  # (about the index itself, whatever the disk)
    except StoreOpenError as inner:
        raise StoreOpenError(f"the disk of the store {path} is full ({_free(path)} free): its index could not "
                             "be made or upgraded, so the store cannot be opened, even read-only, until space is freed; "
                             "then run the command again (nothing stored so far is lost)") from inner
    say_full(path, e)


def _writable(file: Path) -> bool:
    """Whether this user may write `file`, or it is not there. SQLite makes and removes journal
    files while other processes open the store, so one may appear or go between two checks."""
    for _ in range(3):
        if os.access(file, os.W_OK) or not os.path.lexists(file):
            return True
    return False


def _check_mode(path: Path, st: os.stat_result, read_only: bool) -> None:
    """A store is 0700: its cached K/V reveals the prompts. A looser one is tightened (or, when
    it cannot be changed, reported)."""
    loose = stat.S_IMODE(st.st_mode) & 0o077
    if not loose:
        return
    if read_only or st.st_uid != os.geteuid():
        log.warning("kvstore: the store %s has mode %o: other users can read its cached prompts",
                    path, stat.S_IMODE(st.st_mode))
        return
    try:
        os.chmod(path, 0o700)
        log.warning("kvstore: the store %s had mode %o; set it to 700 (its cached K/V reveals "
                    "the prompts)", path, stat.S_IMODE(st.st_mode))
    except OSError as e:
        log.warning("kvstore: the store %s has mode %o and cannot be tightened (%s)",
                    path, stat.S_IMODE(st.st_mode), e)


def _check_own_entries(path: Path) -> None:
    """Refuse a store whose own entries are symbolic links or the wrong kind of file."""
    for name in (*INDEX_FILES, BLOBS_NAME, LOCK_NAME, QUARANTINE_NAME, NODE_ID_NAME, PINS_NAME):
        try:
            st = os.lstat(path / name)
        except FileNotFoundError:
            continue
        want_dir = name in (BLOBS_NAME, QUARANTINE_NAME)
        if stat.S_ISLNK(st.st_mode):
            raise StoreOpenError(f"{path / name} is a symbolic link: kvstore never follows links "
                                 "out of a store (move it away, or use another store folder)")
        if not (stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)):
            kind = "a folder" if want_dir else "a regular file"
            raise StoreOpenError(f"{path / name} is not {kind}: it is not kvstore's own "
                                 "(move it away, or use another store folder)")


def _free(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free:,} bytes"
    except OSError:
        return "no space"


def _check_is_store(path: Path, *, create: bool, read_only: bool) -> None:
    index_file = path / INDEX_NAME
    try:
        has_index = os.lstat(index_file).st_size > 0
    except FileNotFoundError:
        has_index = False
    blob_root = path / BLOBS_NAME
    if has_index:
        problem = index_problem(index_file, read_only=read_only)
        if problem is None:
            return
        has_index = problem != _NO_TABLES  # (another process may be making it right now)
    if has_index:
        if not _only_own_entries(path) and not has_blob_files(blob_root):
            raise NotAStoreError(f"{path} is not a kvstore store: {index_file} is not kvstore's "
                                 f"index ({problem}) and the folder holds files kvstore did not write")
        raise CorruptIndexError(f"the index {index_file} cannot be read ({problem}); run "
                                f"`kvstore verify --repair --store {path}` to rebuild it from the blob files")
    if has_blob_files(blob_root):  # a new, empty index would orphan every blob
        lost = "holds no tables" if os.path.lexists(index_file) else "is missing"
        raise IndexLostError(
            f"the index {index_file} {lost} but {blob_root} holds blobs (an index left only as "
            f"its -wal file is lost too); run `kvstore verify --repair --store {path}` to rebuild "
            "it from them")
    if not _only_own_entries(path):
        strangers = sorted(n for n in os.listdir(path) if not own_name(n) and n not in _IGNORABLE)
        inside = sorted(n for n in _listdir(blob_root) if not _is_hex_folder(blob_root, n))
        named = ", ".join(strangers[:3] + [f"{BLOBS_NAME}/{n}" for n in inside[:3]])
        raise NotAStoreError(f"{path} is not a kvstore store: it holds files kvstore did not "
                             f"write ({named}) and no kvstore index; pass a new or empty folder")
    if not create:
        raise NotAStoreError(f"no kvstore store at {path} (it has no index yet; commands that "
                             "store prompts, like `kvstore warm`, create one)")
    if not os.path.lexists(index_file):
        _set_aside_stale_journals(path)
    try:
        os.mkdir(blob_root, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise StoreOpenError(f"cannot create {blob_root}: {e.strerror or e}") from e


def index_problem(index_file: Path, *, read_only: bool = True) -> str | None:
    """Why `index_file` is not a kvstore index (None if it is one), read-only. A file that
    cannot be read for a passing reason (busy, or another process switching a new index to WAL
    mode: SQLite then answers "attempt to write a readonly database" to a read-only connection)
    is tried again for a few seconds, then StoreOpenError; it is never called damaged."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            return _index_problem(index_file, read_only)
        except sqlite3.DatabaseError as e:
            if is_corruption(e):
                return str(e)
            if time.monotonic() > deadline:
                raise StoreOpenError(f"the index {index_file} cannot be opened ({e})") from e
            time.sleep(0.02)


def _index_problem(index_file: Path, read_only: bool) -> str | None:
    conn = connect_read_only(index_file, timeout=5.0, journal=not read_only)
    try:
        tables = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return _NO_TABLES
        missing = _TABLES - tables
        if missing:
            return f"it has no {', '.join(sorted(missing))} table"
        first = conn.execute("SELECT name FROM schema_migrations WHERE version = 1").fetchone()
        if first is None or first[0] != "0001_initial.sql":
            return "its schema history is not kvstore's"
        return None
    finally:
        conn.close()


def has_blob_files(blob_root: Path) -> bool:
    """Whether the blob tree holds at least one file named as a blob (`ab/cd/abcd....safetensors`)."""
    for a in _listdir(blob_root):
        if not _is_hex_folder(blob_root, a):
            continue
        for b in _listdir(blob_root / a):
            if _is_hex_folder(blob_root / a, b):
                prefix = a + b
                if any(n.startswith(prefix) and n.endswith(SUFFIX) for n in _listdir(blob_root / a / b)):
                    return True
    return False


def _only_own_entries(path: Path) -> bool:
    """Nothing at the top but kvstore's names, and nothing in `blobs/` but its hex folders."""
    if any(not own_name(n) and n not in _IGNORABLE for n in os.listdir(path)):
        return False
    return all(_is_hex_folder(path / BLOBS_NAME, n) for n in _listdir(path / BLOBS_NAME))


def _is_hex_folder(parent: Path, name: str) -> bool:
    if len(name) != 2 or any(c not in "0123456789abcdef" for c in name):
        return False
    try:
        return stat.S_ISDIR(os.lstat(parent / name).st_mode)
    except OSError:
        return False


def _listdir(folder: Path) -> list[str]:
    """Names in a real folder (never through a symbolic link); [] if there is none."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return []
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def _set_aside_stale_journals(path: Path) -> None:
    """A -wal or -shm file without its index belongs to a lost index: SQLite would replay it into
    the new one. Kept, under another name, never deleted."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in INDEX_FILES[1:]:
        # (re-checked each time: a process creating this store makes the index before its -wal)
        if os.path.lexists(path / name) and not os.path.lexists(path / INDEX_NAME):
            aside = path / f"{name}.stale-{stamp}"
            os.replace(path / name, aside)
            log.warning("kvstore: %s had no index beside it; moved it to %s", path / name, aside)


def read_settings_copy(store: Path) -> dict[str, str] | None:
    """The kept settings of the copy beside the index (`set_setting`), or None if there is none
    or it is not one kvstore wrote (a rebuild then keeps the limits closed); values unchecked."""
    try:
        fd = os.open(store / SETTINGS_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    kept = doc.get(SETTINGS_FORMAT) if isinstance(doc, dict) else None
    if not isinstance(kept, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in kept.items()):
        return None
    return kept
