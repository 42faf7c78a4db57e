"""`kvstore generate`: generate text, reusing the store and adding to it."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

import numpy as np

from kvstore.argv import at_least, temperature
from kvstore.cli.options import add_prompt_source, add_store_settings, bound, prompt_items
from kvstore.cli.output import (
    EXIT_PROBLEMS,
    PROG,
    FirstCtrlC,
    disk_budget,
    on_store,
    out,
    plural,
    remote_tokens,
    say,
    uploads_undone,
    write_error,
    write_problems,
)

EXAMPLES = """examples:
  kvstore generate --prompt "You are a helpful assistant. What is a KV cache?"
  kvstore generate --messages '[{"role": "user", "content": "Hello"}]' --max-tokens 64
  kvstore generate --prompts examples/prompts.jsonl --model ./my-model

Run it twice: the second run reuses the stored prompt (see "reused from the store" on stderr)."""


def register(add, store_opts, model_opts) -> None:
    p = add("generate", cmd_generate, "generate text, reusing the store and adding to it",
            [store_opts, model_opts], EXAMPLES)
    add_prompt_source(p, "generate for every line of a prompt file (- for stdin)")
    p.add_argument("--max-tokens", metavar="N", type=at_least(1, "tokens"), default=128,
                   help="tokens to generate at most (default: 128)")
    p.add_argument("--temp", metavar="T", type=temperature, default=0.0,
                   help="sampling temperature (default: 0, greedy)")
    p.add_argument("--seed", metavar="S", type=at_least(0, "a seed", 2**64 - 1), help="random seed for sampling")
    add_store_settings(p)


def _items(args) -> list:
    """The prompt lines to generate for: `--prompt`, `--messages` or the lines of `--prompts`."""
    return prompt_items(args)


def cmd_generate(args) -> int:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    items = _items(args)
    with bound(args, items, "generate") as (store, loaded, mc, work, errors):
        if store.remote is not None:  # what uploads were left undone is said once, in the last lines
            store.remote.say_undone = False
        if args.seed is not None:
            mx.random.seed(args.seed)
        sampler = make_sampler(temp=args.temp)
        failed = 0
        pinning = [item.where for item, _ in work if item.pin]
        if pinning:  # (a line written for warm: said, not silently left unpinned)
            say(f"{PROG} generate: pins nothing: \"pin\" of {pinning[0]}"
                + (f" and {len(pinning) - 1} more line{'s' if len(pinning) > 2 else ''}" if len(pinning) > 1 else "")
                + f" is for `{PROG} warm`, which pins what it stores")
        for item, tokens in work:
            if args.prompts is not None:
                out(f"[{item.id if item.id is not None else item.where}]", flush=True)
            failed += not _generate_one(args, store, loaded, mc, tokens, sampler)
        if failed:
            say(f"{PROG} generate: {failed} of {len(work)} generations were not stored: "
                f"{write_error(store)}")
        if store.remote is not None:
            store.flush()  # (within the remote's flush timeout) to count what did not go up
        undone = uploads_undone(store)
        if undone:
            say(f"{PROG} generate: {undone}")
        budget = disk_budget(store, on_store(args))
        if budget:
            say(budget)
    return EXIT_PROBLEMS if errors or failed else 0


@dataclass
class _Run:
    """One pass of generation: what it printed, and how it ended."""

    ttft: float | None = None
    generated: list = field(default_factory=list)
    finish: str | None = None
    canary: object = None
    moved: object = None  # the first step's check against the stored canary
    interrupted: bool = False  # Ctrl-C: stopped after a whole prefill step, or after a token


class _Interrupted(Exception):
    """Ctrl-C during the prefill: raised between two of its steps, so the cache holds whole steps."""


def _stream(args, loaded, mc, tokens, start, sampler, t0: float, ctrl_c, check: bool) -> _Run:
    """Generate from `start` (a `prompt_cache`), printing as it goes; stop before printing when
    `check` and the first step does not give the restored prompt's canary."""
    from mlx_lm import stream_generate

    from kvstore.certify.firststep import check_first_step
    from kvstore.model.prefill import canary_of

    def progress(done: int, total: int) -> None:
        if ctrl_c.requested and done < total:
            raise _Interrupted

    run = _Run()
    try:
        for response in stream_generate(loaded.model, loaded.tokenizer, start.rest, max_tokens=args.max_tokens,
                                        prompt_cache=start.cache, sampler=sampler, prompt_progress_callback=progress):
            if run.ttft is None:
                run.ttft = time.perf_counter() - t0
                run.canary = canary_of(len(tokens) - 1, int(tokens[-1]), response.logprobs)
                run.moved = check_first_step(mc, tokens, response.logprobs)  # the stored prompt again: its canary's step
                if check and run.moved is not None and not run.moved.ok:
                    return run  # nothing printed yet: the answer comes from the prompt computed again instead
                if start.hold is not None:  # exact mode: the prompt's end, stored with its canary
                    start.hold.submit(run.canary)
            print(response.text, end="", flush=True)
            run.generated.append(response.token)
            run.finish = response.finish_reason
            if ctrl_c.requested:
                run.finish, run.interrupted = "interrupted", True
                break
    except _Interrupted:
        run.finish, run.interrupted = "interrupted", True
    return run


