"""`verify --exact` checks every restore point, names the tensor that differs, and fails when it
could not check.

- A query that branches off a stored prompt restores the prompt's prefix up to a record's end: a
  sliding window's K/V before the prompt's last window, a hybrid model's checkpoint before its
  end. The restore of the whole prompt never reads those; the certificate compares every record
  end the store restores at with the cold run there, so a record altered together with its
  checksums is caught there, and the table and `--json` name the tensor (layer.tensor@point).
- A record altered together with its checksums is named, by its hash, token range and tensor
  (the cause), apart from what differs after the restore point (its effect); a healthy store
  names none, and a difference only in what was computed after the restore point blames none.
- A prompt whose record does not read (a flipped byte) was checked only in part: exit 1, and the
  verdict says how many and why. A certificate that checked nothing exits 3.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from kvtest import alter_record, index_sql, run_cli

import kvstore
from kvstore.model.prefill import run
from kvstore.storage import blobtree

C, S = 16, 32


def toks(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def stored(path, model, model_dir, prompt, exact) -> list:
    with kvstore.open(path, chunk_size=C, exact_prefill=exact) as store:
        store.bind(model, model_dir).prefill(prompt)
        store.flush()
        return sorted(store.index.rows(), key=lambda r: (r.depth, r.kind))


def certify(path, model, model_dir, exact):
    with kvstore.open(path, chunk_size=C, exact_prefill=exact, read_only=True, memory_bytes=0) as store:
        return store.verify_exact(model, model_dir, sample=None)


@pytest.mark.parametrize("exact", [S, "off"])
def test_a_sliding_window_altered_before_the_prompts_last_window_is_caught(tmp_path, demo_model, exact):
    from mlx_lm import load

    model_dir = str(demo_model("gemma3_text"))  # layer 0 slides over a window of 32 tokens
    model = load(model_dir)[0]
    prompt = toks(150, 1)
    rows = stored(tmp_path / "s", model, model_dir, prompt, exact)
    healthy = certify(tmp_path / "s", model, model_dir, exact)
    assert healthy.ok and healthy.checks[0].restore_points >= 4, healthy.table()
    assert "restore points" in healthy.verdict()
    record = next(r for r in rows if r.kind == 0 and r.depth == (2 if exact == S else 4))  # ends at token 64
    alter_record(tmp_path / "s", record.hash, "0.keys", -5.0, strip_tag=True)
    # What the alteration does: a query branching off the prompt at token 70 restores those keys.
    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=exact, read_only=True, memory_bytes=0) as store:
        mc = store.bind(model, model_dir)
        query = prompt[:70] + [7, 8, 9]
        cache, rest = mc.fetch(query)
        assert len(query) - len(rest) >= 64
        differs = float(mx.abs(run(model, cache, rest, S) - run(model, mc.new_cache(), query, S)).max())
        assert differs > 1e-3
    report = certify(tmp_path / "s", model, model_dir, exact)
    assert not report.ok and report.verdict().startswith("MISMATCH"), report.table()
    (check,) = report.checks
    assert check.worst_tensor() == "0.keys@64" and "0.keys@64" in report.table()
    tensors = report.as_dict()["prompts"][0]["tensors"]
    assert tensors["0.keys"]["restored"] > 1 and not tensors["0.keys"]["bitwise"]
    assert tensors["1.keys"]["relative"] < 1e-4 and (tensors["1.keys"]["bitwise"] or exact == "off")
    said = ("are not bit for bit what a cold run computes" if exact == S else
            "differ by more than the bound (0.0001 of a tensor's largest value) from what a cold run computes")
    assert f"the K/V restored from 1 stored record {said} for the same tokens: record" in report.verdict()


def test_a_hybrid_checkpoint_before_the_prompts_end_is_caught(tmp_path, demo_model):
    from mlx_lm import load

    model_dir = str(demo_model("qwen3_5"))
    model = load(model_dir)[0]
    rows = stored(tmp_path / "s", model, model_dir, toks(150, 2), S)
    checkpoints = [r for r in rows if r.kind == 2]
    assert len(checkpoints) == 2  # at 128 (the last full step) and at the prompt's end
    alter_record(tmp_path / "s", checkpoints[0].hash, "0.1", -20.0, strip_tag=True)
    report = certify(tmp_path / "s", model, model_dir, S)
    assert not report.ok and "0.state.1@128" in report.table(), report.table()


def _branching_prompts(store_dir, llama, n: int) -> list:
    """`n` prompts over one 260-token start, prefilled in exact mode (steps of 256, the command's
    chunk size); the rows of their second chunks."""
    model_dir, model = llama
    base = toks(260, 3)
    with kvstore.open(store_dir, exact_prefill=256) as store:
        mc = store.bind(model, model_dir)
        for i in range(n):
            mc.prefill(base + toks(300 + 10 * i, 4 + i))
        store.flush()
        return [r for r in store.index.rows() if r.kind == 0 and r.depth == 2]


def _unreadable_then_verified(store, h: bytes, model_dir):
    """Flip a bit of record `h`'s blob (its checksum no longer holds), then `verify --exact` all."""
    path = blobtree.blob_path(store / "blobs", h)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40
    path.write_bytes(bytes(data))
    return run_cli("verify", "--store", store, "--exact", "--sample", "all", "--model", model_dir, check=False)


