"""Any view gives the right answer: slices with steps, transposes, permutes, expand and
as_strided windows, on every collective, and memory outside the view is never touched.

A backend reads and writes `numel` elements from a tensor's first address, so without care
`all_reduce(b[:, ::2])` reduces the wrong elements and overwrites memory outside the view (seen
on Gloo before the wrappers copied such views). Views whose elements share memory (expand, an
overlapping as_strided) cannot hold an in-place result: the in-place collectives refuse them
with a clear error on every rank; the out-of-place ones read them fine.

    pytest tests/collectives/test_views.py -q
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives as C
from collectives.checks import overlaps_itself
from collectives.errors import CollectiveError

from .reference import check_collective
from collectives.testing import run_on_ranks

IN_PLACE = ["all_reduce", "reduce", "broadcast"]
OUT_OF_PLACE = ["all_gather", "gather", "reduce_scatter", "scatter", "all_to_all"]
DIVISIBLE = ("reduce_scatter", "scatter", "all_to_all")


def base_for(recipe, seed: int, rank: int, dtype) -> torch.Tensor:
    """Rank r's contiguous base tensor: small integers, exact in any order of summation."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(-20, 21, recipe["base"], generator=g).to(dtype)


def view_of(base: torch.Tensor, recipe) -> torch.Tensor:
    kind = recipe["kind"]
    if kind == "slice":
        (r0, r1, rs), (c0, c1, cs) = recipe["rows"], recipe["cols"]
        return base[r0:r1:rs, c0:c1:cs]
    if kind == "transpose":
        return base.t()
    if kind == "permute":
        return base.permute(2, 0, 1)
    if kind == "expand":
        return base.expand(recipe["base"][0], recipe["k"])
    if kind == "as_strided":
        return base.as_strided(recipe["size"], recipe["stride"], recipe["offset"])
    raise ValueError(kind)


@st.composite
def recipes(draw, n: int, divisible: bool):
    """A view whose first dimension is a multiple of n when `divisible`."""
    kind = draw(st.sampled_from(["slice", "transpose", "permute", "expand", "as_strided"]))
    k = draw(st.integers(1, 3))
    rows = n * k if divisible else draw(st.integers(1, 5))
    if kind == "slice":
        rs, cs = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        r0, c0 = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        cols = draw(st.integers(1, 3))
        return {"kind": kind, "base": (r0 + rows * rs + 1, c0 + cols * cs + 2),
                "rows": (r0, r0 + rows * rs, rs), "cols": (c0, c0 + cols * cs, cs)}
    if kind == "transpose":
        return {"kind": kind, "base": (draw(st.integers(1, 4)), rows)}
    if kind == "permute":
        return {"kind": kind, "base": (draw(st.integers(1, 3)), draw(st.integers(1, 3)), rows)}
    if kind == "expand":
        return {"kind": kind, "base": (rows, 1), "k": draw(st.integers(2, 4))}
    cols = draw(st.integers(1, 3))
    row_stride = draw(st.integers(1, 6))  # below cols: the rows overlap (a sliding window)
    col_stride = draw(st.integers(1, 2))
    offset = draw(st.integers(0, 3))
    needed = offset + (rows - 1) * row_stride + (cols - 1) * col_stride + 1
    return {"kind": kind, "base": (needed + draw(st.integers(0, 3)),), "size": (rows, cols),
            "stride": (row_stride, col_stride), "offset": offset}


def _covered(base: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """A mask over base's elements: True where the view reaches."""
    mask = torch.zeros(base.numel(), dtype=torch.bool)
    mask.as_strided(view.shape, view.stride(), view.storage_offset() - base.storage_offset()).fill_(True)
    return mask.view(base.shape)


def _body(env, collective, recipe, seed, dtype, op, root):
    n, r = env.world_size, env.rank
    bases = [base_for(recipe, seed, i, dtype) for i in range(n)]
    logical = [view_of(b, recipe).clone() for b in bases]  # what each rank's view holds, contiguous
    base = bases[r].clone()
    view = view_of(base, recipe)
    before = base.clone()
    outside = ~_covered(base, view)  # (reduce may use non-dst ranks' tensors as scratch: only outside is checked)
    if collective in IN_PLACE and overlaps_itself(view):
        try:
            {"all_reduce": lambda: C.all_reduce(view, op=op), "reduce": lambda: C.reduce(view, dst=root, op=op),
             "broadcast": lambda: C.broadcast(view, src=root)}[collective]()
        except CollectiveError as exc:
            assert "share memory" in str(exc), str(exc)
        else:
            raise AssertionError(f"{collective} wrote into a view whose elements share memory")
        assert torch.equal(base, before)
        return
    check_collective(env, collective, view, logical, op, root)
    # nothing outside the view was written
    assert torch.equal(base[outside], before[outside]), "memory outside the view was overwritten"
    if collective in OUT_OF_PLACE:
        assert torch.equal(base, before), "an out-of-place collective changed its input"


@st.composite
def cases(draw, collective):
    n = draw(st.sampled_from([1, 2, 3, 4]))
    recipe = draw(recipes(n, collective in DIVISIBLE))
    return (n, recipe, draw(st.integers(0, 10**6)), draw(st.sampled_from([torch.float32, torch.int64])),
            draw(st.sampled_from(["sum", "max"])), draw(st.integers(0, n - 1)))


@pytest.mark.parametrize("collective", IN_PLACE + OUT_OF_PLACE)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_collective_is_right_on_any_view(collective, data):
    n, *args = data.draw(cases(collective))
    run_on_ranks(_body, n, args=(collective, *args))


def _the_issue_example(env):
    b = torch.ones(4, 4) * (env.rank + 1)
    v = b[:, ::2]
    C.all_reduce(v)
    with C.checked():
        c = torch.ones(4, 4) * (env.rank + 1)
        C.broadcast(c[:, ::2], src=1)
    return b, c


def test_the_reported_strided_all_reduce():
    """The report: rows 2-3 of the view stayed 1 and b[0]'s other columns were overwritten."""
    for rank, (b, c) in enumerate(run_on_ranks(_the_issue_example, 2)):
        mine = rank + 1.0
        assert torch.equal(b, torch.tensor([[3.0, mine, 3.0, mine]] * 4)), b  # the sum in the view, own values outside
        assert torch.equal(c, torch.tensor([[2.0, mine, 2.0, mine]] * 4)), c  # rank 1's values in the view


def test_overlap_detection():
    assert overlaps_itself(torch.ones(3, 1).expand(3, 4))
    assert overlaps_itself(torch.arange(10.0).as_strided((3, 3), (1, 1)))
    assert not overlaps_itself(torch.ones(4, 4)[:, ::2])
    assert not overlaps_itself(torch.ones(2, 3, 4).permute(2, 0, 1))
    assert not overlaps_itself(torch.arange(10.0).as_strided((2, 3), (3, 2)))  # interleaved, no overlap
    assert overlaps_itself(torch.arange(10.0).as_strided((2, 3), (2, 1)))
