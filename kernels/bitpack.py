"""``bitpack`` kernels: lossless 1-bit packing of dropout masks.

Encode: one pass; each program packs 8 elements per byte (element ``i`` -> bit ``i % 8`` of
byte ``i // 8``). Float masks are read as raw bit patterns and the same pass writes per-program
statistics (min / max nonzero pattern, any nonzero, any ``-0.0``); a one-program kernel turns
them into the ``scale`` (NaN for an input that is not a 0-or-scale mask, as in the reference)
and two flags. Bool masks: one launch (its program 0 writes the zero flags). Nothing waits for
the device: the statistics are sized for the candidate config with the most programs, and the
finaliser is told how many the chosen config wrote (the autotuner's choice, read on the host).
Decode: one pass writing raw bit patterns (``scale`` or ``+0.0``), bit exact in every dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from ._common import (
    FEW_STAGES,
    TILE_SIZES,
    Tuned,
    bits_view,
    candidates,
    cdiv,
    chosen,
    config,
    configs,
    launch,
    num_warps,
    pow2,
    rmax,
    rmin,
    rsum,
    size_class,
)
from ._triton import check_launchable

_MAG_MASK = {torch.float32: 0x7FFFFFFF, torch.float16: 0x7FFF, torch.bfloat16: 0x7FFF}
_INF_BITS = {torch.float32: 0x7F800000, torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
_NAN_BITS = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}


@triton.jit(do_not_specialize=["tune_key"])
def _bitpack_encode_kernel(
    x_ptr,
    bits_ptr,
    stats_ptr,
    scale_ptr,
    flags_ptr,
    N,
    n_bytes,
    tune_key,
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
    else:
        if pid == 0:  # a bool mask: no scale (a dummy False) and no flags
            tl.store(scale_ptr, 0)
            tl.store(flags_ptr + tl.arange(0, 2), tl.full([2], 0, dtype=tl.int32))


@triton.jit(do_not_specialize=["tune_key"])
def _bitpack_finish_kernel(
    stats_ptr,
    scale_ptr,
    flags_ptr,
    n_prog,
    tune_key,
    MAG_MASK: tl.constexpr,
    INF_BITS: tl.constexpr,
    NAN_BITS: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One program: per-program statistics -> scale bits (NaN unless the input is a 0-or-scale
    mask) and flags (more than one distinct nonzero pattern or NaN, some -0.0)."""
    p = tl.arange(0, BLOCK_P)
    lo = tl.full([BLOCK_P], 2147483647, dtype=tl.int32)
    hi = tl.full([BLOCK_P], -2147483648, dtype=tl.int32)
    any_nz = tl.full([BLOCK_P], 0, dtype=tl.int32)
    neg_zero = tl.full([BLOCK_P], 0, dtype=tl.int32)
    for p0 in range(0, n_prog, BLOCK_P):
        m = p0 + p < n_prog
        row = stats_ptr + (p0 + p) * 4
        lo = tl.minimum(lo, tl.load(row, mask=m, other=2147483647))
        hi = tl.maximum(hi, tl.load(row + 1, mask=m, other=-2147483648))
        any_nz = tl.maximum(any_nz, tl.load(row + 2, mask=m, other=0))
        neg_zero = tl.maximum(neg_zero, tl.load(row + 3, mask=m, other=0))
    lo_all = rmin(lo, 0)
    nonzero = rmax(any_nz, 0) > 0
    pattern = tl.where(nonzero, lo_all, 0)
    distinct = nonzero & ((lo_all != rmax(hi, 0)) | ((pattern & MAG_MASK) > INF_BITS))
    neg = rmax(neg_zero, 0) > 0
    scale = tl.where(distinct | neg, NAN_BITS, pattern)
    tl.store(scale_ptr, scale.to(scale_ptr.dtype.element_ty))
    tl.store(flags_ptr, distinct.to(tl.int32))
    tl.store(flags_ptr + 1, neg.to(tl.int32))


@triton.jit(do_not_specialize=["tune_key"])
def _bitpack_decode_kernel(
    bits_ptr,
    scale_ptr,
    out_ptr,
    N,
    n_bytes,
    tune_key,
    IS_FLOAT: tl.constexpr,
    BLOCK: tl.constexpr,
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


def _byte_elems(c: triton.Config) -> int:
    return 8 * c.kwargs["BLOCK"]


def _space(bytes_p2: int, tile: int, *, interpreted: bool) -> list[triton.Config]:
    """BLOCK bytes (8 elements each) per program, no more than the input holds."""
    block = min(bytes_p2, tile // 8)
    legacy = config(num_warps(8 * block), BLOCK=block)
    tiles = [{"BLOCK": n // 8} for n in TILE_SIZES if n // 8 <= bytes_p2]
    return configs(legacy, candidates(tiles, _byte_elems), interpreted=interpreted)


def _finish_space(prog_p2: int, *, interpreted: bool) -> list[triton.Config]:
    """One program looping over the per-program statistics (min / max: any order is exact)."""
    legacy = config(4, BLOCK_P=min(prog_p2, 1024))
    tiles = [{"BLOCK_P": n} for n in (256, 1024) if n <= max(prog_p2, 256)]
    gpu = candidates(tiles, lambda c: c.kwargs["BLOCK_P"], FEW_STAGES)
    return configs(legacy, gpu, interpreted=interpreted)


_ENCODE = Tuned(_bitpack_encode_kernel, _space, elems=_byte_elems, key=["IS_FLOAT"])
_FINISH = Tuned(_bitpack_finish_kernel, _finish_space, elems=lambda c: c.kwargs["BLOCK_P"])
_DECODE = Tuned(_bitpack_decode_kernel, _space, elems=_byte_elems, key=["IS_FLOAT"])


def _grid(n_bytes: int):
    return lambda meta: (cdiv(n_bytes, meta["BLOCK"]),)


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
    scale = torch.empty((), dtype=x.dtype, device=dev)
    flags = torch.empty(2, dtype=torch.int32, device=dev)
    is_float = x.dtype != torch.bool
    tuner = _ENCODE.tuner(pow2(n_bytes), _common.TILE)
    # statistics rows for the config with the most programs (the tuner picks one on a GPU)
    most = max(cdiv(n_bytes, c.kwargs["BLOCK"]) for c in tuner.configs) if is_float else 1
    stats = torch.empty(most, 4, dtype=torch.int32, device=dev)
    launch(
        tuner,
        _grid(n_bytes),
        bits_view(x),
        bits,
        stats,
        bits_view(scale),
        flags,
        n,
        n_bytes,
        size_class(n_bytes),
        IS_FLOAT=is_float,
        MAG_MASK=_MAG_MASK.get(x.dtype, 0),
    )
    if is_float:
        n_prog = cdiv(n_bytes, chosen(tuner).kwargs["BLOCK"])  # host-side: no sync
        launch(
            _FINISH.tuner(pow2(n_prog)),
            (1,),
            stats,
            bits_view(scale),
            flags,
            n_prog,
            size_class(n_prog),
            MAG_MASK=_MAG_MASK[x.dtype],
            INF_BITS=_INF_BITS[x.dtype],
            NAN_BITS=_NAN_BITS[x.dtype],
        )
    return bits, scale, flags


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
    scale_bits = bits_view(scale.reshape(1)) if is_float else bits
    launch(
        _DECODE.tuner(pow2(n_bytes), _common.TILE),
        _grid(n_bytes),
        bits,
        scale_bits,
        bits_view(out),
        numel,
        n_bytes,
        size_class(n_bytes),
        IS_FLOAT=is_float,
    )
    return out
