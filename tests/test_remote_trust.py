"""The remote tier against someone who can write the bucket but does not hold the fleet secret.

The attacker holds the bucket's credentials and the model's fingerprint, binds a model with other
weights under the fleet's fingerprint, and plants its K/V at the keys the fleet uses (before any
honest node stored them, and after deleting the fleet's objects), sealed with a secret of its
own or not at all. Every node of the fleet still restores the honest model's logits, computed
from scratch here; an honest node that stores a planted prompt replaces what was planted. No
object, key or object metadata holds the prompt's token ids or the model's path in clear.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import obstore
import pytest
import xxhash
from kvtest import alter_record, logits_diff, prefill
from mlx.utils import tree_flatten, tree_map
from mlx_lm import load
from remote_fixture import fleet, names

import kvstore
from kvstore import keys, trust
from kvstore.records import prompt_records
from kvstore.remote.health import Health
from kvstore.remote.layout import key_of, manifest_key, parse_key
from kvstore.remote.s3 import S3Bucket as Bucket
from kvstore.remote.seal import fleet_secret, new_key
from kvstore.remote.uploader import Uploader
from kvstore.storage import blobformat
from kvstore.storage.blobtree import blob_path
from kvstore.upkeep.anchors import Anchors
from kvstore.upkeep.local import LocalStore

C = 16
REPO = Path(__file__).resolve().parents[1]


def toks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 250, n).tolist()


@pytest.fixture(scope="module")
def evil(llama):
    """The demo model with other weights (every parameter scaled), same shapes and dtypes."""
    path, _ = llama
    model, _ = load(str(path))
    model.update(tree_map(lambda a: a * 1.7 if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()))
    mx.eval(model.parameters())
    return model


def store_prompts(store_dir: Path, url: str, model, path, prompts, *, fingerprint=None, **options):
    """Store `prompts` on a node and wait for its uploads: (its stats, its ModelCache, its fleet)."""
    with kvstore.open(store_dir, chunk_size=C, remote=url, **options) as node:
        mc = node.bind(model, path, fingerprint=fingerprint)
        for p in prompts:
            mc.insert(p, prefill(model, p))
        assert node.flush(30)
        return node.stats(), mc, node.remote.fleet


def fleet_fetch_is_honest(store, model, path, prompt) -> int:
    """Fetch `prompt` + one token on a fleet node: the logits are the honest model's (from scratch).
    Returns how many tokens were reused."""
    mc = store.bind(model, path)
    query = prompt + [3]
    cache, rest = mc.fetch(query)
    assert logits_diff(model, cache, rest, query) < 1e-4
    return len(query) - len(rest)


def plant(url: str, store_dir: Path, source, ns: bytes, prompts, sealed: bool) -> int:
    """Copy the attacker's records of `prompts` to the keys the fleet uses for them: its sealed
    objects (`sealed`), or its blob files in clear. The attacker's manifest goes over the fleet's
    manifest too. Returns how many objects were planted."""
    bucket, ours, theirs = Bucket(url), fleet().sealer(ns), source.sealer(ns)
    planted = 0
    for p in prompts:
        for r in prompt_records(ns, np.asarray(p), C):
            t = np.asarray(p)[r.start : r.end]
            body = bucket.get(key_of(theirs, r, t)) if sealed else blob_path(store_dir / "blobs", r.hash).read_bytes()
            assert body is not None
            bucket.put(key_of(ours, r, t), bytes(body))
            planted += 1
    manifest = bucket.get(manifest_key(theirs.folder))
    bucket.put(manifest_key(ours.folder), bytes(manifest))
    return planted


def delete_keys(url: str) -> None:
    bucket = Bucket(url)
    bucket.delete([p for p, _, _ in bucket.list("keys/")])


def delete_everything(url: str) -> None:
    bucket = Bucket(url)
    bucket.delete([p for p, _, _ in bucket.list("")])


@pytest.mark.parametrize("sealed", [True, False], ids=["another-secret", "no-secret"])
def test_a_bucket_writer_without_the_secret_never_changes_what_the_fleet_restores(tmp_path, s3, llama, evil, sealed):
    path, model = llama
    url = s3.url()
    prompts = [toks(3 * C + 5, 1), toks(2 * C + 9, 2)]
    with kvstore.open(tmp_path / "probe", chunk_size=C) as probe:
        honest = probe.bind(model, path)
        fp, ns = honest.fingerprint, honest.ns
    # The attacker stores the prompts with its model under the fleet's fingerprint (same namespace).
    _, emc, source = store_prompts(tmp_path / "evil", url, evil, path, prompts, fingerprint=fp, remote_key=new_key())
    assert emc.ns == ns
    n = plant(url, tmp_path / "evil", source, ns, prompts, sealed)
    delete_keys(url)  # (a bucket writer need not leave the key marker its own kvstore published)
    # Planted before any honest node: a fleet node gets a miss, counted, and stores nothing of it.
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0) as b:
        assert fleet_fetch_is_honest(b, model, path, prompts[0]) == 0
        assert b.stats()["remote"]["unauthenticated"] >= 1 and b.stats()["chunks"] == 0
    # An honest node stores the same prompts: its create-only PUTs find the planted objects,
    # which do not open, and replace them.
    r = store_prompts(tmp_path / "a", url, model, path, prompts)[0]["remote"]
    assert r["replaced"] == n + 1 and r["uploads"] == 0, r  # the records, and the manifest
    # Every node of the fleet now restores the honest prompts from the bucket.
    with kvstore.open(tmp_path / "c", chunk_size=C, remote=url, memory_bytes=0) as c:
        for p in prompts:
            assert fleet_fetch_is_honest(c, model, path, p) == len(p)
        assert c.stats()["remote"]["unauthenticated"] == 0 and c.verify() == []
    # The attacker deletes the fleet's objects and plants its own again: misses, never its K/V.
    delete_everything(url)
    source = store_prompts(tmp_path / "evil2", url, evil, path, prompts, fingerprint=fp, remote_key=new_key())[2]
    plant(url, tmp_path / "evil2", source, ns, prompts, sealed)
    delete_keys(url)
    with kvstore.open(tmp_path / "d", chunk_size=C, remote=url, memory_bytes=0) as d:
        for p in prompts:
            assert fleet_fetch_is_honest(d, model, path, p) == 0
        assert d.stats()["chunks"] == 0 and d.stats()["tails"] == 0
    # A verify of the bucket reports every planted object (and notes the attacker's own folder,
    # which it cannot read and leaves alone); repair deletes what was planted.
    out = _cli("verify", "--store", str(tmp_path / "a"), "--remote", url, "--json")
    problems = json.loads(out.stdout)["problems"]
    kinds = [p["kind"] for p in problems]
    assert out.returncode == 1 and set(kinds) == {"unauthenticated_object"}
    assert [n["kind"] for n in json.loads(out.stdout)["notes"]] == ["unknown_namespace"]
    assert kinds.count("unauthenticated_object") == n
    out = _cli("verify", "--store", str(tmp_path / "a"), "--remote", url, "--repair")
    assert "repaired" in out.stdout, out.stdout + out.stderr
    ours = fleet().sealer(ns).folder
    assert not any(parse_key(p) and p.startswith(ours) for p, _, _ in Bucket(url).list(""))


def test_no_object_holds_tokens_or_the_model_path_in_clear(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    prompt = np.random.default_rng(7).permutation(np.arange(100, 100 + 3 * C + 5)).tolist()
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        mc.insert(prompt, prefill(model, prompt), pin=True)
        assert a.flush(30)
        local = [blob_path(a.blob_root, h).read_bytes() for h in mc.record_hashes(prompt)]
    windows = [struct.pack("<3i", *prompt[i : i + 3]) for i in range(len(prompt) - 2)]
    assert any(w in b for b in local for w in windows)  # the search finds them where they are in clear
    secrets = [str(path).encode(), Path(path).name.encode()]
    store = Bucket(url)._read
    listed = Bucket(url).list("")
    assert {k for k in ("manifest", "pins") if any(f"/{k}" in p for p, _, _ in listed)} == {"manifest", "pins"}
    for key, _, _ in listed:
        assert not any(str(t) in key.split("/") for t in prompt)  # no token as a folder
        assert mc.ns.hex() not in key and not any(h.hex() in key for h in mc.record_hashes(prompt))
        got = obstore.get(store, key)
        body, attributes = bytes(got.bytes()), got.attributes
        for needle in windows + secrets:
            assert needle not in body, key
        assert not any(str(path) in str(v) or Path(path).name in str(v) for v in attributes.values()), attributes


def test_a_remote_without_a_secret_is_refused(tmp_path, s3, monkeypatch):
    monkeypatch.delenv("KVSTORE_REMOTE_KEY")
    with pytest.raises(kvstore.InvalidInputError, match="KVSTORE_REMOTE_KEY.*kvstore remote-key"):
        kvstore.open(tmp_path / "s", remote=s3.url())
    assert not (tmp_path / "s").exists()  # refused before anything is created
    kvstore.open(tmp_path / "s").close()
    with pytest.raises(kvstore.InvalidInputError, match="fleet secret is 32 random bytes"):
        kvstore.open(tmp_path / "s", remote=s3.url(), remote_key="too-short")
    env = {"KVSTORE_REMOTE_KEY": ""}
    out = _cli("stats", "--store", str(tmp_path / "s"), "--remote", s3.url(), env=env)
    assert out.returncode == 1 and "KVSTORE_REMOTE_KEY" in out.stderr and "kvstore remote-key" in out.stderr
    # `kvstore remote-key` makes one; `--remote-key-file` gives it.
    made = _cli("remote-key")
    assert made.returncode == 0 and len(made.stdout.strip()) == 43
    keyfile = tmp_path / "fleet.key"
    keyfile.write_text(made.stdout)
    out = _cli("stats", "--store", str(tmp_path / "s"), "--remote", s3.url(), "--remote-key-file", str(keyfile),
               env=env)
    assert out.returncode == 0, out.stderr
    assert made.stdout.strip() not in out.stdout + out.stderr
    keyfile.write_text("not a key\n")
    out = _cli("stats", "--store", str(tmp_path / "s"), "--remote", s3.url(), "--remote-key-file", str(keyfile))
    assert out.returncode == 1 and "fleet.key" in out.stderr and "not a key" not in out.stderr
    serve = subprocess.run([sys.executable, "-m", "kvstore.serve", "--store", str(tmp_path / "s"), "--remote",
                            s3.url(), "--remote-key-file", str(keyfile)], capture_output=True, text=True,
                           timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert serve.returncode == 1 and "fleet.key" in serve.stderr and "not a key" not in serve.stderr, serve.stderr


def test_an_object_that_states_chunk_size_zero_is_a_counted_bad_object(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    prompt = toks(2 * C + 3, 9)
    mc = store_prompts(tmp_path / "a", url, model, path, [prompt])[1]
    first = prompt_records(mc.ns, np.asarray(prompt), C)[0]
    blob = blob_path(tmp_path / "a" / "blobs", first.hash).read_bytes()
    # A fleet node with a bug seals a record whose header says chunk size 0.
    (n,) = struct.unpack_from("<Q", blob, 0)
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"]["chunk_size"] = "0"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    s = fleet().sealer(mc.ns)
    key = key_of(s, first, np.asarray(prompt)[: first.ntokens])
    Bucket(url).put(key, s.seal(key, struct.pack("<Q", len(text)) + text + blob[8 + n :]))
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0) as b:
        assert fleet_fetch_is_honest(b, model, path, prompt) == 0
        assert b.stats()["remote"]["corrupt_objects"] == 1
    out = _cli("verify", "--store", str(tmp_path / "a"), "--remote", url, "--json")
    problems = json.loads(out.stdout)["problems"]
    assert out.returncode == 1 and [(p["kind"], p["path"]) for p in problems][:1] == [("corrupt_object", key)]
    assert "chunk_size '0'" in problems[0]["detail"]


class _Silent:
    """A TCP endpoint on loopback that accepts connections and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


