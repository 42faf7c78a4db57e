"""`kvstore verify --isolation`: whether tenants can tell each other's prompts, measured.

Two made-up tenants, A and B (fresh ids each run). A stores `probes` prompts of its own, each the
shared prompt followed by text of its own. Then it is checked that A's second request for one of
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


@dataclass
class Report:
    """What `verify --isolation` found: its checks (name -> (passed or None if not run, detail))
    and its figures (name -> value)."""

    checks: dict[str, tuple[bool | None, str]] = field(default_factory=dict)
    figures: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(passed is not False for passed, _ in self.checks.values())

    def lines(self) -> list[str]:
        out = [f"{'ok  ' if p else 'FAIL' if p is False else 'skip'} {name}: {detail}"
               for name, (p, detail) in self.checks.items()]
        return out + [f"     {name}: {value}" for name, value in self.figures.items()]


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


def judge(report: Report, other: list[tuple[float, int]], fresh: list[tuple[float, int]], unit: str) -> None:
    """The usage and timing figures of B's probes: (seconds, cached tokens) of A's prompts
    (`other`) and of prompts nobody sent (`fresh`)."""
    n = len(other) - len(other) // 2 + len(fresh) - len(fresh) // 2  # scored probes
    for what, i, fmt in (("time to first token", 0, lambda v: f"{v * 1000:.1f} ms"), (unit, 1, str)):
        xa, xb = [p[i] for p in other], [p[i] for p in fresh]
        if any(v is None for v in xa + xb):
            report.checks[f"{what} tells nothing"] = (None, "not reported by the server")
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
                 text_tokens: int = 600, timeout: float = 120.0) -> Report:
    """Run the checks against the server at `url`, telling tenants as `tenant_from` says
    ("header:NAME" or "bearer"); `shared`: the chat messages the operator warmed (None: that
    check is skipped)."""
    import requests

    from kvstore.serve.tenancy.policy import parse_source

    source = parse_source(tenant_from)
    if source == "none":
        raise ValueError("--tenant-from: give the way the server tells tenants (header:NAME or bearer)")
    run = secrets.token_hex(4)
    tenants = {who: f"kvstore-verify-{who}-{run}" for who in "AB"}

    def ask(who: str, text: str) -> tuple[float, int | None, int]:
        headers = {"Authorization": f"Bearer {tenants[who]}"} if source == "bearer" else {source: tenants[who]}
        body = {"messages": (shared or []) + [{"role": "user", "content": text}], "max_tokens": 1,
                "temperature": 0.0}
        t0 = time.perf_counter()
        r = requests.post(url.rstrip("/") + "/v1/chat/completions", headers=headers, json=body, timeout=timeout)
        took = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {r.text[:200]}")
        usage = r.json().get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return took, cached, int(usage.get("prompt_tokens", 0))

    return _protocol(ask, lambda: _words(text_tokens), probes, shared is not None, "cached_tokens")


def _words(n: int) -> str:
    """Random text of about `n` characters (a prompt nobody else sends)."""
    return " ".join(secrets.token_hex(4) for _ in range(max(1, n // 9)))


# -- the checks ---------------------------------------------------------------------------------

Ask = Callable[[str, str], tuple[float, "int | None", int]]


def _protocol(ask: Ask, fresh_text: Callable[[], object], probes: int, has_shared: bool, unit: str) -> Report:
    """The checks, through `ask(tenant, private part) -> (seconds, reused, prompt tokens)`."""
    report = Report()
    texts = [fresh_text() for _ in range(probes)]
    first = [ask("A", t)[:2] for t in texts]  # A stores its prompts
    _, again, n = ask("A", texts[0])
    other, fresh = [], []
    for t in texts:  # B probes each of A's prompts once, and as many new ones, interleaved
        other.append(ask("B", t)[:2])
        fresh.append(ask("B", fresh_text())[:2])
    if again is None:
        report.checks["the same tenant hits"] = (None, f"{unit} not reported by the server")
    else:
        report.checks["the same tenant hits"] = (again >= n - 1, f"A's second request for its prompt of {n} "
                                                                 f"tokens reused {again}")
        shared_b = {c for _, c in fresh}
        worst = max(c for _, c in other)
        # (B's own earlier probes may share a few tokens with any new prompt: random text rarely more)
        report.checks["another tenant misses"] = (worst <= max(shared_b) + SLACK, f"B's requests for A's prompts "
                                                  f"reused at most {worst} tokens; for prompts nobody sent, "
                                                  f"{min(shared_b)} to {max(shared_b)}")
        if has_shared:
            least = min(c for _, c in first + fresh)
            report.checks["the shared prompt hits for both"] = (least > 0, f"A and B reused at least {least} tokens "
                                                                "of the shared prompt")
    if not has_shared:
        report.checks.setdefault("the shared prompt hits for both",
                                 (None, "no shared prompt given (--prompts: a line the operator warmed)"))
    judge(report, other, fresh, unit)
    report.figures["probes"] = f"{probes} of A's prompts and {probes} new ones, by B"
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

    return _protocol(ask, lambda: make(private), probes, True, "reused tokens")


def figures_json(report: Report) -> str:
    return json.dumps({"ok": report.ok, "checks": {k: {"passed": p, "detail": d} for k, (p, d) in report.checks.items()},
                       "figures": report.figures}, indent=2, default=str)
