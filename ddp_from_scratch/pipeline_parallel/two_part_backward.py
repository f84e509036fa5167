"""A stage's backward in two parts, as zero-bubble schedules run it: the input's gradient now (I),
because the stage before waits for it, and the weights' gradient later (W), where the rank would
otherwise idle.

    dx, weights = input_gradient(y, grad, x, stage.parameters())   # I: what to send back
    ...                                                              # other actions
    weights()                                                        # W: adds to each p.grad

    split = SplitBackward()             # a stage's, for every microbatch: keeps each weight's node
    dx, weights = split.input_gradient(y, grad, x, stage.parameters())

autograd computes only what the asked-for inputs need: asking for x's gradient alone runs the
nodes on the path from the output down to x and nothing on the weights' side. Where that path
meets a weight's side (a Linear's addmm node: its input goes down the path, its weight off it),
the gradient arriving at the node is kept: the I asks the engine for it beside x's, naming the
node's edge (a GradientEdge) among the call's inputs, which costs less than a pre-hook registered
on each node and removed every microbatch. The W part asks autograd for the weights' gradients
from those kept gradients, at those same nodes, a call a node: each node's weight-side arithmetic
runs once, in the W part, with the same kernels a whole backward runs, so the gradients are the
same bits. torch.distributed.pipelining's stage_backward_input and stage_backward_weight split a
backward the same way (with pre-hooks).

A split backward makes one call of autograd's engine a weight group where a whole backward makes
one, and on small layers each call's own cost is not small beside its arithmetic. So the calls go
to the engine directly, without the argument checks of torch.autograd.grad and backward (their
arguments come from autograd itself here); the walk of the graph stops at the input and at the
weights; and a SplitBackward keeps each weight's gradient accumulator from one microbatch to the
next (benchmarks/pipeline_parallel.py prints the I + W against a whole backward).

A stage whose input needs no gradient (the first) has nothing to send: its I does nothing and
its W runs the whole backward. A weight reached from two places on the input's path (used twice)
is refused: its two parts would have to be added in autograd's order to keep the bits.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge
from torch.autograd.variable import Variable


def _node(t: torch.Tensor):
    """t's grad_fn, or a leaf's gradient accumulator (the node its gradient ends in)."""
    return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]


def _run_engine(outputs: tuple, grads: tuple, inputs: tuple, *, keep_graph: bool, accumulate: bool) -> tuple:
    """The call into autograd's engine that torch.autograd.grad (accumulate=False: returns the
    inputs' gradients) and torch.autograd.backward (accumulate=True: adds them to .grad) end in."""
    return Variable._execution_engine.run_backward(outputs, grads, keep_graph, False, inputs,
                                                   allow_unreachable=True, accumulate_grad=accumulate)


def _walk(root, stops: Set, outputs: Dict[object, Set[int]]) -> Tuple[List, Dict[object, List]]:
    """Every node below root, each after all its children (post-order), without recursion and
    without going below a node in stops; and each node's children, read once. Adds to outputs,
    for each node reached, the outputs of its forward that a node above it takes (an edge is a
    node and an output's number): the only ones a gradient can arrive at."""

    def children_of(node) -> List:
        if node in stops:
            return []
        found = []
        for child, output in node.next_functions:
            if child is not None:
                found.append(child)
                outputs.setdefault(child, set()).add(output)
        return found

    children = {root: children_of(root)}
    order, stack = [], [(root, iter(children[root]))]
    while stack:
        node, pending = stack[-1]
        child = next(pending, None)
        if child is None:
            order.append(node)
            stack.pop()
        elif child not in children:
            children[child] = children_of(child)
            stack.append((child, iter(children[child])))
    return order, children


