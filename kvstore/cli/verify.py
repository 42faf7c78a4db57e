"""`kvstore verify`: check the store (or, with `--remote`, every object of the bucket)."""

from __future__ import annotations

import argparse
import json
import shlex

from kvstore.cli.options import (
    add_tenant_salt,
    model_to_load,
    open_local,
    remote_key,
    remote_upkeep,
    remote_url,
    salted_tenant,
    store_path,
    tenant_id,
)
from kvstore.cli.output import EXIT_NOTHING_CHECKED, EXIT_PROBLEMS, EXIT_USAGE, PROG, CommandError, out, plural, say
from kvstore.errors import CorruptIndexError
from kvstore.settings import BY_NAME, argtype
from kvstore.sizes import format_size

EXAMPLES = """examples:
  kvstore verify
  kvstore verify --repair
  kvstore verify --remote --repair                         # check every object of $KVSTORE_REMOTE
  kvstore verify --exact --model ./my-model --sample 20    # restored = cold run? (writes nothing)
  kvstore verify --isolation http://127.0.0.1:8080 --tenant-from header:X-Tenant --prompts system.jsonl
  kvstore verify --isolation --model M                     # the same through the library, on this store's keys

Exit code 0 when the store is clean, 1 when problems were found (also when they were repaired).
With --exact: 0 when every prompt checked restores what a cold run computes, at every restore
point; 1 on a mismatch that is not tie-sensitive, or when a prompt could be checked only in part
(a damaged record); 3 when nothing was checked (no stored prompt of --model, or none restores
anything) (docs/exact.md).
--isolation checks that a tenant's requests hit its own prompts, that another tenant's miss, that
the shared prompt hits for both, and that no usage field nor the time to the first token tells
another tenant's prompt from a new one (two made-up tenants; it prints the figures). Exit code 0
only when every check ran and passed. Against a server, the two tenants' records stay in its
store: it says how much, under which tenant tags."""


def register(add, store_opts, model_opts) -> None:
    p = add("verify", cmd_verify, "check every record against its file, and every file against the index",
            [store_opts, model_opts], EXAMPLES)
    p.add_argument("--repair", action="store_true",
                   help="drop damaged records and stray files; rebuild an unreadable index from the blobs")
    p.add_argument("--force", action="store_true",
                   help="with --repair: delete orphan blobs even when they are more than 10%% of the store")
    p.add_argument("--json", action="store_true", help="print the problems as JSON")
    p.add_argument("--isolation", metavar="URL", nargs="?", const="",
                   help="check that tenants cannot tell each other's prompts: of the server at URL, or "
                        "(no URL) through the library on a temporary copy of this store's keys (with --model)")
    p.add_argument("--tenant-from", metavar="HOW", default=None,
                   help="with --isolation URL: how the server tells tenants, as its --tenant-from "
                        "(header:NAME or bearer; default: header:X-Tenant)")
    p.add_argument("--prompts", metavar="FILE",
                   help="with --isolation: its first line is the shared prompt (as warmed; a chat line for a "
                        "server); without it, a server's shared prompt is not checked")
    p.add_argument("--admin-token-file", metavar="PATH",
                   help="with --isolation URL: the server's --admin-token-file, to read its /metrics and "
                        "/kvstore/stats (they answer only its token)")
    p.add_argument("--probes", metavar="N", type=int, default=None,
                   help="with --isolation: prompts of each kind another tenant probes (default 20; at least 7, "
                        "below which the timing check could not fail)")
    p.add_argument("--exact", action="store_true",
                   help="recompute stored prompts of --model cold and compare: K/V, next-token logits, "
                        "32 greedy tokens, canaries (runs the model; the store is only read)")
    p.add_argument("--sample", metavar="N", type=_sample, default=8,
                   help="with --exact: how many stored prompts to check, or all (default: 8)")
    p.add_argument("--kv-bits", metavar="N", type=int, choices=(2, 3, 4, 5, 6, 8),
                   help="with --exact: check the caches stored quantized by mlx-lm with N bits (mlx_lm.server's "
                        "--kv-bits; found by itself when the store holds only those)")
    p.add_argument("--kv-group-size", metavar="N", type=int, default=64, choices=(32, 64, 128),
                   help="with --exact and --kv-bits: their group size (default: 64)")
    p.add_argument("--tenant", metavar="ID", type=tenant_id,
                   help="with --exact: check this tenant's prompts (default: the shared ones)")
    add_tenant_salt(p, "with --exact")
    p.add_argument("--exact-prefill", metavar="N", type=argtype(BY_NAME["exact_prefill"]), default=argparse.SUPPRESS,
                   help="with --exact: check the prompts stored with this exact_prefill (N tokens, or off) "
                        "instead of those of the store's own (each is a namespace of its own; nothing is kept)")


