"""What the remote tier downloads and how long a fetch waits for it, on a real SeaweedFS.

A node downloads only what no tier of its machine holds (the node that uploaded everything
downloads nothing); children are compared by what their keys say before any body is fetched; a
children folder flooded with keys costs one bounded listing; the prefetch policies (`timeout`,
`best_effort`, `wait_complete`) keep to their waits; a key that failed is asked for again once
its time is up; the local disk is asked before the bucket whatever the memory tier holds; and
the mistakes a user makes (a wrong fleet secret, a bucket that does not exist) are said once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from kvtest import logits_diff, prefill

import kvstore
from kvstore.records import prompt_records
from kvstore.remote.downloads import BAD_FOR_S
from kvstore.remote.layout import children_prefix, key_of
from kvstore.remote.s3 import S3Bucket as Bucket
from kvstore.remote.seal import new_key
from kvstore.tiers.remote import LIST_LIMIT, PREFETCH_BASE_S, PREFETCH_PER_1K_S, RemoteTier

C = 16
REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("s3")


def toks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 250, n).tolist()


def reused(mc, model, query) -> int:
    cache, rest = mc.fetch(query)
    n = len(query) - len(rest)
    if n:
        assert logits_diff(model, cache, rest, query) < 1e-4
    return n


@contextlib.contextmanager
def slow_endpoint(s3, monkeypatch, seconds: float):
    """The bucket behind a proxy that answers downloads one at a time, `seconds` each, and holds
    every upload (`remote_fixture.StallingProxy`), for the stores opened within."""
    from remote_fixture import StallingProxy

    proxy = StallingProxy(s3.endpoint, slow_gets=seconds)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        yield proxy
    finally:
        proxy.close()


def remote_tier(store) -> RemoteTier:
    return next(t for t in store.tiers if isinstance(t, RemoteTier))


def namespace(tmp_path, model, path) -> bytes:
    """The namespace the tests' model is stored under (chunk size C)."""
    with kvstore.open(tmp_path / "probe", chunk_size=C) as probe:
        return probe.bind(model, path).ns


def store_all(directory, url, model, path, prompts, **kw) -> None:
    with kvstore.open(directory, chunk_size=C, remote=url, **kw) as a:
        mc = a.bind(model, path)
        for p in prompts:
            mc.insert(p, prefill(model, p))
        assert a.flush(60)
        assert a.stats()["remote"]["errors"] == 0


def test_the_uploading_node_downloads_nothing_and_another_only_what_it_lacks(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    system = toks(3 * C + 5, 1)
    convs = [system + toks(C + 3 + i, 10 + i) for i in range(6)]
    store_all(tmp_path / "a", url, model, path, convs)
    # Node A, opened again (nothing in RAM), asks for its own prompts and for new conversations
    # over the same system prompt: every child the bucket lists under it is one A holds.
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        for p in convs:
            assert reused(mc, model, p + [7]) == len(p)
        for i in range(4):
            assert reused(mc, model, system + toks(2 * C, 50 + i)) == len(system)
        r = a.stats()["remote"]
        assert r["downloads"] == 0 and r["download_bytes"] == 0 and r["lists"] >= 4, r
    # Node B holds the system prompt of its own: it downloads conversation 0's chunk and tail,
    # nothing of what it holds, and uses all it downloads.
    store_all(tmp_path / "b", url, model, path, [system])
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url) as b:
        mc = b.bind(model, path)
        assert reused(mc, model, convs[0] + [7]) == len(convs[0])
        r = b.stats()["remote"]
        assert r["downloads"] == 2 and r["downloads_used"] == 2 and r["remote_hits"] == 1, r


def test_a_child_is_downloaded_only_when_its_key_says_it_is_worth_it(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    stored = toks(2 * C + C - 1, 2)  # two chunks and a tail of 15 tokens
    store_all(tmp_path / "a", url, model, path, [stored])
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0) as b:
        mc = b.bind(model, path)
        # Two tokens of the 15-token tail: too little of it to be worth its download.
        assert reused(mc, model, stored[: 2 * C + 2] + [251, 252, 253]) == 2 * C
        assert b.stats()["remote"]["downloads"] == 2  # the two chunks only
        # Nine tokens of it: its key's marks say it shares 8 at least; downloaded, and all 9 reused.
        assert reused(mc, model, stored[: 2 * C + 9] + [251, 252, 253]) == 2 * C + 9
        r = b.stats()["remote"]
        assert r["downloads"] == 3 and r["downloads_used"] == 3, r


