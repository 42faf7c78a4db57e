"""The options commands share (`--store`, `--remote`, `--model`) and what they open with them.

Maintenance commands open the store directory alone (`open_local`, `open_remote`: no mlx);
model commands open the whole store and load the model (`open_store`, `bound`).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Iterator

from kvstore import argv, settings
from kvstore.argv import add_store_options, not_empty
from kvstore.cli.output import EXIT_USAGE, PROG, CommandError, say
from kvstore.remote.bucket import check_url_form

PROMPT_FILE = not_empty("give a JSONL file, or - for standard input")  # the type of every --prompts


def tenant_id(text: str) -> str:
    """The type of every `--tenant ID`: a tenant id (argparse's error says what is wrong, never
    the id: it may be a bearer token)."""
    from kvstore.tenants import check_id

    try:
        return check_id(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_tenant_salt(p: argparse.ArgumentParser, goes_with: str) -> None:
    """`--tenant-salt SALT` beside a command's `--tenant ID` (`salted_tenant` reads the two)."""
    p.add_argument("--tenant-salt", metavar="SALT",
                   help=f"{goes_with}: the tenant whose requests send this cache_salt to a server with "
                        "--trust-client-salt (with --tenant ID: that salt under tenant ID; as gc --drop-tenant-salt)")


def salted_tenant(args) -> str | None:
    """The tenant id `--tenant ID` and `--tenant-salt SALT` name together, as `kvstore serve
    --trust-client-salt` builds it (`tenants.salted_id`; a salt alone: under requests that name no
    tenant), or `--tenant` alone; a usage error that never quotes either."""
    if getattr(args, "tenant_salt", None) is None:
        return args.tenant
    return salt_tenant(args.tenant, args.tenant_salt, "--tenant-salt")


def salt_tenant(tenant: str | None, salt: str, option: str) -> str:
    """The id of the tenant `salt` splits off `tenant` (`tenants.salted_id`), or a usage error
    naming `option` that never quotes either."""
    from kvstore.tenants import salted_id

    try:
        return salted_id(tenant, salt)
    except ValueError as e:
        raise CommandError(f"{option}: {e}", EXIT_USAGE) from None


def store_parent() -> argparse.ArgumentParser:
    """`--store`, `--remote` and `--remote-key-file`, for every command (`argv.add_store_options`)."""
    p = argparse.ArgumentParser(add_help=False)
    add_store_options(p, check_url_form)
    return p


def model_parent() -> argparse.ArgumentParser:
    """`--model`, for the commands that run a model."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", metavar="M", type=not_empty("give a folder or a Hugging Face repo id, or leave "
                                                          "--model out for the demo model"),
                   help="model folder or Hugging Face repo id, as mlx_lm.load takes "
                        "(default: the built-in demo model, random weights)")
    return p


def add_store_settings(p: argparse.ArgumentParser) -> None:
    """The store's settings (`kvstore.settings`) as options, for the commands that store prompts."""
    settings.add_options(p.add_argument_group("store settings (see `kvstore settings`)"))


def store_path(args) -> Path:
    """`--store`, else `$KVSTORE_DIR`, else `~/.cache/kvstore`."""
    from kvstore.storage.storedir import default_path

    return Path(args.store).expanduser() if args.store else default_path()


def remote_url(args) -> str | None:
    """`--remote URL`, else `$KVSTORE_REMOTE` (also for a bare `--remote`), else None."""
    try:
        return argv.remote_url(args)
    except ValueError as e:
        raise CommandError(str(e), EXIT_USAGE) from None


def unread_key_file(args, url: str | None) -> None:
    """Refuse `--remote-key-file` for a command that reads it only with a bucket, when none is
    given: a wrong path, or a forgotten `--remote`, went unsaid (`verify`, `gc --drop-tenant-id`
    and `pack import` read it for the local store too, and do not call this)."""
    key_file = getattr(args, "remote_key_file", None)
    if url is None and key_file:
        raise CommandError(f"--remote-key-file {key_file}: the fleet's key is for a bucket here, and none is given "
                           "(--remote s3://BUCKET/PREFIX or $KVSTORE_REMOTE)", EXIT_USAGE)


def remote_key(args) -> list[bytes] | None:
    """The fleet's secrets in `--remote-key-file` (the one written with first), or None (then
    `$KVSTORE_REMOTE_KEY` is read)."""
    path = getattr(args, "remote_key_file", None)
    if not path:
        return None
    from kvstore.remote.seal import read_key_file

    return read_key_file(path)


def read_prompts(path: str) -> list:
    """Every line of a prompt file, parsed (`jsonl.PromptLine` or `jsonl.LineError`)."""
    from kvstore.model import jsonl

    try:
        lines = list(jsonl.read(path))
    except OSError as e:
        raise CommandError(f"cannot read the prompt file {path}: {e.strerror or e}") from e
    if not lines:  # (before a model loads or a store is made: a command that would do nothing)
        raise CommandError(f"--prompts {path}: holds no prompt line (it is empty, or blank lines only)", EXIT_USAGE)
    return lines


