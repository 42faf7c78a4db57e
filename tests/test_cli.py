"""The `kvstore` command line, run as a real process against a tmp store and a tiny demo model.

Failures that happen before any model is loaded (argument and file errors) are also checked by
calling `kvstore.cli.main.main` in this process, which is the same code without the start-up cost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from kvtest import run_cli

import kvstore
from kvstore.cli import main as cli
from kvstore.cli.options import model_to_load, read_prompts
from kvstore.demo import DEMO_NOTE
from kvstore.model import loading
from kvstore.sizes import format_size, parse_duration, parse_size

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "prompts.jsonl"
COMMANDS = ("warm", "generate", "gc", "stats", "verify", "serve")


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """HOME for the commands: nothing they do lands in the real ~/.cache."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture
def kv(home, monkeypatch):
    """Run `kvstore ARGS...`; returns the CompletedProcess. In this process (as `kvtest.run_cli`),
    unless it reads standard input or needs an environment of its own: a new process then."""
    def run(*args, input: str | None = None, env: dict | None = None, code: int | None = 0):
        environ = {k: v for k, v in os.environ.items() if k != "KVSTORE_DIR"}
        environ.update({"HOME": str(home), "PYTHONUNBUFFERED": "1", **(env or {})})
        if input is None and env is None:
            with monkeypatch.context() as m:
                m.setenv("HOME", str(home))
                m.delenv("KVSTORE_DIR", raising=False)
                m.chdir(REPO)
                result = run_cli(*args, check=False)
        else:
            result = subprocess.run([sys.executable, "-m", "kvstore.cli", *map(str, args)], input=input,
                                    capture_output=True, text=True, env=environ, cwd=REPO, timeout=300)
        assert "Traceback" not in result.stderr, result.stderr
        if code is not None:
            assert result.returncode == code, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
        return result
    return run


@pytest.fixture(scope="module")
def warmed(tmp_path_factory, demo_model_path, home):
    """A store warmed with examples/prompts.jsonl, and the output of that first warm (in this
    process, as the `kv` fixture runs a command)."""
    store = tmp_path_factory.mktemp("warmed") / "store"
    with pytest.MonkeyPatch.context() as m:
        m.setenv("HOME", str(home))
        m.delenv("KVSTORE_DIR", raising=False)
        m.chdir(REPO)
        result = run_cli("warm", "--store", store, "--model", demo_model_path, "--prompts", EXAMPLES, check=False)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    return store, result


@pytest.fixture
def store_copy(warmed, tmp_path) -> Path:
    """A private copy of the warmed store, for tests that change it."""
    return Path(shutil.copytree(warmed[0], tmp_path / "store"))


def summary(stdout: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"^(tokens reused|tokens computed|bytes written): (\d+)", stdout, re.M)}


def report(stderr: str) -> list[tuple[int, int, int]]:
    """(prompt tokens, reused, computed) of each `generate` report line."""
    return [tuple(map(int, m)) for m in
            re.findall(r"prompt: (\d+) tokens, (\d+) reused from the store, (\d+) computed", stderr)]


def stats_of(path: Path) -> dict:
    with kvstore.open(path) as store:
        return store.stats()


def problems_of(path: Path) -> list:
    with kvstore.open(path) as store:
        return store.verify()


def in_process(capsys, *args) -> tuple[int, str, str]:
    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# -- sizes and durations ----------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("0", 0), ("100B", 100), ("500MB", 500_000_000), ("500mb", 500_000_000),
    ("2GiB", 2 << 30), ("1.5G", int(1.5 * (1 << 30))), ("10K", 10240), ("3 KB", 3000), ("1TB", 10**12),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-5MB", "5XB", "1.2.3G", "MB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("text, expected", [
    ("30m", 1800), ("12h", 43200), ("7d", 604800), ("45s", 45), ("1h30m", 5400), ("2w", 1209600), ("0.5h", 1800),
    ("0", 0),
])
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "soon", "5y", "-3d", "3d x", "45", "1h30", "7 "])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_format_size():
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 << 30) == "3.0 GiB"


# -- help -------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "serve"])
def test_every_command_help_has_an_example(capsys, command):
    code, out, _ = in_process(capsys, command, "--help")
    assert code == 0
    assert "example" in out.lower() and f"kvstore {command} " in out
    assert "--store" in out


def test_top_level_help_lists_commands_with_examples(capsys):
    code, out, _ = in_process(capsys, "--help")
    assert code == 0
    for command in COMMANDS:
        assert command in out
    assert "example" in out.lower() and "kvstore warm --prompts" in out


def test_console_script_and_serve_help(home):
    script = Path(sys.executable).with_name("kvstore")
    if not script.exists():
        pytest.skip("the kvstore console script is not installed in this environment")
    result = subprocess.run([str(script), "serve", "--help"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HOME": str(home)})
    assert result.returncode == 0, result.stderr
    assert "example" in result.stdout.lower() and "kvstore serve" in result.stdout


def test_no_command_prints_usage(capsys):
    code, _, err = in_process(capsys)
    assert code == 2 and "usage: kvstore" in err


# -- typos ------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, meant", [
    (["warm", "--promts", "p.jsonl"], "--prompts"),  # before "--prompts is required"
    (["gc", "--max-byte", "1MB"], "--max-bytes"),  # a prefix is not taken for the option
    (["gc", "--stroe", "S", "--stale"], "--store"),
    (["stats", "--jsn"], "--json"),
    (["verify", "--repiar"], "--repair"),
])
def test_a_typo_names_the_option_it_resembles(capsys, args, meant):
    code, _, err = in_process(capsys, *args)
    assert code == 2 and f"usage: kvstore {args[0]}" in err, err
    assert f"unknown option {args[1]} (did you mean {meant}?)" in err, err


