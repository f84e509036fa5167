"""The rows of compare's options table: each a setting of the bucketed wrapper trained beside torch's
DDP with the same setting (find_unused_parameters, gradient_as_bucket_view, small buckets, fp16,
bf16, PowerSGD), with a note, the step from which it acts and the backend it runs on.

    rows = options("resnet50", batch_size=2)        # {label: Option}
    what_was_compared(rows["powersgd rank 1, from step 2"], steps=4)   # "steps 0-1 plain, steps 2-3 compressed"
"""

from __future__ import annotations

import functools
from typing import Dict, NamedTuple, Optional

from ..parts.torch_hooks import bf16_compress_hook_on_gloo, powersgd_hook, powersgd_state


class Option(NamedTuple):
    """One row of the options table: train_side_by_side's kwargs, a note under the table, the
    first step at which the option changes anything (a run that stops before it compared nothing
    of it), the names of the steps before and from then, what a row whose steps all come before
    says, and the backend the row runs on."""

    kwargs: dict
    note: str = ""
    acts_from_step: int = 0
    phases: tuple = ("before it acts", "with it")
    idle: str = "the option does not act in these steps"
    backend: str = "gloo"


def _powersgd(note: str, **options) -> Option:
    """One PowerSGD row: ours against torch's hook (a fresh state made in the rank), on shm.

    torch's powerSGD_hook cannot run on Gloo once a model has two buckets: it issues each bucket's
    all_reduce of P (and of Q) from inside a Future callback, which Gloo runs on its own worker
    threads, and waits for it there. The ranks then issue the buckets' all_reduces in whatever
    order those threads reach them (Gloo aborts on the size mismatch), or every worker thread
    waits on an all_reduce none is left to run (a hang). docs/powersgd.md shows both. On shm a
    collective completes in the thread that calls it, so the callbacks run in the hook's order."""
    from ..steps.powersgd import PowerSGD

    batched = options.pop("batched", False)
    state = functools.partial(powersgd_state, **options)  # made in the rank
    return Option({"ours_kwargs": {"compress": PowerSGD(**options, batched=batched)},
                   "torch_comm_hook": (state, powersgd_hook(batched))},
                  note, acts_from_step=options["start_powerSGD_iter"], phases=("plain", "compressed"),
                  idle="not compressed in these steps", backend="shm")


# ResNet-50 at 32x32 with 2 images per rank: BatchNorm over 2 values at the 1x1 last stage makes
# step 0's gradients reach 2.4e9 (conv1.weight), past fp16's largest value, 65504; with 4 images
# the largest is 912. So the fp16 row runs ResNet-50 with at least this many images per rank.
FP16_RESNET50_MIN_BATCH = 4


def options(model: str = "small", batch_size: int = 4) -> Dict[str, Option]:
    """The bucketed wrapper's settings compared with torch's, by label."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    fp16_batch = {}
    fp16_note = "ours with compress='fp16' against torch's DDP with fp16_compress_hook"
    if model == "resnet50" and batch_size < FP16_RESNET50_MIN_BATCH:
        fp16_batch = {"batch_size": FP16_RESNET50_MIN_BATCH}
        fp16_note += (f"; run with {FP16_RESNET50_MIN_BATCH} images per rank, since with {batch_size} ResNet-50's "
                      "step-0 gradients exceed fp16's range (65504) and both sides overflow, identically "
                      "(tests/ddp/test_compare.py)")
    return {
        "find_unused_parameters": Option(
            {"model": "branchy", "ddp_kwargs": {"find_unused_parameters": True}},
            "model Branchy: one head used on rank 0 only, one used by no rank; .grad None-ness compared too"),
        "gradient_as_bucket_view": Option({"ddp_kwargs": {"gradient_as_bucket_view": True}}),
        "gradient_as_bucket_view, set_to_none=False": Option(
            {"ddp_kwargs": {"gradient_as_bucket_view": True}, "set_to_none": False},
            "zero_grad(set_to_none=False): the gradients stay bucket views from step to step",
            acts_from_step=1),
        "bucket_cap_mb=0.0005": Option({"ddp_kwargs": {"bucket_cap_mb": 0.0005}},
                                       "several buckets even for the small model"),
        "compress fp16": Option(
            {"ours_kwargs": {"compress": "fp16"}, "torch_comm_hook": default_hooks.fp16_compress_hook, **fp16_batch},
            fp16_note),
        "compress bf16": Option(
            {"ours_kwargs": {"compress": "bf16"}, "torch_comm_hook": bf16_compress_hook_on_gloo},
            "ours with compress='bf16' against torch's DDP with bf16_compress_hook's body (the hook refuses Gloo by name)"),
        "powersgd rank 1, from step 2": _powersgd(
            "ours with compress=PowerSGD(...) against torch's powerSGD_hook: plain DDP for 2 steps, then rank 1 "
            "(Gram-Schmidt), error feedback and warm start; on shm, since torch's hook dies on Gloo with two or "
            "more buckets (docs/powersgd.md)",
            matrix_approximation_rank=1, start_powerSGD_iter=2),
        "powersgd rank 3, no memories": _powersgd(
            "rank 3 (QR), no error feedback, no warm start; torch's state with its clearing of every bucket's P and Q "
            "made safe for buckets still in flight (torch_hooks.powersgd_state)",
            matrix_approximation_rank=3, start_powerSGD_iter=2, use_error_feedback=False, warm_start=False),
        "batched powersgd rank 2": _powersgd(
            "the bucket as one square matrix, against torch's batched_powerSGD_hook with its orthogonalization of "
            "a 2-D matrix fixed (torch 2.13's raises AssertionError) and a bucket of fewer than rank^2 elements "
            "run with rank = side (batched_powerSGD_hook_fixed)",
            matrix_approximation_rank=2, start_powerSGD_iter=2, batched=True),
    }


def what_was_compared(option: Option, steps: int) -> Optional[str]:
    """The steps a row compared, in the option's terms ("steps 0-1 plain, 2-3 compressed"); None
    when the run stops before the option acts, so that the row compared nothing of it."""
    first = option.acts_from_step
    if steps <= first:
        return None
    span = lambda a, b: f"step {a}" if a == b else f"steps {a}-{b}"  # noqa: E731
    if first == 0:
        return span(0, steps - 1)
    return f"{span(0, first - 1)} {option.phases[0]}, {span(first, steps - 1)} {option.phases[1]}"
