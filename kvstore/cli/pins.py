"""`kvstore pins`: what is pinned, per model version; with `--remove`, unpin prompts."""

from __future__ import annotations

import json

from kvstore.cli.options import (
    add_prompt_source,
    add_tenant_salt,
    bound,
    open_local,
    prompt_items,
    salted_tenant,
    store_path,
    tenant_id,
)
from kvstore.cli.output import EXIT_PROBLEMS, EXIT_USAGE, PROG, CommandError, out, plural, say
from kvstore.sizes import format_size

EXAMPLES = """examples:
  kvstore pins --store ~/kv
  kvstore pins --store ~/kv --remove --prompts examples/prompts.jsonl
  kvstore pins --remove --messages '[{"role": "system", "content": "You are ..."}]' --model ./my-model

Listing reads the index only (no model is loaded); --remove loads the model, to find the prompt's
records. Unpinning a prompt unpins all of its records, those it shares with other prompts too: a
pinned prompt that goes on past them still keeps them, but one that ends on them (a whole number
of chunks) loses its pin; warm it again with "pin": true."""


def register(add, store_opts, model_opts) -> None:
    p = add("pins", cmd_pins, "list what is pinned, or unpin prompts (--remove)", [store_opts, model_opts],
            EXAMPLES)
    p.add_argument("--remove", action="store_true",
                   help="unpin the prompt given by --prompt, --messages or --prompts (gc may then evict it)")
    add_prompt_source(p, "with --remove: unpin every line of a prompt file (- for stdin)", required=False)
    p.add_argument("--tenant", metavar="ID", type=tenant_id,
                   help="with --remove: unpin the prompt as that tenant pinned it (its own records; without "
                        "it, the shared ones)")
    add_tenant_salt(p, "with --remove")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_pins(args) -> int:
    given = args.prompt is not None or args.messages is not None or args.prompts is not None
    if args.remove and not given:
        raise CommandError("pins --remove needs --prompt, --messages or --prompts", EXIT_USAGE)
    if (args.tenant is not None or args.tenant_salt is not None) and not args.remove:
        raise CommandError(f"--tenant{'-salt' if args.tenant is None else ''} goes with --remove (`kvstore pins` "
                           "lists every tenant's pins by tag)", EXIT_USAGE)
    args.tenant = salted_tenant(args)
    if given and not args.remove:
        raise CommandError("--prompt, --messages and --prompts name prompts to unpin: add --remove "
                           "(`kvstore pins` alone lists what is pinned)", EXIT_USAGE)
    return _remove(args) if args.remove else _list(args)


def _list(args) -> int:
    """What is pinned, from the index alone (no mlx)."""
    with open_local(args, must_exist=True, read_only=None) as files:
        models = files.pins()
        path = files.path
    records, size = sum(m["records"] for m in models), sum(m["bytes"] for m in models)
    if args.json:
        print(json.dumps({"path": str(path), "records": records, "bytes": size, "models": models}, indent=2))
        return 0
    if not models:
        out(f"nothing is pinned in the store {path}")
        return 0
    out(f"pinned in {path}: {plural(records, 'record')} ({format_size(size)}) of "
        f"{plural(len(models), 'model version')}")
    for m in models:
        stale = (f"; STALE: its model files are gone or changed, `{PROG} gc --stale` frees them"
                 if m["stale"] else "")
        out(f"  {m['fingerprint'][:12]}  {plural(m['records'], 'record')}, {format_size(m['bytes'])}, "
            f"{plural(m['tokens'], 'token')}  {m['model_id']}{stale}")
        if m["held_records"] > m["records"]:  # (a pinned tail's chunks, a pinned prompt's shared start)
            out(f"    gc keeps them with the records they hang from: {plural(m['held_records'], 'record')}, "
                f"{format_size(m['held_bytes'])}")
        for tag, t in (m.get("tenants") or {}).items():
            out(f"    of them tenant {tag}'s own: {plural(t['records'], 'record')}, {format_size(t['bytes'])} "
                f"(`{PROG} pins --remove --tenant ID` or `--tenant-salt SALT` unpins them)")
    return 0


def _remove(args) -> int:
    """Unpin each prompt named, and say what each had pinned."""
    items = prompt_items(args)
    with open_local(args, must_exist=True):  # a store to unpin in, never a new one
        pass
    done = []
    with bound(args, items, "pins") as (store, loaded, mc, work, errors):
        if args.tenant is not None:
            mc = mc.with_tenant(store.tenant(args.tenant))
        for item, tokens in work:
            result = mc.unpin(tokens)
            done.append({"where": item.where, "tokens": len(tokens), **result})
            if not args.json:
                _say_unpinned(done[-1])
        left = store.pins()
    if args.json:
        print(json.dumps({"path": str(store_path(args)), "unpinned": done, "errors": [str(e) for e in errors],
                          "pinned_left": {"records": sum(m["records"] for m in left),
                                          "bytes": sum(m["bytes"] for m in left)}}, indent=2))
    elif len(done) > 1:
        out(f"unpinned {plural(sum(d['records'] for d in done), 'record')} "
            f"({format_size(sum(d['bytes'] for d in done))}) of {plural(len(done), 'prompt')}; "
            f"{plural(sum(m['records'] for m in left), 'record')} still pinned")
    if errors:
        say(f"{PROG} pins: {plural(len(errors), 'bad line')} skipped (nothing unpinned for them)")
    return EXIT_PROBLEMS if errors else 0


def _say_unpinned(d: dict) -> None:
    if d["records"]:
        out(f"{d['where']}: unpinned {plural(d['records'], 'record')} ({format_size(d['bytes'])}) of "
            f"{plural(d['tokens'], 'token')}; gc may now evict {'it' if d['records'] == 1 else 'them'}")
    else:
        out(f"{d['where']}: nothing was pinned for this prompt ({plural(d['tokens'], 'token')})")
