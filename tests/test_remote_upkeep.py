"""Bucket upkeep a bucket writer cannot steer, against a real SeaweedFS: verify judges sizes by the
geometry the sealed manifest states (planted tiny objects never make the fleet's records look too
large), a pins object put back at its key is a rollback gc does not act on, and a namespace no
key opens is a note that gc neither counts nor keeps, deleted only when told or when old."""

from __future__ import annotations

import json
import os
import subprocess
import time

import mlx.core as mx
import numpy as np
from kvtest import prefill
from mlx_lm.models.cache import make_prompt_cache
from remote_fixture import fleet, names
from test_remote_ops import C, cli, records, toks

import kvstore
from kvstore.records import CHUNK, RecordId
from kvstore.remote.layout import key_of, manifest_key, parse_other
from kvstore.remote.pins import node_id
from kvstore.remote.s3 import S3Bucket as Bucket
from kvstore.remote.upkeep import UNKNOWN_MAX_AGE, collect_remote
from kvstore.sizes import format_size

BIG = 2048  # a chunk of the demo model is then 2.1 MB: far above what five 100-byte objects are


def plant_tiny(url: str, ns: bytes, n: int = 5) -> None:
    """`n` objects of 100 bytes at chunk keys of the fleet's namespace (root chunks)."""
    s, bucket = fleet().sealer(ns), Bucket(url)
    for i in range(n):
        bucket.put(key_of(s, RecordId(os.urandom(16), ns, ns, None, CHUNK, BIG, i + 1), np.arange(i + 1, i + 1 + BIG)),
                   b"x" * 100)


def random_kv(model, n: int) -> list:
    """The model's own cache classes holding `n` tokens of random K/V, of the shapes and dtype a
    prefill gives: what verify judges here is the records' sizes, never their values, and a
    prefill of 4,101 tokens costs seconds of CPU on the bundled BLAS."""
    shapes = [(c.keys.shape, c.keys.dtype) for c in prefill(model, [1])]
    cache = make_prompt_cache(model)
    for layer, ((b, h, _, d), dtype) in zip(cache, shapes):
        layer.update_and_fetch(mx.random.normal((b, h, n, d)).astype(dtype), mx.random.normal((b, h, n, d)).astype(dtype))
    mx.eval([c.state for c in cache])
    return cache