def _sample(text: str) -> int | None:
    if text.strip().lower() == "all":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of prompts (or all)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} would check nothing: give 1 or more, or all")
    return n


def cmd_verify(args) -> int:
    if args.tenant_from is not None and not args.isolation:
        raise CommandError("--tenant-from goes with --isolation URL", EXIT_USAGE)
    if args.isolation is None and (args.prompts is not None or args.probes is not None):
        raise CommandError("--prompts and --probes go with --isolation (verify alone checks every record of the "
                           "store, whatever prompts they hold)", EXIT_USAGE)
    if args.force and not args.repair:
        raise CommandError("--force goes with --repair (it lets a repair delete orphan blobs); verify alone "
                           "changes nothing", EXIT_USAGE)
    args.tenant_from = args.tenant_from or "header:X-Tenant"
    args.probes = 20 if args.probes is None else args.probes
    if args.exact:
        args.tenant = salted_tenant(args)
        return _verify_exact(args)
    if (args.sample != 8 or args.tenant is not None or args.tenant_salt is not None or args.kv_bits is not None
            or args.kv_group_size != 64 or hasattr(args, "exact_prefill")):
        raise CommandError("--sample, --tenant, --tenant-salt, --kv-bits, --kv-group-size and --exact-prefill go "
                           "with --exact", EXIT_USAGE)
    if args.admin_token_file is not None and not args.isolation:
        raise CommandError("--admin-token-file goes with --isolation URL", EXIT_USAGE)
    if args.isolation is not None:
        return _isolation(args)
    if args.model is not None:
        raise CommandError("--model goes with --exact or --isolation", EXIT_USAGE)
    if args.remote is not None:
        return _verify_remote(args)
    rebuilt, held = None, None
    try:
        with open_local(args, must_exist=True, read_only=None if not args.repair else False) as files:
            trust, checked = _local_trust(args, files)
            with files.damage_is_an_error():  # (a page it cannot read: rebuilt below, as any damage)
                before = files.index.totals()["bytes"] if args.repair else None
            problems = files.verify(repair=args.repair, force=args.force, trust=trust)
            if args.repair and problems:  # what the records repair dropped held, as `stats` counts it
                held = (files.index.totals()["bytes"], before)
    except CorruptIndexError as e:  # the index itself is unreadable (or lost): rebuild it from the blobs
        if not args.repair:
            raise
        rebuilt = _rebuild(args, e)
        with open_local(args, must_exist=True) as files:
            trust, checked = _local_trust(args, files)
            problems = files.verify(repair=True, force=args.force, trust=trust)
    if args.json:
        print(json.dumps({"clean": not problems and rebuilt is None,
                          "repaired": bool(args.repair and (problems or rebuilt)), "rebuilt": rebuilt,
                          "trust": checked, "problems": [p.to_dict() for p in problems]}, indent=2))
    else:
        for p in problems:
            out(p)
        out(f"{_summary(args, problems, rebuilt, held)} ({checked})")
    return EXIT_PROBLEMS if problems or rebuilt else 0


def _local_trust(args, files) -> tuple:
    """(the keys the blobs' trust tags are checked with, what they are in words). The fleet's,
    when its secret is given (`--remote-key-file`, `$KVSTORE_REMOTE_KEY`) and the store was opened
    with a remote tier (what it wrote since carries fleet tags: a generating node refuses the rest,
    and so does verify); else the store's own key, which tells damage only. The bucket is not asked."""
    import os

    from kvstore.remote.seal import KEY_ENV, Fleet, fleet_keys
    from kvstore.upkeep.anchors import REMOTE_SINCE

    secrets = fleet_keys(remote_key(args)) if args.remote_key_file or os.environ.get(KEY_ENV) else None
    with files.damage_is_an_error():
        joined = bool(files.index.marks(REMOTE_SINCE))
    if secrets and joined:
        fleet, trust = Fleet.of(secrets), files.trust(secrets)
        if trust.mismatch is not None:  # (reported as one `wrong_key` problem)
            return trust, f"the store's fleet tags not checked: the key {fleet.key_id}, from {fleet.where}, is not its"
        return trust, f"trust tags checked with the fleet's key {fleet.key_id}, from {fleet.where}"
    trust = files.trust(create=False)
    words = "trust tags checked with its own key" if trust is not None else "no trust tags checked (no key)"
    if secrets:
        words += ": it was never opened with a remote tier, so it holds no fleet tags"
    elif joined:
        words += f"; the fleet's are not: give --remote-key-file or {KEY_ENV}"
    return trust, words


