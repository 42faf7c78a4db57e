"""Fault suite, part 2: hostile input and permissions.

Paths with `..`, symbolic links inside the store, blobs whose header lies about their record,
token ids beyond int32, NaN/inf K/V, prompt files with huge lines and deeply nested JSON (through
the `kvstore` command): each is refused with a clear error or served safely, and nothing outside
the store is read, written or deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from faultproc import Child, prompts
from kvtest import logits_diff, prefill

import kvstore
from kvstore import keys
from kvstore.errors import InvalidInputError
from kvstore.storage import blobtree

C = 16
TOL = 1e-4


def stored(tmp_path, llama, tokens) -> tuple[Path, list]:
    """A store holding `tokens`; its rows, shallowest first."""
    model_path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, model_path).insert(tokens, prefill(model, tokens))
        store.flush()
        rows = sorted(store.index.rows(), key=lambda r: r.depth)
    return tmp_path / "s", rows


def tree(path: Path) -> dict[str, bytes]:
    """Every file under `path` (not following links) with its bytes, to prove nothing changed."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for name in files:
            p = Path(dirpath) / name
            out[str(p.relative_to(path))] = os.readlink(p).encode() if p.is_symlink() else p.read_bytes()
    return out


# -- paths and symbolic links -----------------------------------------------------------------

def test_store_path_with_dotdot_stays_where_it_points(tmp_path, llama):
    model_path, model = llama
    tokens = prompts(20, 1, C)[0]
    with kvstore.open(tmp_path / "gone" / ".." / "s", chunk_size=C) as store:
        assert Path(store.stats()["path"]) == tmp_path / "s"
        store.bind(model, model_path).insert(tokens, prefill(model, tokens))
        store.flush()
    assert sorted(os.listdir(tmp_path)) == ["s"]  # no "gone" folder made on the way
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        assert store.bind(model, model_path).fetch(tokens)[1] == tokens[-1:]
    # Names inside the store come only from hashes: a hostile model id changes nothing.
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, model_path, fingerprint=b"\x00" * 16)
        mc.model_id = "../../etc/passwd"
        mc.insert(tokens, prefill(model, tokens))
        store.flush()
    assert sorted(os.listdir(tmp_path)) == ["s"]
    for p in blobtree.walk(tmp_path / "s" / "blobs"):
        assert blobtree.hash_of(p) is not None


def test_symlinked_blob_file_is_not_read_through(tmp_path, llama):
    model_path, model = llama
    tokens = prompts(21, 1, C)[0][: 2 * C] + list(range(40, 40 + C + 3))
    store, rows = stored(tmp_path, llama, tokens)
    outside = tmp_path / "outside"
    outside.mkdir()
    target = blobtree.blob_path(store / "blobs", rows[1].hash)
    copy = outside / "copy.safetensors"
    shutil.copy(target, copy)  # the very same bytes: only the link itself is wrong
    target.unlink()
    target.symlink_to(copy)
    before = tree(outside)
    with kvstore.open(store, chunk_size=C, memory_bytes=0) as s:
        mc = s.bind(model, model_path)
        query = tokens + [5]
        cache, rest = mc.fetch(query)
        assert len(query) - len(rest) == C  # the linked record is not served
        assert logits_diff(model, cache, rest, query) <= TOL
        assert s.stats()["quarantined"] == 1
        assert "quarantined" in {p.kind for p in s.verify()}
        s.verify(repair=True)
        assert s.verify() == []
        assert not os.path.lexists(target)
    assert tree(outside) == before  # the link went, not what it pointed to


