"""The remote tier when the object store fails: killed (SIGKILL) mid-upload and mid-download,
stopped before a fetch, frozen (slow), wrong credentials, objects overwritten with garbage or
truncated. Never an exception, never wrong logits, always bounded time; counters say what happened.

The object store is a real SeaweedFS; the failures are real (the process is killed or frozen, the
objects are rewritten through S3). A test that must kill it at an exact request wraps the tier's
bucket method to kill the server just before the real request goes out.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from kvtest import logits_diff, prefill
from remote_fixture import names

import kvstore
from kvstore.remote.bucket import RemoteError
from kvstore.remote.layout import parse_key
from kvstore.remote.s3 import S3Bucket as Bucket
from kvstore.storage import blobtree

C = 16


def toks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 250, n).tolist()


def stored(tmp_path, name, url, model, path, prompt):
    with kvstore.open(tmp_path / name, chunk_size=C, remote=url) as a:
        a.bind(model, path).insert(prompt, prefill(model, prompt))
        assert a.flush(30)
        assert a.stats()["remote"]["errors"] == 0


def fetch_checked(mc, model, query):
    t0 = time.monotonic()
    cache, rest = mc.fetch(query)
    took = time.monotonic() - t0
    assert logits_diff(model, cache, rest, query) < 1e-4
    return len(query) - len(rest), took


def chain_objects(url):
    """The record objects of a bucket prefix, parents first (one prompt stored: one chain)."""
    objs = {k.hash: k for k in (parse_key(p, s, t) for p, s, t in Bucket(url).list("")) if k}
    order, seen = [], set()
    while len(order) < len(objs):
        for k in objs.values():
            if k.hash not in seen and (k.parent == k.ns or k.parent in seen):
                order.append(k)
                seen.add(k.hash)
    return order


def test_stopped_before_a_fetch(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    prompt = toks(4 * C + 3, 60)
    stored(tmp_path, "a", url, model, path, prompt)
    s3.kill()
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url) as b:
        b.remote.health.retry_after = 0.5
        mc = b.bind(model, path)
        reused, took = fetch_checked(mc, model, prompt + [1])
        assert reused == 0 and took < 3.0
        r = b.stats()["remote"]
        assert r["errors"] >= 1 and "HEAD" in r["last_error"]
        reused, took = fetch_checked(mc, model, prompt + [1])  # left alone for a while: instant
        assert reused == 0 and took < 0.5 and b.stats()["remote"]["skipped_down"] == 1
        # It comes back: the next fetch after the pause uses it again.
        s3.start()
        time.sleep(0.6)
        reused, _ = fetch_checked(mc, model, prompt + [1])
        assert reused == len(prompt)
        # Inserting while it is down: the writer goes on, uploads fail and are counted.
        s3.kill()
        other = toks(2 * C + 1, 61)
        mc.insert(other, prefill(model, other))
        t0 = time.monotonic()
        b.flush(timeout=20)
        assert time.monotonic() - t0 < 20
        r = b.stats()["remote"]
        assert r["upload_errors"] >= 1 and b.stats()["writer"]["write_errors"] == 0
        assert b.stats()["chunks"] == 4 + 2


def test_killed_mid_upload(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    prompt = toks(5 * C + 3, 62)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        real, calls = a.remote.bucket.put_new, []

        def put_new(key, data):
            calls.append(key)
            if len(calls) == 5:  # key marker, manifest, chunk 1, chunk 2 went up: the server dies now
                s3.kill()
            return real(key, data)

        a.remote.bucket.put_new = put_new
        a.bind(model, path).insert(prompt, prefill(model, prompt))
        t0 = time.monotonic()
        a.flush(timeout=30)
        assert time.monotonic() - t0 < 30
        r = a.stats()["remote"]
        assert r["uploads"] == 2 and r["upload_errors"] >= 1, r
        assert a.stats()["chunks"] == 5  # the local store is whole
    s3.start()
    # Only a prefix is in the bucket: another node restores exactly it.
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url) as b:
        mc = b.bind(model, path)
        reused, _ = fetch_checked(mc, model, prompt + [1])
        assert reused == 2 * C


def test_killed_mid_download(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    prompt = toks(6 * C + 3, 63)
    stored(tmp_path, "a", url, model, path, prompt)
    third = chain_objects(url)[3].path
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url) as b:
        real = b.remote.bucket.get

        def get(key, *args, **kwargs):
            if key == third:
                s3.kill()
            return real(key, *args, **kwargs)

        b.remote.bucket.get = get
        mc = b.bind(model, path)
        reused, took = fetch_checked(mc, model, prompt + [1])
        assert reused % C == 0 and reused <= 3 * C and took < 3.0
        assert b.stats()["remote"]["errors"] >= 1
        assert b.verify() == []


def test_frozen_object_store_costs_at_most_the_deadline(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    prompt = toks(4 * C + 3, 64)
    stored(tmp_path, "a", url, model, path, prompt)
    os.kill(s3.proc.pid, signal.SIGSTOP)
    try:
        with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, remote_deadline=0.3) as b:
            mc = b.bind(model, path)
            reused, took = fetch_checked(mc, model, prompt + [1])
            assert reused == 0 and took < 0.3 + 0.5
            assert b.stats()["remote"]["deadline_misses"] == 1
            reused, took = fetch_checked(mc, model, prompt + [1])
            assert took < 0.2 and b.stats()["remote"]["skipped_down"] == 1
    finally:
        os.kill(s3.proc.pid, signal.SIGCONT)


def test_a_download_frozen_at_its_first_get_costs_at_most_the_deadline(tmp_path, s3, llama):
    # The HEADs and the listing answer; the object store freezes as the first download starts.
    # The fetch keeps to its deadline and serves exactly what this node holds.
    path, model = llama
    url = s3.url()
    prompt = toks(4 * C + 3, 69)
    stored(tmp_path, "a", url, model, path, prompt)
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, remote_deadline=0.5, memory_bytes=0) as b:
        mc = b.bind(model, path)
        local = prompt[: 2 * C]
        mc.insert(local, prefill(model, local))
        assert b.flush(30)
        real, frozen, freezing = b.remote.bucket.get, [], threading.Lock()

        def get(key, *args, **kwargs):
            with freezing:  # no download goes out before the endpoint is stopped (a loaded machine)
                if not frozen:
                    frozen.append(key)
                    os.kill(s3.proc.pid, signal.SIGSTOP)
                    while Path(f"/proc/{s3.proc.pid}/stat").read_text().split(")")[-1].split()[0] != "T":
                        time.sleep(0.001)
            return real(key, *args, **kwargs)

        b.remote.bucket.get = get
        thaw = threading.Timer(5.0, os.kill, (s3.proc.pid, signal.SIGCONT))  # a fetch that waits fails, never hangs
        thaw.start()
        try:
            heads = b.stats()["remote"]["heads"]
            reused, took = fetch_checked(mc, model, prompt + [1])
        finally:
            thaw.cancel()
            os.kill(s3.proc.pid, signal.SIGCONT)
        assert frozen and b.stats()["remote"]["heads"] > heads  # it did ask the bucket first
        assert reused == 2 * C and took < 1.0, (reused, took)
        assert b.stats()["remote"]["deadline_misses"] >= 1


def fail_the_second_chunks_put(a, mc, prompt, error: Exception) -> list[str]:
    """Make the PUT of `prompt`'s second chunk raise `error` on store `a`: the keys it failed."""
    victim = names(mc.ns, mc.record_hashes(prompt)[1:2]).pop().hex()
    real, failed = a.remote.bucket.put_new, []

    def put_new(key, data):
        if victim in key:
            failed.append(key)
            raise error
        return real(key, data)

    a.remote.bucket.put_new = put_new
    return failed


