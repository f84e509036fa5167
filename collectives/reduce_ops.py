"""Reduction ops: names, which dtypes each makes sense for, and the one table of how each is done.

Ops are given as strings ("sum", "avg", "min", "max", "product", "band", "bor", "bxor") or as
torch.distributed.ReduceOp values; both mean the same thing on every backend.

COMBINE is the one op table: `fold` (a backend's missing op, done locally by the wrappers),
`local_reduce` (dst op= src, what the from-scratch algorithms do at each step) and `combine`
(out = a op b, the shm backend's reduce) all read it, so every path applies an op the same way.
"avg" is not in it: every path sums and divides by the number of ranks once, at the end.
"""

from __future__ import annotations

import functools
from typing import List, Union

import torch
import torch.distributed as dist

from .dtypes import FLOAT8, arithmetic_widening
from .errors import CollectiveError

R = dist.ReduceOp
OP_NAMES = ("sum", "avg", "min", "max", "product", "band", "bor", "bxor")
TORCH_OPS = {
    "sum": R.SUM, "avg": R.AVG, "min": R.MIN, "max": R.MAX,
    "product": R.PRODUCT, "band": R.BAND, "bor": R.BOR, "bxor": R.BXOR,
}
BITWISE = ("band", "bor", "bxor")

OpLike = Union[str, "dist.ReduceOp", "dist.ReduceOp.RedOpType"]


_names: dict = {}


def _short(op) -> str:
    text = repr(op) if not hasattr(op, "shape") else f"{type(op).__name__} of shape {tuple(op.shape)}"
    return text if len(text) <= 60 else text[:57] + "..."


def op_name(op: OpLike, collective: str = "collective") -> str:
    """Normalise "SUM", ReduceOp.SUM or ReduceOp(ReduceOp.SUM) to "sum"."""
    try:
        return _names[op]
    except (KeyError, TypeError):
        pass
    key = op
    if not isinstance(op, str) and not hasattr(op, "name") and hasattr(op, "op"):
        op = op.op  # a ReduceOp instance wraps a RedOpType
    name = op if isinstance(op, str) else getattr(op, "name", None)
    if not isinstance(name, str):  # None, a number, a tensor (whose .name is None) ...
        raise CollectiveError(f"{collective}: unknown reduction op {_short(op)}; use one of {', '.join(OP_NAMES)} "
                              "or a torch.distributed.ReduceOp")
    name = name.lower()
    if name == "prod":
        name = "product"
    if name not in OP_NAMES:
        raise CollectiveError(f"{collective}: unknown reduction op {op!r}; use one of {', '.join(OP_NAMES)} "
                              "or a torch.distributed.ReduceOp")
    try:
        _names[key] = name
    except TypeError:  # an unhashable ReduceOp instance
        pass
    return name


_allowed: set = set()


def check_op_dtype(name: str, dtype: torch.dtype, collective: str) -> None:
    """Refuse an op that makes no sense for the dtype, with the same rule on every backend."""
    if (name, dtype) in _allowed:
        return
    if dtype in FLOAT8:
        raise CollectiveError(
            f"{collective}: op '{name}' on {dtype} is refused on every backend (the result would depend on the "
            "backend's accumulation precision); cast to bfloat16 or float32 first. Moving float8 data is fine"
        )
    is_int = not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    if name in BITWISE and not (is_int or dtype == torch.bool):
        raise CollectiveError(f"{collective}: op '{name}' needs an integer or bool tensor, got {dtype}")
    if dtype.is_complex and name not in ("sum", "avg"):
        raise CollectiveError(f"{collective}: op '{name}' is not defined on complex tensors ({dtype}); only sum and avg are")
    if name == "avg" and (is_int or dtype == torch.bool):
        raise CollectiveError(
            f"{collective}: op 'avg' on {dtype} would have to round; Gloo refuses it and NCCL truncates. "
            "Use 'sum' and divide, or cast to a floating dtype first"
        )
    if dtype == torch.bool and name in ("sum", "product"):
        raise CollectiveError(
            f"{collective}: op '{name}' on bool is ambiguous (a count, or any/all?); "
            "use 'bor' (any) or 'band' (all), or cast to an integer dtype to count"
        )
    _allowed.add((name, dtype))


def backend_supports(backend: str, name: str) -> bool:
    """NCCL has no bitwise reductions; the wrappers fill that gap (see `fold`)."""
    return not (backend == "nccl" and name in BITWISE)


# op -> a torch function (a, b, out=None) computing a op b elementwise
COMBINE = {
    "sum": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum,
    "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor,
}


def fold(name: str, tensors: List[torch.Tensor]) -> torch.Tensor:
    """Reduce a list of tensors locally, in rank order (used where a backend lacks the op)."""
    if name == "avg":  # floats only (check_op_dtype refuses it on integers)
        return functools.reduce(torch.add, tensors) / len(tensors)
    return functools.reduce(COMBINE[name], tensors)


def local_reduce(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """dst = dst op src in place: one pass over memory, no temporary (this is the gamma term)."""
    widening = arithmetic_widening(dst.dtype, op)  # torch has no CPU arithmetic on uint16/32/64
    if widening is None:
        COMBINE[op](dst, src, out=dst)
    else:
        dst.copy_(widening.narrow(fold(op, [widening.widen(dst), widening.widen(src)])))


def combine(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    """out = a op b in one pass over memory (a copy and an in-place op would be two)."""
    try:
        COMBINE[op](a, b, out=out)
    except RuntimeError:  # no CPU kernel for this dtype (uint16/32/64): the widening path
        out.copy_(a)
        local_reduce(out, b, op)
