"""The alpha-beta-gamma cost model: each algorithm's closed-form time, and "auto"'s choice.

    alpha  seconds a message costs whatever its size (latency, and here Python's per-message cost)
    beta   seconds per byte sent (1 / bandwidth)
    gamma  seconds per byte reduced locally (the add)

    model = CostModel.load()                          # fitted on this machine (fit.py), or DEFAULT
    model.predict("all_reduce", "ring", nbytes=1 << 24, world_size=4)
    choose("all_reduce", 1 << 24, 4, model)          # the cheapest predicted algorithm

The formulas are Thakur, Rabenseifner and Gropp (2005), "Optimization of Collective
Communication Operations in MPICH", for n bytes on p ranks; NCCL's double binary tree is
modelled as two pipelined trees (Sanders, Speck and Traeff 2009), and the pipelined ones use
the number of pieces that minimises their formula (best_pieces). Algorithms that need a power
of two fold the extra ranks in and out: 2 (alpha + n beta) more, plus n gamma when reducing.
The bandwidth benchmark's race (benchmarks/algorithms.py) prints these next to measured times.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable, Dict, Optional

from ..output_files import write_json

DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.json")
MAX_PIECES = 256


@dataclasses.dataclass(frozen=True)
class CostModel:
    alpha: float  # seconds per message
    beta: float  # seconds per byte sent
    gamma: float  # seconds per byte reduced
    source: str = ""  # where the numbers come from

    @classmethod
    def load(cls, path: Optional[str] = None) -> "CostModel":
        """The model saved by `python -m collectives.algorithms.fit` (COLLECTIVES_COST_MODEL or the
        package's model.json, fitted on the development machine)."""
        path = path or os.environ.get("COLLECTIVES_COST_MODEL") or DEFAULT_PATH
        try:
            with open(path) as f:
                data = json.load(f)
            values = [float(data[k]) for k in ("alpha", "beta", "gamma")]
        except FileNotFoundError:
            raise ValueError(f"cost model {path}: no such file (python -m collectives.algorithms.fit writes one)") from None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            why = f"no {exc} key" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            raise ValueError(f"cost model {path} is not one (a JSON object with numbers alpha, beta and gamma): {why}") \
                from None
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"cost model {path}: alpha, beta and gamma must be finite and not negative, got {values}")
        return cls(*values, data.get("source", path))

    def sharing(self, share: float) -> "CostModel":
        """This model for ranks that each get 1/share of a core (more ranks than cores on one
        machine): alpha, beta and gamma all times `share`, for on a machine like this one every
        one of them is CPU time (Python per message, copies through loopback TCP, the add)."""
        if share == 1:
            return self
        return CostModel(self.alpha * share, self.beta * share, self.gamma * share,
                         f"{self.source}, x{share:g} for {share:g} ranks per core")

    def save(self, path: str, flag: Optional[str] = "--out", **extra) -> None:
        write_json(path, {**dataclasses.asdict(self), **extra}, flag)

    def predict(self, collective: str, algorithm: str, nbytes: int, world_size: int) -> float:
        """Predicted seconds for `algorithm` doing `collective` on `nbytes` (the full buffer per
        rank: all_gather's output, reduce_scatter's input, all_to_all's send buffer)."""
        if world_size == 1:
            return 0.0
        return COSTS[collective][algorithm](world_size, float(nbytes), self.alpha, self.beta, self.gamma)


def _lg(p: int) -> int:
    return math.ceil(math.log2(p))


def _fold(p: int):
    """(p', 1 if the world folds) for p' the largest power of two <= p."""
    p2 = 1 << (p.bit_length() - 1)
    return p2, int(p2 != p)


def _rd_all_reduce(p, n, a, b, g):
    p2, f = _fold(p)
    return math.log2(p2) * (a + n * b + n * g) + f * (2 * (a + n * b) + n * g)


def _rabenseifner(p, n, a, b, g):
    p2, f = _fold(p)
    return 2 * math.log2(p2) * a + 2 * (p2 - 1) / p2 * n * b + (p2 - 1) / p2 * n * g + f * (2 * (a + n * b) + n * g)


def _halving(p, n, a, b, g):
    p2, f = _fold(p)
    return math.log2(p2) * a + (p2 - 1) / p2 * n * (b + g) + f * (2 * a + n * b + n * g + n / p * b)


