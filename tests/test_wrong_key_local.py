"""A fleet node's store read with a wrong fleet secret, against a real SeaweedFS: the secret is
wrong, not the records. `kvstore verify --store` says so in one `wrong_key` problem (never a
`corrupt_blob` per record, never a hint to repair them) and `--repair` deletes nothing for it; a
node opened with that secret says it once, and its records are misses, kept whole (never
quarantined): with the right secret they restore as before. A tampered blob under the right
secret is still refused (tests/test_remote_trust.py, tests/test_remote_keys_upkeep.py)."""

from __future__ import annotations

import logging
import os
import time

from kvtest import logits_diff, prefill
from remote_fixture import fleet
from test_remote_ops import C, cli, toks

import kvstore
from kvstore.remote.seal import Fleet, new_key, parse_keys
from kvstore.upkeep.anchors import FLEET_KEYS
from kvstore.upkeep.local import LocalStore


def key_file(path, secret: str) -> str:
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return str(path)


def fleet_store(store, url, model, path, prompts) -> list[bytes]:
    """A fleet node's store holding `prompts` (uploaded) written after it joined the fleet (what it
    held before is taken as it is: trust on first use); the hashes of their records."""
    with kvstore.open(store, chunk_size=C, remote=url):
        pass
    time.sleep(2.1)  # (the store's records are the fleet's from the second after it joined)
    with kvstore.open(store, chunk_size=C, remote=url) as a:
        mc = a.bind(model, path)
        for p in prompts:
            mc.insert(p, prefill(model, p))
        assert a.flush(30)
        return [h for p in prompts for h in mc.record_hashes(p)]


def held(store) -> tuple[int, int, int]:
    """(records, of them quarantined, blob files) of a store."""
    with LocalStore(store, create=False) as files:
        rows = list(files.index.rows())
    return len(rows), sum(r.bad for r in rows), sum(1 for p in (store / "blobs").rglob("*") if p.is_file())


def test_verify_with_a_wrong_key_reports_the_key_once_and_repair_deletes_no_record(tmp_path, s3, llama):
    path, model = llama
    url, store = s3.url(), tmp_path / "a"
    hashes = fleet_store(store, url, model, path, [toks(3 * C + 5, 61), toks(2 * C + 1, 62)])
    before = held(store)
    assert before[0] == len(hashes) and before[1] == 0
    wrong = new_key()
    wrong_file = key_file(tmp_path / "wrong.key", wrong)
    for how in (["--remote-key-file", wrong_file], []):  # a key file, or the environment
        env = {} if how else {"KVSTORE_REMOTE_KEY": wrong}
        out = cli("verify", "--store", str(store), *how, env=env)
        lines = out.stdout.strip().splitlines()
        assert out.returncode == 1, out.stdout + out.stderr
        assert [ln.split(":", 1)[0] for ln in lines[:-1]] == ["wrong_key"], out.stdout
        wrong_id = Fleet.of(parse_keys(wrong, "the wrong key")).key_id
        assert f"key {wrong_id}" in lines[0] and f"key {fleet().key_id}" in lines[0], lines[0]
        assert "--repair" not in lines[-1].replace("--repair changes nothing", ""), lines[-1]
        assert "corrupt_blob" not in out.stdout
    out = cli("verify", "--store", str(store), "--remote-key-file", wrong_file, "--repair")
    assert out.returncode == 1 and "wrong_key" in out.stdout, out.stdout + out.stderr
    assert held(store) == before
    assert cli("verify", "--store", str(store)).returncode == 0  # the right secret (KVSTORE_REMOTE_KEY): clean
    # A store that joined before kvstore noted its fleet key: told from its records' tags.
    with LocalStore(store) as files:
        files.index.conn.execute("DELETE FROM meta WHERE key LIKE ?", (FLEET_KEYS + "%",))
    out = cli("verify", "--store", str(store), "--remote-key-file", wrong_file, "--repair")
    assert out.returncode == 1 and out.stdout.startswith("wrong_key"), out.stdout + out.stderr
    assert held(store) == before
    assert cli("verify", "--store", str(store)).returncode == 0


def test_a_node_with_a_wrong_key_keeps_its_records_and_says_so_once(tmp_path, s3, llama, monkeypatch, caplog):
    """Opened with a wrong KVSTORE_REMOTE_KEY, the node's stored prompts are misses (nothing of
    them is served or quarantined), said once. What it writes meanwhile under the wrong key never
    makes that key the store's. With the right key again, every record restores from the disk."""
    path, model = llama
    url, store = s3.url(), tmp_path / "a"
    prompts = [toks(3 * C + 5, 63), toks(2 * C + 7, 64)]
    fleet_store(store, url, model, path, prompts)
    before = held(store)
    right = os.environ["KVSTORE_REMOTE_KEY"]
    monkeypatch.setenv("KVSTORE_REMOTE_KEY", new_key())
    for _ in range(2):  # the second run after the first wrote under the wrong key
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvstore"), \
                kvstore.open(store, chunk_size=C, remote=url, memory_bytes=0) as a:
            mc = a.bind(model, path)
            for p in prompts:
                _, rest = mc.fetch(p + [3])
                assert len(rest) == len(p) + 1  # a miss
            assert a.disk.quarantined == 0
            new = toks(3 * C + 2, 65)  # written under the wrong key: the store's own all the same
            mc.insert(new, prefill(model, new))
            assert a.flush(30)
        said = [r.getMessage() for r in caplog.records if "is not the one this store's trust tags" in r.getMessage()]
        assert len(said) == 1 and "quarantined" not in caplog.text, caplog.text
    assert held(store)[1] == 0 and held(store)[0] >= before[0]
    monkeypatch.setenv("KVSTORE_REMOTE_KEY", right)
    with kvstore.open(store, chunk_size=C, remote=url, memory_bytes=0) as a:
        mc = a.bind(model, path)
        for p in prompts + [new]:  # (what it wrote under the wrong key, whole: not one record a request)
            query = p + [3]
            cache, rest = mc.fetch(query)
            assert len(rest) == 1 and logits_diff(model, cache, rest, query) < 1e-4
        assert a.disk.quarantined == 0 and a.stats()["remote"]["downloads"] == 0