def test_a_failed_upload_keeps_what_hangs_below_it_out_of_the_bucket(tmp_path, s3, llama):
    # One PUT fails while the object store stays up: the records below it are not uploaded
    # (orphans would break the rule that presence along a chain is a prefix).
    path, model = llama
    url = s3.url()
    prompt = toks(5 * C + 3, 72)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        failed = fail_the_second_chunks_put(a, mc, prompt, RemoteError("PUT: 503 Slow Down (injected)"))
        mc.insert(prompt, prefill(model, prompt))
        assert a.flush(timeout=30)
        objs = {k.hash: k for k in (parse_key(p, s, t) for p, s, t in Bucket(url).list("")) if k}
        for k in objs.values():
            assert k.parent == k.ns or k.parent in objs, f"{k.path} was uploaded without its parent"
        assert len(objs) == 1 and len(failed) == 1
        r = a.stats()["remote"]
        assert r["upload_errors"] == 1 and r["uploads"] == 1, r
        assert a.stats()["chunks"] == 5  # the local store is whole
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0) as b:
        reused, _ = fetch_checked(b.bind(model, path), model, prompt + [1])
        assert reused == C


def test_a_failed_upload_that_does_not_pause_the_remote_still_keeps_its_children_out(tmp_path, s3, llama):
    # The second chunk's PUT fails with an error that is not the endpoint's (so the remote is not
    # left alone, and every later record reaches the parent check): none below it is uploaded.
    path, model = llama
    url = s3.url()
    prompt = toks(5 * C + 3, 73)
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        failed = fail_the_second_chunks_put(a, mc, prompt, ValueError("the request could not be made (injected)"))
        mc.insert(prompt, prefill(model, prompt))
        assert a.flush(timeout=30)
        assert not a.remote.health.down()
        objs = {k.hash: k for k in (parse_key(p, s, t) for p, s, t in Bucket(url).list("")) if k}
        assert len(objs) == 1 and len(failed) == 1
        r = a.stats()["remote"]
        assert (r["uploads"], r["upload_errors"], r["skipped_no_parent"], r["skipped_down_uploads"]) == (1, 1, 4, 0), r


