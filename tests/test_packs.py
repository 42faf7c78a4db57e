"""KV packs (`kvstore pack`): a pack exported from one store and imported into a fresh store on
another path restores its prompt in a fresh process, with the logits of a recompute; every kind
of damage, another model or tokenizer, an untrusted signer, and another chunk size or
`disk_kv_bits` are refused with their own one-line reason and leave the store as it was; a pack
pushed to a real SeaweedFS and pulled by a node without the fleet secret imports; canaries are
checked by a replayed step; third-party OpenSSF model-signing verifiers accept a signed pack."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sqlite3
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from kvtest import run_cli, run_procs

import kvstore
from kvstore import canary
from kvstore.demo import build_demo_model
from kvstore.errors import PackError
from kvstore.packs import manifest as packfile
from kvstore.packs import replay, signing
from kvstore.packs.export import shared_only
from kvstore.records import prompt_records
from kvstore.storage import blobfile, blobformat

PROMPT = "You are the assistant of a small team. Answer briefly. " + "Notes on the build: " * 40
OTHER = "Another prompt that lives in the importing store already. " * 3


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    """Two P-256 key pairs as PEM files: `key`/`pub` (the signer), `other_key`/`other_pub`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    root = tmp_path_factory.mktemp("keys")
    out = {}
    for name in ("", "other_"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[name + "key"] = root / f"{name}key.pem"
        out[name + "key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
        out[name + "pub"] = root / f"{name}key.pub"
        out[name + "pub"].write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return out


@pytest.fixture(scope="module")
def signed_pack(tmp_path_factory, demo_model, keys) -> tuple[Path, Path]:
    """(a signed pack of PROMPT on the tiny llama demo model, the store it was exported from)."""
    root = tmp_path_factory.mktemp("pack")
    model = demo_model("llama")
    result = run_cli("pack", "export", "--store", root / "a", "--model", model, "--prompt", PROMPT,
                     "--sign-key", keys["key"], "--out", root / "pack")
    assert "signed with" in result.stdout and "in clear" in result.stdout
    return root / "pack", root / "a"


def tokens_of(model: Path, text: str) -> list[int]:
    from mlx_lm import load

    _, tokenizer = load(str(model))
    return tokenizer.encode(text)


def snapshot(store: Path) -> dict:
    """What a store holds: its records and models rows, its pins and its blob files (by content)."""
    if not (store / "index.sqlite").exists():
        return {}
    conn = sqlite3.connect(f"file:{store / 'index.sqlite'}?mode=ro", uri=True)
    try:
        rows = {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in ("records", "models")}
    finally:
        conn.close()
    blobs = {p.relative_to(store).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted((store / "blobs").rglob("*")) if p.is_file()}
    pins = (store / "index.pins").read_bytes() if (store / "index.pins").exists() else b""
    return {"rows": rows, "blobs": blobs, "pins": pins}


@pytest.mark.parametrize("dtype, size, bits", [("bfloat16", "tiny", None), ("bfloat16", "small", 8)],
                         ids=["bf16", "8-bit"])
def test_a_pack_imported_on_another_path_is_reused_whole(tmp_path, demo_model, keys, dtype, size, bits):
    model = demo_model("llama", size, dtype)
    opts = ["--disk-kv-bits", str(bits)] if bits else []
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", PROMPT,
            "--sign-key", keys["key"], "--out", tmp_path / "pack", *opts)
    result = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model,
                     "--trust-key", keys["pub"], *opts)
    assert f"signed by the trusted key {keys['pub']}" in result.stdout and "nothing vouches" not in result.stderr
    assert "records pinned" in result.stdout
    tokens = tokens_of(model, PROMPT)
    # In a fresh process: the first fetch reuses all but the last token, logits as a recompute.
    got = run_procs("check", tmp_path / "b", model, 256, tokens)
    assert got["reused"] == len(tokens) - 1
    assert got["max_abs_diff"] < (0.25 if bits else 0.07)
    # The imported records are the exported ones: both stores restore the same K/V, bit for bit.
    from mlx_lm import load

    loaded, _ = load(str(model))
    restored = []
    for name in ("a", "b"):
        with kvstore.open(tmp_path / name, memory_bytes=0) as store:
            cache, rest = store.bind(loaded, str(model)).fetch(tokens)
            restored.append([mx.array(c.state[0]) for c in cache] + [mx.array(c.state[1]) for c in cache])
            assert len(rest) == 1
    assert all(bool(mx.array_equal(x, y)) for x, y in zip(*restored))


def _flip_byte(pack: Path, model: Path, env: dict) -> str:
    blob = sorted((pack / "blobs").iterdir())[0]
    data = bytearray(blob.read_bytes())
    entries, base, _ = blobformat.parse(bytes(data))
    name = next(n for n in entries if n != "tokens")
    data[base + entries[name]["data_offsets"][0] + 5] ^= 0x10  # in the K/V, not the token ids
    blob.write_bytes(bytes(data))
    return "does not match its SHA-256 in the manifest"


def _flip_a_token_byte(pack: Path, model: Path, env: dict) -> str:
    blob = sorted((pack / "blobs").iterdir())[0]
    data = bytearray(blob.read_bytes())
    entries, base, _ = blobformat.parse(bytes(data))
    data[base + entries["tokens"]["data_offsets"][0] + 1] ^= 0x01  # a token id: the chain is checked first
    blob.write_bytes(bytes(data))
    return f"prompt 1: blob {packfile.blob_name(blob.stem)} does not match its SHA-256 in the manifest"


def _swap_blobs(pack: Path, model: Path, env: dict) -> str:
    a, b = [p for p in sorted((pack / "blobs").iterdir()) if p.stat().st_size == max(
        q.stat().st_size for q in (pack / "blobs").iterdir())][:2]  # two chunks: the same size
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    chain = json.loads((pack / "manifest.json").read_text())["prompts"][0]["records"]
    ha, hb = a.stem, b.stem
    first, other = sorted((ha, hb), key=chain.index)  # the first out of place names the other
    return (f"prompt 1: blob {packfile.blob_name(first)}, the manifest's record {chain.index(first) + 1} of "
            f"{len(chain)}, holds record {other} (its record {chain.index(other) + 1}): blobs swapped or renamed")


def _edit_manifest(pack: Path, model: Path, env: dict) -> str:
    doc = json.loads((pack / "manifest.json").read_text())
    doc["prompts"][0]["tokens"] -= 1
    (pack / "manifest.json").write_text(json.dumps(doc))
    return "manifest.json was changed after the pack was signed"


def _edit_manifest_and_sign_again(pack: Path, model: Path, env: dict) -> str:
    _edit_manifest(pack, model, env)
    (pack / "model.sig").unlink()
    signing.sign(pack, env["keys"]["other_key"])  # a valid signature, by a key the importer does not trust
    return "does not verify with the trusted key"


def _extra_files(pack: Path, model: Path, env: dict) -> str:
    (pack / "blobs" / "evil.safetensors").write_bytes(b"x" * 100)
    (pack / "README.txt").write_text("read me")
    return ("the pack folder holds 2 file(s) its signature and manifest do not cover: README.txt, "
            "blobs/evil.safetensors")


def _path_outside_the_pack_signed(pack: Path, model: Path, env: dict) -> str:
    doc = json.loads((pack / "manifest.json").read_text())
    doc["model"]["files"]["../../etc/passwd"] = "0" * 64
    (pack / "manifest.json").write_text(json.dumps(doc))
    (pack / "model.sig").unlink()
    signing.sign(pack, env["keys"]["key"])  # by the trusted key: the manifest's own checks refuse it
    return "names a file '../../etc/passwd' that is not a plain relative name"


