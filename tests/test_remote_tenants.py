"""Tenants and keys of the remote tier, against a real SeaweedFS: a tenant's objects are sealed with
its own key and listed where only it looks; a key rotation reads with both keys and ends with
nothing left that only the old key opens; nonces never repeat; the keys are derived per namespace
and per tenant; a server with a remote tier hides its bucket in /kvstore/stats."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import requests
from kvtest import logits_diff, run_cli
from mlx_lm import load
from test_server import Server

import kvstore
from kvstore.remote.bucket import open_bucket
from kvstore.remote.health import Health, KeyCheck
from kvstore.remote.layout import manifest_key, marker_key, parse_key, parse_other
from kvstore.remote.seal import NONCE_BYTES, Fleet, Unauthenticated, fleet_secret, key_id, new_key, read_key_file
from kvstore.remote.seal import parse_key as key_bytes
from kvstore.remote.upkeep import collect_remote
from kvstore.upkeep.rebuild import rebuild_index

C = 16


def toks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 250, n).tolist()


SYSTEM = toks(40, 1)


@pytest.fixture(scope="module")
def llama_model(demo_model):
    path = demo_model("llama")
    model, _ = load(str(path))
    return path, model


def node(tmp_path, name: str, url: str, **kw):
    return kvstore.open(tmp_path / name, chunk_size=C, remote=url, **kw)


def reused(mc, query) -> int:
    _, rest = mc.fetch(query)
    return len(query) - len(rest)


def objects(url: str) -> list[str]:
    return [p for p, _, _ in open_bucket(url).walk("")]


def test_a_node_of_another_tenant_never_downloads_nor_opens_a_tenants_records(tmp_path, s3, llama_model):
    path, model = llama_model
    url = s3.url()
    secret = SYSTEM + toks(45, 2)
    with node(tmp_path, "n1", url) as n1:
        n1.bind(model, str(path)).prefill(SYSTEM)
        alice = n1.bind(model, str(path), tenant="alice")
        alice.prefill(secret)
        assert n1.flush()
        ns = alice.ns
        mine = {r.hash: r for r in n1.index.rows() if r.tenant is not None}
    listed = [k for k in map(parse_key, objects(url)) if k is not None]
    owned = [k for k in listed if k.owned]
    assert len(owned) == len(mine) and len(listed) == len(owned) + 3  # A's, and the shared chunks and tail
    with node(tmp_path, "n2", url) as n2:
        bob = n2.bind(model, str(path), tenant="bob")
        assert reused(bob, secret + [1]) == len(SYSTEM)
        assert n2.remote.counters["downloads"] == 3  # the shared records, none of alice's
        assert all(r.tenant is None for r in n2.index.rows())
        key = owned[0].path
        body = open_bucket(url).get(key, max_bytes=64 << 20)
        fleet = n2.remote.fleet
        for sealer in (fleet.sealer(ns, n2.tenant("bob")), fleet.sealer(ns)):
            with pytest.raises(Unauthenticated):
                sealer.open(key, body)
        assert fleet.sealer(ns, n2.tenant("alice")).open(key, body)  # only alice's key opens it
    with node(tmp_path, "n3", url) as n3:  # another node serving alice gets all of it
        alice = n3.bind(model, str(path), tenant="alice")
        cache, rest = alice.fetch(secret + [1])
        assert len(rest) == 1 and logits_diff(model, cache, rest, secret + [1]) < 1e-4
        assert {r.hash for r in n3.index.rows() if r.tenant is not None} == set(mine)


def test_a_salted_tenants_downloaded_records_share_their_owners_quota_on_the_downloading_node(tmp_path, s3,
                                                                                               llama_model):
    """Node A stores the records of two cache_salt tenants of alice; node B, serving the same
    salts, downloads them: B's index keeps each salted tenant's owner (from the records' `x-owner`)
    with their rows, so B's `--tenant-max-bytes` check counts both within alice's one quota."""
    from kvstore.tenants import salted_id

    path, model = llama_model
    url = s3.url()
    ids = [salted_id("alice", salt) for salt in ("x", "y")]
    prompts = [SYSTEM + toks(45, 20 + i) for i in range(len(ids))]
    with node(tmp_path, "a", url) as a:
        for tenant_id, prompt in zip(ids, prompts):
            a.bind(model, str(path), tenant=tenant_id).prefill(prompt)
        assert a.flush()
        alice, tags = a.tenant("alice").tag, [a.tenant(t).tag for t in ids]
        assert a.index.tenant_owners() == dict.fromkeys(tags, alice)
    with node(tmp_path, "b", url) as b:
        for tenant_id, prompt in zip(ids, prompts):
            assert reused(b.bind(model, str(path), tenant=tenant_id), prompt + [1]) == len(prompt)
        assert b.flush()
        assert b.remote.counters["downloads"] > 0
        assert b.index.tenant_owners() == dict.fromkeys(tags, alice)
        held = b.index.tenant_totals()
        assert set(tags) <= set(held)
        together = sum(held[t][1] for t in tags)
        assert b.index.quota_totals()[alice][1] == together
        # Each alone is under a quota that both together exceed: only grouped do they go over it.
        assert max(held[t][1] for t in tags) < together - 1
        assert b.index.tenants_over(together - 1) == [alice]


def test_no_object_the_fleet_key_opens_holds_the_uploading_nodes_model_path(tmp_path, s3, llama_model):
    path, model = llama_model
    url = s3.url()
    secret = SYSTEM + toks(45, 3)
    with node(tmp_path, "n1", url) as n1:
        n1.bind(model, str(path)).prefill(SYSTEM, pin=True)
        alice = n1.bind(model, str(path), tenant="alice")
        alice.prefill(secret)
        assert n1.flush()
        fleet, ns, tenant = n1.remote.fleet, alice.ns, n1.tenant("alice")
    bucket, local = open_bucket(url), [str(path).encode(), path.name.encode()]
    kinds = set()
    for key in objects(url):
        body, record, other = bucket.get(key, max_bytes=64 << 20), parse_key(key), parse_other(key)
        if record is not None:
            plain = fleet.sealer(ns, tenant if record.owned else None).open(key, body)
            kinds.add("owned" if record.owned else "shared")
        elif key == marker_key(fleet.marker_name()):
            plain = fleet.marker_box().open(key, body)
            kinds.add("marker")
        else:
            box = fleet.manifest_box(other[1]) if other[0] == "manifest" else fleet.sealer(ns)
            plain = box.open(key, body)
            kinds.add(other[0])
        assert not any(p in bytes(plain) for p in local), key
    assert kinds == {"owned", "shared", "manifest", "pins", "marker"}
    # Another node still takes them: checked, stored, restored, and the bucket verifies clean.
    with node(tmp_path, "n2", url) as n2:
        mc = n2.bind(model, str(path), tenant="alice")
        assert reused(mc, secret + [1]) == len(secret)
        assert n2.flush()
        assert reused(n2.bind(model, str(path), tenant="alice"), secret + [1]) == len(secret)
        downloaded = len(list(n2.index.rows()))
    assert run_cli("verify", "--remote", url, "--store", tmp_path / "n2").returncode == 0
    # Their headers name no model: a lost index is still rebuilt from them.
    for f in (tmp_path / "n2").glob("index.sqlite*"):
        f.unlink()
    assert rebuild_index(tmp_path / "n2")["records"] == downloaded > 0


def test_a_key_rotation_reads_with_both_keys_then_leaves_nothing_only_the_old_key_opens(tmp_path, s3, llama_model):
    path, model = llama_model
    url = s3.url()
    old, new = fleet_secret(), key_bytes(new_key(), "new key")
    shared, private = SYSTEM + toks(9, 3), SYSTEM + toks(30, 4)
    with node(tmp_path, "n1", url, remote_key=old) as n1:  # before the rotation
        n1.bind(model, str(path)).prefill(shared, pin=True)
        n1.bind(model, str(path), tenant="alice").prefill(private)
        assert n1.flush()
        ns = n1.bind(model, str(path)).ns
    with node(tmp_path, "n2", url, remote_key=[new, old]) as n2:  # during it: written with new, read with both
        assert reused(n2.bind(model, str(path)), shared + [1]) == len(shared)
        alice = n2.bind(model, str(path), tenant="alice")
        cache, rest = alice.fetch(private + [1])
        assert len(rest) == 1 and logits_diff(model, cache, rest, private + [1]) < 1e-4
        after = SYSTEM + toks(30, 5)
        alice.prefill(after)
        n2.bind(model, str(path)).prefill(shared, pin=True)  # pinned again: published under the new key
        assert n2.flush()
        assert n2.stats()["remote"]["older_keys"] == [key_id(old)]
        result = n2.remote.drop_key(key_id=key_id(old))
        assert result["namespaces"] == 1 and result["records"] > 0
        with pytest.raises(kvstore.InvalidInputError):
            n2.remote.drop_key(key_id=key_id(new))
    current = Fleet(new)
    left = objects(url)
    assert left and {p.split("/")[0] for p in left} == {current.ns_name(ns), "keys"}
    assert {p for p in left if p.startswith("keys/")} == {marker_key(current.marker_name())}
    manifest = manifest_key(current.ns_name(ns))
    assert current.manifest_box(current.ns_name(ns)).open(manifest, open_bucket(url).get(manifest, 1 << 20))
    with node(tmp_path, "n3", url, remote_key=new) as n3:  # after it: the new key alone
        assert reused(n3.bind(model, str(path)), shared + [1]) == len(shared)
        assert reused(n3.bind(model, str(path), tenant="alice"), after + [1]) == len(after)


def test_pins_nobody_can_open_no_longer_keep_a_namespace_for_ever(tmp_path, s3, llama_model):
    path, model = llama_model
    url = s3.url()
    stranger = key_bytes(new_key(), "another fleet's key")
    with node(tmp_path, "n1", url, remote_key=stranger) as n1:
        n1.bind(model, str(path)).prefill(SYSTEM, pin=True)
        assert n1.flush()
    bucket = open_bucket(url)
    assert any(parse_other(p) == ("pins", p.split("/")[0]) for p in objects(url))
    theirs = set(objects(url))
    # While no namespace opens with the node's keys (a wrong secret?), it is kept even when old.
    result = collect_remote(bucket, Fleet(fleet_secret()), max_age=60, now=2e10)
    assert result["no_namespace_opens"] == 1 and result["dropped_namespaces"] == 0 and set(objects(url)) == theirs
    # As if it were from before key markers, and the fleet's node had claimed the bucket since.
    bucket.delete([p for p in theirs if p.startswith("keys/")])
    theirs = set(objects(url))
    KeyCheck(bucket, Fleet(fleet_secret()), Health()).claim()
    with node(tmp_path, "n2", url) as n2:  # the fleet's own namespace, beside it
        n2.bind(model, str(path)).prefill(SYSTEM)
        assert n2.flush()
    ours = set(objects(url)) - theirs
    # Another fleet's namespace: gc neither counts nor keeps it; it goes whole once it is old.
    result = collect_remote(bucket, Fleet(fleet_secret()), max_age=2e10)
    assert result["evicted"] == 0 and result["unknown_namespaces"] == 1 and result["dropped_namespaces"] == 0
    result = collect_remote(bucket, Fleet(fleet_secret()), max_age=2e10, now=2e10)
    assert result["evicted"] == 0 and result["kept_pinned"] == 0 and result["dropped_namespaces"] == 1
    assert set(objects(url)) == ours  # its records, pins and manifest went


def test_nonces_never_repeat_across_rewrites_of_one_key_and_across_processes(tmp_path, s3, llama_model):
    path, model = llama_model
    url = s3.url()
    with node(tmp_path, "n1", url) as n1:
        n1.bind(model, str(path)).prefill(SYSTEM, pin=True)
        assert n1.flush()
    pins = next(p for p in objects(url) if parse_other(p) and parse_other(p)[0] == "pins")
    nonces = []

    def nonce() -> bytes:
        body = open_bucket(url).get(pins, max_bytes=1 << 20)
        return bytes(body[4:4 + NONCE_BYTES])

    nonces.append(nonce())
    for _ in range(3):  # the same pins object, rewritten at its one key by this process...
        with node(tmp_path, "n1", url) as n1:
            n1.remote.publish_pins()
        nonces.append(nonce())
    code = ("import kvstore, sys\n"  # ...and by fresh processes
            f"with kvstore.open({str(tmp_path / 'n1')!r}, chunk_size={C}, remote={url!r}) as s:\n"
            "    s.remote.publish_pins()\n")
    for _ in range(2):
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=os.environ)
        nonces.append(nonce())
    assert len(set(nonces)) == len(nonces) == 6


def test_keys_are_derived_per_namespace_per_tenant_and_per_secret():
    secret = os.urandom(32)
    fleet, other = Fleet(secret), Fleet(os.urandom(32))
    ns1, ns2 = b"\x01" * 16, b"\x02" * 16
    alice = kvstore.tenants.derive(fleet.tenant_secret(), "alice", key_id=fleet.key_id)
    bob = kvstore.tenants.derive(fleet.tenant_secret(), "bob", key_id=fleet.key_id)
    key, data = "some/object/key", b"the bytes of a record"
    sealers = [fleet.sealer(ns1), fleet.sealer(ns2), fleet.sealer(ns1, alice), fleet.sealer(ns1, bob),
               fleet.sealer(ns2, alice), other.sealer(ns1)]
    for i, s in enumerate(sealers):
        body = s.seal(key, data)
        assert s.open(key, body) == data
        for j, t in enumerate(sealers):
            if i != j:  # the same object key (associated data) and plaintext: another key never opens it
                with pytest.raises(Unauthenticated):
                    t.open(key, body)
    # Names are the namespace's (gc keeps the tree whole); children folders are the tenant's own.
    h = b"\x09" * 16
    assert fleet.sealer(ns1, alice).name(h) == fleet.sealer(ns1).name(h) != fleet.sealer(ns2).name(h)
    assert len({s.children(h, 5) for s in sealers}) == len(sealers)
    assert fleet.manifest_box("a" * 32).seal("m", b"x") != fleet.manifest_box("b" * 32).seal("m", b"x")
    assert key_id(secret) == fleet.key_id != other.key_id


def test_stats_of_a_server_with_a_remote_tier_name_no_bucket(tmp_path, s3, demo_model):
    url = s3.url("team-secret-prefix")
    model, store = demo_model("llama"), tmp_path / "store"
    for extra, shown in (((), False), (("--stats-paths",), True)):
        with Server(model, store, tmp_path / f"log{shown}", "--remote", url, *extra) as server:
            text = requests.get(server.url + "/kvstore/stats", timeout=30).text
        stats = json.loads(text)
        assert stats["remote"] is not None and ("url" in stats["remote"]) == shown
        for part in ("kvtest", "team-secret-prefix", str(store)):
            assert (part in text) == shown, part


def test_rotation_from_the_command_line(tmp_path, s3, demo_model):
    url, keyfile = s3.url(), tmp_path / "fleet.key"
    keyfile.write_text(new_key() + "\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"tokens": SYSTEM}) + "\n")
    common = ("--store", tmp_path / "s", "--model", demo_model("llama"), "--remote", url, "--remote-key-file", keyfile)
    run_cli("generate", "--prompt", "joins", "--max-tokens", "1", *common)  # the store joins the fleet
    time.sleep(2.1)  # (what a store wrote in its first second with a remote is taken on first use)
    run_cli("warm", "--prompts", prompts, *common)
    old = key_id(read_key_file(str(keyfile))[0])
    out = run_cli("remote-key", "--rotate", keyfile).stdout
    keys = read_key_file(str(keyfile))
    assert len(keys) == 2 and key_id(keys[1]) == old and f"--drop-key {old}" in out
    assert os.stat(keyfile).st_mode & 0o777 == 0o600
    run_cli("generate", "--prompt", "hello", "--max-tokens", "2", *common)  # during the overlap
    stats = run_cli("stats", "--store", tmp_path / "s", "--remote", url, "--remote-key-file", keyfile).stdout
    assert f"still read: {old}" in stats
    gone = run_cli("gc", "--store", tmp_path / "s", "--remote", url, "--remote-key-file", keyfile, "--drop-key", old)
    assert f"that only key {old} opens" in gone.stdout and f"key {old} taken out" in gone.stdout
    assert read_key_file(str(keyfile)) == keys[:1]
    bad = run_cli("gc", "--store", tmp_path / "s", "--remote", url, "--remote-key-file", keyfile, "--drop-key", old,
                  check=False)
    assert bad.returncode != 0 and "not an older key" in bad.stderr
    # The rotation's end leaves the node's own records (tagged under the old key) whole: verify is
    # clean, and the prompt warmed under the old key is reused, its records tagged again.
    clean = run_cli("verify", "--store", tmp_path / "s", "--remote-key-file", keyfile, check=False)
    assert clean.returncode == 0 and "corrupt_blob" not in clean.stdout, clean.stdout + clean.stderr
    again = run_cli("warm", "--prompts", prompts, *common)
    assert "0 computed" in again.stderr, again.stderr
