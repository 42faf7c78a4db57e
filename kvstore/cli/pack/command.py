"""The `kvstore pack` command: its four subcommands, each with its options, help and examples."""

from __future__ import annotations

import argparse
import sys

from kvstore.cli.options import add_prompt_source, add_store_settings
from kvstore.cli.output import EXIT_USAGE
from kvstore.cli.pack import export, importing, transfer

EXAMPLES = """examples:
  kvstore pack export --prompts system.jsonl --model ./Qwen3-4B --sign-key pack.pem --out sys-pack
  kvstore pack push sys-pack s3://team-packs/sys-v1
  kvstore pack pull s3://team-packs/sys-v1 sys-pack        # on another machine
  kvstore pack import sys-pack --model ./Qwen3-4B --trust-key pack.pub

A pack is a folder: the stored records of some prompts, a manifest binding them to the model's
weights, tokenizer and chain, and (signed) an OpenSSF model-signing signature. Every record holds
its token ids: a pack carries its prompts in clear. See docs/packs.md."""

EXPORT = """examples:
  kvstore pack export --prompt "You are a helpful assistant..." --unsigned --out my-pack
  kvstore pack export --prompts system.jsonl --model ./my-model --sign-key pack.pem --out my-pack

Prompts that are not stored yet are computed and stored first; a line's "pin": true pins its
prompt in the store (gc keeps it), "pin": false unpins it, as warm does. The pack holds their text in clear
(token ids): export only prompts meant to be shared. --sign-key takes an elliptic-curve private
key in PEM (openssl ecparam -name prime256v1 -genkey -noout -out pack.pem)."""

IMPORT = """examples:
  kvstore pack import my-pack --model ./my-model --trust-key pack.pub
  kvstore pack import my-pack --no-pin              # an unsigned pack, from a source you trust

Everything is checked before one record is stored: the signature (with --trust-key), the model's
weight and tokenizer files, the chain of records recomputed from the tokens, each blob's SHA-256,
each record's own checks, and the canaries by one replayed step. Any failure: one line saying
why, nothing imported, exit code 1. Into a fleet node's store (one used with a remote tier) the
records are tagged with the fleet's key: give its secret (--remote-key-file or KVSTORE_REMOTE_KEY;
--remote is not needed), else nothing is imported."""

MOVE = """examples:
  kvstore pack push my-pack s3://team-packs/sys-v1     # AWS_* settings from the environment
  kvstore pack pull s3://team-packs/sys-v1 my-pack
  kvstore pack push my-pack file:///mnt/share/sys-v1

A pack is pushed to a place that holds nothing yet, and pulled into a new or empty folder. No
fleet secret is used: a pack is readable by whoever can read the place it is pushed to, and
trusted only by its signature (checked by `kvstore pack import --trust-key`)."""


def register(add, store_opts, model_opts) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    p = add("pack", lambda args: _usage(p), "export, import, push and pull signed KV packs", [], EXAMPLES)
    sub = p.add_subparsers(title="subcommands", metavar="SUBCOMMAND")

    def command(name: str, handler, help_text: str, parents: list, examples: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=parents, help=help_text, description=help_text, epilog=examples,
                            formatter_class=raw)
        sp.set_defaults(handler=handler, command_parser=sp)
        return sp

    e = command("export", export.cmd_export, "write the stored records of prompts as a pack folder",
                [store_opts, model_opts], EXPORT)
    add_prompt_source(e, "export every line of a prompt file (- for stdin)")
    e.add_argument("--out", metavar="DIR", required=True, help="the pack folder to write (new, or empty)")
    signed = e.add_mutually_exclusive_group(required=True)
    signed.add_argument("--sign-key", metavar="KEY", help="sign the pack with this EC private key (PEM)")
    signed.add_argument("--unsigned", action="store_true", help="write the pack without a signature")
    add_store_settings(e)

    i = command("import", importing.cmd_import, "check a pack, then store and pin its records",
                [store_opts, model_opts], IMPORT)
    i.add_argument("pack", metavar="DIR", help="the pack folder")
    i.add_argument("--trust-key", metavar="KEY",
                   help="require a valid signature by this EC public key (PEM); without it, the "
                        "signature is not checked")
    i.add_argument("--no-replay", action="store_true", help="do not check the pack's canaries by a replayed step")
    i.add_argument("--no-pin", action="store_true", help="do not pin the imported records (gc may evict them)")
    add_store_settings(i)

    push = command("push", transfer.cmd_push, "copy a pack folder to s3://BUCKET/PREFIX or a folder", [], MOVE)
    push.add_argument("pack", metavar="DIR", help="the pack folder")
    push.add_argument("url", metavar="URL", help="s3://BUCKET/PREFIX, file://PATH or a folder that holds "
                                                 "nothing yet (new, or empty)")
    pull = command("pull", transfer.cmd_pull, "copy a pack from s3://BUCKET/PREFIX or a folder", [], MOVE)
    pull.add_argument("url", metavar="URL", help="s3://BUCKET/PREFIX, file://PATH or a folder")
    pull.add_argument("pack", metavar="DIR", help="the new pack folder")


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE
