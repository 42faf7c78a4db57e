"""A record's tenant as damage leaves it in the index (the row only: its blob, whose header states
the right tenant, is intact). No lookup is served the record, and none quarantines it; `verify`
reports a bad row, not a corrupt blob, and `verify --repair` takes the tenant back from the blob's
header (the row, its children edge, the tenants' totals) and never deletes the blob.

Also the index's deletion and insertion logs: a damaged entry is skipped by their readers,
reported by `verify` and deleted by `--repair`.

Every test breaks a real store on purpose (SQL written by hand into its index) and uses the real
store and `kvstore verify`; the record is fetched again in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kvtest import index_sql as sql

import kvstore
from kvstore.cli.main import main
from kvstore.storage import blobtree

C = 16


def toks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 250, n).tolist()


SYSTEM = toks(40, 1)  # 2 chunks and a tail of 8: shared
PROMPT = SYSTEM + toks(21, 5)  # alice's: 2 shared chunks, then a chunk and a tail of her own


def verify(store: Path, capsys, *extra: str) -> tuple[int, str]:
    code = main(["verify", "--store", str(store), *extra])
    return code, capsys.readouterr().out


def reused(store: Path, model_dir: Path, asks: list[tuple[str | None, list[int]]]) -> list[int]:
    """Tokens each of `asks` ((tenant (None: shared), tokens), in order) reuses, fetched in one
    fresh process."""
    script = (
        "import json, sys\nfrom mlx_lm import load\nimport kvstore\n"
        "store, path, asks = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])\n"
        "model, _ = load(path)\n"
        f"with kvstore.open(store, chunk_size={C}, memory_bytes=0) as s:\n"
        "    print(json.dumps([len(t) - len(s.bind(model, path, tenant=tenant).fetch(t)[1]) for tenant, t in asks]))\n")
    out = subprocess.run([sys.executable, "-c", script, str(store), str(model_dir), json.dumps(asks)],
                         capture_output=True, text=True, env=os.environ, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def build(store: Path, llama) -> dict[str, str]:
    """A store holding SYSTEM (shared) and PROMPT (alice's); the tags of alice and bob."""
    path, model = llama
    with kvstore.open(store, chunk_size=C) as s:
        s.bind(model, str(path)).prefill(SYSTEM)
        s.bind(model, str(path), tenant="alice").prefill(PROMPT)
        s.flush()
        return {"alice": s.tenant("alice").tag, "bob": s.tenant("bob").tag}


def state(store: Path) -> list:
    """Every record's tenant, every edge's, and the tenants' totals."""
    return [sql(store, "SELECT hash, tenant FROM records ORDER BY hash"),
            sql(store, "SELECT hash, tenant FROM children ORDER BY hash"),
            sql(store, "SELECT tenant, records, bytes FROM tenant_totals WHERE records > 0 ORDER BY tenant")]


@pytest.mark.parametrize("record, value", [
    ("alice", 5),  # TEXT affinity: stored as '5'
    ("alice", "ABCDEF0123456789"),
    ("alice", b"\x01" * 8),
    ("alice", None),  # well formed: as shared
    ("alice", "bob"),  # well formed: another tenant's
    ("shared", "alice"),  # a shared record as alice's
])
def test_a_damaged_tenant_is_a_miss_a_bad_row_and_repair_takes_the_blobs(tmp_path, llama, capsys, record, value):
    store = tmp_path / "s"
    path, _ = llama
    tags = build(store, llama)
    before = state(store)
    depth = 3 if record == "alice" else 2  # alice's own chunk, or the shared chunk it follows
    (h,) = [h for (h,) in sql(store, "SELECT hash FROM records WHERE depth = ? AND kind = 0 AND tenant IS ?",
                               (depth, tags["alice"] if record == "alice" else None))]
    sql(store, "UPDATE records SET tenant = ? WHERE hash = ?", (tags.get(value, value), h))
    blob = blobtree.blob_path(store / "blobs", h)
    assert blob.exists()

    # Until repaired: a miss for everyone (never served as another tenant's or as shared), no quarantine.
    alice, bob, shared = reused(store, path, [(who, PROMPT + [1]) for who in ("alice", "bob", None)])
    assert alice < len(PROMPT) and bob <= len(SYSTEM) and shared <= len(SYSTEM), (alice, bob, shared)
    assert sql(store, "SELECT bad FROM records WHERE hash = ?", (h,)) == [(0,)]

    code, out = verify(store, capsys)
    assert code == 1 and f"bad_row: {store / 'index.sqlite'}: records {h.hex()}: its tenant is " in out, out
    assert "corrupt_blob" not in out and "quarantined" not in out and "orphan" not in out, out
    assert "bad_totals" not in out and "bad_edge" not in out, out  # the row is what is wrong, not these
    code, out = verify(store, capsys, "--repair")
    assert "bad_row:" in out and "corrupt_blob" not in out, out
    assert blob.exists()  # the intact blob is kept
    assert state(store) == before  # the row, its edge and the totals as they were
    assert verify(store, capsys)[0] == 0

    # alice's again, and only hers
    assert reused(store, path, [(who, PROMPT + [1]) for who in ("alice", "bob", None)]) == \
        [len(PROMPT), len(SYSTEM), len(SYSTEM)]


@pytest.mark.parametrize("log", ["deletion_log", "insertion_log"])
def test_a_damaged_log_entry_is_skipped_reported_and_deleted(tmp_path, llama, capsys, log):
    store = tmp_path / "s"
    build(store, llama)
    what = "deletions" if log == "deletion_log" else "insertions"
    with kvstore.open(store, chunk_size=C) as s:
        end = getattr(s.index, f"{what}_end")()
    h = bytes(range(16))
    sql(store, f"INSERT INTO {log} (seq, hash, ns) VALUES (?, ?, ?)", ((1 << 63) - 1, h, h))
    sql(store, f"INSERT INTO {log} (seq, hash, ns) VALUES (?, ?, ?)", (end + 1, "abc", 5))
    with kvstore.open(store, chunk_size=C) as s:  # the readers skip both
        assert getattr(s.index, f"{what}_end")() == end
        assert getattr(s.index, f"{what}_since")(end) == []

    code, out = verify(store, capsys)
    assert code == 1 and out.count(f"bad_log_row: {store / 'index.sqlite'}: {log} entry ") == 2, out
    verify(store, capsys, "--repair")
    assert verify(store, capsys)[0] == 0
    assert sql(store, f"SELECT count(*) FROM {log} WHERE seq > ?", (end,)) == [(0,)]
    with kvstore.open(store, chunk_size=C) as s:  # logged in order again
        s.index.delete([r.hash for r in s.index.rows() if r.kind == 1][:1])
        assert s.index.deletions_end() > 0 and s.index.deletions_end() < 1 << 62


@pytest.mark.parametrize("damage", ["bytes = 'many'", "records = x'01', bytes = 3", "bytes = -5", "records = 'x'"])
def test_damaged_tenant_totals_are_counted_from_the_records_by_every_reader(tmp_path, llama, capsys, damage):
    """A `tenant_totals` row that does not hold two counts never reaches a reader as text or as a
    wrong total: `kvstore stats`, gc's per-tenant quota, GET /metrics and the start of a server
    that serves tenants apart (which failed on it) count that tenant from its records."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvstore import PersistentPromptCache
    from kvstore.serve.metrics import ServerMetrics
    from kvstore.serve.tenancy.policy import shared_bytes
    store = tmp_path / "s"
    tags = build(store, llama)
    ((n, size),) = sql(store, "SELECT count(*), sum(size) FROM records WHERE tenant = ?", (tags["alice"],))
    (shared,) = sql(store, "SELECT sum(size) FROM records WHERE tenant IS NULL")[0]
    sql(store, f"UPDATE tenant_totals SET {damage}")

    assert main(["stats", "--store", str(store)]) == 0
    assert f"{tags['alice']} " in capsys.readouterr().out
    with kvstore.open(store, chunk_size=C) as s:
        assert s.index.tenant_totals() == {tags["alice"]: (n, size)}
        assert s.index.tenants_over(size - 1) == [tags["alice"]] and s.index.tenants_over(size) == []
        assert shared_bytes(s) == shared  # (what a server serving tenants apart says as it starts)
        body, _ = ServerMetrics(PersistentPromptCache(s)).render()
        got = {(x.name, x.labels.get("tenant")): x.value
               for family in text_string_to_metric_families(body.decode()) for x in family.samples}
        assert got[("kvstore_tenant_bytes", tags["alice"])] == size
        assert got[("kvstore_tenant_records", tags["alice"])] == n
    code, out = verify(store, capsys)
    assert code == 1 and f"bad_totals: {store / 'index.sqlite'}: tenant {tags['alice']}: " in out, out


def test_metrics_give_the_biggest_tenants_a_series_and_sum_the_rest(tmp_path, llama, monkeypatch):
    """With `--trust-client-salt` every new salt is a tenant: /metrics gives the biggest
    `TENANT_SERIES` a series each and sums the rest under "other", so a client cannot grow the
    scrape without bound; the totals still add up."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvstore import PersistentPromptCache
    from kvstore.serve import metrics

    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as s:
        for i, name in enumerate("abcd"):  # each prompt longer than the one before: d's the biggest
            s.bind(model, str(path), tenant=name).prefill(toks(20 * (i + 1), 10 + i))
        s.flush()
        totals = s.index.tenant_totals()
        assert len(totals) == 4 and len({b for _, b in totals.values()}) == 4
        monkeypatch.setattr(metrics, "TENANT_SERIES", 2)
        body, _ = metrics.ServerMetrics(PersistentPromptCache(s)).render()
        got = {x.labels["tenant"]: x.value for family in text_string_to_metric_families(body.decode())
               for x in family.samples if x.name == "kvstore_tenant_bytes"}
        d, c = s.tenant("d").tag, s.tenant("c").tag
    assert set(got) == {d, c, "other"}
    assert got[d] == totals[d][1] and got[c] == totals[c][1]
    assert got["other"] == sum(b for _, b in totals.values()) - got[d] - got[c]
