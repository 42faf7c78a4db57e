"""`kvstore stats`: the store's totals and a table per model version (or one JSON object)."""

from __future__ import annotations

import json
import time

from kvstore.cli.options import open_local, open_remote, remote_url, unread_key_file
from kvstore.cli.output import PROG, on_store, out, plural
from kvstore.sizes import format_age, format_setting, format_size

EXAMPLES = """examples:
  kvstore stats
  kvstore stats --store ~/kv --json"""

# The scope of the keys `stats` prints, as the library's `kvstore.store.stats_scope` names them
# (a test holds the two to agree): what the store directory holds is the same in every process
# that opens it; how this process opened it is its own; the remote's counters are this
# process's, their `totals` every process's on this store.
PROCESS_KEYS = ("read_only",)
MIXED = {"remote": "process; its totals: store", "writes": "store; admit and max_write_rate: process",
         "settings": "process; kept ones: store"}
WRITE_DAYS = 7


def register(add, store_opts, model_opts) -> None:
    p = add("stats", cmd_stats, "show totals and a table per model", [store_opts], EXAMPLES)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (bytes, chunks, tails, models, ...); its \"scope\" map says "
                        "which keys are totals of the store and which count this process only")


def scope(stats: dict) -> dict[str, str]:
    """`{key: "store" | "process" | ...}` for every key `stats` prints."""
    return {key: MIXED.get(key, "process" if key in PROCESS_KEYS else "store") for key in stats}


def read_stats(args) -> dict:
    """What the store directory holds (`LocalStore.stats`), whether this process may write it,
    and the remote's counters when one is given (`--remote` or `$KVSTORE_REMOTE`)."""
    url = remote_url(args)
    unread_key_file(args, url)
    if not url:
        with open_local(args, must_exist=True, read_only=None) as files:
            return _local(files)
    with open_remote(args, url, must_exist=True, read_only=None) as (files, remote):
        return {**_local(files), "remote": remote.stats()}


def _local(files) -> dict:
    """What the store directory holds, its kept settings and its write log (`write.budget.summary`)."""
    from kvstore import settings
    from kvstore.write.budget import summary

    stats = files.stats()  # (first: it checks the index, and refuses a damaged one)
    with files.damage_is_an_error():
        resolved = files.settings()
        writes = summary(files.index, policy=resolved["admit"][0], per_day=resolved["max_write_rate"][0],
                         days=WRITE_DAYS)
    return {**stats, "read_only": files.read_only, "writes": writes, "settings": settings.report(resolved)}


def cmd_stats(args) -> int:
    stats = read_stats(args)
    if args.json:
        print(json.dumps({**stats, "scope": scope(stats)}, indent=2, sort_keys=True, default=str))
        return 0
    out(f"store: {stats['path']}")
    sizes = sorted({m["chunk_size"] for m in stats["models"] if m["chunk_size"] is not None})
    checkpoints = f"checkpoints: {stats['checkpoints']}   " if stats.get("checkpoints") else ""  # (recurrent layers)
    print(f"bytes: {stats['bytes']} ({format_size(stats['bytes'])})   chunks: {stats['chunks']}   "
          f"tails: {stats['tails']}   {checkpoints}models: {len(stats['models'])}   "
          f"chunk size: {', '.join(map(str, sizes)) or '-'}")
    where = on_store(args)  # (in the commands it suggests)
    _print_settings(stats.get("settings"), where)
    _print_remote(stats.get("remote"))
    _print_writes(stats.get("writes"))
    _print_quarantine(stats, where)
    _print_tenants(stats.get("tenants") or [])
    if stats["models"]:
        _print_models(stats["models"], where)
    return 0


