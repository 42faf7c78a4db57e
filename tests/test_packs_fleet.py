"""A KV pack imported into a fleet node's store (one used with a remote tier) without `--remote`,
as docs/packs.md shows the command, against a real SeaweedFS: with the fleet secret (a key file
here) its records carry the fleet's trust tags, so the node's first request with its remote tier
reuses the whole prompt (logits as a cold run) and quarantines nothing; without the secret the
import is refused in one line and the store is left as it was."""

from __future__ import annotations

import os
import sqlite3
import time

from kvtest import run_cli, run_procs
from test_packs import PROMPT, keys, signed_pack, snapshot, tokens_of  # noqa: F401 (fixtures)


def test_an_import_into_a_fleet_nodes_store_is_tagged_for_the_fleet_or_refused(tmp_path, demo_model, keys,  # noqa: F811
                                                                                signed_pack, s3, monkeypatch):  # noqa: F811
    url, node, model = s3.url(), tmp_path / "node", demo_model("llama")
    run_cli("generate", "--store", node, "--model", model, "--remote", url, "--prompt", "node one",
            "--max-tokens", "1")
    time.sleep(2.1)  # (what a store held before it joined is taken as it is: the pack comes later)
    secret = os.environ["KVSTORE_REMOTE_KEY"]
    key_file = tmp_path / "fleet.key"
    key_file.write_text(secret + "\n")
    key_file.chmod(0o600)
    monkeypatch.delenv("KVSTORE_REMOTE_KEY")
    before = snapshot(node)
    refused = run_cli("pack", "import", signed_pack[0], "--store", node, "--model", model,
                      "--trust-key", keys["pub"], check=False)
    assert refused.returncode == 1 and "give the fleet secret" in refused.stderr, refused.stdout + refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and snapshot(node) == before
    done = run_cli("pack", "import", signed_pack[0], "--store", node, "--model", model,
                   "--trust-key", keys["pub"], "--remote-key-file", key_file)
    assert "records pinned" in done.stdout
    monkeypatch.setenv("KVSTORE_REMOTE_KEY", secret)
    tokens = tokens_of(model, PROMPT)
    got = run_procs("check", node, model, 256, tokens, remote=url)  # a fresh process with the remote tier
    assert got["reused"] == len(tokens) - 1 and got["max_abs_diff"] < 0.07, got
    conn = sqlite3.connect(f"file:{node / 'index.sqlite'}?mode=ro", uri=True)
    try:
        assert conn.execute("SELECT count(*) FROM records WHERE bad != 0").fetchone()[0] == 0
    finally:
        conn.close()
