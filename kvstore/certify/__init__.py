"""`verify --exact`: the certificate that a store restores what a cold run computes.

For sampled stored prompts of one model (`prompts`), recompute each cold with the same steps and
compare (`compare`): the K/V (bit for bit, and the largest difference per tensor), the next-step
logits (largest difference, the same best token, its lead), 32 greedy tokens, and every canary
of the prompt's records. `report` judges them and prints a table and a one-line verdict.

`Store.verify_exact` and `kvstore verify --exact` run it on a store opened read-only: nothing is
written (no access times, no admission rows), and mlx is imported only then.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.certify.report import Bounds, PromptCheck, as_dict, checked_nothing, table, verdict
from kvstore.errors import InvalidInputError


@dataclass
class Report:
    """What `verify_exact` found: `ok` when something was checked and every prompt checked is,
    whole, what a cold run computes (a difference that a tie explains is not one); `checked_nothing`
    when no prompt was put to the test (none stored, or none restores anything)."""

    checks: list[PromptCheck]
    bounds: Bounds
    stored_prompts: int  # leaves of the model's records, of which `checks` are a sample
    cause: str = ""  # what likely explains a mismatch (the records were computed with another BLAS or mlx)
    tenant: bool = False  # a tenant's prompts were checked (not the shared ones)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def checked_nothing(self) -> bool:
        return checked_nothing(self.checks)

    def table(self) -> str:
        return table(self.checks, self.bounds.tie)

    def verdict(self) -> str:
        return verdict(self.checks, self.bounds, self.stored_prompts, self.cause, self.tenant)

    def as_dict(self) -> dict:
        return as_dict(self.checks, self.bounds, self.stored_prompts, self.cause, self.tenant)


def verify_exact(mc, index, blob_root, *, disk_kv_bits: int | None = None, sample: int | None = 8,
                 seed: int = 0, anchors=None) -> Report:
    """Check `sample` stored prompts (all when None) of model cache `mc` (bound on a read-only
    store: see the module docstring) against cold runs: the shared prompts, or those of the
    tenant `mc` is bound for. `anchors`: the disk tier's trust anchors, to refuse what it refuses."""
    from kvstore.certify import prompts
    from kvstore.certify.compare import bounds_for, check_prompt

    if sample is not None and (type(sample) is not int or sample < 1):
        raise InvalidInputError(f"sample={sample!r}: give how many stored prompts to check (1 or more), "
                                "or None for all")
    bounds = bounds_for(mc, disk_kv_bits)
    tag = mc.tenant.tag if getattr(mc, "tenant", None) is not None else None
    leaves = prompts.leaves(index, mc.ns, tag, blob_root) if index is not None else []
    chosen = prompts.sample(leaves, sample, seed)
    checks = [check_prompt(mc, prompts.read_prompt(index, blob_root, leaf, mc.chunk_size, anchors), bounds)
              for leaf in chosen]
    cause = ""
    if mc.exact and index is not None and any(c.problems for c in checks):
        from kvstore.model.blas import mismatch_cause

        cause = mismatch_cause(index, mc.ns)
    return Report(checks, bounds, len(leaves), cause, tag is not None)
