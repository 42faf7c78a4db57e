"""`kvstore verify --isolation`: whether tenants can tell each other's prompts, measured.

Two made-up tenants, A and B (fresh ids each run). A stores `probes` prompts of its own, each the
shared prompt followed by text of its own. Then it is checked that A's second request for the last of
them reuses all of it (the same tenant hits); that B's request for A's prompt reuses only the
shared prompt, as B's request for a prompt nobody sent does (another tenant misses); that the
shared prompt is reused by both; and that neither the usage field nor the time to the first token
tells B whether A sent a prompt: B probes each of A's prompts once, and as many fresh ones,
interleaved; a threshold fitted on half of each is scored on the other half (`threshold_split`),
and its accuracy is compared with a coin's (`chance_p`: the chance of doing as well by guessing).

Against a running server (`check_server`: its tenants told as it tells them, `--tenant-from`) the
shared prompt is the first line of a prompt file the operator warmed; against a store
(`check_store`) the same runs through the library on a temporary store made with that store's
chunk size and tenant key (the store itself is not written).

The shared prompt hits when each tenant's first request (before it stored anything of its own)
reuses all of its whole chunks. A server that tells clients no `cached_tokens`
(`--report-cached-tokens off`) is measured through its `/metrics` (the reuse counters before and
after each probe, kept only when the probe was the server's one request meanwhile). A check
that cannot run is never a pass: the verdict names it (`Report.verdict`).
"""

from __future__ import annotations

import json
import math
import secrets
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

#: A probe this much (or less) likely to be as accurate by chance says the two can be told apart.
ALPHA = 0.01
#: Tokens a request may reuse of the same tenant's earlier, unrelated prompts (random text shares
#: a few leading tokens with them by chance).
SLACK = 8


#: The check the operator may leave out (no `--prompts`): its skip is no failure.
SHARED_CHECK = "the shared prompt hits for both"


@dataclass
class Report:
    """What `verify --isolation` found: its checks (name -> (passed or None if not run, detail)),
    its figures (name -> value) and notes (what the run left behind)."""

    checks: dict[str, tuple[bool | None, str]] = field(default_factory=dict)
    figures: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    not_asked: set[str] = field(default_factory=set)  # checks skipped because the operator left them out

    @property
    def not_run(self) -> list[str]:
        return [name for name, (p, _) in self.checks.items() if p is None and name not in self.not_asked]

    @property
    def ok(self) -> bool:
        """Every check that was asked for ran and passed."""
        return not self.not_run and all(p is not False for p, _ in self.checks.values())

    def verdict(self) -> str:
        failed = [name for name, (p, _) in self.checks.items() if p is False]
        if failed:
            return "tenants are NOT kept apart (failed: " + "; ".join(failed) + ")"
        if self.not_run:
            return ("tenants are NOT shown to be kept apart: no check failed, but these could not run: "
                    + "; ".join(self.not_run))
        left = f" (not checked: {'; '.join(sorted(self.not_asked))})" if self.not_asked else ""
        return f"tenants are kept apart: {len(self.checks) - len(self.not_asked)} checks ran and passed{left}"

    def lines(self) -> list[str]:
        out = [f"{'ok  ' if p else 'FAIL' if p is False else 'skip'} {name}: {detail}"
               for name, (p, detail) in self.checks.items()]
        return out + [f"     {name}: {value}" for name, value in self.figures.items()] + self.notes


