"""`kvstore pack export`: the stored records of some prompts, as a pack folder."""

from __future__ import annotations

from pathlib import Path

from kvstore.cli.options import bound, prompt_items
from kvstore.cli.output import CommandError, out, plural
from kvstore.sizes import format_size


def cmd_export(args) -> int:
    from kvstore.model.fingerprint import resolve_model_dir
    from kvstore.packs.export import export_pack
    from kvstore.packs.signing import check_private_key

    if args.sign_key:  # a mistyped key is said before the model is loaded and the prompts computed
        check_private_key(Path(args.sign_key))
    items = prompt_items(args)
    with bound(args, items, "pack export") as (store, loaded, mc, work, errors):
        if errors:
            raise CommandError(f"{plural(len(errors), 'prompt line')} could not be used (said above): "
                               "nothing exported")
        done = export_pack(store, mc, resolve_model_dir(loaded.model_id), loaded.tokenizer,
                           [tokens for _, tokens in work], Path(args.out),
                           sign_key=Path(args.sign_key) if args.sign_key else None)
        where = store.path
    shared = done.tokens - done.computed - done.stored_before
    within = ", ".join(([f"{done.within_another} of them within a longer one"] if done.within_another else [])
                       + ([f"{done.repeats} of them a repeat of an earlier one"] if done.repeats else []))
    within = f" ({within})" if within else ""
    out(f"pack {args.out}: {plural(done.prompts, 'prompt')}{within}, {plural(done.tokens, 'token')} "
        f"({done.computed} computed now, {done.stored_before} stored before this export"
        + (f", {shared} shared with an earlier prompt of it" if shared > 0 else "")
        + f"), {plural(done.records, 'record')}, {done.bytes} bytes ({format_size(done.bytes)})")
    if done.computed:  # what the export wrote besides the pack
        out(f"the {plural(done.computed, 'token')} computed now are stored in {where} too (not pinned)")
    out(f"signed with {args.sign_key}" if done.signed else "unsigned: an importer cannot tell who made it")
    out("it holds its prompts in clear (every record holds its token ids): share it only with those "
        "who may read them")
    return 0
