"""Operating a shared bucket: gc --remote, verify --remote, the CLI flags, and two servers."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests
from kvtest import logits_diff, prefill, run_cli
from remote_fixture import BUCKET, fleet, names

import kvstore
from kvstore.remote.layout import parse_key
from kvstore.remote.s3 import S3Bucket as Bucket

C = 16
REPO = Path(__file__).resolve().parents[1]


def toks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 250, n).tolist()


def records(url: str) -> dict:
    return {k.hash: k for k in (parse_key(p, s, t) for p, s, t in Bucket(url).list("")) if k is not None}


def assert_whole(objs: dict) -> None:
    """Every record's parent is in the bucket (or is its namespace)."""
    for k in objs.values():
        assert k.parent == k.ns or k.parent in objs, f"{k.path} lost its parent"


def cli(*args, env=None) -> subprocess.CompletedProcess:
    """`kvstore ARGS...` in this process (`kvtest.run_cli`), with `env` added to the environment
    for the command's length."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        return run_cli(*args, check=False)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_gc_remote_keeps_pins_and_never_orphans(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    shared = toks(2 * C, 30)
    pinned = shared + toks(2 * C + 5, 31)
    others = [shared + toks(3 * C + i + 1, 32 + i) for i in range(3)]
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        mc.insert(pinned, prefill(model, pinned), pin=True)
        for p in others:
            mc.insert(p, prefill(model, p))
        assert a.flush(30)
        before = records(url)
        assert len(before) == 4 + 1 + 3 * 4
        # Pins reached the bucket when the pinned records were uploaded.
        assert any("/pins/" in p for p, _, _ in Bucket(url).list(""))
        # A dry run deletes nothing; deepest first with a byte budget keeps the tree whole.
        total = sum(k.size for k in before.values())
        dry = a.remote.gc(max_bytes=total // 2, dry_run=True)
        assert dry["evicted"] > 0 and records(url).keys() == before.keys()
        half = a.remote.gc(max_bytes=total // 2)
        assert half["bytes"] <= total // 2 and half["evicted"] == dry["evicted"]
        after = records(url)
        assert_whole(after)
        # Everything: only the pinned prompt (and its ancestors) stays.
        a.remote.gc(max_bytes=0)
        left = records(url)
        assert_whole(left)
        want = names(mc.ns, mc.record_hashes(np.asarray(pinned)))
        assert set(left) == want
    # Another node still restores the pinned prompt from the bucket.
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0) as b:
        mc = b.bind(model, path)
        cache, rest = mc.fetch(pinned + [5])
        assert len(rest) == 1 and logits_diff(model, cache, rest, pinned + [5]) < 1e-4


@pytest.mark.parametrize("sibling", [
    "team2",  # a string extension of the prefix gc runs on
    "team/sub",  # a nested prefix: another team's, though it is under this prefix
])
def test_gc_remote_leaves_every_object_of_another_prefix(tmp_path, s3, llama, sibling):
    """Two prefixes of one bucket: each node's objects are under its own prefix, and `gc --remote`
    on one (everything evicted) deletes none of the other's."""
    path, model = llama
    base = uuid.uuid4().hex[:12]
    mine, other = f"{base}/team", f"{base}/{sibling}"
    prompt = toks(2 * C + 5, 42)
    for name, prefix in (("mine", mine), ("other", other)):
        with kvstore.open(tmp_path / name, chunk_size=C, remote=s3.url(prefix)) as node:
            mc = node.bind(model, path)
            mc.insert(prompt, prefill(model, prompt))
            assert node.flush(30)
    whole = Bucket(f"s3://{BUCKET}")  # the bucket with no prefix: keys as they are stored

    def under(prefix: str, but: str | None = None) -> set[str]:
        return {p for p, _, _ in whole.list(prefix + "/") if but is None or not p.startswith(but + "/")}

    want = {h.hex() for h in names(mc.ns, mc.record_hashes(prompt))}
    nested = other if other.startswith(mine + "/") else None
    for prefix, skip in ((mine, nested), (other, None)):  # each node's records under its own prefix
        assert {parse_key(p[len(prefix) + 1:]).hash.hex() for p in under(prefix, skip)
                if parse_key(p[len(prefix) + 1:])} == want, prefix
    kept = under(other)
    out = cli("gc", "--store", str(tmp_path / "mine"), "--remote", s3.url(mine), "--max-bytes", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert under(other) == kept
    assert not any(parse_key(p[len(mine) + 1:]) for p in under(mine, nested))  # and gc did delete mine
    out = cli("verify", "--store", str(tmp_path / "mine"), "--remote", s3.url(mine), "--repair")
    assert out.returncode == 0 and under(other) == kept, out.stdout + out.stderr  # nor does verify touch it


def test_gc_remote_by_age_keeps_a_parent_whose_child_is_young(tmp_path, s3, llama):
    from kvstore.remote.upkeep import collect_remote

    path, model = llama
    url = s3.url()
    old = toks(3 * C, 40)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        mc.insert(old, prefill(model, old))
        a.flush(30)
        stamp = time.time()
        time.sleep(1.1)
        young = old + toks(C + 3, 41)
        mc.insert(young, prefill(model, young))
        a.flush(30)
    objs = records(url)
    age = time.time() - stamp
    result = collect_remote(Bucket(url), fleet(), max_age=age)  # everything older than `stamp`
    assert result["evicted"] == 0  # the old chunks are ancestors of the young ones
    result = collect_remote(Bucket(url), fleet(), max_age=0.0, now=time.time() + 1)
    assert result["evicted"] == len(objs) and records(url) == {}


def test_gc_remote_takes_orphans_first_and_a_cycle_of_parents_never_hangs(s3):
    """Anyone may write keys under the prefix: a cycle of parents ends every walk (gc and
    verify return), and a record whose parent is gone goes before any reachable one."""
    from kvstore.records import CHUNK, RecordId
    from kvstore.remote.layout import key_of
    from kvstore.remote.upkeep import collect_remote, verify_remote

    url = s3.url()
    bucket = Bucket(url)
    ns, a, b, root, orphan, gone = (bytes([i]) * 16 for i in range(1, 7))
    s = fleet().sealer(ns)
    for parent, h in ((b, a), (a, b), (ns, root), (gone, orphan)):
        bucket.put(key_of(s, RecordId(h, ns, parent, None, CHUNK, 4, 1), np.arange(1, 5)), b"x" * 10)
    (orphan_name,), (root_name,) = names(ns, [orphan]), names(ns, [root])
    # (A namespace of this node's: one no key opens is not gc's to judge, below.)
    result = collect_remote(bucket, fleet(), [ns], max_bytes=30)  # a cycle is orphans: they go, as the orphan does
    assert result["evicted"] == 3 and set(records(url)) == {root_name} and orphan_name != root_name
    collect_remote(bucket, fleet(), [ns], max_age=0.0, now=time.time() + 1)
    assert root_name not in records(url)
    for parent, h in ((b, a), (a, b)):  # the cycle again: verify returns, and repair deletes it
        bucket.put(key_of(s, RecordId(h, ns, parent, None, CHUNK, 4, 1), np.arange(1, 5)), b"x" * 10)
    unknown = verify_remote(bucket, fleet())  # no manifest, not this node's: not judged, a note
    # (no wrong_key: the bucket holds the fleet key's marker, published by the gc above)
    assert [p.kind for p in unknown] == [] and [n.kind for n in unknown.notes] == ["unknown_namespace"]
    problems = verify_remote(bucket, fleet(), [ns], repair=True)
    assert {p.kind for p in problems} == {"unauthenticated_object", "orphan_object"} and records(url) == {}


def uploaded(store, url: str, llama, prompt: list[int]) -> list[int]:
    """`prompt` stored by a node at `store` sharing the bucket `url`, its uploads done; returns it."""
    path, model = llama
    with kvstore.open(store, chunk_size=C, remote=url) as node:
        node.bind(model, path).insert(prompt, prefill(model, prompt))
        assert node.flush(30)
    return prompt


def test_verify_remote_finds_and_repairs_damaged_objects(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    prompt = toks(4 * C + 3, 50)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        a.bind(model, path).insert(prompt, prefill(model, prompt))
        a.flush(30)
        assert a.remote.verify() == []
    objs = sorted(records(url).values(), key=lambda k: k.path)
    bucket = Bucket(url)
    chain = [k for k in objs if k.kind == 0]
    depth2 = next(k for k in chain if k.parent in {c.hash for c in chain} and
                  next(c for c in chain if c.hash == k.parent).parent == k.ns)
    data = bucket.get(depth2.path)
    bucket.put(depth2.path, data[:-7])  # truncated
    out = cli("verify", "--store", str(tmp_path / "v"), "--remote", url, "--json")
    assert out.returncode == 1, out.stderr
    problems = json.loads(out.stdout)["problems"]
    assert [p["path"] for p in problems] == [depth2.path]
    out = cli("verify", "--store", str(tmp_path / "v"), "--remote", url, "--repair")
    assert out.returncode == 1 and "repaired" in out.stdout
    left = records(url)
    assert_whole(left)
    assert len(left) == 1  # the root chunk; everything below the damaged one went with it
    out = cli("verify", "--store", str(tmp_path / "v"), "--remote", url)
    assert out.returncode == 0 and "clean" in out.stdout, out.stdout + out.stderr


def test_verify_remote_reports_a_deleted_record_as_one_orphan_not_its_healthy_records_as_corrupt(
        tmp_path, s3, llama):
    """A chunk deleted behind the fleet's back: the chunk below it is an orphan, and what hangs
    below that is intact (its depth is not known from the tree): one problem, no `corrupt_object`
    with a made-up depth; the repair deletes the orphan and all below it."""
    url = s3.url()
    uploaded(tmp_path / "a", url, llama, toks(4 * C + 3, 51))
    objs = records(url)
    by_depth, h = [], next(k.hash for k in objs.values() if k.parent == k.ns)
    while h is not None:  # the chain, root first, then the tail
        by_depth.append(objs[h])
        h = next((k.hash for k in objs.values() if k.parent == h), None)
    assert len(by_depth) == 5
    Bucket(url).delete([by_depth[1].path])
    out = cli("verify", "--store", str(tmp_path / "v"), "--remote", url, "--json")
    assert out.returncode == 1, out.stderr
    problems = json.loads(out.stdout)["problems"]
    assert [(p["kind"], p["path"]) for p in problems] == [("orphan_object", by_depth[2].path)], problems
    out = cli("verify", "--store", str(tmp_path / "v"), "--remote", url, "--repair")
    assert "1 problem found; repaired 1 (deleted 3 objects" in out.stdout, out.stdout
    assert set(records(url)) == {by_depth[0].hash}


def test_objects_verify_leaves_alone_are_notes_and_the_repair_line_counts_what_it_did(tmp_path, s3, llama):
    """Objects in a namespace folder whose names are not of the layout (here a marks field too
    short for a 20-token tail) are not kvstore's to delete: `--repair` leaves them, so they are
    notes, not problems. The bucket verifies clean with them there, the hint promises nothing of
    them, and the repair line counts what was repaired and what was left."""
    from kvstore.records import TAIL

    url = s3.url()
    uploaded(tmp_path / "a", url, llama, toks(3 * C + 3, 51))
    bucket = Bucket(url)
    leaf = next(k for k in records(url).values() if k.kind == TAIL)  # nothing hangs below it
    bucket.put(leaf.path, bucket.get(leaf.path)[:-7])  # truncated: kvstore's own, damaged
    folder, parent = leaf.ns.hex(), os.urandom(16).hex()
    planted = sorted(f"{folder}/{parent[:2]}/{parent}/{os.urandom(8).hex()}/{os.urandom(16).hex()}.tail.20."
                     f"{os.urandom(10).hex()}" for _ in range(5))
    for key in planted:
        bucket.put(key, b"x" * 100)
    assert not any(parse_key(key) for key in planted)
    args = ("verify", "--store", str(tmp_path / "v"), "--remote", url)

    found = json.loads(cli(*args, "--json").stdout)
    assert [p["path"] for p in found["problems"]] == [leaf.path] and not found["clean"], found
    assert [(n["kind"], n["path"]) for n in found["notes"]] == [("foreign_object", key) for key in planted], found
    out = cli(*args)
    assert out.returncode == 1, out.stdout + out.stderr
    last = out.stdout.splitlines()[-1]
    assert "1 problem found; run `" in last and "--repair` to delete it; 5 notes" in last, last
    assert all(f"note: foreign_object: {key}" in out.stdout for key in planted), out.stdout
    assert all(line.startswith("note: ") for line in out.stdout.splitlines() if "foreign_object" in line)

    out = cli(*args, "--repair")
    assert out.returncode == 1, out.stdout + out.stderr  # a problem was found (and repaired)
    last = out.stdout.splitlines()[-1]
    assert "1 problem found; repaired 1 (deleted 1 object" in last and "left 0" not in last, last
    assert "5 notes" in last, last
    assert bucket.head(leaf.path) is None and all(bucket.head(key) == 100 for key in planted)

    out = cli(*args)  # every later run: clean, the planted objects listed as notes
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.splitlines()[-1]
    assert last.startswith(f"remote {url}: clean") and "5 notes" in last and "--repair" not in out.stdout, out.stdout
    found = json.loads(cli(*args, "--json").stdout)
    assert found["clean"] and found["problems"] == [] and len(found["notes"]) == 5, found


def test_cli_remote_flag_and_env(tmp_path, s3, demo_model_path):
    url = s3.url()
    store = tmp_path / "s"
    tiny = ("--model", str(demo_model_path))  # what is computed is not the point: the tiny model
    out = cli("warm", "--store", str(store), "--prompts", str(REPO / "examples" / "prompts.jsonl"), *tiny,
              env={"KVSTORE_REMOTE": url})
    assert out.returncode == 0, out.stderr
    assert len(records(url)) > 0
    out = cli("stats", "--store", str(store), "--remote", url)
    assert out.returncode == 0 and f"remote: {url}" in out.stdout, out.stdout + out.stderr
    stats = json.loads(cli("stats", "--store", str(store), "--json", env={"KVSTORE_REMOTE": url}).stdout)
    assert stats["remote"]["totals"]["uploads"] == len(records(url))
    out = cli("gc", "--store", str(store), "--remote", "--max-bytes", "0", "--dry-run", env={"KVSTORE_REMOTE": url})
    assert out.returncode == 0 and "would delete" in out.stdout, out.stdout + out.stderr
    out = cli("gc", "--store", str(store), "--remote", "--max-bytes", "0", env={"KVSTORE_REMOTE": ""})
    assert out.returncode == 2 and "--remote needs a URL" in out.stderr
    out = cli("stats", "--store", str(store), "--remote", "http://not-s3")
    assert out.returncode == 2 and "s3://BUCKET/PREFIX" in out.stderr
    # A second node (fresh folder) warms the same prompts from the bucket: only the last token
    # of each prompt is computed (a fetch always leaves one), nothing new is written.
    out = cli("warm", "--store", str(tmp_path / "s2"), "--prompts", str(REPO / "examples" / "prompts.jsonl"),
              *tiny, "--remote", url)
    assert out.returncode == 0, out.stderr
    assert "tokens computed: 7\n" in out.stdout and "bytes written: 0 " in out.stdout, out.stdout
    # Secrets never reach the output or the store.
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    assert secret not in out.stdout + out.stderr
    for f in (tmp_path / "s2").rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes()


def test_refused_credentials_are_one_clear_line(tmp_path, s3, demo_model_path):
    """A wrong secret: one line that says the bucket refused the credentials, not a line per
    failed request; gc --remote, which cannot go on without the bucket, fails with it."""
    url = s3.url()
    wrong = {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    out = cli("warm", "--store", str(tmp_path / "s"), "--prompts", str(REPO / "examples" / "prompts.jsonl"),
              "--model", str(demo_model_path), "--remote", url, env=wrong)
    refused = [line for line in out.stderr.splitlines() if "refused the credentials" in line]
    assert len(refused) == 1 and url in refused[0], out.stderr
    assert "PermissionDenied" not in out.stderr and "remote tier: RemoteError" not in out.stderr, out.stderr
    out = cli("gc", "--store", str(tmp_path / "s"), "--remote", url, "--max-age", "7d", env=wrong)
    assert out.returncode == 1 and out.stderr.count("refused the credentials") == 1, out.stderr
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in out.stderr


def test_without_an_endpoint_it_says_requests_go_to_aws(tmp_path):
    kvstore.open(tmp_path / "s").close()
    unset = {"AWS_ENDPOINT_URL": "", "AWS_ENDPOINT_URL_S3": "", "HOME": str(tmp_path)}
    out = cli("stats", "--store", str(tmp_path / "s"), "--remote", "s3://kvcache/team", env=unset)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("AWS_ENDPOINT_URL is not set") == 1 and "requests go to AWS S3" in out.stderr


def test_uploads_skipped_while_the_endpoint_is_down_are_said_and_shown(tmp_path, s3, demo_model_path):
    """With the endpoint down, every upload is skipped (the remote is left alone after the first
    failure): `warm` ends by saying how many records will not reach the bucket, and `stats`
    shows the skipped uploads beside the dropped ones."""
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    prompts = tmp_path / "one.jsonl"
    prompts.write_text((REPO / "examples" / "prompts.jsonl").read_text().splitlines()[0] + "\n")
    store, url = tmp_path / "s", s3.url()
    out = cli("warm", "--store", str(store), "--prompts", str(prompts), "--model", str(demo_model_path),
              "--remote", url, env={"AWS_ENDPOINT_URL": closed})
    assert out.returncode == 0 and "cannot reach the object store" in out.stderr, out.stdout + out.stderr
    t = json.loads(cli("stats", "--store", str(store), "--remote", url, "--json").stdout)["remote"]["totals"]
    undone = t["skipped_down_uploads"] + t["skipped_no_parent"] + t["upload_errors"]
    assert t["uploads"] == 0 and t["skipped_down_uploads"] > 0 and undone > 1, t
    line = next((s for s in out.stdout.splitlines() if "uploads not done" in s), None)
    assert line is not None and line.startswith(f"remote: {undone} uploads not done ("), out.stdout
    assert f"{t['skipped_down_uploads']} skipped while the remote failed (said above)" in line, line
    assert "no later process uploads them" in line, line
    text = cli("stats", "--store", str(store), "--remote", url).stdout
    assert (f"skipped uploads: {t['skipped_down_uploads']} (remote down) / {t['skipped_no_parent']} (no parent)"
            in text), text


def test_the_wrong_key_line_names_where_the_key_came_from(tmp_path, s3, demo_model_path):
    """A node whose key opens none of the bucket's namespaces is told to check the key it was
    given: the key file when it came from --remote-key-file, the environment variable otherwise."""
    from kvstore.remote.seal import new_key

    url = s3.url()
    prompts = tmp_path / "one.jsonl"
    lines = (REPO / "examples" / "prompts.jsonl").read_text().splitlines()
    prompts.write_text(lines[0] + "\n")
    tiny = ("--model", str(demo_model_path), "--remote", url)
    assert cli("warm", "--store", str(tmp_path / "a"), "--prompts", str(prompts), *tiny).returncode == 0
    prompts.write_text(lines[1] + "\n")  # another prompt: nothing of it is in the bucket
    key_file = tmp_path / "wrong.key"
    key_file.write_text(new_key() + "\n")
    key_file.chmod(0o644)
    out = cli("warm", "--store", str(tmp_path / "b"), "--prompts", str(prompts), *tiny, "--remote-key-file",
              str(key_file))
    said = [line for line in out.stderr.splitlines() if "none opens with this key" in line]
    assert len(said) == 1 and f"is the remote key file {key_file} the fleet's?" in said[0], out.stderr
    assert "KVSTORE_REMOTE_KEY" not in said[0], said
    # (mode 644: others may read it, which is said once, with the fix)
    mode = [line for line in out.stderr.splitlines() if "can be read by other users" in line]
    assert len(mode) == 1 and f"`chmod 600 {key_file}`" in mode[0], out.stderr
    key_file.chmod(0o600)
    out = cli("warm", "--store", str(tmp_path / "b"), "--prompts", str(prompts), *tiny, "--remote-key-file",
              str(key_file))
    assert "can be read by other users" not in out.stderr
    out = cli("warm", "--store", str(tmp_path / "c"), "--prompts", str(prompts), *tiny,
              env={"KVSTORE_REMOTE_KEY": new_key()})
    said = [line for line in out.stderr.splitlines() if "none opens with this key" in line]
    assert len(said) == 1 and "none opens with this key: is KVSTORE_REMOTE_KEY the fleet's?" in said[0] and str(key_file) not in said[0], out.stderr


def test_generate_says_what_came_from_the_bucket(tmp_path, s3, demo_model_path):
    url = s3.url()
    prompts = tmp_path / "one.jsonl"
    prompts.write_text((REPO / "examples" / "prompts.jsonl").read_text().splitlines()[0] + "\n")
    tiny = ("--model", str(demo_model_path))
    out = cli("warm", "--store", str(tmp_path / "a"), "--prompts", str(prompts), *tiny, "--remote", url)
    assert out.returncode == 0, out.stderr
    out = cli("generate", "--store", str(tmp_path / "b"), "--prompts", str(prompts), "--max-tokens", "2", *tiny,
              "--remote", url)
    assert out.returncode == 0, out.stderr
    m = re.search(r"prompt: (\d+) tokens, (\d+) reused \((\d+) from the bucket (s3://[^,]+), 0 from the local "
                  r"store\)", out.stderr)
    assert m and m.group(4) == url and int(m.group(2)) == int(m.group(3)) == int(m.group(1)) - 1, out.stderr


def test_warm_says_what_came_from_the_bucket_and_that_downloads_go_to_disk(tmp_path, s3, demo_model_path):
    """A second node warming what the first uploaded says each prompt came from the bucket, and
    counts the downloads still being stored locally as queued for disk, not as never written."""
    url = s3.url()
    prompts = REPO / "examples" / "prompts.jsonl"
    tiny = ("--model", str(demo_model_path), "--remote", url)
    out = cli("warm", "--store", str(tmp_path / "a"), "--prompts", str(prompts), *tiny)
    assert out.returncode == 0, out.stderr
    # The first node says what it uploaded (every record the bucket holds), the second what it
    # downloaded: its "bytes written: 0" is this disk's writer, not what the warm moved.
    held = len(records(url))
    assert held > 0 and f"bucket {url}: uploaded {held} records (" in out.stdout, out.stdout
    assert "; downloaded 0 records (0 B, not in the bytes written)" in out.stdout, out.stdout
    out = cli("warm", "--store", str(tmp_path / "b"), "--prompts", str(prompts), *tiny)
    assert out.returncode == 0, out.stderr
    m = re.search(rf"bucket {re.escape(url)}: uploaded 0 records \(0 B\); downloaded (\d+) records \(", out.stdout)
    assert m and int(m.group(1)) == held and "bytes written: 0 " in out.stdout, out.stdout
    day = cli("stats", "--store", str(tmp_path / "b")).stdout.splitlines()
    assert any(re.search(r"  0 records \+ \S+ \S+ downloaded, ", line) for line in day), day
    lines = [line for line in out.stderr.splitlines() if line.startswith("[")]
    got = [re.search(r", (\d+) reused \((\d+) from the bucket\), ", line) for line in lines]
    assert len(lines) == 7 and all(m and 0 < int(m.group(2)) <= int(m.group(1)) for m in got), out.stderr
    assert "in RAM only" not in out.stderr and "not written" not in out.stderr, out.stderr
    m = re.search(r"tokens reused: (\d+) \((\d+) from the bucket (s3://\S+), (\d+) from the local store\)", out.stdout)
    assert m and m.group(3) == url and int(m.group(1)) == int(m.group(2)) + int(m.group(4)), out.stdout
    assert int(m.group(2)) == sum(int(g.group(2)) for g in got), out.stdout
    assert "on disk: 7 of 7 warmed prompts whole" in out.stdout, out.stdout


# -- two servers, one bucket ---------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: Path, store: Path, log: Path, url: str):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--model", str(model), "--store", str(store),
                             "--port", str(port), "--remote", url], stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 90
    while time.monotonic() < end:
        assert proc.poll() is None, log.read_text()
        try:
            if requests.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except requests.RequestException:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server not ready:\n{log.read_text()}")


def _ask(base: str, prompt: str) -> tuple[str, dict]:
    r = requests.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0.0},
                      timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]


