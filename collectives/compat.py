"""torch.distributed names that moved: torch 2.13 renames the tensor-in/tensor-out collectives
(all_gather_into_tensor -> all_gather_single, reduce_scatter_tensor -> reduce_scatter_single)
and warns on the old names; older torch has only the old ones. Same signatures.

    from collectives.compat import all_gather_single, reduce_scatter_single
"""

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
