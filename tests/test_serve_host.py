"""`kvstore serve` answers only requests addressed to it (DNS rebinding) and keeps paths out of
`/kvstore/stats` unless started with `--stats-paths`. Real servers in subprocesses, raw HTTP over
a socket so the `Host` header is exactly what a rebinding page would send."""

from __future__ import annotations

import json
import socket

from test_server import Server, ask, chat_messages

from kvstore.serve.endpoints import Hosts


def raw(server: Server, request: bytes) -> tuple[int, bytes]:
    """(status, body) of one raw HTTP request to the server."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def get(server: Server, path: str, host: str | None) -> tuple[int, bytes]:
    host_line = f"Host: {host}\r\n" if host is not None else ""
    return raw(server, f"GET {path} HTTP/1.1\r\n{host_line}Connection: close\r\n\r\n".encode())


def test_host_names_a_server_answers_for():
    local = Hosts("127.0.0.1")
    for header in ("localhost", "localhost:8080", "LOCALHOST.:80", "127.0.0.1:8080", "[::1]:8080", "[::1]"):
        assert local.allows(header), header
    for header in ("evil.example", "evil.example:8080", "localhost.evil.example", "127.0.0.2", "192.168.1.7:8080",
                   "", "[::2]:8080"):
        assert not local.allows(header), header
    named = Hosts("box.lan", ["proxy.example"])
    assert named.allows("box.lan:8080") and named.allows("Proxy.Example") and not named.allows("evil.example")
    everywhere = Hosts("0.0.0.0")
    assert everywhere.allows("192.168.1.7:8080") and everywhere.allows("[fe80::1]:8080")
    assert not everywhere.allows("evil.example:8080")
    assert Hosts("127.0.0.1", ["*"]).allows("anything.example")


def test_requests_for_another_host_are_refused_and_stats_keep_paths_out(demo_model, tmp_path):
    model = demo_model("llama")
    store = tmp_path / "store"
    with Server(model, store, tmp_path / "log") as server:
        ask(server, messages=chat_messages())  # a model row, with its path as its id
        host = f"127.0.0.1:{server.port}"
        assert get(server, "/health", host)[0] == 200
        assert get(server, "/health", f"localhost:{server.port}")[0] == 200
        for path in ("/health", "/kvstore/stats", "/metrics", "/v1/models"):
            status, body = get(server, path, "evil.example")
            assert status == 421 and b"evil.example" in body and b"--allowed-hosts" in body, (path, status, body)
            assert get(server, path, f"evil.example:{server.port}")[0] == 421
        status, body = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: evil.example\r\nContent-Type: "
                                   b"application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        assert status == 421, body
        assert get(server, "/health", None)[0] == 400  # HTTP/1.1 without a Host
        for path in (b"/v1/completions", b"/v1/completions/render"):  # no Content-Length: never read, refused
            status, body = raw(server, b"POST " + path + b" HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
                                       b"Content-Type: application/json\r\nConnection: close\r\n\r\n{}")
            assert status in (400, 411), (path, status, body)
        assert "refused a request addressed to the host evil.example" in server.log()

        status, body = get(server, "/kvstore/stats", host)
        assert status == 200
        stats = json.loads(body)
        assert "path" not in stats and str(store) not in body.decode() and str(model) not in body.decode()
        assert stats["models"] and stats["models"][0]["model_id"] == model.name
        assert stats["chunks"] + stats["tails"] > 0


def test_stats_paths_and_allowed_hosts_are_the_operators_choice(demo_model, tmp_path):
    model = demo_model("llama")
    store = tmp_path / "store"
    with Server(model, store, tmp_path / "log", "--stats-paths", "--allowed-hosts", "proxy.example") as server:
        ask(server, messages=chat_messages())
        assert get(server, "/health", "proxy.example")[0] == 200
        assert get(server, "/health", "evil.example")[0] == 421
        status, body = get(server, "/kvstore/stats", "proxy.example")
        stats = json.loads(body)
        assert status == 200 and stats["path"] == str(store.resolve())
        assert stats["models"][0]["model_id"] == str(model)
