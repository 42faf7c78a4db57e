"""`kvstore pack import`: check a pack, then store and pin its records."""

from __future__ import annotations

from pathlib import Path

from kvstore import settings
from kvstore.cli.options import model_to_load, remote_key, remote_url, store_path
from kvstore.cli.output import PROG, out, plural, say
from kvstore.sizes import format_size


def cmd_import(args) -> int:
    from kvstore.model.loading import load_model
    from kvstore.packs.importing import import_pack
    from kvstore.packs.signing import check_public_key
    from kvstore.packs.verify import pack_folder

    pack_folder(Path(args.pack))  # a mistyped path or key is said before the model is loaded
    if args.trust_key:
        check_public_key(Path(args.trust_key))
    model_id = model_to_load(args)
    url = remote_url(args)
    loaded = load_model(model_id)
    done = import_pack(Path(args.pack), store_path(args), loaded.model, loaded.model_id, loaded.tokenizer,
                       trust_key=Path(args.trust_key) if args.trust_key else None, replay=not args.no_replay,
                       pin=not args.no_pin, remote=url, remote_key=remote_key(args),
                       **settings.given(args))
    v = done.verified
    out(f"signature: {v.signature}")
    canaries = len(v.manifest.canaries)
    replayed = (f"{v.canaries} {'canary' if v.canaries == 1 else 'canaries'} by a replayed step" if v.canaries
                else "canaries not replayed (--no-replay)" if canaries and args.no_replay
                else "no canaries in the pack" if not canaries else "no canary replayed")
    if v.unreplayable:
        replayed += (f"; {v.unreplayable} {'canary' if v.unreplayable == 1 else 'canaries'} not replayable: "
                     "this model's recurrent layers restore only at a checkpoint, and the pack has none at the "
                     "step (the one at the prompt's end is after it)")
    out(f"checked: model files, chain, {plural(len(v.records), 'blob')} and "
        f"{'its record' if len(v.records) == 1 else 'their records'}; {replayed}")
    if not args.trust_key:  # steps 2 to 5 anyone who can write the folder can make hold again
        say(f"{PROG} pack import: warning: nothing vouches for these K/V without --trust-key: whoever could "
            "write the pack could have changed them and redone every check"
            + (", its canaries too" if v.canaries else ", and no canary compared them with the model")
            + "; import packs from elsewhere with --trust-key")
    out(f"imported {args.pack}: {plural(len(v.manifest.prompts), 'prompt')}, {plural(v.tokens, 'token')}; "
        f"{plural(done.stored, 'record')} stored on disk ({format_size(done.bytes)}"
        + (f"; {done.healed} of them in place of a damaged copy, quarantined" if done.healed else "")
        + f"), {_were(done.present)} stored already; " + _pins(done, len(v.records), args.no_pin))
    if done.evicted:
        say(f"{PROG} pack import: warning: gc took {plural(done.evicted, 'record')} of the pack off the disk again "
            "at once, to keep the store within its max_bytes: import it pinned, or raise --store-max-bytes")
    return 0


def _pins(done, records: int, no_pin: bool) -> str:
    """What the import did to pins, and what an earlier import had pinned already (--no-pin
    leaves those pinned: gc keeps them)."""
    before = done.pinned_before
    if not no_pin:
        said = f"{plural(done.pinned, 'record')} pinned"
        if before and before == done.pinned:
            return said + (" (it was pinned already)" if before == 1 else " (all were pinned already)")
        return said + (f" ({before} of them {_were(before, bare=True)} pinned already)" if before else "")
    if not before:
        return "not pinned (--no-pin): gc may evict them"
    if before == records:
        return ("not pinned by this import (--no-pin), but " + ("it was" if records == 1 else f"all {records} were")
                + " pinned already: gc keeps " + ("it" if records == 1 else "them"))
    return (f"not pinned by this import (--no-pin): {_were(before)} pinned already (gc keeps them), gc may evict "
            f"the other {records - before}")


def _were(n: int, *, bare: bool = False) -> str:
    """`1 was`, `3 were` (`was`, `were` if `bare`)."""
    verb = "was" if n == 1 else "were"
    return verb if bare else f"{n} {verb}"
