"""Tenants in the library: a tenant's chain follows the shared records, then is its own; lookups
see shared records and their own tenant's, in every tier; a tenant never writes a shared record;
quotas, stats, verify and the index rebuild know each record's tenant. Real demo models, chunk 16;
every restore is checked against a recompute."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import xxhash
from kvtest import logits_diff, prefill

import kvstore
from kvstore import keys, tenants
from kvstore.records import CHECKPOINT, prompt_records
from kvstore.storage import blobformat, blobtree
from kvstore.upkeep import evict
from kvstore.upkeep.rebuild import rebuild_index

C = 16


def toks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 250, n).tolist()


SYSTEM = toks(40, 1)  # 2 chunks and a tail of 8: the operator's shared prompt


def reused(mc, query) -> int:
    _, rest = mc.fetch(query)
    return len(query) - len(rest)


def test_a_tenants_keys_follow_the_shared_chunks_then_its_salt():
    alice, bob = tenants.derive(b"k" * 32, "alice"), tenants.derive(b"k" * 32, "bob")
    assert alice.tag != bob.tag and tenants.parse_tag(alice.tag) == alice.tag
    assert tenants.derive(b"k" * 32, "alice") == alice and tenants.derive(b"j" * 32, "alice").salt != alice.salt
    ns, prompt = b"\x01" * 16, np.array(SYSTEM + toks(30, 2))
    shared = prompt_records(ns, prompt, C, checkpoint=True)
    a = prompt_records(ns, prompt, C, checkpoint=True, tenant=alice, shared=2)
    b = prompt_records(ns, prompt, C, checkpoint=True, tenant=bob, shared=2)
    assert [s.hash for s in a[:2]] == [s.hash for s in shared[:2]] and all(s.tenant is None for s in a[:2])
    assert all(s.tenant == alice.tag and s.link == alice.link(s.parent) for s in a[2:] if s.kind != CHECKPOINT)
    assert a[-1].kind == CHECKPOINT and a[-1].tenant == alice.tag and a[-1].link is None
    assert not {s.hash for s in a[2:]} & ({s.hash for s in b} | {s.hash for s in shared})
    # The salt enters every key after the shared ones: a tenant key is its link's and its tokens' hash.
    for s in a[2:-1]:
        assert keys.is_address(s.hash, s.link, s.kind, prompt[s.start:s.end])
        assert not keys.is_address(s.hash, s.parent, s.kind, prompt[s.start:s.end])
    with pytest.raises(ValueError):
        tenants.derive(b"k" * 32, "")


@pytest.mark.parametrize("where", ["memory", "pending", "disk", "fresh process"])
def test_another_tenant_reuses_only_the_shared_prompt(llama, tmp_path, where):
    path, model = llama
    secret = SYSTEM + toks(37, 3)
    store = kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0 if where == "disk" else None)
    try:
        store.bind(model, str(path)).prefill(SYSTEM, pin=True)
        a, b = (store.bind(model, str(path), tenant=t) for t in ("alice", "bob"))
        if where == "pending":
            store.writer.pause()  # A's records stay queued: the pending tier serves them
        a.insert(secret, prefill(model, secret))
        if where != "pending":
            store.flush()
        if where == "fresh process":
            store.close()
            store = kvstore.open(tmp_path / "s", chunk_size=C)
            a, b = (store.bind(model, str(path), tenant=t) for t in ("alice", "bob"))
        query = secret + [7]
        assert reused(b, query) == len(SYSTEM)  # the shared chunks and the shared tail, nothing of A's
        assert reused(a, query) == len(secret)
        cache, rest = a.fetch(query)
        assert logits_diff(model, cache, rest, query) < 1e-4
        assert reused(store.bind(model, str(path)), query) == len(SYSTEM)  # the shared namespace: A's is not its
    finally:
        if where == "pending":
            store.writer.resume()
        store.close()


def test_a_tenant_never_writes_pins_or_marks_a_shared_record(llama, tmp_path):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        shared = store.bind(model, str(path))
        shared.prefill(SYSTEM[:32])  # two whole chunks, no tail
        store.flush()
        before = {r.hash: (r.pinned, r.role) for r in store.index.rows()}
        a = store.bind(model, str(path), tenant="alice")
        a.prefill(SYSTEM[:32] + toks(20, 4), pin=True, cache_type="system")
        a.insert(SYSTEM[:32], prefill(model, SYSTEM[:32]), pin=True, cache_type="system")  # ends on a shared chunk
        store.flush()
        rows = list(store.index.rows())
        assert {r.hash: (r.pinned, r.role) for r in rows if r.tenant is None} == before
        mine = [r for r in rows if r.tenant is not None]
        assert mine and all(r.tenant == a.tenant.tag for r in mine) and all(r.pinned for r in mine)
        assert a.unpin(SYSTEM[:32] + toks(20, 4))["records"] == len(mine)
        assert all(r.pinned == before[r.hash][0] for r in store.index.rows() if r.tenant is None)
        stats = store.stats()
        assert stats["tenants"] == [{"tenant": a.tenant.tag, "records": len(mine), "bytes": sum(r.size for r in mine)}]


def test_a_tenants_records_survive_verify_and_a_rebuild_of_the_index(llama, tmp_path):
    path, model = llama
    prompt = SYSTEM + toks(21, 5)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, str(path)).prefill(SYSTEM)
        a = store.bind(model, str(path), tenant="alice")
        a.prefill(prompt)
        store.flush()
        tags = {r.hash: r.tenant for r in store.index.rows()}
        assert store.verify() == []
        key = store.path / "tenant.key"
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    rebuilt = rebuild_index(tmp_path / "s")
    assert rebuilt["records"] == len(tags) and not rebuilt["skipped"]
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        assert {r.hash: r.tenant for r in store.index.rows()} == tags
        assert store.verify() == []
        assert reused(store.bind(model, str(path), tenant="alice"), prompt + [1]) == len(prompt)
        assert reused(store.bind(model, str(path), tenant="bob"), prompt + [1]) == len(SYSTEM)


@pytest.mark.parametrize("field", ["x-tenant", "x-link"])
def test_a_blob_whose_tenant_fields_lie_is_never_served(llama, tmp_path, field):
    path, model = llama
    prompt = SYSTEM + toks(21, 6)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        store.bind(model, str(path)).prefill(SYSTEM)
        a = store.bind(model, str(path), tenant="alice")
        a.prefill(prompt)
        store.flush()
        row = next(r for r in store.index.rows() if r.tenant is not None and r.depth == 3)
        blob = blobtree.blob_path(store.blob_root, row.hash)
        stored = blobformat.read_record(blob.read_bytes())
        assert stored.metadata["x-tenant"] == a.tenant.tag
        assert stored.metadata["x-link"] == a.tenant.link(row.parent).hex()
        # Another tenant's tag, or another link (bob's, under the same parent): not alice's record.
        lie = store.tenant("bob").tag if field == "x-tenant" else store.tenant("bob").link(row.parent).hex()
        raw = blob.read_bytes().replace(stored.metadata[field].encode(), lie.encode())
        blob.write_bytes(raw)  # and its row agrees, as a rebuild of the index would take it back
        store.index.replace_blob(row.hash, len(raw), xxhash.xxh3_64_intdigest(raw))
        problems = store.verify()
        said = {"x-tenant": "its header says tenant", "x-link": "its token ids are not those"}[field]
        assert problems[0].hash == row.hash.hex() and said in problems[0].detail, problems
        assert all("parent record is missing or damaged" in p.detail for p in problems[1:])  # what hangs below
        # A miss from there on (the shared prompt still serves); the record is quarantined.
        assert reused(a, prompt + [1]) == len(SYSTEM)
        assert store.index.get(row.hash).bad


def test_each_tenant_is_kept_within_its_quota_by_the_same_rule(llama, tmp_path):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, str(path)).prefill(SYSTEM)
        a, b = (store.bind(model, str(path), tenant=t) for t in ("alice", "bob"))
        for i in range(4):
            a.prefill(SYSTEM + toks(32, 10 + i))
        b.prefill(SYSTEM + toks(32, 20))
        store.flush()
        per = {t["tenant"]: t["bytes"] for t in store.stats()["tenants"]}
        one = per[b.tenant.tag]  # one prompt of 32 private tokens
        shared = sum(r.size for r in store.index.rows() if r.tenant is None)
        result = store.files.gc(tenant_max_bytes=2 * one)
        assert result["tenants_over"] == 1
        per = {t["tenant"]: t["bytes"] for t in store.files.tenants()}
        assert per == {a.tenant.tag: 2 * one, b.tenant.tag: one}
        assert sum(r.size for r in store.index.rows() if r.tenant is None) == shared
        store.memory.clear()
        # The least recently used went: alice's last two prompts are whole, the first two gone.
        assert [reused(a, SYSTEM + toks(32, 10 + i) + [1]) for i in range(4)] == [40, 40, 72, 72]
        assert store.verify() == []


def test_gc_drop_tenant_deletes_every_record_of_one_tenant_and_no_other(llama, tmp_path, capsys):
    """`kvstore gc --drop-tenant TAG`: all of that tenant's records go, its pinned ones too, files
    and all; the shared prompt and the other tenant's stay and restore; a dry run deletes nothing
    and a tag the store does not hold deletes nothing, said."""
    from kvstore.cli.main import main

    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, str(path)).prefill(SYSTEM)
        a, b = (store.bind(model, str(path), tenant=t) for t in ("alice", "bob"))
        a.prefill(SYSTEM + toks(32, 10), pin=True)
        a.prefill(SYSTEM + toks(40, 11))
        b.prefill(SYSTEM + toks(32, 20))
        store.flush()
        alice = a.tenant.tag
        mine = {r.hash for r in store.index.rows() if r.tenant == alice}
        others = {r.hash for r in store.index.rows() if r.tenant != alice}
        assert any(r.pinned for r in store.index.rows() if r.tenant == alice)
    s = str(tmp_path / "s")
    assert main(["gc", "--store", s, "--drop-tenant", alice.upper(), "--dry-run"]) == 0  # (any case)
    assert f"tenant {alice}: {len(mine)} records (" in capsys.readouterr().out
    assert main(["gc", "--store", s, "--drop-tenant-id", "alice", "--dry-run"]) == 0  # by the id requests name
    assert f"tenant {alice}: {len(mine)} records (" in capsys.readouterr().out
    assert main(["gc", "--store", s, "--drop-tenant-id", "carol", "--dry-run"]) == 1
    err = capsys.readouterr().err  # (and the fleet's keys, when a fleet secret is in the environment)
    assert "holds no records of that tenant (its tag under the store's tenant.key" in err and "carol" not in err
    assert main(["gc", "--store", s, "--drop-tenant", alice, "--drop-tenant", "0" * 16]) == 1
    assert "no record of tenant 0000000000000000 in this store" in capsys.readouterr().err
    assert main(["gc", "--store", s, "--drop-tenant", alice]) == 0
    assert "deleted, pinned ones too" in capsys.readouterr().out
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        assert {r.hash for r in store.index.rows()} == others
        assert not any(blobtree.blob_path(store.blob_root, h).exists() for h in mine)
        assert alice not in {t["tenant"] for t in store.stats()["tenants"]}
        a, b = (store.bind(model, str(path), tenant=t) for t in ("alice", "bob"))
        assert reused(a, SYSTEM + toks(32, 10) + [1]) == len(SYSTEM)  # the shared prompt only
        assert reused(b, SYSTEM + toks(32, 20) + [1]) == len(SYSTEM) + 32
        assert store.verify() == []


def test_drop_tenant_salt_names_the_tenant_a_cache_salt_splits_off(llama, tmp_path, capsys, monkeypatch):
    """`kvstore gc --drop-tenant-salt SALT` names the tenant `kvstore serve --trust-client-salt`
    makes of a request's cache_salt (its id holds a control character no one can type as
    --drop-tenant-id); with one `--drop-tenant-id ID`, the salt's tenant under ID, which stays."""
    from kvstore.cli.main import main

    # (The remote tests' session exports a fleet secret, whose keys gc's error would name too.)
    monkeypatch.delenv("KVSTORE_REMOTE_KEY", raising=False)
    from kvstore.tenants import salted_id

    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        who = {name: store.bind(model, str(path), tenant=name) for name in
               ("alice", salted_id("alice", "x"), salted_id(None, "x"))}
        for i, mc in enumerate(who.values()):
            mc.prefill(SYSTEM + toks(32, 10 + i))
        store.flush()
        tags = [mc.tenant.tag for mc in who.values()]
    s = str(tmp_path / "s")
    assert main(["gc", "--store", s, "--drop-tenant-id", "alice", "--drop-tenant-salt", "x", "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert f"tenant {tags[1]}: " in said and f"tenant {tags[0]}: " not in said and tags[2] not in said, said
    assert f"(a cache_salt tenant of {tags[0]})" in said, said  # (alice: the tenant whose quota it shares)
    assert main(["gc", "--store", s, "--drop-tenant-salt", "y"]) == 1
    err = capsys.readouterr().err
    assert "holds no records of the tenant of that cache_salt (its tag under the store's tenant.key is" in err, err
    assert main(["gc", "--store", s, "--drop-tenant-id", "a", "--drop-tenant-id", "b", "--drop-tenant-salt", "x"]) == 2
    assert "at most one --drop-tenant-id" in capsys.readouterr().err
    assert main(["gc", "--store", s, "--drop-tenant-salt", "x"]) == 0  # requests that name no tenant
    said = capsys.readouterr().out
    assert f"tenant {tags[2]}: " in said and "deleted" in said and tags[1] not in said, said
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        assert {t["tenant"] for t in store.stats()["tenants"]} == set(tags[:2])


def test_drop_tenant_id_on_a_store_no_tenant_used_says_so(llama, tmp_path, capsys, monkeypatch):
    """A store no tenant was ever served from has no tenant.key: `--drop-tenant-id` says there is
    no tenant's record to delete (exit 1), not that the fleet secret is missing (exit 2)."""
    from kvstore.cli.main import main
    from kvstore.remote.seal import KEY_ENV

    monkeypatch.delenv(KEY_ENV, raising=False)
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, str(path)).prefill(SYSTEM)
    assert main(["gc", "--store", str(tmp_path / "s"), "--drop-tenant-id", "alice"]) == 1
    err = capsys.readouterr().err
    assert "holds no tenant's records (it has no tenant.key" in err and "fleet" not in err, err
    assert not (tmp_path / "s" / "tenant.key").exists()


def test_drop_tenant_takes_records_whose_size_reads_as_0_and_refuses_an_unknown_tag(llama, tmp_path):
    """A tenant's records with a damaged size of 0 (gc counts them as 0 bytes) still go with their
    tenant: a drop is every record, not a byte budget of 0. The library refuses a tag it does not
    hold, and deletes nothing."""
    import sqlite3

    from kvstore.errors import UnknownTenantError

    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, str(path)).prefill(SYSTEM)
        a, b = (store.bind(model, str(path), tenant=t) for t in ("alice", "bob"))
        a.prefill(SYSTEM + toks(48, 10))
        b.prefill(SYSTEM + toks(32, 20))
        store.flush()
        alice, bob = a.tenant.tag, b.tenant.tag
    with sqlite3.connect(tmp_path / "s" / "index.sqlite") as conn:
        conn.execute("UPDATE records SET size = 0 WHERE tenant = ?", (alice,))
    conn.close()
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        assert {r.size for r in store.index.rows() if r.tenant == alice} == {0}  # as gc reads them
        before = {r.hash for r in store.index.rows()}
        with pytest.raises(UnknownTenantError, match="no record of tenant 0000000000000000"):
            store.gc(drop_tenants=[alice, "0" * 16])
        assert {r.hash for r in store.index.rows()} == before
        result = store.gc(drop_tenants=[alice])
        assert result["tenants_dropped"][alice]["records"] == result["evicted"] > 0
        assert not any(r.tenant == alice for r in store.index.rows())
        assert any(r.tenant == bob for r in store.index.rows())