def test_flush_with_a_hanging_endpoint_is_bounded_and_says_what_was_left(tmp_path, s3, llama, monkeypatch):
    path, model = llama
    silent = _Silent()
    monkeypatch.setenv("AWS_ENDPOINT_URL", silent.url)
    try:
        with kvstore.open(tmp_path / "a", chunk_size=C, remote=s3.url(), remote_flush_timeout=0.5) as a:
            mc = a.bind(model, path)
            for i in range(3):
                p = toks(2 * C + 1, 20 + i)
                mc.insert(p, prefill(model, p))
            assert a.flush() is False  # bounded: the uploads are still waiting on the endpoint
            assert a.stats()["remote"]["pending_uploads"] >= 1
            assert a.stats()["chunks"] == 6  # the local store is whole
            remote = a.remote
        assert remote.counters["left_uploads"] >= 1
    finally:
        silent.close()


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def test_keys_a_listing_shows_are_of_the_layout_only(monkeypatch):
    monkeypatch.setenv("KVSTORE_REMOTE_KEY", new_key())  # (no server: the s3 fixture may not have set it)
    f = fleet()
    s = f.sealer(b"\x05" * 16)
    t = np.arange(1, C + 4)
    r = prompt_records(s.ns, t, C)
    for rec in r:
        assert parse_key(key_of(s, rec, t[rec.start : rec.end])) is not None
        assert parse_key("team/" + key_of(s, rec, t[rec.start : rec.end])) is None