def test_symlinked_folders_in_the_blob_tree_are_never_followed(tmp_path, llama):
    model_path, model = llama
    tokens = prompts(22, 1, C)[0]
    store, rows = stored(tmp_path, llama, tokens)
    root = store / "blobs"
    outside = tmp_path / "outside"
    (outside / "cd").mkdir(parents=True)
    (outside / "precious.txt").write_text("keep me")
    used = {p.name for p in root.iterdir()}
    with kvstore.open(store, chunk_size=C) as s:
        ns = s.bind(model, model_path).ns
    # The next record, chosen so that its folder is not one a stored record already uses.
    for start in range(60, 260):
        new = tokens + [t % 250 for t in range(start, start + C)]
        h = keys.chain(ns, np.asarray(new), C)[len(tokens) // C]
        if h.hex()[:2] not in used:
            break
    # A planted link named like a blob folder, but not the folder of a stored record nor of the
    # next one (with a fixed name, 1 run in 256 collided with a real folder).
    taken = used | {h.hex()[:2]}
    planted = next(f"{i:02x}" for i in range(256) if f"{i:02x}" not in taken)
    (outside / "cd" / (planted + "cd" + "1" * 28 + ".safetensors")).write_bytes(b"not yours")
    (root / planted).symlink_to(outside, target_is_directory=True)
    # Where the next record will be written: its first folder is a link out of the store.
    with kvstore.open(store, chunk_size=C) as s:
        mc = s.bind(model, model_path)
        first = root / h.hex()[:2]
        assert not first.exists()
        (outside / "w").mkdir()
        first.symlink_to(outside / "w", target_is_directory=True)
        before = tree(outside)
        mc.insert(new, prefill(model, new))
        s.flush()
        assert s.stats()["writer"]["write_errors"] == 1  # refused, counted
        assert tree(outside) == before  # nothing written through the link
        kinds = sorted(p.kind for p in s.verify())
        assert kinds == ["foreign_file", "foreign_file"]  # both links, reported, not entered
        s.verify(repair=True)
        assert s.verify() == []
    assert tree(outside) == before and not os.path.lexists(root / planted)
    with kvstore.open(store, chunk_size=C, memory_bytes=0) as s:
        mc = s.bind(model, model_path)
        mc.insert(new, prefill(model, new))  # with the link gone the write goes through
        s.flush()
        assert mc.fetch(new)[1] == new[-1:]


# -- blobs that lie ---------------------------------------------------------------------------

def rewrite_blob(store: Path, h: bytes, edit_header) -> None:
    """Rewrite a blob's header and give its row the new size and checksum, so that only the
    content can tell it apart from a good record."""
    path = blobtree.blob_path(store / "blobs", h)
    buf = path.read_bytes()
    (n,) = struct.unpack_from("<Q", buf, 0)
    header = json.loads(buf[8 : 8 + n])
    edit_header(header)
    payload = buf[8 + n :]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    new = struct.pack("<Q", len(raw)) + raw + payload
    path.write_bytes(new)
    checksum = xxhash.xxh3_64_intdigest(new)
    with sqlite3.connect(store / "index.sqlite") as con:
        con.execute("UPDATE records SET size = ?, checksum = ? WHERE hash = ?",
                    (len(new), checksum - (1 << 64) if checksum >= 1 << 63 else checksum, h))
    con.close()


def _meta(key, value):
    def edit(header):
        header["__metadata__"][key] = value
    return edit


def _shape(name, shape):
    def edit(header):
        header[name]["shape"] = shape
    return edit


def _longer_token_axis(header):
    """`0.keys` claims twice the tokens (the bytes of `0.values`, which is gone)."""
    keys_, values = header["0.keys"], header.pop("0.values")
    keys_["shape"][2] *= 2
    keys_["data_offsets"][1] = values["data_offsets"][1]


def _dtype(header):
    header["2.keys"]["dtype"] = "I32"


LIES = {  # (which record: 0 first chunk, 1 second chunk, -1 tail), how its blob lies
    "hash-in-header": (1, _meta("hash", "ab" * 16)),
    "depth-in-header": (1, _meta("depth", "7")),
    "parent-in-header": (1, _meta("parent", "cd" * 16)),
    "namespace-in-header": (1, _meta("ns", "ef" * 16)),
    "heads-and-dim": (1, _shape("0.keys", [1, 4, C, 8])),
    "first-record-heads": (0, _shape("1.values", [1, 1, C, 32])),
    "tail-heads": (-1, _shape("3.keys", [1, 1, 3, 32])),
    "token-axis": (1, _longer_token_axis),
    "dtype": (1, _dtype),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_blob_whose_header_lies_is_a_miss_and_quarantined(tmp_path, llama, lie):
    model_path, model = llama
    tokens = prompts(23, 1, C)[0][: 2 * C] + list(range(70, 73))  # two chunks and a 3-token tail
    store, rows = stored(tmp_path, llama, tokens)
    which, edit = LIES[lie]
    rewrite_blob(store, rows[which].hash, edit)
    with kvstore.open(store, chunk_size=C, memory_bytes=0) as s:
        mc = s.bind(model, model_path)
        query = tokens + [1]
        cache, rest = mc.fetch(query)  # never raises, never a cache of the wrong shape
        reused = len(query) - len(rest)
        assert reused == rows[which].depth * C - C
        assert logits_diff(model, cache, rest, query) <= TOL
        assert s.stats()["quarantined"] == 1
        assert "quarantined" in {p.kind for p in s.verify()}
        s.verify(repair=True)
        assert s.verify() == []


# -- values -----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    [1, 2**31], [2**40], [-1, 3], [2**63 + 5],
    np.array([3, 2**31], dtype=np.int64), np.array([2**40], dtype=np.uint64),
    mx.array([1, 2**31 + 7], dtype=mx.int64),
])
def test_token_ids_beyond_int32_are_refused(tmp_path, llama, bad):
    model_path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, model_path)
        cache = prefill(model, [1, 2])
        for call in (lambda: mc.fetch(bad), lambda: mc.insert(bad, cache),
                     lambda: mc.stored_length(bad), lambda: mc.prefill(bad)):
            with pytest.raises(InvalidInputError, match=r"token \d+ is -?\d+: token ids must be in \[0, 2\*\*31\)"):
                call()
        store.flush()
        assert store.stats()["chunks"] + store.stats()["tails"] == 0