def _doubling_gather(p, n, a, b, g):
    p2, f = _fold(p)
    return math.log2(p2) * a + (p2 - 1) / p2 * n * b + f * (2 * a + n / p * b + n * b)


def _double_tree_k(p, n, a, b, g, k):
    return 2 * (_lg(p) + 2 * k - 1) * (a + n / (2 * k) * b) + n * g


def _chain_k(p, n, a, b, g, k):
    return (p - 2 + k) * (a + n / k * b)


PIPELINED = {"chain": _chain_k, "double_binary_tree": _double_tree_k}


def best_pieces(algorithm: str, p: int, nbytes: float, a: float, b: float, g: float = 0.0) -> int:
    """The number of pipelined pieces that minimises the algorithm's cost: more pieces fill the
    pipeline sooner (less n beta waiting) but each costs another alpha."""
    return min(range(1, MAX_PIECES + 1), key=lambda k: PIPELINED[algorithm](p, nbytes, a, b, g, k))


def _binomial_all_reduce(p, n, a, b, g):
    """A binomial reduce then a binomial broadcast: 2 lg p messages of n, lg p reductions."""
    return 2 * _lg(p) * (a + n * b) + _lg(p) * n * g


def _double_tree(p, n, a, b, g):
    return _double_tree_k(p, n, a, b, g, best_pieces("double_binary_tree", p, n, a, b, g))


def _chain(p, n, a, b, g):
    return _chain_k(p, n, a, b, g, best_pieces("chain", p, n, a, b, g))


_loaded = {}


def pieces_for(algorithm: str, p: int, nbytes: int) -> int:
    """best_pieces under the fitted model (what the pipelined algorithms use when not told)."""
    if "model" not in _loaded:
        _loaded["model"] = CostModel.load()
    m = _loaded["model"]
    return best_pieces(algorithm, p, nbytes, m.alpha, m.beta, m.gamma)


COSTS: Dict[str, Dict[str, Callable]] = {
    "all_reduce": {
        "ring": lambda p, n, a, b, g: 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g,
        "recursive_doubling": _rd_all_reduce,
        "rabenseifner": _rabenseifner,
        "binomial": _binomial_all_reduce,
        "double_binary_tree": _double_tree,
        # on one host (all this model knows): a binomial reduce then broadcast; on several, the
        # two-level model is the simulator's (topology.py, hierarchical.py's docstring)
        "hierarchical": _binomial_all_reduce,
    },
    "reduce_scatter": {
        "ring": lambda p, n, a, b, g: (p - 1) * a + (p - 1) / p * n * (b + g),
        "recursive_halving": _halving,
        "pairwise": lambda p, n, a, b, g: (p - 1) * a + (p - 1) / p * n * (b + g),
    },
    "all_gather": {
        "ring": lambda p, n, a, b, g: (p - 1) * a + (p - 1) / p * n * b,
        "recursive_doubling": _doubling_gather,
        "bruck": lambda p, n, a, b, g: _lg(p) * a + (p - 1) / p * n * b,
    },
    "broadcast": {
        "binomial": lambda p, n, a, b, g: _lg(p) * (a + n * b),
        "chain": _chain,
        "scatter_allgather": lambda p, n, a, b, g: (_lg(p) + p - 1) * a + 2 * (p - 1) / p * n * b,
    },
    "reduce": {
        "binomial": lambda p, n, a, b, g: _lg(p) * (a + n * b + n * g),
        "rabenseifner": lambda p, n, a, b, g: _halving(p, n, a, b, g) + _lg(p) * a + (p - 1) / p * n * b,
    },
    "gather": {"binomial": lambda p, n, a, b, g: _lg(p) * a + (p - 1) / p * n * b},
    "scatter": {"binomial": lambda p, n, a, b, g: _lg(p) * a + (p - 1) / p * n * b},
    "all_to_all": {
        "pairwise": lambda p, n, a, b, g: (p - 1) * a + (p - 1) / p * n * b,
        "bruck": lambda p, n, a, b, g: _lg(p) * a + _lg(p) * n / 2 * b,
    },
}


def choose(collective: str, nbytes: int, world_size: int, model: CostModel) -> str:
    """The algorithm with the smallest predicted time ("auto")."""
    return min(COSTS[collective], key=lambda name: model.predict(collective, name, nbytes, world_size))