def _other_model(pack: Path, model: Path, env: dict) -> str:
    env["model"] = build_demo_model(pack.parent / "seed1", "llama", seed=1)  # same shapes, other weights
    return "weight file model.safetensors has SHA-256"


def _other_tokenizer(pack: Path, model: Path, env: dict) -> str:
    other = shutil.copytree(model, pack.parent / "retokenized")
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["model_max_length"] = 1234
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    env["model"] = other
    return "tokenizer file tokenizer_config.json has SHA-256"


def _untrusted_signer(pack: Path, model: Path, env: dict) -> str:
    env["trust"] = env["keys"]["other_pub"]
    return "does not verify with the trusted key"


def _ed25519_trust_key(pack: Path, model: Path, env: dict) -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    public = ed25519.Ed25519PrivateKey.generate().public_key()
    env["trust"] = pack.parent / "ed25519.pub"
    env["trust"].write_bytes(public.public_bytes(serialization.Encoding.PEM,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo))
    return "not an elliptic-curve public key in PEM (P-256, P-384 or P-521) that can be read (an Ed25519PublicKey)"


def _missing_blob(pack: Path, model: Path, env: dict) -> str:
    sorted((pack / "blobs").iterdir())[-1].unlink()
    return "is missing from the pack"


def _signature_of_another_pack(pack: Path, model: Path, env: dict) -> str:
    other = pack.parent / "other-pack"  # signed by the trusted key too, but of another prompt
    run_cli("pack", "export", "--store", pack.parent / "other-store", "--model", model, "--prompt", OTHER,
            "--sign-key", env["keys"]["key"], "--out", other)
    shutil.copy(other / "model.sig", pack / "model.sig")
    return "model.sig is the signature of another pack (it covers 1 blob, none of them in this folder)"


def _signature_of_a_pack_that_shares_blobs(pack: Path, model: Path, env: dict) -> str:
    other = pack.parent / "longer-pack"  # PROMPT and more: its first records are this pack's too
    run_cli("pack", "export", "--store", pack.parent / "other-store", "--model", model, "--prompt", PROMPT + OTHER,
            "--sign-key", env["keys"]["key"], "--out", other)
    assert set(os.listdir(other / "blobs")) & set(os.listdir(pack / "blobs"))
    shutil.copy(other / "model.sig", pack / "model.sig")
    return "blobs are not in this folder (blobs/"


def _signature_of_a_pack_of_some_of_its_prompts(pack: Path, model: Path, env: dict) -> str:
    """The signed pack's model.sig beside a pack of its prompt and another: every blob it signs is
    in the folder, beside others (it said the manifest was changed after signing)."""
    two = pack.parent / "two-prompts"
    prompts = pack.parent / "two.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n" + json.dumps({"prompt": OTHER}) + "\n")
    run_cli("pack", "export", "--store", pack.parent / "other-store", "--model", model, "--prompts", prompts,
            "--unsigned", "--out", two)
    signed = len(os.listdir(pack / "blobs"))
    assert set(os.listdir(pack / "blobs")) < set(os.listdir(two / "blobs"))
    shutil.copy(pack / "model.sig", two / "model.sig")
    shutil.rmtree(pack)
    shutil.copytree(two, pack)
    return (f"model.sig signs another manifest.json, of {signed} blob{'s' if signed > 1 else ''}, and this folder "
            "holds 1 it does not sign (blobs/")


def _other_config(pack: Path, model: Path, env: dict) -> str:
    other = shutil.copytree(model, pack.parent / "reconfigured")
    (other / "config.json").write_text((other / "config.json").read_text() + "\n")
    env["model"] = other
    return "this model's config file config.json has SHA-256"


def _signature_that_is_not_one(pack: Path, model: Path, env: dict) -> str:
    (pack / "model.sig").write_text('{"mediaType": "application/vnd.dev.sigstore.bundle+json"}')
    return "model.sig is not a signature that can be read (a Sigstore bundle, as kvstore pack export and " \
        "model_signing write it): it has no field 'verificationMaterial'"


def _unsigned_with_trust_key(pack: Path, model: Path, env: dict) -> str:
    (pack / "model.sig").unlink()
    return "the pack is not signed"


@pytest.mark.parametrize("damage", [_flip_byte, _flip_a_token_byte, _swap_blobs, _edit_manifest, _edit_manifest_and_sign_again,
                                    _extra_files, _path_outside_the_pack_signed, _other_model, _other_tokenizer,
                                    _untrusted_signer, _ed25519_trust_key, _missing_blob, _signature_of_another_pack,
                                    _signature_of_a_pack_that_shares_blobs,
                                    _signature_of_a_pack_of_some_of_its_prompts, _other_config, _signature_that_is_not_one,
                                    _unsigned_with_trust_key],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_bad_pack_is_refused_with_its_reason_and_the_store_stays_as_it_was(
        tmp_path, demo_model, keys, signed_pack, damage):
    model = demo_model("llama")
    pack = Path(shutil.copytree(signed_pack[0], tmp_path / "pack"))
    store = tmp_path / "b"
    run_cli("warm", "--store", store, "--model", model, "--prompts", _prompt_file(tmp_path, OTHER))
    before = snapshot(store)
    env = {"keys": keys, "model": model, "trust": keys["pub"], "extra": []}
    reason = damage(pack, model, env)
    result = run_cli("pack", "import", pack, "--store", store, "--model", env["model"],
                     "--trust-key", env["trust"], *env["extra"], check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvstore pack ") and " error: " in line]
    assert len(errors) == 1 and reason in errors[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert snapshot(store) == before


def test_another_chunk_size_is_refused_with_both_values(tmp_path, demo_model, signed_pack):
    from mlx_lm import load

    from kvstore.packs.importing import import_pack

    model = demo_model("llama")
    loaded, tokenizer = load(str(model))
    with pytest.raises(PackError, match="the pack's chunk size is 256 tokens, this store's is 64"):
        import_pack(signed_pack[0], tmp_path / "b", loaded, str(model), tokenizer, chunk_size=64)
    assert not (tmp_path / "b").exists()


def test_an_unsigned_pack_imports_without_a_trust_key_and_says_so(tmp_path, demo_model):
    model = demo_model("llama")
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", PROMPT, "--unsigned",
            "--out", tmp_path / "pack")
    assert not (tmp_path / "pack" / "model.sig").exists()
    result = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model, "--no-pin")
    assert "signature: unsigned: no signature to check" in result.stdout
    assert "not pinned (--no-pin)" in result.stdout
    # its checks show it whole and for this model; only a trusted signature vouches for its K/V
    assert "warning: nothing vouches for these K/V without --trust-key" in result.stderr, result.stderr
    with kvstore.open(tmp_path / "b") as store:
        assert store.pins() == [] and store.stats()["chunks"] > 0
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", OTHER, "--unsigned",
            "--out", tmp_path / "one")
    one = run_cli("pack", "import", tmp_path / "one", "--store", tmp_path / "b", "--model", model)
    assert "checked: model files, chain, 1 blob and its record; 1 canary" in one.stdout, one.stdout


def test_a_pack_of_a_single_token_prompt_imports_and_replays_its_canary(tmp_path, demo_model):
    """A one-token prompt's canary is of the step at token 0, with nothing before it: the import
    replays it from an empty cache (it refused the pack: 'not at this record')."""
    model = demo_model("llama")
    exported = run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", "x", "--unsigned",
                       "--out", tmp_path / "pack")
    assert "1 token (1 computed now" in exported.stdout and "the 1 token computed now is stored" in exported.stdout
    result = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model)
    assert "1 blob and its record; 1 canary by a replayed step" in result.stdout, result.stdout