def test_the_disk_budget_keeps_tenants_within_their_quota_as_records_land(llama, tmp_path):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, tenant_max_bytes="60KB") as store:
        a = store.bind(model, str(path), tenant="alice")
        for i in range(6):
            a.prefill(toks(32, 30 + i))
        store.flush()
        assert store.stats()["tenant_max_bytes"] == 60_000
        assert 0 < store.files.tenants()[0]["bytes"] <= 60_000


def test_a_tenant_share_smaller_than_one_chunk_says_so_once(llama, tmp_path, caplog):
    """Each of a tenant's chunks over `tenant_max_bytes` is written, then evicted again at once:
    the tenant reuses only the shared prompt, every request writes again. That is said (once)
    when the model is bound, as a disk budget below one chunk is, not left to be found out."""
    path, model = llama
    with caplog.at_level("WARNING", logger="kvstore"), kvstore.open(tmp_path / "s", chunk_size=C,
                                                                    tenant_max_bytes=1000) as store:
        store.bind(model, str(path)).prefill(SYSTEM)
        a = store.bind(model, str(path), tenant="alice")
        per_token = a.check.bound().per_token
        for _ in range(2):
            a.prefill(SYSTEM + toks(40, 2))
            store.flush()
            store.backing.budget.settle()
        assert a.stored_length(SYSTEM + toks(40, 2)) == len(SYSTEM)  # (what the warning is about)
    said = [r.getMessage() for r in caplog.records if "tenant's share" in r.getMessage()]
    assert said == [f"kvstore: a chunk ({C} tokens) of this model takes about {C * per_token} bytes on disk, more "
                    "than each tenant's share of the disk (tenant_max_bytes 1000): a tenant's own chunks cannot "
                    "stay on disk (each is written, then evicted again); raise it"], said