def test_a_record_that_does_not_read_fails_the_certificate(tmp_path, llama):
    model_dir, model = llama
    second = _branching_prompts(tmp_path / "s", llama, 3)
    result = _unreadable_then_verified(tmp_path / "s", second[0].hash, model_dir)
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("INCOMPLETE: 1 of the 3 stored prompts sampled"), last
    assert "was read only to token 256" in last and "checksum" in last and "the other 2 restore" in last
    assert "PARTIAL" in result.stdout
    hint = result.stdout.strip().splitlines()[-2]  # what to do about it, as docs/exact.md says
    assert hint.endswith(f"kvstore verify --repair --store {tmp_path / 's'}"), hint
    assert run_cli("verify", "--store", tmp_path / "s", "--repair", check=False).returncode == 1  # repaired
    again = run_cli("verify", "--store", tmp_path / "s", "--exact", "--sample", "all", "--model", model_dir)
    assert again.stdout.strip().splitlines()[-1].startswith("exact: 2 of 2"), again.stdout  # (the third dropped)


def test_a_shared_record_that_does_not_read_leaves_no_prompt_checked_whole_and_says_so(tmp_path, llama):
    """Every sampled prompt read only in part: the verdict does not speak of 'the other 0'."""
    model_dir, model = llama
    with kvstore.open(tmp_path / "s", exact_prefill=256) as store:
        mc = store.bind(model, model_dir)
        for i in range(2):
            mc.prefill(toks(600, 3) + toks(40, 4 + i))
        store.flush()
        shared = next(r for r in store.index.rows() if r.kind == 0 and r.depth == 2)
    result = _unreadable_then_verified(tmp_path / "s", shared.hash, model_dir)
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("INCOMPLETE: 2 of the 2 stored prompts sampled"), last
    assert last.endswith("none was checked whole") and "the other 0" not in last, last


def test_a_record_whose_trust_tag_does_not_hold_fails_the_certificate(tmp_path, llama, caplog):
    """A record altered with its checksums but not its trust tag reads whole, and the restore
    refuses it (a miss there): the certificate checks the prompt only up to it, as the restore
    does, and says so (it said `exact`, exit 0, over a prompt restored only in part). The
    read-only opening quarantines nothing and says so."""
    model_dir, model = llama
    second = _branching_prompts(tmp_path / "s", llama, 2)
    alter_record(tmp_path / "s", second[0].hash, "1.keys", 1.01)  # its tag kept: it no longer holds
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "s").rglob("*") if p.is_file())
    result = run_cli("verify", "--store", tmp_path / "s", "--exact", "--sample", "all", "--model", model_dir,
                     check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("INCOMPLETE: 1 of the 2 stored prompts sampled"), last
    assert "was read only to token 256" in last and "trust tag does not hold" in last
    assert result.stdout.strip().splitlines()[-2].endswith(f"kvstore verify --repair --store {tmp_path / 's'}")
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "s").rglob("*") if p.is_file()) == before
    with caplog.at_level(logging.WARNING, logger="kvstore"), kvstore.open(tmp_path / "s", read_only=True) as store:
        prompt = toks(260, 3) + toks(300, 4)  # (the first of `_branching_prompts`)
        _, rest = store.bind(model, model_dir).fetch(prompt)
        assert len(prompt) - len(rest) == 256  # a miss at the altered record
        assert store.stats()["quarantined"] == 1
    said = [r.getMessage() for r in caplog.records if "damaged record" in r.getMessage()]
    assert len(said) == 1 and "not quarantined (the store is open read-only" in said[0], said
    assert not index_sql(tmp_path / "s", "SELECT hash FROM records WHERE bad != 0")


