"""Pins have a life cycle: unpinned (library, `kvstore pins --remove`, a warm line with
`"pin": false`), listed (`kvstore pins`), kept through a rebuild of a damaged or lost index, and
dropped with the stale model version they belong to (`gc --stale`)."""

from __future__ import annotations

import json
import os

import pytest
from kvtest import logits_diff, run_cli
from test_stale import PINNED, by_ns, store_two_versions
from test_stale import C as STALE_C

import kvstore
from kvstore.cli import main as cli
from kvstore.sizes import format_size

C = 16
TOL = 1e-4
SYSTEM = list(range(1, 1 + 2 * C))  # two whole chunks both prompts start with
A = SYSTEM + list(range(100, 125))
B = SYSTEM + list(range(150, 170))


def _bytes_of(store, mc, tokens) -> int:
    return sum(store.index.get(h).size for h in mc.record_hashes(tokens))


def _pinned_pair(path, llama):
    """A store holding A and B, both pinned, and an unpinned third prompt."""
    model_path, model = llama
    with kvstore.open(path, chunk_size=C) as store:
        mc = store.bind(model, model_path)
        for p in (A, B):
            mc.prefill(p, pin=True)
        mc.prefill(list(range(200, 240)))
        store.flush()


def test_unpin_lets_gc_free_the_prompt_and_keeps_the_other_pinned_one(tmp_path, llama):
    model_path, model = llama
    path = tmp_path / "s"
    _pinned_pair(path, llama)
    with kvstore.open(path, chunk_size=C) as store:
        mc = store.bind(model, model_path)
        store.gc(max_bytes=0)  # pinned: both stay (the third prompt goes)
        a_bytes, b_bytes, shared = (_bytes_of(store, mc, p) for p in (A, B, SYSTEM))
        assert store.stats()["bytes"] == a_bytes + b_bytes - shared
        [listed] = store.pins()
        # The two shared chunks once, then a chunk and a tail of each prompt.
        assert listed["model_id"] == str(model_path) and listed["records"] == 6
        assert listed["bytes"] == a_bytes + b_bytes - shared and listed["tokens"] == len(A) + len(B) - len(SYSTEM)
        result = mc.unpin(A)
        assert result == {"records": len(mc.record_hashes(A)), "bytes": a_bytes}  # shared chunks too
        assert mc.unpin(A) == {"records": 0, "bytes": 0}
        assert store.gc(max_bytes=0)["freed_bytes"] == a_bytes - shared
        # A's own records went; B keeps its pin, and so the shared chunks it hangs from.
        assert store.stats()["bytes"] == b_bytes
        [listed] = store.pins()
        assert (listed["records"], listed["bytes"]) == (2, b_bytes - shared)
        # what gc keeps for them: the shared chunks they hang from too (said by `kvstore pins`)
        assert (listed["held_records"], listed["held_bytes"]) == (4, b_bytes)
    said = _run("pins", "--store", path).stdout
    assert f"gc keeps them with the records they hang from: 4 records, {format_size(b_bytes)}" in said, said
    with kvstore.open(path, chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, model_path)
        cache, rest = mc.fetch(A + [9])
        assert len(A) + 1 - len(rest) == len(SYSTEM)
        cache, rest = mc.fetch(B + [9])
        assert rest == [9] and logits_diff(model, cache, rest, B + [9]) <= TOL


def _run(*args, check=True):
    return run_cli(*args, check=check)


