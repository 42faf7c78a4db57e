"""`kvstore remote-key`: print a new random fleet secret for a shared remote tier, or rotate one."""

from __future__ import annotations

import os
from pathlib import Path

from kvstore.cli.output import CommandError, out

EXAMPLES = """examples:
  kvstore remote-key > fleet.key                           # once, for the whole fleet (made 0600)
  kvstore generate --remote s3://team-cache/kv --remote-key-file fleet.key --prompt "Hello"
  export KVSTORE_REMOTE_KEY=$(cat fleet.key)               # or give it by the environment
  kvstore remote-key --rotate fleet.key                    # a new key first, the old one still read

Every node that shares the bucket needs the same key (43 characters, base64url of 32 random
bytes); a node without it can neither read the bucket's objects nor make the fleet use its own.
A holder of the key reads every prompt stored under it. After --rotate, give every node the new
file: they write with the new key and read with both. Then `kvstore gc --remote URL
--remote-key-file fleet.key --drop-key OLD` deletes what only the old key opens and takes it out
of the file (docs/remote.md)."""


def register(add, store_opts, model_opts) -> None:
    p = add("remote-key", cmd_remote_key, "print a new random fleet secret for --remote (KVSTORE_REMOTE_KEY)", [],
            EXAMPLES)
    p.add_argument("--rotate", metavar="FILE",
                   help="put a new key first in the key file FILE (which holds the current key): objects are "
                        "written with it from then on, and still read with the older ones")


def cmd_remote_key(args) -> int:
    from kvstore.remote.seal import key_id, new_key, parse_key, read_key_file

    if args.rotate is None:
        _private_if_a_file(1)
        print(new_key())
        return 0
    older = read_key_file(args.rotate)
    new = new_key()
    write_key_file(Path(args.rotate), [parse_key(new, "the new key"), *older])
    out(f"{args.rotate}: new key {key_id(parse_key(new, 'the new key'))} first (written with from now on); "
        f"still read: {', '.join(key_id(k) for k in older)}")
    out("give this file to every node of the fleet (and restart them); once all run with it: "
        f"kvstore gc --remote URL --remote-key-file {args.rotate} --drop-key {key_id(older[0])}")
    return 0


def _private_if_a_file(fd: int) -> None:
    """`kvstore remote-key > fleet.key`: the shell made the file with the umask's mode (0644,
    readable by every user of the machine, and every command that reads it then warns): a file
    the secret is written to is made 0600 first. A pipe or a terminal is left as it is."""
    import stat

    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fchmod(fd, 0o600)
    except OSError:  # (not ours to change, or no such descriptor: the key is printed anyway)
        pass


def write_key_file(path: Path, keys: list[bytes]) -> None:
    """Replace the key file `path` with `keys`, one a line, the one written with first (0600,
    written beside it and renamed into place)."""
    import base64

    text = "".join(base64.urlsafe_b64encode(k).rstrip(b"=").decode() + "\n" for k in keys)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise CommandError(f"cannot write the key file {path}: {e.strerror or e}") from None
