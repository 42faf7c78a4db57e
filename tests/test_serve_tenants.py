"""Tenants of `kvstore serve`, end to end: real HTTP on 127.0.0.1 against `python -m kvstore.serve`
subprocesses serving the tiny demo model, on a store warmed with a shared system prompt; and the
request-to-cache plumbing (`serve.tenancy.policy`) in this process."""

from __future__ import annotations

import functools
import json
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import requests
from kvtest import prefill, run_cli
from test_server import Server, cached

import kvstore
from kvstore import tenants
from kvstore.serve.options import build_parser, server_settings
from kvstore.serve.promptcache import PersistentPromptCache
from kvstore.serve.tenancy import isolation
from kvstore.serve.tenancy.isolation import ALPHA, SHARED_CHECK, Report, chance_p, min_probes, scored
from kvstore.serve.tenancy.policy import (
    UNKNOWN,
    UNNAMED,
    Refused,
    RequestTenants,
    TenantPolicy,
    describe_tenants,
    parse_source,
)
from kvstore.storage.storedir import tenant_key

SYSTEM = {"role": "system", "content": "You are the assistant of a clinic. Answer in one short sentence. " * 4}
SECRET = "My diagnosis code is 4711-XQ; keep it between us. " * 4
# What a tenant reuses of its own earlier, unrelated requests past the shared prompt: the user
# turn's opening tokens of the chat template, and a few letters its text shares by chance.
OWN = 8


@pytest.fixture(scope="module")
def warmed(demo_model, tmp_path_factory):
    """(model folder, a store warmed with SYSTEM, the prompt file it was warmed from)."""
    model, work = demo_model("llama"), tmp_path_factory.mktemp("tenants")
    prompts = work / "system.jsonl"
    prompts.write_text(json.dumps({"messages": [SYSTEM]}) + "\n")
    run_cli("warm", "--store", work / "store", "--model", model, "--prompts", prompts)
    return model, work / "store", prompts


PROBE_TEXT = 150  # characters of each probe's private part (the demo tokenizer: a token each)


@pytest.fixture
def short_probes(monkeypatch):
    """`verify --isolation` in this process with probe texts of PROBE_TEXT characters instead of
    600: every probe is a prompt the server computes (22 of them at `--probes 7`, more at 10), and
    what the checks compare (reused tokens, by tenant) does not depend on the length. A server
    that leaked would still give B's probes of A's prompts all of A's PROBE_TEXT private tokens,
    far above the fresh prompts' reuse plus `isolation.SLACK` (8)."""
    assert PROBE_TEXT > 10 * isolation.SLACK
    monkeypatch.setattr(isolation, "check_server", functools.partial(isolation.check_server, text_tokens=PROBE_TEXT))


def chat(server, user: str, headers=None, **body):
    r = requests.post(server.url + "/v1/chat/completions", headers=headers or {}, timeout=120, json={
        "messages": [SYSTEM, {"role": "user", "content": user}], "max_tokens": 2, "temperature": 0.0, **body})
    return r


