"""`kvstore pack push` and `kvstore pack pull`: a pack folder to and from S3 or a folder."""

from __future__ import annotations

from pathlib import Path

from kvstore.cli.output import out, plural
from kvstore.sizes import format_size


def cmd_push(args) -> int:
    from kvstore.packs.transfer import push

    done = push(Path(args.pack), args.url)
    out(f"pushed {args.pack} to {args.url}: {plural(done.files, 'file')}, {format_size(done.bytes)}, "
        + ("signed" if done.signed else "unsigned"))
    return 0


def cmd_pull(args) -> int:
    from kvstore.packs.transfer import pull

    done = pull(args.url, Path(args.pack))
    out(f"pulled {args.url} into {args.pack}: {plural(done.files, 'file')}, {format_size(done.bytes)}, "
        + ("signed" if done.signed else "unsigned") + f"; nothing is checked until `kvstore pack import {args.pack}`")
    return 0
