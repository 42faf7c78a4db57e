"""The fleet's keys in the maintenance commands, against a real SeaweedFS: `verify --store` checks
the local blobs' fleet trust tags when the fleet secret is given (without asking the bucket), and
with a key that opens none of the bucket's namespaces `verify --remote` is not clean and `gc
--remote` deletes none of them (neither `--drop-unknown` nor the age rule): they may be the
fleet's under the right key. The fleet's key markers (`keys/<marker>`) keep it so after a node
with the wrong key ran: it uploads nothing, so it never makes a namespace that opens with its key;
a rotation publishes the new key's marker and `--drop-key` deletes the old one's."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from kvtest import alter_record, prefill
from remote_fixture import fleet
from test_remote_ops import REPO, C, cli, records, toks

import kvstore
from kvstore.remote.layout import marker_key
from kvstore.remote.s3 import S3Bucket as Bucket
from kvstore.remote.seal import Fleet, key_id, new_key, parse_key, read_key_file
from kvstore.remote.upkeep import UNKNOWN_MAX_AGE, collect_remote


def key_file(path, secret: str) -> str:
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return str(path)


def test_verify_of_the_store_checks_the_fleet_tags_with_the_fleets_key_and_says_so(tmp_path, s3, llama,
                                                                                     monkeypatch):
    """A writer of the folder scales a chunk's keys and fixes every checksum (its fleet tag kept):
    `kvstore verify --store` with the fleet secret finds it, from the environment or a key file,
    with the endpoint down (the bucket is not asked). Without the secret it can only say that it
    checked the store's own key, and how to check the fleet's."""
    path, model = llama
    url, store = s3.url(), tmp_path / "a"
    prompt = toks(2 * C + 3, 45)
    with kvstore.open(store, chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        mc.insert(prompt, prefill(model, prompt))
        assert a.flush(30)
        first = mc.record_hashes(prompt)[0]
    out = cli("verify", "--store", str(store))
    fleet_words = f"trust tags checked with the fleet's key {fleet().key_id}, from KVSTORE_REMOTE_KEY"
    assert out.returncode == 0 and out.stdout.rstrip().endswith(f"is clean ({fleet_words})"), out.stdout + out.stderr
    alter_record(store, first, "0.keys", 1.7)
    monkeypatch.setenv("KVSTORE_REMOTE", url)
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing answers: the bucket is not asked
    out = cli("verify", "--store", str(store))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "corrupt_blob" in out.stdout and "trust tag does not hold" in out.stdout and fleet_words in out.stdout
    assert json.loads(cli("verify", "--store", str(store), "--json").stdout)["trust"] == fleet_words
    secret = os.environ["KVSTORE_REMOTE_KEY"]
    monkeypatch.delenv("KVSTORE_REMOTE_KEY")
    keys = key_file(tmp_path / "fleet.key", secret)
    out = cli("verify", "--store", str(store), "--remote-key-file", keys)
    assert out.returncode == 1 and f"from the remote key file {keys})" in out.stdout, out.stdout + out.stderr
    assert f"verify --repair --store {store} --remote-key-file {keys}`" in out.stdout  # the repair that can see it
    out = cli("verify", "--store", str(store))  # no secret: the store's own key tells damage only
    assert out.returncode == 0 and "the fleet's are not: give --remote-key-file" in out.stdout, out.stdout
    # A store never opened with a remote holds no fleet tags: its own key, said so, with a secret given.
    with kvstore.open(tmp_path / "alone", chunk_size=C) as b:
        b.bind(model, path).insert(prompt, prefill(model, prompt))
    out = cli("verify", "--store", str(tmp_path / "alone"), "--remote-key-file", keys)
    assert out.returncode == 0 and "never opened with a remote tier" in out.stdout, out.stdout + out.stderr
    # Once it joins the fleet, what it wrote before under its own key is taken on first use, as a
    # node's lookups take it: verify with the fleet's key does not call it damage.
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("KVSTORE_REMOTE_KEY", secret)
    with kvstore.open(tmp_path / "alone", chunk_size=C, remote=url):
        pass
    out = cli("verify", "--store", str(tmp_path / "alone"))
    assert out.returncode == 0 and out.stdout.rstrip().endswith(f"({fleet_words})"), out.stdout + out.stderr


@pytest.fixture
def fleet_bucket(tmp_path, s3, llama):
    """A bucket holding one namespace of the fleet (node A's, 3 records), and a wrong key file."""
    path, model = llama
    url = s3.url()
    prompt = toks(3 * C + 2, 46)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        a.bind(model, path).insert(prompt, prefill(model, prompt))
        assert a.flush(30)
    return url, key_file(tmp_path / "wrong.key", new_key()), records(url)


def test_with_a_key_that_opens_nothing_verify_remote_is_not_clean_and_says_the_mistake(tmp_path, fleet_bucket):
    url, wrong, fleet_records = fleet_bucket
    wrong_id = Fleet.of(read_key_file(wrong)).key_id
    line = (f"holds 1 namespace and none opens with this key: is the remote key file {wrong} the fleet's? "
            f"(this key is {wrong_id};")
    for store in (tmp_path / "none", tmp_path / "a"):  # a node with no store, and the fleet node's store
        out = cli("verify", "--remote", url, "--store", str(store), "--remote-key-file", wrong)
        assert out.returncode == 1, out.stdout + out.stderr
        assert out.stderr.count(line) == 1, out.stderr
        assert "wrong_key" in out.stdout and "clean" not in out.stdout.splitlines()[-1], out.stdout
    found = json.loads(cli("verify", "--remote", url, "--store", str(tmp_path / "none"),
                           "--remote-key-file", wrong, "--json").stdout)
    assert not found["clean"] and [p["kind"] for p in found["problems"]] == ["wrong_key"], found
    out = cli("verify", "--remote", url, "--store", str(tmp_path / "none"))  # the fleet's key: clean
    assert out.returncode == 0 and "wrong_key" not in out.stdout + out.stderr, out.stdout + out.stderr


def test_with_a_key_that_opens_nothing_gc_remote_deletes_no_unknown_namespace(tmp_path, fleet_bucket):
    url, wrong, fleet_records = fleet_bucket
    where = ["--remote", url, "--store", str(tmp_path / "none"), "--remote-key-file", wrong]
    for extra in (["--drop-unknown", "--dry-run"], ["--drop-unknown"]):
        out = cli("gc", *where, *extra)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "none opens with this key" in out.stderr and "would delete 1 namespace" not in out.stdout
        assert "deletes no namespace none of its keys opens" in out.stdout, out.stdout
        assert records(url).keys() == fleet_records.keys()
    out = cli("gc", *where, "--max-age", "7d")
    assert out.returncode == 0 and "none opens with this key" in out.stderr, out.stdout + out.stderr
    # The age rule holds back too: an idle fleet's namespace is 30 days old one day.
    secret = Fleet.of(read_key_file(wrong))
    kept = collect_remote(Bucket(url), secret, now=time.time() + UNKNOWN_MAX_AGE + 60)
    assert kept["dropped_namespaces"] == 0 and kept["no_namespace_opens"] == 1, kept
    assert records(url).keys() == fleet_records.keys()
    # With the fleet's key the same run would delete nothing of it either (it opens), and a truly
    # unknown namespace beside one that opens still goes past the age.
    gone = collect_remote(Bucket(url), fleet(), now=time.time() + UNKNOWN_MAX_AGE + 60)
    assert gone["no_namespace_opens"] == 0 and records(url).keys() == fleet_records.keys()


def objects(url: str) -> set[str]:
    return {p for p, _, _ in Bucket(url).list("")}


def marked(url: str, secret) -> bool:
    """Whether the bucket holds the key marker of `secret`."""
    return Bucket(url).head(marker_key(Fleet(parse_key(secret, "key")).marker_name())) is not None


def test_a_node_with_the_wrong_key_uploads_nothing_so_every_run_is_told_and_gc_deletes_nothing(tmp_path, s3,
                                                                                               demo_model_path):
    """The audit's run: the fleet's node A warms; W, with another key, generates twice and W2 with
    the same key once. Each is told (the line, once a run), none uploads anything (so no
    namespace opens with their key), and W's verify --remote reports wrong_key and its gc
    --remote --drop-unknown deletes nothing: a fleet node still restores A's prompt from the bucket."""
    url = s3.url()
    prompts = tmp_path / "one.jsonl"
    prompts.write_text((REPO / "examples" / "prompts.jsonl").read_text().splitlines()[0] + "\n")
    tiny = ("--model", str(demo_model_path), "--remote", url)
    assert cli("warm", "--store", str(tmp_path / "a"), "--prompts", str(prompts), *tiny).returncode == 0
    before = objects(url)
    assert marked(url, os.environ["KVSTORE_REMOTE_KEY"]) and any("/manifest" in p for p in before)
    wrong = key_file(tmp_path / "wrong.key", new_key())
    for i, store in enumerate(("w", "w", "w2")):  # (a prompt the store lacks: it asks the bucket)
        out = cli("generate", "--store", str(tmp_path / store), *tiny, "--remote-key-file", wrong,
                  "--prompt", f"hello there, a node with the wrong key, run {i}. " * 8, "--max-tokens", "2")
        assert out.returncode == 0, out.stderr
        said = [line for line in out.stderr.splitlines() if "none opens with this key" in line]
        assert len(said) == 1 and "uploads nothing" in said[0] and f"is the remote key file {wrong} the fleet's?" in said[0], \
            out.stderr
        assert objects(url) == before
    with kvstore.open(tmp_path / "w", remote=url, remote_key=read_key_file(wrong)) as w:
        totals = w.stats()["remote"]["totals"]  # every record is counted as such, none for want of a parent
        assert totals["skipped_wrong_key"] >= 2 and totals["skipped_no_parent"] == 0, totals
    where = ["--remote", url, "--store", str(tmp_path / "w"), "--remote-key-file", wrong]
    out = cli("verify", *where)
    assert out.returncode == 1 and "wrong_key" in out.stdout, out.stdout + out.stderr
    out = cli("gc", *where, "--drop-unknown")
    assert out.returncode == 1 and "deletes no namespace" in out.stdout, out.stdout + out.stderr
    assert objects(url) == before
    out = cli("generate", "--store", str(tmp_path / "b"), "--prompts", str(prompts), "--max-tokens", "2", *tiny)
    assert out.returncode == 0 and "none opens" not in out.stderr, out.stderr
    m = re.search(r"prompt: (\d+) tokens, (\d+) reused \((\d+) from the bucket", out.stderr)
    assert m and int(m.group(3)) == int(m.group(1)) - 1, out.stderr


def test_a_fetch_only_session_with_the_wrong_key_leaves_nothing_in_the_bucket(tmp_path, s3, llama):
    """Not even the pins of what it pinned before it had a remote."""
    path, model = llama
    url = s3.url()
    theirs, mine = toks(2 * C + 3, 47), toks(2 * C + 1, 48)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        a.bind(model, path).insert(theirs, prefill(model, theirs))
        assert a.flush(30)
    with kvstore.open(tmp_path / "w", chunk_size=C) as w:
        w.bind(model, path).insert(mine, prefill(model, mine), pin=True)
    before = objects(url)
    with kvstore.open(tmp_path / "w", chunk_size=C, remote=url, remote_key=new_key()) as w:
        mc = w.bind(model, path)
        assert len(theirs) - len(mc.fetch(theirs)[1]) == 0
        assert len(mine) - len(mc.fetch(mine)[1]) == len(mine) - 1
    assert objects(url) == before


def test_a_rotation_keeps_the_fleet_and_drop_key_deletes_the_old_keys_marker(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    old, new = new_key(), new_key()
    first, second, third = toks(2 * C + 3, 49), toks(2 * C + 5, 50), toks(2 * C + 7, 51)

    def store(name, keys, prompt, reused: int) -> dict:
        with kvstore.open(tmp_path / name, chunk_size=C, remote=url, remote_key=keys) as n:
            mc = n.bind(model, path)
            assert len(prompt) - len(mc.fetch(prompt)[1]) == reused
            mc.insert(prompt, prefill(model, prompt))
            assert n.flush(60)
            return n.stats()["remote"]

    assert store("a", old, first, 0)["uploads"] > 0 and marked(url, old) and not marked(url, new)
    r = store("b", [new, old], first, len(first) - 1)  # read with the old key, stored again under the new
    assert r["uploads"] > 0 and r["skipped_wrong_key"] == 0 and marked(url, new) and marked(url, old)
    r = store("c", old, second, 0)  # a node not given the new key yet is still the fleet's
    assert r["uploads"] > 0 and r["skipped_wrong_key"] == 0
    sizes = dict((p, n) for p, n, _ in Bucket(url).list(""))
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, remote_key=[new, old]) as b:
        dropped = b.remote.drop_key(key_id=key_id(parse_key(old, "old")))
        assert dropped["records"] > 0
    assert marked(url, new) and not marked(url, old)
    before = objects(url)
    gone = set(sizes) - before  # the bytes said are every object deleted: manifest and marker too
    assert dropped["objects"] == len(gone) and dropped["bytes"] == sum(sizes[p] for p in gone), (dropped, gone)
    r = store("d", old, third, 0)  # only the dropped key: told, and nothing goes up
    assert r["uploads"] == 0 and r["skipped_wrong_key"] > 0 and r["foreign_namespaces"] == 1
    assert objects(url) == before
    r = store("e", new, first, len(first) - 1)
    assert r["skipped_wrong_key"] == 0 and r["foreign_namespaces"] == 0


def test_a_node_not_given_the_rotated_key_file_drops_nothing_of_the_new_key(tmp_path, s3, llama):
    """During a rotation a node with the old key alone is still the fleet's, but the new key's
    namespace does not open with it: its gc --remote --drop-unknown (or the age rule) deleted
    every record the fleet had written since the rotation. A key marker its keys do not name
    (the new key's) holds them back; a node given the whole key file is not held back."""
    path, model = llama
    url = s3.url()
    old, new = new_key(), new_key()
    prompt = toks(2 * C + 3, 52)
    for name, keys, reused in (("a", old, 0), ("b", [new, old], len(prompt) - 1)):
        with kvstore.open(tmp_path / name, chunk_size=C, remote=url, remote_key=keys) as n:
            mc = n.bind(model, path)
            assert len(prompt) - len(mc.fetch(prompt)[1]) == reused
            mc.insert(prompt, prefill(model, prompt))
            assert n.flush(60)
    assert marked(url, new) and marked(url, old)
    before = objects(url)
    stale = Fleet(parse_key(old, "old"))
    for now in (None, time.time() + UNKNOWN_MAX_AGE + 60):
        kept = collect_remote(Bucket(url), stale, drop_unknown=True, now=now)
        assert kept["unknown_namespaces"] == 1 and kept["dropped_namespaces"] == 0, kept
        assert kept["other_key_markers"] == 1 and not kept["wrong_key"], kept
    assert objects(url) == before
    old_file = key_file(tmp_path / "old.key", old)
    where = ["--remote", url, "--store", str(tmp_path / "none"), "--remote-key-file", old_file]
    out = cli("gc", *where, "--drop-unknown")
    assert out.returncode == 1 and "1 key marker of a key this node does not hold" in out.stdout, out.stdout
    assert "deletes no namespace none of its keys opens" in out.stdout and objects(url) == before
    out = cli("verify", *where)
    assert out.returncode == 0 and "neither with --drop-unknown nor by its age while the bucket holds 1 key " \
        "marker" in out.stdout, out.stdout
    both = Fleet.of([parse_key(new, "new"), parse_key(old, "old")])
    done = collect_remote(Bucket(url), both, drop_unknown=True, dry_run=True)
    assert done["unknown_namespaces"] == 0 and done["other_key_markers"] == 0, done


def test_a_node_left_running_through_a_rotation_stops_uploading_once_its_key_is_dropped(tmp_path, s3, llama,
                                                                                          monkeypatch):
    """A node opened with the old key alone, and not restarted when the rotation ended: it asked
    once whether its key was the fleet's and went on uploading under it, so right after `--drop-key`
    the bucket again held objects only the dropped (perhaps leaked) key opens, and nothing said so.
    It now asks again (a HEAD of its marker) once `RECHECK_S` passed: it finds the marker gone, says
    its key is not the fleet's, and uploads nothing more; the other nodes keep uploading."""
    from kvstore.remote.health import KeyCheck

    monkeypatch.setattr(KeyCheck, "RECHECK_S", 0.0)  # (a minute in production: every judgement asks here)
    path, model = llama
    url = s3.url()
    old, new = new_key(), new_key()
    first, second, third = toks(2 * C + 3, 53), toks(2 * C + 5, 54), toks(2 * C + 7, 55)
    with kvstore.open(tmp_path / "stale", chunk_size=C, remote=url, remote_key=old) as stale:
        smc = stale.bind(model, path)
        smc.insert(first, prefill(model, first))
        assert stale.flush(60) and stale.stats()["remote"]["uploads"] > 0 and marked(url, old)
        with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, remote_key=[new, old]) as b:
            mc = b.bind(model, path)
            assert len(first) - len(mc.fetch(first)[1]) == len(first) - 1  # read with the old key
            mc.insert(first, prefill(model, first))
            assert b.flush(60) and marked(url, new)
            assert b.remote.drop_key(key_id=key_id(parse_key(old, "old")))["records"] > 0
        assert not marked(url, old)
        before = objects(url)
        smc.insert(second, prefill(model, second))
        assert stale.flush(60)
        r = stale.stats()["remote"]
        assert r["skipped_wrong_key"] > 0, r
        assert objects(url) == before  # nothing more only the dropped key opens
    with kvstore.open(tmp_path / "c", chunk_size=C, remote=url, remote_key=new) as c:
        mc = c.bind(model, path)
        mc.insert(third, prefill(model, third))
        assert c.flush(60) and c.stats()["remote"]["uploads"] > 0 and c.stats()["remote"]["skipped_wrong_key"] == 0


def test_a_node_whose_first_records_hang_below_its_own_is_told_its_key_is_wrong(tmp_path, s3, llama, caplog):
    """The audit's node B: it joined with the fleet's key, then runs with a wrong one and stores a
    prompt that continues one it holds. Its fetch asks the bucket only for the tail (it holds the
    chunks), so only the upload can find the key wrong: said once, and its records counted as
    skipped for the key, not "for want of their parent in the bucket"."""
    path, model = llama
    url = s3.url()
    prompt = toks(2 * C + 3, 52)
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url) as b:
        b.bind(model, path).insert(prompt, prefill(model, prompt))
        assert b.flush(30)
    longer = prompt + toks(C + 2, 53)
    with caplog.at_level("WARNING", logger="kvstore"):
        with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, remote_key=new_key()) as b:
            mc = b.bind(model, path)
            mc.insert(longer, prefill(model, longer))
            b.flush(30)
            r = b.stats()["remote"]
    said = [m for m in caplog.messages if "is kept by another fleet key" in m]
    assert len(said) == 1 and "uploads nothing" in said[0], caplog.messages
    assert r["skipped_no_parent"] == 0 and r["skipped_wrong_key"] >= 1 and r["uploads"] == 0, r