def test_an_import_again_says_what_it_did_to_the_pins_an_earlier_import_made(tmp_path, demo_model, signed_pack):
    """Importing a pack again stores nothing and says so; with --no-pin it does not say that gc
    may evict records an earlier import pinned (they stay pinned), and with pins it says they were."""
    model = demo_model("llama")
    pack, store = signed_pack[0], tmp_path / "b"
    first = run_cli("pack", "import", pack, "--store", store, "--model", model)
    n = len(json.loads((pack / "manifest.json").read_text())["records"])
    assert f"{n} records stored on disk" in first.stdout and "pinned already" not in first.stdout
    again = run_cli("pack", "import", pack, "--store", store, "--model", model, "--no-pin")
    assert f"0 records stored on disk (0 B), {n} were stored already" in again.stdout, again.stdout
    assert f"not pinned by this import (--no-pin), but all {n} were pinned already: gc keeps them" in again.stdout
    assert "gc may evict" not in again.stdout
    assert sum(row[0] for row in _column(store, "pinned")) == n  # still pinned, as it said
    pinned = run_cli("pack", "import", pack, "--store", store, "--model", model)
    assert f"{n} were stored already; {n} records pinned (all were pinned already)" in pinned.stdout, pinned.stdout


def test_an_import_over_a_damaged_copy_of_its_records_stores_them_again(tmp_path, demo_model, signed_pack):
    """A record the store holds damaged (a flipped byte no read has met yet) is not 'stored
    already': the import quarantines it and stores the pack's checked copy, so the first request
    after it reuses the whole prompt, as docs/packs.md says (it was restored only up to there)."""
    from kvstore.storage import blobtree

    model = demo_model("llama")
    pack, store = signed_pack[0], tmp_path / "b"
    run_cli("pack", "import", pack, "--store", store, "--model", model)
    n = len(json.loads((pack / "manifest.json").read_text())["records"])
    second = json.loads((pack / "manifest.json").read_text())["prompts"][0]["records"][1]
    path = blobtree.blob_path(store / "blobs", bytes.fromhex(second))
    data = bytearray(path.read_bytes())
    data[-9] ^= 0x10
    path.write_bytes(bytes(data))
    again = run_cli("pack", "import", pack, "--store", store, "--model", model)
    assert f"; 1 of them in place of a damaged copy, quarantined), {n - 1} were stored already" in again.stdout, \
        again.stdout
    assert again.stdout.count("1 record stored on disk") == 1
    assert run_cli("verify", "--store", store).returncode == 0
    tokens = tokens_of(model, PROMPT)
    got = run_procs("check", store, model, 256, tokens)
    assert got["reused"] == len(tokens) - 1, got