def _print_tenants(tenants: list[dict], most: int = 10) -> None:
    """Each tenant's records, by its tag (never its id), the largest first; a cache_salt's tenant
    says whose quota it shares, and each such owner what its tenants hold together."""
    if not tenants:
        return
    shown = ", ".join(f"{t['tenant']} {format_size(t['bytes'])} ({plural(t['records'], 'record')}"
                      f"{'; quota of owner ' + t['owner'] if t.get('owner') else ''})" for t in tenants[:most])
    more = f", and {len(tenants) - most} more" if len(tenants) > most else ""
    out(f"tenants: {len(tenants)} ({format_size(sum(t['bytes'] for t in tenants))}): {shown}{more}")
    groups: dict[str, list[dict]] = {}  # owner -> its tenants (itself included, if it holds records)
    for t in tenants:
        groups.setdefault(t.get("owner") or t["tenant"], []).append(t)
    shared = [(owner, members) for owner, members in groups.items() if any(t.get("owner") for t in members)]
    for owner, members in shared[:most]:
        salted = sum(1 for t in members if t.get("owner"))
        out(f"tenant {owner}'s quota holds {format_size(sum(t['bytes'] for t in members))}: "
            f"{'itself and ' if salted < len(members) else ''}{plural(salted, 'cache_salt tenant')} sharing it")


def _print_settings(entries: dict | None, where: str = "") -> None:
    """The settings that are not their defaults (`kvstore settings` shows them all)."""
    from kvstore import settings

    changed = settings.not_default(entries or {})
    print(f"settings: {changed or 'all defaults'} (`{PROG} settings{where}` shows them all)")


def _print_remote(remote: dict | None) -> None:
    if not remote:
        return
    t = remote["totals"]
    unused = max(0, t["downloads"] - t["downloads_used"] - t["prefetched"])
    prefetched = f", {t['prefetched']} fetched ahead" if t["prefetched"] else ""
    there = (f"; {t['already_there']} already there: {format_size(t['already_there_bytes'])} sent, and read back "
             "to check" if t["already_there"] else "")
    out(f"remote: {remote['url']}   uploads: {t['uploads']} ({format_size(t['upload_bytes'])}{there})   "
        f"downloads: {t['downloads']} ({format_size(t['download_bytes'])}; {t['downloads_used']} used{prefetched}, "
        f"{unused} unused)   remote hits: {t['remote_hits']} ({t['partial_restores']} partial)   "
        f"errors: {t['errors']}   dropped uploads: {t['dropped_uploads']}   skipped uploads: "
        f"{t['skipped_down_uploads']} (remote down) / {t['skipped_no_parent']} (no parent)   "
        f"past the wait: {t['deadline_misses']}")
    if t.get("skipped_wrong_key"):
        out(f"remote: uploads skipped because this node's key is not the fleet's: {t['skipped_wrong_key']} (the "
            "wrong-key line in the log says why; give the fleet's secret)")
    if t.get("refused_uploads"):
        out(f"remote: refused uploads: {t['refused_uploads']} (a blob changed after it was written, or without "
            "a trust tag of this fleet: the warning in the log says which; `kvstore verify` finds them)")
    older = remote.get("older_keys") or []
    if older:
        out(f"remote key: {remote['key']} (written with); still read: {', '.join(older)} (a rotation not "
            "finished: `kvstore gc --remote --drop-key ID` ends it)")


