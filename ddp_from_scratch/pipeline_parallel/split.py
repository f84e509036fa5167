"""A model's layers cut into pipeline stages.

    stages = split(nn.Sequential(...), 4)                 # balanced by parameter count
    stages = split(model, 2, sizes=[3, 5])                # the first 3 layers, then the next 5

A stage is an nn.Sequential of consecutive layers of the model (the same module objects, so a
stage's parameters are the model's). Balanced: the cut points that make the largest stage's
parameter count as small as it can be, every stage keeping at least one layer (the same search
torch.distributed.pipelining leaves to the user, and picotron does by layer count). Anything
that does not cover the layers exactly is a ValueError naming the numbers.

Only a plain nn.Sequential is cut: its forward is its layers in turn, so the stages run in turn
are the model. Another module's forward may do more than run its children (a residual
connection, a layer called twice), which stages cannot see, so it is refused; so is an
nn.Sequential that holds one layer with parameters or buffers twice (the stages would share its
parameters, and nn.Module.children() would silently drop the second). A layer without them (one
nn.ReLU in several places) is taken at each place.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from torch import nn


def _check(layers: int, stages: int, sizes: Optional[Sequence[int]]) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise ValueError(f"the number of stages must be a whole number, got {stages!r}")
    if stages < 1:
        raise ValueError(f"a pipeline needs at least 1 stage, got {stages}")
    if stages > layers:
        raise ValueError(f"{stages} stages need at least {stages} layers (one a stage); the model has {layers}")
    if sizes is not None:
        sizes = list(sizes)
        if any(isinstance(s, bool) or not isinstance(s, int) for s in sizes):
            raise ValueError(f"stage sizes {sizes} must be whole numbers of layers")
        if len(sizes) != stages or any(s < 1 for s in sizes) or sum(sizes) != layers:
            raise ValueError(f"stage sizes {sizes} must be {stages} whole numbers of at least 1 that add up to the "
                             f"model's {layers} layers")


def balanced_sizes(weights: Sequence[int], stages: int) -> List[int]:
    """Layers a stage, in order, so that the heaviest stage (sum of `weights`) is as light as it
    can be. Exhaustive over the cut points by dynamic programming: models here have tens of layers."""
    n = len(weights)
    _check(n, stages, None)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest heaviest stage when the first i layers make k stages; cut[k][i]: the start of the k-th
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(i - 1, k - 2, -1):  # the k-th stage is layers j..i-1
                heaviest = max(best[k - 1][j], prefix[i] - prefix[j])
                if heaviest < best[k][i]:
                    best[k][i], cut[k][i] = heaviest, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def layers_of(model: nn.Module) -> List[nn.Module]:
    """`model`'s layers in order, if it is a plain nn.Sequential of distinct layers; else a
    ValueError that says why its stages would not be the model."""
    if not isinstance(model, nn.Sequential) or type(model).forward is not nn.Sequential.forward:
        kind = type(model).__name__
        raise ValueError(f"split() cuts an nn.Sequential's layers in order; {kind} is not one (or overrides its "
                         f"forward), and its forward may do more than run its children in turn (a residual "
                         f"connection, say), which stages run in turn would not: write the model as an "
                         f"nn.Sequential whose layers each take the one before's output")
    layers = list(model)  # not children(): that drops a module seen before
    first: dict = {}
    for i, layer in enumerate(layers):
        if id(layer) in first and any(True for _ in layer.parameters()) | any(True for _ in layer.buffers()):
            raise ValueError(f"layer {i} of the nn.Sequential is layer {first[id(layer)]} again "
                             f"({type(layer).__name__}): stages cannot share one layer's parameters; give each "
                             f"place its own layer (copy.deepcopy) or tie their weights by hand")
        first[id(layer)] = i
    return layers


def split(model: nn.Sequential, stages: int, sizes: Optional[Sequence[int]] = None) -> List[nn.Sequential]:
    """`model`'s layers (a plain nn.Sequential's, in order) as `stages` consecutive nn.Sequentials."""
    layers = layers_of(model)
    _check(len(layers), stages, sizes)
    if sizes is None:
        sizes = balanced_sizes([sum(p.numel() for p in layer.parameters()) for layer in layers], stages)
    out, at = [], 0
    for size in sizes:
        out.append(nn.Sequential(*layers[at:at + size]))
        at += size
    return out
