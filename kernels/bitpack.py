"""``bitpack`` kernels: lossless 1-bit packing of dropout masks.

Encode: one pass; each program packs 8 elements per byte (element ``i`` -> bit ``i % 8`` of
byte ``i // 8``). Float masks are read as raw bit patterns and the same pass writes per-program
statistics (min / max nonzero pattern, any nonzero, any ``-0.0``); a few tiny torch reductions
turn them into the ``scale`` (NaN for an input that is not a 0-or-scale mask, as in the
reference) and two flags. Nothing waits for the device.
Decode: one pass writing raw bit patterns (``scale`` or ``+0.0``), bit exact in every dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from ._common import NO_FMA, bits_view, cdiv, num_warps, pow2, rmax, rmin, rsum
from ._triton import check_launchable

_MAG_MASK = {torch.float32: 0x7FFFFFFF, torch.float16: 0x7FFF, torch.bfloat16: 0x7FFF}


@triton.jit
def _bitpack_encode_kernel(
    x_ptr,
    bits_ptr,
    stats_ptr,
    N,
    n_bytes,
    IS_FLOAT: tl.constexpr,
    MAG_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, 8)
    e = b[:, None] * 8 + k[None, :]
    m = e < N
    v = tl.load(x_ptr + e, mask=m, other=0)
    if IS_FLOAT:  # noqa: SIM108 (Triton: keep constexpr branches as statements)
        nz = (v & MAG_MASK) != 0
    else:
        nz = v != 0
    byte = rsum(nz.to(tl.int32) << k[None, :], 1)
    tl.store(bits_ptr + b, byte.to(tl.uint8), mask=b < n_bytes)
    if IS_FLOAT:
        vi = v.to(tl.int32)
        lo = rmin(rmin(tl.where(nz, vi, 2147483647), 1), 0)
        hi = rmax(rmax(tl.where(nz, vi, -2147483648), 1), 0)
        any_nz = rmax(rmax(nz.to(tl.int32), 1), 0)
        neg_zero = rmax(rmax(((v != 0) & (~nz)).to(tl.int32), 1), 0)
        tl.store(stats_ptr + pid * 4 + 0, lo)
        tl.store(stats_ptr + pid * 4 + 1, hi)
        tl.store(stats_ptr + pid * 4 + 2, any_nz)
        tl.store(stats_ptr + pid * 4 + 3, neg_zero)


@triton.jit
def _bitpack_decode_kernel(
    bits_ptr, scale_ptr, out_ptr, N, n_bytes, IS_FLOAT: tl.constexpr, BLOCK: tl.constexpr
):
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, 8)
    e = b[:, None] * 8 + k[None, :]
    byte = tl.load(bits_ptr + b, mask=b < n_bytes, other=0).to(tl.int32)
    bit = (byte[:, None] >> k[None, :]) & 1
    if IS_FLOAT:
        s = tl.load(scale_ptr)
        out = tl.where(bit != 0, s, 0).to(s.dtype)
    else:
        out = bit.to(tl.uint8)
    tl.store(out_ptr + e, out, mask=e < N)


def _block(n_bytes: int) -> int:
    return min(pow2(n_bytes), _common.TILE // 8)


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat contiguous mask x -> (bits uint8 [ceil(n / 8)], scale (0-dim, x.dtype), flags).

    ``flags`` int32 [2]: (more than one distinct nonzero value or NaN, some ``-0.0``); both
    zero for a valid mask, whose ``scale`` is NaN otherwise. Bool masks: scale is a dummy
    ``False`` and flags are zeros.
    """
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError("bitpack kernels expect a flat contiguous tensor")
    check_launchable(x.device)
    n = x.numel()
    n_bytes = cdiv(n, 8)
    dev = x.device
    bits = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    is_float = x.dtype != torch.bool
    block = _block(n_bytes)
    n_prog = cdiv(n_bytes, block)
    stats = torch.empty(n_prog if is_float else 1, 4, dtype=torch.int32, device=dev)
    _bitpack_encode_kernel[(n_prog,)](
        bits_view(x),
        bits,
        stats,
        n,
        n_bytes,
        IS_FLOAT=is_float,
        MAG_MASK=_MAG_MASK.get(x.dtype, 0),
        BLOCK=block,
        num_warps=num_warps(8 * block),
        **NO_FMA,
    )
    if not is_float:
        zero_flags = torch.zeros(2, dtype=torch.int32, device=dev)
        return bits, torch.zeros((), dtype=torch.bool, device=dev), zero_flags
    lo, hi = stats.amin(0)[0], stats.amax(0)[1]
    any_nz, neg_zero = stats.amax(0)[2] > 0, stats.amax(0)[3] > 0
    pattern = torch.where(any_nz, lo, torch.zeros_like(lo))
    scale = pattern.to(bits_view(x).dtype).view(x.dtype).clone()
    distinct = any_nz & ((lo != hi) | torch.isnan(scale))
    scale = torch.where(distinct | neg_zero, torch.full_like(scale, torch.nan), scale)
    return bits, scale, torch.stack([distinct, neg_zero]).to(torch.int32)


def decode(
    bits: torch.Tensor,
    scale: torch.Tensor,
    numel: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flat [numel] mask of ``dtype``: ``scale`` where the bit is set, else +0.0 (or bool);
    written into ``out`` (flat, contiguous) when given."""
    check_launchable(bits.device)
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=bits.device)
    is_float = dtype != torch.bool
    n_bytes = bits.numel()
    block = _block(n_bytes)
    scale_bits = bits_view(scale.reshape(1)) if is_float else bits
    _bitpack_decode_kernel[(cdiv(n_bytes, block),)](
        bits,
        scale_bits,
        bits_view(out),
        numel,
        n_bytes,
        IS_FLOAT=is_float,
        BLOCK=block,
        num_warps=num_warps(8 * block),
        **NO_FMA,
    )
    return out