def test_a_children_folder_flooded_with_keys_costs_one_bounded_listing(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    prompt = toks(2 * C + 9, 3)
    store_all(tmp_path / "a", url, model, path, [prompt])
    from remote_fixture import fleet

    ns = namespace(tmp_path, model, path)
    s = fleet().sealer(ns)
    chunks = prompt_records(ns, np.asarray(prompt), C, tail=False)
    folder = children_prefix(s, chunks[-1].hash, prompt[2 * C])  # where the prompt's tail is
    junk = [f"{folder}{uuid.uuid4().hex}.tail.1." for _ in range(20_000)]  # one-token tails: no marks
    # Empty objects (a key is listed whatever its size), through SeaweedFS's filer: a fraction of
    # the CPU of 20,000 signed S3 PUTs of one byte. The bucket lists every one of them.
    s3.plant_empty(url, junk)
    assert set(junk) <= {key for key, _, _ in Bucket(url).list(folder)}
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0, remote_deadline=2.0) as b:
        mc = b.bind(model, path)
        t0 = time.monotonic()
        got = reused(mc, model, prompt[: 2 * C + 5] + [251, 252])
        took = time.monotonic() - t0
        r = b.stats()["remote"]
    assert r["lists"] == 1 and r["truncated_lists"] == 1 and r["deadline_misses"] == 0, r
    assert got >= 2 * C and took < 2.0, (got, took)  # within the deadline: a bound, not a speed test
    assert LIST_LIMIT < 20_000


def test_a_key_that_failed_is_asked_for_again_once_its_time_is_up(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    prompt = toks(3 * C + 4, 4)
    store_all(tmp_path / "a", url, model, path, [prompt])
    from remote_fixture import fleet

    ns = namespace(tmp_path, model, path)
    second = prompt_records(ns, np.asarray(prompt), C)[1]
    key = key_of(fleet().sealer(ns), second, np.asarray(prompt[C : 2 * C]))
    bucket = Bucket(url)
    good = bytes(bucket.get(key))
    bucket.put(key, b"planted")  # does not open: unauthenticated, remembered as bad
    now = [1000.0]
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0) as b:
        mc = b.bind(model, path)
        remote_tier(b).clock = lambda: now[0]
        query = prompt + [7]
        assert reused(mc, model, query) == C
        bucket.put(key, good)  # put right
        gets = b.stats()["remote"]["downloads"]
        assert reused(mc, model, query) == C  # still bad for a while: not asked for
        assert b.stats()["remote"]["downloads"] == gets
        now[0] += BAD_FOR_S + 1
        assert reused(mc, model, query) == len(prompt)
        assert b.stats()["remote"]["unauthenticated"] == 1


@pytest.mark.parametrize("memory_bytes", [None, 0], ids=["memory-tier", "no-memory-tier"])
def test_the_local_disk_is_asked_before_the_bucket(tmp_path, s3, llama, memory_bytes):
    """Whether or not the memory tier is on (and empty, in a new open), what the local disk holds
    is never asked of the bucket."""
    path, model = llama
    url = s3.url()
    prompt = toks(3 * C + 4, 5)
    store_all(tmp_path / "a", url, model, path, [prompt])
    kw = {} if memory_bytes is None else {"memory_bytes": memory_bytes}
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url, **kw) as a:
        mc = a.bind(model, path)
        for _ in range(2):
            assert reused(mc, model, prompt + [7]) == len(prompt)
        r = a.stats()["remote"]
        assert r["heads"] == 0 and r["lists"] == 0 and r["downloads"] == 0, r


def test_timeout_restores_what_arrived_within_its_wait(tmp_path, s3, llama, monkeypatch):
    path, model = llama
    url = s3.url()
    prompt = toks(10 * C + 3, 6)
    store_all(tmp_path / "a", url, model, path, [prompt])
    # Downloads one at a time, 0.2 s each: 11 take 2.2 s, past the wait (1.0 s here), and the
    # first ones arrive within it even when the lookup's requests are slow (a loaded machine).
    with slow_endpoint(s3, monkeypatch, 0.2):
        with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0) as b:
            mc = b.bind(model, path)
            t0 = time.monotonic()
            got = reused(mc, model, prompt + [7])
            took = time.monotonic() - t0
            r = b.stats()["remote"]
            # a slow endpoint that answers is not down: this node's uploads and fetches go on
            down = b.remote.health.down()
    wait = PREFETCH_BASE_S + PREFETCH_PER_1K_S * len(prompt) / 1024
    assert 0 < got < len(prompt) and got % C == 0, got  # a partial restore: a prefix of the path
    assert r["partial_restores"] == 1 and r["remote_hits"] == 1 and r["downloads_used"] == got // C, r
    assert took < wait + 1.5, (took, wait)  # the policy's wait and a generous margin: a bound
    assert not down and r["errors"] == 0, r


