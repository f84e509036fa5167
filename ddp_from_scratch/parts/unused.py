"""Which parameters a forward's output cannot reach: for find_unused_parameters=True.

Backward from an output reaches a parameter only through that parameter's AccumulateGrad node in
the autograd graph. Walking the graph from the output's grad_fn finds every reachable one; the
others will get no gradient in this backward, and the DDP wrapper marks them ready (as zeros) at
once, so their buckets are not left waiting.

    reached = reachable_parameters(model(x))          # ids of the leaf tensors backward will reach
"""

from __future__ import annotations

import torch


def tensors_in(value):
    """Every tensor in a (nested) forward output."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)


def reachable_parameters(output) -> set:
    """ids of the leaf tensors that backward from `output` would reach (its AccumulateGrad nodes)."""
    stack = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
    seen, leaves = set(), set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # set on AccumulateGrad nodes only
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return leaves