def test_wrong_credentials_are_an_error_not_a_crash(tmp_path, s3, llama, monkeypatch):
    path, model = llama
    url = s3.url()
    prompt = toks(2 * C + 3, 65)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url) as b:
        mc = b.bind(model, path)
        reused, _ = fetch_checked(mc, model, prompt)
        assert reused == 0
        mc.insert(prompt, prefill(model, prompt))
        b.flush(10)
        r = b.stats()["remote"]
        assert r["errors"] >= 1 and r["uploads"] == 0 and "not-the-secret" not in r["last_error"]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other_record", "bit_flip"])
def test_damaged_objects_are_never_served(tmp_path, s3, llama, damage):
    path, model = llama
    url = s3.url()
    prompt = toks(4 * C + 5, 66)
    stored(tmp_path, "a", url, model, path, prompt)
    chain = chain_objects(url)
    bucket = Bucket(url)
    victim = chain[2]  # the third chunk
    data = bucket.get(victim.path)
    if damage == "garbage":
        bad = os.urandom(len(data))
    elif damage == "truncated":
        bad = data[: len(data) // 2]
    elif damage == "other_record":
        bad = bucket.get(chain[1].path)  # a valid object, at the wrong key
    else:
        pos = len(data) - 100
        bad = data[:pos] + bytes([data[pos] ^ 1]) + data[pos + 1 :]
    bucket.put(victim.path, bad)
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0) as b:
        mc = b.bind(model, path)
        reused, _ = fetch_checked(mc, model, prompt + [1])
        assert reused == 2 * C
        r = b.stats()["remote"]
        assert r["unauthenticated"] == 1 and r["corrupt_objects"] == 0
        assert b.verify() == []
        assert_only_checked_records(b, real_hashes(mc, prompt, chain[:2]))
    # The tail damaged instead: every chunk is used, the tail is not.
    bucket.put(victim.path, data)
    tail = chain[-1]
    bucket.put(tail.path, bucket.get(tail.path)[:-3])
    with kvstore.open(tmp_path / "c", chunk_size=C, remote=url, memory_bytes=0) as c:
        mc = c.bind(model, path)
        reused, _ = fetch_checked(mc, model, prompt + [1])
        assert reused == 4 * C
        assert_only_checked_records(c, real_hashes(mc, prompt, chain[:-1]))


