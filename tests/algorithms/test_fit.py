"""The cost-model fit recovers known alpha and beta (and gamma) from synthetic timings, and weighs
small and large sizes as its docstring says: relative error lets the small sizes pin alpha.

    pytest tests/algorithms/test_fit.py -q
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.algorithms.fit import fit_line

SIZES = [8 << k for k in range(0, 26, 2)]  # 8 B .. 256 MiB, as the fit measures


@settings(max_examples=50, deadline=None)
@given(st.floats(1e-6, 1e-3), st.floats(1e-11, 1e-8))
def test_exact_timings_give_back_alpha_and_beta(alpha, beta):
    points = [(n, alpha + beta * n) for n in SIZES]
    for relative in (True, False):
        a, b = fit_line(points, relative=relative)
        assert a == pytest.approx(alpha, rel=1e-6, abs=1e-12) and b == pytest.approx(beta, rel=1e-6)


def test_relative_error_lets_the_small_sizes_pin_alpha():
    """With 5% noise on every time, the relative fit finds alpha within a few percent; plain least
    squares, which the large sizes dominate, does not (a fit weighting the wrong way would pass
    the exact test above and fail here)."""
    alpha, beta = 50e-6, 0.25e-9
    rng = random.Random(0)
    points = [(n, (alpha + beta * n) * (1 + rng.uniform(-0.05, 0.05))) for n in SIZES for _ in range(3)]
    a_rel, b_rel = fit_line(points, relative=True)
    a_abs, b_abs = fit_line(points, relative=False)
    assert a_rel == pytest.approx(alpha, rel=0.05) and b_rel == pytest.approx(beta, rel=0.05)
    assert abs(a_abs - alpha) > 10 * abs(a_rel - alpha)  # the large sizes' noise swamps alpha
    assert b_abs == pytest.approx(beta, rel=0.05)  # and gamma's plain fit still recovers a slope


@settings(max_examples=100, deadline=None)
@given(st.floats(1e-6, 1e-3), st.floats(1e-11, 1e-8), st.integers(0, 2**32 - 1))
def test_the_fit_minimises_the_error_its_docstring_names(alpha, beta, seed):
    """At the fitted line the gradient of the named objective is zero: sum(((a + b n - t) / t)^2)
    for the relative fit, sum((a + b n - t)^2) for the plain one. Exact points fit any weighting,
    and 5% noise recovers alpha under 1/t, 1/n or 1/t^3 weights too: this is what tells them apart."""
    rng = random.Random(seed)
    points = [(n, (alpha + beta * n) * (1 + rng.uniform(-0.3, 0.3))) for n in SIZES for _ in range(2)]
    for relative in (True, False):
        a, b = fit_line(points, relative=relative)
        w = [1 / t ** 2 if relative else 1.0 for _, t in points]
        residual = [a + b * n - t for n, t in points]
        # d/da and d/db of the objective, each against the size of its terms
        for grad, scale in ((sum(wi * r for wi, r in zip(w, residual)), sum(wi * t for wi, (_, t) in zip(w, points))),
                            (sum(wi * n * r for wi, r, (n, _) in zip(w, residual, points)),
                             sum(wi * n * t for wi, (n, t) in zip(w, points)))):
            assert abs(grad) <= 1e-9 * scale, (relative, grad, scale)


@pytest.mark.parametrize("size", ["3", "0", "1"])
def test_the_ranks_exchange_in_pairs_so_an_odd_world_is_refused(size, tmp_path, capsys):
    from collectives.algorithms import fit
    with pytest.raises(SystemExit):
        fit.main(["--world-size", size, "--out", str(tmp_path / "m.json")])
    assert f"--world-size must be an even number of ranks (they exchange in pairs), got {size}" in \
        capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()