def test_downloads_a_fetch_did_not_take_are_counted_as_unused(tmp_path, s3, llama):
    """The first chunk's GET is held until the fetch gave up on it; the other chunks of the path
    and the tail arrive whole meanwhile (their downloads start at once). The fetch restores none
    of them, and stats count each one that arrived as a download, unused: none is hidden."""
    import threading

    path, model = llama
    url = s3.url()
    prompt = toks(6 * C + 3, 26)
    store_all(tmp_path / "a", url, model, path, [prompt])
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0, remote_deadline=0.5) as b:
        mc = b.bind(model, path)
        first = prompt_records(mc.ns, np.asarray(prompt), C)[0]
        held = key_of(b.remote.fleet.sealer(mc.ns), first, np.asarray(prompt[:C]))
        real, release = b.remote.bucket.get, threading.Event()

        def get(key, *args, **kw):
            if key == held:
                assert release.wait(60)  # then past the wait: dropped as it arrives, not counted
            return real(key, *args, **kw)

        b.remote.bucket.get = get
        assert reused(mc, model, prompt + [7]) == 0
        release.set()
        for _ in range(600):  # the 5 other chunks and the tail, each counted once it arrived whole
            if b.stats()["remote"]["downloads"] >= 6:
                break
            time.sleep(0.05)
        r = b.stats()["remote"]
    assert r["downloads"] == 6 and r["download_bytes"] > 0, r
    assert r["downloads_used"] == r["remote_hits"] == r["prefetched"] == 0, r


def test_a_deadline_of_0_reads_nothing_from_the_bucket_and_still_uploads(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    prompt = toks(3 * C + 3, 16)
    store_all(tmp_path / "a", url, model, path, [prompt])
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, remote_deadline=0) as b:
        mc = b.bind(model, path)
        assert reused(mc, model, prompt + [7]) == 0
        other = toks(2 * C + 5, 17)
        mc.insert(other, prefill(model, other))
        assert b.flush(30)
        r = b.stats()["remote"]
    assert r["heads"] == r["downloads"] == r["skipped_down"] == 0, r
    assert r["uploads"] == 3 and r["skipped_down_uploads"] == 0, r


def test_best_effort_serves_what_is_local_and_fetches_for_the_next_request(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    prompt = toks(4 * C + 6, 7)
    store_all(tmp_path / "a", url, model, path, [prompt])
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, remote_prefetch="best_effort") as b:
        mc = b.bind(model, path)
        query = prompt + [7]
        assert reused(mc, model, query) == 0  # nothing local: served at once, a miss
        end = time.monotonic() + 30
        while b.stats()["remote"]["prefetched"] < 5 and time.monotonic() < end:
            time.sleep(0.05)
        assert b.flush(30)  # (counted when downloaded: written to the local disk in the background)
        r = b.stats()["remote"]
        assert r["prefetched"] == 5 and r["remote_hits"] == 0, r  # four chunks and the tail, on disk now
        assert reused(mc, model, query) == len(prompt)
        r = b.stats()["remote"]
        assert r["downloads"] == 5 and r["remote_hits"] == 0, r  # the second fetch read the local disk


def test_best_effort_counts_as_fetched_ahead_only_what_it_stored(tmp_path, s3, llama, monkeypatch):
    """The request that found nothing local prefills and stores the prompt itself while the
    background job downloads it slowly: every record is stored once, by one of them, and only
    those the job stored count as fetched ahead (the others are unused downloads, if any)."""
    path, model = llama
    url = s3.url()
    prompt = toks(6 * C + 3, 19)
    store_all(tmp_path / "a", url, model, path, [prompt])
    with slow_endpoint(s3, monkeypatch, 0.4):
        with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, remote_prefetch="best_effort",
                          remote_flush_timeout=0) as b:
            mc = b.bind(model, path)
            query = prompt + [7]
            cache, rest = mc.fetch(query)
            assert len(rest) == len(query)
            mc.insert(prompt, prefill(model, prompt))
            assert b.backing.writer.flush(30)
            tier, end = remote_tier(b), time.monotonic() + 30
            while tier._jobs:  # the background job's downloads
                assert time.monotonic() < end
                time.sleep(0.1)
            assert tier.settle(30)
            r, written = b.stats()["remote"], b.write_stats()["records_lifetime"]
            problems = b.verify()
            again = reused(mc, model, query)
    assert problems == [] and again == len(prompt), (problems, again)
    assert r["prefetched"] + written == 7, (r, written)  # six chunks and the tail, each stored once
    assert r["downloads"] >= r["prefetched"] and r["downloads_used"] == 0, r