def test_downloads_count_against_the_local_budget(tmp_path, s3, llama):
    """A node with a disk budget that restores more than it from the bucket: gc runs after the
    downloads as it does after the writer's batches, and the store ends within its budget."""
    import time

    path, model = llama
    url = s3.url()
    prompts = [toks(4 * C + 3, 30 + i) for i in range(3)]
    budget = store_prompts(tmp_path / "a", url, model, path, prompts)[0]["bytes"] // 2
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, max_bytes=budget, memory_bytes=0) as b:
        for p in prompts:
            assert fleet_fetch_is_honest(b, model, path, p) == len(p)
        assert b.stats()["remote"]["downloads"] == 3 * 5
        end = time.monotonic() + 30  # gc runs on a thread of its own: wait for it, boundedly
        while b.stats()["bytes"] > budget and time.monotonic() < end:
            time.sleep(0.1)
        assert b.stats()["bytes"] <= budget


# -- laundering: what a writer of one node's store folder can make an honest node upload -----------

def record_objects(url: str) -> dict[bytes, object]:
    """The bucket's record objects under `url`, by name."""
    return {k.hash: k for k in (parse_key(p, s, t) for p, s, t in Bucket(url).list("")) if k}


@pytest.mark.parametrize("tag", [None, "0123abcd:" + "ab" * 32], ids=["untagged", "made-up-tag"])
def test_planted_fingerprint_memo_rows_never_put_other_weights_under_the_fleet_namespace(tmp_path, s3, llama,
                                                                                        evil, tag):
    """The folder's writer plants rows in the node's fingerprint memo (`file_digests`) that give the
    files of a model with other weights the fleet model's digests (so, unchecked, its fingerprint
    and namespace). The rows hold no trust tag of the node: its files are hashed again, and nothing
    of the other model's K/V goes into the fleet's namespace."""
    path, model = llama
    url = s3.url()
    prompts = [toks(3 * C + 5, 41)]
    with kvstore.open(tmp_path / "probe", chunk_size=C) as probe:
        fleet_ns = probe.bind(model, path).ns
    other = tmp_path / "other-weights"
    shutil.copytree(path, other)
    (weights,) = other.glob("*.safetensors")
    mx.save_safetensors(str(weights), dict(tree_flatten(evil.parameters())))
    kvstore.open(tmp_path / "node", chunk_size=C).close()  # the node's store, as the writer finds it
    files = keys.model_files(other.resolve())
    with sqlite3.connect(tmp_path / "node" / "index.sqlite") as con:
        for f in files:
            st = os.stat(f)
            honest = keys.file_digest(Path(path).resolve() / f.relative_to(other.resolve()))
            con.execute("INSERT OR REPLACE INTO file_digests (path, size, mtime_ns, dev, inode, ctime_ns, digest, tag) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (str(f), st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, st.st_ctime_ns, honest, tag))
    con.close()
    _, mc, _ = store_prompts(tmp_path / "node", url, evil, other, prompts)
    assert mc.ns != fleet_ns  # the files as they are: another model
    fleet_folder = fleet().sealer(fleet_ns).folder
    listed = [p for p, _, _ in Bucket(url).list("")]
    assert listed and not any(p.startswith(fleet_folder + "/") for p in listed), listed
    with kvstore.open(tmp_path / "c", chunk_size=C, remote=url, memory_bytes=0) as c:
        assert fleet_fetch_is_honest(c, model, path, prompts[0]) == 0


def test_a_parent_altered_with_its_checksums_fixed_is_refused_and_nothing_below_it_goes_up(
        tmp_path, s3, llama, caplog):
    """While a node's uploads are under way, the folder's writer scales the second chunk's keys and
    writes their checksums (and its row's) to match. The uploader finds the blob changed since its
    commit: refused (counted, said once, no path), nothing that hangs below it is uploaded though
    the remote was never paused (so the parent check itself keeps them out). Sent again as the
    index now has it (as a key rotation's re-upload sends rows), its trust tag is found wrong:
    refused again. `verify` reports it."""
    path, model = llama
    url = s3.url()
    prompt = toks(4 * C + 5, 42)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        hashes = mc.record_hashes(prompt)
        real, waiting, go = a.remote.bucket.put_new, threading.Event(), threading.Event()

        def put_new(key, data):  # the first PUT (the manifest) waits: the first chunk was read already
            if not waiting.is_set():
                waiting.set()
                assert go.wait(60)
            return real(key, data)

        a.remote.bucket.put_new = put_new
        mc.insert(prompt, prefill(model, prompt))
        assert waiting.wait(60)
        alter_record(tmp_path / "a", hashes[1], "1.keys", 1.5)
        go.set()
        assert a.flush(30)
        assert not a.remote.health.down()
        r = a.stats()["remote"]
        assert set(record_objects(url)) == names(mc.ns, hashes[:1])
        assert (r["uploads"], r["refused_uploads"], r["skipped_no_parent"], r["upload_errors"]) == (1, 1, 3, 0), r
        a.remote.uploader.submit([a.index.get(h) for h in hashes[1:]])
        assert a.flush(30)
        r = a.stats()["remote"]
        assert set(record_objects(url)) == names(mc.ns, hashes[:1])
        assert (r["uploads"], r["refused_uploads"], r["skipped_no_parent"]) == (1, 2, 6), r
        problems = a.verify()
        damaged = [p for p in problems if p.kind == "corrupt_blob"]
        assert [p.hash for p in damaged] == [hashes[1].hex()] and "trust tag does not hold" in damaged[0].detail
    said = [m.getMessage() for m in caplog.records if "refused to upload" in m.getMessage()]
    assert len(said) == 2 and "changed after it was committed" in said[0] and "trust tag does not hold" in said[1]
    assert not any(str(tmp_path) in m or hashes[1].hex() in m for m in said)
    out = _cli("stats", "--store", str(tmp_path / "a"), "--remote", url)
    assert "refused uploads: 2" in out.stdout, out.stdout + out.stderr


def test_a_continuation_of_an_altered_parent_never_reaches_the_fleet(tmp_path, s3, llama):
    """The node stored and uploaded a prompt; then the folder's writer alters its first chunk (keys
    scaled, checksums fixed). The node continues the prompt as a server does (fetch, prefill the
    rest on the restored cache, insert): the altered chunk is refused as it is opened (the prompt
    comes from the bucket instead), so the continuation is computed from the honest prompt and
    what the fleet restores is honest."""
    path, model = llama
    url = s3.url()
    prompt = toks(2 * C + 3, 43)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url, memory_bytes=0) as a:
        mc = a.bind(model, path)
        mc.insert(prompt, prefill(model, prompt))
        assert a.flush(30)
        first = mc.record_hashes(prompt)[0]
    alter_record(tmp_path / "a", first, "0.keys", 1.7)
    longer = prompt + toks(3 * C + 4, 44)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url, memory_bytes=0) as a:
        mc = a.bind(model, path)
        cache, rest = mc.fetch(longer)  # the altered chunk is quarantined; the bucket's copy is honest
        assert a.disk.quarantined == 1 and logits_diff(model, cache, rest, longer) < 1e-4
        cache, rest = mc.fetch(longer)  # (the check ran the model on that cache)
        model(mx.array(rest)[None], cache=cache)
        mx.eval([c.state for c in cache])
        mc.insert(longer, cache)
        assert a.flush(30)
    with kvstore.open(tmp_path / "c", chunk_size=C, remote=url, memory_bytes=0) as c:
        assert fleet_fetch_is_honest(c, model, path, longer) >= 2 * C