def test_an_object_deleted_behind_a_nodes_back_keeps_the_chain_before_it(tmp_path, s3, llama):
    """A chunk in the middle of a chain deleted from the bucket (by hand, or another fleet's
    tools) while the chunks below it stay: the HEAD of the deepest finds the chain whole, the
    GET of the deleted one finds nothing. The fetch restores the chunks before it, not nothing."""
    path, model = llama
    url = s3.url()
    prompt = toks(4 * C + 5, 67)
    stored(tmp_path, "a", url, model, path, prompt)
    chain = chain_objects(url)
    Bucket(url).delete([chain[2].path])  # the third chunk; the fourth and the tail stay
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0) as b:
        mc = b.bind(model, path)
        reused, _ = fetch_checked(mc, model, prompt + [1])
        assert reused == 2 * C
        r = b.stats()["remote"]
        # (what the failed try downloaded may have landed on the local disk before the next try
        # plans: those chunks are then read there, not from the bucket again)
        assert 0 < r["remote_tokens"] <= 2 * C and r["errors"] == 0


def real_hashes(mc, prompt, objects) -> set[bytes]:
    """The chain hashes of the records these objects (named by MAC) are, of a stored prompt."""
    by_name = {names(mc.ns, [h]).pop(): h for h in mc.record_hashes(prompt)}
    return {by_name[k.hash] for k in objects}


def assert_only_checked_records(store, good: set[bytes]) -> None:
    """The node's store holds exactly these downloaded records, as blobs and as rows: no byte of
    a damaged object reached it (not even as a quarantined row or a file left behind)."""
    assert store.flush(timeout=30)  # (downloads are stored locally in the background: all of them first)
    rows = {r.hash: r for r in store.index.rows()}
    assert set(rows) == good and not any(r.bad for r in rows.values())
    files = {blobtree.hash_of(p, store.blob_root) for p in blobtree.walk(store.blob_root)}
    assert files == good


def test_upload_queue_is_bounded_by_bytes(tmp_path, s3, llama):
    path, model = llama
    url = s3.url()
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:
        a.remote.uploader.max_upload_bytes = 1  # one batch at a time: what arrives while one waits is dropped
        mc = a.bind(model, path)
        gate, real = __import__("threading").Event(), a.remote.bucket.put_new

        def slow_put(key, data):
            gate.wait(10)
            return real(key, data)

        a.remote.bucket.put_new = slow_put
        for i in range(3):
            p = toks(C + 1, 70 + i)
            mc.insert(p, prefill(model, p))
        a.writer.flush()
        gate.set()
        assert a.flush(30)
        r = a.stats()["remote"]
        assert r["dropped_uploads"] == 4 and r["dropped_upload_bytes"] > 0 and r["uploads"] == 2, r


def test_a_damaged_local_copy_is_downloaded_again(tmp_path, s3, llama):
    from kvstore.storage import blobtree

    path, model = llama
    url = s3.url()
    prompt = toks(3 * C + 5, 67)
    stored(tmp_path, "a", url, model, path, prompt)
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0, remote_prefetch="wait_complete") as b:
        mc = b.bind(model, path)
        assert fetch_checked(mc, model, prompt + [1])[0] == len(prompt)
        (second,) = real_hashes(mc, prompt, chain_objects(url)[1:2])
        f = blobtree.blob_path(b.blob_root, second)
        f.write_bytes(f.read_bytes()[:-10])  # torn, as a power cut could leave it
        reused, _ = fetch_checked(mc, model, prompt + [1])
        assert reused in (C, len(prompt))  # quarantined at once, or healed in the same fetch
        assert fetch_checked(mc, model, prompt + [1])[0] == len(prompt)
        assert b.stats()["remote"]["downloads"] == 4 + 1 and b.verify() == []  # only the torn one again


