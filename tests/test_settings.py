"""One table of settings, and reports that tell what reached the disk.

Every store setting is a row of `kvstore.settings.STORE_SETTINGS`: `kvstore.open`, the commands'
options, `stats()["settings"]` and `kvstore settings` are built from it. Explicit writes (warm,
prefill, pins) are never refused by the write budget, and every per-prompt line says how many
tokens are on disk and how many stay in RAM only, and why.
"""

from __future__ import annotations

import json
import re
import shlex
import sqlite3
import subprocess
import sys

import pytest
from kvtest import run_cli
from test_cli import EXAMPLES

import kvstore
from kvstore import settings
from kvstore.errors import InvalidInputError
from kvstore.model.loading import load_model
from kvstore.sizes import format_size

C = 16


@pytest.fixture
def kv():
    """`kvstore ARGS...` in this process; `code`: the exit code it must give."""
    def run(*args, code: int = 0):
        result = run_cli(*args, check=False)
        assert result.returncode == code, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
        return result
    return run


def _warm_lines(stderr: str) -> list[tuple[int, int, int]]:
    """(tokens, reused, computed) of each per-prompt line of `kvstore warm`."""
    return [tuple(map(int, m)) for m in re.findall(r": (\d+) tokens, (\d+) reused, (\d+) computed", stderr)]