def add_prompt_source(p: argparse.ArgumentParser, prompts_help: str, *, required: bool = True) -> None:
    """`--prompt`, `--messages` and `--prompts` (one of them), for the commands that take prompts."""
    source = p.add_mutually_exclusive_group(required=required)
    source.add_argument("--prompt", metavar="TEXT", help="prompt text, tokenized as is")
    source.add_argument("--messages", metavar="JSON",
                        help='chat messages as JSON, like \'[{"role": "user", "content": "Hi"}]\' (chat template applied)')
    source.add_argument("--prompts", metavar="FILE.jsonl", type=PROMPT_FILE, help=prompts_help)


def prompt_items(args) -> list:
    """The prompt lines `--prompt`, `--messages` or `--prompts` name (`jsonl.PromptLine` or
    `jsonl.LineError`); a bad `--prompt` or `--messages` is an error here, before a model loads."""
    from kvstore.model import jsonl

    if args.prompts is not None:
        return read_prompts(args.prompts)
    if args.prompt is not None:
        item = jsonl.parse_object({"prompt": args.prompt}, "--prompt", None)
    else:
        try:
            value = jsonl.loads(args.messages)
        except ValueError as e:
            raise CommandError(f"--messages: {e}", EXIT_USAGE) from None
        # Always the list itself: a lone {"role": ...} object is an error that says so.
        item = jsonl.parse_object({"messages": value}, "--messages", None)
    if isinstance(item, jsonl.LineError):  # no model to load for nothing; a bad command line
        raise CommandError(str(item), EXIT_USAGE)
    return [item]


def open_local(args, *, must_exist: bool = False, read_only: bool | None = False):
    """The store directory alone, for maintenance (`upkeep.local.LocalStore`: no mlx).
    `must_exist`: create nothing; `read_only=None`: read-only when this user may not write it."""
    from kvstore.upkeep.local import LocalStore

    # A store whose index was lost still has its blobs: opening it says how to rebuild it.
    return LocalStore(store_path(args), create=not must_exist, read_only=read_only)


def bucket_and_fleet(args, url: str) -> tuple:
    """The bucket at `url` and the fleet whose secret seals its objects; a bad URL, or no fleet
    secret, is refused here, before any store is opened."""
    from kvstore.remote.bucket import open_bucket
    from kvstore.remote.seal import Fleet, fleet_keys

    bucket = open_bucket(url)
    return bucket, Fleet.of(fleet_keys(remote_key(args)))


@contextlib.contextmanager
def open_remote(args, url: str, **local) -> Iterator[tuple]:
    """(the store directory, this node's side of the bucket at `url`): a `LocalStore` (see
    `open_local`, which takes `local`) and a `remote.node.Remote` over its index."""
    from kvstore.remote.node import Remote

    bucket, fleet = bucket_and_fleet(args, url)
    with open_local(args, **local) as files:
        remote = Remote(bucket, fleet, files.index, files.path, files.blob_root, deadline=0.0)  # (no fetches here)
        try:
            yield files, remote
        finally:
            remote.close()


def remote_upkeep(args, url: str, action: str, **kw):
    """`gc`, `verify` or `drop_key` (`action`) of the bucket at `url`, with these keyword arguments: through
    this node's `Remote` when its store is there (it knows its pins), else on the bucket alone,
    creating no store (a node with no store has nothing pinned). A bucket that cannot be reached,
    or is refused, is one line that names it."""
    from kvstore.remote.bucket import RemoteError
    from kvstore.storage.storedir import is_absent

    try:
        if is_absent(store_path(args).expanduser()):
            from kvstore.remote.upkeep import collect_remote, drop_key, verify_remote

            run = {"gc": collect_remote, "verify": verify_remote, "drop_key": drop_key}[action]
            return run(*bucket_and_fleet(args, url), (), **kw)  # no local index: namespaces come from the manifests
        with open_remote(args, url, must_exist=True) as (_, remote):
            return getattr(remote, action)(**kw)
    except RemoteError as e:
        text = " ".join(str(e).split())
        text = text if len(text) <= 300 else text[:297] + "..."
        raise CommandError(text if url in text else f"remote {url}: {text}") from None


def open_store(args):
    """The whole store (`kvstore.open`: tiers, writer, models), for the model commands."""
    import kvstore

    url = remote_url(args)
    unread_key_file(args, url)
    return kvstore.open(store_path(args), remote=url, remote_key=remote_key(args) if url else None,
                        **settings.given(args))


def model_to_load(args) -> str:
    """What `--model` names (see `loading.resolve_model`); without it the demo model, said so."""
    from kvstore.model.loading import resolve_model

    model_id = resolve_model(args.model)
    if args.model is None:
        from kvstore.demo import DEMO_NOTE

        say(DEMO_NOTE)
    return model_id


@contextlib.contextmanager
def bound(args, items: list, command: str) -> Iterator[tuple]:
    """(store, loaded model, its `ModelCache`, work, errors) for a model command: work holds the
    (item, tokens) pairs of the good prompt lines; the bad ones are reported here."""
    from kvstore.model.loading import load_model, prepare

    model_id = model_to_load(args)
    with open_store(args) as store:
        loaded = load_model(model_id)
        mc = store.bind(loaded.model, loaded.model_id)
        work, errors = prepare(items, loaded)
        for e in errors:
            say(f"{PROG} {command}: {e}")
        yield store, loaded, mc, work, errors
