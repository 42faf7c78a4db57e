"""What `verify --exact` found: one row per stored prompt, a table, and a one-line verdict.

What counts as the same depends on how the store was written (`Bounds`):

- **exact mode** (`exact_prefill`): bit for bit. The restored K/V, the K/V computed after the
  restore point, the next-step log-probabilities and 32 greedy tokens must equal a cold run's
  that splits the prompt as the store does;
- **token-exact reuse** (exact mode off): the records were computed in whatever steps the run that
  stored them took, so bits may differ by kernel noise: within `kv` (relative to the tensor's
  largest value) and `logprobs`, the same best token and the same greedy tokens;
- **K/V quantized on disk** (`disk_kv_bits`): within the bounds docs/kv8.md documents; greedy
  tokens may part (reported, not a mismatch).

A different best token is tie-sensitive, not a mismatch, when the cold run's lead was under
`kvstore.canary.TIE_MARGIN` (under the logit bound, for K/V quantized on disk), and so is a greedy
run that parts after such a step. Canaries must reproduce within `canary`. No mlx here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvstore.canary import TIE_MARGIN

GREEDY = 32  # greedy tokens compared per prompt


@dataclass(frozen=True)
class Bounds:
    """What counts as the same (see the module docstring)."""

    label: str
    exact: bool
    kv: float = 0.0  # max |difference| of K/V over the tensor's largest |value|
    logprobs: float = 0.0  # max |difference| of next-token log-probabilities
    canary: float = 0.05
    greedy: bool = True  # greedy tokens must agree
    tie: float = TIE_MARGIN  # a lead under this may flip: a different token is tie-sensitive
    kv_after: bool = True  # the K/V computed after the restore point are judged too (not when
    # they were computed from lossy K/V: then the logits' bound judges what that did)


@dataclass
class PromptCheck:
    """One stored prompt compared with a cold run of it."""

    leaf: str
    tokens: int
    restored: int = 0
    kv_restored: float = 0.0  # max |difference| of the K/V read from the store (positions before it)
    kv_restored_rel: float = 0.0
    kv_after: float = 0.0  # ... of the K/V computed after the restore point, and the state at the end
    kv_after_rel: float = 0.0
    kv_bitwise: bool = True
    logprobs: float = 0.0
    top1: bool = True
    margin: float = 0.0  # the cold run's lead of its best token
    greedy: int = GREEDY  # leading greedy tokens that agree
    greedy_tie: bool = False  # they part after a tie-sensitive step
    canaries: int = 0
    canaries_ok: int = 0
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)  # why it is a mismatch (empty: it is not)
    tie: bool = False  # a difference that a tie explains

    @property
    def ok(self) -> bool:
        return not self.problems


def judge(c: PromptCheck, b: Bounds) -> PromptCheck:
    """Fill `problems` and `tie` of a check by the bounds."""
    if c.notes and c.tokens == 0:
        c.problems.append(c.notes[0])
    if b.exact and not c.kv_bitwise:
        c.problems.append(f"K/V differ by up to {max(c.kv_restored, c.kv_after):.3g}, not bit for bit")
    elif not b.exact and max(c.kv_restored_rel, c.kv_after_rel if b.kv_after else 0.0) > b.kv:
        c.problems.append(f"K/V differ by {max(c.kv_restored_rel, c.kv_after_rel if b.kv_after else 0.0):.3g} "
                          f"of their largest value (bound {b.kv:g})")
    if c.logprobs > b.logprobs:
        c.problems.append(f"next-token log-probabilities differ by up to {c.logprobs:.3g}"
                          + ("" if b.exact else f" (bound {b.logprobs:g})"))
    tie_top = not c.top1 and c.margin < b.tie
    if not c.top1 and not tie_top:
        c.problems.append(f"another best next token (the cold run's led by {c.margin:.3g})")
    if c.greedy < GREEDY and b.greedy and not c.greedy_tie and c.top1:
        c.problems.append(f"greedy tokens part at token {c.greedy + 1} of {GREEDY}")
    if c.canaries_ok < c.canaries:
        c.problems.append(f"{c.canaries - c.canaries_ok} of {c.canaries} canaries do not reproduce")
    c.tie = tie_top or (c.greedy < GREEDY and c.greedy_tie)
    return c


def table(checks: list[PromptCheck]) -> str:
    """The checks as a fixed-width table."""
    head = ("prompt", "tokens", "restored", "K/V max |Δ|", "logprob |Δ|", "best", "lead", "greedy", "canaries", "")
    rows = [head]
    for c in checks:
        kv = "bit for bit" if c.kv_bitwise else f"{max(c.kv_restored, c.kv_after):.2g}"
        flag = "ok" if c.ok and not c.tie else "tie" if c.ok else "MISMATCH"
        rows.append((c.leaf[:12], str(c.tokens), str(c.restored), kv, f"{c.logprobs:.2g}",
                     "same" if c.top1 else "other", f"{c.margin:.3f}" + ("*" if c.margin < TIE_MARGIN else ""),
                     f"{c.greedy}/{GREEDY}", f"{c.canaries_ok}/{c.canaries}", flag))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def verdict(checks: list[PromptCheck], b: Bounds, leaves: int) -> str:
    """One line: what was checked and whether every prompt is what a cold run computes."""
    n = len(checks)
    if not n:
        return (f"nothing to check: the store holds no prompt of this model ({b.label}; a tenant's prompts "
                "are checked when the tenant is given)")
    bad = [c for c in checks if not c.ok]
    ties = sum(c.tie for c in checks)
    per = sum(c.seconds for c in checks) / n
    what = f"{n} of {leaves} stored prompts checked ({b.label}; {per:.2f} s a prompt)"
    tied = f"; {ties} tie-sensitive (a lead under {b.tie:g})" if ties else ""
    if bad:
        return (f"MISMATCH: {len(bad)} of the {n} stored prompts checked (of {leaves}; {b.label}) differ "
                f"from a cold run: {bad[0].problems[0]}{tied}")
    same = "bit for bit" if b.exact else "within the bounds"
    cold = sum(c.restored == 0 for c in checks)
    untested = f"; {cold} restored nothing, so compared nothing" if cold else ""
    return (f"exact: {what}: each restores {same} what a cold run computes (K/V, next-token logits, "
            f"{GREEDY} greedy tokens), {sum(c.canaries for c in checks)} canaries reproduced{tied}{untested}")


def as_dict(checks: list[PromptCheck], b: Bounds, leaves: int) -> dict:
    """The report as JSON-ready data (`verify --exact --json`)."""
    return {"ok": all(c.ok for c in checks), "bounds": asdict(b), "stored_prompts": leaves,
            "verdict": verdict(checks, b, leaves), "prompts": [{**asdict(c), "ok": c.ok} for c in checks]}