def test_a_typo_of_generate_gets_its_usage_not_the_top_level_one(kv):
    result = kv("generate", "--max-tokns", "5", "--prompt", "Hello", code=2)
    assert "usage: kvstore generate" in result.stderr
    assert "unknown option --max-tokns (did you mean --max-tokens?)" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["gc", "--max-bytes", "-5MB"], "argument --max-bytes: '-5MB' is negative"),
    (["gc", "--max-age", "-3d"], "argument --max-age: '-3d' is negative"),
    (["gc", "--max-bytes", "1.5B"], "argument --max-bytes: '1.5B' is not a whole number of bytes"),  # not 1 byte
    (["gc", "--max-bytes", "1.5"], "argument --max-bytes: '1.5' has no unit: a disk budget is a size, like 1.5GB "
                                   "or 1.5GiB\n"),  # (not "1.5B for bytes")
    (["warm", "--prompts", "x.jsonl", "--max-write-rate", "bogus"], "'bogus' is not a rate"),
    # `--store "$DIR"` with DIR unset: refused, never read as "no --store" (the default store);
    # an empty file or model is not read as the current folder.
    (["warm", "--store", "", "--prompts", "x.jsonl"], "argument --store: an empty value: give a folder"),
    (["stats", "--store", " "], "argument --store: an empty value"),
    (["warm", "--prompts", ""], "argument --prompts: an empty value: give a JSONL file"),
    (["generate", "--prompts", ""], "argument --prompts: an empty value"),
    (["generate", "--model", "", "--prompt", "hi"], "argument --model: an empty value"),
    # A mistyped --remote is a bad command line, said before a model loads (it was exit 1, after).
    (["warm", "--prompts", "x.jsonl", "--remote", "kvcache/team"], "argument --remote: remote must be a URL like "
                                                                     "s3://BUCKET/PREFIX, got 'kvcache/team'"),
    (["gc", "--remote", "s3://kv cache/team", "--max-age", "1d"], "argument --remote: remote 's3://kv cache/team' "
                                                                  "names no bucket"),
    (["stats", "--remote", "s3:/kvcache"], "argument --remote: remote must be a URL like"),
])
def test_a_bad_value_says_what_is_wrong_with_it(capsys, args, message):
    code, _, err = in_process(capsys, *args)
    assert code == 2 and message in err and "expected one argument" not in err, err


@pytest.mark.parametrize("args, message", [
    (["--force"], "--force goes with --repair"),
    (["--prompts", "system.jsonl"], "--prompts and --probes go with --isolation"),
    (["--probes", "7"], "--prompts and --probes go with --isolation"),
    (["--tenant-from", "bearer"], "--tenant-from goes with --isolation URL"),
])
def test_verify_refuses_an_option_it_would_ignore(capsys, store_copy, args, message):
    """An option of another mode of verify is refused, not ignored: `verify --prompts FILE` would
    otherwise report the whole store clean as if it had checked those prompts."""
    code, out, err = in_process(capsys, "verify", "--store", store_copy, *args)
    assert code == 2 and message in err and out == "", (out, err)


@pytest.mark.parametrize("command", [["stats"], ["generate", "--prompt", "hi"], ["warm", "--prompts", "p.jsonl"]])
def test_a_remote_key_file_without_a_bucket_is_refused(capsys, tmp_path, monkeypatch, command):
    """`--remote-key-file` with no bucket (`--remote`, `$KVSTORE_REMOTE`) would not be read: a
    wrong path, or a forgotten `--remote`, went unsaid; it is a usage error naming the file."""
    monkeypatch.delenv("KVSTORE_REMOTE", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    code, out, err = in_process(capsys, *command, "--store", tmp_path / "s", "--remote-key-file", "/nonexistent")
    assert code == 2 and "--remote-key-file /nonexistent: the fleet's key is for a bucket here, and none is given" in err
    assert not (tmp_path / "s").exists(), "refused before a store is made"


def test_a_prompt_file_without_a_prompt_is_refused_before_a_store_is_made(capsys, tmp_path):
    for text in ("", "\n  \n"):
        (tmp_path / "p.jsonl").write_text(text)
        for command in ("warm", "generate"):  # (warm said "0 warmed", exit 0, and made the store)
            code, _, err = in_process(capsys, command, "--store", str(tmp_path / "s"), "--prompts", str(tmp_path / "p.jsonl"))
            assert code == 2 and "p.jsonl: holds no prompt line" in err, err
    assert not (tmp_path / "s").exists()


def test_a_closed_standard_input_is_a_clear_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)  # (how Python starts with `<&-`; it was an AttributeError)
    for command in ("warm", "generate"):
        code, _, err = in_process(capsys, command, "--store", str(tmp_path / "s"), "--prompts", "-")
        assert code == 1 and "cannot read the prompt file -: standard input is closed" in err, err
    assert not (tmp_path / "s").exists()


# -- warm -------------------------------------------------------------------------------------

def test_warm_stores_shared_prefix_once_and_twice_computes_nothing(warmed, kv, demo_model_path):
    store, first = warmed
    s1 = summary(first.stdout)
    assert "prompts: 7 warmed, 0 skipped" in first.stdout
    assert s1["tokens computed"] > 0 and s1["bytes written"] > 0
    # Prompts 2..6 share the long system prompt of prompt 1: it is computed once.
    assert s1["tokens reused"] >= 5 * 900
    assert re.search(r"^\[1/7\] .*prompts.jsonl:1 \(id hours\): \d+ tokens", first.stderr, re.M)

    stats = stats_of(store)
    assert stats["bytes"] == s1["bytes written"]
    assert stats["chunks"] > 0 and stats["tails"] > 0
    [model] = stats["models"]
    assert model["model_id"] == str(demo_model_path)
    with sqlite3.connect(store / "index.sqlite") as db:
        assert db.execute("SELECT count(*) FROM records WHERE pinned = 1").fetchone()[0] > 0

    again = kv("warm", "--store", store, "--model", demo_model_path, "--prompts", EXAMPLES)
    s2 = summary(again.stdout)
    assert s2["tokens computed"] == 0 and s2["bytes written"] == 0
    assert s2["tokens reused"] == s1["tokens reused"] + s1["tokens computed"]
    assert stats_of(store)["bytes"] == stats["bytes"]


def test_warm_reads_standard_input(kv, demo_model_path, tmp_path):
    lines = [json.dumps({"prompt": "one prompt from stdin"}), json.dumps({"tokens": [1, 2, 3, 4, 5]})]
    result = kv("warm", "--store", tmp_path / "s", "--model", demo_model_path, "--prompts", "-",
                input="\n".join(lines) + "\n")
    assert "prompts: 2 warmed" in result.stdout
    assert "<stdin>:2" in result.stderr
    assert stats_of(tmp_path / "s")["tails"] == 2


def test_a_line_with_an_empty_id_is_named_by_its_line_alone(kv, demo_model_path, tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "", "prompt": "a prompt with an empty id"}) + "\n")
    result = kv("warm", "--store", tmp_path / "s", "--model", demo_model_path, "--prompts", tmp_path / "p.jsonl")
    assert "p.jsonl:1: 25 tokens" in result.stderr and "(id )" not in result.stderr, result.stderr