def test_warm_under_a_write_budget_stores_every_prompt_for_the_next_process(kv, tmp_path, demo_model_path):
    """Warmed prompts are explicit writes: a budget far below them writes them all the same, and
    a new process reuses every one in full (they used to stay in RAM, lost at exit)."""
    store = tmp_path / "w5"
    first = kv("warm", "--store", store, "--model", demo_model_path, "--max-write-rate", "1MB/day",
               "--prompts", EXAMPLES)
    lines = _warm_lines(first.stderr)
    assert len(lines) == 7
    for (n, _, _), line in zip(lines, re.findall(r"^\[\d/7\].*$", first.stderr, re.M)):
        assert re.search(r"computed, (\d+) on disk(, (\d+) queued for disk)?", line), line
        assert "in RAM only" not in line, line
    assert "on disk: 7 of 7 warmed prompts whole" in first.stdout, first.stdout
    again = subprocess.run([sys.executable, "-m", "kvstore.cli", "warm", "--store", str(store), "--model",
                            str(demo_model_path), "--prompts", str(EXAMPLES)],  # a process of its own
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert [(n, r) for n, r, _ in _warm_lines(again.stderr)] == [(n, n) for n, _, _ in lines], again.stderr
    stats = json.loads(kv("stats", "--store", store, "--json").stdout)
    writes = stats["writes"]
    assert writes["over_budget"] == 0 and writes["explicit_last_day"] == writes["bytes_last_day"] > 1_000_000
    assert writes["budget_left"] == 0  # explicit writes used the automatic writes' allowance up


def test_generate_says_nothing_reached_the_disk_under_admit_reused(kv, tmp_path, demo_model_path):
    result = kv("generate", "--store", tmp_path / "s", "--model", demo_model_path, "--admit", "reused",
                "--max-tokens", "4", "--prompt", "You are a helpful assistant. What is a KV cache, really?")
    line = next(x for x in result.stderr.splitlines() if x.startswith("prompt:"))
    assert re.search(r"cache of (\d+) tokens: 0 on disk, \1 in RAM only \(not admitted\)", line), line
    result = kv("generate", "--store", tmp_path / "s", "--model", demo_model_path, "--admit", "reused",
                "--memory-bytes", "0", "--max-tokens", "4", "--prompt", "Another question, never asked before?")
    line = next(x for x in result.stderr.splitlines() if x.startswith("prompt:"))  # no memory tier holds it
    assert re.search(r"cache of (\d+) tokens: 0 on disk, \1 not stored \(not admitted\)", line), line


def test_a_warmed_prompt_is_said_to_be_on_disk_under_an_answer_admission_keeps_in_ram(kv, tmp_path, demo_model_path):
    """Under admit=pinned, generating on a warmed prompt keeps the new tail (prompt and answer)
    in RAM; the prompt's own tokens are on disk in the warmed tail, and the line says so (it
    said the whole tail was in RAM only, as if the warmed prompt had not been stored)."""
    store, prompt = tmp_path / "s", "You are a helpful assistant. " + "Tell me about caches. " * 40
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": prompt}) + "\n")
    kv("warm", "--store", store, "--model", demo_model_path, "--admit", "pinned", "--prompts", tmp_path / "p.jsonl")
    result = kv("generate", "--store", store, "--model", demo_model_path, "--max-tokens", "3", "--prompt", prompt)
    line = next(x for x in result.stderr.splitlines() if x.startswith("prompt:"))
    n = int(re.search(r"prompt: (\d+) tokens", line)[1])
    assert n % 256 and f"cache of {n + 3} tokens: {n} on disk, 3 in RAM only (not admitted)" in line, line


def test_a_setting_it_does_not_know_names_those_the_store_keeps(kv, tmp_path, demo_model_path):
    """A name with no close match (ADMIT, an empty one) was refused as "no setting ADMIT", which
    says nothing of what to give: the refusal names the settings the store keeps."""
    kv("generate", "--store", tmp_path / "s", "--model", demo_model_path, "--prompt", "hi", "--max-tokens", 1)
    for given in (["ADMIT=all"], ["=all"], ["--reset", "everything"]):
        refused = kv("settings", "--store", tmp_path / "s", *given, code=2)
        assert "the store keeps admit, max_write_rate, disk_kv_bits, exact_prefill" in refused.stderr, refused.stderr


def test_a_write_rate_of_0_is_refused_naming_off(kv, tmp_path, demo_model_path):
    for bad in (0, "0", "0MB/day"):
        with pytest.raises(InvalidInputError, match="off"):
            kvstore.open(tmp_path / "s", max_write_rate=bad)
    result = kv("generate", "--store", tmp_path / "s", "--model", demo_model_path, "--max-write-rate", "0",
                "--prompt", "hi", code=2)
    assert "--max-write-rate" in result.stderr and "use off for no limit" in result.stderr, result.stderr
    assert "--admit pinned" in result.stderr
    refused = kv("settings", "--store", tmp_path / "s", "max_write_rate=0", code=2)
    assert "use off" in refused.stderr
    # a rate that rounds down to 0 bytes a day, and numbers that are none, are said as what they are
    with pytest.raises(InvalidInputError, match="less than one byte a day"):
        kvstore.open(tmp_path / "s", max_write_rate="1B/week")
    for name, bad in (("max_write_rate", float("inf")), ("max_write_rate", float("nan")),
                      ("remote_flush_timeout", float("nan")), ("remote_deadline", float("inf"))):
        with pytest.raises(InvalidInputError, match=f"{name}: .* is not a finite number"):
            kvstore.open(tmp_path / "s", **{name: bad})


def test_an_exact_step_of_no_whole_chunks_is_a_bad_command_line(kv, tmp_path, demo_model_path):
    for command in ("generate", "warm"):  # refused before a model loads, as a bad option is
        result = kv(command, "--store", tmp_path / "s", "--model", demo_model_path, "--exact-prefill", "300",
                    "--prompt", "hi", code=2)
        assert "argument --exact-prefill: exact_prefill (given) is 300 tokens, not a multiple of the chunk size " \
               "(256): give a multiple such as 256, or off" in result.stderr, result.stderr
    result = kv("warm", "--store", tmp_path / "s", "--exact-prefill", "on", "--prompts", "p.jsonl", code=2)
    assert "argument --exact-prefill: 'on' is not a whole number of tokens: give a multiple of the chunk size, " \
           "like 256, or off" in result.stderr, result.stderr
    result = kv("warm", "--store", tmp_path / "s", "--exact-prefill", "-256", "--prompts", "p.jsonl", code=2)
    assert "argument --exact-prefill: -256 is negative: give a multiple of the chunk size, like 256, or off" \
           in result.stderr, result.stderr  # (it said "give 1 or more", and 1 is refused)
    assert not (tmp_path / "s").exists()


def test_a_store_that_keeps_0_keeps_it_and_says_so(kv, tmp_path):
    with kvstore.open(tmp_path / "s"):
        pass
    with sqlite3.connect(tmp_path / "s" / "index.sqlite") as conn:  # kept before 0 was refused
        conn.execute("INSERT INTO meta (key, value) VALUES ('setting.max_write_rate', '0')")
    with kvstore.open(tmp_path / "s") as store:
        assert store.gate.per_day == 0
        assert store.stats()["settings"]["max_write_rate"] == {"value": 0, "source": "kept"}
    text = kv("stats", "--store", tmp_path / "s").stdout
    assert "max_write_rate=0 B/day (kept): automatic writes never reach the disk" in text, text
    listed = kv("settings", "--store", tmp_path / "s").stdout
    assert "max_write_rate is 0 (kept)" in listed and "max_write_rate=off" in listed
    # the commands it names act on this store, not on the default one
    assert f"`kvstore settings --store {shlex.quote(str(tmp_path / 's'))} max_write_rate=off` lifts it" in listed, listed


def test_stats_json_shows_the_settings_with_their_sources(kv, tmp_path, demo_model_path):
    store = tmp_path / "s"
    kv("generate", "--store", store, "--model", demo_model_path, "--max-tokens", "1", "--prompt", "hi there",
       "--disk-kv-bits", "8", "--admit", "reused", "--max-write-rate", "20GB/day")
    shown = json.loads(kv("stats", "--store", store, "--json").stdout)
    assert shown["settings"]["disk_kv_bits"] == {"value": 8, "source": "kept"}
    assert shown["settings"]["admit"] == {"value": "reused", "source": "kept"}
    assert shown["settings"]["max_write_rate"] == {"value": 20_000_000_000, "source": "kept"}
    assert shown["settings"]["memory_bytes"]["source"] == "default"
    assert shown["scope"]["settings"] == "process; kept ones: store"
    text = kv("stats", "--store", store).stdout
    assert "settings: admit=reused (kept), max_write_rate=20 GB/day (kept), disk_kv_bits=8 bits (kept)" in text
    with kvstore.open(store, admit="all") as s:  # given beats kept, and is kept in turn
        assert s.stats()["settings"]["admit"] == {"value": "all", "source": "given"}
        assert s.stats()["settings"]["max_write_rate"]["source"] == "kept"
    for off in ("0", "off"):  # an option given as off beats a kept value, and is kept
        kv("settings", "--store", store, "disk_kv_bits=8")
        kv("generate", "--store", store, "--model", demo_model_path, "--max-tokens", "1", "--prompt", "hi again",
           "--disk-kv-bits", off)
        shown = json.loads(kv("stats", "--store", store, "--json").stdout)
        assert shown["settings"]["disk_kv_bits"] == {"value": None, "source": "kept"}, off


def test_serves_own_defaults_read_as_defaults_not_as_given(tmp_path):
    from kvstore.serve.server import _parser

    args = _parser().parse_args([])
    assert "max_bytes" not in settings.given(args)
    with kvstore.open(tmp_path / "s", defaults=settings.serve_defaults(), **settings.given(args)) as store:
        assert store.stats()["settings"]["max_bytes"] == {"value": "auto", "source": "default"}
        assert store.max_bytes is not None  # the automatic budget applies all the same
    given = _parser().parse_args(["--store-max-bytes", "auto"])
    with kvstore.open(tmp_path / "s", defaults=settings.serve_defaults(), **settings.given(given)) as store:
        assert store.stats()["settings"]["max_bytes"] == {"value": "auto", "source": "given"}
    with pytest.raises(InvalidInputError, match="defaults: 'max_byte' is not a store setting"):
        kvstore.open(tmp_path / "t", defaults={"max_byte": "auto"})  # (a typo was ignored)
    assert not (tmp_path / "t").exists()


def test_settings_keeps_and_forgets_and_refuses_what_it_cannot_keep(kv, tmp_path):
    store = tmp_path / "s"
    with kvstore.open(store):
        pass
    changed = kv("settings", "--store", store, "admit=pinned", "max_write_rate=500MB/h", "--json")
    assert json.loads(changed.stdout)["max_write_rate"] == {"value": 12_000_000_000, "source": "kept"}
    assert "kept admit=pinned (was all, default)" in changed.stderr
    again = kv("settings", "--store", store, "max_write_rate=12000MB/day")  # the same rate, spelled otherwise
    assert "max_write_rate=12 GB/day was kept already; nothing changed" in again.stderr, again.stderr
    with kvstore.open(store) as s:
        assert (s.gate.policy, s.gate.per_day) == ("pinned", 12_000_000_000)
    forgot = kv("settings", "--store", store, "--reset", "admit")
    assert "forgot admit (was pinned); now all, the default" in forgot.stderr
    assert re.search(r"^admit\s+all\s+default", forgot.stdout, re.M), forgot.stdout
    not_kept = kv("settings", "--store", store, "memory_bytes=1G", code=2)
    assert "not kept in the store" in not_kept.stderr and "--memory-bytes" in not_kept.stderr
    typo = kv("settings", "--store", store, "admt=all", code=2)
    assert "did you mean admit" in typo.stderr
    for twice in (["admit=all", "admit=reused"], ["disk_kv_bits=8", "--reset", "disk_kv_bits"]):
        refused = kv("settings", "--store", store, *twice, code=2)
        assert "given more than once" in refused.stderr, refused.stderr
    assert re.search(r"^admit\s+all\s+default", kv("settings", "--store", store).stdout, re.M)  # nothing kept
    assert "made a new" not in changed.stderr  # (the store was there)
    made = kv("settings", "--store", tmp_path / "typo", "admit=reused")
    assert f"no store was at {tmp_path / 'typo'}: made a new, empty one" in made.stderr, made.stderr
    forget = kv("settings", "--store", tmp_path / "typo2", "--reset", "admit", code=1)  # nothing to keep
    assert "no kvstore store at" in forget.stderr and not (tmp_path / "typo2").exists(), forget.stderr
    bucket = kv("settings", "--store", store, "--remote", "s3://team/kv", "admit=reused", code=2)
    assert "--remote: settings are kept in the local store" in bucket.stderr, bucket.stderr  # not ignored
    assert re.search(r"^admit\s+all\s+default", kv("settings", "--store", store).stdout, re.M)  # nor kept


def test_explicit_writes_count_in_the_budget_and_automatic_ones_then_wait(tmp_path, demo_model_path):
    """A prefill past the budget is written (and logged as explicit); an insert after it finds
    no allowance left and stays in RAM, said so by its placement."""
    import mlx.core as mx

    loaded = load_model(str(demo_model_path))
    model = loaded.model
    with kvstore.open(tmp_path / "s", chunk_size=C, max_write_rate="1KB/day", memory_bytes=1 << 26) as store:
        mc = store.bind(model, str(demo_model_path))
        warm = list(range(3, 3 + 3 * C + 5))
        mc.prefill(warm)
        store.flush()
        assert mc.placement(warm).on_disk == len(warm)
        other = list(range(100, 100 + 2 * C))
        cache = mc.new_cache()
        model(mx.array(other)[None], cache=cache)
        mx.eval([c.state for c in cache])
        mc.insert(other, cache)
        store.flush()
        placed = mc.placement(other)
        assert (placed.on_disk, placed.in_ram, placed.why) == (0, len(other), {"over_budget": len(other)})
        assert placed.text() == f"0 on disk, {len(other)} in RAM only (over budget)"
        writes = store.stats()["writes"]
        assert writes["explicit_last_day"] == writes["bytes_last_day"] > 1000 and writes["over_budget"] == 2


def test_every_setting_says_what_0_means_and_the_options_come_from_the_table():
    from kvstore.cli.main import build_parser
    from kvstore.serve.options import SERVE_SETTINGS
    from kvstore.serve.options import build_parser as serve_parser

    for s in settings.STORE_SETTINGS + SERVE_SETTINGS:
        if s.kind in ("size", "rate", "duration", "count", "bits"):  # its own words for 0, or that 0 is refused
            if s.zero is None:
                assert s.refuse_zero and "0 is refused" in s.help, s.name
            else:
                assert s.zero and f"0: {s.zero}" in s.help, s.name
    warm = next(a for a in build_parser()._subparsers._group_actions[0].choices["warm"]._actions
                if a.dest == "max_write_rate")
    serve = next(a for a in serve_parser()._actions if a.dest == "max_write_rate")
    assert warm.help == serve.help  # one definition
    table = settings.table_text()
    assert "| `max_write_rate` | `--max-write-rate` | off | yes |" in table
    assert "(`kvstore serve`: auto)" in table


def test_the_docs_show_the_table_as_it_is():
    from pathlib import Path

    from kvstore.serve.options import SERVE_SETTINGS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    for name, table in (("store", settings.STORE_SETTINGS), ("serve", SERVE_SETTINGS)):
        block = doc.split(f"<!-- settings:{name} -->\n", 1)[1].split("\n<!-- /settings -->", 1)[0]
        assert block == settings.table_text(table), f"docs/settings.md's {name} table: paste\n{settings.table_text(table)}"


def test_one_parser_one_declaration_and_one_word_for_no_limit(tmp_path, capsys):
    """Rates and admission policies go through the settings table alone; `--store`, `--remote`
    and `--remote-key-file` are declared once for `kvstore` and `kvstore serve`; gc takes the
    table's word for no limit."""
    import kvstore.write.admission as admission
    import kvstore.write.budget as budget
    from kvstore.cli.main import build_parser, main
    from kvstore.serve.options import build_parser as serve_parser

    assert not hasattr(budget, "parse_rate") and not hasattr(admission, "check_policy")
    with pytest.raises(InvalidInputError, match="admit: must be one of all, reused, pinned"):
        admission.Gate(None, "sometimes")
    gc = build_parser()._subparsers._group_actions[0].choices["gc"]
    for flag in ("--store", "--remote", "--remote-key-file"):
        ours = next(a for a in gc._actions if flag in a.option_strings)
        theirs = next(a for a in serve_parser()._actions if flag in a.option_strings)
        assert (ours.help, ours.nargs, ours.default) == (theirs.help, theirs.nargs, theirs.default), flag
    with kvstore.open(tmp_path / "s"):
        pass
    for word in ("off", "none"):
        assert main(["gc", "--store", str(tmp_path / "s"), "--max-bytes", word]) == 0
        assert main(["gc", "--store", str(tmp_path / "s"), "--max-age", word]) == 0
    assert "freed 0 B" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["\u0663", "\u0663GB/day", "\uff11MB", "\u0663h"])