def test_two_servers_share_one_bucket(tmp_path, s3, demo_model):
    model = demo_model("llama")
    url = s3.url()
    prompt = "You are a terse assistant, answering in one sentence. " * 8 + "What is a prompt cache?"
    procs = []
    try:
        a, base_a = _serve(model, tmp_path / "a", tmp_path / "a.log", url)
        procs.append(a)
        b, base_b = _serve(model, tmp_path / "b", tmp_path / "b.log", url)
        procs.append(b)
        text_a, usage_a = _ask(base_a, prompt)
        assert usage_a["prompt_tokens_details"]["cached_tokens"] == 0
        n = usage_a["prompt_tokens"]
        end = time.monotonic() + 30  # A uploads in the background, soon after the response
        while time.monotonic() < end:
            if sum(k.ntokens for k in records(url).values()) >= n - 1:
                break
            time.sleep(0.2)
        text_b, usage_b = _ask(base_b, prompt)
        assert usage_b["prompt_tokens_details"]["cached_tokens"] >= n - 1, (usage_b, (tmp_path / "b.log").read_text())
        assert text_b == text_a
        assert f"remote tier {url} (read through, written behind" in (tmp_path / "b.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


def test_pins_made_on_another_node_are_kept(tmp_path, s3, llama):
    """Node B pins a prompt it got from the bucket (no upload of its own): its pins object is
    published when it closes, and gc run on node A keeps that prompt."""
    path, model = llama
    url = s3.url()
    prompt, other = toks(3 * C + 4, 80), toks(2 * C + 2, 81)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        for p in (prompt, other):
            mc.insert(p, prefill(model, p))
        a.flush(30)
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url) as b:
        mc = b.bind(model, path)
        mc.prefill(prompt, pin=True)
        assert b.stats()["remote"]["remote_hits"] == 1 and b.stats()["remote"]["uploads"] == 0
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        result = a.remote.gc(max_bytes=0)
        assert result["kept_pinned"] == 4
    left = records(url)
    assert_whole(left)
    with kvstore.open(tmp_path / "c", chunk_size=C) as c:
        mc = c.bind(model, path)
        assert set(left) == names(mc.ns, mc.record_hashes(np.asarray(prompt)))