def test_best_effort_cut_short_by_close_is_no_error(tmp_path, s3, llama, monkeypatch, caplog):
    path, model = llama
    url = s3.url()
    prompt = toks(6 * C + 3, 18)
    store_all(tmp_path / "a", url, model, path, [prompt])
    with slow_endpoint(s3, monkeypatch, 0.3):
        with caplog.at_level("WARNING", logger="kvstore"):
            b = kvstore.open(tmp_path / "b", chunk_size=C, remote=url, remote_prefetch="best_effort",
                             remote_flush_timeout=0)
            assert reused(b.bind(model, path), model, prompt + [7]) == 0
            time.sleep(0.5)  # the background job is downloading
            b.close()
            time.sleep(0.5)
    # (the proxy holds PUTs: the manifest's upload may fail as it closes, and that is said)
    assert "RuntimeError" not in caplog.text and "after shutdown" not in caplog.text, caplog.text
    assert b.remote.health.last_error == "" or "PUT" in b.remote.health.last_error, b.remote.health.last_error


def test_wait_complete_waits_for_the_whole_path(tmp_path, s3, llama, monkeypatch):
    path, model = llama
    url = s3.url()
    prompt = toks(6 * C + 3, 8)
    store_all(tmp_path / "a", url, model, path, [prompt])
    with slow_endpoint(s3, monkeypatch, 0.3):
        with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0,
                          remote_prefetch="wait_complete") as b:
            mc = b.bind(model, path)
            assert reused(mc, model, prompt + [7]) == len(prompt)  # 7 downloads, 2.1 s: more than `timeout` waits
            assert b.stats()["remote"]["partial_restores"] == 0


def test_a_wrong_fleet_secret_is_said_once(tmp_path, s3, llama, caplog):
    path, model = llama
    url = s3.url()
    prompt = toks(2 * C + 3, 9)
    store_all(tmp_path / "a", url, model, path, [prompt])
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, remote_key=new_key()) as b:
            mc = b.bind(model, path)
            assert reused(mc, model, prompt + [7]) == 0
            assert reused(mc, model, toks(2 * C, 10)) == 0
    said = [r.getMessage() for r in caplog.records if "none opens with this key" in r.getMessage()]
    assert len(said) == 1 and "holds 1 namespace and none opens with this key: is remote_key the fleet's?" in said[0], said
    # A prompt shorter than a chunk (a tail only: no HEAD, a listing) is a first miss too.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        with kvstore.open(tmp_path / "d", chunk_size=C, remote=url, remote_key=new_key()) as d:
            assert reused(d.bind(model, path), model, prompt[: C - 3]) == 0
    assert [r for r in caplog.records if "none opens with this key" in r.getMessage()]
    # With the fleet's own secret, nothing is said.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        with kvstore.open(tmp_path / "c", chunk_size=C, remote=url) as c:
            assert reused(c.bind(model, path), model, toks(2 * C, 11)) == 0
    assert not [r for r in caplog.records if "none opens" in r.getMessage()]


