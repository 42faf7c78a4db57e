"""`kvstore pack export`: the stored records of some prompts, as a pack folder."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvstore.cli.options import bound, prompt_items
from kvstore.cli.output import PROG, CommandError, out, plural, say
from kvstore.sizes import format_size


def cmd_export(args) -> int:
    from kvstore.model.fingerprint import resolve_model_dir
    from kvstore.model.jsonl import LineError
    from kvstore.packs.export import check_prompts, distinct, export_pack
    from kvstore.packs.signing import check_private_key
    from kvstore.packs.verify import is_free

    if args.sign_key:  # a mistyped key is said before the model is loaded and the prompts computed
        check_private_key(Path(args.sign_key))
    if not is_free(Path(args.out).absolute()):  # and a used --out (it said "computing 1 prompt" first)
        raise CommandError(f"{args.out} exists and is not an empty folder: a pack is written to a new folder")
    items = prompt_items(args)
    bad = [item for item in items if isinstance(item, LineError)]
    if bad:  # (before a store is opened or made: nothing is exported anyway)
        for item in bad:
            say(f"{PROG} pack export: {item}")
        raise CommandError(f"{plural(len(bad), 'prompt line')} could not be used (said above): nothing exported")
    with bound(args, items, "pack export") as (store, loaded, mc, work, errors):
        if errors:
            raise CommandError(f"{plural(len(errors), 'prompt line')} could not be used (said above): "
                               "nothing exported")
        prompts, pins = [tokens for _, tokens in work], [item.pin for item, _ in work]
        check_prompts(mc, prompts)  # (before it says what it computes)
        with _progress(mc, distinct(prompts)) as progress:
            done = export_pack(store, mc, resolve_model_dir(loaded.model_id), loaded.tokenizer, prompts,
                               Path(args.out), sign_key=Path(args.sign_key) if args.sign_key else None,
                               progress=progress, pins=pins)
        where = store.path
    shared = done.tokens - done.computed - done.stored_before
    within = ", ".join(([f"{done.within_another} of them within a longer one"] if done.within_another else [])
                       + ([("and " if done.within_another else "") + f"{plural(done.repeats, 'repeat')} of them, "
                           "carried once"] if done.repeats else []))
    within = f" ({within})" if within else ""
    out(f"pack {args.out}: {plural(done.prompts, 'prompt')}{within}, {plural(done.tokens, 'token')} "
        f"({done.computed} computed now, {done.stored_before} stored before this export"
        + (f", {shared} shared with an earlier prompt of it" if shared > 0 else "")
        + f"), {plural(done.records, 'record')}, {done.bytes} bytes ({format_size(done.bytes)})")
    if done.computed:  # what the export wrote besides the pack
        out(f"the {plural(done.computed, 'token')} computed now {'is' if done.computed == 1 else 'are'} stored in "
            f"{where} too" + ("" if done.pinned else " (not pinned)"))
    if done.pinned:
        out(f"{plural(done.pinned, 'prompt')} pinned in {where} (\"pin\": true): gc keeps "
            f"{'it' if done.pinned == 1 else 'them'} (`{PROG} pins --remove` unpins)")
    if done.pin_asked > done.pinned:
        out(f"{plural(done.pin_asked - done.pinned, 'prompt')} with \"pin\": true not pinned in {where}: the store "
            "does not hold all of its records pinned (another process evicted or unpinned some)")
    if done.unpinned:
        out(f"{plural(done.unpinned, 'record')} unpinned in {where} (\"pin\": false)")
    out(f"signed with {args.sign_key}" if done.signed else "unsigned: an importer cannot tell who made it")
    out("it holds its prompts in clear (every record holds its token ids): share it only with those "
        "who may read them")
    return 0


@contextmanager
def _progress(mc, prompts: list):
    """What an export says while it computes the prompts not stored yet: a count of tokens on a
    terminal, one line otherwise; nothing when all of them are stored."""
    # (In exact mode a stored prompt is all but its last token, the first generation step's.)
    missing = [len(part) - mc.stored_length(part) for part in (mc.stored_part(np.asarray(t)) for t in prompts)]
    todo = [n for n in missing if n > 0]
    if not todo:
        yield None
        return
    if not sys.stderr.isatty():
        say(f"computing {plural(len(todo), 'prompt')} not stored whole yet (at most "
            f"{plural(sum(todo), 'token')}: what they share is computed once)")
        yield None
        return
    from tqdm import tqdm

    with tqdm(desc="tokens computed", unit="tok", unit_scale=True, file=sys.stderr, dynamic_ncols=True) as bar:
        yield bar.update
