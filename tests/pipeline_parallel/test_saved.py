"""The activations a stage holds, counted as autograd saves and frees them
(ddp_from_scratch/pipeline_parallel/saved.py): exact bytes on a graph whose saved tensors are
known, parameters left out, and every byte given back when a backward frees the graph or the
graph is dropped without one.

    pytest tests/pipeline_parallel/test_saved.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddp_from_scratch.pipeline_parallel.saved import SavedBytes


@pytest.mark.parametrize("rows,width", [(1, 3), (4, 8), (5, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("end", ["backward", "dropped"])
def test_a_linear_then_tanh_saves_its_input_and_its_output_and_gives_them_back(rows, width, dtype, end):
    """Linear saves its input (rows x width) and its weight (a parameter: not counted); tanh saves
    its output (rows x width). So the peak is two activations of the dtype's size, and none is
    left at the end."""
    torch.manual_seed(0)
    lin = nn.Linear(width, width).to(dtype)
    saved = SavedBytes(lin.parameters())
    x = torch.randn(rows, width, dtype=dtype, requires_grad=True)
    with saved:
        y = torch.tanh(lin(x)).sum()
    one = rows * width * x.element_size()
    assert (saved.live, saved.peak) == (2 * one, 2 * one)
    if end == "backward":
        y.backward()
    else:
        del y
    assert saved.live == 0 and saved.peak == 2 * one
    saved.reset()
    assert (saved.live, saved.peak) == (0, 0)


def test_outside_the_context_nothing_is_counted_and_the_grads_are_those_of_a_plain_backward():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    saved = SavedBytes(lin.parameters())
    x = torch.randn(2, 4, requires_grad=True)
    torch.tanh(lin(x)).sum().backward()
    assert saved.peak == 0
    plain = x.grad.clone()
    x.grad = None
    with saved:
        y = torch.tanh(lin(x)).sum()
    y.backward()
    assert torch.equal(x.grad, plain)