def test_a_number_in_digits_of_another_script_is_refused(text):
    """`max_write_rate=\u0663` (an Arabic-Indic 3) was kept as 3 bytes a day: the regular expressions
    took any script's digits, and the check that a rate has its unit only 0-9."""
    for name in ("max_write_rate", "max_bytes", "remote_deadline"):
        with pytest.raises(InvalidInputError, match=f"^{name}: '.*' is not a"):
            settings.BY_NAME[name].parse(text)


def test_a_prompt_whose_tail_a_longer_one_holds_is_said_to_be_on_disk(tmp_path, llama):
    """The writer keeps one tail a branch: a prompt stored, then the same prompt and one token
    more, leaves the first's tail to the longer one. Its tokens are on disk all the same, and the
    report says so (it said they were in RAM only, lost at exit)."""
    path, model = llama
    prompt = list(range(100, 140))
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, str(path))
        mc.prefill(prompt)
        mc.prefill(prompt + [7])
        store.flush()
        assert store.stats()["writer"]["redundant_dropped"] == 1
        placed = mc.placement(prompt)
        assert (placed.on_disk, placed.in_ram) == (40, 0), placed.text()
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:  # and so it is: a new process restores it
        assert len(store.bind(model, str(path)).fetch(prompt)[1]) == 1


