"""A backward split into the input's gradient (I) and the weights' (W), as zero bubble runs it
(ddp_from_scratch/pipeline_parallel/two_part_backward.py): the I part computes no weight's
gradient, the W part no input's, and together they give whole-backward bits, over several
microbatches accumulating, on graphs with branches, residuals, norms and a layer's output used
twice.

    pytest tests/pipeline_parallel/test_two_part_backward.py -q
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ddp_from_scratch.pipeline_parallel.two_part_backward import SplitBackward, input_gradient


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Reused(nn.Module):
    """A Linear whose output goes two ways (y + tanh(y)): two gradients arrive at its node, and
    its W must start from their sum, once."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        y = self.fc(x)
        return y + torch.tanh(y)


def _model(kind: str, width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "reused":
        return nn.Sequential(Reused(width), nn.Tanh(), Reused(width), nn.Linear(width, 3))
    if kind == "mlp":
        return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width, bias=False))
    if kind == "residual":
        return nn.Sequential(Residual(width), Residual(width), nn.Linear(width, 3))
    return nn.Sequential(nn.Unflatten(1, (1, width)), nn.Conv1d(1, 2, 3, padding=1), nn.BatchNorm1d(2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(2 * width, 3))


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["mlp", "residual", "conv", "reused"]), width=st.integers(2, 9), batch=st.integers(2, 5),
       microbatches=st.integers(1, 4), later=st.booleans(), kept=st.booleans(),
       precision=st.sampled_from(["float32", "float64", "bfloat16 autocast"]), frozen=st.booleans(),
       seed=st.integers(0, 10**6))
def test_i_then_w_is_the_whole_backward_bit_for_bit(kind, width, batch, microbatches, later, kept, precision, frozen,
                                                    seed):
    """Against loss.backward() on a copy, microbatch after microbatch: every input gradient and,
    after the Ws (all at once at the end, or each right after its I), every weight's; with one
    SplitBackward for every microbatch (as a stage keeps it) or the one-off function; in float32,
    float64, or a forward under bfloat16 autocast (as Stage(autocast=...) runs it); with the first
    parameter frozen (no gradient on either side) or not."""
    ours, whole = _model(kind, width, seed), _model(kind, width, seed)
    dtype = torch.float64 if precision == "float64" else torch.float32
    ours, whole = ours.to(dtype), whole.to(dtype)
    if frozen:
        next(ours.parameters()).requires_grad_(False)
        next(whole.parameters()).requires_grad_(False)

    def forward(model, x):
        if precision == "bfloat16 autocast":
            with torch.autocast("cpu", torch.bfloat16):
                return model(x)
        return model(x)

    split = SplitBackward().input_gradient if kept else input_gradient
    g = torch.Generator().manual_seed(seed)
    pending = []
    for _ in range(microbatches):
        x = torch.randn(batch, width, generator=g, dtype=dtype)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        before = {n: None if q.grad is None else q.grad.clone() for n, q in ours.named_parameters()}
        ya, yb = forward(ours, xa), forward(whole, xb)
        grad_out = torch.randn(ya.shape, generator=g, dtype=dtype).to(ya.dtype)
        dx, weights = split(ya, grad_out, xa, ours.parameters())
        for n, q in ours.named_parameters():  # the I part touched no weight's gradient
            assert (q.grad is None and before[n] is None) or torch.equal(q.grad, before[n]), n
        yb.backward(grad_out)
        assert torch.equal(dx, xb.grad)
        assert xa.grad is None  # the I part returns the input's gradient, it does not accumulate it
        if later:
            pending.append(weights)
        else:
            weights()
    for weights in pending:
        weights()
    for (n, a), b in zip(ours.named_parameters(), whole.parameters()):
        if not a.requires_grad:
            assert a.grad is None and b.grad is None, n
        else:
            assert torch.equal(a.grad, b.grad), n