def _weights_below(node, children: Dict[object, List], weight_nodes: Set, found: List) -> None:
    """Adds to found the weights' accumulators in node's subgraph (off the input's path: small)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n in weight_nodes:
            if n not in found:
                found.append(n)
        else:
            stack.extend(children[n])


def weight_groups(root, x: torch.Tensor, weight_nodes: Set,
                  root_output: int = 0) -> List[Tuple[object, List, List[int]]]:
    """The nodes where the path from root down to x meets a weight's side, each with the
    accumulators of the weights below it on that side and the outputs of its forward that a
    gradient can arrive at (root_output: the stage output's own, for root):
    [(node, [accumulator, ...], [output, ...])]."""
    outputs: Dict[object, Set[int]] = {root: {root_output}}
    x_fn = x.grad_fn  # where x's gradient arrives; a leaf's accumulator is found in the walk instead
    order, children = _walk(root, weight_nodes if x_fn is None else weight_nodes | {x_fn}, outputs)
    on_path = set()
    for node in order:  # children first: a node is on the path if one of its children is
        below = children[node]
        if below:
            if not on_path.isdisjoint(below):
                on_path.add(node)
        elif node is x_fn or (x_fn is None and node not in weight_nodes and getattr(node, "variable", None) is x):
            on_path.add(node)
    if root not in on_path:
        raise ValueError("the stage's output does not depend on its input: there is no input gradient to send")
    groups, owner = [], {}
    for node in order:
        if node not in on_path:
            continue
        weights: List = []
        for k in children[node]:
            if k not in on_path:
                _weights_below(k, children, weight_nodes, weights)
        for w in weights:
            if w in owner:
                raise ValueError(f"the weight {tuple(w.variable.shape)} is reached from two places on the input's "
                                 "path (used twice): its gradient cannot be split into I and W bit for bit")
            owner[w] = node
        if weights:
            groups.append((node, weights, sorted(outputs[node])))
    return groups


class SplitBackward:
    """A stage's split backward, microbatch after microbatch. It holds each weight's gradient
    accumulator, so autograd gives every microbatch's graph the same one (a tensor keeps its
    accumulator only while something holds it) and it is found once."""

    def __init__(self) -> None:
        self._accumulators: Dict[torch.Tensor, object] = {}
        self._key: tuple = ()
        self._found: Set = set()

    def accumulators(self, parameters: Iterable[torch.Tensor]) -> Set:
        """The accumulators of the parameters that need a gradient, kept for these parameters only
        (one put in another's place is found anew, and the one it replaced is let go). The same
        parameters as last time (the same objects, each needing a gradient or not as then: it
        holds them, so their ids are theirs) give the same set without looking each one up."""
        parameters = list(parameters)
        key = tuple(map(id, parameters)) + tuple(p.requires_grad for p in parameters)
        if key != self._key:
            known = self._accumulators
            self._accumulators = {p: known.get(p) or _node(p) for p in parameters if p.requires_grad}
            self._key, self._found = key, set(self._accumulators.values())
        return self._found

    def input_gradient(self, y: torch.Tensor, grad: Optional[torch.Tensor], x: torch.Tensor,
                       parameters: Iterable[torch.Tensor]) -> Tuple[Optional[torch.Tensor], Callable[[], None]]:
        """The I part: x's gradient (None where x needs none), and the W part to call later."""
        if not x.requires_grad:  # the first stage: nothing to send, the whole backward is the W part
            return None, lambda: torch.autograd.backward(y, grad)
        if grad is None:
            if y.numel() != 1:
                raise ValueError(f"a gradient for the stage's output of shape {tuple(y.shape)} is needed: only a "
                                 "one-element output (a loss) starts its backward without one")
            grad = torch.ones_like(y)  # what torch.autograd.backward(loss) starts from
        groups = weight_groups(y.grad_fn, x, self.accumulators(parameters), y.output_nr)
        # The gradient arriving at each group's node, for its W: the engine returns it beside x's
        # when asked for the node's edges (one per output of the node's forward that a node above
        # takes; None where none arrived, and a node that did not run gets none: its W call is
        # left out), as it would give a hook on the node before it runs, without the hooks' cost.
        edges = [GradientEdge(node, output) for node, _, outputs in groups for output in outputs]
        dx, *arrived = _run_engine((y,), (grad,), (x, *edges), keep_graph=True, accumulate=False)
        calls, arrived = [], iter(zip(edges, arrived))
        for node, accumulators, outputs in groups:
            used = [(e, g) for e, g in (next(arrived) for _ in outputs) if g is not None]
            if used:
                calls.append((tuple(e for e, _ in used), tuple(g for _, g in used),
                              tuple(acc.variable for acc in accumulators)))

        def weights_part() -> None:
            # A call a group: a weight's side hangs below one node, and the input's path below it
            # leads to the next group's weights, which this call must not reach again. The
            # accumulators add to each p.grad, as in a whole backward, and in its order: the
            # groups nearest the output first.
            while calls:
                edges, grads, weights = calls.pop()
                _run_engine(edges, grads, weights, keep_graph=False, accumulate=True)

        return dx, weights_part


def input_gradient(y: torch.Tensor, grad: Optional[torch.Tensor], x: torch.Tensor,
                   parameters: Iterable[torch.Tensor]) -> Tuple[Optional[torch.Tensor], Callable[[], None]]:
    """The I part: x's gradient (None where x needs none), and the W part to call later."""
    return SplitBackward().input_gradient(y, grad, x, parameters)
