"""The activations a pipeline stage holds: the bytes autograd saves for backward, counted as
they are saved and as they are freed, so a step's peak is measured, not computed.

    saved = SavedBytes(module.parameters())
    with saved:
        loss = module(x).sum()          # what autograd saves here is counted (parameters are not)
    saved.live, saved.peak              # bytes held now, and the most at once
    loss.backward()                     # frees them: saved.live goes back down
"""

from __future__ import annotations

import torch


class SavedBytes:
    """The bytes autograd saves for backward inside `with saved:` (parameters excluded), counted
    as they are saved and as they are freed: `live` now, `peak` the most at once since `reset()`.
    Each saved tensor is held detached (an output a node saves would otherwise hold the node
    through its grad_fn, a cycle through C++ that only a backward freeing the graph breaks, and a
    split backward's I keeps the graph for its W)."""

    def __init__(self, parameters):
        self._params = {p.data_ptr() for p in parameters}
        self.live = self.peak = 0
        self._hooks = None

    def reset(self, parameters=None) -> None:
        """Count from zero (a step's start), excluding `parameters` (their storage as it is now)."""
        if parameters is not None:
            self._params = {p.data_ptr() for p in parameters}
        self.live = self.peak = 0

    def __enter__(self) -> "SavedBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t):
        return t if t.data_ptr() in self._params else _Saved(self, t.detach())

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved


class _Saved:
    """One tensor autograd saved for backward, counted in its SavedBytes while it lives (__del__:
    it holds nothing that refers back to it, so it goes when autograd lets go of it; cheaper on
    every saved tensor than a weakref.finalize)."""

    __slots__ = ("tensor", "counter", "nbytes")

    def __init__(self, counter: SavedBytes, tensor: torch.Tensor):
        self.tensor, self.counter, self.nbytes = tensor, counter, tensor.numel() * tensor.element_size()
        counter.live += self.nbytes
        if counter.live > counter.peak:
            counter.peak = counter.live

    def __del__(self) -> None:
        self.counter.live -= self.nbytes