def test_a_record_changed_after_it_was_written_is_never_exported(tmp_path, demo_model, keys, signed_pack):
    """A stored record whose K/V were changed with their checksums (its trust tag no longer holds,
    so a restore refuses it) is not signed into a pack: the export refuses, names it and the
    store, and writes nothing. (It was exported, signed and imported as the key holder's.)"""
    from kvtest import alter_record

    model = demo_model("llama")
    store = Path(shutil.copytree(signed_pack[1], tmp_path / "a"))
    second = json.loads((signed_pack[0] / "manifest.json").read_text())["prompts"][0]["records"][1]
    alter_record(store, bytes.fromhex(second), "1.keys", 1.01)
    result = run_cli("pack", "export", "--store", store, "--model", model, "--prompt", PROMPT,
                     "--sign-key", keys["key"], "--out", tmp_path / "pack", check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{second}.safetensors: its trust tag does not hold" in result.stderr, result.stderr
    assert f"kvstore verify --repair --store {store}" in result.stderr
    assert not (tmp_path / "pack").exists() and result.stdout == ""


def _column(store: Path, name: str) -> list:
    conn = sqlite3.connect(f"file:{store / 'index.sqlite'}?mode=ro", uri=True)
    try:
        return conn.execute(f"SELECT {name} FROM records").fetchall()
    finally:
        conn.close()


def _unsigned_copy(signed_pack, tmp_path: Path, name: str) -> tuple[Path, dict]:
    pack = Path(shutil.copytree(signed_pack[0], tmp_path / name))
    (pack / "model.sig").unlink()
    return pack, json.loads((pack / "manifest.json").read_text())


def _write_manifest(pack: Path, doc: dict) -> None:
    (pack / "manifest.json").write_text(json.dumps(doc))


def test_an_unsigned_pack_edited_or_with_extra_files_is_refused_by_its_own_checks(tmp_path, demo_model, signed_pack):
    """Without a signature to check, the manifest still binds the pack: a changed token count,
    token SHA-256 or chain hash, a file it does not list, or a record named with a path out of the pack are each
    refused, and nothing is imported."""
    model = demo_model("llama")
    count, doc = _unsigned_copy(signed_pack, tmp_path, "count")
    tokens = doc["prompts"][0]["tokens"]
    doc["prompts"][0]["tokens"] += 1
    _write_manifest(count, doc)
    digest, doc = _unsigned_copy(signed_pack, tmp_path, "digest")
    doc["prompts"][0]["tokens_sha256"] = "0" * 64
    _write_manifest(digest, doc)
    chain, doc = _unsigned_copy(signed_pack, tmp_path, "chain")
    old = doc["prompts"][0]["records"][1]
    new = format(int(old, 16) ^ 1, "032x")  # the record (and its blob) under another hash
    doc["prompts"][0]["records"][1] = new
    doc["records"][new] = doc["records"].pop(old)
    if old in doc["canaries"]:
        doc["canaries"][new] = doc["canaries"].pop(old)
    (chain / packfile.blob_name(old)).rename(chain / packfile.blob_name(new))
    _write_manifest(chain, doc)
    extra, _ = _unsigned_copy(signed_pack, tmp_path, "extra")
    (extra / "blobs" / "evil.safetensors").write_bytes(b"x" * 100)
    outside, doc = _unsigned_copy(signed_pack, tmp_path, "outside")
    first = doc["prompts"][0]["records"][0]
    doc["prompts"][0]["records"][0] = "../../../../tmp/x"
    doc["records"]["../../../../tmp/x"] = doc["records"].pop(first)
    _write_manifest(outside, doc)
    linked, doc = _unsigned_copy(signed_pack, tmp_path, "linked")  # a blob as a link to its own bytes elsewhere
    blob = linked / packfile.blob_name(doc["prompts"][0]["records"][0])
    blob.rename(tmp_path / "elsewhere.safetensors")
    blob.symlink_to(tmp_path / "elsewhere.safetensors")
    folder, _ = _unsigned_copy(signed_pack, tmp_path, "linked-folder")  # blobs/ as a link to a folder elsewhere
    (folder / "blobs").rename(tmp_path / "blobs-elsewhere")
    (folder / "blobs").symlink_to(tmp_path / "blobs-elsewhere")  # (it was "1 file(s) its manifest does not list: blobs")
    for pack, reason in [(linked, f"{blob} is not a regular file: it is a symbolic link (a pack holds its files"),
                         (folder, f"{folder / 'blobs'} is not a folder: it is a symbolic link (a pack holds its files"),
                         (count, f"prompt 1: its blobs hold {tokens} token ids, manifest.json's prompts[0].tokens says {tokens + 1}"),
                         (digest, f"prompt 1: the {tokens} token ids its blobs hold are not the ones the manifest "
                                  "names (their SHA-256 is not manifest.json's prompts[0].tokens_sha256)"),
                         (chain, "prompt 1: the chain recomputed from its tokens differs from manifest.json's "
                                 "prompts[0].records at record 2"),
                         (extra, "the pack folder holds 1 file(s) its manifest does not list: blobs/evil.safetensors"),
                         (outside, "a record hash must be 32 lower-case hex digits, got '../../../../tmp/x'")]:
        result = run_cli("pack", "import", pack, "--store", tmp_path / "b", "--model", model, check=False)
        assert result.returncode == 1 and reason in result.stderr, (pack.name, result.stderr)
        assert not (tmp_path / "b").exists()


def test_a_signed_pack_verifies_with_model_signings_own_verifier(tmp_path, keys, signed_pack):
    from model_signing import verifying

    pack = Path(shutil.copytree(signed_pack[0], tmp_path / "copy-under-another-name"))
    verifier = verifying.Config().use_elliptic_key_verifier(public_key=keys["pub"])
    verifier.verify(pack, pack / "model.sig")
    blob = sorted((pack / "blobs").iterdir())[0]
    blob.write_bytes(blob.read_bytes()[:-1] + b"\0")
    with pytest.raises(ValueError, match="Signature mismatch"):
        verifier.verify(pack, pack / "model.sig")


def test_no_local_path_goes_into_a_pack(signed_pack):
    pack, store = signed_pack
    text = b"".join(p.read_bytes() for p in pack.rglob("*") if p.is_file())
    assert str(store).encode() not in text and b"model_id" not in text
    assert b"demo-models" not in text  # the model's folder


def test_push_and_pull_through_a_bucket_by_a_node_without_the_fleet_secret(tmp_path, demo_model, keys, signed_pack,
                                                                          s3, monkeypatch):
    url = s3.url()
    pushed = run_cli("pack", "push", signed_pack[0], url)
    assert "signed" in pushed.stdout
    monkeypatch.delenv("KVSTORE_REMOTE_KEY")
    run_cli("pack", "pull", url, tmp_path / "pulled")
    run_cli("pack", "pull", f"file://{signed_pack[0]}", tmp_path / "copied")
    model = demo_model("llama")
    for name in ("pulled", "copied"):
        run_cli("pack", "import", tmp_path / name, "--store", tmp_path / f"store-{name}", "--model", model,
                "--trust-key", keys["pub"])
    tokens = tokens_of(model, PROMPT)
    from mlx_lm import load

    loaded, _ = load(str(model))
    with kvstore.open(tmp_path / "store-pulled") as store:
        assert len(store.bind(loaded, str(model)).fetch(tokens)[1]) == 1
    # Without --trust-key, a signed pack's import says its signature was not checked (as the docs show).
    unchecked = run_cli("pack", "import", tmp_path / "copied", "--store", tmp_path / "store-unchecked", "--model",
                        model)
    assert "signature: signed, but the signature was not checked (no --trust-key)" in unchecked.stdout
    missing = run_cli("pack", "pull", s3.url(), tmp_path / "nothing", check=False)
    assert missing.returncode == 1 and "has no manifest.json" in missing.stderr
    # A bucket that is not there is said so, not taken for a place without a pack.
    gone = run_cli("pack", "pull", "s3://no-such-bucket/pack", tmp_path / "nothing", check=False)
    assert gone.returncode == 1 and "the bucket 'no-such-bucket' does not exist" in gone.stderr, gone.stderr
    assert "has no manifest.json" not in gone.stderr
    assert not (tmp_path / "nothing").exists()
    from kvstore.packs import transfer

    bucket = transfer.place(url)  # a blob bigger than the manifest says: the error names it
    blob = next(key for key, _, _ in bucket.list("") if key.startswith("blobs/"))
    bucket.put(blob, b"x" * (4 << 20))
    big = run_cli("pack", "pull", url, tmp_path / "big", check=False)
    assert big.returncode == 1 and f"{blob} is larger than the" in big.stderr, big.stderr
    assert not (tmp_path / "big").exists()


def _held(place) -> dict[str, int]:
    """What a push destination holds: key -> size (a folder's files, or the objects under a prefix)."""
    from kvstore.packs import transfer

    target = transfer.place(str(place))
    if isinstance(target, transfer.Folder):
        return {p.relative_to(target.path).as_posix(): p.stat().st_size
                for p in target.path.rglob("*") if p.is_file()}
    return {key: size for key, size, _ in target.list("")}


def test_a_push_to_a_place_that_holds_anything_is_refused_and_writes_nothing(tmp_path, demo_model, signed_pack, s3):
    """A push never merges into what a place holds (an unsigned 1-blob pack pushed onto a signed
    4-blob one left its model.sig and blobs there: pulled, it read as signed, and its import was
    refused for extra files): a folder, a file:// URL or an S3 prefix that holds anything is
    refused, naming it and what to do, and is left as it was; an empty folder is pushed to."""
    model = demo_model("llama")
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", OTHER, "--unsigned",
            "--out", tmp_path / "small")
    assert len(list((tmp_path / "small" / "blobs").iterdir())) == 1
    folder, url = tmp_path / "dest", s3.url()
    for place in (folder, url):
        run_cli("pack", "push", signed_pack[0], place)
    (tmp_path / "a-file").write_text("not a folder")
    for place in (folder, f"file://{folder}", url, tmp_path / "a-file"):
        before = _held(folder), _held(url)
        refused = run_cli("pack", "push", tmp_path / "small", place, check=False)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        errors = [line for line in refused.stderr.splitlines() if line.startswith("kvstore pack ") and " error: " in line]
        assert len(errors) == 1 and errors[0].startswith(f"kvstore pack push: error: {place} "), refused.stderr
        assert errors[0].endswith("a pack is pushed to a new or empty place, never merged into another (nothing "
                                  "pushed: push to another place, or empty this one first)"), errors[0]
        assert "Traceback" not in refused.stderr and refused.stdout == ""
        assert (_held(folder), _held(url)) == before
    assert (tmp_path / "a-file").read_text() == "not a folder"
    (tmp_path / "empty").mkdir()
    run_cli("pack", "push", tmp_path / "small", tmp_path / "empty")
    pulled = run_cli("pack", "pull", tmp_path / "empty", tmp_path / "pulled")
    assert "unsigned" in pulled.stdout and _held(tmp_path / "pulled") == _held(tmp_path / "small")


def test_a_push_of_a_pack_missing_a_blob_pushes_nothing(tmp_path, signed_pack, s3):
    """A pack missing a blob its manifest lists (or holding one of another size) is refused before
    anything is pushed: the blobs before it were left at the place, which then refused the whole
    pack pushed again as a place that holds objects."""
    broken = Path(shutil.copytree(signed_pack[0], tmp_path / "broken"))
    chain = json.loads((broken / "manifest.json").read_text())["prompts"][0]["records"]
    missing = broken / packfile.blob_name(chain[-1])
    missing.unlink()
    longer = Path(shutil.copytree(signed_pack[0], tmp_path / "longer"))
    (longer / packfile.blob_name(chain[0])).open("ab").write(b"\0")
    linked = Path(shutil.copytree(signed_pack[0], tmp_path / "linked"))  # blobs/ a link: it was pushed through it
    (linked / "blobs").rename(tmp_path / "blobs-elsewhere")
    (linked / "blobs").symlink_to(tmp_path / "blobs-elsewhere")
    url, folder = s3.url(), tmp_path / "dest"
    for pack, why in [(broken, f"the pack has no {packfile.blob_name(chain[-1])} ({missing}), which its manifest "
                               "lists: nothing pushed"),
                      (linked, f"{linked / 'blobs'} is not a folder: it is a symbolic link"),
                      (longer, "bytes, the manifest says")]:
        for place in (url, folder):
            refused = run_cli("pack", "push", pack, place, check=False)
            assert refused.returncode == 1 and _held(place) == {}, (refused.stderr, _held(place))
            assert why in refused.stderr, refused.stderr
    for place in (url, folder):
        run_cli("pack", "push", signed_pack[0], place)
        assert _held(place) == _held(signed_pack[0])