def test_five_planted_tiny_objects_never_make_verify_repair_delete_the_fleets_records(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    prompt = toks(2 * BIG + 5, 60)
    with kvstore.open(tmp_path / "a", chunk_size=BIG, remote=url) as a:
        mc = a.bind(model, path)
        mc.insert(prompt, random_kv(model, len(prompt)))
        assert a.flush(60)
    fleet_records = records(url)
    assert len(fleet_records) == 3 and sorted(k.size for k in fleet_records.values())[-1] > 2_000_000
    plant_tiny(url, mc.ns)
    # A node with no store and no model: the cap is the manifest's, and the hint repeats the command.
    key_file = tmp_path / "fleet.key"
    key_file.write_text(os.environ["KVSTORE_REMOTE_KEY"] + "\n")
    where = ["--store", str(tmp_path / "none"), "--remote", url, "--remote-key-file", str(key_file)]
    out = cli("verify", *where)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"run `kvstore verify --remote {url} --store {tmp_path / 'none'} --remote-key-file {key_file} --repair`" \
        in out.stdout, out.stdout
    out = cli("verify", *where, "--repair", "--json")
    problems = json.loads(out.stdout)["problems"]
    assert [p["kind"] for p in problems] == ["unauthenticated_object"] * 5, problems
    assert records(url).keys() == fleet_records.keys()
    # A manifest written before manifests stated the geometry: sizes are not judged, contents are.
    folder = fleet().ns_name(mc.ns)
    bucket, box, key = Bucket(url), fleet().manifest_box(folder), manifest_key(folder)
    manifest = json.loads(box.open(key, bucket.get(key)))
    assert manifest["geometry"]["per_token"] > 0
    del manifest["geometry"]
    bucket.put(key, box.seal(key, json.dumps(manifest).encode()))
    plant_tiny(url, mc.ns)
    out = cli("verify", *where, "--repair")
    assert out.returncode == 1 and records(url).keys() == fleet_records.keys(), out.stdout
    out = cli("verify", *where)
    assert out.returncode == 0 and out.stdout.endswith("clean\n"), out.stdout + out.stderr


def test_a_rolled_back_pins_object_is_detected_and_gc_keeps_the_pinned_prompt(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    first, second, other = toks(2 * C + 3, 70), toks(3 * C + 4, 71), toks(2 * C + 2, 72)
    bucket = Bucket(url)
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url) as b:  # node B pins one prompt, then another
        mc = b.bind(model, path)
        mc.insert(first, prefill(model, first), pin=True)
        assert b.flush(30)
        pins = next(p for p, _, _ in bucket.list("") if (parse_other(p) or ("",))[0] == "pins")
        old = bytes(bucket.get(pins))  # what a bucket writer keeps, to put back later
        mc.insert(second, prefill(model, second), pin=True)
        assert b.flush(30)
        pinned = names(mc.ns, mc.record_hashes(np.asarray(second)))
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:  # node A reads B's pins once
        mca = a.bind(model, path)
        mca.insert(other, prefill(model, other))
        assert a.flush(30)
        assert a.remote.verify() == []
    bucket.put(pins, old)  # the rollback: `second` is not in it
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        result = a.remote.gc(max_bytes=0)
        assert result["held_namespaces"] == 1 and result["evicted"] == 0 and len(result["rollbacks"]) == 1
    assert pinned <= set(records(url))
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url) as b:  # B's own: a problem verify reports
        found = b.remote.verify()
        assert [p.kind for p in found] == ["rolled_back_pins"] and "this node's" in found[0].detail
        assert b.remote.verify(repair=True) and b.remote.verify() == []  # published again
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:  # gc goes on, and keeps both pins
        result = a.remote.gc(max_bytes=0)
        assert result["held_namespaces"] == 0 and result["evicted"] > 0 and not result["rollbacks"]
    left = set(records(url))
    assert pinned <= left and names(mca.ns, mca.record_hashes(np.asarray(first))) <= left
    bucket.put(pins, os.urandom(300))  # an object that does not open, in the place of one seen
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        result = a.remote.gc(max_bytes=0)
        assert result["held_namespaces"] == 1 and "does not open" in result["rollbacks"][0]
    assert set(records(url)) == left