def test_warm_bad_lines_are_reported_and_good_lines_stored(kv, demo_model_path, tmp_path):
    good = [json.dumps({"prompt": "the first good prompt", "id": "a"}),
            json.dumps({"tokens": [7, 8, 9, 10]}),
            json.dumps({"messages": [{"role": "user", "content": "the last good one"}], "pin": True})]
    bad = [  # (line, field, what the message says)
        ("this is not json", None, "not valid JSON"),
        (json.dumps({"id": 3, "text": "hi"}), None, "none of the fields"),
        (json.dumps({"tokens": [1, -2, 3]}), "tokens[1]", "not a non-negative integer"),
        (json.dumps({"tokens": [1, 2.5]}), "tokens[1]", "not a non-negative integer"),
        (json.dumps({"tokens": ["a"]}), "tokens[0]", "not a non-negative integer"),
        (json.dumps({"tokens": [1, 2, 5000]}), "tokens[2]", "outside the model's vocabulary"),
        (json.dumps({"prompt": ""}), "prompt", "is empty"),
        (json.dumps({"tokens": []}), "tokens", "is empty"),
        (json.dumps({"messages": []}), "messages", "is empty"),
        (json.dumps({"messages": [{"role": "user"}]}), "messages[0].content", "is missing"),
        (json.dumps({"prompt": "x" * 33000}), "prompt", "longer than the model's context (32768"),
        (json.dumps({"prompt": "ok", "pin": "yes"}), "pin", "must be true or false"),
        (json.dumps({"prompt": "ok", "tokens": [1]}), "tokens", "give only one of"),
        (json.dumps([1, 2, 3]), None, "expected a JSON object"),
        # A typo of a known field is named, with the field it resembles, and the line skipped.
        (json.dumps({"prompt": "ok", "pinned": True}), None, 'unknown field "pinned" (did you mean "pin"?'),
        (json.dumps({"promt": "ok"}), None, 'unknown field "promt" (did you mean "prompt"?'),
        (json.dumps({"messages": [{"role": "user", "contnt": "hi"}]}), "messages[0].content",
         'is missing (there is "contnt": a typo of "content"?)'),
    ]
    rows = [good[0], *[b[0] for b in bad[:7]], good[1], *[b[0] for b in bad[7:]], good[2]]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(rows) + "\n\n")
    with path.open("ab") as f:
        f.write(b'{"prompt": "\xff\xfe"}\n')  # not UTF-8: line len(rows) + 2 (after a blank line)

    result = kv("warm", "--store", tmp_path / "s", "--model", demo_model_path, "--prompts", path, code=1)
    for line, field, message in bad:
        number = rows.index(line) + 1
        where = f"{path}:{number}: " + (f"{field}: " if field else "")
        assert any(l.startswith(f"kvstore warm: {where}") and message in l for l in result.stderr.splitlines()), \
            (where, message, result.stderr)
    assert f"{path}:{len(rows) + 2}: not UTF-8" in result.stderr
    assert f"prompts: 3 warmed, {len(bad) + 1} skipped (bad lines)" in result.stdout

    # The good lines were stored: warming just them computes nothing (a BOM, as some editors
    # write at a file's start, is no bad line).
    only_good = tmp_path / "good.jsonl"
    only_good.write_text("\ufeff" + "\n".join(good) + "\n")
    again = kv("warm", "--store", tmp_path / "s", "--model", demo_model_path, "--prompts", only_good)
    assert summary(again.stdout)["tokens computed"] == 0


@pytest.mark.parametrize("make, reason", [
    (lambda tmp: tmp / "missing.jsonl", "No such file or directory"),
    (lambda tmp: tmp, "is a directory"),
])
def test_warm_unreadable_prompt_file(capsys, tmp_path, make, reason):
    path = make(tmp_path)
    code, _, err = in_process(capsys, "warm", "--store", tmp_path / "s", "--prompts", path)
    assert code == 1
    assert err.startswith(f"kvstore warm: error: cannot read the prompt file {path}: {reason}")
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()  # nothing was opened before the file was read


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "no-such-model", "does not exist"),
    (lambda tmp: tmp, "has no config.json"),
    (lambda tmp: _write(tmp / "model.safetensors", b"weights"), "is a file, not a model folder"),
    (lambda tmp: _write(tmp / "config.json", b'{"model_type": "llama",}').parent, "config.json is not valid JSON"),
])
def test_bad_model_path(capsys, tmp_path, make, message):
    model = make(tmp_path)
    code, _, err = in_process(capsys, "warm", "--store", tmp_path / "s", "--model", model, "--prompts", EXAMPLES)
    assert code == 1
    assert err.startswith("kvstore warm: error: ") and str(model) in err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()


def test_store_that_cannot_be_created(capsys, demo_model_path, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code, _, err = in_process(capsys, "warm", "--store", blocker / "store", "--model", demo_model_path,
                              "--prompts", EXAMPLES)
    assert code == 1
    assert err.strip().startswith(f"kvstore warm: error: cannot create the store directory {blocker / 'store'}")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["stats", "verify", "gc --max-bytes 1MB"])
def test_maintenance_commands_need_an_existing_store(capsys, tmp_path, command):
    code, _, err = in_process(capsys, *command.split(), "--store", tmp_path / "nothing")
    assert code == 1 and f"no kvstore store at {tmp_path / 'nothing'}" in err
    assert not (tmp_path / "nothing").exists()


def test_ctrl_c_during_warm_stops_cleanly(demo_model_path, home, tmp_path):
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(40):  # distinct from the first token on: nothing is shared
            f.write(json.dumps({"id": i, "prompt": f"{i} " + f"lorem ipsum dolor sit amet {i} " * 60}) + "\n")
    store = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "warm", "--store", str(store),
                             "--model", str(demo_model_path), "--prompts", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"})
    try:
        seen = []
        while not (seen and seen[-1].startswith("[1/40]")):  # wait until the first prompt is done
            seen.append(proc.stderr.readline())
            assert seen[-1] and len(seen) < 20, seen
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    numbers = summary(out)
    assert numbers["tokens computed"] > 0
    warmed = int(re.search(r"^prompts: (\d+) warmed", out, re.M).group(1))
    assert 1 <= warmed < 40
    # Everything reported as written is durable, and the store is whole.
    assert problems_of(store) == []
    stats = stats_of(store)
    assert stats["bytes"] == numbers["bytes written"] > 0 and stats["chunks"] > 0


# -- generate ---------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "baichuan_m1"])  # recurrent state needs a checkpoint
def test_generate_twice_shows_reuse(kv, demo_model, tmp_path, arch):
    args = ("generate", "--store", tmp_path / "s", "--model", demo_model(arch), "--max-tokens", 8,
            "--prompt", "You are a helpful assistant. Answer briefly. What is a KV cache?")
    first, second = kv(*args), kv(*args)
    [(n, reused, computed)] = report(first.stderr)
    assert reused == 0 and computed == n
    assert report(second.stderr) == [(n, n - 1, 1)]
    assert "time to first token:" in second.stderr
    assert first.stdout.strip() and first.stdout == second.stdout  # greedy: same text from the store
    # Prompt and generated tokens were stored: exactly what the cache had processed.
    stored = int(re.search(r"cache of (\d+) tokens: \1 on disk", first.stderr).group(1))
    assert n < stored <= n + 8
    assert problems_of(tmp_path / "s") == []