@pytest.mark.parametrize("where", ["under-a-file", "full-disk"])
def test_an_export_that_cannot_write_its_pack_names_the_pack_and_why(tmp_path, demo_model, where):
    """--out under a file, or on a full disk: the error names the pack and why (it named the
    temporary folder the pack is made in, or only "[Errno 28] No space left on device"), exit 1,
    and nothing is left beside it."""
    import subprocess

    model, parent = demo_model("llama"), tmp_path / "out"
    parent.mkdir()
    if where == "under-a-file":
        (parent / "a-file").write_text("")
        out, why = parent / "a-file" / "pack", f"{parent / 'a-file'} is not a folder"
    else:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(parent)], capture_output=True)
        if made.returncode != 0:
            pytest.skip("cannot mount a tmpfs here")
        out, why = parent / "pack", "No space left on device"
    try:
        result = run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", PROMPT,
                         "--unsigned", "--out", out, check=False)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert f"kvstore pack export: error: cannot write the pack {out}: {why}; nothing exported" in result.stderr, result.stderr
        assert ".tmp-" not in result.stderr and not out.exists()
        assert sorted(os.listdir(parent)) == (["a-file"] if where == "under-a-file" else [])
    finally:
        if where == "full-disk":
            subprocess.run(["umount", str(parent)], capture_output=True)


def test_an_import_of_a_folder_that_is_not_there_says_so(tmp_path, demo_model):
    """A mistyped pack path (nothing there, or a file) is said as such by import and push, not as
    a pack without its manifest.json, and nothing is created."""
    model = demo_model("llama")
    (tmp_path / "a-file").write_text("not a pack")
    for pack, reason in [(tmp_path / "nonexist", f"no pack folder at {tmp_path / 'nonexist'}"),
                         (tmp_path / "a-file", f"{tmp_path / 'a-file'} is not a folder: a pack is a folder")]:
        for command in (["import", pack, "--store", tmp_path / "b", "--model", model],
                        ["push", pack, tmp_path / "dest"]):
            result = run_cli("pack", *command, check=False)
            assert result.returncode == 1, result.stdout + result.stderr
            errors = [line for line in result.stderr.splitlines() if line.startswith("kvstore pack ") and " error: " in line]
            assert len(errors) == 1 and reason in errors[0] and "has no manifest.json" not in errors[0], result.stderr
        for url in (str(pack), f"file://{pack}"):  # and pull, from a folder or a file:// URL
            result = run_cli("pack", "pull", url, tmp_path / "dest", check=False)
            errors = [line for line in result.stderr.splitlines() if line.startswith("kvstore pack ") and " error: " in line]
            assert result.returncode == 1 and len(errors) == 1, result.stdout + result.stderr
            assert reason.replace(str(pack), url) in errors[0], errors
    assert not (tmp_path / "b").exists() and not (tmp_path / "dest").exists()


# -- canaries: checked by one replayed step ---------------------------------------------------

def _with_canary(pack: Path, edit) -> None:
    """Change the canary of the pack's last record (`edit(canary) -> canary`), in its blob header
    and in the manifest, as someone rewriting the pack would."""
    doc = json.loads((pack / "manifest.json").read_text())
    last = doc["prompts"][0]["records"][-1]
    path = pack / packfile.blob_name(last)
    data = path.read_bytes()
    meta = blobformat.parse(data)[2]
    text = edit(canary.parse(meta["x-canary"])).text()
    data = blobformat.restamp(data, {**meta, "x-canary": text})
    path.write_bytes(data)
    doc["records"][last] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    doc["canaries"][last]["canary"] = text
    (pack / "manifest.json").write_text(json.dumps(doc))


def test_the_prompts_canary_is_checked_by_one_replayed_step(tmp_path, demo_model):
    """An export stores its prompt as warm does, whose last step is the prompt's canary: the pack
    carries it, an import replays that step, and a canary whose log-probabilities were moved (the
    pack rewritten, manifest and all, unsigned) is refused; `--no-replay` skips it."""
    model = demo_model("llama")
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", PROMPT, "--unsigned",
            "--out", tmp_path / "pack")
    doc = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    assert [list(c) for c in doc["canaries"].values()] == [["canary"]]
    result = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model)
    assert "1 canary by a replayed step" in result.stdout
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "pack", bad)
    _with_canary(bad, lambda c: canary.Canary(c.at, c.token, c.ids, tuple(v - 1.0 for v in c.logprobs)))
    refused = run_cli("pack", "import", bad, "--store", tmp_path / "c", "--model", model, check=False)
    assert refused.returncode == 1 and "its canary does not hold" in refused.stderr, refused.stderr
    assert not (tmp_path / "c").exists()
    skipped = run_cli("pack", "import", bad, "--store", tmp_path / "c", "--model", model, "--no-replay")
    assert "canaries not replayed (--no-replay)" in skipped.stdout


# -- the manifest and the tenant rule ----------------------------------------------------------

def test_the_manifest_is_read_strictly(signed_pack):
    raw = (signed_pack[0] / "manifest.json").read_bytes()
    m = packfile.parse(raw)
    assert packfile.parse(m.to_json()) == m
    doc = json.loads(raw)
    for edit, reason in [(lambda d: d.update(extra=1), "fields"),
                         (lambda d: d["records"].update({"ab" * 16: {"bytes": 10, "sha256": "0" * 64}}),
                          "in no prompt"),
                         (lambda d: d["model"]["files"].update({"../x": "0" * 64}), "plain relative name"),
                         (lambda d: d.update(kvstore_pack=2), "pack format 2"),
                         (lambda d: d.update(chunk_size=True), "chunk_size")]:
        bad = json.loads(json.dumps(doc))
        edit(bad)
        with pytest.raises(PackError, match=reason):
            packfile.parse(json.dumps(bad).encode())


def test_a_tenants_records_are_never_exported():
    class Row:
        def __init__(self, tenant):
            self.tenant = tenant

    shared_only([Row(None), Row(None)])
    with pytest.raises(PackError, match="belong to a tenant"):
        shared_only([Row(None), Row(b"\x01" * 8)])


def test_record_arrays_read_a_blob_as_the_writer_stored_it(signed_pack):
    blob = sorted((signed_pack[0] / "blobs").iterdir())[0].read_bytes()
    arrays, views = replay.record_arrays(blob)
    entries = blobformat.parse(blob)[0]
    assert set(arrays) == set(entries) - {"tokens"} and not views
    name = next(iter(arrays))
    assert np.array_equal(np.asarray(arrays[name]).reshape(-1)[:4],
                          np.frombuffer(blob, "<f4", 4, blobformat.parse(blob)[1] + entries[name]["data_offsets"][0]))


def _prompt_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": text}) + "\n")
    return path


def test_a_hybrid_models_pack_carries_its_checkpoint(tmp_path, demo_model):
    model = demo_model("qwen3_5")  # recurrent layers: restored only from the checkpoint at the prompt's end
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", PROMPT, "--unsigned",
            "--out", tmp_path / "pack")
    doc = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    tokens = tokens_of(model, PROMPT)
    assert len(doc["prompts"][0]["records"]) == len(tokens) // 256 + 2  # chunks, the tail, its checkpoint
    assert len(doc["prompts"][0]["resume"]) == 2  # the tail and checkpoint one token short of its end
    result = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model)
    assert "1 canary by a replayed step" in result.stdout  # from the checkpoint one token short of the end
    # A follow-up request restores the whole prompt from its checkpoint (the prompt alone, all but
    # its last token: at least one token is left to compute; tests/test_packs_hybrid.py).
    got = run_procs("check", tmp_path / "b", model, 256, tokens + tokens_of(model, " And then?"))
    assert got["reused"] == len(tokens) and got["max_abs_diff"] < 1e-3