def test_a_record_from_before_tags_is_tagged_once_checked_and_a_later_untagged_one_is_refused(tmp_path, s3, llama):
    """A store from before trust tags (its blobs untagged, its rows older than the tags): the
    uploader checks each record whole, tags its blob in place (same tensors, row updated) and
    uploads it. A record written since tags existed that has none (stripped) is refused."""
    path, model = llama
    url = s3.url()
    prompt = toks(3 * C + 5, 45)
    with kvstore.open(tmp_path / "s", chunk_size=C) as s:
        mc = s.bind(model, path)
        mc.insert(prompt, prefill(model, prompt))
        s.flush()
        hashes = mc.record_hashes(prompt)
    root = tmp_path / "s" / "blobs"
    tensors_before = {}
    with LocalStore(tmp_path / "s") as files:
        for h in hashes:  # as a store from before tags wrote them
            buf = blob_path(root, h).read_bytes()
            entries, base, meta = blobformat.parse(buf)
            tensors_before[h] = {n: buf[base + i["data_offsets"][0]: base + i["data_offsets"][1]]
                                 for n, i in entries.items()}
            data = blobformat.restamp(buf, trust.unsigned(meta))
            blob_path(root, h).write_bytes(data)
            files.index.replace_blob(h, len(data), xxhash.xxh3_64_intdigest(data))
        old = hashes[:-1]  # the tail's row stays new: written after tags, untagged
        files.index.conn.execute(f"UPDATE records SET created = 0 WHERE hash IN ({','.join('?' * len(old))})", old)
        health = Health()
        f = fleet()
        anchors = Anchors(trust.Trust.for_fleet([fleet_secret()]), files.index, root)
        uploader = Uploader(Bucket(url), health, f, root, files.index.get, lambda ns: 0, threads=1, anchors=anchors)
        try:
            uploader.submit(sorted(files.index.rows(), key=lambda r: r.depth))
            assert uploader.flush(timeout=60)
        finally:
            uploader.close(timeout=5)
        c = health.counters
        assert (c["uploads"], c["tagged_records"], c["refused_uploads"]) == (len(old), len(old), 1), c
        assert set(record_objects(url)) == names(mc.ns, old)
        for h in old:  # tagged, the same tensors, its row agrees
            buf = blob_path(root, h).read_bytes()
            assert anchors.verdict(buf) is trust.Verdict.GOOD
            entries, base, _ = blobformat.parse(buf)
            assert {n: buf[base + i["data_offsets"][0]: base + i["data_offsets"][1]]
                    for n, i in entries.items()} == tensors_before[h]
        problems = files.verify(trust=anchors.trust)
        assert [(p.kind, p.hash) for p in problems] == [("corrupt_blob", hashes[-1].hex())], problems
        assert "no trust tag of this fleet" in problems[0].detail