def test_remote_settings_without_a_remote_say_they_do_nothing(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="kvstore"):
        with kvstore.open(tmp_path / "s", remote_prefetch="best_effort", remote_deadline="2s"):
            pass
        with kvstore.open(tmp_path / "s"):  # nothing given: nothing said
            pass
    said = [r.getMessage() for r in caplog.records if "no remote tier" in r.getMessage()]
    assert said == ["kvstore: remote_prefetch, remote_deadline given, but this store has no remote tier "
                    "(--remote): they do nothing"], said


def test_a_prompt_a_disk_budget_evicted_is_said_to_be_evicted_not_unwritten(tmp_path, llama, kv, demo_model_path):
    """Under a disk budget smaller than what is warmed, gc evicts records just written: the
    report says they were evicted, not 'not written' nor 'lost at exit' (they are gone already)."""
    path, model = llama
    first, second = list(range(100, 164)), list(range(10, 74))  # 4 chunks each, nothing shared
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, str(path))
        mc.prefill(first)
        store.flush()
        budget = store.stats()["bytes"] * 3 // 2
    with kvstore.open(tmp_path / "s", chunk_size=C, max_bytes=budget) as store:
        mc = store.bind(model, str(path))
        mc.prefill(second)  # past the budget: gc evicts the least recently used, the first's
        store.flush()
        placed = mc.placement(first)
        assert placed.on_disk < len(first) and placed.in_ram == len(first) - placed.on_disk
        assert set(placed.why) == {"evicted"}, placed.text()
        assert "(evicted since written)" in placed.text()
    lines = tmp_path / "p.jsonl"
    lines.write_text("".join(json.dumps({"prompt": f"{i} " + "the same long enough prompt " * 40}) + "\n"
                             for i in range(3)))
    out = kv("warm", "--store", tmp_path / "w", "--model", demo_model_path, "--prompts", lines,
             "--store-max-bytes", "1MB")
    summary = next(s for s in out.stdout.splitlines() if s.startswith("on disk:"))
    assert "not on disk: evicted since written" in summary and "lost at exit" not in summary, summary