def test_an_oversized_object_is_never_read_into_memory(tmp_path, s3, llama):
    """A huge object planted at a chunk's key: its size is checked before its body is read, and
    the key is not asked for again (the download is not repeated on the next fetch)."""
    path, model = llama
    url = s3.url()
    prompt = toks(2 * C + 5, 68)
    stored(tmp_path, "a", url, model, path, prompt)
    victim = chain_objects(url)[1]
    Bucket(url).put(victim.path, b"\0" * (64 << 20))
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0) as b:
        mc = b.bind(model, path)
        real, asked = b.remote.bucket.get, []

        def get(key, *args, **kwargs):
            asked.append(key)
            return real(key, *args, **kwargs)

        b.remote.bucket.get = get
        reused, _ = fetch_checked(mc, model, prompt + [1])
        assert reused == C
        r = b.stats()["remote"]
        assert r["oversized_objects"] == 1 and r["download_bytes"] < (1 << 20), r
        assert asked.count(victim.path) == 1
        reused, _ = fetch_checked(mc, model, prompt[: 2 * C] + [7, 8])  # the bad key is remembered
        assert reused == C and asked.count(victim.path) == 1
        # verify --remote judges it by its listed size, and does not read it either.
        problems = b.remote.verify()
        assert [(p.kind, p.path) for p in problems] == [("corrupt_object", victim.path)]
        assert "more than a record of its namespace" in problems[0].detail and asked.count(victim.path) == 1


HUNG_FLUSH_S = 2.0  # remote_flush_timeout of the hung-endpoint tests: short, so a hang shows