def test_a_pack_made_in_exact_mode_imports_into_an_exact_store_only(tmp_path, demo_model):
    """In exact mode a prompt is stored but its last token (the first step's): the pack holds
    that, its canary replays in an exact store, and a store not in exact mode refuses it, naming
    the option."""
    model = demo_model("llama")
    exported = run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", PROMPT,
                       "--unsigned", "--exact-prefill", "256", "--out", tmp_path / "pack")
    doc = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    n = len(tokens_of(model, PROMPT)) - 1
    assert doc["prompts"][0]["tokens"] == n
    # The last token is computed (its own step) but not stored: not counted as computed for the pack.
    assert f"{n} tokens ({n} computed now, 0 stored before this export)" in exported.stdout, exported.stdout
    assert f"the {n} tokens computed now are stored in" in exported.stdout
    result = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model,
                     "--exact-prefill", "256")
    assert "1 canary by a replayed step" in result.stdout
    refused = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "c", "--model", model, check=False)
    assert refused.returncode == 1 and "--exact-prefill 256" in refused.stderr
    assert not (tmp_path / "c").exists()
    # Another step is another exact mode, not another chunk size (its records are that step long).
    other = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "c", "--model", model,
                    "--exact-prefill", "512", check=False)
    assert other.returncode == 1 and "made in exact mode 256, this store's is 512" in other.stderr, other.stderr
    assert "chunk size" not in other.stderr and not (tmp_path / "c").exists()
    # Exported again, nothing is computed (the last token is the first step's, never stored), and
    # the export does not say that it computes the prompt.
    again = run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", PROMPT,
                    "--unsigned", "--out", tmp_path / "pack2")
    assert f"({0} computed now, {n} stored before this export)" in again.stdout, again.stdout
    assert "computing" not in again.stderr, again.stderr
    # A single-token prompt has nothing stored in exact mode: said so, not "did not reach the disk".
    single = run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", "x",
                     "--unsigned", "--out", tmp_path / "pack3", check=False)
    assert single.returncode == 1 and "prompt 1 of the pack is a single token: in exact mode" in single.stderr, \
        single.stderr
    assert "computing" not in single.stderr and not (tmp_path / "pack3").exists()


def test_an_import_reads_the_models_weights_once_and_then_not_again(tmp_path, demo_model, signed_pack, keys,
                                                                     monkeypatch):
    """The store's memo of file digests (xxh3 for the fingerprint, SHA-256 for the pack, each row
    tagged) spares the weights' reads: an import into a new store reads each weight file once (its
    SHA-256 and xxh3 from one read), and a second import, or a bind, reads none."""
    import os as os_module

    from mlx_lm import load

    from kvstore.packs.importing import import_pack

    model = Path(shutil.copytree(demo_model("llama"), tmp_path / "model"))  # its stamps change below
    loaded, tokenizer = load(str(model))
    weights = str(model / "model.safetensors")
    real_open, opened = os_module.open, []

    def counting_open(path, *args, **kwargs):
        if str(path) == weights:
            opened.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os_module, "open", counting_open)
    import_pack(signed_pack[0], tmp_path / "b", loaded, str(model), tokenizer, trust_key=keys["pub"])
    assert len(opened) == 1
    opened.clear()
    import_pack(signed_pack[0], tmp_path / "b", loaded, str(model), tokenizer, trust_key=keys["pub"])
    with kvstore.open(tmp_path / "b") as store:
        store.bind(loaded, str(model))
    assert opened == []
    touched = os_module.stat(weights)
    os_module.utime(weights, ns=(touched.st_atime_ns, touched.st_mtime_ns + 1))  # changed: read again
    import_pack(signed_pack[0], tmp_path / "b", loaded, str(model), tokenizer, trust_key=keys["pub"])
    assert len(opened) == 1


def test_imported_records_count_as_explicit_writes_not_downloads(tmp_path, signed_pack, keys, demo_model):
    """An import writes its records on purpose, pinned, as `warm` does: `stats` counts them as
    explicit writes (bytes and records, by day), not as the remote tier's downloads."""
    model = demo_model("llama")
    run_cli("pack", "import", signed_pack[0], "--store", tmp_path / "b", "--model", model, "--trust-key", keys["pub"])
    writes = json.loads(run_cli("stats", "--store", tmp_path / "b", "--json").stdout)["writes"]
    with kvstore.open(tmp_path / "b") as store:
        stored = store.stats()
    on_disk = sum(p.stat().st_size for p in (tmp_path / "b" / "blobs").rglob("*.safetensors"))
    assert writes["downloaded_lifetime"] == 0
    assert writes["explicit_lifetime"] == writes["bytes_lifetime"] == on_disk
    assert writes["records_lifetime"] == stored["chunks"] + stored["tails"] > 0
    assert [d["records"] for d in writes["days"] if d["bytes"]] == [writes["records_lifetime"]]


def test_a_tenants_prompt_never_leaves_in_a_pack(tmp_path, demo_model):
    """End to end: a tenant stores a prompt; a shared export of the same text computes it again
    in the shared namespace and carries none of the tenant's records; an export through a model
    bound for the tenant is refused, saying that only the shared namespace is exportable."""
    from mlx_lm import load

    from kvstore.packs.export import export_pack

    model = demo_model("llama")
    loaded, tokenizer = load(str(model))
    secret = "Alice's private notes: the vault code is 4417. " * 12
    tokens = tokenizer.encode(secret)
    with kvstore.open(tmp_path / "s") as store:
        alice = store.bind(loaded, str(model), tenant="alice")
        alice.prefill(tokens)
        store.flush()
        theirs = {h.hex() for (h,) in store.index.conn.execute("SELECT hash FROM records WHERE tenant IS NOT NULL")}
        assert theirs
        with pytest.raises(PackError, match="bound for a tenant: only the shared namespace is exportable"):
            export_pack(store, alice, model, tokenizer, [np.array(tokens)], tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    result = run_cli("pack", "export", "--store", tmp_path / "s", "--model", model, "--prompt", secret, "--unsigned",
                     "--out", tmp_path / "pack")
    assert f"({len(tokens)} computed now, 0 stored before this export)" in result.stdout, result.stdout
    assert f"the {len(tokens)} tokens computed now are stored in {tmp_path / 's'} too (not pinned)" in result.stdout
    doc = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    assert not theirs & set(doc["records"])
    for blob in (tmp_path / "pack" / "blobs").iterdir():
        assert "x-tenant" not in blobformat.parse(blob.read_bytes())[2]
    # A pack made by other means of the tenant's records (their blobs, a manifest of their chain)
    # is refused as a tenant's, naming the blob, and nothing is imported.
    forged = Path(shutil.copytree(tmp_path / "pack", tmp_path / "forged"))
    shutil.rmtree(forged / "blobs")
    (forged / "blobs").mkdir()
    with kvstore.open(tmp_path / "s") as store:
        alice = store.bind(loaded, str(model), tenant="alice")
        chain = prompt_records(alice.ns, tokens, alice.chunk_size, tenant=alice.tenant)
        rows = store.index.rows_of([s.hash for s in chain])
        assert len(rows) == len(chain) and all(r.tenant is not None for r in rows.values())
        for h, r in rows.items():
            data = blobfile.read_checked(store.blob_root, h, size=r.size, checksum=r.checksum)[0]
            (forged / packfile.blob_name(h)).write_bytes(blobformat.restamp(data, blobformat.portable(
                blobformat.header_metadata(data))))
    doc["prompts"][0]["records"] = [s.hash.hex() for s in chain]
    doc["records"] = {h.hex(): {"bytes": (forged / packfile.blob_name(h)).stat().st_size,
                                "sha256": hashlib.sha256((forged / packfile.blob_name(h)).read_bytes()).hexdigest()}
                      for h in rows}
    doc["canaries"] = {}
    _write_manifest(forged, doc)
    refused = run_cli("pack", "import", forged, "--store", tmp_path / "b", "--model", model, check=False)
    first = packfile.blob_name(chain[0].hash)
    assert refused.returncode == 1, refused.stdout
    assert f"blob {first} holds a record of tenant {chain[0].tenant}: only the shared namespace" in refused.stderr
    assert not (tmp_path / "b").exists()


def test_an_export_says_which_tokens_it_computed_and_which_it_shared(tmp_path, demo_model):
    model = demo_model("llama")
    lines = tmp_path / "two.jsonl"
    lines.write_text("".join(json.dumps({"prompt": PROMPT + q}) + "\n" for q in (" First?", " Then a second one?")))
    n = len(tokens_of(model, PROMPT))
    result = run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompts", lines, "--unsigned",
                     "--out", tmp_path / "pack")
    # The second prompt restores what it shares with the first, stored earlier by this same export.
    said = re.search(r"(\d+) tokens \((\d+) computed now, 0 stored before this export, (\d+) shared with an "
                     r"earlier prompt of it\)", result.stdout)
    assert said, result.stdout
    tokens, computed, shared = map(int, said.groups())
    assert computed + shared == tokens and shared >= n
    again = run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompts", lines, "--unsigned",
                    "--out", tmp_path / "pack2")
    assert "(0 computed now," in again.stdout and "computed now are stored" not in again.stdout, again.stdout


