"""The remote tier against a real SeaweedFS: several stores with their own folders are the nodes.

Every restore is checked end to end: the reused length, the logits and 20 greedy tokens against a
recompute from scratch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from kvtest import logits_diff, prefill, run_procs
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

import kvstore
from kvstore.records import RecordId
from kvstore.remote import s3 as remote_client
from kvstore.remote.layout import key_of, manifest_key, mark_lengths, parse_key
from kvstore.remote.seal import Fleet

C = 16


def toks(n: int, seed: int, vocab: int = 250) -> list[int]:
    return np.random.default_rng(seed).integers(1, vocab, n).tolist()


def node(tmp_path, name: str, url: str, **kw):
    # What is restored, not when: the whole path is waited for (the `timeout` policy's wait can
    # run out on a machine busy with other work; tests/test_remote_prefetch.py times the policies).
    kw.setdefault("remote_prefetch", "wait_complete")
    return kvstore.open(tmp_path / name, chunk_size=C, remote=url, **kw)


def greedy(model, cache, rest, n=20) -> list[int]:
    out = []
    logits = model(mx.array([rest]), cache=cache)
    for _ in range(n):
        t = int(mx.argmax(logits[0, -1]).item())
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)
    return out


def check_restore(mc, model, query, expect_reused):
    cache, rest = mc.fetch(query)
    assert len(query) - len(rest) == expect_reused
    ref = greedy(model, make_prompt_cache(model), query)
    got = greedy(model, cache, rest)
    assert got == ref
    cache, rest = mc.fetch(query)
    assert logits_diff(model, cache, rest, query) < 1e-4


@pytest.fixture(scope="module")
def llama_model(demo_model):
    path = demo_model("llama")
    model, _ = load(str(path))
    return path, model


def test_url_and_keys():
    assert remote_client.parse_url("s3://b/a/b/") == ("b", "a/b")
    assert remote_client.parse_url("s3://b") == ("b", "")
    for bad in ("http://b/x", "s3://", "s3:///x", "s3://b/a//c", "s3://b/../x"):
        with pytest.raises(kvstore.InvalidInputError):
            remote_client.parse_url(bad)
    fleet = Fleet(b"\x07" * 32)
    ns, parent, h = b"\x01" * 16, b"\xab" * 16, b"\x02" * 16
    s = fleet.sealer(ns)
    tail = np.array([42, 5, 6, 7, 8, 9, 10], dtype=np.int32)
    key = key_of(s, RecordId(h, ns, parent, None, 1, 7, 42), tail)
    p = s.name(parent)
    marks = "".join(s.marks(parent, tail, [2, 3, 4, 6]))
    assert key == f"{s.folder}/{p[:2]}/{p}/{s.children(parent, 42)}/{s.name(h)}.tail.7.{marks}"
    # The key holds no hash and no token of the chain: names and marks are MACs under the fleet secret.
    assert ns.hex() not in key and parent.hex() not in key and h.hex() not in key and "/42/" not in key
    assert key_of(Fleet(b"\x08" * 32).sealer(ns), RecordId(h, ns, parent, None, 1, 7, 42), tail) != key
    k = parse_key(key)
    assert (k.ns.hex(), k.parent.hex(), k.hash.hex(), k.kind, k.ntokens) == (s.folder, p, s.name(h), 1, 7)
    assert len(k.marks) == 4 and k.marks[3] == s.marks(parent, tail[:6], [6])[0]
    # A record's key is made from its tokens; one without them, or with marks that do not fit, is refused.
    with pytest.raises(ValueError):
        key_of(s, RecordId(h, ns, parent, None, 1, 7, 42))
    assert parse_key(key[:-4]) is None
    # A key of layout 2 (no marks) is still a record's key (gc ages it out), which says nothing of its tokens.
    assert parse_key(key.rpartition(".")[0]).marks is None
    assert s.name(ns) == s.folder  # a root chunk's parent reads as its namespace
    ck = parse_key(key_of(s, RecordId(h, ns, parent, None, 2, 0, None)))
    assert ck.kind == 2 and ck.parent.hex() == p
    assert parse_key(manifest_key(s.folder)) is None
    # Only exactly the layout counts: the same key under a nested prefix is another team's.
    assert parse_key("sub/" + key) is None and parse_key(key + "x") is None



def test_an_object_opened_as_its_bytes_arrive_is_the_object_opened_whole():
    """A download is opened part by part as it arrives (no copy of the sealed bytes): whatever
    the parts (the tag or the nonce split between them), it gives the plaintext `open` gives, and
    a changed byte anywhere, a missing or extra byte, another key or another object key never
    gives any."""
    from kvstore.remote.seal import OVERHEAD, Unauthenticated

    s = Fleet(b"\x07" * 32).sealer(b"\x01" * 16)
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    sealed = s.seal("k/1", data)

    def opened(body, sizes, key="k/1", box=s):
        o = box.opener(key)(len(body))
        at, i = 0, 0
        while at < len(body):
            n = sizes[i % len(sizes)]
            o.write(body[at : at + n])
            at, i = at + n, i + 1
        return bytes(o.done())

    for sizes in ([len(sealed)], [1], [3, 7], [len(sealed) - 10, 10], [15, 1 << 16], [4096]):
        assert opened(sealed, sizes) == data == bytes(s.open("k/1", sealed)), sizes
    for at in (0, 5, len(sealed) // 2, len(sealed) - 17, len(sealed) - 1):  # magic, nonce, text, tag
        bad = bytearray(sealed)
        bad[at] ^= 1
        with pytest.raises(Unauthenticated):
            opened(bytes(bad), [1000])
    with pytest.raises(Unauthenticated):
        opened(sealed, [1000], key="k/2")  # copied to another key
    with pytest.raises(Unauthenticated):
        opened(sealed, [1000], box=Fleet(b"\x08" * 32).sealer(b"\x01" * 16))
    o = s.opener("k/1")(len(sealed))
    o.write(sealed[:-1])
    with pytest.raises(Unauthenticated):
        o.done()  # a byte short
    with pytest.raises(Unauthenticated):
        s.opener("k/1")(len(sealed) - 1).write(sealed)  # more than its stated size
    with pytest.raises(Unauthenticated):
        s.opener("k/1")(OVERHEAD - 1)

def test_aws_profile_files(tmp_path):
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text("[team]\naws_access_key_id = AK\naws_secret_access_key = SK\n")
    (tmp_path / ".aws" / "config").write_text("[profile team]\nregion = eu-west-1\nendpoint_url = http://h:1\n")
    got = remote_client.aws_settings({"HOME": str(tmp_path), "AWS_PROFILE": "team"})
    assert got == {"access_key_id": "AK", "secret_access_key": "SK", "region": "eu-west-1", "endpoint": "http://h:1"}
    # The environment wins over the files.
    got = remote_client.aws_settings({"HOME": str(tmp_path), "AWS_PROFILE": "team", "AWS_ACCESS_KEY_ID": "E"})
    assert got["access_key_id"] == "E" and got["secret_access_key"] == "SK"


def test_node_b_restores_what_node_a_stored(tmp_path, s3, llama_model):
    path, model = llama_model
    url = s3.url()
    prompt = toks(5 * C + 7, seed=1)
    with node(tmp_path, "a", url) as a:
        mc = a.bind(model, path)
        mc.insert(prompt, prefill(model, prompt))
        assert a.flush(timeout=30)
        ra = a.stats()["remote"]
        assert ra["uploads"] == 6 and ra["upload_errors"] == 0 and ra["errors"] == 0
    with node(tmp_path, "b", url) as b:
        mc = b.bind(model, path)
        query = prompt + toks(5, seed=2)
        check_restore(mc, model, query, expect_reused=len(prompt))
        rb = b.stats()["remote"]
        assert rb["downloads"] == 6 and rb["remote_hits"] == 1 and rb["uploads"] == 0
        assert rb["remote_tokens"] == len(prompt)
        heads = rb["heads"]
        # Now local: no more remote requests for it.
        mc.fetch(query)
        assert b.stats()["remote"]["heads"] == heads
        b.flush()  # (downloads are stored locally in the background)
        assert b.stats()["chunks"] == 5 and b.stats()["tails"] == 1
        # What it downloaded is never uploaded again.
        assert b.stats()["remote"]["uploads"] == 0 and b.stats()["remote"]["already_there"] == 0


def test_branch_inside_a_remote_tail_reuses_exactly_the_common_prefix(tmp_path, s3, llama_model):
    path, model = llama_model
    url = s3.url()
    prompt = toks(3 * C + 12, seed=3)
    with node(tmp_path, "a", url) as a:
        a.bind(model, path).insert(prompt, prefill(model, prompt))
        a.flush(timeout=30)
    with node(tmp_path, "b", url) as b:
        mc = b.bind(model, path)
        query = prompt[: 3 * C + 5] + [251, 252, 253]
        check_restore(mc, model, query, expect_reused=3 * C + 5)
        # And a branch inside a chunk reuses up to it.
        query = prompt[: 2 * C + 3] + [251, 252]
        check_restore(mc, model, query, expect_reused=2 * C + 3)


def test_binary_search_needs_few_heads(tmp_path, s3, llama_model):
    path, model = llama_model
    url = s3.url()
    prompt = toks(128 * 4, seed=4)
    with kvstore.open(tmp_path / "a", chunk_size=4, remote=url) as a:
        a.bind(model, path).insert(prompt, prefill(model, prompt))
        assert a.flush(timeout=60)
        assert a.stats()["remote"]["uploads"] == 128
    with kvstore.open(tmp_path / "b", chunk_size=4, remote=url) as b:
        mc = b.bind(model, path)
        query = prompt[: 100 * 4] + [7, 7, 7, 7, 7, 7]
        cache, rest = mc.fetch(query)
        assert len(query) - len(rest) == 100 * 4
        r = b.stats()["remote"]
        assert r["heads"] <= 9, r
        assert r["lists"] == 1


def test_the_binary_search_finds_the_deepest_chunk_exactly(tmp_path, s3, llama_model):
    # Node B asks for 6 chunks where A stored 4 and a tail: the probe of the deepest misses, and
    # only a binary search that ends exactly at chunk 4 finds A's tail (a listing of chunk 3's
    # children would give back chunk 4, but not what hangs below it).
    path, model = llama_model
    url = s3.url()
    prompt = toks(4 * C + 7, seed=5)
    with node(tmp_path, "a", url) as a:
        a.bind(model, path).insert(prompt, prefill(model, prompt))
        assert a.flush(timeout=30)
    with node(tmp_path, "b", url, memory_bytes=0) as b:
        mc = b.bind(model, path)
        query = prompt + toks(2 * C, seed=6)  # 6 chunks and a tail
        check_restore(mc, model, query, expect_reused=len(prompt))
        r = b.stats()["remote"]
        assert r["downloads"] == 5 and r["remote_tokens"] == len(prompt), r


HERE = Path(__file__).parent


def run(mode, store, model, tokens, **extra) -> dict:
    return run_procs(mode, store, model, C, tokens, **extra)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_5"])
def test_across_nodes_in_fresh_processes(tmp_path, s3, demo_model, arch):
    """Node A (one process) stores; node B (another process, empty folder) restores it exactly."""
    model = demo_model(arch)
    url = s3.url()
    prompt = toks(4 * C + 9, seed=10)
    a = run("insert", tmp_path / "a", model, prompt, remote=url, prefill=arch == "qwen3_5", checkpoint_every=2)
    assert a["remote"]["uploads"] >= 5 and a["remote"]["errors"] == 0, a["remote"]
    got = run("check", tmp_path / "b", model, prompt + toks(3, seed=11), remote=url, memory_bytes=0)
    assert got["reused"] == len(prompt), got
    assert got["max_abs_diff"] <= 1e-4 and got["greedy"] == got["greedy_ref"]
    assert got["remote"]["remote_hits"] == 1 and got["remote"]["corrupt_objects"] == 0
    if arch == "qwen3_5":
        assert "ArraysCache" in got["classes"]
        # Inside the prompt, the deepest checkpoint (after chunk 2) is where it restores.
        branch = run("check", tmp_path / "c", model, prompt[: 3 * C + 2] + toks(3, seed=12), remote=url,
                     memory_bytes=0)
        assert branch["reused"] == 2 * C and branch["greedy"] == branch["greedy_ref"]
    if arch == "gemma3_text":
        assert "RotatingKVCache" in got["classes"]


def test_three_nodes_warming_overlapping_prompts(tmp_path, s3, demo_model):
    model = demo_model("llama")
    url = s3.url()
    system = toks(3 * C + 5, seed=20)
    prompts = [system + toks(2 * C + i, seed=21 + i) for i in range(6)]
    procs = []
    for n in range(3):  # each node warms 4 of the 6 prompts, overlapping the others
        mine = [prompts[(2 * n + j) % 6] for j in range(4)]
        script = ("import json, sys, kvstore\n"
                  "from mlx_lm import load\n"
                  "sys.path.insert(0, %r)\n"
                  "from kvtest import prefill\n"
                  "model, _ = load(%r)\n"
                  "with kvstore.open(%r, chunk_size=%d, remote=%r) as s:\n"
                  "    mc = s.bind(model, %r)\n"
                  "    for p in json.loads(sys.argv[1]):\n"
                  "        mc.insert(p, prefill(model, p))\n"
                  "    assert s.flush(60)\n"
                  "    print(json.dumps(s.stats()['remote']))\n") % (
            str(HERE), str(model), str(tmp_path / f"n{n}"), C, url, str(model))
        procs.append(subprocess.Popen([sys.executable, "-c", script, json.dumps(mine)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    stats = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        stats.append(json.loads(out.strip().splitlines()[-1]))
    assert all(s["errors"] == 0 and s["upload_errors"] == 0 for s in stats), stats
    assert sum(s["already_there"] for s in stats) > 0  # the shared system prompt went up once
    m, _ = load(str(model))
    for n in range(3):
        with kvstore.open(tmp_path / f"n{n}", chunk_size=C, remote=url, memory_bytes=0) as s:
            mc = s.bind(m, model)
            for p in prompts:
                cache, rest = mc.fetch(p + [3, 4])
                assert len(rest) == 2
                assert logits_diff(m, cache, rest, p + [3, 4]) < 1e-4


def test_reuse_from_the_bucket_is_token_exact(tmp_path_factory, s3, llama_model):
    """For any branch point of any stored sequence, a node with an empty folder reuses the longest
    common prefix with what node A stored (capped to leave one token), as local does, whenever the
    child it branches in is worth downloading (its key's marks show it shares at least a quarter of
    its tokens, or all that is left); else up to the end of the last whole chunk. Never more."""
    import tempfile

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    path, model = llama_model
    url = s3.url()
    base = toks(3 * C + 6, seed=90)
    stored = [base, base[: 2 * C + 3] + toks(C + 9, seed=91), toks(C - 3, seed=92)]
    root = tmp_path_factory.mktemp("exact")
    with kvstore.open(root / "a", chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        for s in stored:
            mc.insert(s, prefill(model, s))
        assert a.flush(30)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(which=st.integers(0, len(stored) - 1), cut=st.integers(1, 4 * C), extra=st.integers(0, 5))
    def check(which, cut, extra):
        src = stored[which]
        query = src[: min(cut, len(src))] + [251 + i % 4 for i in range(extra)]
        if len(query) < 2:
            return
        want = min(len(query) - 1, max(_common(query, s) for s in stored))
        whole = want // C * C  # what the chain of chunks gives, found by HEADs
        n = min(C, len(src) - whole)  # the child of src that the query branches in
        shared = max([m for m in mark_lengths(n) + [n] if m <= want - whole], default=0)
        worth = shared and (4 * shared >= n or shared >= len(query) - whole - 1)
        with tempfile.TemporaryDirectory(dir=root) as d:
            with kvstore.open(d, chunk_size=C, remote=url, memory_bytes=0) as b:
                cache, rest = b.bind(model, path).fetch(query)
                got = len(query) - len(rest)
                assert whole <= got <= want and (got == want or not worth), (got, want, whole, shared, n)
                want = got
                if want:
                    assert logits_diff(model, cache, rest, query) < 1e-4

    check()


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