def usage(server, user: str, tenant: str | None, **body) -> dict:
    r = chat(server, user, {"X-Tenant": tenant} if tenant else None, **body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_two_tenants_by_header_share_only_the_warmed_system_prompt(warmed, tmp_path, short_probes):
    model, store, prompts = warmed
    with Server(model, store, tmp_path / "log", "--tenant-from", "header:X-Tenant") as server:
        first = usage(server, SECRET, "alice")
        shared = cached(first)
        assert 0 < shared < first["prompt_tokens"] - 150  # the warmed system prompt, none of the secret
        assert cached(usage(server, SECRET, "alice")) == first["prompt_tokens"] - 1  # A's second: all of it
        assert cached(usage(server, SECRET, "bob")) == shared  # B with A's exact prompt: the shared part only
        # Without the header: refused, and nothing is computed for it.
        r = chat(server, SECRET)
        assert r.status_code == 400 and "X-Tenant header" in r.json()["error"]
        # A request with a seed is served alone (mlx_lm.server's one-at-a-time path): the same.
        alone = usage(server, "a seeded question of alice's " * 8, "alice", seed=3)
        assert cached(usage(server, "a seeded question of alice's " * 8, "alice", seed=3)) == alone["prompt_tokens"] - 1
        assert cached(usage(server, "a seeded question of alice's " * 8, "bob", seed=3)) <= shared + OWN
        # cache_salt is ignored without --trust-client-salt: alice with a salt is still alice.
        assert cached(usage(server, SECRET, "alice", cache_salt="other")) == first["prompt_tokens"] - 1
        # Two tenants at once (mlx_lm.server batches them): each request's cache lands in its own tenant.
        texts = {who: f"{who} asks about the results of the tests of {who}. " * 6 for who in ("carol", "dave")}
        got: dict = {}
        threads = [threading.Thread(target=lambda w=w: got.__setitem__(w, usage(server, texts[w], w))) for w in texts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for who, text in texts.items():
            other = "dave" if who == "carol" else "carol"
            assert cached(usage(server, text, who)) == got[who]["prompt_tokens"] - 1
            assert cached(usage(server, text, other)) <= shared + OWN
        log = server.log()
        stats = requests.get(server.url + "/kvstore/stats", timeout=10).json()
        metrics = requests.get(server.url + "/metrics", timeout=10).text
        # verify --isolation against it, as an operator runs it (in this process: it is an HTTP client)
        out = run_cli("verify", "--isolation", server.url, "--tenant-from", "header:X-Tenant",
                      "--prompts", prompts, "--probes", "10")
    for who in ("alice", "bob", "carol", "dave"):
        assert who not in log  # tenants are named by tag, never by the header's value
    assert "keep them for the operator" in log  # /metrics and /kvstore/stats show every tenant's bytes
    assert "kvstore: serving tenants apart (the tenant is the X-Tenant header" in log, log  # the start line
    assert re.search(r"what the store holds without a tenant \(\d+\.\d [KM]iB: what `kvstore warm`", log), log
    tags = {t["tenant"] for t in stats["tenants"]}
    assert len(tags) >= 4 and all(len(t) == 16 for t in tags)
    assert all(f'kvstore_tenant_bytes{{tenant="{t}"}}' in metrics for t in tags)
    assert "tenants are kept apart: 5 checks ran and passed" in out.stdout, out.stdout
    for check in ("the same tenant hits", "another tenant misses", "the shared prompt hits for both",
                  "time to first token tells nothing", "cached_tokens tells nothing"):
        assert f"ok   {check}" in out.stdout, out.stdout
    assert "median" in out.stdout


def test_exact_mode_reports_each_tenants_own_reuse_when_tenants_send_one_prompt_at_once(demo_model, tmp_path):
    """In exact mode kvstore prefills the prompt itself and counts what it computed for each
    request, to take it out of cached_tokens. That count was kept by prompt alone: four tenants
    sending one new prompt at once left one count for four requests, and three of them were told
    the whole prompt was cached (1 less than its length) though each computed all but the shared
    part; the same prompt of another tenant could change what a request was told."""
    model, prompts = demo_model("llama"), tmp_path / "system.jsonl"
    prompts.write_text(json.dumps({"messages": [SYSTEM]}) + "\n")
    run_cli("warm", "--store", tmp_path / "store", "--model", model, "--prompts", prompts, "--exact-prefill", "256")
    with Server(model, tmp_path / "store", tmp_path / "log", "--tenant-from", "header:X-Tenant",
                "--exact-prefill", "256") as server:
        shared = cached(usage(server, "a first question " * 4, "erin"))
        assert shared >= 256
        got: dict = {}
        who = [f"tenant-{i}" for i in range(4)]
        threads = [threading.Thread(target=lambda w=w: got.__setitem__(w, usage(server, SECRET, w))) for w in who]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [cached(got[w]) for w in who] == [shared] * 4, got  # each computed its own part
        assert all(cached(usage(server, SECRET, w)) == got[w]["prompt_tokens"] - 1 for w in who)


def test_a_trusted_cache_salt_keeps_clients_apart(warmed, tmp_path):
    model, store, _ = warmed
    with Server(model, store, tmp_path / "log", "--trust-client-salt") as server:
        first = usage(server, SECRET, None, cache_salt="team-a")
        shared = cached(first)
        assert shared > 0
        assert cached(usage(server, SECRET, None, cache_salt="team-a")) == first["prompt_tokens"] - 1
        assert cached(usage(server, SECRET, None, cache_salt="team-b")) == shared
        assert cached(usage(server, SECRET, None)) == shared  # no salt: not team-a's
        # Requests without a salt are a tenant of their own: they reuse each other's prompts, and a
        # salted request for one of them reuses only the shared prompt (no oracle on them).
        victim = "An unsalted client's own question, never sent before. " * 3
        unsalted = usage(server, victim, None)
        assert cached(unsalted) <= shared + OWN
        assert cached(usage(server, victim, None)) == unsalted["prompt_tokens"] - 1
        assert cached(usage(server, victim, None, cache_salt="evil")) == shared
        r = chat(server, SECRET, cache_salt=7)
        assert r.status_code == 400 and "cache_salt" in r.json()["error"]
        r = chat(server, SECRET, cache_salt="s" * 5000)  # (was a 500 "ValueError")
        assert r.status_code == 400 and "cache_salt is too long" in r.json()["error"], r.text
        # /v1/completions reads it too
        body = {"prompt": SECRET * 2, "max_tokens": 2, "temperature": 0.0}
        one = requests.post(server.url + "/v1/completions", json={**body, "cache_salt": "x"}, timeout=120).json()
        two = requests.post(server.url + "/v1/completions", json={**body, "cache_salt": "y"}, timeout=120).json()
        again = requests.post(server.url + "/v1/completions", json={**body, "cache_salt": "x"}, timeout=120).json()
    assert cached(two["usage"]) == 0 and cached(again["usage"]) == one["usage"]["prompt_tokens"] - 1


def test_gc_drops_one_cache_salts_records_and_keeps_the_others(warmed, tmp_path):
    """`kvstore gc --drop-tenant-salt team-a`, run between two `--trust-client-salt` servers on one
    store: team-a's records go (its prompt is computed again past the shared one), team-b's and
    the unsalted requests' stay and are reused whole."""
    model, _, prompts = warmed
    store = tmp_path / "store"
    run_cli("warm", "--store", store, "--model", model, "--prompts", prompts)
    own = "An unsalted client's question, asked before gc. " * 3
    with Server(model, store, tmp_path / "log", "--trust-client-salt") as server:
        first = {salt: usage(server, SECRET, None, cache_salt=salt) for salt in ("team-a", "team-b")}
        unsalted = usage(server, own, None)
        assert server.stop() == 0  # (SIGTERM: it flushes what it queued for the disk)
    with kvstore.open(store) as opened:
        assert len(opened.stats()["tenants"]) == 3  # two salts and the unsalted requests
    shared = cached(first["team-a"])
    gone = run_cli("gc", "--store", store, "--drop-tenant-salt", "team-a")
    team_a = tenants.derive(tenant_key(store, create=False), tenants.salted_id(None, "team-a")).tag
    assert re.search(rf"^tenant {team_a}: \d+ records? \(.*\) deleted", gone.stdout, re.M), gone
    missing = run_cli("gc", "--store", store, "--drop-tenant-salt", "team-c", check=False)
    assert missing.returncode == 1 and "holds no records of the tenant of that cache_salt" in missing.stderr
    with Server(model, store, tmp_path / "log2", "--trust-client-salt") as server:
        assert cached(usage(server, SECRET, None, cache_salt="team-a")) == shared  # computed again
        assert cached(usage(server, SECRET, None, cache_salt="team-b")) == first["team-b"]["prompt_tokens"] - 1
        assert cached(usage(server, own, None)) == unsalted["prompt_tokens"] - 1


def test_a_server_without_tenants_never_shares_its_requests_with_tenants(demo_model, tmp_path):
    """A `--tenant-from none` server on a store tenants use: before the tenants' server starts its
    requests are shared; after, it stores none (it is told within seconds); started after it,
    its requests are a tenant of their own. Tenants reuse none of them."""
    model, prompts = demo_model("llama"), tmp_path / "system.jsonl"
    prompts.write_text(json.dumps({"messages": [SYSTEM]}) + "\n")
    store = tmp_path / "store"
    run_cli("warm", "--store", store, "--model", model, "--prompts", prompts)
    before, after, later = (f"Question {n} of a client of the plain server. " * 3 for n in ("one", "two", "three"))
    with Server(model, store, tmp_path / "plain.log") as plain:
        assert cached(usage(plain, before, None)) > 0  # the warmed prompt
        with Server(model, store, tmp_path / "tenants.log", "--tenant-from", "header:X-Tenant") as tenants:
            time.sleep(2.5)  # the plain server looks at its store every 2 s
            sent = usage(plain, after, None)
            shared = cached(usage(tenants, after, "mallory"))
            assert shared < sent["prompt_tokens"] - 30  # the warmed prompt only: `after` was not stored
            assert cached(usage(plain, after, None)) <= shared + OWN
            # Started on the store the tenants use: its requests are a tenant of their own.
            with Server(model, store, tmp_path / "plain2.log") as plain2:
                first = usage(plain2, later, None)
                assert cached(first) <= shared + OWN
                assert cached(usage(plain2, later, None)) == first["prompt_tokens"] - 1
                assert cached(usage(tenants, later, "mallory")) <= shared + OWN
                start_line = plain2.log()
    assert "stores none of its requests from now on" in plain.log()
    assert "stored as one tenant of their own" in start_line


def test_verify_isolation_never_passes_a_server_that_does_not_isolate(warmed, tmp_path, short_probes):
    """Without cached_tokens in the answers, verify measures reuse through /metrics: a server
    that ignores the tenants' header fails "another tenant misses"; a shared prompt nobody warmed
    fails "the shared prompt hits for both"; too few probes to fail the timing check are refused."""
    model, store, prompts = warmed
    unwarmed = tmp_path / "unwarmed.jsonl"
    unwarmed.write_text(json.dumps({"messages": [{"role": "system", "content": "Nobody warmed this. " * 40}]}) + "\n")
    few = run_cli("verify", "--isolation", "http://127.0.0.1:9", "--probes", "6", check=False)
    assert few.returncode == 2 and "at least 7" in few.stderr
    for url in ("127.0.0.1:8080", "prompts.jsonl"):  # (requests said "Invalid URL '...': No scheme supplied")
        wrong = run_cli("verify", "--isolation", url, check=False)
        assert wrong.returncode == 2 and f"--isolation {url}: not a server's URL: give http://HOST:PORT" in wrong.stderr
    off = ("--report-cached-tokens", "off")
    with Server(model, store, tmp_path / "one.log", *off) as server:  # one tenant: the header is ignored
        one = run_cli("verify", "--isolation", server.url, "--prompts", prompts, "--probes", "7", check=False)
    assert one.returncode == 1 and "FAIL another tenant misses" in one.stdout, one.stdout
    assert "tenants are NOT kept apart" in one.stdout and "from the server's /metrics" in one.stdout
    with Server(model, store, tmp_path / "two.log", "--tenant-from", "header:X-Tenant", *off) as server:
        two = run_cli("verify", "--isolation", server.url, "--prompts", unwarmed, "--probes", "7", check=False)
    assert two.returncode == 1, two.stdout
    for check in ("the same tenant hits", "another tenant misses", "cached_tokens tells nothing"):
        assert f"ok   {check}" in two.stdout, two.stdout
    assert "FAIL the shared prompt hits for both" in two.stdout
    assert "left in the store: the two probe tenants' records" in two.stdout


def test_an_isolation_report_with_a_check_not_run_is_no_pass():
    report = Report(checks={"the same tenant hits": (True, ""), "another tenant misses": (None, "not known")})
    assert not report.ok and "NOT shown to be kept apart" in report.verdict()
    report.checks["another tenant misses"] = (True, "")
    report.checks[SHARED_CHECK] = (None, "no shared prompt given")
    report.not_asked.add(SHARED_CHECK)
    assert report.ok and "not checked: the shared prompt" in report.verdict()
    assert chance_p(1.0, scored(min_probes())) < ALPHA <= chance_p(1.0, scored(min_probes() - 1))


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_bearer_default_tenant_no_cached_tokens_and_a_body_over_the_limit(warmed, tmp_path):
    model, store, _ = warmed
    (tmp_path / "admin").write_text("an-operator-token-0123456789\n")
    extra = ("--tenant-from", "bearer", "--default-tenant", "guest", "--report-cached-tokens", "off",
             "--max-body-bytes", "1MiB", "--admin-token-file", str(tmp_path / "admin"))
    with Server(model, store, tmp_path / "log", *extra) as server:
        for path in ("/metrics", "/kvstore/stats"):  # the operator's, not a tenant's (its token is no key)
            for auth in ({}, {"Authorization": "Bearer token-of-alice"}):
                refused = requests.get(f"{server.url}{path}", headers=auth, timeout=30)
                assert refused.status_code == 401 and refused.headers["WWW-Authenticate"].startswith("Bearer")
            ok = requests.get(f"{server.url}{path}", headers={"Authorization": "Bearer an-operator-token-0123456789"},
                              timeout=30)
            assert ok.status_code == 200, ok.text
        # verify --isolation needs the operator's token to read them: said at once, not as a missing check
        (tmp_path / "wrong").write_text("not-the-operator-token-0123\n")
        for extra_args in ([], ["--admin-token-file", str(tmp_path / "wrong")]):
            told = run_cli("verify", "--isolation", server.url, "--tenant-from", "bearer", *extra_args, check=False)
            assert told.returncode == 2 and "keeps /metrics and /kvstore/stats for its operator (401)" in told.stderr
        for _ in range(2):  # a repeated request: it hits, and still says nothing of it
            r = chat(server, SECRET, {"Authorization": "Bearer token-of-alice"})
            assert r.status_code == 200 and "prompt_tokens_details" not in r.json()["usage"]
        r = chat(server, SECRET)  # no token: the default tenant
        assert r.status_code == 200 and "prompt_tokens_details" not in r.json()["usage"]
        # streamed: its progress comments tell no token counts (prompt - total was the cached count)
        streamed = chat(server, SECRET, {"Authorization": "Bearer token-of-alice"}, stream=True,
                        stream_options={"include_usage": True})
        progress = [line for line in streamed.text.splitlines() if line.startswith(": keepalive")]
        assert progress and all(line == ": keepalive 0/0" for line in progress), progress
        assert "prompt_tokens_details" not in streamed.text
        fetched = requests.post(f"{server.url}/kvstore/prefetch", json={"messages": [{"role": "user", "content": SECRET}]},
                                headers={"Authorization": "Bearer token-of-alice"}, timeout=60)
        assert fetched.status_code == 200 and set(fetched.json()) == {"tokens"}, fetched.text  # nor does a prefetch
        before = _rss(server.proc.pid)
        status = _post_huge(server.port, 200 << 20)
        time.sleep(0.5)
        grew = _rss(server.proc.pid) - before
        assert chat(server, "still serving?").status_code == 200
        # a client's own token before the one its proxy added: the request is refused, not alice's
        twice = _post_raw(server.port, {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 1},
                          [("Authorization", "Bearer token-of-alice"), ("Authorization", "Bearer mallory")])
        assert twice.split()[1] == "400" and "2 times" in twice, twice
        log = server.log()
    assert status == 413
    assert grew < 32 << 20, f"RSS grew by {grew} bytes"
    assert "token-of-alice" not in log and "over --max-body-bytes" in log


def _post_raw(port: int, body: dict, headers: list[tuple[str, str]]) -> str:
    """POST `body` to chat completions with exactly these headers (a name may repeat); the answer."""
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"{head}Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer.decode(errors="replace")


def _post_huge(port: int, size: int) -> int:
    """POST a body of `size` bytes (sent for real, from a thread, until the server closes); the
    status the server answers."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {size}\r\n\r\n".encode())

    def send():
        chunk = b" " * (1 << 20)
        try:
            for _ in range(size >> 20):
                sock.sendall(chunk)
        except OSError:
            pass  # the server closed the connection: what is left is never read

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    head = sock.recv(4096).decode(errors="replace")
    sender.join(60)
    sock.close()
    return int(head.split()[1])


# -- in this process ------------------------------------------------------------------------------

def test_the_tenant_policy():
    header = TenantPolicy.parse("header:X-Tenant")
    assert header.tenant_of({"X-Tenant": " alice "}, {}) == "alice"
    with pytest.raises(Refused) as e:
        header.tenant_of({}, {})
    assert e.value.status == 400
    assert TenantPolicy.parse("header:X-Tenant", "guest").tenant_of({}, {}) == "guest"
    bearer = TenantPolicy.parse("bearer")
    assert bearer.tenant_of({"Authorization": "Bearer abc"}, {}) == "abc"
    with pytest.raises(Refused) as e:
        bearer.tenant_of({"Authorization": "Basic abc"}, {})
    assert e.value.status == 401 and "abc" not in str(e.value)
    assert not TenantPolicy().active and TenantPolicy().tenant_of({"X-Tenant": "a"}, {"cache_salt": "s"}) is None
    salted = TenantPolicy.parse("none", trust_client_salt=True)
    assert salted.active and salted.tenant_of({}, {"cache_salt": "s"}) != salted.tenant_of({}, {"cache_salt": "t"})
    assert salted.tenant_of({}, {}) == UNNAMED  # no salt: a tenant of its own, not the shared namespace
    assert salted.tenant_of({}, {"cache_salt": None}) == UNNAMED  # null: an optional field left unset
    for bad in ("", 7, ["s"]):
        with pytest.raises(Refused, match="cache_salt must be a non-empty string"):
            salted.tenant_of({}, {"cache_salt": bad})
    assert salted.tenant_of({}, {"cache_salt": "s"}) != UNNAMED
    assert TenantPolicy(unnamed=True).active and TenantPolicy(unnamed=True).tenant_of({}, {}) == UNNAMED
    with pytest.raises(Refused, match="control characters"):
        header.tenant_of({"X-Tenant": "a\x00b"}, {})
    for sly in (UNNAMED, "alice\x1f", "\x1calice", "alice\x85"):  # refused, not stripped into another's id
        with pytest.raises(Refused, match="control characters"):
            header.tenant_of({"X-Tenant": sly}, {})
    assert header.tenant_of({"X-Tenant": "alice\xa0"}, {}) == "alice\xa0"  # (a space of its own: its own tenant)
    from email.message import Message

    twice = Message()
    twice["X-Tenant"], twice["x-tenant"] = "alice", "mallory"  # (a proxy that appends its header)
    with pytest.raises(Refused, match="X-Tenant header 2 times") as e:
        header.tenant_of(twice, {})
    assert e.value.status == 400 and "alice" not in str(e.value)
    assert "own" not in describe_tenants(TenantPolicy.parse("bearer", trust_client_salt=True))  # refused, not own
    assert "one tenant of their own" in describe_tenants(salted)
    from kvstore.serve.endpoints import KVStoreEndpoints

    class Answered(KVStoreEndpoints):  # a refusal as the handler answers it: 401 carries its challenge
        path, said = "/v1/completions", []

        def _answer_json(self, status, value, headers=None):
            self.said.append((status, headers))

    for status, challenge in ((401, {"WWW-Authenticate": 'Bearer realm="kvstore"'}), (400, None)):
        Answered()._refused(Refused(status, "no tenant"))
        assert Answered.said[-1] == (status, challenge)
    for bad in ("header:", "header:a b", "cookie", "header:a:b"):
        with pytest.raises(ValueError):
            parse_source(bad)
    args, _ = build_parser().parse_known_args(["--default-tenant", "guest"])
    with pytest.raises(kvstore.InvalidInputError, match="--tenant-from"):
        server_settings(args)
    args, _ = build_parser().parse_known_args([])
    assert server_settings(args)["max_body_bytes"] == 64 << 20
    args, _ = build_parser().parse_known_args(["--max-body-bytes", "off"])
    assert server_settings(args)["max_body_bytes"] is None


def test_requests_carry_their_tenant_to_the_cache(llama, tmp_path):
    path, model = llama
    tokens = list(range(3, 70))
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        cache = PersistentPromptCache(store, tenants=True)
        cache.register("m", store.bind(model, str(path)))
        with cache.for_tenant("alice"):
            assert cache.fetch_nearest_cache("m", tokens) == (None, tokens)
            cache.insert_cache("m", tokens, prefill(model, tokens))
            cache.tenants.begin("alice")
            _, rest = cache.fetch_nearest_cache("m", tokens + [1])
            assert len(rest) == 1
        cache.tenants.begin("bob")
        assert cache.fetch_nearest_cache("m", tokens + [1]) == (None, tokens + [1])
        # No request said whose these are: neither looked up nor stored.
        assert cache.fetch_nearest_cache("m", tokens + [1]) == (None, tokens + [1])
        cache.insert_cache("m", tokens[:20], prefill(model, tokens[:20]))
        assert cache.counters["tenant_unknown"] == 2
        store.flush()
        assert {t["records"] for t in store.stats()["tenants"]} == {5}  # alice's 4 chunks and tail


def test_every_lookup_within_for_tenant_is_its_tenants(llama, tmp_path):
    """A conversation served turn by turn in one `for_tenant` block: each turn's lookup reuses the
    last turn's insert (the second lookup was served without the store, a miss every time)."""
    path, model = llama
    turns = [list(range(3, 40)), list(range(3, 70)), list(range(3, 101))]
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        cache = PersistentPromptCache(store, tenants=True)
        cache.register("m", store.bind(model, str(path)))
        reused = []
        with cache.for_tenant("alice"):
            for tokens in turns:
                _, rest = cache.fetch_nearest_cache("m", tokens)
                reused.append(len(tokens) - len(rest))
                cache.insert_cache("m", tokens, prefill(model, tokens))
        assert reused == [0, 37, 67] and cache.counters["tenant_unknown"] == 0
        with cache.for_tenant("bob"):
            assert cache.fetch_nearest_cache("m", turns[2]) == (None, turns[2])
            assert cache.fetch_nearest_cache("m", turns[2]) == (None, turns[2])
        assert cache.counters["tenant_unknown"] == 0
        with cache.for_tenant("alice"):  # a block without a lookup: the next lookup, outside, is no one's
            cache.insert_cache("m", turns[0], prefill(model, turns[0]))
        assert cache.fetch_nearest_cache("m", turns[2]) == (None, turns[2])  # (it was served alice's cache)
        assert cache.counters["tenant_unknown"] == 1


def test_a_store_whose_tenant_key_cannot_be_read_is_refused_at_start(tmp_path, capsys):
    """Every request of a tenant needs the store's tenant key: one that cannot be read was found
    request by request (each served without the store, a warning each); it is said at start."""
    from kvstore.serve.server import main

    kvstore.open(tmp_path / "s").close()
    (tmp_path / "s" / "tenant.key").write_text("not a key\n")
    assert main(["--store", str(tmp_path / "s"), "--tenant-from", "header:X-Tenant"]) == 1  # before a model loads
    err = capsys.readouterr().err
    assert f"kvstore serve: cannot serve tenants: cannot read {tmp_path / 's' / 'tenant.key'}" in err, err


def test_a_default_tenant_that_is_no_tenant_id_is_a_bad_command_line(tmp_path, capsys):
    """--default-tenant over 4,096 bytes started the server, whose every request without a tenant
    then failed its lookup and insert (served without the store, a warning each)."""
    from kvstore.serve.server import main

    args = ["--store", str(tmp_path / "s"), "--tenant-from", "header:X-Tenant", "--default-tenant", "x" * 5000]
    assert main(args) == 2
    assert "--default-tenant: a tenant id is 1 to 4096 bytes, this one is 5000" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("how", ["none", "cache_salt", "header:"])
def test_verify_isolation_says_how_tenants_must_be_told(how):
    """A --tenant-from that is no way to tell tenants: said as one, naming the option, never
    offering "none" (a word of serve's --tenant-from that verify cannot use)."""
    with pytest.raises(ValueError) as e:
        isolation.check_server("http://127.0.0.1:9", how, None)
    assert str(e.value).startswith(f"--tenant-from {how}: give the way the server tells tenants, header:NAME or "
                                   "bearer (a server whose tenants are only its requests' cache_salt")


def test_caches_are_tagged_with_their_requests_tenant():
    tenants = RequestTenants(True)
    a, b = [_Layer(), _Layer()], [_Layer()]
    tenants.begin("alice")
    assert tenants.take() == "alice" and tenants.last() == "alice" and tenants.take() is UNKNOWN
    tenants.tag(a, "alice")
    tenants.tag(b, None)
    assert tenants.of_cache(b) is None and tenants.of_cache(a) == "alice"
    assert tenants.of_cache(a) is UNKNOWN  # a tag is used once
    with tenants.single("carol"):
        assert tenants.take() == "carol" and tenants.of_cache([_Layer()]) == "carol"
    assert tenants.of_cache([_Layer()]) is UNKNOWN
    assert RequestTenants(False).of_cache([object()]) is None


class _Layer:
    """A cache layer as a tag sees it (mlx-lm's are plain objects too)."""


def test_what_probes_leave_behind_is_said_with_the_bucket_copies():
    from kvstore.serve.tenancy.isolation import left_behind

    [local] = left_behind({"aaaaaaaaaaaaaaaa": 1 << 20})
    assert "--drop-tenant aaaaaaaaaaaaaaaa" in local and "bucket" not in local
    [remote] = left_behind({"aaaaaaaaaaaaaaaa": 1 << 20}, bucket=True)
    assert "the bucket's copies stay until `kvstore gc --remote`" in remote
    assert left_behind({}) == []


def test_verify_isolation_reads_the_operators_endpoints_with_the_token_and_probes_without_it():
    from kvstore.serve.tenancy.isolation import _Operator

    class Session:
        def __init__(self):
            self.sent = []

        def get(self, url, **kw):
            self.sent.append(("GET", url, kw.get("headers", {})))

        def post(self, url, **kw):
            self.sent.append(("POST", url, kw.get("headers", {})))

    session = Session()
    http = _Operator(session, b"the-operator-token-0123")
    http.get("http://s/metrics", timeout=1)
    http.post("http://s/v1/chat/completions", headers={"Authorization": "Bearer tenant-a"})
    assert session.sent == [("GET", "http://s/metrics", {"Authorization": "Bearer the-operator-token-0123"}),
                            ("POST", "http://s/v1/chat/completions", {"Authorization": "Bearer tenant-a"})]


def test_new_cache_salts_share_their_tenants_quota_and_push_no_one_else_off_the_disk(warmed, tmp_path):
    """A header tenant's cache_salts are tenants that share its one `--tenant-max-bytes`: bob's 12
    prompts, each with a new salt, stay within one quota together, so on a full store alice keeps
    her prompt on the disk (with a quota per salt they took 12 quotas and pushed hers off)."""
    model, _, prompts = warmed
    store = tmp_path / "store"
    run_cli("warm", "--store", store, "--model", model, "--prompts", prompts)
    flags = ("--tenant-from", "header:X-Tenant", "--trust-client-salt", "--store-max-bytes", "3MiB",
             "--tenant-max-bytes", "1MiB", "--prompt-cache-size", "1")  # (mlx-lm's RAM cache: one sequence)
    with Server(model, store, tmp_path / "log", *flags) as server:
        first = usage(server, SECRET, "alice")
        shared = cached(first)
        whole = cached(usage(server, SECRET, "alice"))
        assert whole == first["prompt_tokens"] - 1 > shared
        for n in range(12):
            usage(server, f"Bob's question number {n}, never asked before. " * 12, "bob", cache_salt=f"salt-{n}")
        assert server.stop() == 0
    with kvstore.open(store) as opened:
        held = opened.stats()["tenants"]
        bob = opened.tenant("bob").tag
        salted = [t for t in held if t.get("owner") == bob]
        assert len(salted) >= 2 and sum(t["bytes"] for t in salted) <= 1 << 20
        assert not any(t["tenant"] == bob for t in held)  # (every request of bob's had a salt)
    said = run_cli("stats", "--store", store).stdout
    assert f"quota of owner {bob}" in said and f"tenant {bob}'s quota holds" in said, said
    with Server(model, store, tmp_path / "log2", *flags) as server:
        assert cached(usage(server, SECRET, "alice")) == whole  # from the disk: a new server's RAM is empty