def test_generate_reuses_what_warm_stored(kv, store_copy, demo_model_path, tmp_path):
    system = json.loads(EXAMPLES.read_text().splitlines()[0])["messages"][0]
    question = [system, {"role": "user", "content": "Do you repair cargo bikes on Sundays?"}]
    result = kv("generate", "--store", store_copy, "--model", demo_model_path, "--max-tokens", 4,
                "--messages", json.dumps(question))
    [(n, reused, _)] = report(result.stderr)
    assert reused >= len(system["content"])  # the byte-level tokenizer: a token per byte

    two = tmp_path / "two.jsonl"
    two.write_text("\n".join([*EXAMPLES.read_text().splitlines()[1:3], '{"tokens": [1, 999]}']) + "\n")
    result = kv("generate", "--store", store_copy, "--model", demo_model_path, "--max-tokens", 4, "--prompts", two,
                code=1)
    assert f"kvstore generate: {two}:3: tokens[1]: 999 is outside the model's vocabulary" in result.stderr
    assert [r[1] for r in report(result.stderr)] == [r[0] - 1 for r in report(result.stderr)]
    assert len(report(result.stderr)) == 2
    assert "[brakes]" in result.stdout and "[warranty]" in result.stdout
    assert "pins nothing" not in result.stderr  # (no line of these asks for a pin)
    pinned = kv("generate", "--store", store_copy, "--model", demo_model_path, "--max-tokens", 1, "--prompts", EXAMPLES)
    assert (f'kvstore generate: pins nothing: "pin" of {EXAMPLES}:1 (id hours) is for `kvstore warm`, which pins '
            "what it stores") in pinned.stderr, pinned.stderr


def test_generate_bad_input(capsys, tmp_path):
    code, _, err = in_process(capsys, "generate", "--store", tmp_path / "s", "--messages", '[{"role": "user"')
    assert code == 2 and "--messages: not valid JSON" in err  # a bad command line
    code, _, err = in_process(capsys, "generate", "--prompt", "hi", "--messages", "[]")
    assert code == 2 and "not allowed with argument" in err
    code, _, err = in_process(capsys, "generate", "--store", tmp_path / "s", "--prompt", "hi", "--max-tokens", 0)
    assert code == 2 and "kvstore generate: error: argument --max-tokens: must be at least 1, got 0" in err
    for option, value, said in (("--seed", "-5", "must be at least 0"), ("--seed", str(2**70), "at most"),
                                ("--temp", "nan", "a finite number of 0 or more"), ("--temp", "-1", "0 or more")):
        code, _, err = in_process(capsys, "generate", "--store", tmp_path / "s", "--prompt", "hi", option, value)
        assert code == 2 and f"argument {option}: " in err and said in err and "Traceback" not in err, err


def test_default_model_and_store_location(kv, home, tmp_path):
    store = tmp_path / "env-store"
    result = kv("generate", "--max-tokens", 2, "--prompt", "Hello", env={"KVSTORE_DIR": str(store)})
    assert result.stderr.count(DEMO_NOTE) == 1
    assert (store / "index.sqlite").exists()
    [model] = stats_of(store)["models"]
    assert model["model_id"].startswith(str(home / ".cache" / "kvstore-demo" / "llama-small"))


# -- gc, stats, verify ------------------------------------------------------------------------

def test_gc_keeps_within_budget(kv, capsys, store_copy):
    before = stats_of(store_copy)["bytes"]
    budget = 2_000_000
    assert before > budget
    code, dry, _ = in_process(capsys, "gc", "--store", store_copy, "--max-bytes", "2MB", "--dry-run")
    assert code == 0 and dry.startswith("would free ")
    assert stats_of(store_copy)["bytes"] == before

    result = kv("gc", "--store", store_copy, "--max-bytes", "2MB")
    freed = int(re.search(r"^freed .* \((\d+) bytes, (\d+) records\)", result.stdout).group(1))
    after = stats_of(store_copy)["bytes"]
    assert after <= budget and after == before - freed
    assert re.search(r"\((\d+) bytes", dry).group(1) == str(freed)
    assert problems_of(store_copy) == []


def test_gc_keeps_pinned_prompts(kv, capsys, store_copy, demo_model_path):
    code, _, err = in_process(capsys, "gc", "--store", store_copy, "--max-bytes", 0)
    assert code == 0 and "is held by pinned records and their ancestors" in err
    assert problems_of(store_copy) == []
    with sqlite3.connect(store_copy / "index.sqlite") as db:
        assert db.execute("SELECT count(*) FROM records WHERE pinned = 0").fetchone()[0] == 0
    # The pinned prompt (line 1) is still whole: warming it again computes nothing.
    first = store_copy.parent / "first.jsonl"
    first.write_text(EXAMPLES.read_text().splitlines()[0] + "\n")
    again = kv("warm", "--store", store_copy, "--model", demo_model_path, "--prompts", first)
    assert summary(again.stdout)["tokens computed"] == 0


def test_gc_max_age_and_bad_values(capsys, store_copy):
    code, out, _ = in_process(capsys, "gc", "--store", store_copy, "--max-age", "0s", "--dry-run")
    assert code == 0 and out.startswith("would free ")
    code, _, err = in_process(capsys, "gc", "--store", store_copy, "--max-bytes", "5XB")
    assert code == 2 and "argument --max-bytes: '5XB': unknown size unit" in err
    code, _, err = in_process(capsys, "gc", "--store", store_copy, "--max-age", "soon")
    assert code == 2 and "argument --max-age: 'soon' is not a duration" in err
    code, _, err = in_process(capsys, "gc", "--store", store_copy)
    assert code == 2 and "gc needs --max-bytes and/or --max-age" in err


def test_stats(kv, capsys, warmed, demo_model_path):
    store, _ = warmed
    expected = stats_of(store)
    text = kv("stats", "--store", store).stdout
    [model] = expected["models"]
    assert f"bytes: {expected['bytes']} " in text and f"chunks: {expected['chunks']} " in text
    row = next(l for l in text.splitlines() if l.startswith(model["fingerprint"][:12]))
    assert row.endswith(str(demo_model_path)) and f" {model['chunks']} " in row

    code, out, _ = in_process(capsys, "stats", "--store", store, "--json")
    data = json.loads(out)
    for key in ("bytes", "chunks", "tails", "models"):
        assert data[key] == expected[key] if key != "models" else len(data[key]) == 1
    assert data["models"][0]["fingerprint"] == model["fingerprint"]


def test_output_to_a_reader_that_goes_away_ends_quietly(warmed):
    """`kvstore stats | head -n 1`: the rest of the output has nowhere to go, and no traceback."""
    store, _ = warmed
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "stats", "--store", str(store)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.close()  # before anything is printed
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and err.decode() == ""