def _verify_exact(args) -> int:
    """`verify --exact`: the store, opened read-only, against cold runs of the model."""
    if args.repair or args.remote is not None:
        raise CommandError("--exact checks the local store and repairs nothing: leave out --repair and --remote",
                           EXIT_USAGE)
    if args.kv_group_size != 64 and args.kv_bits is None:  # (else it would be ignored without a word)
        raise CommandError("--kv-group-size goes with --kv-bits (the caches mlx-lm quantized with that group size)",
                           EXIT_USAGE)
    import kvstore
    from kvstore.model.loading import load_model
    from kvstore.storage.storedir import TENANT_KEY_NAME

    model_id = model_to_load(args)
    step = {"exact_prefill": args.exact_prefill or "off"} if hasattr(args, "exact_prefill") else {}
    with kvstore.open(store_path(args), create=False, read_only=True, memory_bytes=0, **step) as store:
        if args.tenant is not None and not (store_path(args) / TENANT_KEY_NAME).is_file():
            return _no_tenant_key(args)
        loaded = load_model(model_id)
        quantized = _quantized(store, loaded)
        bits, group = args.kv_bits, args.kv_group_size
        if bits is None and len(quantized) == 1 and not _plain_held(store, loaded):
            bits, group = quantized[0]  # the one way this store holds this model's caches
            say(f"{PROG} verify: this store holds the model's caches quantized by mlx-lm (QuantizedKVCache, "
                f"{bits} bits, group size {group}): checking those")
        options = {"kv_bits": bits, "kv_group_size": group} if bits is not None else {}
        report = store.verify_exact(loaded.model, loaded.model_id, sample=args.sample, tenant=args.tenant,
                                    **options)
        if report.checked_nothing and bits is None and quantized:
            say(f"{PROG} verify: the store holds this model's caches quantized by mlx-lm too ("
                + ", ".join(f"--kv-bits {b} --kv-group-size {g}" for b, g in quantized) + "): check them with that")
        others = _other_steps(store, loaded, store.exact_prefill)
        if others:  # (a namespace of its own each: this run checked none of them)
            say(f"{PROG} verify: not checked: this model's prompts stored with another exact_prefill ("
                + ", ".join(f"{plural(n, 'record')} under {step or 'off'}" for step, n in others)
                + "): check them with " + " or ".join(f"--exact-prefill {n or 'off'}" for n, _ in others))
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        for line in report.table().splitlines() if report.checks else []:
            out(line)
        for c in report.checks:
            for why in c.problems + ([c.partial] if c.partial else []) + c.notes[:3]:
                out(f"{c.leaf[:12]}: {why}")
        if not report.cause:  # (records computed with another BLAS are not damaged: the verdict says so)
            hint = _drop_hint(args, report)
            if hint:
                out(hint)
        if any(c.partial for c in report.checks):  # a record that does not read (or is quarantined): repair drops it
            out(f"to drop the records that do not read or are quarantined, and those that hang from them: {PROG} verify --repair "
                f"--store {shlex.quote(str(store_path(args)))}")
        out(report.verdict())
    if report.checked_nothing:
        return EXIT_NOTHING_CHECKED
    return 0 if report.ok else EXIT_PROBLEMS