def scored(probes: int) -> int:
    """How many probes a run of `probes` per kind scores the threshold on (the second halves)."""
    return 2 * (probes - probes // 2)


def min_probes() -> int:
    """The fewest probes per kind with which the timing check can fail: below it, even a threshold
    that classifies every scored probe right is as likely by chance as `ALPHA` or more."""
    n = 4
    while chance_p(1.0, scored(n)) >= ALPHA:
        n += 1
    return n


def threshold_split(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(threshold, accuracy): the threshold that best tells `a` from `b` on the first half of
    each (either side), scored on the second halves (the fraction of them it classifies right)."""
    ha, hb = len(a) // 2, len(b) // 2
    train_a, train_b, test_a, test_b = list(a[:ha]), list(b[:hb]), list(a[ha:]), list(b[hb:])
    cuts = sorted(set(train_a + train_b))
    best = (-1.0, 0.0, True)
    for lo, hi in zip([cuts[0] - 1] + cuts, cuts + [cuts[-1] + 1]):
        t = (lo + hi) / 2
        for below_is_a in (True, False):
            right = sum((x < t) == below_is_a for x in train_a) + sum((x < t) != below_is_a for x in train_b)
            if right > best[0]:
                best = (right, t, below_is_a)
    _, t, below_is_a = best
    right = sum((x < t) == below_is_a for x in test_a) + sum((x < t) != below_is_a for x in test_b)
    return t, right / max(1, len(test_a) + len(test_b))


def chance_p(accuracy: float, n: int) -> float:
    """The chance that guessing classifies at least this share of `n` probes right."""
    k = math.ceil(accuracy * n - 1e-9)
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


def judge(report: Report, other: list[tuple[float, int]], fresh: list[tuple[float, int]], unit: str | None) -> None:
    """The usage and timing figures of B's probes: (seconds, reused tokens) of A's prompts
    (`other`) and of prompts nobody sent (`fresh`); `unit`: the usage field B is told its reuse
    by (None: its answers tell none)."""
    n = len(other) - len(other) // 2 + len(fresh) - len(fresh) // 2  # scored probes
    if unit is None:
        report.checks["cached_tokens tells nothing"] = (True, "the server's answers carry no cached_tokens")
    for what, i, fmt in (("time to first token", 0, lambda v: f"{v * 1000:.1f} ms"), (unit, 1, str)):
        if what is None:
            continue
        xa, xb = [p[i] for p in other], [p[i] for p in fresh]
        if any(v is None for v in xa + xb):
            report.checks[f"{what} tells nothing"] = (None, "not in every answer of the server")
            continue
        _, acc = threshold_split(xa, xb)
        p = chance_p(acc, n)
        report.figures[f"{what}, another tenant's prompts"] = f"median {fmt(statistics.median(xa))}"
        report.figures[f"{what}, prompts nobody sent"] = f"median {fmt(statistics.median(xb))}"
        report.checks[f"{what} tells nothing"] = (
            p >= ALPHA, f"a threshold fitted on {len(xa) // 2}+{len(xb) // 2} probes classifies {acc:.0%} of "
                        f"{n} others right (guessing does as well {p:.1%} of the time)")


# -- against a running server --------------------------------------------------------------------

def check_server(url: str, tenant_from: str, shared: list[dict] | None, probes: int = 20, *,
                 text_tokens: int = 600, timeout: float = 120.0, admin_token: bytes | None = None) -> Report:
    """Run the checks against the server at `url`, telling tenants as `tenant_from` says
    ("header:NAME" or "bearer"); `shared`: the chat messages the operator warmed (None: that
    check is skipped); `admin_token`: the server's `--admin-token-file` token, for its /metrics
    and /kvstore/stats (ValueError if they ask for one and it is not given or not theirs)."""
    import requests

    from kvstore.serve.tenancy.policy import parse_source

    try:
        source = parse_source(tenant_from)
    except ValueError:  # (its message offers "none", which is no way to tell tenants here)
        source = "none"
    if source == "none":
        raise ValueError(f"--tenant-from {tenant_from}: give the way the server tells tenants, header:NAME or "
                         "bearer (a server whose tenants are only its requests' cache_salt, --trust-client-salt "
                         "alone, cannot be checked this way)")
    base, http = url.rstrip("/"), _Operator(requests.Session(), admin_token)
    if http.get(base + "/kvstore/stats", timeout=timeout).status_code == 401:
        raise ValueError(f"{base} keeps /metrics and /kvstore/stats for its operator (401): give its token "
                         "with --admin-token-file" + (" (the one given is not it)" if admin_token else ""))
    run = secrets.token_hex(4)
    tenants = {who: f"kvstore-verify-{who}-{run}" for who in "AB"}
    told = {"cached_tokens": False}
    counted: list[tuple[int, int] | None] = [None]  # /metrics' counters after the last probe that read them

    def headers(who: str) -> dict:
        return {"Authorization": f"Bearer {tenants[who]}"} if source == "bearer" else {source: tenants[who]}

    def ask(who: str, text: str) -> tuple[float, int | None, int]:
        body = {"messages": (shared or []) + [{"role": "user", "content": text}], "max_tokens": 1,
                "temperature": 0.0}
        # /metrics is read only while the server has not reported cached_tokens, once a probe (the
        # reading after one probe is the one before the next)
        before = None if told["cached_tokens"] else counted[0] or _reuse_counters(http, base)
        t0 = time.perf_counter()
        r = http.post(base + "/v1/chat/completions", headers=headers(who), json=body, timeout=timeout)
        took = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {r.text[:200]}")
        usage = r.json().get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        told["cached_tokens"] |= cached is not None
        counted[0] = None
        if cached is None:  # its /metrics, if this probe was its one request meanwhile
            after = counted[0] = _reuse_counters(http, base)
            if before is not None and after is not None and after[0] - before[0] == 1:
                cached = after[1] - before[1]
        return took, cached, int(usage.get("prompt_tokens", 0))

    need = _shared_need(http, base, shared, headers("A"), timeout) if shared is not None else None
    stored_before = _tenant_bytes(http, base)
    report = _protocol(ask, lambda: _words(text_tokens), probes, need, lambda: "cached_tokens" if told["cached_tokens"]
                       else None, "reuse (from the server's /metrics)")
    stored_after = _settled_tenant_bytes(http, base)
    _say_quota(report, http, base)
    if stored_before is not None and stored_after is not None:
        report.notes.extend(left_behind({t: b for t, b in stored_after.items() if t not in stored_before},
                                        bucket=_has_remote(http, base)))
    return report


def _say_quota(report: Report, http, base: str) -> None:
    """A failed same-tenant hit on a server that bounds each tenant says by how much: a prompt
    larger than the quota is evicted by its own tenant's later writes (no leak, but no pass)."""
    passed, detail = report.checks.get("the same tenant hits", (None, ""))
    if passed is not False:
        return
    try:
        quota = http.get(base + "/kvstore/stats", timeout=30).json().get("tenant_max_bytes")
    except Exception:
        return
    if quota:
        from kvstore.sizes import format_size

        report.checks["the same tenant hits"] = (False, f"{detail} (the server bounds each tenant to "
                                                 f"{format_size(quota)}, --tenant-max-bytes: a prompt whose "
                                                 "records take more is evicted by its tenant's own writes)")


class _Operator:
    """A requests session whose GETs (the server's /metrics and /kvstore/stats) carry the
    operator's token, if there is one; its POSTs (the probes) carry only their own headers."""

    def __init__(self, session, token: bytes | None):
        self.session, self.token = session, token

    def get(self, url: str, **kw):
        if self.token is not None:
            kw["headers"] = {**kw.get("headers", {}), "Authorization": f"Bearer {self.token.decode()}"}
        return self.session.get(url, **kw)

    def post(self, url: str, **kw):
        return self.session.post(url, **kw)


def _settled_tenant_bytes(http, base: str, wait: float = 10.0) -> dict[str, int] | None:
    """`_tenant_bytes` once the server's writes of the last probes landed: two readings a
    second apart that agree (at most `wait` seconds)."""
    last, end = _tenant_bytes(http, base), time.monotonic() + wait
    while last is not None and time.monotonic() < end:
        time.sleep(1.0)
        now = _tenant_bytes(http, base)
        if now == last:
            break
        last = now
    return last


def _has_remote(http, base: str) -> bool:
    """Whether the server has a remote tier (its /kvstore/stats says so; the URL is not shown)."""
    try:
        return bool(http.get(base + "/kvstore/stats", timeout=30).json().get("remote"))
    except Exception:
        return False


def left_behind(tags: dict[str, int], bucket: bool = False) -> list[str]:
    """What a run's probe tenants left in the server's store (their tags -> bytes), and how it
    goes; `bucket`: the server has a remote tier, which uploaded them too."""
    if not tags:
        return []
    from kvstore.sizes import format_size

    each = ", ".join(f"{tag} ({format_size(size)})" for tag, size in sorted(tags.items()))
    return [f"left in the store: the two probe tenants' records, {format_size(sum(tags.values()))} under "
            f"the tenant tags {each}; `kvstore gc --store STORE "
            + " ".join(f"--drop-tenant {tag}" for tag in sorted(tags)) + "` deletes them"
            + ("; its remote tier uploaded them too: the bucket's copies stay until `kvstore gc --remote` "
               "bounds the bucket (by size or age)" if bucket else "")]


def _reuse_counters(http, base: str) -> tuple[int, int] | None:
    """(requests, tokens reused) of the server's /metrics (None if it cannot be read)."""
    try:
        r = http.get(base + "/metrics", timeout=10)
    except Exception:
        return None
    if r.status_code != 200:
        return None
    requests_seen, reused = None, 0
    for line in r.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == "kvstore_requests_total":
            requests_seen = int(float(value))
        elif name.startswith("kvstore_reused_tokens_total{"):
            reused += int(float(value))
    return None if requests_seen is None else (requests_seen, reused)


def _tenant_bytes(http, base: str) -> dict[str, int] | None:
    """Tenant tag -> bytes on disk, from the server's /kvstore/stats (None if it cannot be read)."""
    try:
        r = http.get(base + "/kvstore/stats", timeout=30)
        return {t["tenant"]: int(t["bytes"]) for t in r.json().get("tenants") or []} if r.status_code == 200 else None
    except Exception:
        return None


def _shared_need(http, base: str, shared: list[dict], headers: dict, timeout: float) -> int:
    """How many tokens of a request the shared prompt's stored records must give it: every whole
    chunk of the part its warmed line (rendered as `kvstore warm` renders it) has in common with
    a request that begins with it; all of that part when it is shorter than a chunk."""
    def render(messages: list[dict]) -> list[int]:
        r = http.post(base + "/v1/chat/completions/render", headers=headers, json={"messages": messages},
                      timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"the server's render endpoint answered {r.status_code}: {r.text[:200]}")
        return list(r.json()["token_ids"])

    warmed, asked = render(shared), render(shared + [{"role": "user", "content": _words(40)}])
    common = next((i for i, (a, b) in enumerate(zip(warmed, asked)) if a != b), min(len(warmed), len(asked)))
    r = http.get(base + "/kvstore/stats", timeout=30)
    chunk = int(r.json().get("chunk_size") or 256) if r.status_code == 200 else 256
    return common // chunk * chunk or common


def _words(n: int) -> str:
    """Random text of about `n` characters (a prompt nobody else sends)."""
    return " ".join(secrets.token_hex(4) for _ in range(max(1, n // 9)))


# -- the checks ---------------------------------------------------------------------------------

Ask = Callable[[str, str], tuple[float, "int | None", int]]


def _protocol(ask: Ask, fresh_text: Callable[[], object], probes: int, need: int | None,
              told: Callable[[], str | None], unit: str) -> Report:
    """The checks, through `ask(tenant, private part) -> (seconds, reused, prompt tokens)`;
    `need`: tokens the shared prompt must give each tenant's first request (None: not checked);
    `told()`: the usage field that tells a client its reuse (None: none); `unit`: the reuse's name."""
    report = Report()
    texts = [fresh_text() for _ in range(probes)]
    first = [ask("A", t)[:2] for t in texts]  # A stores its prompts
    # (its last: a server's --tenant-max-bytes evicts A's least recently used first, and a prompt
    # evicted by A's own quota is no leak)
    _, again, n = ask("A", texts[-1])
    other, fresh = [], []
    for t in texts:  # B probes each of A's prompts once, and as many new ones, interleaved
        other.append(ask("B", t)[:2])
        fresh.append(ask("B", fresh_text())[:2])
    missing = f"{unit}: not known for every probe (other requests to the server meanwhile, or no /metrics)"
    if again is None:
        report.checks["the same tenant hits"] = (None, missing)
    else:
        report.checks["the same tenant hits"] = (again >= n - 1, f"A's second request for its prompt of {n} "
                                                                 f"tokens reused {again}")
    if any(c is None for _, c in other + fresh):
        report.checks["another tenant misses"] = (None, missing)
    else:
        shared_b = {c for _, c in fresh}
        worst = max(c for _, c in other)
        # (B's own earlier probes may share a few tokens with any new prompt: random text rarely more)
        report.checks["another tenant misses"] = (worst <= max(shared_b) + SLACK, f"B's requests for A's prompts "
                                                  f"reused at most {worst} tokens; for prompts nobody sent, "
                                                  f"{min(shared_b)} to {max(shared_b)}")
    if need is None:
        report.checks[SHARED_CHECK] = (None, "no shared prompt given (--prompts: a line the operator warmed)")
        report.not_asked.add(SHARED_CHECK)
    elif first[0][1] is None or other[0][1] is None:
        report.checks[SHARED_CHECK] = (None, missing)
    else:
        least = min(first[0][1], other[0][1])
        report.checks[SHARED_CHECK] = (least >= need, f"the first requests of A and B reused {first[0][1]} and "
                                       f"{other[0][1]} tokens; the shared prompt's whole chunks (all of it, if shorter) "
                                       f"are {need}")
    judge(report, other, fresh, told())
    report.figures["probes"] = f"{probes} of A's prompts and {probes} new ones, by B"
    if told() is None:
        report.figures["reuse measured by"] = unit
    return report


# -- against a store ------------------------------------------------------------------------------

def check_store(store, model, model_id: str, shared: Sequence[int] | None, probes: int = 20, *,
                private_tokens: int | None = None, make_tokens: Callable[[int], list[int]] | None = None) -> Report:
    """The checks through the library: `store` (a temporary one, see `cmd`), `model` loaded from
    `model_id`; `shared`: the token ids of the shared prompt (warmed here first), else made up."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(secrets.randbits(32))
    C = store.chunk_size
    make = make_tokens or (lambda n: rng.integers(10, 200, n).tolist())
    shared = list(shared) if shared is not None else make(C + C // 3)
    store.bind(model, model_id).prefill(shared, pin=True)
    run = secrets.token_hex(4)
    mcs = {who: store.bind(model, model_id, tenant=f"kvstore-verify-{who}-{run}") for who in "AB"}
    private = private_tokens or 2 * C

    def ask(who: str, tail: list[int]) -> tuple[float, int, int]:
        toks = shared + tail
        mc = mcs[who]
        t0 = time.perf_counter()
        cache, rest = mc.fetch(toks)
        logits = mc.model(mx.array(rest)[None], cache=cache)
        mx.eval(logits)
        took = time.perf_counter() - t0
        mc.insert(toks, cache)
        store.flush()
        return took, len(toks) - len(rest), len(toks)

    need = len(shared) // C * C or len(shared)
    return _protocol(ask, lambda: make(private), probes, need, lambda: "reused tokens", "reused tokens")


def figures_json(report: Report) -> str:
    return json.dumps({"ok": report.ok, "verdict": report.verdict(),
                       "checks": {k: {"passed": p, "detail": d} for k, (p, d) in report.checks.items()},
                       "figures": report.figures, "notes": report.notes}, indent=2, default=str)