def test_a_read_only_store_without_a_tenant_key_says_so(llama, tmp_path):
    path, model = llama
    kvstore.open(tmp_path / "s", chunk_size=C).close()
    with kvstore.open(tmp_path / "s", chunk_size=C, read_only=True) as store:
        with pytest.raises(kvstore.StoreOpenError, match="tenant key"):
            store.bind(model, str(path), tenant="alice")
        for bad, why in ((123, "is text, got int"), ("", "this one is 0"), ("x" * 5000, "this one is 5000")):
            with pytest.raises(kvstore.InvalidInputError, match=why):  # the id's fault, not the key's
                store.bind(model, str(path), tenant=bad)
    with kvstore.open(kvstore.MEMORY, chunk_size=C) as store:  # in RAM: a key of this process's
        a = store.bind(model, str(path), tenant="alice")
        a.insert(SYSTEM, prefill(model, SYSTEM))
        assert reused(a, SYSTEM + [1]) == len(SYSTEM)
        assert reused(store.bind(model, str(path), tenant="bob"), SYSTEM + [1]) == 0
        [held] = store.stats()["tenants"]  # (its records in RAM, by tag: it listed none)
        assert held == {"tenant": a.tenant.tag, "records": 3, "bytes": store.stats()["bytes"]}


def test_records_another_process_deleted_are_not_served_from_ram(llama, tmp_path, monkeypatch):
    """A server holds a tenant's prompt in RAM; `gc --drop-tenant` in another process deletes it
    from disk: the server's next fetch no longer finds it in RAM either (it would go on serving
    a dropped tenant's prompts until a restart). What the disk still holds is still served."""
    from kvstore.model.backing import DeletedElsewhere

    monkeypatch.setattr(DeletedElsewhere, "EVERY_S", 0.0)
    path, model = llama
    prompt = SYSTEM + toks(40, 12)
    with kvstore.open(tmp_path / "s", chunk_size=C) as server:
        server.bind(model, str(path)).prefill(SYSTEM)
        alice = server.bind(model, str(path), tenant="alice")
        alice.prefill(prompt)
        server.flush()
        assert reused(alice, prompt + [1]) == len(prompt) and server.stats()["memory"]["records"] > 0
        with kvstore.open(tmp_path / "s", chunk_size=C) as other:  # another process's gc
            other.gc(drop_tenants=[alice.tenant.tag])
        assert reused(alice, prompt + [1]) == len(SYSTEM)  # the shared prompt only, from disk or RAM


