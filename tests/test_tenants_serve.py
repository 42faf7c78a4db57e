"""Tenants of `kvstore serve` under a tenant quota: `kvstore verify --isolation` against a server
started with `--tenant-max-bytes` (real HTTP on 127.0.0.1, the tiny demo model)."""

from __future__ import annotations

import functools
import json

from kvtest import run_cli
from test_server import Server

from kvstore.serve.tenancy import isolation

SYSTEM = {"role": "system", "content": "You are the assistant of a clinic. Answer in one short sentence. " * 4}


def test_verify_isolation_passes_a_server_whose_tenant_quota_holds_fewer_than_all_probes(
        demo_model, tmp_path, monkeypatch):
    """Each of A's probes (600 characters past the shared prompt) takes about 300 KiB on disk
    here: a quota of 1,100 KiB keeps its last three (700 KiB, two, failed one run in three: the
    quota's gc runs beside the last probe's writes, and may take part of it). verify asked A
    again for its first prompt, which
    A's own later probes had evicted, and said the tenants were NOT kept apart; it asks for the
    last one (and a miss on a server with a quota names the quota)."""
    monkeypatch.setattr(isolation, "check_server", functools.partial(isolation.check_server, text_tokens=600))
    model, store, prompts = demo_model("llama"), tmp_path / "store", tmp_path / "system.jsonl"
    prompts.write_text(json.dumps({"messages": [SYSTEM]}) + "\n")
    run_cli("warm", "--store", store, "--model", model, "--prompts", prompts)
    with Server(model, store, tmp_path / "log", "--tenant-from", "header:X-Tenant",
                "--tenant-max-bytes", "1100KiB") as server:
        out = run_cli("verify", "--isolation", server.url, "--prompts", prompts, "--probes", "7", check=False)
    assert out.returncode == 0 and "tenants are kept apart: 5 checks ran and passed" in out.stdout, out.stdout
    assert "ok   the same tenant hits" in out.stdout