def test_off_on_a_setting_whose_off_is_0_names_the_0(tmp_path):
    """`memory_bytes=off` is refused with what turns the memory tier off (0), not as a bad size;
    a setting that takes off (`max_write_rate`, `disk_kv_bits`) still takes it."""
    with pytest.raises(InvalidInputError, match=r"memory_bytes: 'off' is not taken: use 0 \(no memory tier\)"):
        kvstore.open(tmp_path / "s", memory_bytes="off")
    with pytest.raises(InvalidInputError, match=r"remote_flush_timeout: 'none' .* use 0 \(do not wait"):
        kvstore.open(tmp_path / "s", remote_flush_timeout="none")
    with kvstore.open(tmp_path / "s", max_write_rate="off", disk_kv_bits="off", memory_bytes=0) as store:
        assert store.settings["max_write_rate"] == store.settings["disk_kv_bits"] == (None, "given")


def test_a_disk_budget_needs_its_unit_so_a_slip_empties_nothing(kv, tmp_path, demo_model_path, capsys):
    """`--store-max-bytes 10` meant as 10GB read as 10 bytes, and the run's gc evicted every
    record not pinned (with a warning, after the fact). A disk budget, like a rate and a
    duration, takes a number only with its unit (`10B` for bytes), 0 aside; the store keeps all."""
    store = tmp_path / "s"
    lines = tmp_path / "p.jsonl"
    lines.write_text(json.dumps({"prompt": "a prompt of a few chunks to keep " * 40}) + "\n")
    kv("warm", "--store", store, "--model", demo_model_path, "--prompts", lines)
    held = json.loads(kv("stats", "--store", store, "--json").stdout)["bytes"]
    assert held > 0
    for command, option, value in (("generate", "--store-max-bytes", "10"), ("generate", "--tenant-max-bytes", "5"),
                                   ("gc", "--max-bytes", "10"), ("gc", "--tenant-max-bytes", "1.5")):
        prompt = ["--model", demo_model_path, "--prompt", "hi"] if command == "generate" else []
        result = kv(command, "--store", store, *prompt, option, value, code=2)
        bytes_too = f" ({value}B for bytes)" if value.isdigit() else "\n"
        assert f"argument {option}: '{value}' has no unit: a disk budget is a size, like {value}GB or {value}GiB" \
               f"{bytes_too}" in result.stderr, result.stderr
    from kvstore.serve.options import build_parser as serve_parser

    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--store-max-bytes", "20"])
    assert "'20' has no unit: a disk budget" in capsys.readouterr().err
    assert json.loads(kv("stats", "--store", store, "--json").stdout)["bytes"] == held
    for bad in ("10", " 7 "):
        with pytest.raises(InvalidInputError, match="has no unit: a disk budget"):
            kvstore.open(store, max_bytes=bad)
    with kvstore.open(store) as s:
        with pytest.raises(InvalidInputError, match="max_bytes: '10' has no unit"):
            s.gc(max_bytes="10")
        assert s.gc(max_bytes="10B", dry_run=True)["bytes"] == s.gc(max_bytes=10, dry_run=True)["bytes"] < held
        assert s.gc(max_bytes="0", dry_run=True)["bytes"] == 0
    # 0 needs no unit where it is taken; sizes that bound no disk still take bytes
    assert "would free" in kv("gc", "--store", store, "--max-bytes", "0", "--dry-run").stdout
    with kvstore.open(store, memory_bytes="4096", max_pending_bytes="65536") as s:
        assert s.settings["memory_bytes"] == (4096, "given")


