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
from kvstore.sizes import plural

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
    partial: str = ""  # why only a part of the prompt could be checked (a record that does not read)
    restore_points: int = 0  # positions compared with the cold run: record ends the store restores at
    # layer.tensor -> its largest |difference| "restored" (read from the store) and "after" (computed
    # after the restore point), relative ones, whether it was bit for bit, and the restore point it was worst at
    tensors: dict[str, dict] = field(default_factory=dict)
    # the stored records whose restored K/V differ from what the cold run computed for their tokens
    # (beyond the bound): each one's hash, kind (record or checkpoint), tokens [start, end), the
    # tensor that differs most there, by how much (max, relative), at which restore point, and
    # every tensor of it that differs
    differing_records: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The same as a cold run, and checked whole."""
        return not self.problems and self.complete

    @property
    def complete(self) -> bool:
        """Every token of the prompt was read, and something of it was restored and compared."""
        return not self.partial and self.restored > 0

    def note_tensor(self, name: str, part: str, worst: float, rel: float, bitwise: bool, at: int) -> None:
        t = self.tensors.setdefault(name, {"restored": 0.0, "after": 0.0, "relative": 0.0, "after_relative": 0.0,
                                           "bitwise": True, "worst_at": None})
        t["bitwise"] = t["bitwise"] and bitwise
        t[part] = max(t[part], worst)
        if part == "after":
            t["after_relative"] = max(t["after_relative"], rel)
        if rel > t["relative"]:
            t["relative"], t["worst_at"] = rel, at

    def note_record(self, h: str, kind: str, start: int, end: int, tensor: str, worst: float, rel: float,
                    at: int) -> None:
        """Record `h` (hex) restores `tensor` over its tokens [start, end) `worst` away from the cold run."""
        r = next((r for r in self.differing_records if r["record"] == h), None)
        if r is None:
            r = {"record": h, "kind": kind, "tokens": [start, end], "tensor": tensor, "max": worst,
                 "relative": rel, "at": at, "tensors": []}
            self.differing_records.append(r)
        elif not rel <= r["relative"]:
            r.update(tensor=tensor, max=worst, relative=rel, at=at)
        if tensor not in r["tensors"]:
            r["tensors"].append(tensor)

    def worst_record(self) -> dict | None:
        """The stored record whose restored K/V differ most from the cold run's, if any does."""
        return max(self.differing_records, key=lambda r: r["relative"], default=None)

    def worst_tensor(self) -> str:
        """The tensor that differs most (relative to its largest value), with its restore point:
        the worst of the stored records' when one differs (the cause), else of all."""
        r = self.worst_record()
        if r is not None:
            return f"{r['tensor']}@{r['at']}"
        name, t = max(self.tensors.items(), key=lambda kv: (kv[1]["relative"], not kv[1]["bitwise"]),
                      default=(None, None))
        if name is None or t["bitwise"]:
            return ""
        return f"{name}@{t['worst_at']}" if t["worst_at"] is not None else name

    def worst_after(self) -> str:
        """The tensor computed after the restore point that differs most, with the restore point."""
        name, t = max(self.tensors.items(), key=lambda kv: kv[1]["after_relative"], default=(None, None))
        return f"{name}@{self.restored}" if name is not None and t["after"] else ""


def judge(c: PromptCheck, b: Bounds) -> PromptCheck:
    """Fill `problems` and `tie` of a check by the bounds."""
    c.problems += _kv_problems(c, b)
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