def test_a_certificate_that_checked_nothing_exits_3(tmp_path, llama, demo_model):
    model_dir, model = llama
    with kvstore.open(tmp_path / "s", exact_prefill=256) as store:
        store.bind(model, model_dir).prefill(toks(40, 8))
    other = demo_model("llama", "tiny", "bfloat16")  # another model: none of its prompts is stored
    result = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", other, check=False)
    assert result.returncode == 3 and result.stdout.startswith("NOTHING CHECKED"), result.stdout
    result = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", model_dir, "--json")
    got = json.loads(result.stdout)
    assert got["ok"] and not got["checked_nothing"] and got["prompts"][0]["restore_points"] == 1
    # A tenant of a store that never stored one: no tenant key (a read-only opening must not make
    # one), so nothing of it can be checked; that said, not "open it once to write", exit 1.
    result = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", model_dir, "--tenant", "bob",
                     check=False)
    assert result.returncode == 3 and result.stdout.startswith("NOTHING CHECKED: the store"), result.stdout
    assert "has no tenant key" in result.stdout and "Traceback" not in result.stderr
    assert not (tmp_path / "s" / "tenant.key").exists()
    with kvstore.open(tmp_path / "s") as store:
        store.bind(model, model_dir, tenant="alice").prefill(toks(40, 9))
    result = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", model_dir, "--tenant", "bob",
                     check=False)
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stdout.startswith("NOTHING CHECKED: the store holds no prompt of this model for this tenant")
    empty = run_cli("verify", "--store", tmp_path / "s", "--exact", "--tenant", "", check=False)
    assert empty.returncode == 2 and "argument --tenant: a tenant id is 1 to 4096 bytes" in empty.stderr


def test_another_blas_is_named_when_an_exact_store_is_opened_and_when_it_mismatches(tmp_path, llama, caplog):
    """The store keeps what computed its exact-mode records (mlx, device, BLAS); a process that
    computes otherwise is told once when it binds, and `verify --exact` names it on a mismatch."""
    import logging

    from kvstore.model import blas

    model_dir, model = llama
    prompt = toks(80, 9)
    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=S) as store:
        mc = store.bind(model, model_dir)
        mc.prefill(prompt)
        store.flush()
        assert store.index.computed_with(mc.ns) == [blas.compute()]
        assert blas.compute().startswith("mlx ") and "BLAS" in blas.compute()
        store.index.add_computed_with(mc.ns, "mlx 0.1.0 on Device(gpu, 0), Accelerate")  # as a Mac would
        first = next(r for r in store.index.rows() if r.kind == 0)
    alter_record(tmp_path / "s", first.hash, "1.keys", 1.5, strip_tag=True)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        report = certify(tmp_path / "s", model, model_dir, S)
        certify(tmp_path / "s", model, model_dir, S)
    told = [r.getMessage() for r in caplog.records if "were computed with" in r.getMessage()]
    assert len(told) == 1 and "Accelerate" in told[0] and blas.compute() in told[0]
    assert not report.ok and "computed with mlx 0.1.0 on Device(gpu, 0), Accelerate" in report.verdict()
    assert "likely cause" in report.verdict() and report.as_dict()["likely_cause"]


def test_the_record_whose_restored_kv_differ_is_named(tmp_path, llama):
    """The restored K/V are compared with the cold run's over each record's tokens: the report
    names the altered record (hash, tokens, tensor), not only the K/V computed after the restore
    point, which the alteration changes too."""
    model_dir, model = llama
    with kvstore.open(tmp_path / "s", exact_prefill=256) as store:  # the command's chunk size
        store.bind(model, model_dir).prefill(toks(600, 10))
        store.flush()
        rows = sorted(store.index.rows(), key=lambda r: r.depth)
    healthy = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", model_dir, "--json")
    (prompt,) = json.loads(healthy.stdout)["prompts"]
    assert prompt["ok"] and prompt["differing_records"] == [] and prompt["worst_tensor"] is None
    second = next(r for r in rows if r.depth == 2)  # tokens [256, 512)
    alter_record(tmp_path / "s", second.hash, "2.values", 1.001, strip_tag=True)
    result = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", model_dir, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    named = f"record {second.hash.hex()[:12]} (tokens 256-512: most in 2.values"
    assert named in result.stdout.splitlines()[-1], result.stdout  # the verdict names it
    assert f"2.values@599 in {second.hash.hex()[:12]}" in result.stdout  # and the table
    assert set(re.findall(r"(?:record|checkpoint) ([0-9a-f]{12})", result.stdout)) == {second.hash.hex()[:12]}
    assert "computed after the restore point differ" in result.stdout  # the effect, apart
    got = json.loads(run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", model_dir, "--json",
                             check=False).stdout)["prompts"][0]
    assert [(r["record"], r["tokens"], r["tensor"], r["tensors"]) for r in got["differing_records"]] == [
        (second.hash.hex(), [256, 512], "2.values", ["2.values"])]
    assert got["worst_tensor"] == "2.values@599" and got["worst_after"] and not got["no_record_differs"]
    # What it says to do drops that record and the tail after it: the rest restores as a cold run.
    hint = next(line for line in result.stdout.splitlines() if line.startswith("to drop that record"))
    (blob,) = re.findall(r"rm (\S+) &&", hint)
    assert blob == str(blobtree.blob_path(tmp_path / "s" / "blobs", second.hash))
    Path(blob).unlink()
    assert run_cli("verify", "--store", tmp_path / "s", "--repair", check=False).returncode == 1  # repaired
    again = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", model_dir)
    assert "exact: 1 of 1" in again.stdout and "to drop" not in again.stdout


