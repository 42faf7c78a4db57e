"""What the remote tier lets out, and what it lets in through the local files: credentials pasted
into the URL are refused and never shown; a recorded error holds no object key; the uploader
opens blobs as the local reads do (a FIFO in a blob's place never blocks a flush); foreign object
keys reach the terminal escaped; and `gc --remote` / `verify --remote` with no store make none.

The URL and uploader tests need no bucket: an S3 client pointed at a port where nothing listens
is a real endpoint that is down. The others run against the session's SeaweedFS.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from faultproc import prompts
from kvtest import prefill

import kvstore
from kvstore.errors import InvalidInputError
from kvstore.remote.bucket import RemoteAuthError, RemoteError, RemoteUnreachable, open_bucket
from kvstore.remote.health import Health
from kvstore.remote.layout import key_of
from kvstore.remote.s3 import S3Bucket
from kvstore.remote.seal import Fleet
from kvstore.remote.uploader import Uploader
from kvstore.storage import blobtree
from kvstore.upkeep.anchors import Anchors
from kvstore.upkeep.local import LocalStore

C = 16
REPO = Path(__file__).resolve().parents[1]
KEY_ID, SECRET = "AKIAPASTEDKEY1234", "pasted/Secret+Value0123"


def cli(*args, env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("KVSTORE_DIR", "KVSTORE_REMOTE")}
    # A fleet secret, for a remote tier that asks for one (a random key nobody else holds).
    base.setdefault("KVSTORE_REMOTE_KEY", secrets.token_hex(32))
    result = subprocess.run([sys.executable, "-m", "kvstore.cli", *map(str, args)], capture_output=True, text=True,
                            timeout=120, cwd=REPO, env={**base, "PYTHONPATH": str(REPO), **env})
    assert "Traceback" not in result.stderr, result.stderr
    return result


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def down_endpoint(monkeypatch) -> str:
    """AWS_* pointing at 127.0.0.1 on a port where nothing listens."""
    endpoint = f"http://127.0.0.1:{closed_port()}"
    for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "kvtest", "AWS_SECRET_ACCESS_KEY": "kvtest",
                        "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    return endpoint


def stored_rows(store: Path, llama) -> list:
    model_path, model = llama
    with kvstore.open(store, chunk_size=C) as s:
        mc = s.bind(model, model_path)
        t = prompts(71, 1, C)[0][: 2 * C]
        mc.insert(t, prefill(model, t))
        s.flush()
        return sorted(s.index.rows(), key=lambda r: r.depth)


# -- credentials in the URL --------------------------------------------------------------------

CREDENTIAL_URLS = [f"s3://{KEY_ID}:{SECRET}@bucket/team", f"s3://{KEY_ID}@bucket/team",
                   f"http://{KEY_ID}:{SECRET}@host/bucket"]


@pytest.mark.parametrize("url", CREDENTIAL_URLS)
def test_credentials_in_the_url_are_refused_and_never_shown(tmp_path, url, demo_model_path):
    with pytest.raises(InvalidInputError) as e:
        kvstore.open(tmp_path / "lib", remote=url)
    assert "AWS_ACCESS_KEY_ID" in str(e.value) and KEY_ID not in str(e.value) and SECRET not in str(e.value)
    assert not (tmp_path / "lib").exists()
    with pytest.raises(InvalidInputError):
        open_bucket(url)
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home)}
    runs = [cli("gc", "--remote", url, "--max-age", "7d", env=env)]
    if url == CREDENTIAL_URLS[0]:  # (every command checks the URL through the same parser: one form is enough)
        runs += [cli("verify", "--remote", url, env=env), cli("stats", "--store", tmp_path / "s", "--remote", url, env=env),
                 cli("warm", "--store", tmp_path / "s", "--model", demo_model_path, "--prompts",
                     REPO / "examples" / "prompts.jsonl", "--remote", url, env=env),
                 subprocess.run([sys.executable, "-m", "kvstore.serve", "--model", str(demo_model_path), "--store",
                                 str(tmp_path / "s"), "--remote", url], capture_output=True, text=True, timeout=120,
                                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env})]
    for run in runs:
        said = run.stdout + run.stderr
        assert run.returncode != 0 and "AWS_ACCESS_KEY_ID" in said, said
        assert KEY_ID not in said and SECRET not in said, said
    assert not (tmp_path / "s").exists() and list(home.iterdir()) == []


# -- a mistyped endpoint, bucket name or missing credentials: one line each -------------------

@pytest.mark.parametrize("endpoint", ["notaurl", "127.0.0.1:9000", "http://", "http://127.0.0.1:99999",
                                      "ftp://127.0.0.1:9000"])
def test_an_endpoint_that_is_not_a_url_is_one_line_not_a_panic(tmp_path, endpoint, demo_model_path):
    """The S3 client takes any endpoint and panics at its first request (a Rust panic, which no
    `except Exception` catches): every command ended in a traceback. It is refused up front,
    by name, and no store is made."""
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "kvtest", "AWS_SECRET_ACCESS_KEY": "kvtest",
           "HOME": str(tmp_path)}
    runs = [cli("verify", "--remote", "s3://kvtest/team", env=env)]
    if endpoint == "notaurl":  # (every command checks the endpoint through the same parser: one form is enough)
        runs += [cli("generate", "--store", tmp_path / "s", "--model", demo_model_path, "--prompt", "hi",
                     "--max-tokens", "1", "--remote", "s3://kvtest/team", env=env),
                 cli("pack", "pull", "s3://kvtest/pack", tmp_path / "pulled", env=env)]
    for run in runs:
        errors = [line for line in run.stderr.splitlines() if re.match(r"kvstore [a-z ]+: error: ", line)]
        assert run.returncode == 1 and len(errors) == 1, run.stdout + run.stderr
        assert f"endpoint {endpoint!r}" in errors[0] and "AWS_ENDPOINT_URL" in errors[0], errors[0]
    assert not (tmp_path / "s").exists() and not (tmp_path / "pulled").exists()


def test_a_bucket_name_no_store_takes_is_refused_by_name(tmp_path):
    """Such a name reached the store, whose answer read as refused credentials."""
    with pytest.raises(InvalidInputError, match="'Team_Cache!' is not a bucket name"):
        kvstore.open(tmp_path / "lib", remote="s3://Team_Cache!/kv")
    assert not (tmp_path / "lib").exists()
    open_bucket("s3://Team_Cache.v2-x/kv")  # capitals, dots, dashes, underscores: some stores take them


def test_no_credentials_at_all_are_said_as_such(tmp_path, monkeypatch):
    """With no key set, the S3 client asks the instance's credential service: its failure was shown
    raw (or, where that service does not answer, as an endpoint that cannot be reached)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws either
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    try:
        size = S3Bucket("s3://kvtest/team").head("x")
    except RemoteAuthError as e:
        said = str(e)
    else:
        pytest.skip(f"this machine's instance credentials answered ({size})")
    assert "no credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set" in said, said
    assert "s3://kvtest/team" in said and "\n" not in said and "169.254" not in said