def _kv_problems(c: PromptCheck, b: Bounds) -> list[str]:
    """Why the K/V are a mismatch, cause first: the stored records whose restored K/V are not what
    the cold run computed for their tokens, then what differs after the restore point (their
    effect); or, when no record differs, that the difference is in what was computed after it."""
    after = c.kv_after_rel if b.kv_after else 0.0
    if b.exact and c.kv_bitwise or not b.exact and max(c.kv_restored_rel, after) <= b.kv:
        return []
    same = "not bit for bit" if b.exact else f"beyond the bound ({b.kv:g} of a tensor's largest value)"
    records = sorted(c.differing_records, key=lambda r: (r["tokens"], r["kind"]))
    after_said = (f"the K/V computed after the restore point differ by up to {c.kv_after:.3g} (most in "
                  f"{c.worst_after()})") if (not c.kv_bitwise if b.exact else after > b.kv) and c.worst_after() else ""
    if records:
        named = "; ".join(_record_said(r) for r in records[:3]) + (
            f"; and {len(records) - 3} more (--json lists them)" if len(records) > 3 else "")
        differ = ("are not bit for bit" if b.exact
                  else f"differ by more than the bound ({b.kv:g} of a tensor's largest value) from")
        said = [f"the K/V restored from {plural(len(records), 'stored record')} {differ} what a cold run "
                f"computes for the same tokens: {named}"]
        return said + ([f"and from them on, {after_said}"] if after_said else [])
    if after_said and c.kv_restored_rel <= b.kv and (not b.exact or c.kv_restored == 0):
        restored = "bit for bit" if b.exact else "within the bound of"
        return [f"{after_said}, {same}: the K/V restored from the store are {restored} what a cold run computes, "
                "so no stored record differs (none to evict): this machine computes the tokens after the "
                "restore point otherwise than the cold run does"]
    worst = f" (most in {c.worst_tensor()}: layer.tensor@restore point)" if c.worst_tensor() else ""
    if b.exact:
        return [f"K/V differ by up to {max(c.kv_restored, c.kv_after):.3g}, not bit for bit{worst}"]
    return [f"K/V differ by {max(c.kv_restored_rel, after):.3g} of their largest value (bound {b.kv:g}){worst}"]


def _record_said(r: dict) -> str:
    what = (f"checkpoint {r['record'][:12]} (the state at token {r['at']}" if r["kind"] == "checkpoint"
            else f"record {r['record'][:12]} (tokens {r['tokens'][0]}-{r['tokens'][1]}")
    return f"{what}: most in {r['tensor']}, by up to {r['max']:.3g}, in the restore of tokens 0-{r['at']})"


