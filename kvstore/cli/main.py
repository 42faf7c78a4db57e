"""The `kvstore` command: its parser, and the dispatch to one module per command.

Each command module (`warm`, `generate`, `gc`, `stats`, `settings`, `verify`, `pins`, `remotekey`,
`pack.command`, `serve`) has `register`, which
adds its subparser (with its options, help and examples), and a `cmd_*` function, which opens the
store, calls the library and prints. To add a command, write such a module and list it in
`COMMANDS`. Failures the user can fix (a bad path, a bad line, a store that cannot be opened)
are one line on stderr and a non-zero exit code (`output`).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from typing import Callable

from kvstore.argv import Parser, option_strings, unrecognized
from kvstore.cli import gc, generate, pins, remotekey, serve, settings, stats, verify, warm
from kvstore.cli.options import model_parent, store_parent
from kvstore.cli.output import EXIT_INTERRUPTED, EXIT_PROBLEMS, EXIT_USAGE, PROG, CommandError, say
from kvstore.cli.pack import command as pack
from kvstore.errors import KVStoreError

COMMANDS = (warm, generate, gc, stats, settings, verify, pins, remotekey, pack)  # `serve` is dispatched before parsing

EPILOG = """examples:
  kvstore warm --prompts examples/prompts.jsonl      # store the KV cache of known prompts
  kvstore generate --prompt "Hello"                  # generate, reusing and growing the store
  kvstore stats                                      # what is stored, per model
  kvstore gc --max-bytes 2GiB                        # keep the store within a budget
  kvstore settings                                   # every setting, its value and source

`kvstore COMMAND --help` shows each command's options. Without --model, commands use a built-in
demo model with random weights (meaningless text)."""


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = Parser(
        prog=PROG, formatter_class=raw, epilog=EPILOG,
        description="A persistent, on-disk prompt-cache store for MLX language models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    def add(name: str, handler, help_text: str, parents: list, examples: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=parents, help=help_text, description=help_text,
                           epilog=examples, formatter_class=raw)
        p.set_defaults(handler=handler, command_parser=p)
        return p

    store_opts, model_opts = store_parent(), model_parent()
    for command in COMMANDS:
        command.register(add, store_opts, model_opts)
    serve.register(sub)
    return parser


def _version() -> str:
    from kvstore import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        return _run(lambda: serve.cmd_serve(argv[1:]), f"{PROG} serve")
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # the command's own usage, and the option a typo resembles
        command = getattr(args, "command_parser", parser)
        command.error(unrecognized(extras, option_strings(command)))
    if not hasattr(args, "handler"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return _run(lambda: args.handler(args), getattr(args, "command_parser", parser).prog)


def _run(command: Callable[[], int], prog: str = PROG) -> int:
    """Run a command; what the user can fix becomes one line on stderr (`kvstore warm: error:
    ...`, as argparse says a usage error) and an exit code."""
    try:
        return command()
    except CommandError as e:
        say(f"{prog}: error: {e}")
        return e.code
    except KVStoreError as e:
        say(f"{prog}: error: {e}")
        return EXIT_PROBLEMS
    except BrokenPipeError:  # the reader of our output went away (`kvstore stats | head`): go quiet
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_PROBLEMS
    except OSError as e:
        say(f"{prog}: error: {_os_message(e)}")
        return EXIT_PROBLEMS
    except sqlite3.Error as e:  # the index failed under the command (a full disk, its -wal taken away)
        from kvstore.storage.schema import is_corruption

        if isinstance(e, sqlite3.DatabaseError) and is_corruption(e):  # (not passing: running it again fails again)
            say(f"{prog}: error: the store's index is damaged ({e}); nothing more was changed: run `{PROG} verify "
                "--repair` (with the command's --store) to rebuild it from the blob files")
            return EXIT_PROBLEMS
        full = "full" in str(e)
        say(f"{prog}: error: the store's index failed ({e})" + (
            ": free some space on the store's disk (gc needs a little to record what it deletes), then run "
            "the command again" if full else ": run the command again; `kvstore verify` says whether "
            "anything needs repair"))
        return EXIT_PROBLEMS
    except KeyboardInterrupt:
        say(f"{prog}: interrupted")
        return EXIT_INTERRUPTED


def _os_message(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