def _chat_lines(path, n: int = 3) -> None:
    """`n` messages lines with a system prompt each (warm marks them), the first one pinned."""
    import json

    system = "You are a careful assistant of a bike shop. Answer in at most three sentences. " * 3
    lines = [{"messages": [{"role": "system", "content": system + f"Shop {i}."},
                           {"role": "user", "content": f"When are you open on day {i}?"}], **({"pin": True} if not i else {})}
             for i in range(n)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _warm(capsys, store, model, prompts, url) -> tuple[float, str]:
    from kvstore.cli.main import main

    t0 = time.monotonic()
    code = main(["warm", "--store", str(store), "--model", str(model), "--prompts", str(prompts), "--remote", url,
                 "--remote-flush-timeout", f"{HUNG_FLUSH_S:g}s"])
    took = time.monotonic() - t0
    assert code == 0
    return took, capsys.readouterr().out


def test_warm_against_an_endpoint_that_hangs_on_writes_waits_one_flush_timeout(
        tmp_path, s3, demo_model, monkeypatch, capsys, caplog):
    """Each prompt's system part is marked and one is pinned: those wait for the local writer
    only, and the command waits for uploads once, within remote_flush_timeout in all."""
    from remote_fixture import StallingProxy

    model, prompts = demo_model("llama"), tmp_path / "chat.jsonl"
    _chat_lines(prompts)
    baseline, out = _warm(capsys, tmp_path / "healthy", model, prompts, s3.url())  # compute time, uploads done
    assert "prompts: 3 warmed" in out and "uploads not done" not in out
    proxy = StallingProxy(s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        took, out = _warm(capsys, tmp_path / "hung", model, prompts, s3.url())
    finally:
        proxy.close()
    assert proxy.stalled >= 1  # the uploads did reach the hanging endpoint
    assert took < baseline + HUNG_FLUSH_S + 4.0, (took, baseline)  # a bound on the hang, not a speed test
    assert "prompts: 3 warmed" in out
    line = next(s for s in out.splitlines() if "uploads not done" in s)
    assert f"did not answer in {HUNG_FLUSH_S:g} s" in line and "no later process uploads them" in line
    assert "did not take" not in caplog.text and "left undone at close" not in caplog.text  # said once, above
    with kvstore.open(tmp_path / "hung", read_only=True) as store:  # the local store is whole
        healthy = kvstore.open(tmp_path / "healthy", read_only=True)
        assert store.stats()["chunks"] == healthy.stats()["chunks"] > 0
        assert store.stats()["remote"] is None
        healthy.close()


def test_flush_and_close_against_an_endpoint_that_hangs_on_writes_wait_one_timeout(tmp_path, s3, llama, monkeypatch):
    from remote_fixture import StallingProxy

    path, model = llama
    proxy = StallingProxy(s3.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    timeout = 3.0
    try:
        store = kvstore.open(tmp_path / "a", chunk_size=C, remote=s3.url(), remote_flush_timeout=timeout)
        mc = store.bind(model, path)
        for i in range(3):
            p = toks(2 * C + 1, 70 + i)
            mc.insert(p, prefill(model, p))
            mc.mark(p, "system")  # waits for the local writer only
        assert store.writer.flush(30)
        t0 = time.monotonic()
        flushed = [store.flush(), store.flush()]  # the second wait is not spent again
        undone = store.stats()["remote"]["undone_uploads"]
        remote = store.remote
        store.close()
        took = time.monotonic() - t0
    finally:
        proxy.close()
    assert timeout <= took < 1.5 * timeout + 0.5, took  # one timeout in all, not one per call
    assert flushed == [False, False] and undone >= 1
    assert remote.counters["left_uploads"] == remote.stats()["undone_uploads"] >= undone


def test_serve_stopped_with_an_endpoint_that_hangs_on_writes_says_its_records_are_on_disk(
        tmp_path, s3, demo_model, monkeypatch):
    """SIGTERM: the server waits for its uploads once, within remote_flush_timeout, and its last
    line tells the uploads left undone from the local writes: every record it wrote is on this
    machine's disk (a restart restores it), so the line never says that something is not on disk."""
    from remote_fixture import StallingProxy
    from test_server import Server, ask, cached, chat_messages

    model, store = demo_model("llama"), tmp_path / "store"
    proxy = StallingProxy(s3.endpoint)
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url}
    try:
        with Server(model, store, tmp_path / "a.log", "--remote", s3.url(), "--remote-flush-timeout",
                    f"{HUNG_FLUSH_S:g}s", env=env) as server:
            _, first = ask(server, messages=chat_messages())
            t0 = time.monotonic()
            assert server.stop() == 0
            took = time.monotonic() - t0
            log = server.log()
    finally:
        proxy.close()
    assert proxy.stalled >= 1
    assert took < HUNG_FLUSH_S + 10.0, took  # one flush timeout, and the model's teardown
    last = next(line for line in reversed(log.splitlines()) if "kvstore: stopped:" in line)
    assert "not on disk" not in last and "did not finish" not in last, last
    n = int(re.search(r"written to disk: (\d+) record", last).group(1))
    assert n >= 1 and re.search(r"(\d+) uploads? to the remote not done: those records are on this machine's disk only",
                                last), last
    with Server(model, store, tmp_path / "b.log") as server:  # no remote: the local disk alone
        _, again = ask(server, messages=chat_messages())
        assert cached(again) >= first["prompt_tokens"] - 1
        assert server.stop() == 0


def test_serve_a_second_ctrl_c_does_not_wait_for_a_hanging_endpoint(tmp_path, s3, demo_model):
    """The first Ctrl-C waits for the uploads (remote_flush_timeout); a second one is to exit now:
    it waits for this machine's disk only, exits 0 when every write is there, and says what did
    not go up."""
    from remote_fixture import StallingProxy
    from test_server import Server, ask, chat_messages

    model = demo_model("llama")
    proxy = StallingProxy(s3.endpoint)
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url}
    try:
        with Server(model, tmp_path / "store", tmp_path / "a.log", "--remote", s3.url(), "--remote-flush-timeout",
                    "60s", env=env) as server:
            ask(server, messages=chat_messages())
            server.proc.send_signal(signal.SIGINT)
            end = time.monotonic() + 30
            while "kvstore: flushing pending writes" not in server.log() and time.monotonic() < end:
                time.sleep(0.1)
            time.sleep(0.5)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGINT)
            code = server.proc.wait(timeout=60)
            took = time.monotonic() - t0
            log = server.log()
    finally:
        proxy.close()
    assert proxy.stalled >= 1
    last = next(line for line in reversed(log.splitlines()) if "kvstore: exiting:" in line)
    assert code == 0 and took < 8.0, (code, took, last)
    assert "every queued write is on disk" in last and re.search(r"\d+ uploads? to the remote not done", last), last