def test_records_deleted_before_the_first_fetch_are_not_served_from_ram(llama, tmp_path):
    """RAM filled by inserts alone (a library warming, before any fetch); another process's gc
    then empties the disk: the first fetch must not serve what it deleted from RAM (the deletion
    log was read from its end only at that fetch, after the deletions)."""
    path, model = llama
    prompt = SYSTEM + toks(40, 12)
    with kvstore.open(tmp_path / "s", chunk_size=C) as server:
        mc = server.bind(model, str(path), tenant="alice")
        mc.insert(prompt, prefill(model, prompt))
        server.flush()
        assert server.stats()["memory"]["records"] > 0
        with kvstore.open(tmp_path / "s", chunk_size=C) as other:  # another process's gc
            other.gc(max_bytes=0)
        assert reused(mc, prompt + [1]) == 0


def test_verify_exact_of_a_tenant_on_a_store_with_no_tenant_key_yet(llama, tmp_path):
    """`verify_exact(..., tenant=ID)` on a store open for writing that has bound no tenant yet:
    the read-only opening it checks through said the store "is open read-only: open it once to
    write" (it was open to write). It checks that tenant's prompts: none. A keyword that is not
    one of bind's is named as verify_exact's."""
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, str(path)).insert(SYSTEM, prefill(model, SYSTEM))
        report = store.verify_exact(model, str(path), tenant="alice")
        assert not report.checks and "NOTHING CHECKED" in report.verdict()
        with pytest.raises(TypeError, match=r"verify_exact\(\) got an unexpected keyword argument 'tenantt'"):
            store.verify_exact(model, str(path), tenantt="alice")


