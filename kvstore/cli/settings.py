"""`kvstore settings`: every store setting with its value and where it came from; change or
forget the ones the store keeps."""

from __future__ import annotations

import json

from kvstore import settings as table
from kvstore.argv import did_you_mean
from kvstore.cli.options import open_local, store_path
from kvstore.cli.output import EXIT_USAGE, PROG, CommandError, out, say
from kvstore.errors import InvalidInputError
from kvstore.sizes import format_size
from kvstore.storage.storedir import is_absent

EXAMPLES = """examples:
  kvstore settings --store ~/kv                        # every setting, its value and source
  kvstore settings --store ~/kv admit=reused max_write_rate=20GB/day
  kvstore settings --store ~/kv --reset max_write_rate # forget it: the default applies again

A source is `kept` (the store remembers it: every run that does not give the option uses it) or
`default`. Settings that are not kept apply to one run: give their option to that command (or the
keyword to kvstore.open). A process that has the store open (kvstore serve) keeps the values it
opened with until it starts again."""


def register(add, store_opts, model_opts) -> None:
    p = add("settings", cmd_settings, "show the store's settings; change or forget the kept ones",
            [store_opts], EXAMPLES)
    p.add_argument("changes", nargs="*", metavar="NAME=VALUE", help="keep this value in the store")
    p.add_argument("--reset", metavar="NAME", action="append", default=[],
                   help="forget a kept setting (its default applies again); may be repeated")
    p.add_argument("--json", action="store_true", help="print one JSON object: {name: {value, source}}")


def _setting(name: str, what: str) -> table.Setting:
    s = table.BY_NAME.get(name.strip().replace("-", "_"))
    if s is None:
        named = did_you_mean(name, table.BY_NAME) if name.strip() else "named"
        kept = ", ".join(k.name for k in table.BY_NAME.values() if k.kept)
        raise CommandError(f"{what}: no setting {named}; the store keeps {kept} (`kvstore settings` lists "
                           "every setting)", EXIT_USAGE)
    if not s.kept:
        hint = f"give {s.flag} to each command that should use it" if s.flag else f"pass {s.name}= to kvstore.open"
        raise CommandError(f"{what}: {s.name} is not kept in the store, it applies to one run: {hint}", EXIT_USAGE)
    return s


def _changes(args) -> list[tuple[table.Setting, object]]:
    out_ = []
    for text in args.changes:
        name, eq, value = text.partition("=")
        if not eq:
            raise CommandError(f"{text!r}: give NAME=VALUE, like admit=reused", EXIT_USAGE)
        s = _setting(name, text)
        try:
            parsed = s.parse(value, s.name)
            table.check_chunks(s, parsed, "to keep")  # (the chunk size of every command)
            out_.append((s, parsed))
        except InvalidInputError as e:  # what was wrong with the value
            raise CommandError(str(e), EXIT_USAGE) from None
    return out_


def cmd_settings(args) -> int:
    given = [flag for flag, value in (("--remote", args.remote), ("--remote-key-file", args.remote_key_file))
             if value is not None]
    if given:  # (accepted and ignored, it would look as if the bucket's settings were shown or set)
        raise CommandError(f"{' and '.join(given)}: settings are kept in the local store (--store), one store "
                           "at a time; the bucket keeps none: leave it out", EXIT_USAGE)
    changes = _changes(args)
    resets = [_setting(name, f"--reset {name}") for name in args.reset]
    named = [s.name for s, _ in changes] + [s.name for s in resets]
    twice = sorted({n for n in named if named.count(n) > 1})
    if twice:  # which one would win is not what the user meant to say
        raise CommandError(f"{', '.join(twice)} given more than once (to keep and to --reset, or twice): "
                           "give each setting once", EXIT_USAGE)
    writes = bool(changes or resets)
    new = bool(changes) and is_absent(store_path(args))  # (a reset alone keeps nothing: it makes no store)
    with open_local(args, must_exist=not changes, read_only=None if not writes else False) as files:
        if new:  # (a mistyped --store would otherwise become a store without a word)
            say(f"{PROG} settings: no store was at {files.path}: made a new, empty one to keep these settings")
        before = files.settings()
        for s in resets:
            files.index.set_setting(s.name, None)
            value, source = before[s.name]
            say(f"{PROG} settings: forgot {s.name}" + (f" (was {s.show(value)})" if source == table.KEPT else
                                                        " (it was not kept)") + f"; now {s.show(s.default)}, the default")
        for s, value in changes:
            files.index.set_setting(s.name, s.encode(value))
            old, source = before[s.name]
            if (old, source) == (value, table.KEPT):  # (not a change: nothing to undo)
                say(f"{PROG} settings: {s.name}={s.show(value)} was kept already; nothing changed")
                continue
            changed = f"; {s.changed}{_held_at_other_widths(files.index, value)}" if s.changed and old != value else ""
            say(f"{PROG} settings: kept {s.name}={s.show(value)} (was {s.show(old)}, {source}){changed}")
        resolved = files.settings() if writes else before  # (a damaged kept value is said once)
        if args.json:
            print(json.dumps(table.report(resolved), indent=2, sort_keys=True))
            return 0
        out(f"store: {files.path}")
    _print(resolved, files.path)
    return 0


def _held_at_other_widths(index, bits: int | None) -> str:
    """`: it holds 20 records, 3.7 MiB, at 16 bits`: the records of bf16/f16 models stored at
    another `disk_kv_bits` than `bits` (none of f32 models, nor of caches mlx-lm quantized)."""
    from kvstore.restore.quant import layout_bits  # (here: it imports mlx, which stats and gc never do)

    held: dict[str, list[int]] = {}
    for m in index.models():
        layout = m["layout"] if isinstance(m["layout"], dict) else {}
        width = layout_bits(layout)
        layers = [c for c in layout.get("layers", []) if isinstance(c, dict)]
        half = {"mlx.core.bfloat16", "mlx.core.float16"} & set(layout.get("param_dtypes") or ())
        plain = any(c.get("class") in ("KVCache", "RotatingKVCache") and "bits" not in c for c in layers)
        if width != bits and m["chunks"] + m["tails"] and (width is not None or (half and plain)):
            count = held.setdefault(f"{width or 16} bits", [0, 0])
            count[0] += m["chunks"] + m["tails"] + m["checkpoints"]
            count[1] += m["bytes"] or 0
    return (": it holds " + ", ".join(f"{n} record{'s' if n != 1 else ''}, {format_size(b)}, at {w}"
                                      for w, (n, b) in sorted(held.items()))) if held else ""


def _print(resolved: dict, store) -> None:
    rows = [("setting", "value", "source", "option")]
    for s in table.STORE_SETTINGS:
        value, source = resolved[s.name]
        option = s.flag or "library only"
        if s.serve_default is not None:
            option += f" (kvstore serve: {s.show(s.serve_default)})"
        rows.append((s.name, s.show(value), source if s.kept else f"{source}, per run", option))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        out("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    for note in table.notes(resolved, store):
        out(note)
