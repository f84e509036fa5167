"""Dtypes a backend cannot carry, and how the wrappers carry them anyway.

Measured on Gloo (torch 2.13): int16, uint16, uint32, uint64 and the float8 types fail in every
collective with "Invalid scalar type", and complex fails in gather. NCCL has no 16-bit integer
type either. The wrappers fill these gaps so that every dtype works the same on every backend:

- Moving data (broadcast, all_gather, gather, scatter, all_to_all): the bytes are moved, as a
  uint8 view of the contiguous tensor; nothing is converted, so the result is exact.
- Reducing (all_reduce, reduce, reduce_scatter): computed in a wider integer type and narrowed
  back. int16 and uint16 go through int32, uint32 through int64: sum and product then wrap
  exactly as they would in the narrow type (only the low bits are kept), min/max/bitwise are
  exact. uint64 travels as int64 with the same bits (sum, product, bitwise are the same modulo
  2**64); for min/max the sign bit is flipped on the way in and out, so signed order is unsigned order.
- The wrappers' own local folds (NCCL has no bitwise reductions) widen the unsigned types the
  same way, since torch has no CPU arithmetic on them.
- Reducing float8 is refused on every backend (the result would depend on the backend's
  accumulation precision): cast to bfloat16 or float32 first.

    widening = reduction_widening(backend, dtype, op)     # None: the backend takes the dtype as it is
    sent = widening.widen(t); ...reduce sent...; t.copy_(widening.narrow(sent))
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
               if hasattr(torch, n))
# Bit-packed and sub-byte dtypes, and float8_e8m0fnu: no backend here moves them (Gloo fails with
# "Invalid scalar type", measured on torch 2.13) and they are not whole bytes per element, or have
# no arithmetic, so the wrappers refuse them by name instead of moving bytes.
UNMOVABLE = frozenset(getattr(torch, n) for n in (
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16", "float4_e2m1fn_x2", "float8_e8m0fnu",
    *(f"int{k}" for k in range(1, 8)), *(f"uint{k}" for k in range(1, 8))) if hasattr(torch, n))
_UNSIGNED_WIDE = tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))
# What each backend cannot carry, per kind of collective.
UNSUPPORTED = {
    "gloo": {"move": {torch.int16, *_UNSIGNED_WIDE, *FLOAT8}, "gather": {torch.complex64, torch.complex128}},
    "nccl": {"move": {torch.int16, *_UNSIGNED_WIDE}, "gather": set()},
}
SIGN_BIT = -(2**63)



def moves_as_bytes(backend: str, dtype: torch.dtype, collective: str) -> bool:
    """True when the backend cannot move `dtype` in this collective, so the wrapper moves bytes."""
    table = UNSUPPORTED.get(backend)
    if table is None:
        return False
    return dtype in table["move"] or (collective == "gather" and dtype in table["gather"])


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a 1-d uint8 view (writing into it writes the tensor)."""
    flat = tensor.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:  # one element under a stride torch calls contiguous anyway
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def from_bytes(data: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    return data.view(dtype).view(shape)


@dataclasses.dataclass(frozen=True)
class Widening:
    """How a reduction travels: converted on the way in, converted back on the way out."""

    dtype: torch.dtype
    widen: Callable[[torch.Tensor], torch.Tensor]
    narrow: Callable[[torch.Tensor], torch.Tensor]


def _flip(t: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_xor(t, SIGN_BIT)


def reduction_widening(backend: str, dtype: torch.dtype, op: str) -> Optional[Widening]:
    """None when the backend reduces `dtype` itself; else how the wrapper carries it."""
    table = UNSUPPORTED.get(backend)
    if table is None or dtype not in table["move"]:
        return None
    return _widened(dtype, op)


def arithmetic_widening(dtype: torch.dtype, op: str) -> Optional[Widening]:
    """For reducing on this process (the wrappers' local folds): torch 2.13 has no CPU arithmetic
    on uint16, uint32 and uint64 ("add_stub not implemented for 'UInt16'"), so they are widened."""
    return _widened(dtype, op) if dtype in _UNSIGNED_WIDE else None


def _widened(dtype: torch.dtype, op: str) -> Optional[Widening]:
    if dtype in (torch.int16, getattr(torch, "uint16", None)):
        return Widening(torch.int32, lambda t: t.to(torch.int32), lambda w: w.to(dtype))
    if dtype == getattr(torch, "uint32", None):
        return Widening(torch.int64, lambda t: t.to(torch.int64), lambda w: w.to(dtype))
    if dtype == getattr(torch, "uint64", None):
        if op in ("min", "max"):
            return Widening(torch.int64, lambda t: _flip(t.view(torch.int64)), lambda w: _flip(w).view(dtype))
        return Widening(torch.int64, lambda t: t.view(torch.int64).clone(), lambda w: w.view(dtype))
    return None  # float8: refused by check_op_dtype before this is asked