def test_tenant_victims_count_a_tenants_cache_salt_tenants_against_its_one_quota():
    """`tenant_victims` with owners: bob and the three salted tenants he owns share one quota (the
    LRU rule over their records together: x2's chain is one tree whose root hangs from the shared
    record, its leaf y2 goes first); alice alone is within hers. Without owners each is within its own."""
    ns, shared = b"N" * 16, b"S" * 16
    rows = [(shared + ns, 0.0, (100 * 4) * 16 + 4, None)]  # (hash + parent, last access, size/role/flags, tag)
    alice, bob, salted = "a" * 16, "b" * 16, ["c" * 16, "d" * 16, "e" * 16]
    rows += [(b"A1" * 8 + shared, 9.0, 100 * 64, alice), (b"A2" * 8 + b"A1" * 8, 9.5, 100 * 64, alice)]
    rows += [(b"B1" * 8 + shared, 8.0, 100 * 64, bob)]
    rows += [(f"X{i}".encode() * 8 + shared, float(i), 100 * 64, tag) for i, tag in enumerate(salted)]
    rows += [(b"Y2" * 8 + b"X2" * 8, 7.0, 100 * 64, salted[2])]  # below x2: x2 goes after it
    g = evict.Graph.from_index([rows])
    assert not len(evict.tenant_victims(g, 250))  # a quota per tag: none is over
    owners = dict.fromkeys(salted, bob)
    gone = {g.hashes[i].tobytes()[:2] for i in evict.tenant_victims(g, 150, (), owners)}
    assert gone == {b"X0", b"X1", b"X2", b"Y2", b"A2"}  # bob's 500 -> 100 (his own stays); alice's 200 -> 100
    assert {g.hashes[i].tobytes()[:2] for i in evict.tenant_victims(g, 250, (), owners)} == {b"X0", b"X1", b"Y2"}
    assert {g.hashes[i].tobytes()[:2] for i in evict.tenant_victims(g, 350, (), owners)} == {b"X0", b"X1"}
    plan = evict.choose_victims(g, max_bytes=None, cutoff=None, stale=False, tenant_max_bytes=350, owners=owners)
    assert [h[:2] for h in plan.hashes] == [b"X0", b"X1"]


