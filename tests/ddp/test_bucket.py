"""Our bucket layouts are torch's: checked against torch's own assignment function over random
sizes, caps and ready orders, and against the buckets a live torch DDP hands its comm hook.

Why it matters: with more than two ranks, a ring all_reduce rounds an element differently
depending on where it sits in the buffer, so only the same layout gives the same bits.

    pytest tests/ddp/test_bucket.py -q
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from ddp_from_scratch.parts import bucket as bucketing
from ddp_from_scratch.workload.models import SmallNet, batch
from ddp_from_scratch.steps.ddp import DistributedDataParallel
from collectives.testing import run_on_ranks

sizes = st.lists(st.integers(1, 5000), min_size=1, max_size=30)  # elements per parameter
limits = st.tuples(st.integers(1, 40000), st.integers(1, 40000))  # (first bucket, cap) in bytes


def _torch_assignment(tensors, limits, order=None):
    """torch's C++ compute_bucket_assignment_by_size, as DDP calls it."""
    if order is None:
        return dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))[0]
    return dist._compute_bucket_assignment_by_size([tensors[i] for i in order], limits, [False] * len(tensors),
                                                   list(order))[0]


@settings(max_examples=200, deadline=None)
@given(sizes=sizes, limits=limits, data=st.data())
def test_rebuilt_layout_is_torchs(sizes, limits, data):
    params = [torch.empty(n) for n in sizes]
    order = data.draw(st.permutations(range(len(params))))
    first, cap = limits
    assert bucketing.rebuilt_layout(params, order, cap, first) == _torch_assignment(params, [first, cap], order)


@settings(max_examples=200, deadline=None)
@given(sizes=sizes, limits=limits, find_unused=st.booleans())
def test_initial_layout_is_torchs(sizes, limits, find_unused):
    params = [torch.empty(n) for n in sizes]
    first, cap = limits
    # torch/nn/parallel/distributed.py (BucketCapacityConfig) picks these limits, then reverses the buckets
    expected_limits = [sys.maxsize] if not find_unused else [first, cap] if first < cap else [cap]
    expected = _torch_assignment(params, expected_limits)[::-1]
    assert bucketing.initial_layout(params, cap, first, find_unused) == expected


@settings(max_examples=100, deadline=None)
@given(kinds=st.lists(st.sampled_from([torch.float32, torch.float64, torch.float16]), min_size=1, max_size=20),
       limits=limits, data=st.data())
def test_mixed_dtypes_never_share_a_bucket(kinds, limits, data):
    params = [torch.empty(data.draw(st.integers(1, 3000)), dtype=k) for k in kinds]
    first, cap = limits
    ours = bucketing.initial_layout(params, cap, first, True)
    assert ours == _torch_assignment(params, [first, cap] if first < cap else [cap])[::-1]
    order = data.draw(st.permutations(range(len(params))))
    rebuilt = bucketing.rebuilt_layout(params, order, cap, first)
    # torch appends the still-open buckets in its hash map's order; ours in order of first
    # appearance, so with several dtypes only the set of buckets is comparable
    assert sorted(rebuilt) == sorted(_torch_assignment(params, [first, cap], order))
    assert all(len({params[i].dtype for i in b}) == 1 for b in rebuilt)


def _live_layouts(env, cap_mb, find_unused):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    theirs = nn.parallel.DistributedDataParallel(SmallNet(), bucket_cap_mb=cap_mb, find_unused_parameters=find_unused)
    ours = DistributedDataParallel(SmallNet(), bucket_cap_mb=cap_mb, find_unused_parameters=find_unused)
    index_of = {p.data_ptr(): i for i, p in enumerate(theirs.module.parameters())}
    seen = []

    def recording_hook(state, bucket):  # torch requires the argument to be named `bucket`
        seen[-1][bucket.index()] = [index_of[p.data_ptr()] for p in bucket.parameters()]
        return default_hooks.allreduce_hook(None, bucket)

    theirs.register_comm_hook(None, recording_hook)
    layouts = []
    for step in range(3):
        x, y = batch(step, env.rank, 4, 12)
        seen.append({})
        F.cross_entropy(theirs(x), y).backward()
        F.cross_entropy(ours(x), y).backward()
        layouts.append(([seen[-1][k] for k in sorted(seen[-1])], [b.param_indices for b in ours.buckets]))
    return layouts


def test_layouts_match_a_live_torch_ddp():
    """Iterations 0, 1, 2: the buckets torch's reducer hands its comm hook are ours, in order."""
    for find_unused in (False, True):
        for step, (theirs, ours) in enumerate(run_on_ranks(_live_layouts, 2, args=(0.0005, find_unused))[0]):
            assert ours == theirs, f"find_unused_parameters={find_unused}, step {step}"
            assert len(theirs) > (1 if step or find_unused else 0)
