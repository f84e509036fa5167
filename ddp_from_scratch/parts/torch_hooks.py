"""torch's DDP comm hooks as they run in this project's comparisons and training, where torch's
own cannot run as they are: each one calls torch's hook body, changing only what stops it.

    model.register_comm_hook(None, bf16_compress_hook_on_gloo)
    model.register_comm_hook(PowerSGDState(None, start_powerSGD_iter=10), batched_powerSGD_hook_fixed)
"""

from __future__ import annotations

import torch

# Why torch's powerSGD_hook (and batched_powerSGD_hook) cannot run on Gloo with two or more
# buckets, in a clause: the programs refuse the case with it (docs/powersgd.md has the whole story).
POWERSGD_ON_GLOO = ("torch's PowerSGD hook issues each bucket's all_reduce of P and Q from inside a Future callback, "
                    "which Gloo runs on its worker threads, and waits there: the ranks then issue the buckets' "
                    "all_reduces in different orders (Gloo aborts with SIGABRT) or every worker thread waits on one "
                    "no thread is left to run (a hang)")


def powersgd_hook(batched: bool = False):
    """torch's powerSGD_hook, or (batched) its batched_powerSGD_hook as it runs here."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    return batched_powerSGD_hook_fixed if batched else P.powerSGD_hook


class _KeptWhileInFlight(dict):
    """A PowerSGDState memory dict whose clear() leaves the entries of buckets still in flight."""

    def clear(self) -> None:
        pass


def powersgd_state(**options):
    """torch's PowerSGDState, with one fix where warm_start=False.

    Without warm start, each bucket's hook makes a fresh P and Q in the state's dicts, and the
    bucket's last callback clears the dicts of *every* bucket: a bucket whose all_reduces are
    still in flight then finds its own gone (KeyError in its callback: seen on shm with ResNet-50,
    whose large buckets run on the backend's worker thread while the next bucket's hook runs).
    With dicts whose clear() does nothing, every bucket keeps its own until its next step's hook
    replaces it: the arithmetic is the hook's own, without the race."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    state = P.PowerSGDState(process_group=None, **options)
    if not state.warm_start:
        state.p_memory_dict, state.q_memory_dict = _KeptWhileInFlight(), _KeptWhileInFlight()
    return state


def powersgd_state_dict(state) -> dict:
    """torch's PowerSGDState as ddp_from_scratch.steps.powersgd.PowerSGD.state_dict lays its own out."""
    from .rng import rng_state

    return {"iter": state.iter, "rng": rng_state(state.rng), "error": dict(state.error_dict),
            "p": dict(state.p_memory_dict), "q": dict(state.q_memory_dict)}


def load_powersgd_state_dict(state, saved: dict) -> None:
    from .rng import set_rng_state

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
    """torch's batched_powerSGD_hook, with the two things torch 2.13 gets wrong fixed.

    The hook hands its Q and P, 2-D matrices, to `_orthogonalize`, which since torch batched it
    takes only 3-D batches and raises AssertionError: the hook fails at its first compressed step.
    Here `_orthogonalize` is given a 2-D matrix as a batch of one (the hook's meaning); the fix
    stays in place in this process (it only changes the call that raised). And a bucket whose
    square side is less than the rank (fewer than rank^2 elements) makes a Q with more columns
    than rows, which `_orthogonalize` refuses (AssertionError): for that bucket the hook runs with
    rank = side, as the layerwise hook takes min(rows, cols, rank). The rank is read only while
    the hook makes P and Q, before it returns. Every other operation is the hook's own."""
    import math

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    if not getattr(P._orthogonalize, "takes_one_matrix", False):
        batches_only = P._orthogonalize

        def orthogonalize(matrices, epsilon=0):
            return batches_only(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)
        orthogonalize.takes_one_matrix, orthogonalize.original = True, batches_only
        P._orthogonalize = orthogonalize
    side = math.ceil(math.sqrt(bucket.buffer().numel()))
    rank = state.matrix_approximation_rank
    state.matrix_approximation_rank = min(rank, side)
    try:
        return P.batched_powerSGD_hook(state, bucket)
    finally:
        state.matrix_approximation_rank = rank