def _no_tenant_key(args) -> int:
    """`--exact --tenant` on a store without a tenant key: a tenant's records are keyed under a salt
    derived from it, and the first tenant's prompt stored without a remote tier makes it, so no
    tenant's prompt here can be checked (the read-only opening cannot make one, and must not)."""
    verdict = (f"NOTHING CHECKED: the store {store_path(args)} has no tenant key, so it holds no tenant's "
               "prompt --exact can check (a tenant's records are keyed under it; the first tenant's prompt "
               "stored without a remote tier makes it): leave out --tenant to check the shared prompts")
    if args.json:
        print(json.dumps({"ok": False, "checked_nothing": True, "stored_prompts": 0, "verdict": verdict,
                          "prompts": []}, indent=2))
    else:
        out(verdict)
    return EXIT_NOTHING_CHECKED


def _drop_hint(args, report) -> str:
    """How to take the stored records whose restored K/V differ out of the store: delete their blob
    files, and `verify --repair` drops their rows and every record that hangs from them."""
    from kvstore.storage import blobtree

    records = sorted({r["record"] for c in report.checks for r in c.differing_records})
    if not records:
        return ""
    root = store_path(args) / "blobs"
    paths = " ".join(shlex.quote(str(blobtree.blob_path(root, bytes.fromhex(h)))) for h in records)
    return (f"to drop {'that record' if len(records) == 1 else f'those {len(records)} records'} and the records "
            f"that hang from {'it' if len(records) == 1 else 'them'}: rm {paths} && {PROG} verify --repair "
            f"--store {shlex.quote(str(store_path(args)))}")


def _quantized(store, loaded) -> list[tuple[int, int]]:
    """(bits, group size) of each namespace of this model whose caches were quantized by mlx-lm
    (`bind(kv_bits=...)`, `serve --kv-bits`) and that holds records."""
    found = set()
    for m in _this_models(store, loaded):
        layers = (m.get("layout") or {}).get("layers") or []
        quant = {(la.get("bits"), la.get("group_size")) for la in layers if isinstance(la, dict)
                 and la.get("class") == "QuantizedKVCache"}
        if len(quant) == 1:
            found |= quant
    return sorted(found)


def _other_steps(store, loaded, step: int | None) -> list[tuple[int | None, int]]:
    """(exact_prefill, records) of this model's namespaces stored with another exact_prefill
    than `step` (None: off) that hold records."""
    found: dict[int | None, int] = {}
    for m in _this_models(store, loaded):
        other = (m.get("layout") or {}).get("exact_prefill")
        if other != step and (other is None or isinstance(other, int)):
            found[other] = found.get(other, 0) + m["chunks"] + m["tails"]
    return sorted(found.items(), key=lambda kv: kv[0] or 0)


def _plain_held(store, loaded) -> bool:
    """Whether this model's caches are stored unquantized (QuantizedKVCache nowhere in the layout)."""
    return any("QuantizedKVCache" not in json.dumps(m.get("layout")) for m in _this_models(store, loaded))


def _this_models(store, loaded) -> list[dict]:
    """The store's model versions with this model's fingerprint that hold records."""
    fp = store.bind(loaded.model, loaded.model_id).fingerprint.hex()
    return [m for m in store.index.models() if m["fingerprint"] == fp and (m["chunks"] or m["tails"])]


def _summary(args, problems: list, rebuilt: dict | None, held: tuple[int, int] | None = None) -> str:
    """The last line; it agrees with the exit code (a rebuilt index is a problem repaired), and
    names the store it checked in the command that repairs it; after a repair, what the store
    holds now and held before (`held`), as gc says it."""
    if not problems and rebuilt is None:
        return f"the store {store_path(args)} is clean"
    found = plural(len(problems) + (rebuilt is not None), "problem") + " found"
    if rebuilt is not None:
        found += " (the index could not be read: it was rebuilt from the blob files)"
    keyed = sum(p.kind == "wrong_key" for p in problems)  # the key is wrong, not the store: repair mends nothing
    if keyed:
        found += "; give the fleet's secret: --repair changes nothing for a wrong key"
    if keyed == len(problems) and rebuilt is None:
        return found
    if args.repair:
        now = f": the store holds {format_size(held[0])} (was {format_size(held[1])})" if held else ""
        return f"{found}; repaired" + (" the others" if keyed else "") + now
    key = f" --remote-key-file {shlex.quote(args.remote_key_file)}" if getattr(args, "remote_key_file", None) else ""
    return (f"{found}; run `{PROG} verify --repair --store {shlex.quote(str(store_path(args)))}{key}` to fix "
            + ("the others" if keyed else "them"))


