"""`kvstore serve`: hand everything after `serve` to `kvstore.serve.server`, which owns its options."""

from __future__ import annotations

from kvstore.cli.output import EXIT_USAGE, CommandError

SERVE_HELP = """usage: kvstore serve [--store DIR] [mlx_lm.server options]

Run mlx_lm.server with a prompt cache kept in the store. Everything after `serve` goes to
kvstore.serve.server, whose help lists its options.

example:
  kvstore serve --store ~/.cache/kvstore --model mlx-community/Qwen3-4B-4bit --port 8080
"""


def register(sub) -> None:
    # Dispatched before parsing (its options belong to the server); listed for --help.
    sub.add_parser("serve", help="run an mlx-lm server backed by the store (kvstore serve --help)", add_help=False)


def cmd_serve(argv: list[str]) -> int:
    """Run the server with `argv`."""
    try:
        from kvstore.serve import server
    except ImportError as e:
        if any(a in ("-h", "--help") for a in argv):
            print(SERVE_HELP)
            return 0
        raise CommandError(f"kvstore serve is not available: cannot import kvstore.serve.server ({e})", EXIT_USAGE) from e
    code = server.run(argv)  # exits the process itself (see kvstore.serve.server.run)
    return code if isinstance(code, int) else 0