def test_a_canary_that_is_not_a_step_of_the_tokens_is_refused(tmp_path, llama):
    """`insert(..., canary=)` takes a `Canary` of one of its tokens (or of the one after them):
    text, or another prompt's canary, raised an AttributeError or was kept, and every later
    restore of the prompt would then miss it. Nothing is queued for a refused one."""
    from kvstore import canary as canaries

    model_path, model = llama
    tokens = prompts(24, 1, C)[0][: C + 5]
    cache, logits = prefill(model, tokens), np.arange(10.0)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, model_path)
        for canary, said in [("x", "not str"), (canaries.of(len(tokens) + 1, 5, logits), "past the 21 tokens"),
                             (canaries.of(3, tokens[3] + 1, logits), f"have {tokens[3]} there")]:
            with pytest.raises(InvalidInputError, match=f"canary: .*{said}"):
                mc.insert(tokens, cache, canary=canary)
        assert mc.stored_length(tokens) == 0
        assert mc.insert(tokens, cache, canary=canaries.of(len(tokens) - 1, tokens[-1], logits)) == 2
        assert mc.insert(tokens + [7], prefill(model, tokens + [7]), canary=canaries.of(
            len(tokens) + 1, 9, logits)) == 1  # (the step of the token after them: its record ends before it)


def test_nan_and_inf_in_a_cache_are_stored_as_computed(tmp_path, llama):
    """Decision (tests/README.md): K/V are stored bit for bit, NaN and inf included."""
    model_path, model = llama
    tokens = prompts(24, 1, C)[0][: C + 5]
    cache = prefill(model, tokens)
    n = len(tokens)
    for i, layer in enumerate(cache):
        pos = mx.arange(layer.keys.shape[2])[None, None, :, None]
        special = [mx.nan, mx.inf, -mx.inf, mx.nan][i]
        layer.keys = mx.where(pos % 3 == 0, special, layer.keys)
    mx.eval([c.state for c in cache])
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, model_path)
        mc.insert(tokens, cache)
        store.flush()
        w = store.stats()["writer"]
        assert (w["write_errors"], w["dropped_jobs"]) == (0, 0)
        # Another prompt, sharing nothing with the first (prompts() all share a system prompt: a
        # stored child of the same chunk would tie with the NaN tail and could be served instead).
        other = [int(t) for t in np.random.default_rng(25).integers(0, 250, 2 * C + 3)]
        other[0] = (tokens[0] + 1) % 250
        mc.insert(other, prefill(model, other))  # the writer is alive and well
        store.flush()
        assert store.stats()["writer"]["write_errors"] == 0
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        got, rest = store.bind(model, model_path).fetch(tokens + [1])
        assert rest == [1]
        for a, b in zip(got, cache):
            mine = np.array(a.keys[..., :n, :].view(mx.uint32))
            theirs = np.array(b.keys[..., :n, :].view(mx.uint32))
            assert (mine == theirs).all()  # bit for bit, NaN payloads too


