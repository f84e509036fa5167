"""A backward split into the input's gradient (I) and the weights' (W), as zero bubble runs it
(ddp_from_scratch/pipeline_parallel/two_part_backward.py): the I part computes no weight's
gradient, the W part no input's, and together they give whole-backward bits, over several
microbatches accumulating, on graphs with branches, residuals and norms.

    pytest tests/pipeline_parallel/test_two_part_backward.py -q
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ddp_from_scratch.pipeline_parallel.two_part_backward import input_gradient


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


def _model(kind: str, width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width, bias=False))
    if kind == "residual":
        return nn.Sequential(Residual(width), Residual(width), nn.Linear(width, 3))
    return nn.Sequential(nn.Unflatten(1, (1, width)), nn.Conv1d(1, 2, 3, padding=1), nn.BatchNorm1d(2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(2 * width, 3))


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["mlp", "residual", "conv"]), width=st.integers(2, 9), batch=st.integers(2, 5),
       microbatches=st.integers(1, 4), later=st.booleans(), seed=st.integers(0, 10**6))
def test_i_then_w_is_the_whole_backward_bit_for_bit(kind, width, batch, microbatches, later, seed):
    """Against loss.backward() on a copy, microbatch after microbatch: every input gradient and,
    after the Ws (all at once at the end, or each right after its I), every weight's."""
    ours, whole = _model(kind, width, seed), _model(kind, width, seed)
    g = torch.Generator().manual_seed(seed)
    pending = []
    for _ in range(microbatches):
        x = torch.randn(batch, width, generator=g)
        grad_out = torch.randn(batch, 3 if kind != "mlp" else width, generator=g)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        before = {n: None if q.grad is None else q.grad.clone() for n, q in ours.named_parameters()}
        dx, weights = input_gradient(ours(xa), grad_out, xa, ours.parameters())
        for n, q in ours.named_parameters():  # the I part touched no weight's gradient
            assert (q.grad is None and before[n] is None) or torch.equal(q.grad, before[n]), n
        whole(xb).backward(grad_out)
        assert torch.equal(dx, xb.grad)
        assert xa.grad is None  # the I part returns the input's gradient, it does not accumulate it
        if later:
            pending.append(weights)
        else:
            weights()
    for weights in pending:
        weights()
    for (n, a), b in zip(ours.named_parameters(), whole.parameters()):
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
