"""The compare program's tensor-parallel table (python -m ddp_from_scratch.compare --impl tp): each
split block against torch's parallelize_module, bit for bit, and the split transformer trained
beside the one-rank model, within float32 rounding (tensor_parallel/parity.py runs them).

    python -m ddp_from_scratch.compare --impl tp --world-sizes 2 4 --steps 4

Rows on p ranks: the MLP block, attention and the sequence-parallel LayerNorm + MLP against torch
(one step, every output and gradient), and on 4 ranks the MLP block as TP x DP on 2 x 2
against torch's on a 2-D DeviceMesh; the transformer with TP over p, with sequence parallelism,
and (p = 4) TP x DP on 2 x 2, each trained --steps SGD steps beside the one-rank model (their
losses and the logits of a probe batch after the last step). A block needs p to divide its 4
heads and 8 positions; a world size that does not is a row that says so.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..tensor_parallel import parity

TP_IMPL = "tp"
TOLERANCE = 1e-4  # relative: float32 partial sums added in another order, compounded over a few SGD steps
TP_HEADERS = ["tensor parallelism", "against", "ranks", "steps", "bitwise equal", "largest relative diff",
              "must be bitwise"]
ATTENTION_NOTE = ("attention's input gradient is the one value that cannot be bitwise: torch's three ColwiseParallel "
                  "layers (q, k, v) each all-reduce their share of it and add the sums; ours adds the shares and "
                  "all-reduces once (a third of the messages), the same numbers in another order.")


def _fits(p: int) -> bool:
    return parity.HEADS % p == 0 and parity.S % p == 0


def tp_checks(env, steps: int) -> list:
    """This rank's rows: (label, against, steps, bitwise or None, largest relative diff, must be bitwise)."""
    p, world = env.world_size, dist.group.WORLD
    if not _fits(p):
        return []
    rows = []
    for label, against, run, inexact in (
            ("MLP block", "torch ColwiseParallel + RowwiseParallel", parity.mlp_against_torch, ()),
            ("attention (heads split)", "torch ColwiseParallel (q, k, v) + RowwiseParallel (out)",
             parity.attention_against_torch, ("dx",)),
            ("LayerNorm + MLP, sequence parallel", "torch SequenceParallel + Colwise/Rowwise on Shard(1)",
             parity.sequence_parallel_against_torch, ())):
        exact, diff = parity.agrees(run(world), inexact)
        rows.append((label + (" (all but dx)" if inexact else ""), against, 1, exact, diff, True))
    if p == 4:
        exact, diff = parity.agrees(parity.tp_by_dp_against_torch())
        rows.append(("MLP block, TP x DP 2 x 2", "torch's on a 2-D DeviceMesh + DDP's arithmetic", 1, exact, diff, True))
    layouts = [(f"transformer, TP over {p}", p, False), (f"transformer, TP + SP over {p}", p, True)]
    if p == 4:
        layouts.append(("transformer, TP x DP 2 x 2", 2, False))
    for label, tp, sp in layouts:
        run = parity.transformer_against_one_rank(env.rank, tp, steps=steps, sequence_parallel=sp)
        losses = {k: torch.tensor(v) for k, v in run["losses"].items()}
        diff = max(parity.relative_difference(losses["ours"], losses["one rank"]),
                   parity.relative_difference(run["logits"]["ours"], run["logits"]["one rank"]))
        rows.append((label, "the one-rank model (losses, final logits)", steps, None, diff, False))
    return rows


def table_rows(per_rank: list, p: int, steps: int) -> tuple:
    """(rows, ok): the rows of every rank merged (bitwise only if on every rank, the largest
    difference of any), and whether every must-be-bitwise row is bitwise on every rank and every
    other row within TOLERANCE (judged on the numbers, not their printed form)."""
    if not _fits(p):
        return [["every row", "-", p, steps, "not run", "-", f"{p} does not divide the blocks' 4 heads and 8 positions"]], True
    rows, ok = [], True
    for i, (label, against, n_steps, exact, _, must) in enumerate(per_rank[0]):
        diff = max(rank_rows[i][4] for rank_rows in per_rank)
        everywhere = exact is not None and all(r[i][3] for r in per_rank)
        ok = ok and (everywhere if must else diff <= TOLERANCE)
        bitwise = "-" if exact is None else ("yes" if everywhere else "no")
        rows.append([label, against, p, n_steps, bitwise, f"{diff:.2e}", "yes" if must else f"no (within {TOLERANCE:g})"])
    return rows, ok