def test_python_dash_m_kvstore_is_the_command(warmed):
    """`python -m kvstore` failed with "No module named kvstore.__main__"; it is the command."""
    store, _ = warmed
    via_m = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--store", str(store), "--json"],
                           capture_output=True, text=True, cwd=REPO, timeout=300)
    via_cli = subprocess.run([sys.executable, "-m", "kvstore.cli", "stats", "--store", str(store), "--json"],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
    assert via_m.returncode == 0, via_m.stderr
    assert json.loads(via_m.stdout)["models"] == json.loads(via_cli.stdout)["models"] != []


def test_verify_finds_and_repairs_damage(kv, capsys, store_copy, monkeypatch):
    # (The remote tests' session exports a fleet secret, which changes verify's last line.)
    monkeypatch.delenv("KVSTORE_REMOTE_KEY", raising=False)
    blobs = sorted((store_copy / "blobs").rglob("*.safetensors"))
    blobs[0].unlink()
    blobs[1].write_bytes(blobs[1].read_bytes()[:100])
    (blobs[2].parent / "notes.txt").write_text("not a blob")

    found = kv("verify", "--store", store_copy, "--json", code=1)
    kinds = {p["kind"] for p in json.loads(found.stdout)["problems"]}
    assert {"missing_blob", "corrupt_blob", "foreign_file"} <= kinds
    orphans = [p["hash"] for p in json.loads(found.stdout)["problems"] if p["kind"] == "orphan_row"]
    assert len(orphans) > 2 and orphans == sorted(orphans)  # listed alike on every run, not in a set's order
    code, text, _ = in_process(capsys, "verify", "--store", store_copy)
    # The advice names the store it checked: without --store it would repair ~/.cache/kvstore.
    assert code == 1 and str(blobs[0]) in text and f"run `kvstore verify --repair --store {store_copy}`" in text

    with kvstore.open(store_copy) as store:
        was = store.stats()["bytes"]
    code, out, _ = in_process(capsys, "verify", "--store", store_copy, "--repair")
    with kvstore.open(store_copy) as store:
        now = store.stats()["bytes"]
    # It says what the records it dropped held, in the numbers `stats` gives.
    assert code == 1 and f"; repaired: the store holds {format_size(now)} (was {format_size(was)})" in out, out
    assert now < was
    assert problems_of(store_copy) == []
    code, out, _ = in_process(capsys, "verify", "--store", store_copy)
    assert code == 0 and out.strip() == f"the store {store_copy} is clean (trust tags checked with its own key)"


# -- first contact: what a new user meets first -------------------------------------

def test_every_command_uses_one_default_demo_model(capsys, monkeypatch, tmp_path):
    """warm/generate and serve default to the same demo model, so what `kvstore warm` stores
    is what `kvstore serve` reuses (they used to be two different models)."""
    from kvstore import demo
    from kvstore.serve import server

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = str(demo.ensure_demo_model())
    assert expected == str(demo.build_demo_model(**demo.DEFAULT_DEMO))
    assert model_to_load(argparse.Namespace(model=None)) == expected
    seen: list[list[str]] = []
    monkeypatch.setattr(server, "_run_mlx_server_main", lambda _server, args: seen.append(list(args)) or 0)
    assert server.main(["--store", str(tmp_path / "s")]) == 0
    [args] = seen
    assert args[args.index("--model") + 1] == expected
    assert capsys.readouterr().err.count(DEMO_NOTE) == 2  # once per command, as the design says


def _mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount here ({result.stderr.strip()})")


@pytest.mark.parametrize("how", ["read-only-blobs", "full-disk"])
def test_generate_whose_write_failed_says_not_stored(kv, demo_model_path, tmp_path, how):
    """A real read-only folder (a read-only bind mount of the blob tree) and a real full disk (a
    tmpfs filled to the last byte): generate still answers, says it stored nothing, exits 1."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    from test_faults_disk import TmpfsFull

    mount = tmp_path / "mnt"
    mount.mkdir()
    store = mount / "s" if how == "full-disk" else tmp_path / "s"
    if how == "full-disk":
        _mount("-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount))
    try:
        args = ("generate", "--store", store, "--model", demo_model_path, "--max-tokens", 4)
        first = kv(*args, "--prompt", "a first prompt, stored")
        assert re.search(r"; cache of (\d+) tokens: \1 on disk", first.stderr)
        # Another process (a server, say) has the store open while the disk fills up, so the
        # index's WAL files exist; with none open, SQLite could not even open the index.
        other = kvstore.open(store)
        if how == "full-disk":
            TmpfsFull(mount).fill()
        else:
            _mount("--bind", "-o", "ro", str(store / "blobs"), str(store / "blobs"))
        before = other.stats()
        try:
            failed = kv(*args, "--prompt", "another prompt that cannot be stored " * 20, code=1)
        finally:
            if how != "full-disk":
                subprocess.run(["umount", str(store / "blobs")], check=True)
            after = other.stats()
            other.close()
        assert failed.stdout.strip(), "the answer is still printed"
        assert "not stored (" in failed.stderr, failed.stderr
        assert "1 of 1 generations were not stored" in failed.stderr
        assert not re.search(r"; cache of \d+ tokens: [1-9]\d* on disk", failed.stderr)
        assert after["chunks"] == before["chunks"]  # nothing was added to the index either
    finally:
        if how == "full-disk":
            subprocess.run(["umount", str(mount)], check=True)


def test_warm_whose_writes_failed_says_why_its_tokens_are_not_on_disk(kv, demo_model_path, tmp_path):
    """Every blob write fails (the disk is full): each prompt's line and the summary say its
    tokens were not written because the write failed, and with what error (they said "not stored
    (not written)", which leaves the reader to guess), and warm exits 1."""
    from kvstore import faults

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "' + "a prompt of some length " * 30 + '"}\n'
                       '{"id": "b", "prompt": "' + "another prompt to store " * 30 + '"}\n')
    faults.arm("blob_write", "enospc")
    try:
        ran = kv("warm", "--store", tmp_path / "s", "--model", demo_model_path, "--prompts", prompts, code=1)
    finally:
        faults.disarm()
    failure = "not written; the write failed: OSError: [Errno 28] No space left on device"
    assert re.search(r"^on disk: 0 of 2 warmed prompts whole; 0 of (\d+) tokens \(\1 not on disk: "
                     + re.escape(failure), ran.stdout, re.M), ran.stdout
    lines = [line for line in ran.stderr.splitlines() if line.startswith("[")]
    assert len(lines) == 2 and all("not written" not in line or failure in line for line in lines), lines
    assert re.search(r"kvstore warm: \d+ writes? failed \(last error: OSError: .*No space left on device.*\): "
                     r"what they held is not on disk", ran.stderr), ran.stderr