def test_the_wrong_key_line_counts_only_namespaces_that_hold_objects(tmp_path, s3, llama, caplog):
    """SeaweedFS lists a folder after its last object is deleted: an empty folder is no namespace.
    After a rotation and `drop_key`, and folders emptied by deletions, a stranger's key is told of
    the one namespace that holds objects, and a node that has only the dropped key (its own folder
    still listed, empty) is told too."""
    from kvstore.remote.seal import key_id, parse_key

    path, model = llama
    url = s3.url()
    old, new = new_key(), new_key()
    prompt = toks(2 * C + 3, 13)
    store_all(tmp_path / "a", url, model, path, [prompt], remote_key=old)
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, remote_key=[new, old]) as b:
        assert reused(b.bind(model, path), model, prompt + [7]) == len(prompt)  # stored again under the new key
        assert b.flush(60)
        assert b.remote.drop_key(key_id=key_id(parse_key(old, "old")))["records"] > 0
    bucket = Bucket(url)
    for i in range(5):  # more folders emptied (planted, then deleted)
        bucket.put(f"{os.urandom(16).hex()}/manifest", b"x")
    bucket.delete([p for p, _, _ in bucket.list("") if p.endswith("/manifest") and len(p) == 41
                   and bucket.get(p) == b"x"])
    folders = [f for f in bucket.folders("") if f != "keys"]  # (the key markers' folder is no namespace)
    assert len(folders) == 7 and len({p.split("/")[0] for p, _, _ in bucket.list("")} - {"keys"}) == 1

    def said(key) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            with kvstore.open(tmp_path / uuid.uuid4().hex[:8], chunk_size=C, remote=url, remote_key=key) as n:
                assert reused(n.bind(model, path), model, toks(2 * C, 14)) == 0
                counted = n.stats()["remote"]["foreign_namespaces"]
        lines = [r.getMessage() for r in caplog.records if "none opens with this key" in r.getMessage()]
        assert counted == (1 if lines else 0), (counted, lines)
        return lines

    stranger = said(new_key())
    assert len(stranger) == 1 and "holds 1 namespace and none opens" in stranger[0], stranger
    dropped = said(old)  # its own namespace's folder is listed, and empty
    assert len(dropped) == 1 and "holds 1 namespace and none opens" in dropped[0], dropped
    assert said(new) == []


def test_a_missing_bucket_is_said_by_generate_and_raised_by_the_library(tmp_path, s3, demo_model_path):
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/team"
    run = subprocess.run([sys.executable, "-m", "kvstore.cli", "generate", "--store", str(tmp_path / "s"),
                          "--model", str(demo_model_path), "--remote", url, "--prompt", "hello there, bucket",
                          "--max-tokens", "2"], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = [line for line in run.stderr.splitlines() if "does not exist" in line]
    assert len(lines) == 1 and url in lines[0] and "create it" in lines[0], run.stderr
    with kvstore.open(tmp_path / "lib", chunk_size=C, remote=url) as store:
        with pytest.raises(kvstore.KVStoreError, match="does not exist"):
            store.remote.verify()


def test_a_store_used_alone_keeps_its_records_once_it_has_a_remote(tmp_path, s3, llama):
    """What a store wrote without a remote tier (tagged under its own key) is restored, not
    quarantined, once it is opened with one (trust on first use, as for records from before tags);
    what it writes from then on goes up."""
    path, model = llama
    url = s3.url()
    prompt = toks(3 * C + 5, 12)
    with kvstore.open(tmp_path / "a", chunk_size=C) as alone:
        alone.bind(model, path).insert(prompt, prefill(model, prompt))
        assert alone.flush(30)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url, memory_bytes=0) as a:
        mc = a.bind(model, path)
        assert reused(mc, model, prompt + [7]) == len(prompt)
        other = toks(2 * C + 3, 14)
        mc.insert(other, prefill(model, other))
        assert a.flush(30)
        r = a.stats()["remote"]
        assert a.stats()["quarantined"] == 0 and r["refused_uploads"] == 0 and r["uploads"] == 3, r
        assert reused(mc, model, prompt + [7]) == len(prompt)  # still whole


def test_a_downloaded_record_inserted_again_is_written_once(tmp_path, s3, llama, monkeypatch):
    """A prompt restored from the bucket and then inserted (as `warm` and a server do) while its
    downloads are still being stored locally: the writer waits for them instead of writing the
    same records itself (a slow local disk here makes the write-through the slower of the two)."""
    from kvstore.tiers.disk import DiskTier

    path, model = llama
    url = s3.url()
    prompt = toks(3 * C + 5, 12)
    store_all(tmp_path / "a", url, model, path, [prompt])
    real = DiskTier.put

    def slow_put(self, row, body, **options):
        time.sleep(0.5)
        return real(self, row, body, **options)

    monkeypatch.setattr(DiskTier, "put", slow_put)
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0,
                      remote_prefetch="wait_complete") as b:
        mc = b.bind(model, path)
        cache, rest = mc.fetch(prompt + [7])
        assert len(rest) == 1
        mc.insert(prompt, prefill(model, prompt))  # its records: downloaded, still being stored
        assert b.flush(60)
        writes = b.stats()["writes"]
        assert writes["records_lifetime"] == 0, writes  # the writer wrote none of them
        assert b.stats()["remote"]["downloads"] == 4 and writes["downloaded_lifetime"] > 0
        assert {r.hash for r in b.index.rows()} == {s.hash for s in prompt_records(mc.ns, np.asarray(prompt), C)}
