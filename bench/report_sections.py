"""The sections of bench/README.md for bench/conversation.py and bench/remote.py, whose results
files record no date of their own, and for bench/agent_trace.py (written by report.py)."""

from __future__ import annotations

import subprocess

import common as C


def mb(n: float) -> str:
    """Bytes as MB, for the tables."""
    return f"{n / 1e6:,.0f} MB" if n >= 10e6 else f"{n / 1e6:.1f} MB"


def _committed(name: str) -> str:
    """The date results/NAME.json was last committed (for results that record no date of their own)."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cs", "--", f"results/{name}.json"], cwd=C.HERE,
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"results committed {out}" if out else "date not recorded"


def conversation(add, conversation) -> None:
    """The conversation section: disk bytes of a multi-turn conversation against its K/V."""
    add("## Conversations")
    add("")
    add(f"`PYTHONPATH=. python bench/conversation.py` ({_committed('conversation')}): a conversation inserted as a "
        "server inserts it, after every turn, on small demo models; disk bytes at the end against the K/V of its "
        "tokens, with the writer dropping tails that a newer record holds (kvstore) and with that switched off.")
    add("")
    add("| model | turns | tokens | chunks / tails | disk bytes / K/V | without dropping tails |")
    add("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in conversation["runs"]:
        now, before = r["now"], r.get("before") or {}
        add(f"| {r['arch']} | {r['turns']} | {now['final_tokens']:,} | {now['chunks']} / {now['tails']} "
            f"| {now['ratio']:.3f}x | {before['ratio']:.3f}x |" if before else
            f"| {r['arch']} | {r['turns']} | {now['final_tokens']:,} | {now['chunks']} / {now['tails']} "
            f"| {now['ratio']:.3f}x | - |")
    add("")
    add("A sliding-window layer (`gemma3_text`) keeps the older tails whose window slid past their tokens: "
        "the newer record does not hold their K/V for that layer.")
    add("")


def remote(add, remote) -> None:
    """The remote-tier section: restore from a bucket, uploads, lookups, the S3 client."""
    m = remote.get("machine", {})
    add("## Remote tier")
    add("")
    add(f"`python bench/remote.py` ({_committed('remote')}; {remote.get('note', '')}; load average "
        f"{m.get('load_average_1m', '?')} at the start): {remote['shape']}-shaped K/V "
        f"({remote['bytes_per_token'] / 1e3:.0f} KB a token), 256-token chunks. Restore from remote starts from an "
        "empty local store and includes the lookup, the download, the checks and the local write; from local "
        "disk is the same fetch afterwards, page cache warm. Medians, with the range.")
    add("")
    add("| tokens | K/V | restore from remote | from local disk | upload | raw PUT, same bytes |")
    add("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in remote["lengths"]:
        rr, rl = r["restore_remote"], r["restore_local"]
        add(f"| {r['length']:,} | {mb(r['kv_bytes'])} | {rr['median']:.2f} s ({rr['min']:.2f} to {rr['max']:.2f}, "
            f"n={rr['n']}) | {rl['median']:.3f} s | {r['upload_gbps'] * 1e3:.0f} MB/s "
            f"({r['upload_gbps'] / r['raw_put_gbps']:.2f}x raw) | {r['raw_put_gbps'] * 1e3:.0f} MB/s |")
    add("")
    add("Lookup (the binary search of HEADs alone):")
    add("")
    add("| chain | chunks in the bucket | HEADs | median | p99 | runs |")
    add("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in remote["lookup"]:
        add(f"| {r['chunks']} chunks | {r['present']} | {r['heads']} | {r['median'] * 1e3:.2f} ms "
            f"| {r['p99'] * 1e3:.2f} ms | {r['n']} |")
    add("")
    c = remote.get("clients")
    if c:
        add(f"Client, same objects ({c['obstore_head']['n']} runs): HEAD median {c['obstore_head']['median'] * 1e3:.2f} ms "
            f"with obstore vs {c['boto3_head']['median'] * 1e3:.2f} ms with boto3 ({c['head_speedup']:.1f}x); a LIST "
            f"{c['obstore_list']['median'] * 1e3:.2f} ms vs {c['boto3_list']['median'] * 1e3:.2f} ms "
            f"({c['list_speedup']:.1f}x).")
        add("")


def agent_trace(add, out) -> None:
    """The agent-trace section: `admit="all"` against `admit="reused"` (bench/agent_trace.py)."""
    m = out.get("machine", {})
    add("## Agent trace: what is written under `admit=\"all\"` and `admit=\"reused\"`")
    add("")
    add(f"`python bench/agent_trace.py --prompts {out['prompts']} --tokens {out['max_tokens']}` "
        f"(run {out.get('written_utc', '?')}; load average {out.get('load_start', '?')} at the start, "
        f"{m.get('load_average_1m', '?')} at the end; BLAS "
        f"{out.get('blas', '?')}): {out['prompts']} prompts of {out['min_tokens']:,} to {out['max_tokens']:,} "
        f"tokens ({out['tokens']:,} in all) over 10 shared 1,024-token system prompts, {out['repeats']} of them "
        "repeated later; the demo model (llama, tiny, float32: 1 KiB of K/V a token). Each prompt is fetched, "
        "its rest prefilled, its first token sampled, and it is inserted. \"After restart\": the store closed and "
        "opened again, the repeats sent once more. Recompute of a repeat, from nothing: "
        f"{out['recompute_ttft_median_s'] * 1000:,.0f} ms (median).")
    add("")
    add("| admit | written | on disk | not admitted | hit rate | repeat TTFT | after restart | restart hit rate |")
    add("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in out["policies"]:
        add(f"| {r['policy']} | {mb(r['bytes_written'])} | {mb(r['bytes_on_disk'])} | {r['not_admitted']} "
            f"({mb(r['not_admitted_bytes'])}) | {r['hit_rate']:.0%} | {r['repeat_ttft_median_s'] * 1000:,.0f} ms "
            f"| {r['repeat_ttft_after_restart_median_s'] * 1000:,.0f} ms | {r['repeat_hit_rate_after_restart']:.0%} |")
    add("")
    add("TTFT are medians over the repeats; the hit rate is the share of prompt tokens restored instead of "
        "computed. Under `reused` a prompt's first sight stays in RAM: its repeat in the same process still "
        "hits there, and the repeat writes it, so after a restart the repeats hit the disk in both rows. "
        "\"Not admitted\" counts every record at its first sight, those written later at their second too.")
    add("")
