"""Sections of bench/README.md written by report.py: how to run each benchmark, and the sections for
bench/conversation.py and bench/remote.py (whose results files record no date of their own),
bench/agent_trace.py, bench/kv8.py, bench/exact.py, bench/packs.py, bench/stats_scale.py,
bench/tenants.py, bench/kv_events.py and bench/fleet.py."""

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


# Every benchmark: its command (with the venv active) and whether `make bench` runs it.
COMMANDS = [
    ("restore from disk and memory vs raw reads and mlx-lm", "python bench/restore.py [--quick]", True),
    ("where a warm restore's time goes", "python bench/restore_parts.py [--tokens 2048] [--reps 11]", False),
    ("alignment of the kernel's copy", "python bench/copy_alignment.py [--quick]", False),
    ("time to first token", "python bench/ttft.py [--quick] [--budget SECONDS]", True),
    ("through the server", "python bench/serve.py [--quick] [--tokens 2048 8192] [--reps 3]", True),
    ("write path", "python bench/write_path.py [--quick]", True),
    ("index scale and gc", "python bench/index_scale.py [--quick] [--rows 10000 100000] [--files]", True),
    ("`kvstore stats` at 100,000 records", "python bench/stats_scale.py [--rows 100000] [--runs 7]", False),
    ("conversations", "python bench/conversation.py [--arch llama] [--turns 20]", True),
    ("remote tier (starts a local SeaweedFS)", "python bench/remote.py [--lengths 2048 8192] [--reps 3] [--policy-lengths 2048] [--slow-get 0.25]", False),
    ("agent trace under `admit`", "python bench/agent_trace.py [--prompts 200] [--tokens 2048]", True),
    ("8-bit K/V on disk", "python bench/kv8.py [--quick]", True),
    ("exact mode on and off, `verify --exact` (OpenBLAS preloaded)", "python bench/exact.py [--quick]", True),
    ("KV packs: size per token, import against a raw read", "python bench/packs.py [--tokens 2048] [--reps 3] [--weights-mb 512]", False),
    ("tenants: one probe against another tenant's prompts; reuse against one shared cache",
     "python bench/tenants.py [--quick] [--probes 200] [--system 1024] [--private 256]", False),
    ("what the benchmarks changed", "python bench/before_after.py [--quick]", True),
    ("checkpoint bytes of a hybrid model (arithmetic)", "python bench/checkpoint_bytes.py [CONFIG.json]", False),
    ("a profile of `fetch` (a quick look)", "python bench/profile_fetch.py [--tokens 2048] [--cprofile]", False),
    ("KV events: announce at restart, cost on insert", "python bench/kv_events.py [--records 1000] [--inserts 600]",
     False),
    ("a fleet of 3 nodes: round robin against routing by KV events",
     "python bench/fleet.py [--conversations 8] [--turns 4] [--sglang-router PATH] [--dynamo-python PATH] "
     "[--no-bucket]", False),
]


def commands(add) -> None:
    """How to run every benchmark: `make bench`, and each script on its own."""
    add("## How to run")
    add("")
    add("`make bench` runs every benchmark marked below, one after the other (about 25 minutes on 2 cores), "
        "then writes the JSON files, the plot and this page; `python bench/run_all.py --only NAME ...` runs some "
        "of them and keeps the others' results. Each script also runs on its own, with the venv active "
        "(`. .venv/bin/activate`), and writes its results file; `python bench/report.py` then writes this page "
        "again. On Linux, `make bench` preloads Debian's OpenBLAS for the time-to-first-token benchmarks when "
        "`libopenblas0-pthread` is installed; `bench/ttft.py` and `bench/exact.py` run on their own start "
        "themselves again with it preloaded.")
    add("")
    add("| benchmark | command | in `make bench` |")
    add("| --- | --- | --- |")
    for what, command, in_all in COMMANDS:
        add(f"| {what} | `{command}` | {'yes' if in_all else '-'} |")
    add("")