def test_a_junk_namespace_with_a_pins_object_never_makes_gc_evict_the_fleets_records(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    store = tmp_path / "a"
    with kvstore.open(store, chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        for i in range(3):
            p = toks(3 * C + 5, 90 + i)
            mc.insert(p, prefill(model, p))
        assert a.flush(30)
    fleet_records = records(url)
    total = sum(k.size for k in fleet_records.values())
    junk = plant_junk(url)
    out = cli("gc", "--store", str(store), "--remote", url, "--max-bytes", f"{total}B")
    assert out.returncode == 0 and "deleted 0 objects" in out.stdout, out.stdout + out.stderr
    assert "1 namespace none of this node's keys opens (20.0 MiB) not counted" in out.stdout, out.stdout
    assert records(url).keys() == fleet_records.keys() | junk
    out = cli("verify", "--store", str(store), "--remote", url)
    assert out.returncode == 0 and out.stdout.endswith("clean; 1 note (left alone: not problems)\n"), out.stdout
    assert "note: unknown_namespace" in out.stdout and "--drop-unknown" in out.stdout
    out = cli("gc", "--store", str(store), "--remote", url, "--drop-unknown", "--dry-run")
    assert out.returncode == 0 and "would delete 1 namespace" in out.stdout, out.stdout + out.stderr
    assert records(url).keys() == fleet_records.keys() | junk
    out = cli("gc", "--store", str(store), "--remote", url, "--drop-unknown")
    assert out.returncode == 0 and "deleted 1 namespace" in out.stdout, out.stdout + out.stderr
    assert records(url).keys() == fleet_records.keys()
    assert not [p for p, _, _ in Bucket(url).list("") if p.startswith(JUNK)]
    # Without --drop-unknown, past the documented age only (since its newest object).
    plant_junk(url, n=2)
    kept = collect_remote(Bucket(url), fleet(), now=time.time() + UNKNOWN_MAX_AGE - 86400)
    assert kept["dropped_namespaces"] == 0 and kept["unknown_namespaces"] == 1
    gone = collect_remote(Bucket(url), fleet(), now=time.time() + UNKNOWN_MAX_AGE + 60)
    assert gone["dropped_namespaces"] == 1 and gone["evicted"] == 0 and records(url).keys() == fleet_records.keys()


def test_objects_too_large_for_a_record_planted_below_the_fleets_never_make_gc_evict_them(tmp_path, s3, llama):
    """20 MiB of objects named as chunks below one of the fleet's records (the newest objects: least
    recently used goes first), each larger than a chunk of the namespace can be by its manifest's
    geometry (at most 1 MiB and twice its K/V): gc does not count them against --max-bytes, deletes them first, and
    keeps every record of the fleet."""
    path, model = llama
    url = s3.url()
    store = tmp_path / "a"
    prompts = [toks(3 * C + 5, 95 + i) for i in range(3)]
    with kvstore.open(store, chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        for p in prompts:
            mc.insert(p, prefill(model, p))
        assert a.flush(30)
        ns, parent = mc.ns, mc.record_hashes(prompts[0])[1]
    fleet_records = records(url)
    total = sum(k.size for k in fleet_records.values())
    s, bucket = fleet().sealer(ns), Bucket(url)
    for i in range(8):
        rid = RecordId(os.urandom(16), ns, parent, None, CHUNK, C, i + 1)
        bucket.put(key_of(s, rid, np.arange(i + 1, i + 1 + C)), os.urandom(5 << 19))
    out = cli("gc", "--store", str(store), "--remote", url, "--max-bytes", f"{total}B")
    assert out.returncode == 0 and "deleted 8 objects (20.0 MiB)" in out.stdout, out.stdout + out.stderr
    assert "8 of those objects (20.0 MiB) are larger than a record" in out.stdout, out.stdout
    # The total after gc is not listed again: said as what it is, the listed one less what gc deleted.
    n = len(fleet_records)
    assert (f"the bucket held {n + 8} objects ({format_size(total + (20 << 20))}) when gc listed it: {n} objects "
            f"({format_size(total)}) less what gc deleted, not counting what other nodes stored or deleted "
            "since\n") in out.stdout, out.stdout
    assert records(url).keys() == fleet_records.keys()


JUNK = "0123456789abcdef0123456789abcdef"


def plant_junk(url: str, n: int = 20) -> set[bytes]:
    """A made-up namespace folder: a pins object, a manifest and `n` MiB of root chunks (their
    names), newer than the fleet's (least recently used goes first)."""
    bucket, ns = Bucket(url), bytes.fromhex(JUNK)
    bucket.put(f"{JUNK}/pins/{os.urandom(16).hex()}", os.urandom(200))
    bucket.put(f"{JUNK}/manifest", os.urandom(200))
    made = set()
    for _ in range(n):
        h = os.urandom(16)
        bucket.put(f"{JUNK}/{JUNK[:2]}/{JUNK}/{os.urandom(8).hex()}/{h.hex()}.chunk.{C}", os.urandom(1 << 20))
        made.add(h)
    assert ns.hex() == JUNK
    return made


def test_a_missing_bucket_is_one_line_that_names_it(tmp_path, s3):
    url = s3.url().replace("s3://kvtest/", "s3://no-such-bucket-kv/")
    for args in (["verify", "--remote", url], ["gc", "--remote", url, "--max-age", "7d"]):
        out = cli(*args, "--store", str(tmp_path / "none"))
        assert out.returncode == 1 and out.stdout == "", out.stdout
        assert out.stderr.count("\n") == 1 and f"remote {url}" in out.stderr, out.stderr


def pinning_nodes(tmp_path, url: str, llama) -> tuple:
    """Node B pins `first`, keeping a copy of its pins object then, and pins `second`; node A pins a
    prompt of its own and reads B's pins once (its verify). (B's pins key, the copy, the names of
    `first`'s, `second`'s and A's prompt's records.)"""
    path, model = llama
    first, second, other = toks(2 * C + 3, 70), toks(3 * C + 4, 71), toks(2 * C + 2, 72)
    bucket = Bucket(url)
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url) as b:
        mc = b.bind(model, path)
        mc.insert(first, prefill(model, first), pin=True)
        assert b.flush(30)
        pins = next(p for p, _, _ in bucket.list("") if (parse_other(p) or ("",))[0] == "pins")
        old = bytes(bucket.get(pins))
        mc.insert(second, prefill(model, second), pin=True)
        assert b.flush(30)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        a.bind(model, path).insert(other, prefill(model, other), pin=True)
        assert a.flush(30)
        assert a.remote.verify() == []
    return pins, old, *(names(mc.ns, mc.record_hashes(np.asarray(p))) for p in (first, second, other))


def test_gc_says_apart_the_pinned_records_and_those_a_rolled_back_pins_object_kept(tmp_path, s3, llama):
    url = s3.url()
    pins, old, first, second, own = pinning_nodes(tmp_path, url, llama)
    Bucket(url).put(pins, old)  # the rollback: `second` is not pinned in it
    total = len(records(url))
    out = cli("gc", "--store", str(tmp_path / "a"), "--remote", url, "--max-bytes", "1B")
    assert out.returncode == 0 and "deleted 0 objects" in out.stdout, out.stdout + out.stderr
    # A's own pins are pinned records (its index says so); the rest of the namespace is kept only
    # because B's pins cannot be trusted now (what the older copy lacks is not known).
    assert (f"({len(own)} pinned records kept; {total - len(own)} other records kept because gc was "
            "blocked, below)") in out.stdout, out.stdout
    assert "gc kept every record of a namespace" in out.stdout and "older than" in out.stdout, out.stdout
    assert len(records(url)) == total


def test_a_deleted_pins_object_is_a_rollback_until_its_node_publishes_again_or_is_forgotten(tmp_path, s3, llama):
    """B's pins object, seen by A, is deleted: A's gc deletes nothing of that namespace (what B
    pinned is not known) and verify reports it, until B publishes again (at its next close) or
    `verify --repair` on A takes B as retired. A's own, deleted, is published again."""
    path, model = llama
    url = s3.url()
    pins, _, first, second, own = pinning_nodes(tmp_path, url, llama)
    bucket, every = Bucket(url), set(records(url))
    bucket.delete([pins])
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        result = a.remote.gc(max_bytes=0)
        assert result["held_namespaces"] == 1 and result["evicted"] == 0, result
        assert "was deleted" in result["rollbacks"][0] and result["kept_held"] == len(every) - len(own), result
        found = a.remote.verify()
        assert [p.kind for p in found] == ["rolled_back_pins"] and "retired for good" in found[0].detail, found
    assert set(records(url)) == every
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url) as b:  # B's next close publishes again
        b.bind(model, path)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        assert a.remote.verify() == []
        result = a.remote.gc(max_bytes=0)
        assert result["held_namespaces"] == 0 and set(records(url)) == first | second | own, result
        mine = next(p for p, _, _ in bucket.list("") if p.endswith("/pins/" + a.remote.ledger().node))
        bucket.delete([pins, mine])  # B retired, its pins deleted on purpose; A's own deleted too
        found = a.remote.verify()
        assert sorted(p.detail.split(" ")[0] for p in found) == ["node", "this"], found
        assert a.remote.verify(repair=True) and a.remote.verify() == []  # A's published, B's forgotten
        result = a.remote.gc(max_bytes=0)
        assert result["held_namespaces"] == 0 and set(records(url)) == own, result


def test_a_store_folder_copied_takes_a_node_id_of_its_own_and_one_renamed_keeps_its_own(tmp_path):
    """The node id is bound to the inode of its store folder: `cp -a` (or a restore from backup)
    makes another folder, which takes a new id and takes the serials of its pins objects as the
    original's; a folder renamed on its filesystem is the same folder, and keeps its id."""
    kvstore.open(tmp_path / "p5").close()
    with kvstore.open(tmp_path / "p5") as s:
        node = node_id(tmp_path / "p5", s.index)
        s.index.raise_mark("remote.pins.f0", 7)  # as if it had published pins, serial 7
    subprocess.run(["cp", "-a", str(tmp_path / "p5"), str(tmp_path / "p6")], check=True)
    with kvstore.open(tmp_path / "p6") as s:
        copy = node_id(tmp_path / "p6", s.index)
        assert copy != node and node_id(tmp_path / "p6", s.index) == copy
        assert s.index.marks("remote.pins") == {f"remote.pins_seen.f0.{node}": 7}
    os.rename(tmp_path / "p5", tmp_path / "p7")
    with kvstore.open(tmp_path / "p7") as s:
        assert node_id(tmp_path / "p7", s.index) == node and s.index.marks("remote.pins.") == {"remote.pins.f0": 7}


def copied_node(tmp_path, url: str, llama, *, keep_id: bool) -> tuple:
    """P5 pins a prompt and R5 stores one (read P5's pins once); P5's folder is copied to P6, and
    P6 unpins the prompt. `keep_id`: P6 keeps P5's node id (a copy made before ids were bound to
    the folder, or a cloned disk image). (P5's pinned records' names, P6's model cache.)"""
    path, model = llama
    pinned, other = toks(3 * C + 3, 80), toks(2 * C + 2, 81)
    with kvstore.open(tmp_path / "p5", chunk_size=C, remote=url) as p5:
        mc = p5.bind(model, path)
        mc.insert(pinned, prefill(model, pinned), pin=True)
        assert p5.flush(30)
    with kvstore.open(tmp_path / "r5", chunk_size=C, remote=url) as r5:
        r5.bind(model, path).insert(other, prefill(model, other))
        assert r5.flush(30) and r5.remote.verify() == []
    subprocess.run(["cp", "-a", str(tmp_path / "p5"), str(tmp_path / "p6")], check=True)
    if keep_id:
        with kvstore.open(tmp_path / "p6") as p6:
            p6.index.drop_mark("remote.node_folder." + node_id(tmp_path / "p6"))
    with kvstore.open(tmp_path / "p6", chunk_size=C, remote=url) as p6:
        assert p6.bind(model, path).unpin(pinned)["records"] > 0
    return names(mc.ns, mc.record_hashes(np.asarray(pinned))), pinned


def test_a_copied_store_folder_never_publishes_over_the_originals_pins(tmp_path, s3, llama):
    """The audit's case: P6, a copy of P5's folder, unpins P5's prompt; R5's gc with a small
    budget keeps it (P6 published under a node id of its own), and a fresh node restores it."""
    path, model = llama
    url = s3.url()
    kept, pinned = copied_node(tmp_path, url, llama, keep_id=False)
    out = cli("gc", "--store", str(tmp_path / "r5"), "--remote", url, "--max-bytes", "1B")
    assert out.returncode == 0, out.stdout + out.stderr
    assert kept <= set(records(url)), out.stdout
    with kvstore.open(tmp_path / "p5", chunk_size=C, remote=url) as p5:
        assert p5.remote.verify() == []
    with kvstore.open(tmp_path / "fresh", chunk_size=C, remote=url, memory_bytes=0) as fresh:
        _, rest = fresh.bind(model, path).fetch(pinned + [5])
        assert len(rest) == 1


def test_a_pins_object_another_store_wrote_under_this_nodes_id_is_reported_and_this_node_moves(tmp_path, s3, llama):
    """A copy that kept the node id publishes over P5's pins: P5's verify reports `foreign_pins`
    (not clean), and --repair gives P5 a new id and publishes its pins under it; R5's gc then
    keeps P5's prompt. (P5's close does the same, unasked.)"""
    url = s3.url()
    kept, _ = copied_node(tmp_path, url, llama, keep_id=True)
    with kvstore.open(tmp_path / "p5", chunk_size=C, remote=url) as p5:
        node = p5.remote.ledger().node
        found = p5.remote.verify()
        assert [p.kind for p in found] == ["foreign_pins"] and "never wrote" in found[0].detail, found
        assert p5.remote.verify(repair=True) and p5.remote.verify() == []
        assert p5.remote.ledger().node != node
    with kvstore.open(tmp_path / "p6", chunk_size=C, remote=url) as p6:
        assert p6.remote.ledger().node == node and p6.remote.verify() == []
    with kvstore.open(tmp_path / "r5", chunk_size=C, remote=url) as r5:
        r5.remote.gc(max_bytes=1)
    assert kept <= set(records(url))