def test_messages_must_be_a_list(capsys, tmp_path):
    code, _, err = in_process(capsys, "generate", "--store", tmp_path / "s", "--messages", '{"role": "user"}')
    assert code == 2 and "--messages: must be a list" in err and "got an object" in err
    assert not (tmp_path / "s").exists()  # refused before a store or a model was opened
    # The option names the field: not a second time, and a part of it in its own words.
    for option, value, said in (("--prompt", "", "--prompt: is empty"),
                                ("--messages", '[{"role": "user", "content": 5}]', "--messages[0].content: must be")):
        code, _, err = in_process(capsys, "generate", "--store", tmp_path / "s", option, value)
        assert code == 2 and f"kvstore generate: error: {said}" in err, err


def test_long_text_is_refused_before_it_is_tokenized(tmp_path):
    """A 100 MB line is refused before it is parsed; a text too long for the context before it is
    tokenized (which took minutes and gigabytes for 100 MB); both with file:line and the limit."""
    from kvstore.model import jsonl

    path = tmp_path / "p.jsonl"
    with path.open("wb") as f:
        f.write(b'{"prompt": "' + b"x" * 100_000_000 + b'"}\n')
        f.write(json.dumps({"prompt": "y" * 2_000_000}).encode() + b"\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "z" * 2_000_000}]}).encode() + b"\n")
        f.write(b'{"tokens": [1, 2, 3]}\n')

    class MustNotTokenize:
        def encode(self, *a, **kw):
            raise AssertionError("a text past the limit was tokenized")

    items = read_prompts(str(path))
    loaded = loading.LoadedModel(None, MustNotTokenize(), "m", 262, 32768)
    good, errors = loading.prepare(items, loaded)
    assert [item.kind for item, _ in good] == ["tokens"]
    messages = [str(e) for e in errors]
    assert messages[0].startswith(f"{path}:1: line of 100,000,014 bytes is longer than the limit of "
                                  f"{jsonl.MAX_LINE_BYTES:,} bytes")
    limit = 32768 * jsonl.MAX_CHARS_PER_TOKEN
    assert messages[1].startswith(f"{path}:2: prompt: skipped: 2,000,000 characters is more than the {limit:,}")
    assert messages[2].startswith(f"{path}:3: messages: skipped: 2,000,000 characters")


def _stored_whole(store: Path, model_path: Path, prompts: list[list[int]]) -> list[bool]:
    from mlx_lm import load

    model, _ = load(str(model_path))
    with kvstore.open(store) as s:
        mc = s.bind(model, model_path)
        return [mc.stored_length(p) == len(p) for p in prompts]


def test_ctrl_c_counts_a_prompt_stored_whole_as_warmed(demo_model_path, home, tmp_path):
    """Prompts of one chunk each: the Ctrl-C arrives while one is computed, and it is inserted
    before warm stops, so it is stored whole. The summary must count exactly the prompts that
    are stored whole as warmed (it used to count that one as "not reached")."""
    import numpy as np

    rng = np.random.default_rng(5)
    n = 60  # more than it can warm before the signal lands
    prompts = [[i + 1] + [int(t) for t in rng.integers(0, 250, 250)] for i in range(n)]
    path = tmp_path / "one-chunk.jsonl"
    path.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in prompts))
    store = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "warm", "--store", str(store),
                             "--model", str(demo_model_path), "--prompts", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"})
    try:
        seen = []
        while not (seen and seen[-1].startswith(f"[1/{n}]")):  # the first prompt is done
            seen.append(proc.stderr.readline())
            assert seen[-1] and len(seen) < 20, seen
        proc.send_signal(signal.SIGINT)  # while the second prompt is being computed
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    m = re.search(r"^prompts: (\d+) warmed, 0 skipped \(bad lines\), (\d+) not reached", out, re.M)
    warmed, not_reached = int(m.group(1)), int(m.group(2))
    whole = _stored_whole(store, demo_model_path, prompts)
    # The prompt in flight when the signal landed was finished, and is counted.
    assert warmed == sum(whole) >= 1, (warmed, whole)
    assert whole == [True] * warmed + [False] * (n - warmed)
    assert warmed + not_reached == n
    assert summary(out)["tokens computed"] == sum(len(p) for p in prompts[:warmed])


def test_stats_json_says_which_counters_are_per_process(capsys, warmed):
    """Every key `stats --json` prints has a scope, none unknown, and the same one the library's
    `Store.stats()` gives it; the library's keys are all scoped too."""
    from kvstore.store import stats_scope

    store, _ = warmed
    code, out, _ = in_process(capsys, "stats", "--store", store, "--json")
    data = json.loads(out)
    scope = data.pop("scope")
    assert set(scope) == set(data), "every key has a scope"
    assert "unknown" not in scope.values(), {k: v for k, v in scope.items() if v == "unknown"}
    for key in ("bytes", "chunks", "tails", "models"):
        assert scope[key] == "store"
    assert scope["read_only"] == "process"
    library = stats_of(store)
    library_scope = stats_scope(library)
    assert "unknown" not in library_scope.values(), {k: v for k, v in library_scope.items() if v == "unknown"}
    for key in ("memory", "writer", "quarantined", "fetches"):
        assert library_scope[key] == "process"
    assert {k: library_scope[k] for k in scope} == scope, "the command and the library agree"
    # Only the store's totals, and how this process opened it: a process that served nothing
    # has no counters to print.
    assert data["bytes"] > 0 and not {"memory", "writer", "fetches"} & set(data)
    assert "\"scope\"" in cli.build_parser()._subparsers._group_actions[0].choices["stats"].format_help()