def test_the_first_stage_sends_nothing_and_its_w_is_the_whole_backward():
    model, whole = _model("mlp", 4, 0), _model("mlp", 4, 0)
    x, grad_out = torch.randn(3, 4), torch.randn(3, 4)
    dx, weights = input_gradient(model(x), grad_out, x, model.parameters())
    assert dx is None and all(q.grad is None for q in model.parameters())
    weights()
    whole(x).backward(grad_out)
    for a, b in zip(model.parameters(), whole.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_weight_used_twice_on_the_inputs_path_and_an_output_without_the_input_are_refused():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"the weight \((4, 4|4,)\) is reached from two places on the input's path"):
        input_gradient(lin(lin(x)), torch.ones(2, 4), x, lin.parameters())
    with pytest.raises(ValueError, match="the stage's output does not depend on its input"):
        input_gradient(lin(torch.randn(2, 4)), torch.ones(2, 4), x, lin.parameters())


class _TwoOutputs(torch.autograd.Function):
    """y1 = x @ w and y2 = x @ w * 2 from one node: a node on the input's path with two outputs."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        y = x @ w
        return y, y * 2

    @staticmethod
    def backward(ctx, g1, g2):
        x, w = ctx.saved_tensors
        g = g1 + g2 * 2
        return (g @ w.t() if ctx.needs_input_grad[0] else None), (x.t() @ g if ctx.needs_input_grad[1] else None)


@pytest.mark.parametrize("used", ["first", "both"])
def test_a_node_with_two_outputs_one_of_them_unused(used):
    """The gradient kept for a node's W is one per output, and an output no gradient reached
    (the second, when only the first is used) stays unset, as in the whole backward."""
    torch.manual_seed(0)
    w_ours, w_whole = nn.Parameter(torch.randn(4, 4)), None
    w_whole = nn.Parameter(w_ours.detach().clone())
    x = torch.randn(3, 4)

    def out(x, w):
        y1, y2 = _TwoOutputs.apply(torch.tanh(x), w)
        return (y1 if used == "first" else y1 + y2).sum()

    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    dx, weights = input_gradient(out(xa, w_ours), None, xa, [w_ours])
    assert w_ours.grad is None
    weights()
    out(xb, w_whole).backward()
    assert torch.equal(dx, xb.grad) and torch.equal(w_ours.grad, w_whole.grad)


def test_a_stage_whose_parameter_is_replaced_splits_onto_the_new_one():
    """A SplitBackward keeps each parameter's gradient accumulator; a parameter put in another's
    place (load_state_dict(assign=True)) is found anew, its gradient lands in it, and the one it
    replaced is let go."""
    model, whole = _model("mlp", 4, 1), _model("mlp", 4, 1)
    split = SplitBackward()
    x = torch.randn(3, 4, requires_grad=True)
    split.input_gradient(model(x), torch.ones(3, 4), x, model.parameters())[1]()
    replaced = weakref.ref(next(model.parameters()))
    model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
    assert all(q.grad is None for q in model.parameters())
    x = torch.randn(3, 4)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    dx, weights = split.input_gradient(model(xa), torch.ones(3, 4), xa, model.parameters())
    gc.collect()
    assert replaced() is None, "the SplitBackward still holds the parameter that was replaced"
    weights()
    whole(xb).backward(torch.ones(3, 4))
    assert torch.equal(dx, xb.grad)
    for (n, a), b in zip(model.named_parameters(), whole.parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_an_output_of_more_than_one_element_needs_its_gradient():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"a gradient for the stage's output of shape \(2, 4\) is needed"):
        input_gradient(lin(x), None, x, lin.parameters())


@pytest.mark.parametrize("set_to_none", [True, False])
def test_one_split_backward_over_optimizer_steps_trains_as_the_whole_backward(set_to_none):
    """A stage keeps its SplitBackward across steps: an optimizer changes the weights in place and
    zero_grad clears (or zeroes) their gradients between steps; three SGD steps with momentum,
    two microbatches each, give the whole backward's weights bit for bit."""
    ours, whole = _model("residual", 5, 3), _model("residual", 5, 3)
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(whole.parameters(), lr=0.1, momentum=0.9)
    split, g = SplitBackward(), torch.Generator().manual_seed(7)
    for _ in range(3):
        pending = []
        for _ in range(2):
            x, grad_out = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            dx, weights = split.input_gradient(ours(xa), grad_out, xa, ours.parameters())
            pending.append(weights)
            whole(xb).backward(grad_out)
            assert torch.equal(dx, xb.grad)
        for weights in pending:
            weights()
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad(set_to_none=set_to_none)
        opt_b.zero_grad(set_to_none=set_to_none)
    for (n, a), b in zip(ours.named_parameters(), whole.parameters()):
        assert torch.equal(a, b), n