def test_a_flush_timeout_of_0_says_the_uploads_were_not_waited_for(tmp_path, s3, demo_model, llama, capsys, caplog):
    """remote_flush_timeout 0 means "do not wait for uploads": what is left is said as not waited
    for, never blamed on a healthy remote that "did not answer in 0 s"."""
    from kvstore.cli.main import main

    assert main(["generate", "--store", str(tmp_path / "g"), "--model", str(demo_model("llama")), "--max-tokens", "2",
                 "--prompt", "Tell me about bikes. " * 20, "--remote", s3.url(), "--remote-flush-timeout", "0"]) == 0
    err = capsys.readouterr().err
    line = next((s for s in err.splitlines() if "not done" in s), "")
    assert "did not answer" not in err, err
    if line:  # (a fast machine may have uploaded it before the exit)
        assert "not waited for (remote_flush_timeout 0)" in line, line
    path, model = llama
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=s3.url(), remote_flush_timeout=0) as a:
        mc = a.bind(model, path)
        p = toks(8 * C + 1, 90)
        mc.insert(p, prefill(model, p))
        assert a.writer.flush(30)
        done = a.flush()
    assert "did not take" not in caplog.text and "did not answer" not in caplog.text, caplog.text
    assert done or "not waited for (remote_flush_timeout is 0)" in caplog.text, caplog.text


_LEFT_OPEN = """
import sys, time
sys.path.insert(0, {tests!r})
from kvtest import prefill
from mlx_lm import load
import kvstore
from kvstore import faults
model, _ = load({model!r})
real = faults.hit
faults.hit = lambda point: (time.sleep(0.05), real(point))  # a slow disk: the writer is still busy at exit
store = kvstore.open({store!r}, chunk_size={C}, remote={url!r}, remote_flush_timeout=0)
mc = store.bind(model, {model!r})
for i in range(3):
    p = list(range(1 + i, 8 * {C} + 2 + i))
    mc.insert(p, prefill(model, p))
print("left open", flush=True)
"""


def test_a_store_left_open_at_exit_writes_its_queue_whatever_its_flush_timeout(tmp_path, s3, llama):
    """A store left open is flushed at interpreter exit: its queued writes reach this machine's
    disk (within 30 s) whatever `remote_flush_timeout` says: that bounds the uploads only."""
    import subprocess
    import sys

    path, _ = llama
    store = tmp_path / "s"
    code = _LEFT_OPEN.format(tests=str(Path(__file__).parent), model=str(path), store=str(store), C=C, url=s3.url())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0 and "left open" in out.stdout, out.stderr[-2000:]
    with kvstore.open(store, read_only=True) as s:
        stats = s.stats()
    assert (stats["chunks"], stats["tails"]) == (3 * 8, 3), stats


def test_a_parent_the_bucket_lost_is_uploaded_again_before_its_new_children(tmp_path, s3, llama):
    """A gc of the bucket (or a key rotation) took a prompt's records while this node still holds
    them: a continuation stored later hangs below them. The node uploads the lost parents from its
    disk first, so the continuation is shared; before, it was skipped for want of its parent, and
    so was every later turn below it."""
    path, model = llama
    url = s3.url()
    prompt = toks(3 * C + 5, 68)
    longer = prompt[: 3 * C] + toks(2 * C, 69)
    stored(tmp_path, "a", url, model, path, prompt)
    Bucket(url).delete([k.path for k in chain_objects(url)])  # every record object
    with kvstore.open(tmp_path / "a", chunk_size=C, remote=url) as a:  # (a process that knows nothing of them)
        mc = a.bind(model, path)
        mc.insert(longer, prefill(model, longer))
        assert a.flush(30)
        r = a.stats()["remote"]
        assert r["skipped_no_parent"] == 0 and r["errors"] == 0, r
    with kvstore.open(tmp_path / "b", chunk_size=C, remote=url, memory_bytes=0, remote_prefetch="wait_complete") as b:
        reused, _ = fetch_checked(b.bind(model, path), model, longer + [1])
        assert reused == len(longer)  # all of it from the bucket
