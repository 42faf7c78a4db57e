"""Smoke tests of bench/restore.py and bench/serve.py: they run end to end and report every method
and case (no timing asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Every method the restore benchmark measures: baselines, then kvstore.
REQUIRED = [
    "raw_read_aligned_1t", "raw_read_aligned_2t", "raw_read_new_memory", "buffered_cold_read",
    "load_prompt_cache", "load_prompt_cache_first_step", "lru_fetch_first_step",
    "kvstore_restore_warm", "kvstore_restore_cold", "kvstore_restore_first_step",
    "kvstore_memory", "kvstore_memory_first_step",
]


def test_restore_bench_quick_reports_every_method(tmp_path):
    out = tmp_path / "restore.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), KVSTORE_BENCH_DIR=str(tmp_path / "scratch"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "restore.py"), "--quick", "--shape", "tiny", "--tokens", "512",
         "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    data = json.loads(out.read_text())
    assert data["quick"] is True
    (result,) = data["results"]
    assert (result["shape"], result["tokens"]) == ("tiny", 512)
    assert result["kv_bytes"] > 0 and result["blob_files"] >= 1
    methods = result["methods"]
    for name in REQUIRED:
        row = methods.get(name)
        assert row is not None, f"{name} missing from the results"
        assert row["exit_codes"] == [0], (name, row.get("errors"))
        assert row["n"] >= 1 and len(row["samples_s"]) == row["n"]
        assert row["median_s"] > 0, name
        assert row["minflt_median"] >= 0 and row["majflt_median"] >= 0, name
    # The kvstore workers check the restored bits against the inserted cache; they record what they saw.
    for name in ("kvstore_restore_warm", "kvstore_restore_cold", "kvstore_restore_first_step",
                 "kvstore_memory", "kvstore_memory_first_step"):
        checks = methods[name]["checks"]
        assert checks["offset"] == 512, name
        assert checks["capacity_tokens"] >= 512, name
    assert isinstance(methods["kvstore_memory"]["checks"]["served_from_memory"], bool)
    for name in ("raw_read_aligned_1t", "raw_read_aligned_2t", "raw_read_new_memory", "buffered_cold_read"):
        assert methods[name]["checks"]["bytes_checked"] is True, name
    for name in ("buffered_cold_read", "kvstore_restore_cold"):
        assert methods[name]["checks"]["cold_method"], name
    for name in ("load_prompt_cache_first_step", "lru_fetch_first_step", "kvstore_restore_first_step",
                 "kvstore_memory_first_step"):
        checks = methods[name]["checks"]
        assert checks["capacity_after_step"] >= 513, name
        assert isinstance(checks["first_step_reallocates"], bool), name
    # Every method ran twice: all in one process (the headline, judged) and each in its own.
    assert set(result["separate"]) == set(methods)
    for name in REQUIRED:
        assert result["separate"][name]["exit_codes"] == [0] and result["separate"][name]["n"] >= 1, name
    assert set(result["targets_separate"]) == set(result["targets"])
    for key in ("warm", "alone", "cold", "first_step", "memory"):
        target = result["targets"][key]
        assert target["ratio"] is not None and target["ratio"] > 0, key
        assert isinstance(target["met"], bool), key

    table = out.with_suffix(".md").read_text()
    assert table.startswith("## Restore")
    assert "one process" in table and "a process of its own" in table and data["machine"]["cpu"] in table
    for name in REQUIRED:
        assert f"| {name} |" in table, name


def test_serve_bench_quick_compares_both_servers(tmp_path):
    out = tmp_path / "serve.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), KVSTORE_BENCH_DIR=str(tmp_path / "scratch"))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "serve.py"), "--tokens", "600", "--reps", "1",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    stock, ours = data["results"]["mlx_lm.server"]["600"], data["results"]["kvstore serve"]["600"]
    for case in ("first", "repeat", "shared", "restart"):
        assert stock[case]["median_s"] > 0 and ours[case]["median_s"] > 0, case
    # What the table claims about reuse, as the servers reported it: both reuse in RAM; after a
    # restart only kvstore does (from disk), the whole prompt but the last token.
    for side in (stock, ours):
        assert side["first"]["cached_tokens"] == [0]
        assert side["repeat"]["cached_tokens"][0] > 500 and side["shared"]["cached_tokens"][0] > 500
    assert stock["restart"]["cached_tokens"] == [0]
    assert ours["restart"]["cached_tokens"] == ours["repeat"]["cached_tokens"]


def _bench(tmp_path, script: str, *args: str) -> tuple[dict, str]:
    """Run `bench/<script>.py` with `args` into a scratch folder: its JSON, and its section of
    bench/README.md as `markdown` renders it."""
    out = tmp_path / f"{script}.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), KVSTORE_BENCH_DIR=str(tmp_path / "scratch"))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / f"{script}.py"), *args, "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    sys.path.insert(0, str(REPO / "bench"))
    try:
        markdown = __import__(script).markdown
    finally:
        sys.path.remove(str(REPO / "bench"))
    return data, "\n".join(markdown(data))


def test_copy_alignment_bench_times_every_pairing_and_reports_where_mlx_puts_arrays(tmp_path):
    data, text = _bench(tmp_path, "copy_alignment", "--quick")
    result = data["result"]
    assert len(result["median_s"]) == 3 * 8 and all(v > 0 for v in result["median_s"].values())
    assert result["copied_bytes"] > 0 and sum(result["mlx_offsets"].values()) == 56
    assert all(0 <= int(k) < 64 for k in result["mlx_offsets"])
    assert "| `preadv`, source at 16 |" in text and "Aligned alike" in text


def test_restore_parts_bench_times_every_part_and_checks_its_reads(tmp_path):
    data, text = _bench(tmp_path, "restore_parts", "--shape", "tiny", "--tokens", "1024", "--reps", "1")
    (result,) = data["results"]
    assert (result["shape"], result["tokens"], result["records"]) == ("tiny", 1024, 4)
    parts = ("raw_1t", "raw_2t", "fetch", "load_prompt_cache", "allocate", "reads_1t", "reads_2t",
             "reads_unchecked_2t", "hash_pieces_1t", "hash_pieces_2t")
    assert set(result["median_s"]) == set(parts)
    assert all(result["median_s"][p] > 0 and len(result["samples_s"][p]) == 1 for p in parts)
    assert "tiny shape, 1,024 tokens" in text and "| `reads_2t` |" in text
    # The ceiling the parts allow, worked out from them: raw read / (raw read on 2 threads + arrays).
    m = result["median_s"]
    assert f"to {m['raw_1t'] / (m['raw_2t'] + m['allocate']):.2f}x the raw read" in text
    # What a hand-off between threads costs, free on every core and (on Linux) pinned to one core.
    hand = data["handoffs"]
    assert set(hand) == ({"every core", "one core"} if hasattr(os, "sched_setaffinity") else {"every core"})
    for got in hand.values():
        assert got["arrays"] == result["final_arrays"]
        assert all(got[k] > 0 for k in ("thread_round_trip_s", "mlx_eval_round_trip_s", "allocate_s"))
    assert "What the final arrays wait for" in text


def _run_bench(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script, args, says", [
    ("stats_scale.py", ["--runs", "0"], "argument --runs: 0 is less than 1"),
    ("restore_parts.py", ["--tokens", "0"], "argument --tokens: 0 is less than 1"),
    ("kv_events.py", ["--inserts", "-3"], "argument --inserts: -3 is less than 1"),
    ("packs.py", ["--reps", "two"], "argument --reps: 'two' is not a whole number"),
    ("remote.py", ["--slow-get", "-1"], "argument --slow-get: -1 is less than 0"),
    ("checkpoint_bytes.py", ["README.md"], "cannot read README.md as a model's config.json"),
    # Before: nine nodes started, then a FileNotFoundError traceback.
    ("fleet.py", ["--sglang-router", "/no/such/sglang-router"], "--sglang-router /no/such/sglang-router: no such"),
    ("fleet.py", ["--dynamo-python", sys.executable], "has no dynamo.indexer"),
])
def test_bench_bad_arguments_are_usage_errors_not_tracebacks(script, args, says):
    # A count of 0 once ran the benchmark and ended in a ZeroDivisionError or StatisticsError.
    proc = _run_bench(script, *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("script", ["report.py", "plot.py", "restore_methods.py"])
def test_bench_helpers_help_writes_nothing(script):
    # report.py and plot.py took no options: `--help` rewrote bench/README.md (or the plot);
    # restore_methods.py read "--help" as its spec file.
    watched = [REPO / "bench" / "README.md", REPO / "bench" / "results" / "ttft.png"]
    before = [p.stat().st_mtime_ns for p in watched]
    proc = _run_bench(script, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr[-2000:]
    assert [p.stat().st_mtime_ns for p in watched] == before


def test_bench_preload_openblas_starts_the_script_again_with_it(tmp_path):
    # ttft.py and exact.py measure prefill: run on their own (as the table says) they ran on mlx's
    # bundled BLAS, several times slower than the OpenBLAS `make bench` gives them.
    sys.path.insert(0, str(REPO / "bench"))
    try:
        blas = __import__("common").openblas_path()
    finally:
        sys.path.remove(str(REPO / "bench"))
    if blas is None:
        pytest.skip("Debian's OpenBLAS is not installed")
    script = tmp_path / "probe.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r})\n"
                      "import common as C\nC.preload_openblas('probe')\nprint(C.blas_in_use())\n")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run([sys.executable, str(script)], env=dict(env, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "OpenBLAS (Debian libopenblas0-pthread, LD_PRELOAD)"
    assert "starting again with LD_PRELOAD" in proc.stderr


def test_bench_report_keeps_a_hand_edited_page(tmp_path, monkeypatch):
    # bench/README.md carries run notes and earlier runs written by hand: regenerating the page
    # (`make bench`, `bench/restore.py`, `bench/report.py`) dropped them without a word.
    sys.path.insert(0, str(REPO / "bench"))
    try:
        report = __import__("report")
        common = __import__("common")
    finally:
        sys.path.remove(str(REPO / "bench"))
    (tmp_path / "results").mkdir()
    monkeypatch.setattr(common, "HERE", tmp_path)
    assert report._write_page("first\n") == str(tmp_path / "README.md")
    assert report._write_page("second\n") == str(tmp_path / "README.md")  # not edited since: replaced
    (tmp_path / "README.md").write_text("second\nand a note by hand\n")
    assert report._write_page("third\n") == str(tmp_path / "README.generated.md")
    assert (tmp_path / "README.md").read_text() == "second\nand a note by hand\n"
    assert (tmp_path / "README.generated.md").read_text() == "third\n"