def test_an_endpoint_that_is_not_an_s3_store_is_not_called_a_missing_bucket(tmp_path, monkeypatch):
    """A server that answers 404 to everything (a web server, the object store's filer port) was
    said to have no such bucket: only S3's NoSuchBucket says that."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Length", "9")
            self.end_headers()
            self.wfile.write(b"not found")

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "kvtest",
                            "AWS_SECRET_ACCESS_KEY": "kvtest"}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(RemoteUnreachable) as e:
            S3Bucket("s3://kvtest/team").folders("")
        said = str(e.value)
        assert "does not exist" not in said and "not as an S3 store" in said and endpoint in said, said
        run = cli("pack", "pull", "s3://kvtest/pack", tmp_path / "pulled", env={})
        assert run.returncode == 1 and "not as an S3 store" in run.stderr, run.stderr
        assert "has no manifest.json" not in run.stderr and "does not exist" not in run.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_a_key_printed_into_a_file_makes_the_file_private(tmp_path):
    """`kvstore remote-key > fleet.key`, as the docs show it: the shell made the file 0644, and
    every command given it warned that other users can read the fleet's secret."""
    from kvstore.remote.seal import read_key_file

    target = tmp_path / "fleet.key"
    with open(target, "w") as f:
        target.chmod(0o644)
        run = subprocess.run([sys.executable, "-m", "kvstore.cli", "remote-key"], stdout=f, stderr=subprocess.PIPE,
                             text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert target.stat().st_mode & 0o777 == 0o600 and len(read_key_file(str(target))) == 1
    piped = subprocess.run([sys.executable, "-m", "kvstore.cli", "remote-key"], capture_output=True, text=True,
                           timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert piped.returncode == 0 and len(piped.stdout.strip()) == 43  # a pipe: printed as before


# -- errors hold no object key -----------------------------------------------------------------

def test_a_recorded_error_holds_no_object_key(tmp_path, llama, down_endpoint, caplog):
    rows = stored_rows(tmp_path / "s", llama)
    sealer = Fleet(secrets.token_bytes(32)).sealer(rows[-1].ns)
    key = key_of(sealer, rows[-1], np.arange(rows[-1].ntokens))
    bucket = S3Bucket("s3://kvtest/team")
    # An endpoint that does not answer is a setup mistake: one line of kvstore's own, naming the
    # remote and its endpoint and what to check, never the request's key.
    with pytest.raises(RemoteUnreachable) as down:
        bucket.head(key)
    said = str(down.value)
    assert "s3://kvtest/team" in said and down_endpoint in said and "AWS_ENDPOINT_URL" in said, said
    assert sealer.name(rows[-1].hash) not in said and "\n" not in said
    # Any other error of the backend names the request: what is kept of it holds no key.
    error = RemoteError(f"HEAD {key}: GenericError: Generic S3 error: 500 for {down_endpoint}/kvtest/team/{key}")
    health = Health()
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        health.error(error, down=True)
    for where in (health.last_error, caplog.text):
        assert where and "RemoteError" in where, where
        for part in (p for p in key.split("/") if len(p) >= 16):  # namespace, parent, the record
            assert part not in where and part[:16] not in where, (part, where)
        assert key.rpartition("/")[0] not in where
        assert down_endpoint not in where
    assert len(health.last_error) <= 240


# -- the uploader opens blobs as the local reads do ---------------------------------------------

@pytest.mark.parametrize("replace", ["fifo", "larger", "symlink", "none"])
def test_the_uploader_opens_only_a_regular_blob_of_its_rows_size(tmp_path, llama, down_endpoint, replace):
    """A FIFO in a blob's place never blocks `flush`; a file larger than its row, or a link, is not
    read. With the blob as it was ("none"), the upload reaches the (down) endpoint: an error."""
    store = tmp_path / "s"
    root = store / "blobs"
    row = stored_rows(store, llama)[0]  # a first record: no parent to ask the bucket about
    path = blobtree.blob_path(root, row.hash)
    if replace == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif replace == "larger":
        with open(path, "ab") as f:
            f.write(b"\0" * 4096)
    elif replace == "symlink":
        aside = tmp_path / "elsewhere.safetensors"
        path.rename(aside)
        path.symlink_to(aside)
    health = Health()
    fleet = Fleet(secrets.token_bytes(32))
    with LocalStore(store) as files:  # its records' tags are under the store's own key
        uploader = Uploader(S3Bucket("s3://kvtest/team"), health, fleet, root, lambda h: None, lambda ns: 0,
                            threads=1, anchors=Anchors(files.trust(), files.index, root))
        try:
            uploader.submit([row])
            assert uploader.flush(timeout=60), "the upload is stuck"
        finally:
            uploader.close(timeout=5)
    assert health.counters["uploads"] == 0
    assert health.counters["upload_errors"] == (1 if replace == "none" else 0), health.counters


# -- against a real bucket ---------------------------------------------------------------------

def test_remote_maintenance_without_a_store_creates_nothing_and_prints_keys_escaped(tmp_path, s3):
    url = s3.url()
    bucket = S3Bucket(url)
    evil = "report\u202egpj.exe"  # shown raw, it reads "reportexe.jpg"
    bucket.put(f"{'ab' * 16}/{evil}", b"planted by a bucket writer")
    home, nowhere = tmp_path / "home", tmp_path / "no-store"
    home.mkdir()
    for env in ({"HOME": str(home)}, {"HOME": str(home), "KVSTORE_DIR": str(nowhere)}):
        out = cli("verify", "--remote", url, env=env)
        assert out.returncode == 0 and "note: foreign_object" in out.stdout, out.stdout + out.stderr
        assert "\u202e" not in out.stdout + out.stderr
        assert "report\\u202egpj.exe" in out.stdout, out.stdout
        out = cli("gc", "--remote", url, "--max-age", "7d", "--dry-run", env=env)
        assert out.returncode == 0 and "would delete 0 objects" in out.stdout, out.stdout + out.stderr
        out = cli("gc", "--remote", url, "--max-bytes", "0", env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert list(home.iterdir()) == [] and not nowhere.exists()
    # A store that is there is used (its pins are published), and nothing else is made.
    store = tmp_path / "s"
    kvstore.open(store).close()
    out = cli("gc", "--store", store, "--remote", url, "--max-age", "7d", env={"HOME": str(home)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert (store / "remote-node-id").exists() and list(home.iterdir()) == []
