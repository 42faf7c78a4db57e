"""`kvstore remote-key`: print a new random fleet secret for a shared remote tier."""

from __future__ import annotations

EXAMPLES = """examples:
  kvstore remote-key > fleet.key && chmod 600 fleet.key   # once, for the whole fleet
  kvstore generate --remote s3://team-cache/kv --remote-key-file fleet.key --prompt "Hello"
  export KVSTORE_REMOTE_KEY=$(cat fleet.key)               # or give it by the environment

Every node that shares the bucket needs the same key (43 characters, base64url of 32 random
bytes); a node without it can neither read the bucket's objects nor make the fleet use its own."""


def register(add, store_opts, model_opts) -> None:
    add("remote-key", cmd_remote_key, "print a new random fleet secret for --remote (KVSTORE_REMOTE_KEY)", [],
        EXAMPLES)


def cmd_remote_key(args) -> int:
    from kvstore.remote.seal import new_key

    print(new_key())
    return 0