def table(checks: list[PromptCheck], tie: float = TIE_MARGIN) -> str:
    """The checks as a fixed-width table (`points`: restore points compared; the K/V column names
    the tensor that differs most, as layer.tensor@restore point; `*`: a lead under `tie`, the
    bounds' tie margin; `-`: nothing of the prompt was restored, so nothing was compared)."""
    head = ("prompt", "tokens", "restored", "points", "K/V max |Δ|", "logprob |Δ|", "best", "lead", "greedy",
            "canaries", "verdict")
    rows = [head]
    for c in checks:
        kv = "bit for bit" if c.kv_bitwise else f"{max(c.kv_restored, c.kv_after):.2g} {c.worst_tensor()}".rstrip()
        if c.worst_record() is not None:  # the cause: the record restored at that point
            r = c.worst_record()
            kv = f"{r['max']:.2g} {c.worst_tensor()} in {r['record'][:12]}"
        compared = (kv, f"{c.logprobs:.2g}", "same" if c.top1 else "other",
                    f"{c.margin:.3f}" + ("*" if c.margin < tie else ""), f"{c.greedy}/{GREEDY}")
        if not c.restored:  # nothing of it was restored: there is no restore to call the same as a cold run
            compared = ("-",) * len(compared)
        rows.append((c.leaf[:12], str(c.tokens), str(c.restored), str(c.restore_points), *compared,
                     f"{c.canaries_ok}/{c.canaries}", _flag(c)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    if any(c.margin < tie and c.restored for c in checks):
        lines.append(f"lead*: the cold run's best token led the next by under {tie:g} (a log-probability): "
                     "a different best token there is tie-sensitive, not a mismatch")
    if any(c.greedy_tie and c.greedy < GREEDY for c in checks):
        lines.append(f"greedy tokens that part after a step whose best token led by under {tie:g} are "
                     "tie-sensitive too (verdict: tie)")
    return "\n".join(lines)


def _flag(c: PromptCheck) -> str:
    if c.problems:
        return "MISMATCH"
    if c.partial:
        return "PARTIAL"
    if not c.restored:
        return "UNCHECKED"
    return "tie" if c.tie else "ok"


def checked_nothing(checks: list[PromptCheck]) -> bool:
    """No prompt was put to the test: none sampled, or none restores anything (cold against cold)."""
    return not any(c.restored for c in checks)


def verdict(checks: list[PromptCheck], b: Bounds, leaves: int, cause: str = "", tenant: bool = False) -> str:
    """One line: what was checked and whether every prompt is what a cold run computes. `cause`:
    what likely explains a mismatch (another BLAS or mlx than the records were computed with);
    `tenant`: the prompts were a tenant's (never named: its id may be a bearer token)."""
    n = len(checks)
    if not n and tenant:
        return f"NOTHING CHECKED: the store holds no prompt of this model for this tenant ({b.label})"
    if not n:
        return (f"NOTHING CHECKED: the store holds no shared prompt of this model ({b.label}; a tenant's "
                "prompts are checked when the tenant is given)")
    if checked_nothing(checks):
        return (f"NOTHING CHECKED: none of the {n} stored prompts sampled (of {leaves}; {b.label}) restores "
                f"anything from the store, so nothing was compared: {_first_reason(checks)}")
    bad = [c for c in checks if c.problems]
    part = [c for c in checks if not c.problems and not c.complete]
    ties = sum(c.tie for c in checks)
    points = sum(c.restore_points for c in checks)
    tied = f"; {ties} tie-sensitive (a lead under {b.tie:g})" if ties else ""
    incomplete = (f"; {len(part)} of them could not be checked whole ({_first_reason(part)})" if part else "")
    if bad:
        return (f"MISMATCH: {len(bad)} of the {n} stored prompts checked (of {leaves}; {b.label}; "
                f"{plural(points, 'restore point')}) differ from a cold run: {bad[0].problems[0]}"
                f"{cause and '; ' + cause}{tied}{incomplete}")
    if part:
        whole = (f"the other {n - len(part)} restore what a cold run computes at "
                 f"{plural(sum(c.restore_points for c in checks if c.complete), 'restore point')}"
                 if n > len(part) else "none was checked whole")
        return (f"INCOMPLETE: {len(part)} of the {n} stored prompts sampled (of {leaves}; {b.label}) could be "
                f"checked only in part, or not at all: {_first_reason(part)}; {whole}{tied}")
    per = sum(c.seconds for c in checks) / n
    same = "bit for bit" if b.exact else "within the bounds"
    return (f"exact: {n} of {leaves} stored prompts checked ({b.label}; {per:.2f} s a prompt), at "
            f"{plural(points, 'restore point')} ({points / n:.1f} a prompt: its end, and each record end where a "
            f"sliding window or checkpoint is restored): each restores {same} what a cold run computes (K/V, "
            f"next-token logits"
            f"{f', {GREEDY} greedy tokens' if b.greedy else f'; {GREEDY} greedy tokens reported, not judged'}), "
            f"{plural(sum(c.canaries for c in checks), 'canary', 'canaries')} reproduced{tied}")


def _first_reason(checks: list[PromptCheck]) -> str:
    """Why the first of these prompts was not checked whole."""
    c = checks[0]
    if c.partial:
        return f"{c.leaf[:12]} was read only to token {c.tokens}: {c.partial}"
    return f"{c.leaf[:12]} restores nothing (a record the restore cannot use)"


def as_dict(checks: list[PromptCheck], b: Bounds, leaves: int, cause: str = "", tenant: bool = False) -> dict:
    """The report as JSON-ready data (`verify --exact --json`)."""
    return {"ok": bool(checks) and all(c.ok for c in checks), "checked_nothing": checked_nothing(checks),
            "bounds": asdict(b), "stored_prompts": leaves, "likely_cause": cause or None,
            "verdict": verdict(checks, b, leaves, cause, tenant),
            "prompts": [{**asdict(c), "ok": c.ok, "complete": c.complete, "worst_tensor": c.worst_tensor() or None,
                         "worst_after": c.worst_after() or None,
                         "no_record_differs": bool(c.problems) and not c.differing_records} for c in checks]}