def test_a_kept_setting_given_anew_says_it_is_kept_once(kv, tmp_path, demo_model_path):
    """A kept setting given on a command changes every later run on that store: the run says so
    (with the command that forgets it), once, not again when the same value is given again."""
    common = ("generate", "--store", tmp_path / "s", "--model", demo_model_path, "--prompt", "hi", "--max-tokens", "1")
    first = kv(*common, "--admit", "reused")
    assert (f"kvstore: admit reused is kept in the store {tmp_path / 's'} (was the default): later runs that do "
            f"not give --admit use it; `kvstore settings --store {tmp_path / 's'} --reset admit` forgets it"
            ) in first.stderr, first.stderr
    assert "is kept in the store" not in kv(*common, "--admit", "reused").stderr
    changed = kv(*common, "--admit", "all")
    assert "admit all is kept in the store" in changed.stderr and "(was reused)" in changed.stderr
    # a rate is said as `kvstore settings` says it, not as the bytes a day it is kept as
    kv(*common, "--max-write-rate", "5MB/day")
    rate = kv(*common, "--max-write-rate", "1GB/day")
    assert "max_write_rate 1 GB/day is kept in the store" in rate.stderr and "(was 5 MB/day)" in rate.stderr, rate.stderr


def test_changing_disk_kv_bits_says_what_it_holds_at_the_other_widths(kv, tmp_path, demo_model, demo_model_path,
                                                                     caplog):
    """A width change starts another namespace: what the store holds at the old width is no longer
    restored. `kvstore settings` says how much that is per width (bf16/f16 models only: a float32
    model's records are the same at every width), and an open that keeps a new width says so."""
    from kvtest import prefill
    from mlx_lm import load

    half = demo_model("llama", "small", "bfloat16")
    tokens = [1 + i % 250 for i in range(300)]  # a chunk and a tail
    for path, bits in ((half, 0), (demo_model_path, 0), (half, 8)):
        model, _ = load(str(path))
        with caplog.at_level("WARNING", logger="kvstore"), kvstore.open(tmp_path / "s", disk_kv_bits=bits) as store:
            store.bind(model, path).insert(tokens, prefill(model, tokens))
    said = [r.getMessage() for r in caplog.records if "is kept in the store" in r.getMessage()]
    # off, kept where the default was off, changes no width
    assert len(said) == 2 and settings.WIDTH_CHANGED not in said[0] and settings.WIDTH_CHANGED in said[1], said
    sizes = {m["layout"]["layers"][0].get("disk_bits", 16): m["bytes"] for m in
             json.loads(kv("stats", "--store", tmp_path / "s", "--json").stdout)["models"]
             if "bfloat16" in m["model_id"]}
    off = kv("settings", "--store", tmp_path / "s", "disk_kv_bits=0").stderr
    assert (f"kept disk_kv_bits=off (was 8 bits, kept); {settings.WIDTH_CHANGED}: it holds 2 records, "
            f"{format_size(sizes[8])}, at 8 bits\n") in off, off
    on = kv("settings", "--store", tmp_path / "s", "disk_kv_bits=4").stderr
    assert (f"it holds 2 records, {format_size(sizes[16])}, at 16 bits, 2 records, {format_size(sizes[8])}, "
            "at 8 bits\n") in on, on
    kept = kv("generate", "--store", tmp_path / "s", "--model", half, "--prompt", "hi", "--max-tokens", "1",
              "--disk-kv-bits", "8").stderr
    assert "disk_kv_bits 8 bits is kept in the store" in kept and settings.WIDTH_CHANGED in kept, kept
