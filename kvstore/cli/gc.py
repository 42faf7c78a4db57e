"""`kvstore gc`: keep the store (or, with `--remote`, the shared bucket) within a budget."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from kvstore import settings
from kvstore.argv import disk_budget, duration, or_off
from kvstore.cli.options import open_local, remote_key, remote_upkeep, remote_url, salt_tenant, store_path
from kvstore.cli.output import EXIT_USAGE, PROG, CommandError, on_store, out, plural, say
from kvstore.errors import UnknownTenantError
from kvstore.sizes import format_size

EXAMPLES = """examples:
  kvstore gc --max-bytes 2GiB
  kvstore gc --max-bytes 500MB --max-age 7d --dry-run
  kvstore gc --remote s3://team-cache/kv --max-age 7d     # the shared bucket, deepest first
  kvstore gc --max-bytes 20GiB --tenant-max-bytes 1GiB     # and no tenant above 1 GiB
  kvstore gc --drop-tenant 94006b12d940acf3                # every record of one tenant, pins too
  kvstore gc --drop-tenant-id customer-42                  # the same, by the id its requests name
  kvstore gc --drop-tenant-salt team-a                     # a request cache_salt's tenant (--trust-client-salt)
  kvstore gc --remote s3://team-cache/kv --remote-key-file fleet.key --drop-key 3fa2c1d0  # end a key rotation

