"""What a rank holds during a step: bytes of parameters, gradients and optimizer state, sampled.

The point of ZeRO and FSDP is memory, so it is measured, not quoted from the paper's formula:
during a training step the sampler adds up the tensors the rank holds at every module entry and
exit in forward, every module boundary in backward (a hook on each module's output gradient),
every gradient accumulated into a parameter (FSDP2's unsharded parameters included: each is
hooked the first time it is seen registered on a module),
just before and after every collective (the moment a unit's gradients are all there and about
to be reduce-scattered falls between module boundaries), and keeps the largest total.

    held = HeldBytes(model, optimizer)        # any wrapper here, torch's DDP or fully_shard
    with held.watching_collectives():
        ...one training step...
    held.peak   # {"params", "grads", "optimizer", "comm", "total"} at the largest total

What counts, each storage once (views share it): every parameter registered on a module at that
moment (FSDP2 registers its unsharded parameters during forward and backward, and its sharded
DTensors between: their local shard is counted) and every parameter the optimizer steps (the
sharded steps' shards; FSDP2's sharded DTensors, alive while their unit is unsharded), its
.grad, the wrapper's own gradient buffers (DDP's buckets, ZeRO-2/FSDP's gradient shards and the
reduce-scatter inputs being filled), and every
tensor in the optimizer's state; "comm" is the collective's own input and output where they are
not one of those (a packed reduce-scatter input, a gathered unit's landing buffer), and the
buffers of collectives still in flight (the wrappers' bytes_in_flight(): an async reduce-scatter,
a prefetched all_gather). Activations and communication scratch inside the backends are
not counted: they are the same for every stage at a given batch, or invisible from Python
(torch's DDP keeps its buckets in C++, so DDP is measured on ours, which has torch's layout).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Dict, Iterable, List, Optional

import torch
from torch import nn

from .unused import tensors_in


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's shard on this rank


def _storages(tensors: Iterable[Optional[torch.Tensor]], seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        storage = _local(t).untyped_storage()
        key = (storage.data_ptr(), storage.device.type)
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


class HeldBytes:
    def __init__(self, model: nn.Module, optimizer):
        self.model = model
        self.root = getattr(model, "module", model)
        self.optimizer = getattr(optimizer, "inner", optimizer)  # ours: the optimizer over this rank's shards
        # what it steps is held even when no module has it registered: our shards, and FSDP2's
        # sharded parameters, which it swaps out of the module while their unit is gathered (the
        # sampler missed them once: fully_shard's peak looked 1/p of a unit smaller than it is)
        self._stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.peak: Dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0, "comm": 0, "total": 0}
        self.samples = 0
        self._handles, self._hooked = [], {}
        for mod in self.root.modules():
            self._handles.append(mod.register_forward_pre_hook(lambda m, args: self.sample()))
            self._handles.append(mod.register_forward_hook(self._after_forward))

    def _after_forward(self, mod, args, output) -> None:
        self.sample()
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(lambda grad: (self.sample(), grad)[1])

    def _params_now(self) -> List[torch.Tensor]:
        params = [p for m in self.root.modules() for p in m._parameters.values() if p is not None]
        for p in params:
            if id(p) not in self._hooked and p.requires_grad and p.is_leaf and not hasattr(p, "_local_tensor"):
                self._hooked[id(p)] = p  # kept alive: a later tensor must not reuse the id
                self._handles.append(p.register_post_accumulate_grad_hook(lambda q: self.sample()))
        return params

    def sample(self, comm: Iterable[torch.Tensor] = ()) -> None:
        """Add up what is held now (and `comm`, a collective's tensors); keep the largest total."""
        seen: set = set()
        params_now = self._params_now()
        params = _storages(params_now, seen) + _storages(self._stepped, seen)
        grads = [p.grad for p in params_now] + [getattr(b, "buffer", None) for b in getattr(self.model, "buckets", [])]
        grads += list(getattr(self.model, "_grad_shards", [])) + list(getattr(self.model, "_flat", []))
        grad_bytes = _storages(grads, seen)
        state = [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        opt_bytes = _storages(state, seen)
        comm_bytes = _storages(comm, seen) + int(getattr(self.model, "bytes_in_flight", lambda: 0)())
        self.samples += 1
        total = params + grad_bytes + opt_bytes + comm_bytes
        if total > self.peak["total"]:
            self.peak = {"params": params, "grads": grad_bytes, "optimizer": opt_bytes, "comm": comm_bytes,
                         "total": total}

    @contextlib.contextmanager
    def watching_collectives(self):
        """Sample just before and after every collective torch.distributed (and so FSDP2 and the
        wrappers here) calls, counting its tensors."""
        import torch.distributed as dist

        from collectives import compat

        names = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_reduce", "broadcast")
        saved = []
        for owner in (dist, compat):
            for name in names:
                original = getattr(owner, name, None)
                if original is None:
                    continue
                saved.append((owner, name, original))
                setattr(owner, name, self._watched(original))
        try:
            yield self
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)

    def _watched(self, original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
            self.sample(tensors)
            out = original(*args, **kwargs)
            self.sample(tensors)
            return out

        return call

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