def test_an_export_pins_and_unpins_the_prompts_as_their_lines_say(tmp_path, demo_model):
    """`pack export --prompts FILE` stores the prompts it computes as `warm` does, pins and all: a
    line with "pin": true is pinned in the store (gc keeps it), one with "pin": false unpinned,
    and the lines it prints say so."""
    model, store = demo_model("llama"), tmp_path / "s"
    lines = tmp_path / "pins.jsonl"
    pinned, loose = PROMPT + " Pinned?", OTHER
    lines.write_text("".join(json.dumps(line) + "\n" for line in (
        {"prompt": pinned, "pin": True}, {"prompt": loose}, {"prompt": pinned})))  # (a repeat keeps its pin)
    result = run_cli("pack", "export", "--store", store, "--model", model, "--prompts", lines, "--unsigned",
                     "--out", tmp_path / "pack")
    assert f"1 prompt pinned in {store} (\"pin\": true): gc keeps it" in result.stdout, result.stdout
    assert "(not pinned)" not in result.stdout and "computed now are stored in" in result.stdout
    run_cli("gc", "--store", store, "--max-bytes", "0")
    again = run_cli("pack", "export", "--store", store, "--model", model, "--prompt", pinned, "--unsigned",
                    "--out", tmp_path / "kept")
    assert "(0 computed now," in again.stdout, again.stdout  # gc kept the pinned prompt whole
    assert "(0 computed now," not in run_cli("pack", "export", "--store", store, "--model", model, "--prompt", loose,
                                              "--unsigned", "--out", tmp_path / "gone").stdout  # and not the other
    lines.write_text(json.dumps({"prompt": pinned, "pin": False}) + "\n")
    unpinned = run_cli("pack", "export", "--store", store, "--model", model, "--prompts", lines, "--unsigned",
                       "--out", tmp_path / "unpinned")
    assert re.search(rf"^\d+ records? unpinned in {re.escape(str(store))} \(\"pin\": false\)$", unpinned.stdout, re.M)
    assert "pinned in" not in unpinned.stdout.replace("unpinned in", "")
    run_cli("gc", "--store", store, "--max-bytes", "0")
    with kvstore.open(store) as opened:
        assert opened.stats()["bytes"] == 0 and opened.pins() == []


def test_a_pack_of_a_prompt_a_tenant_stored_holds_none_of_its_records(tmp_path, demo_model):
    """`pack export` of a store a tenant used, for the very prompt that tenant stored: it reuses the
    shared prompt only and computes the rest, and no blob of the pack is the tenant's (a pack is
    handed to others, who would read the tenant's prompt from it)."""
    from mlx_lm import load

    model_dir, store = demo_model("llama"), tmp_path / "s"
    model, tokenizer = load(str(model_dir))
    system = tokenizer.encode(PROMPT)
    secret = system + tokenizer.encode(" alice's diagnosis code is 4711-XQ" * 12)
    with kvstore.open(store) as opened:
        opened.bind(model, str(model_dir)).prefill(system, pin=True)
        alice = opened.bind(model, str(model_dir), tenant="alice")
        alice.prefill(secret, pin=True)
        opened.flush()
        assert len(secret) - len(alice.fetch(secret)[1]) == len(secret) - 1  # alice's own: all of it
        shared = len(secret) - len(opened.bind(model, str(model_dir)).fetch(secret)[1])
    assert 0 < shared < len(system) + 1
    lines = tmp_path / "secret.jsonl"
    lines.write_text(json.dumps({"tokens": secret}) + "\n")
    result = run_cli("pack", "export", "--store", store, "--model", model_dir, "--prompts", lines, "--unsigned",
                     "--out", tmp_path / "pack")
    assert f"({len(secret) - shared} computed now, {shared} stored before this export)" in result.stdout, result.stdout
    blobs = list((tmp_path / "pack").rglob("*.safetensors"))
    assert blobs and not any(b"x-tenant" in p.read_bytes() for p in blobs)  # (a tenant's blob header field)
    assert any(b"x-tenant" in p.read_bytes() for p in store.rglob("*.safetensors"))


def test_another_disk_kv_bits_is_refused_with_both_values(tmp_path, demo_model):
    """The refusal names both values and the option that imports the pack anyway, saying that the
    store then keeps that value for later runs (a kept setting), which following it does."""
    model = demo_model("llama", "small", "bfloat16")  # bf16 K/V: disk_kv_bits acts on them
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", OTHER, "--unsigned",
            "--out", tmp_path / "pack")
    refused = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model,
                      "--disk-kv-bits", "8", check=False)
    assert refused.returncode == 1
    hint = ("the pack's disk_kv_bits is off, this store's is 8: import it with --disk-kv-bits 0 (which the store "
            "then keeps for later runs), or import it into another store")
    assert hint in refused.stderr, refused.stderr
    assert not (tmp_path / "b").exists()
    run_cli("settings", "--store", tmp_path / "b", "disk_kv_bits=8")  # a store that keeps 8 bits
    before = snapshot(tmp_path / "b")
    refused = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model, check=False)
    assert refused.returncode == 1 and hint in refused.stderr, refused.stderr
    assert snapshot(tmp_path / "b") == before
    run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model, "--disk-kv-bits", "0")
    kept = json.loads(run_cli("stats", "--store", tmp_path / "b", "--json").stdout)["settings"]["disk_kv_bits"]
    assert kept == {"value": None, "source": "kept"}, kept  # what the hint said: off from now on


def test_disk_kv_bits_that_do_not_act_on_a_float32_model_do_not_refuse_its_pack(tmp_path, demo_model):
    """disk_kv_bits has no effect on K/V in float32 (the store warns so): a pack of such a model
    is the same with or without it, and imports either way."""
    model = demo_model("llama")  # float32
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", PROMPT, "--unsigned",
            "--disk-kv-bits", "8", "--out", tmp_path / "pack")
    assert json.loads((tmp_path / "pack" / "manifest.json").read_text())["disk_kv_bits"] is None
    run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model)
    run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "c", "--model", model, "--disk-kv-bits", "8")