def stats_scale(add, data) -> None:
    """The section of bench/stats_scale.py: `kvstore stats` at 100,000 records."""
    add("## `kvstore stats` on a large store")
    add("")
    add(f"`python bench/stats_scale.py` (run {data.get('written_utc', '?')} on {data.get('cpu', '?')}): "
        f"`python -m kvstore.cli stats` on a store of {data['records']:,} records, from start to exit "
        f"(interpreter start-up, imports, open, queries, printing), median of {data['runs']} runs: "
        f"**{data['stats_median_s']:.2f} s** (target < {data['target_s']} s; a bare `python -c pass` takes "
        f"{data['python_start_median_s'] * 1000:.0f} ms).")
    add("")


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
    seal = remote.get("sealing")
    if seal:
        add(f"Sealing (AES-256-GCM, one {seal['object_mib']} MiB object, one thread, medians of "
            f"{seal['seal']['n']}): seal {seal['seal_gbps']:.1f} GB/s, open {seal['open_gbps']:.1f} GB/s "
            f"({seal['open_s_per_gb']:.2f} s per GB opened); `python bench/remote.py --sealing-only` measures "
            "it alone.")
        add("")


def agent_trace(add, out) -> None:
    """The agent-trace section: `admit="all"` against `admit="reused"` (bench/agent_trace.py)."""
    m = out.get("machine", {})
    add("## Agent trace: what is written under `admit=\"all\"` and `admit=\"reused\"`")
    add("")
    add(f"`python bench/agent_trace.py --prompts {out['prompts']} --tokens {out['max_tokens']}` "
        f"(run {out.get('written_utc', '?')} on {m.get('cpu', '?')}, {m.get('cores', '?')} cores; load average {out.get('load_start', '?')} at the start, "
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

def kv8(add, data) -> None:
    """The 8-bit K/V on disk section (bench/kv8.py)."""
    add("## 8-bit K/V on disk")
    add("")
    add("`PYTHONPATH=. python bench/kv8.py` (docs/kv8.md): stores written with `disk_kv_bits=8` and `4` against "
        "bf16/f16 ones. Demo models: a 1,000-token prompt restored from disk and compared with a recompute of the "
        "whole prompt (logits at the first step, then 50 greedy tokens). Qwen3-0.6B-shaped cache: random K/V, "
        "the error of the K/V and of one attention read-out per layer (a random query), bytes on disk, restore "
        "from disk with the page cache warm (memory tier off; the stores fetched round by round in one process), "
        "and the `insert` call.")
    add("")
    for line in kv8_table(data).splitlines():
        add(line)
    add("")


def kv8_table(data: dict) -> str:
    """The tables of bench/kv8.py's results."""
    lines = [f"Run {data['written']} on {data['cpu']}, load average {data['load_before']} before, "
             f"{data['load_after']} after.", "",
             "| demo model | on disk | max \\|logit diff\\| | mean | greedy: tokens before the first difference (of 50) | same token at the same step (of 50) | recompute's top-2 margin | disk bytes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["demo"]:
        width = f"{r['bits']} bits" if r["bits"] else "bf16/f16 (exact)"
        lines.append(f"| {r['model']} | {width} | {r['max_logit_diff']:.4f} (of {r['logit_scale']:.1f}) | "
                     f"{r['mean_logit_diff']:.4f} | {_prefix(r)} | {r['greedy_agree']} | "
                     f"{r.get('ref_margin', float('nan')):.4f} | "
                     f"{r['disk_bytes']:,} |")
    for q in data["qwen"]:
        lines += ["", f"Qwen3-0.6B-shaped cache, {q['tokens']} tokens ({q['kv_bytes']:,} bytes of bf16 K/V), "
                      "restore from disk with the page cache warm:", "",
                  "| K/V | on disk | disk bytes | vs bf16 | max / mean K/V error | max / mean attention read-out error | restore (warm) | speed vs bf16 | insert call |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in q["stores"].items():
            kind, width = name.split(", ")
            speed = (f"{r['restore_warm_ms']:.0f} ms | {r['restore_vs_bf16']:.2f}x" if "restore_warm_ms" in r
                     else "- | -")
            lines.append(f"| {kind} | {width} | {r['disk_bytes']:,} | {r['vs_bf16_kv']:.3f}x | "
                         f"{r['kv_max_err']:.4f} / {r['kv_mean_err']:.5f} | "
                         f"{r['readout_max_err']:.4f} / {r['readout_mean_err']:.5f} | {speed} | "
                         f"{r['insert_call_ms']:.1f} ms |")
    return "\n".join(lines) + "\n"


def _prefix(r: dict) -> int:
    return 50 if r["greedy_first_diff"] is None else r["greedy_first_diff"]


def exact(add, data) -> None:
    """The exact mode section (bench/exact.py)."""
    add("## Exact mode")
    add("")
    add("`LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/exact.py` "
        "(docs/exact.md): a prompt of 2k or 8k tokens stored as `kvstore generate` stores it (demo models, "
        "float32), then queries sharing a prefix of random length with it, and the prompt itself, restored from "
        "disk and run as generation runs them, against a cold run of each query in the same steps (mlx-lm's "
        "2048 with exact mode off). With exact mode off a sliding-window model reuses nothing here: its one "
        "insert after generation holds only the last window, so no record before it has the window a restore "
        "needs; exact mode stores each step as it goes.")
    add("")
    for line in exact_table(data).splitlines():
        add(line)
    add("")


def exact_table(data: dict) -> str:
    lines = [f"Last written {data['written_utc']} on {data['cpu']} ({data['blas']}; a part run again on its own keeps "
             f"the others' numbers), load average {data['load_before']} before, {data['load_after']} after.", "",
             "| demo model | prompt | exact_prefill | greedy agreement (32 tokens a query) | K/V bit for bit after the "
             "restore point | max \\|logit diff\\| | tokens reused (of the queries') | restore + rest, median | "
             "cold, median |",
             "| --- | ---: | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["exactness"]:
        lines.append(f"| {r['model']} | {r['tokens']:,} | {r['mode']} | {r['greedy_agree']}/{r['greedy_total']} | "
                     f"{r['kv_bitwise']}/{r['queries']} | {r['max_logit_diff']:.2g} | "
                     f"{r['reused']:,} of {r['query_tokens']:,} ({r['reused'] / r['query_tokens']:.0%}) | "
                     f"{r['warm_s'] * 1000:.0f} ms | {r['cold_s'] * 1000:.0f} ms |")
    lines += ["", "Cold prefill (demo llama small, float32), median of the rounds:", "",
              "| prompt | steps of 256 | steps of 2048 | one piece | the last token alone (the canary's step) |",
              "| ---: | --- | --- | --- | --- |"]
    for r in data["prefill"]:
        lines.append(f"| {r['tokens']:,} | {r['prefill_256'] * 1000:.0f} ms ({r['prefill_256'] / r['prefill_2048']:.2f}x) | "
                     f"{r['prefill_2048'] * 1000:.0f} ms | {r['prefill_whole'] * 1000:.0f} ms "
                     f"({r['prefill_whole'] / r['prefill_2048']:.2f}x) | {r['last_step'] * 1000:.1f} ms "
                     f"({r['last_step'] / r['prefill_2048']:.1%} of the prefill) |")
    lines += ["", "`verify --exact` on a store of 100 prompts (demo llama tiny, a 256-token system prompt each):", "",
              "| exact_prefill | prompts checked | seconds a prompt | canaries reproduced | store files unchanged | verdict |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in data["verify"]:
        lines.append(f"| {r['mode']} | {r['prompts']} | {r['per_prompt_s']:.2f} s | {r['canaries']} | "
                     f"{'yes' if r['unchanged'] else 'NO'} | {'ok' if r['ok'] else 'MISMATCH'} |")
    if data.get("conversation"):
        lines += ["", "A conversation (demo llama tiny): a 1,024-token system prompt, then turns of a 64-token user "
                      "message and a 48-token reply, each generated and stored as `kvstore generate` does:", "",
                  "| exact_prefill | turns | prompt tokens reused (of all turns') |", "| --- | --- | --- |"]
        for r in data["conversation"]:
            lines.append(f"| {r['mode']} | {r['turns']} | {r['reused']:,} of {r['prompt_tokens']:,} "
                         f"({r['reused'] / r['prompt_tokens']:.0%}) |")
    c = data.get("selfcheck")
    if c:
        lines += ["", f"The backend self-check, on the first restore of a process (a Qwen3-0.6B-shaped cache of "
                      f"{c['tokens']:,} tokens, {c['kv_bytes'] / 1e6:,.0f} MB, from disk with the page cache warm; fresh "
                      "processes, alternating; medians): "
                      f"{c['first_restore_checked_s'] * 1000:.0f} ms with it, {c['first_restore_skip_s'] * 1000:.0f} ms "
                      "without it. It reads one record's tensors again and copies them through mlx, once per process."]
    return "\n".join(lines) + "\n"


def tenant_targets(data) -> list[tuple[str, str, bool]]:
    """(target, measured, met) of bench/tenants.py: a one-probe attacker's accuracy against
    another tenant's prompts (at most 60%, by time and by cached tokens), and reuse within a
    tenant and of the shared prompt within 10% of one shared cache."""
    r = data["results"]
    t, today = r["tenants"], r["today"]
    out = []
    for signal, label in (("ttft", "time to first token"), ("cached_tokens", "`cached_tokens`")):
        a = t["attacker"][signal]
        out.append((f"cross-tenant: a threshold on {label} tells another tenant's prompt from a new one <= 60% "
                    f"of held-out probes", f"{a['accuracy']:.0%} with tenants ({today['attacker'][signal]['accuracy']:.0%} "
                    "with one shared cache)", a["accuracy"] <= 0.60))
    for case, label in (("repeat", "a tenant's own prompt again"), ("shared", "a new tenant after the shared prompt")):
        ratio = r[f"{case}_ttft_ratio_tenants_to_today"]
        out.append((f"time to first token of {label}, tenants / one shared cache, no more than 10% slower",
                    f"{ratio:.2f}x" + (" (faster: see the tenants section)" if ratio < 0.9 else ""), ratio <= 1.1))
    return out


def tenants(add, data) -> None:
    """The section of bench/tenants.py."""
    r = data["results"]
    add("## Tenants")
    add("")
    add(f"`python bench/tenants.py` (run {data.get('started', '?')} on {data.get('cpu', '?')}, BLAS: "
        f"**{data.get('blas')}**), the built-in demo model: two `kvstore serve`, each on a store of its own warmed "
        f"with the same {data['system_tokens']:,}-token system prompt, side by side: `--tenant-from none` (one cache for every "
        "client, as before tenants) and `--tenant-from header:X-Tenant`. A victim stores "
        f"{data['probes']} prompts (the system prompt and {data['private_tokens']} tokens of its own); an attacker "
        "(another tenant) probes each once and as many new prompts, interleaved, each request streamed; a "
        f"threshold fitted on the first {data['probes'] // 2} of each kind classifies the other "
        f"{data['probes'] - data['probes'] // 2} + {data['probes'] - data['probes'] // 2}. Then the victim asks "
        f"{data['repeats']} of its prompts again, and as many new tenants each send a first request.")
    add("")
    add("| | one shared cache | tenants |")
    add("| --- | ---: | ---: |")
    for signal, label in (("ttft", "time to first token"), ("cached_tokens", "`cached_tokens`")):
        cells = []
        for name in ("today", "tenants"):
            a = r[name]["attacker"][signal]
            unit = (lambda v: f"{v * 1e3:.1f} ms") if signal == "ttft" else (lambda v: f"{v:,.0f}")
            cells.append(f"{a['accuracy']:.0%} ({unit(a['median_other'])} vs {unit(a['median_fresh'])})")
        add(f"| one probe by {label}: accuracy (another tenant's prompts vs new, medians) | {cells[0]} | {cells[1]} |")
    for case, label in (("victim", "a prompt's first request"), ("repeat", "a tenant's own prompt again"),
                        ("shared", "a new tenant after the shared prompt")):
        cells = [f"{r[n][case]['median_ttft_s'] * 1e3:.1f} ms ({r[n][case]['median_cached_tokens']:,.0f} cached)"
                 for n in ("today", "tenants")]
        add(f"| time to first token: {label} | {cells[0]} | {cells[1]} |")
    add("")
    add(f"`cached_tokens` of the attacker's probes of the victim's prompts, with tenants: "
        f"{r['tenants']['cached_tokens_of_victims_prompts']}; of new prompts: {r['tenants']['cached_tokens_of_fresh_prompts']} "
        "(the shared system prompt, and the opening tokens of the user turn its own earlier prompts hold). "
        f"Tenants / one shared cache: a tenant's own prompt again {r['repeat_ttft_ratio_tenants_to_today']:.2f}x, "
        f"a new tenant after the shared prompt {r['shared_ttft_ratio_tenants_to_today']:.2f}x.")
    add("")
    add("Why a new tenant's first request can be faster with tenants: with one cache for every client, every "
        "client's prompt after the system prompt is a child of its last shared chunk, starting with the same "
        "token (the system prompt's), and a lookup of a new prompt reads the tokens of each to compare them; with "
        "tenants it reads the shared ones and its own only (`children_by_tenant`). In-process, with 400 other "
        "clients' prompts after a shared one, a fetch of a new prompt took 8.0 ms with one cache and 0.74 ms as a "
        "tenant (0.62 ms each with none).")
    add("")


def kv_events(add, data) -> None:
    """The section of bench/kv_events.py: a restarted node's announce, and the cost on insert."""
    a, i = data["announce"], data["insert"]
    add("## KV events")
    add("")
    add(f"`LD_PRELOAD=.../libblas.so.3 python bench/kv_events.py` (run {data.get('written_utc', '?')} on "
        f"{data['machine'].get('cpu', '?')}, {data['machine'].get('cores', '?')} cores, load average "
        f"{data['machine'].get('load_average_1m', '?')} at the start; {data.get('blas')}; tiny demo llama, "
        "256-token chunks, 64-token blocks).")
    add("")
    add(f"- **Announce at restart** (target: within 5 s of start): `kvstore serve` started on a store of "
        f"{a['records']:,} records ({a['blocks']:,} blocks); a subscriber bound on 127.0.0.1 received every block "
        f"**{a['announced_s']:.2f} s** after the process was started (`/health` said ready at "
        f"{a['health_s']:.2f} s: most of it is loading Python, mlx and the model; the announce itself took "
        f"{a['announce_in_process_s']:.2f} s in the server, in {a['batches']} batches of at most "
        f"{a['largest_batch']} events). What the subscriber believed equals the store: {a['blocks_believed']:,} "
        "blocks.")
    add(f"- **Cost on insert** (target: under 5% of its caller-side time): {i['inserts']} inserts into a store "
        f"that publishes and one that does not, the same caches, interleaved: median "
        f"{i['events']['median_ms']:.3f} ms against {i['plain']['median_ms']:.3f} ms "
        f"(**{i['overhead_median'] * 100:+.1f}%**), mean without the slowest 5% "
        f"{i['events']['trimmed_mean_ms']:.3f} ms against {i['plain']['trimmed_mean_ms']:.3f} ms "
        f"({i['overhead_trimmed_mean'] * 100:+.1f}%), mean {i['events']['mean_ms']:.3f} ms against "
        f"{i['plain']['mean_ms']:.3f} ms ({i['overhead_mean'] * 100:+.1f}%; the slowest inserts are scheduler "
        "stalls of a busy machine). Insert only queues; the publisher does its work on a thread of its own, "
        f"so what differs is that thread's share of the GIL. {i['batches']} batches, sequence numbers {'without a gap' if i['gapless'] else 'WITH GAPS'}; "
        f"the subscriber's view of the disk {'equals' if i['disk_view_equals_store'] else 'DIFFERS FROM'} the store "
        f"({i['disk_blocks_held']:,} blocks).")
    add("")


def fleet(add, data, earlier=None) -> None:
    """The section of bench/fleet.py: three nodes, round robin against routing by KV events; the
    latest run (its nodes sharing a bucket, unless it says none) and `earlier`, a run without one."""
    add("## Fleet: routing by KV events")
    add("")
    w = data["workload"]
    add(f"Fleets of three `kvstore serve` nodes (small demo llama, each node its own empty store), side by "
        f"side, every request sent to each fleet in turn: {w['systems']} system prompts of {w['system_tokens']} "
        f"tokens shared by {w['conversations']} conversations of {w['turns']} turns, each conversation with a "
        f"document of {w['document_tokens']} tokens of its own, turns interleaved. The hit rate is the share of "
        "prompt tokens the nodes reported cached (restored from RAM, disk or the bucket); times to first token "
        "are the client's, streamed.")
    add("")
    for run in (data, earlier):
        if run:
            _fleet_run(add, run)
    add("Round robin sends each turn to the next node, which holds the shared system prompts after a few "
        "requests but rarely the conversation's own document: without a bucket it recomputes it; with one it "
        "restores it from the bucket, which costs more than RAM. The picker (in bench/fleet.py, not part of "
        "kvstore) and Dynamo's standalone KV indexer (`python -m dynamo.indexer`, ai-dynamo-runtime) route by "
        "the nodes' KV events and keep each conversation where it is in RAM. SGLang's gateway routes by "
        "request text, which on this workload finds the same nodes; it cannot see what a node evicted or "
        "restored. See docs/fleet.md.")
    add("")


def _fleet_run(add, data) -> None:
    m, bucket = data["machine"], data["workload"].get("bucket", "none")
    flags = " ".join(f for f, name in (("--sglang-router PATH", "sglang-router cache_aware"),
                                       ("--dynamo-python PATH", "Dynamo KV indexer")) if name in data["policies"])
    command = f"python bench/fleet.py {flags}".strip() + (" --no-bucket" if bucket == "none" and "bucket" in
                                                            data["workload"] else "")
    add(f"`{command}` (run {data.get('written_utc', '?')} on {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
        f"load average {m.get('load_average_1m', '?')} at the start; {data.get('blas')}; bucket: {bucket}):")
    add("")
    shared = any("from_bucket_tokens" in r for r in data["policies"].values())
    add("| router | requests | hit rate |" + (" from the bucket |" if shared else "") + " median TTFT | p90 TTFT |")
    add("| --- | ---: | ---: |" + (" ---: |" if shared else "") + " ---: | ---: |")
    for name, r in data["policies"].items():
        bucket_cell = f" {r.get('from_bucket_tokens', 0):,} tokens |" if shared else ""
        add(f"| {name} | {r['requests']} | {r['hit_rate'] * 100:.1f}% |{bucket_cell} {r['ttft_median_ms']:.0f} ms "
            f"| {r['ttft_p90_ms']:.0f} ms |")
    add("")


def packs(add, data) -> None:
    """The KV packs section (bench/packs.py)."""
    add("## KV packs")
    add("")
    add("`LD_PRELOAD=.../libblas.so.3 python bench/packs.py` (docs/packs.md): a pack of one 2,048-token prompt per "
        "model shape, at bf16 and with `disk_kv_bits=8` (real shapes: random bf16 K/V of every layer through a "
        "shape-only model); the import of the Qwen3-0.6B-shaped bf16 pack against a raw read of its files (page "
        "cache warm, medians, side by side in one process); and the demo model end to end.")
    add("")
    for line in packs_table(data).splitlines():
        add(line)
    add("")


def packs_table(data: dict) -> str:
    """The tables of bench/packs.py's results."""
    m, imp, demo = data["machine"], data["import"], data["demo"]
    lines = [f"Run {data.get('written_utc', 'now')} on {m['cpu']} ({m['cores']} cores); {demo['blas']}.", "",
             "| model shape | layers x kv heads x head_dim | pack bytes per token, bf16 | at 8 bits | 8-bit / bf16 |",
             "| --- | --- | ---: | ---: | ---: |"]
    for r in data["sizes"]:
        lines.append(f"| {r['model']} | {r['layers']} x {r['kv_heads']} x {r['head_dim']} | "
                     f"{r['bytes_per_token_16']:,.0f} | {r['bytes_per_token_8']:,.0f} | {r['ratio_8']:.3f}x |")
    weights = mb(imp["weight_bytes"]) if "weight_bytes" in imp else "a few bytes"
    lines += ["", f"Import of the Qwen3-0.6B-shaped pack ({mb(imp['bytes'])}, {imp['files']} files, "
              f"{imp['tokens']:,} tokens), its model's weight file {weights}:", "",
              "| step | seconds | GB/s of pack bytes |", "| --- | ---: | ---: |"]
    for key, what in (("raw_read", "raw read of the pack's files into memory"), ("sha256", "SHA-256 of those bytes"),
                      ("xxh3", "xxh3 of those bytes (the tensor checksums' hash)"),
                      ("model_hash", f"the model's files hashed: SHA-256 and xxh3 in one read ({weights})"),
                      ("checks", "every check of `pack import` (the model's files hashed, the pack read once, "
                                 "hashed, records checked)"),
                      ("import", "the whole import into a fresh store (checks, blobs fsynced, rows, pins)"),
                      ("import_memo", "the whole import into a store that has hashed the model before")):
        if key in imp:
            lines.append(f"| {what} | {imp[key]['seconds']:.3f} | {imp[key]['gb_per_s']:.2f} |")
    lines += ["", f"Page faults per import: {imp['import_minor_faults']:,.0f} minor ({imp['pages']:,} pages of "
              "pack bytes).", "",
              f"Demo model (llama small, bf16), {demo['tokens']:,} tokens: the export computed {demo['computed_by_export']:,} "
              f"tokens in {demo['export_seconds']:.1f} s; the pack is {mb(demo['pack_bytes'])} and imports in "
              f"{demo['import_seconds']:.2f} s; the first request after the import reuses "
              f"{demo['reused_after_import']:,} tokens, first token in {demo['ttft_restored']:.3f} s against "
              f"{demo['ttft_cold']:.2f} s cold (one step of all the tokens): "
              f"{demo['prefill_seconds_saved_per_mb']:.2f} s of prefill saved per MB of pack, against the quicker "
              "of the two prefills."]
    return "\n".join(lines)
