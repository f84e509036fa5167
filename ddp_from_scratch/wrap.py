"""One name for each data-parallel wrapper, and one `wrap` that builds any of them.

    model = wrap(net, "bucketed", bucket_cap_mb=25)    # or "torch", "naive", "flat"

"torch" is torch.nn.parallel.DistributedDataParallel; the others are the teaching path's three
steps. Options that only some wrappers have (bucket_cap_mb, find_unused_parameters, ...) are
refused by name for the others, so a comparison never silently drops one.
"""

from __future__ import annotations

from typing import Union

from torch import nn

from .ddp import DistributedDataParallel
from .flat import FlatDataParallel
from .naive import NaiveDataParallel

WRAPPERS = {"naive": NaiveDataParallel, "flat": FlatDataParallel, "bucketed": DistributedDataParallel}
IMPLS = ["torch"] + list(WRAPPERS)


def wrap(model: nn.Module, impl: Union[str, type], **kwargs) -> nn.Module:
    """`model` wrapped by `impl`: a name in IMPLS, or a wrapper class (tests pass broken ones).

    Args:
        model: the module to replicate (on this rank's device).
        impl: "torch", "naive", "flat", "bucketed", or a class taking (module, **kwargs).
        kwargs: the wrapper's options, with torch's names (bucket_cap_mb, find_unused_parameters,
            gradient_as_bucket_view, device_ids for torch's; compress, timeline for ours).
            A None value means the wrapper's default and is not passed on.
    """
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if impl == "torch":
        return nn.parallel.DistributedDataParallel(model, **kwargs)
    cls = WRAPPERS[impl] if isinstance(impl, str) else impl
    if cls in (NaiveDataParallel, FlatDataParallel) and kwargs.keys() - {"group", "broadcast_buffers"}:
        raise ValueError(f"{cls.__name__} takes no {', '.join(sorted(kwargs))}: only the bucketed wrapper and torch's do")
    return cls(model, **kwargs)