# -- prompt files through the command line ----------------------------------------------------

def kvstore_cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def test_prompt_file_with_huge_lines_and_deep_nesting(tmp_path, llama):
    try:
        import kvstore.cli.main  # noqa: F401
        import kvstore.model.jsonl  # noqa: F401
    except ImportError:
        pytest.skip("the kvstore command line is not there yet")
    model_path, model = llama
    good = list(range(1, 40))
    lines = [
        json.dumps({"tokens": good, "id": "good"}),
        "[" * 200_000 + "]" * 200_000,  # deeper than any JSON parser's recursion
        '{"prompt": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001,
        json.dumps({"messages": [{"role": "user", "content": [[[[[[[[[[["deep"]]]]]]]]]]]}]}),
        json.dumps({"tokens": [5] * 3_000_000}),  # a 9 MB line, longer than the model's context
        json.dumps({"prompt": "x" * 5_000_000}),  # 5 MB of text in one line
        '{"tokens": [1, 2, 2147483648]}',
        '{"tokens": [1, 2, 1e400]}',
        "\x00\xff garbage",
    ]
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("\n".join(lines) + "\n")
    out = kvstore_cli("warm", "--prompts", prompt_file, "--store", tmp_path / "s", "--model", model_path)
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == 1, (out.stdout, out.stderr[-3000:])  # bad lines: reported, skipped
    for number in (2, 3, 7, 8, 9):
        assert f"prompts.jsonl:{number}" in out.stderr, (number, out.stderr[-3000:])
    with kvstore.open(tmp_path / "s") as store:
        mc = store.bind(model, model_path)
        assert mc.stored_length(good) == len(good)  # the good line was warmed all the same
    assert sorted(os.listdir(tmp_path)) == ["prompts.jsonl", "s"]



def test_a_field_given_twice_is_a_bad_line_and_json_messages_read_as_written():
    """JSON keeps the last of two equal keys: `"pin": true, "pin": false` would unpin silently."""
    import io

    from kvstore.model.jsonl import LineError, PromptLine, parse_stream

    lines = [b'{"prompt": "a", "pin": true, "pin": false}',
             b'{"messages": [{"role": "user", "content": "x", "content": "y"}]}',
             b'{"prompt": "tab\\there"}',
             b'{"prompt": "ok", "pin": true}']
    got = list(parse_stream(io.BytesIO(b"\n".join(lines) + b"\n"), "p.jsonl"))
    assert [type(g) for g in got] == [LineError, LineError, PromptLine, PromptLine]
    assert str(got[0]).startswith('p.jsonl:1: the field "pin" is given twice in one object')
    assert '"content" is given twice' in str(got[1])
    raw_tab = list(parse_stream(io.BytesIO(b'{"prompt": "a\tb"}\n'), "p.jsonl"))[0]
    assert str(raw_tab) == "p.jsonl:1: not valid JSON (Invalid control character at column 14)"


def test_utf16_files_and_lone_surrogates_are_named_not_garbled():
    """A UTF-16 file (PowerShell's `>`) was a "not UTF-8" line and then a JSON error on every
    other line; a lone surrogate escape ("\\ud83d") reached the tokenizer, whose error said
    "TextEncodeInput must be Union[...]"."""
    import io

    from kvstore.model.jsonl import LineError, PromptLine, parse_stream

    utf16 = '{"prompt": "a"}\r\n{"prompt": "b"}\r\n'.encode("utf-16")
    assert [str(g) for g in parse_stream(io.BytesIO(utf16), "p.jsonl")] == [
        "p.jsonl:1: the file is UTF-16 text (it starts with a UTF-16 byte order mark, as Windows tools write): "
        "save it as UTF-8"]
    lines = [b'{"prompt": "lone \\ud800 half"}',
             b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\udc00"}]}]}',
             b'{"prompt": "a pair \\ud83d\\ude00 is fine", "id": "\\udc00"}']
    got = list(parse_stream(io.BytesIO(b"\n".join(lines)), "p.jsonl"))
    assert str(got[0]).startswith("p.jsonl:1: prompt: holds '\\ud800', half of a UTF-16 surrogate pair")
    assert str(got[1]).startswith("p.jsonl:2: messages[0].content[0].text: holds '\\udc00'")
    assert isinstance(got[0], LineError) and isinstance(got[2], PromptLine) and got[2].value.endswith("\U0001f600 is fine")


