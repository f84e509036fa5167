"""A stage's backward in two parts, as zero-bubble schedules run it: the input's gradient now (I),
because the stage before waits for it, and the weights' gradient later (W), where the rank would
otherwise idle.

    dx, weights = input_gradient(y, grad, x, stage.parameters())   # I: what to send back
    ...                                                              # other actions
    weights()                                                        # W: adds to each p.grad

autograd computes only what the asked-for inputs need: asking for x's gradient alone runs the
nodes on the path from the output down to x and nothing on the weights' side. Where that path
meets a weight's side (a Linear's addmm node: its input goes down the path, its weight off it),
the gradient arriving at the node is kept (a pre-hook on the node). The W part asks autograd for
the weights' gradients from those kept gradients, at those same nodes: each node's weight-side
arithmetic runs once, in the W part, with the same kernels a whole backward runs, so the
gradients are the same bits. torch.distributed.pipelining's stage_backward_input and
stage_backward_weight split a backward the same way.

A stage whose input needs no gradient (the first) has nothing to send: its I does nothing and
its W runs the whole backward. A weight reached from two places on the input's path (used twice)
is refused: its two parts would have to be added in autograd's order to keep the bits.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge


def _node(t: torch.Tensor):
    """t's grad_fn, or a leaf's gradient accumulator (the node its gradient ends in)."""
    return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]


def _children(node) -> List:
    return [n for n, _ in node.next_functions if n is not None]


def _walk(root) -> List:
    """Every node below root, each after all its children (post-order), without recursion."""
    order, seen, stack = [], {root}, [(root, iter(_children(root)))]
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            order.append(node)
            stack.pop()
        elif child not in seen:
            seen.add(child)
            stack.append((child, iter(_children(child))))
    return order


def weight_groups(root, x_node, weight_nodes: Set) -> List[Tuple[object, List]]:
    """The nodes where the input's path meets a weight's side, each with the accumulators of the
    weights below it on that side: [(node, [accumulator, ...])]."""
    on_path: Dict[object, bool] = {}
    below: Dict[object, frozenset] = {}  # off the path: the weights' accumulators under a node
    for node in _walk(root):
        kids = _children(node)
        on_path[node] = node is x_node or any(on_path[k] for k in kids)
        if not on_path[node]:
            below[node] = frozenset([node] if node in weight_nodes else []).union(*(below[k] for k in kids))
    if not on_path[root]:
        raise ValueError("the stage's output does not depend on its input: there is no input gradient to send")
    groups, owner = [], {}
    for node, path in on_path.items():
        if not path:
            continue
        weights = sorted(frozenset().union(*(below[k] for k in _children(node) if not on_path[k])), key=id)
        for w in weights:
            if w in owner:
                raise ValueError(f"the weight {tuple(w.variable.shape)} is reached from two places on the input's "
                                 "path (used twice): its gradient cannot be split into I and W bit for bit")
            owner[w] = node
        if weights:
            groups.append((node, weights))
    return groups


def input_gradient(y: torch.Tensor, grad: Optional[torch.Tensor], x: torch.Tensor,
                   parameters: Iterable[torch.Tensor]) -> Tuple[Optional[torch.Tensor], Callable[[], None]]:
    """The I part: x's gradient (None where x needs none), and the W part to call later."""
    if not x.requires_grad:  # the first stage: nothing to send, the whole backward is the W part
        return None, lambda: torch.autograd.backward(y, grad)
    weights = {_node(p) for p in parameters if p.requires_grad}
    groups = weight_groups(y.grad_fn, _node(x), weights)
    kept: Dict[object, tuple] = {}

    def keeper(node):
        def hook(grad_outputs):
            kept[node] = grad_outputs
        return hook

    handles = [node.register_prehook(keeper(node)) for node, _ in groups]
    try:
        (dx,) = torch.autograd.grad(y, x, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()

    def weights_part() -> None:
        for node, accumulators in groups:
            grads = kept.pop(node)
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            if not edges:
                continue
            dws = torch.autograd.grad([e for e, _ in edges], [GradientEdge(a, 0) for a in accumulators],
                                      [g for _, g in edges], allow_unused=True)
            for acc, dw in zip(accumulators, dws):
                if dw is None:
                    continue
                p = acc.variable
                if p.grad is None:
                    p.grad = dw
                else:
                    p.grad += dw

    return dx, weights_part
