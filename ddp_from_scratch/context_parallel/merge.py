"""The online softmax: two attention results over disjoint sets of keys merged into the result over
both, from their outputs and log-sum-exps alone. Ring attention's only arithmetic of its own.

    out, lse = merge(out, lse, block_out, block_lse)

For one query, attention over keys K is out_K = sum_j softmax_j(s) v_j, with s_j = q.k_j / sqrt(d),
and lse_K = log sum_j exp(s_j). Over two disjoint sets A and B:

    lse = log(exp(lse_A) + exp(lse_B))
    out = (exp(lse_A) out_A + exp(lse_B) out_B) / exp(lse)

since each set's softmax is its share of the whole one, weighted by exp(lse_set - lse). Written
with the sigmoid (s(x) = 1 / (1 + exp(-x))), which never forms exp of a large number:

    out = out_A - s(lse_B - lse_A) (out_A - out_B)
    lse = lse_A - log s(lse_A - lse_B)

This is the form torch's ring attention merges with (its _SDPAMerger, after ring-flash-attention),
in float32; the same operations in the same order give the same bits, which the proof relies on.
lse has a trailing dimension of 1 here, to broadcast over the head size.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) over both sets of keys. out: (..., seq, head_dim); lse: (..., seq, 1)."""
    out = out - F.sigmoid(block_lse - lse) * (out - block_out)
    lse = lse - F.logsigmoid(lse - block_lse)
    return out, lse