def _rebuild(args, why: CorruptIndexError) -> dict:
    """Rebuild the index from the blob files, and say what was taken back."""
    from kvstore.upkeep.rebuild import rebuild_index

    say(f"{PROG} verify: {why}")
    rebuilt = rebuild_index(store_path(args))
    say(f"{PROG} verify: rebuilt the index from the blob files: {rebuilt['records']} records, "
        f"{len(rebuilt['skipped'])} files not taken back; {rebuilt['pins']}; {rebuilt['settings']}"
        + (f"; the damaged index is kept as {rebuilt['damaged_index']}" if rebuilt["damaged_index"] else ""))
    return rebuilt


def _verify_remote(args) -> int:
    """`verify --remote`: download and check every object of the bucket. What it leaves alone
    (namespaces no key of this node opens, objects not of the layout) are notes: the verdict and
    the exit code are the problems'."""
    url = remote_url(args)
    problems = remote_upkeep(args, url, "verify", repair=args.repair)
    notes = getattr(problems, "notes", [])
    repairable = getattr(problems, "repairable", [])
    if args.json:
        print(json.dumps({"clean": not problems, "repaired": bool(args.repair and repairable),
                          "repaired_problems": len(repairable) if args.repair else 0,
                          "left_problems": len(problems) - len(repairable) if args.repair else len(problems),
                          "deleted_objects": getattr(problems, "deletes", 0) if args.repair else 0,
                          "problems": [p.to_dict() for p in problems], "notes": [n.to_dict() for n in notes]},
                         indent=2))
    else:
        for p in problems:
            out(p)  # object keys are the bucket's: any writer of it chose them
        for n in notes:
            out(f"note: {n}")
        out(f"remote {url}: " + _remote_summary(args, url, problems, notes))
    return EXIT_PROBLEMS if problems else 0


_OWN_PINS = ("rolled_back_pins", "foreign_pins", "unpublished_pins")  # what --repair publishes again


def _remote_summary(args, url: str, problems: list, notes: list) -> str:
    """The last line of `verify --remote`: what was found, what `--repair` did or would do and
    what it leaves, in counts; notes are counted, never called problems."""
    noted = f"{plural(len(notes), 'note')} (left alone: not problems)" if notes else ""
    if not problems:
        return "clean" + (f"; {noted}" if noted else "")
    repairable = getattr(problems, "repairable", [])
    n, k = len(problems), len(repairable)
    parts = [f"{plural(n, 'problem')} found"]
    if args.repair:
        done = []
        if getattr(problems, "deletes", 0):
            done.append(f"deleted {plural(problems.deletes, 'object')}: each damaged one and all below it")
        if any(p.kind == "foreign_pins" for p in repairable):
            done.append("gave this node a new id and published its pins under it")
        elif any(p.kind in _OWN_PINS and "this node's" in p.detail[:12] for p in repairable):
            done.append("published this node's pins again")
        if any(p.kind == "rolled_back_pins" and p.detail.startswith("node ") for p in repairable):
            done.append("forgot the deleted pins of retired nodes")
        parts.append(f"repaired {k}" + (f" ({'; '.join(done)})" if done else ""))
        if n > k:
            parts.append(f"left {n - k} (--repair does not mend {'it' if n - k == 1 else 'them'}: see "
                         f"{'its line' if n - k == 1 else 'their lines'})")
    else:
        verb = "repair" if any(p.kind in _OWN_PINS for p in repairable) else "delete"
        command = _repair_command(args, url)
        if k == n:
            parts.append(f"run `{command}` to {verb} {'it' if n == 1 else 'them'}")
        elif k:
            parts.append(f"run `{command}` to {verb} {k} of them (it leaves the other {n - k}: see their lines)")
        else:
            parts.append(f"--repair does not mend {'it' if n == 1 else 'them'} "
                         f"(see {'its line' if n == 1 else 'their lines'})")
    return "; ".join(parts + ([noted] if noted else []))


def _repair_command(args, url: str) -> str:
    """The command that was run, with `--repair`: the same bucket, store and key file."""
    words = [PROG, "verify", "--remote", url, "--store", str(store_path(args))]
    if args.remote_key_file:
        words += ["--remote-key-file", args.remote_key_file]
    return " ".join(shlex.quote(w) for w in words + ["--repair"])