def test_a_tenants_cache_salts_share_its_quota_through_gc_a_rebuild_and_drop_tenant_id(llama, tmp_path, capsys):
    """Tenants made of bob's cache_salts are kept within bob's one quota by gc; a rebuilt index
    takes their owner back from their blobs' headers; `gc --drop-tenant-id bob` drops them too."""
    from kvstore.cli.main import main

    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, str(path)).prefill(SYSTEM)
        salts = [store.bind(model, str(path), tenant=tenants.salted_id("bob", f"s{i}")) for i in range(4)]
        for i, mc in enumerate(salts):
            mc.prefill(SYSTEM + toks(32, 50 + i))
        alice = store.bind(model, str(path), tenant="alice")
        alice.prefill(SYSTEM + toks(32, 60))
        store.flush()
        bob = store.tenant("bob").tag
        assert all(mc.tenant.owner == bob for mc in salts) and alice.tenant.owner is None
        one = next(t["bytes"] for t in store.files.tenants() if t["tenant"] == alice.tenant.tag)
        assert store.files.gc(tenant_max_bytes=2 * one)["tenants_over"] == 1
        held = {t["tenant"]: t for t in store.files.tenants()}
        left = [t for t in held.values() if t.get("owner") == bob]
        assert len(left) >= 1 and one < sum(t["bytes"] for t in left) <= 2 * one  # (of 4 prompts: about 4 * one)
        assert held[alice.tenant.tag]["bytes"] == one and "owner" not in held[alice.tenant.tag]
        owners = {t: o for t, o in store.index.tenant_owners().items() if t in held}  # (of those with records)
        assert len(owners) == len(left)
    rebuilt = rebuild_index(tmp_path / "s")
    assert rebuilt["records"] > 0 and not rebuilt["skipped"]
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        assert store.index.tenant_owners() == owners
    assert main(["gc", "--store", str(tmp_path / "s"), "--drop-tenant-id", "bob"]) == 0
    said = capsys.readouterr().out
    assert said.count(f"(a cache_salt tenant of {bob})") == len(left), said
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        assert [t["tenant"] for t in store.files.tenants()] == [alice.tenant.tag]
