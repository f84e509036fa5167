"""Property tests (hypothesis): random shapes (zero elements included), dtypes, world sizes 1-4,
roots and uneven first dimensions. Each rank draws its input from (seed, rank); the expectation
is computed locally from every rank's regenerated input, so it never runs the code under test.

    pytest tests/collectives/test_properties.py -q
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .reference import check_collective
from collectives.testing import run_on_ranks

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32, torch.int64]
COLLECTIVES = ["all_reduce", "reduce", "broadcast", "all_gather", "gather", "reduce_scatter", "scatter", "all_to_all"]


def draw(seed: int, rank: int, shape, dtype) -> torch.Tensor:
    # small integers: sums of up to 4 of them are exact in every dtype, in any order
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def _body(env, collective, op, shape, dtype, seed, root, dim0s):
    n, r = env.world_size, env.rank
    if collective in ("all_gather", "gather"):
        inputs = [draw(seed, i, (dim0s[i],) + shape[1:], dtype) for i in range(n)]
    else:
        inputs = [draw(seed, i, shape, dtype) for i in range(n)]
    check_collective(env, collective, inputs[r].clone(), inputs, op, root)


@st.composite
def cases(draw_):
    n = draw_(st.sampled_from([1, 2, 3, 4]))
    collective = draw_(st.sampled_from(COLLECTIVES))
    trailing = tuple(draw_(st.lists(st.integers(0, 3), max_size=2)))
    if collective in ("reduce_scatter", "scatter", "all_to_all"):
        dim0 = n * draw_(st.integers(0, 3))  # must divide by the group size
    else:
        dim0 = draw_(st.integers(0, 5))
    dim0s = tuple(draw_(st.integers(0, 4)) for _ in range(n))  # uneven, for (all_)gather
    return (n, collective, draw_(st.sampled_from(["sum", "min", "max"])), (dim0,) + trailing,
            draw_(st.sampled_from(DTYPES)), draw_(st.integers(0, 10**6)), draw_(st.integers(0, n - 1)), dim0s)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_collectives_match_a_local_computation(case):
    n, *args = case
    run_on_ranks(_body, n, args=tuple(args))