def _server_problem(e: Exception, tenant_from: str) -> str:
    """Why a server could not be checked, in a line: not reachable, or what it answered."""
    import requests

    if isinstance(e, requests.ConnectionError):
        return "no server answers there (connection refused or unreachable): is `kvstore serve` running at that URL?"
    if isinstance(e, requests.Timeout):
        return "the server did not answer in time"
    text = str(e)
    if text.startswith("the server answered 40"):
        return (f"{text} (is --tenant-from {tenant_from} how the server tells tenants, as its own "
                "--tenant-from says?)")
    return f"{type(e).__name__}: {text}"


def _isolation(args) -> int:
    """`verify --isolation [URL]`: run `serve.tenancy.isolation`'s checks and print the figures."""
    from kvstore.serve.tenancy import isolation

    least = isolation.min_probes()
    if args.probes < least:
        raise CommandError(f"--probes: at least {least}: with fewer, a threshold that tells every probe "
                           f"right is {isolation.ALPHA:.0%} likely or more by chance, so the timing check "
                           "could never fail", EXIT_USAGE)
    line = _shared_line(args.prompts) if args.prompts else None
    if args.isolation and not args.isolation.lower().startswith(("http://", "https://")):
        raise CommandError(f"--isolation {args.isolation}: not a server's URL: give http://HOST:PORT (or no URL, "
                           "with --model, to check through the library on a copy of the store's keys)", EXIT_USAGE)
    if args.isolation:
        if line is not None and line.kind != "messages":
            raise CommandError(f"--prompts {args.prompts}: a server's shared prompt is a chat line "
                               "({\"messages\": [...]}), as it was warmed", EXIT_USAGE)
        try:
            from kvstore.serve.options import admin_token

            report = isolation.check_server(args.isolation, args.tenant_from, line.value if line else None,
                                            args.probes, admin_token=admin_token(args.admin_token_file))
        except ValueError as e:
            raise CommandError(str(e), EXIT_USAGE) from None
        except Exception as e:  # the server is down or answers otherwise
            raise CommandError(f"--isolation {args.isolation}: {_server_problem(e, args.tenant_from)}") from None
        where = args.isolation
    else:
        report, where = _isolation_in_store(args, line, isolation)
    if args.json:
        print(isolation.figures_json(report))
    else:
        out(f"isolation of tenants, {where}:")
        for text in report.lines():
            out("  " + text)
        out(report.verdict())
    return 0 if report.ok else EXIT_PROBLEMS


def _shared_line(path: str):
    from kvstore.cli.options import read_prompts
    from kvstore.model import jsonl

    lines = read_prompts(path)  # (a file without a prompt line is refused there)
    if isinstance(lines[0], jsonl.LineError):
        raise CommandError(f"--prompts {path}: {lines[0]}", EXIT_USAGE)
    return lines[0]


def _isolation_in_store(args, line, isolation) -> tuple:
    """The checks through the library on a temporary store with this store's chunk size and
    tenant key (so this store is never written)."""
    import shutil
    import tempfile
    from pathlib import Path

    import kvstore
    from kvstore.cli.options import model_to_load
    from kvstore.model.loading import load_model, prepare
    from kvstore.storage.storedir import TENANT_KEY_NAME

    with open_local(args, must_exist=True, read_only=True) as files:
        sizes = [m["chunk_size"] for m in files.index.models() if m["chunk_size"]]
    key = store_path(args) / TENANT_KEY_NAME
    loaded = load_model(model_to_load(args))
    shared = None
    if line is not None:
        good, errors = prepare([line], loaded)
        if errors:
            raise CommandError(f"--prompts {args.prompts}: {errors[0]}", EXIT_USAGE)
        shared = good[0][1]
    with tempfile.TemporaryDirectory(prefix="kvstore-isolation-") as tmp:
        path = Path(tmp) / "store"
        with kvstore.open(path, chunk_size=max(set(sizes), key=sizes.count) if sizes else None) as store:
            if key.is_file():  # the store's own tenant key, so the tags are its tenants'
                shutil.copyfile(key, path / TENANT_KEY_NAME)
                (path / TENANT_KEY_NAME).chmod(0o600)
            report = isolation.check_store(store, loaded.model, loaded.model_id, shared, args.probes)
    return report, f"through the library on a temporary store with {store_path(args)}'s chunk size and tenant key"
