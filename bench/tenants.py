"""Tenants: can one client of `kvstore serve` tell another's prompts, and what does keeping them
apart cost? Two servers, each on a store of its own warmed with the same system prompt, run side
by side: `--tenant-from none` (today: one cache for every client) and `--tenant-from
header:X-Tenant`.

On each, the same sequence of requests (each sent to one server and then the other):

1. A victim (tenant A) sends `--probes` prompts of its own: the warmed system prompt followed by
   `--private` tokens of text nobody else sends.
2. An attacker (tenant B) probes each of A's prompts once, and as many prompts nobody sent,
   interleaved (`max_tokens` 2, streamed: time to first token as a client sees it). A threshold
   fitted on the first half of each kind (time to first token, and `cached_tokens`) classifies the
   second half; the accuracy is what an attacker reaches with one probe (the target: at most 60%).
3. Within a tenant: A asks `--repeats` of its prompts again (its reuse and time to first token).
4. The shared prompt: a new tenant's first request after the system prompt (what it reuses).

The within-tenant and shared rows are compared between the two servers as a ratio of medians
(the target: within 10%). Writes bench/results/tenants.json.

    python bench/tenants.py [--quick] [--probes 200] [--system 1024] [--private 256]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common as C
import requests
import serve as S

from kvstore.demo import ensure_demo_model
from kvstore.serve.tenancy.isolation import chance_p, threshold_split

CONFIGS = {"today": ("--tenant-from", "none"), "tenants": ("--tenant-from", "header:X-Tenant")}


class Server(S.Server):
    """`kvstore serve` with these extra options, in a process of its own."""

    def __init__(self, name: str, model: Path, store: Path, log: Path, env: dict):
        S.SERVERS[name] = lambda m, s, port: [sys.executable, "-m", "kvstore.serve", "--model", str(m), "--store",
                                              str(s), "--port", str(port), *CONFIGS[name]]
        super().__init__(name, model, store, log, env)


def ask(server: Server, tenant: str, system: str, text: str) -> tuple[float, int]:
    """(time to first token, cached tokens) of one streamed chat request of `tenant`."""
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
            "max_tokens": 2, "temperature": 0.0, "logit_bias": S.NO_END, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    r = requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=S.REQUEST_TIMEOUT_S,
                      headers={"X-Tenant": tenant})
    r.raise_for_status()
    ttft, usage = None, None
    for line in r.iter_lines():
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if ttft is None and any(c.get("delta", {}).get("content") or c.get("finish_reason")
                                for c in event.get("choices", [])):
            ttft = time.perf_counter() - started
        usage = event.get("usage") or usage
    return ttft, int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def private_text(n: int) -> str:
    """About `n` tokens (one a byte) of text nobody else sends."""
    return secrets.token_hex(n // 2 + 1)[:n]


def classify(other: list[tuple[float, int]], fresh: list[tuple[float, int]]) -> dict:
    """What a one-probe attacker reaches: per signal, the held-out accuracy of a fitted threshold."""
    n = len(other) - len(other) // 2 + len(fresh) - len(fresh) // 2
    out = {}
    for name, i in (("ttft", 0), ("cached_tokens", 1)):
        a, b = [p[i] for p in other], [p[i] for p in fresh]
        threshold, accuracy = threshold_split(a, b)
        out[name] = {"accuracy": accuracy, "threshold": threshold, "chance_p": chance_p(accuracy, n),
                     "median_other": statistics.median(a), "median_fresh": statistics.median(b)}
    return out


def run(model: Path, work: Path, system: str, probes: int, private: int, repeats: int, env: dict) -> dict:
    prompts = work / "system.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "system", "content": system}]}) + "\n")
    for name in CONFIGS:  # a store each: what one cache for every client stores is shared by definition
        subprocess.run([sys.executable, "-m", "kvstore.cli", "warm", "--store", str(work / name), "--model",
                        str(model), "--prompts", str(prompts)], check=True, env=env, cwd=str(C.REPO), capture_output=True)
    servers = {name: Server(name, model, work / name, work / f"{name}.log", env) for name in CONFIGS}
    texts = [private_text(private) for _ in range(probes)]
    got = {name: {"victim": [], "other": [], "fresh": [], "repeat": [], "shared": []} for name in servers}
    try:
        for i, t in enumerate(texts):  # the victim stores its prompts
            for name, s in servers.items():
                got[name]["victim"].append(ask(s, "victim", system, t))
        for i, t in enumerate(texts):  # the attacker probes: one of the victim's, one nobody sent
            fresh = private_text(private)
            for name, s in servers.items():
                got[name]["other"].append(ask(s, "attacker", system, t))
                got[name]["fresh"].append(ask(s, "attacker", system, fresh))
            if (i + 1) % 50 == 0:
                C.log(f"[tenants] {i + 1}/{probes} probes")
        for i, t in enumerate(texts[:repeats]):
            fresh = private_text(private)
            for name, s in servers.items():
                got[name]["repeat"].append(ask(s, "victim", system, t))
                got[name]["shared"].append(ask(s, f"newcomer-{i}", system, fresh))
    finally:
        for s in servers.values():
            s.stop()
    out = {}
    for name, g in got.items():
        out[name] = {
            "attacker": classify(g["other"], g["fresh"]),
            "cached_tokens_of_victims_prompts": sorted(set(c for _, c in g["other"])),
            "cached_tokens_of_fresh_prompts": sorted(set(c for _, c in g["fresh"])),
            **{case: {"median_ttft_s": statistics.median(t for t, _ in g[case]),
                      "median_cached_tokens": statistics.median(c for _, c in g[case]),
                      "samples_s": [t for t, _ in g[case]]} for case in ("victim", "repeat", "shared")},
        }
    for case in ("repeat", "shared"):
        out[f"{case}_ttft_ratio_tenants_to_today"] = out["tenants"][case]["median_ttft_s"] / out["today"][case]["median_ttft_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20 probes of each kind, 5 repeats")
    ap.add_argument("--probes", type=C.positive_int, default=None, help="the victim's prompts, and as many fresh probes (200)")
    ap.add_argument("--system", type=C.positive_int, default=1024, help="tokens of the warmed system prompt")
    ap.add_argument("--private", type=C.positive_int, default=256, help="tokens of each private part")
    ap.add_argument("--repeats", type=C.positive_int, default=None)
    ap.add_argument("--out", type=Path, help="write the JSON here instead of bench/results/tenants.json")
    args = ap.parse_args()
    probes = args.probes or (20 if args.quick else 200)
    repeats = args.repeats or (5 if args.quick else 30)
    model = ensure_demo_model()
    env = dict(os.environ, PYTHONPATH=str(C.REPO))
    blas = C.openblas_path()
    if blas and blas not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = blas
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=C.scratch_root()) as tmp:
        results = run(model, Path(tmp), S.system_prompt(args.system, 0), probes, args.private, repeats, env)
    data = {"model": str(model), "probes": probes, "system_tokens": args.system, "private_tokens": args.private,
            "repeats": repeats, "quick": args.quick,
            "blas": "OpenBLAS (Debian libopenblas0-pthread, LD_PRELOAD)" if "LD_PRELOAD" in env and blas
            else "reference BLAS bundled with the mlx-cpu wheel",
            "results": results, "started": time.strftime("%Y-%m-%d %H:%M %Z"),
            "seconds": time.perf_counter() - started, **C.machine()}
    out = args.out or C.RESULTS / "tenants.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    for name in CONFIGS:
        r = results[name]
        a = r["attacker"]
        label = "one shared cache" if name == "today" else name
        C.log(f"[tenants] {label} ({' '.join(CONFIGS[name])}): one probe tells another tenant's prompt from a new one {a['ttft']['accuracy']:.0%} "
              f"right by time to first token ({a['ttft']['median_other'] * 1e3:.1f} vs {a['ttft']['median_fresh'] * 1e3:.1f} ms), "
              f"{a['cached_tokens']['accuracy']:.0%} by cached_tokens ({r['cached_tokens_of_victims_prompts']} vs "
              f"{r['cached_tokens_of_fresh_prompts']}); median time to first token of a tenant's own prompt again "
              f"{r['repeat']['median_ttft_s'] * 1e3:.1f} ms, of a new tenant after the shared prompt "
              f"{r['shared']['median_ttft_s'] * 1e3:.1f} ms")
    C.log(f"[tenants] tenants / one shared cache: own prompt again {results['repeat_ttft_ratio_tenants_to_today']:.2f}x, "
          f"new tenant {results['shared_ttft_ratio_tenants_to_today']:.2f}x; wrote {out}")
    C.log(f"[tenants] {data['cpu']}, {data['cores']} cores, BLAS in the servers: {data['blas']}")


if __name__ == "__main__":
    main()