def test_kvstore_pins_lists_and_removes(tmp_path, demo_model_path):
    store, model = tmp_path / "s", str(demo_model_path)
    messages = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Why?"}]
    lines = [{"prompt": "a pinned prompt about kv caches", "pin": True},
             {"messages": messages, "pin": True},
             {"prompt": "not pinned at all"}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    _run("warm", "--store", store, "--model", model, "--prompts", prompts)

    listed = json.loads(_run("pins", "--store", store, "--json").stdout)
    assert listed["records"] >= 2 and listed["bytes"] > 0
    [m] = listed["models"]
    assert m["model_id"] == model and m["records"] == listed["records"] and m["stale"] is False
    text = _run("pins", "--store", store).stdout
    assert "pinned in" in text and model in text

    out = _run("pins", "--store", store, "--model", model, "--remove", "--prompt", lines[0]["prompt"])
    assert "--prompt: unpinned 1 record" in out.stdout and "gc may now evict" in out.stdout
    out = _run("pins", "--store", store, "--model", model, "--remove", "--prompt", lines[0]["prompt"])
    assert "nothing was pinned" in out.stdout
    out = _run("pins", "--store", store, "--model", model, "--remove", "--messages", json.dumps(messages))
    assert "--messages: unpinned" in out.stdout
    assert json.loads(_run("pins", "--store", store, "--json").stdout)["models"] == []
    assert "nothing is pinned" in _run("pins", "--store", store).stdout
    _run("gc", "--store", store, "--max-bytes", "0")
    assert json.loads(_run("stats", "--store", store, "--json").stdout)["bytes"] == 0

    # Warmed pinned again, then a line with "pin": false unpins it (no "pin" leaves it alone).
    _run("warm", "--store", store, "--model", model, "--prompts", prompts)
    prompts.write_text(json.dumps({"prompt": lines[0]["prompt"], "pin": False}) + "\n"
                       + json.dumps({"messages": messages}) + "\n")
    out = _run("warm", "--store", store, "--model", model, "--prompts", prompts)
    assert "unpinned 1 record" in out.stderr, out.stderr
    [m] = json.loads(_run("pins", "--store", store, "--json").stdout)["models"]
    assert m["records"] == listed["records"] - 1  # the messages line's pins stay

    bad = _run("pins", "--store", store, "--prompt", "x", check=False)
    assert bad.returncode == 2 and "add --remove" in bad.stderr


@pytest.mark.parametrize("how", ["garbage", "lost", "garbage-and-damaged-pins-file"])
def test_pins_survive_a_rebuild_of_a_damaged_index(tmp_path, llama, capsys, how):
    model_path, model = llama
    path = tmp_path / "s"
    with kvstore.open(path, chunk_size=C) as store:
        mc = store.bind(model, model_path)
        mc.prefill(A, pin=True)
        mc.prefill(list(range(200, 240)))
        store.flush()
        a_bytes = _bytes_of(store, mc, A)
        assert store.stats()["bytes"] > a_bytes
    db = path / "index.sqlite"
    if how == "lost":
        for name in os.listdir(path):
            if name.startswith("index.sqlite"):
                os.unlink(path / name)
    else:
        db.write_bytes(b"this is not a database" * 200)
    if how == "garbage-and-damaged-pins-file":
        pins = path / "index.pins"
        pins.write_text(pins.read_text()[:-3] + "zz\n")  # the count at its end is cut short
    assert cli.main(["verify", "--repair", "--store", str(path)]) == 1
    err = capsys.readouterr().err
    assert "rebuilt the index" in err and "4 pinned records kept" in err, err
    if how == "garbage-and-damaged-pins-file":
        assert "pins file" in err and "damaged" in err
    assert cli.main(["gc", "--max-bytes", "0", "--store", str(path)]) == 0
    with kvstore.open(path, chunk_size=C, memory_bytes=0) as store:
        assert store.stats()["bytes"] == a_bytes
        mc = store.bind(model, model_path)
        cache, rest = mc.fetch(A + [9])
        assert rest == [9] and logits_diff(model, cache, rest, A + [9]) <= TOL
        assert store.verify() == []


def test_gc_stale_frees_a_stale_models_pinned_bytes(tmp_path, demo_model_path, capsys):
    path, folder, old_ns, new_ns = store_two_versions(tmp_path, demo_model_path)
    before = by_ns(path)
    pinned_records = len(PINNED) // STALE_C + 1
    assert cli.main(["gc", "--stale", "--dry-run", "--store", str(path)]) == 0
    assert f"{pinned_records} pinned records of stale models would be freed" in capsys.readouterr().out
    assert cli.main(["gc", "--stale", "--store", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{pinned_records} pinned records of stale models freed" in out, out
    after = by_ns(path)
    assert after[old_ns]["bytes"] == 0 and after[new_ns]["bytes"] == before[new_ns]["bytes"]
    assert cli.main(["stats", "--store", str(path)]) == 0
    assert "STALE:" not in capsys.readouterr().out  # no more nagging about what gc --stale keeps
    assert cli.main(["pins", "--store", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["models"] == []


def test_a_tenants_pins_are_listed_by_tag_and_unpinned_as_that_tenant(tmp_path, demo_model_path):
    """A tenant's pinned prompt (its own records after the shared system prompt): `pins` lists
    them under the tenant's tag; `pins --remove --tenant ID` unpins those, and leaves the shared
    system prompt's pins to the operator."""
    from mlx_lm import load

    store, model_path = tmp_path / "s", str(demo_model_path)
    model, tokenizer = load(model_path)
    system = tokenizer.encode("You are a careful assistant who answers in one short word. " * 8)
    mine = system + tokenizer.encode("alice's own question, pinned by her")
    with kvstore.open(store) as s:
        s.bind(model, model_path).prefill(system, pin=True)
        alice = s.bind(model, model_path, tenant="alice")
        alice.prefill(mine, pin=True)
        tag = alice.tenant.tag
        s.flush()
        shared = sum(1 for r in s.index.rows() if r.pinned and r.tenant is None)
        own = sum(1 for r in s.index.rows() if r.pinned and r.tenant == tag)
    assert shared and own
    [m] = json.loads(_run("pins", "--store", store, "--json").stdout)["models"]
    assert m["records"] == shared + own and m["tenants"][tag]["records"] == own
    assert f"of them tenant {tag}'s own: {own} record" in _run("pins", "--store", store).stdout
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(json.dumps({"tokens": mine}) + "\n")
    out = _run("pins", "--store", store, "--model", model_path, "--remove", "--tenant", "alice", "--prompts", prompts)
    assert f"unpinned {own} record" in out.stdout, out.stdout
    [m] = json.loads(_run("pins", "--store", store, "--json").stdout)["models"]
    assert m["records"] == shared and m["tenants"] == {}  # the operator's shared pins stay
    assert _run("pins", "--store", store, "--tenant", "alice", check=False).returncode == 2
    empty = _run("pins", "--store", store, "--remove", "--tenant", "", "--prompts", prompts, check=False)
    assert empty.returncode == 2 and "--tenant: a tenant id is 1 to 4096 bytes" in empty.stderr  # before any model


def test_pins_and_verify_name_a_cache_salts_tenant_with_tenant_salt(tmp_path, demo_model_path):
    """`kvstore serve --trust-client-salt` makes a tenant of each request's cache_salt, whose id
    (`tenants.salted_id`) holds a control character no one types as `--tenant ID`: `pins --remove`
    and `verify --exact` reach it with `--tenant-salt SALT` (under `--tenant ID`, or alone: under
    requests that name no tenant), as `gc --drop-tenant-salt` does; `--tenant` alone reaches the
    unsalted tenant, which holds none of it."""
    from mlx_lm import load

    from kvstore.tenants import salted_id

    store, model_path = tmp_path / "s", str(demo_model_path)
    model, tokenizer = load(model_path)
    system = tokenizer.encode("You are a careful assistant who answers in one short word. " * 8)
    mine = system + tokenizer.encode("team-a's own question, pinned under its cache_salt")
    with kvstore.open(store) as s:
        s.bind(model, model_path).prefill(system, pin=True)
        for tenant_id in (salted_id("alice", "team-a"), salted_id(None, "team-b")):
            s.bind(model, model_path, tenant=tenant_id).prefill(mine, pin=True)
        s.flush()
    [m] = json.loads(_run("pins", "--store", store, "--json").stdout)["models"]
    assert len(m["tenants"]) == 2
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(json.dumps({"tokens": mine}) + "\n")
    remove = ("pins", "--store", store, "--model", model_path, "--remove", "--prompts", prompts)
    assert "nothing was pinned for this prompt" in _run(*remove, "--tenant", "alice").stdout
    verify = ("verify", "--store", store, "--exact", "--model", model_path, "--json")
    assert _run(*verify, "--tenant", "alice", check=False).returncode == 3  # alice herself stored nothing
    got = json.loads(_run(*verify, "--tenant", "alice", "--tenant-salt", "team-a").stdout)
    assert got["ok"] and len(got["prompts"]) == 1, got
    out = _run(*remove, "--tenant", "alice", "--tenant-salt", "team-a").stdout
    assert "unpinned" in out and "nothing was pinned" not in out, out
    [m] = json.loads(_run("pins", "--store", store, "--json").stdout)["models"]
    assert len(m["tenants"]) == 1  # team-b's, under requests that name no tenant, stays
    assert "unpinned" in _run(*remove, "--tenant-salt", "team-b").stdout
    [m] = json.loads(_run("pins", "--store", store, "--json").stdout)["models"]
    assert m["tenants"] == {}
    listing = _run("pins", "--store", store, "--tenant-salt", "team-b", check=False)
    assert listing.returncode == 2 and "--tenant-salt goes with --remove" in listing.stderr
    bare = _run("verify", "--store", store, "--tenant-salt", "team-b", check=False)
    assert bare.returncode == 2 and "--tenant-salt" in bare.stderr and "go with --exact" in bare.stderr


def test_a_pinned_record_stored_again_after_a_bad_read_stays_pinned(tmp_path, llama):
    """A pinned prompt whose blobs went bad is quarantined at its next fetch and stored again
    (healed) by the next insert of it, which does not pin: the pin stays, and the pins file a
    rebuild reads back still agrees with the index (verify finds nothing)."""
    from kvstore.storage.blobtree import blob_path

    model_path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, model_path)
        mc.prefill(SYSTEM, pin=True)  # two whole chunks: no tail holds them
        store.flush()
        pinned = set(mc.record_hashes(SYSTEM))
        assert set(store.index.pinned()) == pinned
        for h in pinned:
            path = blob_path(store.blob_root, h)
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF  # in the last tensor's data: its checksum fails
            path.write_bytes(bytes(data))
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:  # (no copy in RAM)
        mc = store.bind(model, model_path)
        cache, rest = mc.fetch(SYSTEM + [3])
        assert rest == SYSTEM + [3] and store.stats()["quarantined"] == len(pinned)
        mc.prefill(SYSTEM)  # stored again, healed, by an insert that does not pin
        store.flush()
        assert set(store.index.pinned()) == pinned
        assert store.verify() == []
        cache, rest = mc.fetch(SYSTEM + [3])
        assert rest == [3] and logits_diff(model, cache, rest, SYSTEM + [3]) <= TOL