def test_a_parameter_frozen_or_thawed_between_microbatches_is_split_as_it_is_then():
    """One SplitBackward over microbatches while a weight is frozen, thawed, frozen and thawed
    again (frozen first: its accumulator is found when it first needs a gradient): the W adds a
    gradient to it only for the microbatches it needed one in, as the whole backward does."""
    ours, whole = _model("mlp", 4, 5), _model("mlp", 4, 5)
    split, g = SplitBackward(), torch.Generator().manual_seed(5)
    for frozen in (True, False, True, False):
        for model in (ours, whole):
            model[0].weight.requires_grad_(not frozen)
        x, grad_out = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        dx, weights = split.input_gradient(ours(xa), grad_out, xa, ours.parameters())
        weights()
        whole(xb).backward(grad_out)
        assert torch.equal(dx, xb.grad)
        for (n, a), b in zip(ours.named_parameters(), whole.parameters()):
            assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), n


def test_an_input_that_is_not_a_leaf_is_where_the_i_stops():
    """x made by an op (not a leaf): the I returns x's own gradient, and nothing below x is run."""
    model, whole = _model("residual", 4, 2), _model("residual", 4, 2)
    base = torch.randn(3, 4, requires_grad=True)
    x = base * 2
    grad_out = torch.ones(3, 3)
    dx, weights = input_gradient(model(x), grad_out, x, model.parameters())
    weights()
    assert base.grad is None  # the I stopped at x
    xb = (base.detach() * 2).requires_grad_()
    whole(xb).backward(grad_out)
    assert torch.equal(dx, xb.grad)
    for (n, a), b in zip(model.named_parameters(), whole.parameters()):
        assert torch.equal(a.grad, b.grad), n


class _Halves(torch.autograd.Function):
    """x @ w cut by columns into two outputs of one node, as a multi-output op with a weight
    (an RNN's output and state) makes: a stage may return its second output."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        y = x @ w
        k = y.shape[1] // 2
        return y[:, :k].clone(), y[:, k:].clone()

    @staticmethod
    def backward(ctx, g0, g1):
        x, w = ctx.saved_tensors
        g = torch.cat([g0, g1], 1)
        return g @ w.t(), x.t() @ g


def test_a_stage_whose_output_is_its_last_nodes_second_output_splits_as_the_whole_backward():
    """The W starts at the output the stage returned (its output number, here 1), not at the
    node's first: started at output 0, no gradient arrives there and the weight's is lost."""
    torch.manual_seed(4)
    first, w = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Parameter(torch.randn(4, 6))
    params = [*first.parameters(), w]
    x, grad_out = torch.randn(3, 4), torch.randn(3, 3)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = _Halves.apply(first(xa), w)[1]
    assert ya.output_nr == 1
    dx, weights = input_gradient(ya, grad_out, xa, params)
    grads = [p.grad for p in params]
    assert all(g is None for g in grads)  # the I computes no weight's gradient
    weights()
    assert all(p.grad is not None for p in params), "the W lost a weight's gradient"
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    _Halves.apply(first(xb), w)[1].backward(grad_out)
    assert torch.equal(dx, xb.grad)
    for a, p in zip(grads, params):
        assert torch.equal(a, p.grad)