def test_stats_json_layout_is_an_object(capsys, warmed):
    """A model's cache layout is JSON inside the JSON, not a string a reader must parse again."""
    store, _ = warmed
    code, out, _ = in_process(capsys, "stats", "--store", store, "--json")
    [model] = json.loads(out)["models"]
    assert code == 0 and isinstance(model["layout"], dict) and model["layout"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mlx[cpu] and its bundled BLAS are Linux's")
def test_a_long_prefill_on_the_bundled_blas_says_how_to_get_openblas(kv, demo_model_path, tmp_path):
    """Once per process, at the first prefill of 2,048 tokens or more, and not for a short one."""
    from kvstore.model.blas import LONG_PREFILL_TOKENS

    note = "kvstore: note: mlx is running on the reference BLAS bundled with the mlx-cpu wheel"
    # The demo tokenizer gives a token a character: a short prompt first, then two prompts that
    # share nothing, each long, all in one process.
    long = [json.dumps({"prompt": c * (LONG_PREFILL_TOKENS + 50)}) + "\n" for c in "ab"]
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello"}) + "\n" + "".join(long))
    no_openblas = {"LD_PRELOAD": ""}
    result = kv("generate", "--store", tmp_path / "s", "--model", demo_model_path, "--prompts", prompts,
                "--max-tokens", "1", env=no_openblas)
    assert result.stderr.count(note) == 1, result.stderr
    assert "sudo apt-get install libopenblas0-pthread; export LD_PRELOAD=" in result.stderr
    # The short prompt said nothing (its report comes before the note), the first long one said it.
    reports = [line for line in result.stderr.splitlines() if line.startswith("prompt: ") or note in line]
    assert len(reports) == 4 and reports[0].startswith("prompt: 5 tokens") and note in reports[1], result.stderr
    assert all(f"prompt: {LONG_PREFILL_TOKENS + 50} tokens, 0 reused" in r for r in reports[2:]), result.stderr
    openblas = Path(f"/usr/lib/{os.uname().machine}-linux-gnu/openblas-pthread/libblas.so.3")
    if openblas.exists():  # preloaded as the note says: nothing to say
        prompts.write_text(long[0])
        fixed = kv("generate", "--store", tmp_path / "s2", "--model", demo_model_path, "--prompts", prompts,
                   "--max-tokens", "1", env={"LD_PRELOAD": str(openblas)})
        assert note not in fixed.stderr and f"prompt: {LONG_PREFILL_TOKENS + 50} tokens" in fixed.stderr


def test_demo_store_is_ignored_by_git():
    assert ".demo-store/" in (REPO / ".gitignore").read_text().splitlines()


def test_user_text_is_printed_escaped(kv, demo_model_path, tmp_path):
    """Ids, model ids and paths are printed with non-printable characters escaped: a prompt file
    or a folder name cannot send escape sequences to the terminal."""
    model = tmp_path / "model\x1b[2J"
    shutil.copytree(demo_model_path, model)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "red\x1b[31m\u202e", "tokens": [1, 2, 3]}) + "\n"
                    + json.dumps({"prompt": "x", "pin\x07": True}) + "\n")
    store = tmp_path / "s"
    warm = kv("warm", "--store", store, "--model", model, "--prompts", path, code=1)
    generate = kv("generate", "--store", store, "--model", model, "--prompts", path, "--max-tokens", 2, code=1)
    stats = kv("stats", "--store", store)
    for text in (warm.stderr, generate.stdout, generate.stderr, stats.stdout):
        assert "\x1b" not in text and "\u202e" not in text and "\x07" not in text
    assert "(id red\\x1b[31m\\u202e)" in warm.stderr
    assert "[red\\x1b[31m\\u202e]" in generate.stdout
    assert 'unknown field "pin\\u0007"' in warm.stderr
    assert "model\\x1b[2J" in stats.stdout


def test_what_warm_stores_by_default_is_what_serve_reuses(kv, monkeypatch, tmp_path):
    """The user's path: `kvstore warm` with no --model, then `kvstore serve` with no --model on
    the same store. The model serve would load finds the whole warmed prompt (it found 46 of
    1,065 tokens when serve's default was another demo model)."""
    from mlx_lm import load

    from kvstore.serve import server

    home = tmp_path / "home"
    first = tmp_path / "first.jsonl"
    first.write_text(EXAMPLES.read_text().splitlines()[0] + "\n")
    store = tmp_path / "s"
    kv("warm", "--store", store, "--prompts", first, env={"HOME": str(home)})
    monkeypatch.setenv("HOME", str(home))
    seen: list[list[str]] = []
    monkeypatch.setattr(server, "_run_mlx_server_main", lambda _server, args: seen.append(list(args)) or 0)
    assert server.main(["--store", str(store)]) == 0
    model_path = seen[0][seen[0].index("--model") + 1]
    model, tokenizer = load(model_path)
    messages = json.loads(first.read_text())["messages"]
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)  # as mlx_lm.server does
    with kvstore.open(store) as s:
        cache, rest = s.bind(model, model_path).fetch(tokens)
    assert len(tokens) > 1000 and len(rest) == 1


def test_tenant_bounds_are_refused_for_the_bucket(tmp_path):
    """The bucket is bounded as a whole: a tenant's quota or drop given with --remote would do
    nothing there, so it is refused, before any request."""
    for option in (("--tenant-max-bytes", "1MB"), ("--drop-tenant", "0" * 16)):
        result = run_cli("gc", "--store", tmp_path / "s", "--remote", "s3://nowhere/p", *option, check=False)
        assert result.returncode == 2 and "without --remote" in result.stderr, result.stderr


def test_an_index_that_fails_under_a_command_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    """A full disk (or an index's -wal taken away) makes SQLite fail under a command: one line that
    says what to do, exit 1 (it was a traceback)."""
    import sqlite3

    from kvstore.cli.main import main
    from kvstore.upkeep.local import LocalStore

    with kvstore.open(tmp_path / "s"):
        pass

    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(LocalStore, "gc", full)
    assert main(["gc", "--store", str(tmp_path / "s"), "--max-bytes", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvstore gc: error: the store's index failed (database or disk is full): free some space")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_prompt_cut_short_by_ctrl_c_is_said_with_what_of_it_is_stored(capsys, demo_model_path, tmp_path,
                                                                        monkeypatch):
    """The Ctrl-C lands inside a prompt of several chunks: the chunks before it are stored, and the
    summary says so ("1 cut short (512 of its 900 tokens stored)"), not that it was not reached."""
    import kvstore.cli.warm as warm

    class LateCtrlC:  # as if Ctrl-C were pressed once the second prompt's second chunk is computed
        asked = 0

        def __init__(self, *args):
            pass

        @property
        def requested(self):
            LateCtrlC.asked += 1
            return LateCtrlC.asked > 6

        def __call__(self, signum, frame):
            pass

    monkeypatch.setattr(warm, "FirstCtrlC", LateCtrlC)
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"tokens": [i + 1] + [7 + (j * 13 + i) % 200 for j in range(899)]}) + "\n"
                            for i in range(3)))
    code, out, err = in_process(capsys, "warm", "--store", tmp_path / "s", "--model", demo_model_path,
                                "--prompts", path)
    assert code == 130, err
    m = re.search(r"^prompts: (\d) warmed, 0 skipped \(bad lines\), 1 cut short \((\d+) of its 900 tokens "
                  r"stored\), (\d) not reached", out, re.M)
    assert m and int(m.group(2)) % 256 == 0 and 0 < int(m.group(2)) < 900, out
    assert int(m.group(1)) + 1 + int(m.group(3)) == 3