SIZE: a number with KB/MB/GB/TB (x1000) or K/M/G/T, KiB/MiB/GiB/TiB (x1024), or B for bytes.
DURATION: a number with s, m, h, d or w, like 30m, 12h, 7d. Pinned prompts are never evicted
(but --stale evicts those of stale model versions; `kvstore pins --remove` unpins a prompt)."""


def register(add, store_opts, model_opts) -> None:
    p = add("gc", cmd_gc, "evict least recently used records down to a size (and age) budget", [store_opts],
            EXAMPLES)
    p.add_argument("--max-bytes", metavar="SIZE", type=or_off(disk_budget), default=argparse.SUPPRESS,
                   help="keep at most this many bytes, like 500MB or 2GiB (10B for bytes: a number needs its "
                        "unit); 0 empties the store; off: no bound")
    p.add_argument("--max-age", metavar="DURATION", type=or_off(duration), default=argparse.SUPPRESS,
                   help="also evict records unused for this long, like 7d; off: no bound")
    p.add_argument("--stale", action="store_true",
                   help="evict model versions whose files are gone or changed, pinned records too (no lookup "
                        "can use them again); a budget evicts them first anyway, pins kept")
    settings.add_options(p, (settings.BY_NAME["tenant_max_bytes"],))  # its row in the settings table
    p.add_argument("--drop-tenant", metavar="TAG", action="append", type=_tenant_tag, default=[],
                   help="delete every record of the tenant with this tag (as `kvstore stats` lists tenants), "
                        "its pinned ones too; repeatable. The local store only: the bucket's copies stay "
                        "until `gc --remote` bounds it")
    p.add_argument("--drop-tenant-id", metavar="ID", action="append", default=[],
                   help="as --drop-tenant, for the tenant whose requests name this id (its header value or "
                        "bearer token): its tag is derived as kvstore serve derives it, under the store's "
                        "tenant.key and, when the fleet secret is given (--remote-key-file or "
                        "$KVSTORE_REMOTE_KEY), the fleet's keys; with it go the tenants its requests' "
                        "cache_salts made (--trust-client-salt), which share its quota; repeatable")
    p.add_argument("--drop-tenant-salt", metavar="SALT", action="append", default=[],
                   help="as --drop-tenant, for the tenant whose requests send this cache_salt to a server with "
                        "--trust-client-salt (with one --drop-tenant-id ID: the salt's tenant under that "
                        "tenant, which itself stays); repeatable")
    p.add_argument("--drop-key", metavar="ID",
                   help="with --remote: delete every object only the older fleet key ID opens (the end of "
                        "`kvstore remote-key --rotate`), and take it out of --remote-key-file")
    p.add_argument("--drop-unknown", action="store_true",
                   help="with --remote: also delete every namespace folder none of this node's keys opens "
                        "(any gc --remote deletes one whose newest object is 30 days old); none while no "
                        "namespace of the bucket opens with this node's keys (a wrong secret?)")
    p.add_argument("--dry-run", action="store_true", help="only report what would be freed")


def cmd_gc(args) -> int:
    bounds = [name for name in ("max_bytes", "max_age", "tenant_max_bytes") if hasattr(args, name)]  # given, or off
    for name in ("max_bytes", "max_age", "tenant_max_bytes"):
        setattr(args, name, getattr(args, name, None))
    if args.drop_key is not None:
        return _drop_key(args)
    if args.drop_unknown and args.remote is None:
        raise CommandError("--drop-unknown deletes namespaces of a bucket: give --remote URL", EXIT_USAGE)
    dropping = args.drop_tenant or args.drop_tenant_id or args.drop_tenant_salt
    if not bounds and not args.stale and not args.drop_unknown and not dropping:
        raise CommandError("gc needs --max-bytes and/or --max-age (or --tenant-max-bytes, --drop-tenant, "
                           "--drop-tenant-id, --drop-tenant-salt or --stale; with --remote, --drop-unknown or "
                           "--drop-key)", EXIT_USAGE)
    if args.drop_tenant_salt and len(args.drop_tenant_id) > 1:
        raise CommandError("--drop-tenant-salt names salts of one tenant: give at most one --drop-tenant-id with it "
                           "(run gc once per tenant)", EXIT_USAGE)
    if args.remote is not None:
        if dropping or getattr(args, "tenant_max_bytes", None) is not None:
            raise CommandError("--drop-tenant and --tenant-max-bytes act on the local store's tenants: run them "
                               "without --remote (the bucket is bounded as a whole)", EXIT_USAGE)
        return _gc_remote(args)
    with open_local(args, must_exist=True) as files:
        args.drop_tenant += [tag for tenant_id, what in _ids(args) for tag in _tags_of(args, files, tenant_id, what)]
        owners = {t["tenant"]: t["owner"] for t in files.tenants() if t.get("owner")} if dropping else {}
        try:
            result = files.gc(max_bytes=args.max_bytes, max_age=args.max_age, dry_run=args.dry_run,
                              stale=args.stale, tenant_max_bytes=args.tenant_max_bytes, drop_tenants=args.drop_tenant)
        except UnknownTenantError as e:
            raise CommandError(f"{e} (`{PROG} stats --store {shlex.quote(str(store_path(args)))}` lists its "
                               "tenants' tags)") from None
        pinned = bool(files.pins()) if args.max_bytes is not None and result["bytes"] > args.max_bytes else False
    verb, holds = ("would free", "would hold") if args.dry_run else ("freed", "holds")
    before = result.get("bytes_before", result["bytes"] + result["freed_bytes"])
    others = result["bytes"] - (before - result["freed_bytes"])  # stored (or deleted) by other processes meanwhile
    print(f"{verb} {format_size(result['freed_bytes'])} ({result['freed_bytes']} bytes, "
          f"{plural(result['evicted'], 'record')}); the store {holds} {format_size(result['bytes'])} "
          f"(was {format_size(before)}" + (f"; other processes {'stored' if others > 0 else 'deleted'} "
                                             f"{format_size(abs(others))} while gc ran)" if others else ")"))
    if result.get("leftover_files"):
        out(f"and {plural(result['leftover_files'], 'file')} an earlier gc was stopped before unlinking "
            "(their records were already deleted): unlinked now")
    stale_pins = result.get("stale_pins") or {}
    if stale_pins.get("records"):
        out(f"{plural(stale_pins['records'], 'pinned record')} of stale models "
            f"{'would be ' if args.dry_run else ''}freed ({format_size(stale_pins['bytes'])}): their model "
            "files are gone or changed, so no lookup could use them again")
    if result.get("tenants_over"):
        out(f"{plural(result['tenants_over'], 'tenant')} held more than {format_size(args.tenant_max_bytes)} "
            "(each with the cache_salt tenants that share its quota): their least recently used records "
            f"{'would go' if args.dry_run else 'went'} first (pinned ones stay)")
    for tag, held in (result.get("tenants_dropped") or {}).items():
        whose = f" (a cache_salt tenant of {owners[tag]})" if tag in owners else ""
        out(f"tenant {tag}: {plural(held['records'], 'record')} ({format_size(held['bytes'])}) "
            f"{'would be deleted' if args.dry_run else 'deleted'}, pinned ones too{whose}")
    if args.max_bytes is not None and result["bytes"] > args.max_bytes:
        say(f"{PROG} gc: still above the budget of {args.max_bytes} bytes: "
            f"{_kept(args, result['kept_bytes'], pinned)}")
    return 0


def _ids(args) -> list[tuple[str, str]]:
    """(tenant id, what it is in an error's words) of each tenant `--drop-tenant-id` and
    `--drop-tenant-salt` name: with salts, the tenants they split off the one `--drop-tenant-id`
    (or off requests that name no tenant), as `kvstore serve --trust-client-salt` builds their ids."""
    if not args.drop_tenant_salt:
        return [(tenant_id, "that tenant") for tenant_id in args.drop_tenant_id]
    named = args.drop_tenant_id[0] if args.drop_tenant_id else None
    return [(salt_tenant(named, salt, "--drop-tenant-salt"), "the tenant of that cache_salt")
            for salt in args.drop_tenant_salt]


def _tags_of(args, files, tenant_id: str, what: str = "that tenant") -> list[str]:
    """The tags the store holds records under for the tenant `tenant_id` (`what` it is, in the
    error's words), derived as a server derives them (the store's tenant key; the fleet's keys,
    current and older, when given). CommandError naming the keys tried when it holds none (the id
    is never quoted: it may be a bearer token)."""
    from kvstore import tenants
    from kvstore.errors import StoreOpenError
    from kvstore.remote.seal import KEY_ENV, Fleet, fleet_keys
    from kvstore.storage.storedir import tenant_key

    secrets, tried = [], []
    try:
        secrets.append(tenant_key(files.path, create=False))
        tried.append("the store's tenant.key")
    except StoreOpenError:
        pass
    given = remote_key(args)
    if given is not None or os.environ.get(KEY_ENV):  # (without the fleet secret: the store's key alone)
        fleet = Fleet.of(fleet_keys(given))
        secrets += [f.tenant_secret() for f in fleet.keyring()]
        tried.append(plural(len(fleet.keyring()), "fleet key"))
    if not secrets and not files.tenants():  # (no key and no tenant's record: no tenant ever used it)
        raise CommandError("the store holds no tenant's records (it has no tenant.key: no tenant was ever "
                           f"served from it); nothing deleted (`{PROG} stats` lists a store's tenants)")
    if not secrets:
        raise CommandError(f"--drop-tenant-{'salt' if args.drop_tenant_salt else 'id'}: this store has no tenant.key, so its tenants' tags come from the "
                           "fleet secret: give it (--remote-key-file or $KVSTORE_REMOTE_KEY)", EXIT_USAGE)
    try:
        tags = {tenants.derive(secret, tenant_id).tag for secret in secrets}
    except ValueError as e:
        raise CommandError(f"--drop-tenant-id: {e}", EXIT_USAGE) from None
    present = files.tenants()
    held = tags & {t["tenant"] for t in present}
    if not args.drop_tenant_salt:  # (a tenant goes with the cache_salt tenants that share its quota)
        held |= {t["tenant"] for t in present if t.get("owner") in tags}
    if not held:
        raise CommandError(f"the store holds no records of {what} (its tag under {' and '.join(tried)}"
                           f" is {', '.join(sorted(tags))}; `{PROG} stats` lists the tenants' tags)")
    return sorted(held)


def _tenant_tag(text: str) -> str:
    from kvstore.tenants import parse_tag

    try:
        return parse_tag(text.strip().lower())  # (as typed: any case)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (as `kvstore stats` lists tenants), not {text!r:.40}") from None


def _kept(args, kept: dict, pinned: bool) -> str:
    """What held the bytes gc did not free, in words (`pinned`: the store has pinned records)."""
    parts = []
    if kept["records"]:
        held = (f"pinned records and their ancestors (`{PROG} pins{on_store(args)}` lists them), or records "
                "given a child while gc ran" if pinned else "records given a child or stored while gc ran (by a writer in "
                "another process): a gc run again frees them")
        parts.append(f"{format_size(kept['records'])} {'would be' if args.dry_run else 'is'} held by {held}")
    if kept["unread"]:
        parts.append(f"{format_size(kept['unread'])} is counted by the index but held by no record gc could read "
                     f"(damaged rows): `{PROG} verify --repair --store {shlex.quote(str(store_path(args)))}` "
                     "mends them and counts again")
    return "; ".join(parts) or "records written while gc ran"


def _drop_key(args) -> int:
    """`gc --remote --drop-key ID`: delete what only an older fleet key opens, and forget it."""
    url = remote_url(args)
    if url is None:
        raise CommandError("--drop-key deletes a key's objects from a bucket: give --remote URL", EXIT_USAGE)
    result = remote_upkeep(args, url, "drop_key", key_id=args.drop_key, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    out(f"remote {url}: {verb} {plural(result['objects'], 'object')} ({format_size(result['bytes'])}, "
        f"{plural(result['namespaces'], 'namespace')}) that only key {args.drop_key} opens")
    if args.dry_run:
        return 0
    if args.remote_key_file:
        from kvstore.cli.remotekey import write_key_file
        from kvstore.remote.seal import key_id, read_key_file

        keys = read_key_file(args.remote_key_file)
        write_key_file(Path(args.remote_key_file), [k for k in keys if key_id(k) != args.drop_key])
        out(f"{args.remote_key_file}: key {args.drop_key} taken out")
    else:
        out(f"take key {args.drop_key} out of $KVSTORE_REMOTE_KEY on every node")
    return 0


def _gc_remote(args) -> int:
    """`gc --remote`: bound the bucket, deepest records first; pins of every node are kept;
    namespaces no key of this node opens are not counted, and go when told or when old."""
    from kvstore.remote.upkeep import UNKNOWN_MAX_AGE, other_markers

    url = remote_url(args)
    days = int(UNKNOWN_MAX_AGE // 86400)
    result = remote_upkeep(args, url, "gc", max_bytes=args.max_bytes, max_age=args.max_age, dry_run=args.dry_run,
                           drop_unknown=args.drop_unknown)
    verb = "would delete" if args.dry_run else "deleted"
    # Listing the bucket again costs as much as gc's own listing (a request per 1000 objects), so
    # the total after gc is the listed one less what gc deleted: said as that, not as a fresh count.
    they = "they" if result.get("wrong_key") else "the bucket"
    out(f"remote {url}: {verb} {plural(result['evicted'], 'object')} ({format_size(result['freed_bytes'])}) "
        f"of this node's namespaces ({plural(result['kept_pinned'], 'pinned record')} kept"
        + (f"; {plural(result['kept_held'], 'other record')} kept because gc was blocked, below)"
           if result["kept_held"] else ")")
        + f"; {they} held {plural(result['records'] + result['evicted'], 'object')} "
        f"({format_size(result['bytes_before'])}) when gc listed {'them' if they == 'they' else 'it'}: "
        f"{plural(result['records'], 'object')} ({format_size(result['bytes'])}) less what gc {verb}, not "
        "counting what other nodes stored or deleted since")
    if result.get("oversized"):
        out(f"remote {url}: {result['oversized']} of those objects ({format_size(result['oversized_bytes'])}) "
            f"{'are' if result['oversized'] > 1 else 'is'} larger than a record of the namespace can be (its "
            "manifest says how large): planted, not records; they go first and do not count against --max-bytes")
    for why in result["held"]:
        out(f"remote {url}: gc kept every record of a namespace (it deletes none until that node publishes its "
            f"pins again): {why}")
    if result["dropped_namespaces"]:
        out(f"remote {url}: {verb} {plural(result['dropped_namespaces'], 'namespace')} none of this node's keys "
            f"opens ({plural(result['dropped_objects'], 'object')}, {format_size(result['dropped_bytes'])}"
            + (")" if args.drop_unknown else f", newest object over {days} days old)"))
    left = result["unknown_namespaces"] - result["dropped_namespaces"]
    if result.get("wrong_key"):  # (the library said the wrong-key line)
        out(f"remote {url}: gc deletes no namespace none of its keys opens ({plural(left, 'namespace')}, "
            f"{format_size(result['unknown_bytes'])} kept) while this node's key is not the fleet's (the "
            "wrong-key line above says why): they may be the fleet's under the right secret. Give it (--remote-key-file, or "
            "KVSTORE_REMOTE_KEY); to delete them anyway, use your object store's tools")
        return 1 if args.drop_unknown else 0
    if result.get("other_key_markers"):
        out(f"remote {url}: gc deletes no namespace none of its keys opens ({plural(left, 'namespace')}, "
            f"{format_size(result['unknown_bytes'])} kept) while the bucket holds "
            f"{other_markers(result['other_key_markers'])}: they may be the fleet's under that key. Run gc from a "
            "node given the whole key file (`kvstore remote-key --rotate` keeps the older keys in it)")
        return 1 if args.drop_unknown else 0
    if left > 0:
        out(f"remote {url}: {plural(left, 'namespace')} none of this node's keys opens "
            f"({format_size(result['unknown_bytes'] - result['dropped_bytes'])}) not counted against --max-bytes: "
            f"{'it goes' if left == 1 else 'they go'} with --drop-unknown, or once "
            f"{'its' if left == 1 else 'their'} newest object is {days} days old")
    # (A pins object put back in the bucket is said by the library's warning, once per object.)
    return 0