def test_a_prompt_that_starts_another_of_the_pack_is_carried_within_it(tmp_path, demo_model):
    """A prompt that is the start of a longer one is stored within the longer one's records (its
    own last record folded into them): the pack carries the longer prompt, which restores both; a
    prompt stored only that way, exported alone, is refused naming why, not as a failed write."""
    model = demo_model("llama")
    longer = PROMPT + " And then a follow-up question that runs past the next chunk. " * 6
    lines = tmp_path / "two.jsonl"
    lines.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (PROMPT, longer)))
    result = run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompts", lines, "--unsigned",
                     "--out", tmp_path / "pack")
    assert "2 prompts (1 of them within a longer one)" in result.stdout
    doc = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    assert [p["tokens"] for p in doc["prompts"]] == [len(tokens_of(model, longer))]
    run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model)
    short = tokens_of(model, PROMPT)
    got = run_procs("check", tmp_path / "b", model, 256, short)
    assert got["reused"] == len(short) - 1 and got["max_abs_diff"] < 1e-3
    alone = run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", PROMPT, "--unsigned",
                    "--out", tmp_path / "pack2", check=False)
    assert alone.returncode == 1 and "start of a longer stored prompt" in alone.stderr
    assert not (tmp_path / "pack2").exists()


def test_a_prompt_given_twice_is_said_as_a_repeat_not_as_within_a_longer_one(tmp_path, demo_model):
    model = demo_model("llama")
    lines = tmp_path / "three.jsonl"
    longer = OTHER + " And a question after it."
    lines.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (OTHER, longer, longer)))
    result = run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompts", lines, "--unsigned",
                     "--out", tmp_path / "pack")
    shorter, whole = len(tokens_of(model, OTHER)), len(tokens_of(model, longer))
    # The repeat is counted once, in prompts and in tokens; the computing is said before it is done.
    assert (f"2 prompts (1 of them within a longer one, and 1 repeat of them, carried once), {shorter + whole} "
            f"tokens ({whole} computed now, 0 stored before this export, {shorter} shared") in result.stdout, result.stdout
    assert f"computing 2 prompts not stored whole yet (at most {shorter + whole} tokens" in result.stderr
    doc = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    assert [p["tokens"] for p in doc["prompts"]] == [len(tokens_of(model, longer))]


def test_a_key_that_cannot_be_used_is_said_before_the_model_is_loaded(tmp_path, signed_pack):
    """A mistyped --sign-key or --trust-key is said at once, not after the model is loaded and its
    weights hashed (here there is no model at all: the key is what is said)."""
    no_model = tmp_path / "no-model"
    export = run_cli("pack", "export", "--store", tmp_path / "a", "--model", no_model, "--prompt", "hi",
                     "--sign-key", tmp_path / "none.pem", "--out", tmp_path / "pack", check=False)
    assert export.returncode == 1 and f"--sign-key {tmp_path / 'none.pem'}: no such file" in export.stderr, \
        export.stderr
    imported = run_cli("pack", "import", signed_pack[0], "--store", tmp_path / "b", "--model", no_model,
                       "--trust-key", tmp_path / "none.pub", check=False)
    assert imported.returncode == 1 and f"--trust-key {tmp_path / 'none.pub'}: no such file" in imported.stderr, \
        imported.stderr
    (tmp_path / "junk.pem").write_text("not a key\n")
    export = run_cli("pack", "export", "--store", tmp_path / "a", "--model", no_model, "--prompt", "hi",
                     "--sign-key", tmp_path / "junk.pem", "--out", tmp_path / "pack", check=False)
    assert export.returncode == 1 and f"--sign-key {tmp_path / 'junk.pem'}: not an unencrypted" in export.stderr, \
        export.stderr
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    k1 = ec.generate_private_key(ec.SECP256K1())  # an EC key, but on a curve the signer does not take
    (tmp_path / "k1.pem").write_bytes(k1.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    export = run_cli("pack", "export", "--store", tmp_path / "a", "--model", no_model, "--prompt", "hi",
                     "--sign-key", tmp_path / "k1.pem", "--out", tmp_path / "pack", check=False)
    assert export.returncode == 1 and "(an elliptic-curve key on the curve secp256k1)" in export.stderr, export.stderr
    imported = run_cli("pack", "import", signed_pack[0], "--store", tmp_path / "b", "--model", no_model,
                       "--trust-key", tmp_path, check=False)
    assert imported.returncode == 1 and f"--trust-key {tmp_path}: a folder, not a key file" in imported.stderr, \
        imported.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "pack").exists()


def test_a_pack_is_exported_and_pulled_into_the_working_folder_as_dot(tmp_path, demo_model, keys, monkeypatch):
    """`--out .` and `pack pull URL .` in an empty working folder write the pack there (it said
    '.: Invalid argument': the folder was made as '' and renamed onto '.'), signed for a verifier."""
    from model_signing import verifying

    model = demo_model("llama")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", OTHER,
            "--sign-key", keys["key"], "--out", ".")
    assert sorted(p.name for p in Path(".").iterdir()) == ["blobs", "manifest.json", "model.sig"]
    verifying.Config().use_elliptic_key_verifier(public_key=keys["pub"]).verify(Path("."), Path("model.sig"))
    (tmp_path / "there").mkdir()
    monkeypatch.chdir(tmp_path / "there")
    pulled = run_cli("pack", "pull", tmp_path / "here", ".")
    assert "into .: 3 files" in pulled.stdout, pulled.stdout
    run_cli("pack", "import", ".", "--store", tmp_path / "b", "--model", model, "--trust-key", keys["pub"])
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_an_unpinned_import_that_gc_takes_off_the_disk_at_once_says_so(tmp_path, demo_model, signed_pack):
    """With --no-pin into a store whose max_bytes cannot hold the pack, gc evicts its records as
    they land: the import said they were stored on disk and nothing else, and the store held none."""
    model = demo_model("llama")
    n = len(json.loads((signed_pack[0] / "manifest.json").read_text())["records"])
    small = run_cli("pack", "import", signed_pack[0], "--store", tmp_path / "b", "--model", model, "--no-pin",
                    "--store-max-bytes", "1000B")
    assert f"warning: gc took {n} records of the pack off the disk again at once" in small.stderr, small.stderr
    assert _column(tmp_path / "b", "hash") == []
    pinned = run_cli("pack", "import", signed_pack[0], "--store", tmp_path / "c", "--model", model,
                     "--store-max-bytes", "1000B")
    assert "gc took" not in pinned.stderr and len(_column(tmp_path / "c", "hash")) == n


def test_an_export_to_a_used_folder_is_refused_before_it_computes_or_stores_anything(tmp_path, demo_model):
    """`--out` naming a folder that holds files was refused only after the export said "computing 1
    prompt not stored whole yet": it is said first, like a mistyped --sign-key, and the store is
    neither made nor written."""
    model = demo_model("llama")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine\n")
    result = run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", OTHER,
                     "--unsigned", "--out", tmp_path / "used", check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{tmp_path / 'used'} exists and is not an empty folder: a pack is written to a new folder" \
           in result.stderr and "computing" not in result.stderr, result.stderr
    assert not (tmp_path / "a").exists() and [p.name for p in (tmp_path / "used").iterdir()] == ["notes.txt"]


def test_export_with_a_bad_prompt_line_makes_no_store_and_no_pack(tmp_path):
    """A prompt file with a line that cannot be used exports nothing: said per line, before a
    model loads or a store is made (an export refused for it used to leave a new, empty store)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a good line"}\n{"prompt": 5}\n')
    result = run_cli("pack", "export", "--store", tmp_path / "s", "--prompts", prompts, "--out", tmp_path / "pack",
                     "--unsigned", check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"kvstore pack export: {prompts}:2: prompt: must be a string" in result.stderr, result.stderr
    assert "1 prompt line could not be used (said above): nothing exported" in result.stderr
    assert not (tmp_path / "s").exists() and not (tmp_path / "pack").exists()
