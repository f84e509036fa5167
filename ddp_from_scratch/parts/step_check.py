"""How two trainings are compared, step by step: the same bits, the largest difference, the summary.

Both parity programs use these: compare.py (ours against torch's DDP) and compare/sharded.py (the
sharded stages against torch's fully_shard and DDP).

    same_bits(a, b)              # bitwise equal, identical NaNs included
    check = StepCheck(params=True, buffers=True, loss=True, largest_diff=0.0, nonfinite_ours=0, nonfinite_theirs=0)
    summarise([[check, ...] for each rank])   # {"bitwise", "largest_diff", "first_step_differing", "nonfinite"}
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import torch

# An integer dtype of each width: "the same bits" is torch.equal on these views
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Bitwise equal: the same dtype, shape and bit pattern, so identical NaNs (and the sign of
    zero) count as equal, and a NaN against a number does not. torch.equal would call two
    identical NaN tensors different. Both None counts as equal."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_complex:
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.dtype.is_floating_point:
        width = _BITS[a.element_size()]
        a, b = a.contiguous().view(width), b.contiguous().view(width)
    return torch.equal(a, b)


def relative_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest |ours - theirs| over the tensor, relative to the tensor's largest |value| (0 when
    the bits are the same; NaN when either side is not finite and they differ)."""
    if same_bits(ours, theirs):
        return 0.0
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()


def count_nonfinite(params) -> int:
    """How many parameter tensors hold an inf or a NaN."""
    return sum(not bool(torch.isfinite(p).all()) for p in params)


class StepCheck(NamedTuple):
    """One training step on one rank: ours against torch's DDP."""

    params: bool  # every parameter and its .grad: the same bits (or both .grad None)
    buffers: bool  # every buffer (BatchNorm running statistics)
    loss: bool
    largest_diff: float  # the largest relative difference of a parameter or its gradient (see relative_diff)
    nonfinite_ours: int  # parameter tensors holding inf or NaN after the step
    nonfinite_theirs: int

    @property
    def bitwise(self) -> bool:
        return self.params and self.buffers and self.loss


def summarise(per_rank: List[List[StepCheck]]) -> Dict:
    """Over every rank and step: bitwise or not, the largest difference, the first step that
    differs, and when values stopped being finite (first step, tensors on each side)."""
    steps = len(per_rank[0])
    first_off = next((s for s in range(steps) if not all(rank[s].bitwise for rank in per_rank)), None)
    first_nonfinite = next((s for s in range(steps) if any(rank[s].nonfinite_ours or rank[s].nonfinite_theirs
                                                            for rank in per_rank)), None)
    nonfinite = None
    if first_nonfinite is not None:
        last = [rank[-1] for rank in per_rank]
        nonfinite = {"first_step": first_nonfinite, "ours": max(c.nonfinite_ours for c in last),
                     "theirs": max(c.nonfinite_theirs for c in last)}
    diffs = [c.largest_diff for rank in per_rank for c in rank]
    return {"bitwise": first_off is None, "largest_diff": max(diffs, key=lambda d: (d != d, d)),
            "first_step_differing": first_off, "nonfinite": nonfinite}


def describe_nonfinite(res: Dict) -> str:
    """"" for finite runs, else e.g. "both sides overflow (inf/NaN) from step 0: 129 / 129 tensors"."""
    nf = res.get("nonfinite")
    if not nf:
        return ""
    who = "both sides" if nf["ours"] and nf["theirs"] else ("ours only" if nf["ours"] else "torch's only")
    return f"{who} overflow (inf/NaN) from step {nf['first_step']}: {nf['ours']} / {nf['theirs']} tensors at the end"


def table_row(label, n, steps, res):
    return [label, n, steps, "yes" if res["bitwise"] else "no", f"{res['largest_diff']:.3g}",
            "-" if res["first_step_differing"] is None else res["first_step_differing"],
            describe_nonfinite(res) or "finite"]
