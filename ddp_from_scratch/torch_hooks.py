"""torch's DDP comm hooks as they run in this project's comparisons and training, where torch's
own cannot run as they are: each one calls torch's hook body, changing only what stops it.

    model.register_comm_hook(None, bf16_compress_hook_on_gloo)
    model.register_comm_hook(PowerSGDState(None, start_powerSGD_iter=10), batched_powerSGD_hook_fixed)
"""

from __future__ import annotations

import torch


def powersgd_hook(batched: bool = False):
    """torch's powerSGD_hook, or (batched) its batched_powerSGD_hook as it runs here."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    return batched_powerSGD_hook_fixed if batched else P.powerSGD_hook


def powersgd_state_dict(state) -> dict:
    """torch's PowerSGDState as ddp_from_scratch.powersgd.PowerSGD.state_dict lays its own out."""
    from .powersgd import rng_state

    return {"iter": state.iter, "rng": rng_state(state.rng), "error": dict(state.error_dict),
            "p": dict(state.p_memory_dict), "q": dict(state.q_memory_dict)}


def load_powersgd_state_dict(state, saved: dict) -> None:
    from .powersgd import set_rng_state

    state.iter = saved["iter"]
    set_rng_state(state.rng, saved["rng"])
    state.error_dict, state.p_memory_dict, state.q_memory_dict = (dict(saved["error"]), dict(saved["p"]),
                                                                  dict(saved["q"]))


def bf16_compress_hook_on_gloo(state, bucket):
    """torch's bf16_compress_hook, run on Gloo.

    torch refuses the public hook without NCCL ("BF16 all reduce communication hook required
    CUDA 11+ and NCCL 2.10+"), but it is only `_compress_hook(torch.bfloat16, ...)`, the same
    body as fp16_compress_hook; Gloo sums bf16 fine. So we call that body directly.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, state, bucket)


def batched_powerSGD_hook_fixed(state, bucket):
    """torch's batched_powerSGD_hook, with the one call torch 2.13 gets wrong fixed.

    The hook hands its Q and P, 2-D matrices, to `_orthogonalize`, which since torch batched it
    takes only 3-D batches and raises AssertionError: the hook fails at its first compressed step.
    Here `_orthogonalize` is given a 2-D matrix as a batch of one (the hook's meaning); every other
    operation is the hook's own. The fix stays in place in this process (it only changes the call
    that raised)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    if not getattr(P._orthogonalize, "takes_one_matrix", False):
        batches_only = P._orthogonalize

        def orthogonalize(matrices, epsilon=0):
            return batches_only(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)
        orthogonalize.takes_one_matrix, orthogonalize.original = True, batches_only
        P._orthogonalize = orthogonalize
    return P.batched_powerSGD_hook(state, bucket)