def _generate_one(args, store, loaded, mc, tokens, sampler) -> bool:
    """Generate for one prompt, print the text and a report line; False if it was not stored.
    A first Ctrl-C stops after the prefill step or token in progress, stores what was computed
    and says so, then stops the command (`KeyboardInterrupt`)."""
    from kvstore.certify.compare import disk_bits
    from kvstore.model.blas import long_prefill_note
    from kvstore.model.prefill import insert_generated, prompt_cache

    t0 = time.perf_counter()
    downloaded, before = remote_tokens(store), write_problems(store)
    start = prompt_cache(mc, tokens)
    reused = start.reused
    from_bucket = min(reused, remote_tokens(store) - downloaded)
    slow = long_prefill_note(lambda: len(start.rest))
    if slow:
        say(slow)
    ctrl_c = FirstCtrlC("generate", "the prefill step or token in progress, storing what is computed")
    previous = signal.signal(signal.SIGINT, ctrl_c)
    try:
        run = _stream(args, loaded, mc, tokens, start, sampler, t0, ctrl_c, check=True)
        if run.moved is not None and not run.moved.ok and not run.generated and not run.interrupted:
            kept = ("its K/V are stored quantized (disk_kv_bits), so its records are kept, and the answer is "
                    "computed again without restoring them" if disk_bits(mc) else  # (reported only: not quarantined)
                    "the records it was restored from are quarantined, and the answer is computed again without them")
            say(f"{PROG} generate: the restored prompt did not give its canary ({run.moved.reason}); {kept}")
            start = prompt_cache(mc, tokens, restore=False)  # the cold run, as `kvstore serve` computes it again
            reused = start.reused
            from_bucket = min(reused, remote_tokens(store) - downloaded)
            run = _stream(args, loaded, mc, tokens, start, sampler, t0, ctrl_c, check=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    cache, generated, ttft, finish, canary = start.cache, run.generated, run.ttft, run.finish, run.canary
    print(flush=True)
    if start.hold is not None:
        start.hold.submit()  # no step ran: stored without a canary (a second submit does nothing)
    stored = insert_generated(mc, tokens, generated, cache, canary)
    generated_stored = [] if mc.exact else generated
    if mc.exact:  # what exact mode stores: the prompt but its last token, as it was prefilled
        stored = len(mc.stored_part(np.asarray(tokens)))
    elif not stored:
        say(f"{PROG} generate: not stored: the cache does not say which of the "
            f"{len(tokens) + len(generated)} tokens it holds")
    store.writer.flush()  # to know what reached the disk, not only what was queued
    if store.backing.budget is not None:  # and what is still there once the disk budget's gc ran
        store.backing.budget.settle()
    problem = write_problems(store) != before
    placed = mc.placement(list(tokens) + list(generated_stored))
    if stored and stored < placed.tokens:  # the cache held fewer tokens than were generated
        placed = mc.placement((list(tokens) + list(generated_stored))[:stored])
    stored_text = placed.summary() if stored else "nothing stored"
    if problem and not placed.on_disk:
        stored_text = f"not stored ({write_error(store)}); {placed.text()}"
    elif problem:
        stored_text += f" ({write_error(store)})"
    where = (f"reused ({from_bucket} from the bucket {store.remote.url}, {reused - from_bucket} from the "
             "local store)") if from_bucket else "reused from the store"
    if ttft is None:  # Ctrl-C during the prefill: what of the prompt it computed is what the cache holds
        computed = f"{max(0, (stored or reused) - reused)} of {len(tokens) - reused} computed"
        first = "interrupted before the first token"
    else:
        computed, first = f"{len(tokens) - reused} computed", f"time to first token: {ttft:.3f} s"
    say(f"prompt: {plural(len(tokens), 'token')}, {reused} {where}, {computed}; {first}; "
        f"generated {plural(len(generated), 'token')} ({finish}); {stored_text}")
    if run.interrupted:
        raise KeyboardInterrupt  # (the command stops: `kvstore generate: interrupted`, exit 130)
    return not problem