def test_tokens_from_the_bucket_count_what_was_used_of_a_record(tmp_path, s3, llama):
    """A prompt that shares part of a stored tail: the restore uses part of the downloaded tail,
    and the count of tokens from the bucket (what the reports say) is what was used, not the
    whole record."""
    path, model = llama
    url = s3.url()
    stored = toks(2 * C + 10, 40)
    asked = stored[: 2 * C + 6] + [7, 8, 9]  # 6 of the tail's 10 tokens, then others
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        a.bind(model, path).insert(stored, prefill(model, stored))
        a.flush(30)
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, remote_prefetch="wait_complete") as b:
        _, rest = b.bind(model, path).fetch(asked)
        assert len(asked) - len(rest) == 2 * C + 6
        assert b.stats()["remote"]["remote_tokens"] == 2 * C + 6


def test_uploads_that_find_the_record_there_are_shown_with_their_bytes(tmp_path, s3, llama):
    """Two nodes store the same prompt (B never reads the bucket): B's create-only PUTs find A's
    objects and read them back to check them. That traffic is counted and `stats` shows it."""
    path, model = llama
    url = s3.url()
    prompt = toks(2 * C + 5, 90)
    for node, options in (("a", {}), ("b", {"remote_deadline": 0})):
        with kvstore.open(tmp_path / node, chunk_size=C, remote=url, **options) as n:
            n.bind(model, path).insert(prompt, prefill(model, prompt))
            assert n.flush(30)
            r = n.stats()["remote"]
    assert (r["uploads"], r["already_there"], r["downloads"]) == (0, 3, 0), r
    assert r["already_there_bytes"] > 2 * C * 1000, r
    out = cli("stats", "--store", str(tmp_path / "b"), "--remote", url).stdout
    assert "uploads: 0 (0 B; 3 already there: " in out and "sent, and read back to check)" in out, out