def test_a_difference_after_the_restore_point_alone_blames_no_record(tmp_path, llama, monkeypatch):
    """What the restored run computes after the restore point differs (as on another BLAS), the
    restored K/V do not: no record is named, and the report says the difference is not in one."""
    from kvstore.certify import compare

    model_dir, model = llama
    with kvstore.open(tmp_path / "s", exact_prefill=256) as store:
        store.bind(model, model_dir).prefill(toks(300, 11))
    real = compare.run

    def otherwise(model, cache, rest, step):  # the last token's K/V computed a little otherwise
        out = real(model, cache, rest, step)
        layer = cache[1]
        layer.keys[..., layer.offset - 1 :, :] *= 1.001
        return out

    monkeypatch.setattr(compare, "run", otherwise)
    result = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", model_dir, "--json", check=False)
    (prompt,) = json.loads(result.stdout)["prompts"]
    assert not prompt["ok"] and prompt["differing_records"] == [] and prompt["no_record_differs"]
    assert prompt["worst_after"] == "1.keys@299", prompt["problems"]
    assert "no stored record differs (none to evict)" in prompt["problems"][0]


def test_a_prompt_restored_only_up_to_a_quarantined_record_is_not_certified_whole(tmp_path, llama):
    """A read that failed once (the blob was away: a disk that did not answer) quarantines that
    record, and a restore stops before it from then on; the blob reads again. A prompt that hangs
    from it restores only its records before it, so the rest is never compared: the certificate
    said `exact`, exit 0, with `restored` short of `tokens`. It is checked only in part (exit 1),
    and the verdict names the quarantined record."""
    model_dir, model = llama
    prompt = toks(560, 7)  # records of 256, 256 and a tail of 47 tokens
    rows = stored(tmp_path / "s", model, model_dir, prompt, 256)
    second = next(r for r in rows if r.kind == 0 and r.depth == 2)  # tokens 256-512
    path = blobtree.blob_path(tmp_path / "s" / "blobs", second.hash)
    away = path.with_name("away")
    path.rename(away)
    with kvstore.open(tmp_path / "s") as store:
        _, rest = store.bind(model, model_dir).fetch(prompt)
        assert len(rest) == len(prompt) - 256
    away.rename(path)
    assert index_sql(tmp_path / "s", "SELECT bad FROM records WHERE hash = ?", (second.hash,)) == [(1,)]
    result = run_cli("verify", "--store", tmp_path / "s", "--exact", "--sample", "all", "--model", model_dir,
                     check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("INCOMPLETE: 1 of the 1 stored prompts sampled"), last
    assert f"was read only to token 256: record {second.hash.hex()} is quarantined" in last, last
    assert "PARTIAL" in result.stdout, result.stdout


def test_a_prompt_that_restores_nothing_shows_no_comparison_in_its_row(tmp_path, llama):
    """A prompt whose first record does not read restores nothing: its row showed `bit for bit`,
    `same`, `32/32` and a `0.000*` lead (with the tie note) for a comparison that never ran."""
    model_dir, model = llama
    stored(tmp_path / "s", model, model_dir, toks(300, 9), 256)
    with kvstore.open(tmp_path / "s", read_only=True) as store:
        first = next(r for r in store.index.rows() if r.depth == 1)
    result = _unreadable_then_verified(tmp_path / "s", first.hash, model_dir)
    assert result.returncode == 3, result.stdout + result.stderr
    head, row = result.stdout.splitlines()[:2]
    assert row.split()[1:] == ["0", "0", "0", "-", "-", "-", "-", "-", "0/0", "PARTIAL"], row
    assert "bit for bit" not in row and "lead*" not in result.stdout, result.stdout


def test_a_hybrid_prompts_resume_point_is_part_of_it_not_a_prompt_of_its_own(tmp_path, demo_model):
    """Out of exact mode a hybrid model's prefill also stores the prompt at its last token but
    one (where the same prompt, asked again, resumes): the certificate counts and checks each
    warmed prompt once, not that point beside it as a second stored prompt."""
    from mlx_lm import load

    model_dir = str(demo_model("qwen3_5"))
    model = load(model_dir)[0]
    with kvstore.open(tmp_path / "s") as store:
        mc = store.bind(model, model_dir)
        for i in range(2):
            mc.prefill(toks(300 + 7 * i, 20 + i))
        store.flush()
        tails = [r for r in store.index.rows() if r.kind == 1]
        assert len(tails) == 4  # each prompt's tail, and its resume point's
        report = store.verify_exact(model, model_dir, sample=None)
    assert report.ok and report.stored_prompts == 2 and len(report.checks) == 2, report.table()