def _print_writes(writes: dict | None) -> None:
    """Writes to this disk: the settings, the totals, what was kept out, and a line a day."""
    if not writes:
        return
    rate = writes["max_write_rate"]
    budget = (f"budget: {format_setting(rate)}/day, {format_size(writes['budget_left'])} left"
              if rate is not None else "budget: off")
    if rate is not None and writes["budget_left"] < rate - writes["bytes_last_day"]:  # (not what was written)
        budget += " (an hour of the write log was damaged: it counts as the whole budget until it leaves the day)"
    print(f"writes: {format_size(writes['bytes_last_day'])} in the last day "
          f"({format_size(writes.get('explicit_last_day', 0))} of it explicit: warmed and pinned), "
          f"{format_size(writes['bytes_lifetime'])} in all (remote downloads: "
          f"{format_size(writes['downloaded_lifetime'])})   admit: {writes['admit']}   {budget}")
    # Counted when a record is kept out, never taken back when it is written later: these are not
    # what is in RAM now (no other process's RAM can be seen from here).
    print(f"kept out of the disk when inserted, in all: not admitted: {writes['not_admitted']} "
          f"({format_size(writes['not_admitted_bytes'])}), over budget: {writes['over_budget']} "
          f"({format_size(writes['over_budget_bytes'])}); written since if asked for again (or inserted again "
          "when the budget had room), else lost when their process exited")
    for day in writes["days"]:
        print(f"  {day['day']}  {format_size(day['bytes'] + day['downloaded']):>10}  "
              f"{plural(day['records'], 'record')}"  # (downloads are bytes of the log, not records of it)
              + (f" + {format_size(day['downloaded'])} downloaded" if day["downloaded"] else "")
              + f", not admitted {day['not_admitted']}, "
              f"over budget {day['over_budget']}")


def _print_quarantine(stats: dict, where: str = "") -> None:
    now_bad = stats.get("quarantined_now") or {}
    if stats.get("quarantined_total") or now_bad.get("records"):
        print(f"quarantined records: {now_bad.get('records', 0)} now ({format_size(now_bad.get('bytes', 0))}, "
              f"never served; any `{PROG} gc{where}` drops those not pinned, storing the prompt again heals "
              f"it), {stats.get('quarantined_total', 0)} so far (run `{PROG} verify{where}`)")
    moved = stats.get("quarantine_folder") or {}
    if moved.get("files"):
        out(f"{stats['path']}/quarantine: {plural(moved['files'], 'file')} ({format_size(moved['bytes'])}) that "
            f"`{PROG} verify --repair{where}` moved aside (not kvstore's; never deleted by kvstore: look, then remove them)")


def _print_models(models: list[dict], where: str = "") -> None:
    """One row per model version, and how much of it is stale."""
    now = time.time()
    header = ("fingerprint", "chunks", "tails", "bytes", "hits", "last use", "stale", "model")
    rows = [(m["fingerprint"][:12], str(m["chunks"]), str(m["tails"]), format_size(m["bytes"]), str(m["hits"]),
             f"{format_age(now - m['last_used'])} ago" if m.get("last_used") else "never",
             _stale_cell(m), m["model_id"] + _kv_note(m.get("layout")))
            for m in models]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    print()
    for row in [header, *rows]:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out("  ".join(cells + [row[-1]]))
    held = sum(m["bytes"] for m in models if m.get("stale"))
    unsure = [m for m in models if _stale_cell(m) == "changed"]
    if held or unsure:
        print()
    if held:
        out(f"STALE: {format_size(held)} of K/V whose model files changed or are gone since they were stored; "
            f"`{PROG} gc --stale{where}` evicts it, pinned records too")
    for m in unsure:  # the bytes may be the same (a folder copied away and back): not stale yet
        out(f"changed: {m['fingerprint'][:12]}: {m['stale_reason']}; `{PROG} gc --stale{where}` hashes "
            f"the changed files again and evicts the version only if their bytes differ")


def _kv_note(layout) -> str:
    """How a version stores its K/V, when not as the model computed them: one model's versions
    differ in that alone (same fingerprint), and each is a namespace of its own."""
    layers = layout.get("layers", []) if isinstance(layout, dict) else []
    for key, what in (("disk_bits", "on disk"), ("bits", "quantized by mlx-lm, --kv-bits")):
        bits = sorted({str(c[key]) for c in layers if isinstance(c, dict) and c.get(key)})
        if bits:
            return f" (K/V {'/'.join(bits)}-bit, {what})"
    return ""


def _stale_cell(m: dict) -> str:
    """The `stale` column: STALE, no, changed (files changed, bytes not re-checked) or ? (unknown)."""
    if m.get("stale") is None:
        return "changed" if m.get("stale_reason") else "?"
    return "STALE" if m["stale"] else "no"