def test_warm_summary_counts_each_reason_once_and_says_record_in_the_singular(capsys):
    """The summary's counts read as written: one reason is not given its count twice, several are
    each counted, and one record is not `1 records`."""
    from kvstore.cli.warm import _summary
    from kvstore.write.placement import Placement

    def summary(placed, records):
        _summary({"done": len(placed), "reused": 0, "computed": 0}, 0, len(placed),
                 {"bytes_written": 100, "records_written": records}, 0.1, placed)
        return capsys.readouterr().out

    out = summary([Placement(tokens=10, on_disk=10), Placement(tokens=8, in_ram=8, why={"evicted": 8})], 1)
    assert "on disk: 1 of 2 warmed prompts whole; 10 of 18 tokens (8 not on disk: evicted since written)\n" in out
    assert "bytes written: 100 (100 B, 1 record)\n" in out
    out = summary([Placement(tokens=9, on_disk=1, in_ram=8, why={"evicted": 5, "not_admitted": 3})], 2)
    assert "(8 not on disk: evicted since written: 5, not admitted: 3; those in RAM are lost at exit)" in out
    assert "(100 B, 2 records)" in out


def test_warm_summary_says_a_prompt_held_by_a_longer_record_evicted_since_was_evicted_not_unwritten(llama, tmp_path,
                                                                                                      capsys):
    """A prompt that is a prefix of one stored before is not written: the longer prompt's tail
    holds its tokens, and its line says all of them are on disk. When a gc (another process's,
    say) evicts that tail before the summary, the summary says those tokens were evicted since
    written, in the longer record, not "not written" (it found neither a row nor a deletion of the
    prompt's own record)."""
    import numpy as np

    from kvstore.cli.warm import _summary, _warm_all, placed_now
    from kvstore.model.jsonl import PromptLine

    path, model = llama
    longer = np.random.default_rng(7).integers(1, 250, 44).tolist()  # two chunks of 16 and a tail of 12
    prefix = longer[:40]  # its tail (8 tokens) lies inside the longer prompt's
    work = [(PromptLine("p.jsonl", n, "tokens", t), t) for n, t in ((1, longer), (2, prefix))]
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        mc = store.bind(model, str(path))
        totals = {"done": 0, "reused": 0, "computed": 0, "warmed": [], "from_bucket": 0}
        _warm_all(mc, work, totals, lambda: False)
        assert store.flush()
        assert "p.jsonl:2: 40 tokens, 40 reused, 0 computed, 40 on disk (" in capsys.readouterr().err
        tail = [r for r in store.index.rows() if r.ntokens == 12]
        assert len(tail) == 1 and len(list(store.index.rows())) == 3  # the prefix's own tail was never written
        assert store.gc(max_bytes=store.index.totals()["bytes"] - 1)["evicted"] == 1  # the longer tail: the leaf
        assert store.index.get(tail[0].hash) is None
        _summary(totals, 0, len(work), store.stats()["writer"], 0.1, placed_now(mc, totals))
    out = capsys.readouterr().out
    assert ("on disk: 0 of 2 warmed prompts whole; 64 of 84 tokens (20 not on disk: evicted since written: 12, "
            "evicted since written (held in a longer record): 8)\n") in out, out
    assert "not written" not in out, out


def test_generate_under_a_disk_budget_too_small_says_what_is_left_on_disk(kv, demo_model_path, tmp_path):
    """A budget smaller than the record: its gc evicts it right after the write, and the report
    says so, as `stats` sees the store, not `on disk`."""
    result = kv("generate", "--store", tmp_path / "s", "--model", demo_model_path, "--max-tokens", 2,
                "--store-max-bytes", "10KB", "--prompt", "a prompt whose cache is larger than the budget")
    assert re.search(r"cache of (\d+) tokens: 0 on disk, \1 not stored \(evicted since written\)", result.stderr), \
        result.stderr
    with kvstore.open(tmp_path / "s") as store:
        assert store.stats()["bytes"] == 0


def test_the_commands_a_report_suggests_name_the_store_it_ran_on(kv, store_copy, demo_model_path, tmp_path):
    """`stats --store S` said "`kvstore settings` shows them all" and "`kvstore gc --stale`
    evicts it", and gc "`kvstore pins` lists them": run as printed, each acted on the default
    store, not on S. Each now names S, as verify's `verify --repair --store S` does."""
    store, model = tmp_path / "s", Path(shutil.copytree(demo_model_path, tmp_path / "model"))
    kv("generate", "--store", store, "--model", model, "--prompt", "hi", "--max-tokens", "1")
    (model / "config.json").write_text((model / "config.json").read_text() + " ")  # its records go stale
    kv("settings", "--store", store, "admit=reused")
    stats = kv("stats", "--store", store).stdout
    assert f"(`kvstore settings --store {store}` shows them all)" in stats, stats
    assert f"`kvstore gc --stale --store {store}` evicts it" in stats, stats
    gc = kv("gc", "--store", store_copy, "--max-bytes", "0").stderr
    assert f"(`kvstore pins --store {store_copy}` lists them)" in gc, gc


@pytest.mark.parametrize("at", ["prefill", "generation"])
def test_ctrl_c_in_generate_stores_what_was_computed(capsys, llama, tmp_path, monkeypatch, at):
    """A first Ctrl-C during generate's prefill stops after the step in progress (mlx-lm's 2,048
    tokens), during its answer after the token in progress: either way what the cache holds is
    stored and said, and the command exits 130. Before, an interrupted generate stored nothing."""
    import kvstore.cli.generate as generate

    class LateCtrlC:  # as if Ctrl-C were pressed after the first prefill step, or the second token
        asked = 0

        def __init__(self, *args):
            LateCtrlC.asked = 0

        @property
        def requested(self):
            LateCtrlC.asked += 1
            return LateCtrlC.asked > (1 if at == "prefill" else 4)

        def __call__(self, signum, frame):
            pass

    monkeypatch.setattr(generate, "FirstCtrlC", LateCtrlC)
    path, model = llama
    tokens = [1 + (i * 11) % 250 for i in range(2100 if at == "prefill" else 300)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"tokens": tokens}) + "\n" + json.dumps({"tokens": tokens[::-1]}) + "\n")
    code, _, err = in_process(capsys, "generate", "--store", tmp_path / "s", "--model", path, "--prompts", prompts,
                              "--max-tokens", "8")
    assert code == 130 and err.rstrip().endswith("kvstore generate: interrupted"), err
    lines = [line for line in err.splitlines() if line.startswith("prompt: ")]
    assert len(lines) == 1, err  # the second prompt was not reached
    with kvstore.open(tmp_path / "s") as store:
        reused = len(tokens) + 1 - len(store.bind(model, path).fetch(tokens + [5])[1])
    if at == "prefill":
        assert "2048 of 2100 computed; interrupted before the first token; generated 0 tokens (interrupted)" \
            in lines[0], lines
        assert reused == 2048  # 8 chunks of 256: the whole first step
    else:
        assert "generated 2 tokens (interrupted)" in lines[0] and "time to first token" in lines[0], lines
        assert reused == len(tokens)