def test_openai_style_messages_give_the_servers_tokens(tmp_path, llama):
    """Content as a list of text parts, a null content beside tool calls whose arguments are a JSON
    string, a tool message, a name: tokenized as `mlx_lm.server` does (its `process_message_content`,
    then the chat template), so what `warm` stores is what the server looks up. The parts list was
    handed to the template as it was (rendered as a Python list), and a null content refused."""
    import copy

    from kvtest import run_cli
    from mlx_lm.server import process_message_content
    from mlx_lm.utils import load_tokenizer

    from kvstore.model.jsonl import LineError, parse_stream

    model_path, model = llama
    tokenizer = load_tokenizer(model_path)
    chats = [
        [{"role": "system", "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]},
         {"role": "user", "content": [{"type": "text", "text": "Hi there"}], "name": "bob"}],
        [{"role": "user", "content": "What is 6 x 7?"},
         {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "mul", "arguments": '{"a": 6, "b": 7}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "42"}],
    ]
    bad = [([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}],
            'messages[0].content[0]: must be a {"type": "text", "text": ...} part, got a part of type "image_url"'),
           ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text: must be a string"),
           ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
              "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
            "messages[1].tool_calls[0].function.arguments: not valid JSON")]
    text = "".join(json.dumps({"messages": m}) + "\n" for m in chats + [b for b, _ in bad])
    parsed = list(parse_stream(__import__("io").BytesIO(text.encode()), "p.jsonl"))
    for got, (_, message) in zip(parsed[len(chats):], bad):
        assert isinstance(got, LineError) and message in str(got), str(got)

    server = []
    for messages in chats:
        messages = copy.deepcopy(messages)
        process_message_content(messages)
        server.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    (tmp_path / "p.jsonl").write_text(text)
    result = run_cli("warm", "--prompts", tmp_path / "p.jsonl", "--store", tmp_path / "s", "--model", model_path,
                     check=False)
    assert result.returncode == 1 and "prompts: 2 warmed, 3 skipped" in result.stdout, result.stderr
    with kvstore.open(tmp_path / "s") as store:
        mc = store.bind(model, model_path)
        for tokens in server:
            assert mc.stored_length(tokens) == len(tokens)

# -- permissions ------------------------------------------------------------------------------

def test_permissions_of_everything_kvstore_creates(tmp_path, llama):
    """0700 folders and 0600 files, whatever the umask: index, WAL, SHM, blob folders at both
    levels, blobs, a crashed writer's temporary file, and a rebuilt index."""
    model_path, model = llama
    old = os.umask(0)
    try:
        store = tmp_path / "s"
        with kvstore.open(store, chunk_size=C) as s:
            mc = s.bind(model, model_path)
            for p in prompts(26, 4, C):
                mc.insert(p, prefill(model, p))
            s.flush()
            names = set(os.listdir(store))
            assert {"index.sqlite", "index.sqlite-wal", "index.sqlite-shm"} <= names
            _check_modes(store)
        child = Child("warm", store, model_path, C, 27, 4, fault="blob_temp:kill:2")
        child.wait()
        assert any(p.name.startswith(blobtree.TMP_PREFIX) for p in blobtree.walk(store / "blobs"))
        _check_modes(store)  # the temporary file too
        from kvstore.upkeep.rebuild import rebuild_index

        (store / "index.sqlite").write_bytes(b"garbage" * 100)
        rebuild_index(store)
        with kvstore.open(store, chunk_size=C) as s:
            s.verify(repair=True)
            _check_modes(store)
    finally:
        os.umask(old)


def _check_modes(store: Path) -> None:
    assert store.stat().st_mode & 0o777 == 0o700
    for dirpath, dirnames, filenames in os.walk(store):
        for d in dirnames:
            assert (Path(dirpath) / d).stat().st_mode & 0o777 == 0o700, Path(dirpath) / d
        for f in filenames:
            if ".damaged-" in f:
                continue  # the moved-aside old index keeps the mode it had
            assert (Path(dirpath) / f).stat().st_mode & 0o777 == 0o600, Path(dirpath) / f


# -- a damaged page of the index --------------------------------------------------------------

def test_a_damaged_page_of_the_index_is_found_by_verify_and_rebuilt_by_repair(tmp_path, llama):
    """A page of `index.sqlite` whose cell pointers are garbage reads as rows of NULLs, or fails
    only the queries that reach it: verify says the index is damaged (not only a bad row that
    repair then never mends), bind says how to rebuild it, and repair rebuilds it from the blobs."""
    from kvtest import run_cli

    from kvstore.errors import CorruptIndexError

    model_path, model = llama
    tokens = prompts(41, 1, C)[0]
    store, rows = stored(tmp_path, llama, tokens)
    con = sqlite3.connect(store / "index.sqlite")
    page_size = con.execute("PRAGMA page_size").fetchone()[0]
    root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'models'").fetchone()[0]
    con.close()
    with open(store / "index.sqlite", "r+b") as f:  # the first cell pointers of the models' page
        f.seek((root - 1) * page_size + 8)
        f.write(b"\xde\xad\xbe\xef" * 3)

    checked = run_cli("verify", "--store", str(store), check=False)
    assert checked.returncode == 1
    assert f"the index {store / 'index.sqlite'} cannot be read" in checked.stderr
    assert "out of range" in checked.stderr and "kvstore verify --repair" in checked.stderr
    with kvstore.open(store, chunk_size=C) as s, pytest.raises(CorruptIndexError, match="verify --repair"):
        s.bind(model, model_path)

    repaired = run_cli("verify", "--repair", "--store", str(store), check=False)
    assert "rebuilt the index from the blob files: " + str(len(rows)) + " records" in repaired.stderr
    assert run_cli("verify", "--store", str(store), check=False).returncode == 0
    with kvstore.open(store, chunk_size=C) as s:
        cache, rest = s.bind(model, model_path).fetch(tokens + [7])
        assert rest == [7]
        assert logits_diff(model, cache, rest, tokens + [7]) <= TOL


def test_an_index_file_without_its_tables_is_not_called_missing(tmp_path, llama):
    """An index whose tables were only in its -wal (a new store killed, then that -wal damaged)
    is a file with no tables: the error says so, not that the file is missing, and repair
    rebuilds it from the blobs."""
    from kvtest import run_cli

    store, rows = stored(tmp_path, llama, prompts(42, 1, C)[0])
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        if (store / name).exists():
            os.unlink(store / name)
    con = sqlite3.connect(store / "index.sqlite")
    con.execute("PRAGMA user_version = 1")  # a database file of one page, and no table
    con.close()

    said = run_cli("stats", "--store", str(store), check=False)
    assert said.returncode == 1
    assert f"the index {store / 'index.sqlite'} holds no tables but" in said.stderr
    repaired = run_cli("verify", "--repair", "--store", str(store), check=False)
    assert f"rebuilt the index from the blob files: {len(rows)} records" in repaired.stderr


def test_lone_cr_line_endings_are_named():
    """A file with old Mac line endings (a lone CR) reads as one line; its error said only
    "Extra data at column 16", which does not tell the user what to change."""
    import io

    from kvstore.model.jsonl import PromptLine, parse_stream

    got = [str(g) for g in parse_stream(io.BytesIO(b'{"prompt": "a"}\r{"prompt": "b"}\r'), "p.jsonl")]
    assert got == ["p.jsonl:1: not valid JSON (Extra data at column 17): its lines end in a lone CR "
                   "(old Mac line endings); save the file with LF or CRLF line endings"]
    crlf = list(parse_stream(io.BytesIO(b'{"prompt": "a"}\r\n{"prompt": "b"}\r\n'), "p.jsonl"))
    assert [type(g) for g in crlf] == [PromptLine, PromptLine]
    two_values = [str(g) for g in parse_stream(io.BytesIO(b'{"prompt": "a"} {"prompt": "b"}\n'), "p.jsonl")]
    assert two_values == ["p.jsonl:1: not valid JSON (Extra data at column 17)"]
