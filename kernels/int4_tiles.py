"""Device helpers of the segment encoder (:func:`adacc_kernels.int4._seg_encode_kernel`): tile
loads with the outlier gather, quantise + pack + store, per-row statistics and parameters, and
the zeros of unused outlier slots. Layout and non-finite rules as in :mod:`.int4`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    flagged_scale,
    is_finite,
    pack_nibbles,
    quantize_robust,
    rmax,
    rmin,
)


@triton.jit
def _load_seg_tile(
    x_ptr,
    rows,
    rmask,
    cols,
    cmask,
    sxr,
    sxc,
    slot_ptr,
    values_ptr,
    n_out,
    HAS_OUT: tl.constexpr,
    WRITE_VALUES: tl.constexpr,
):
    """float32 tile of x (strides ``sxr``, ``sxc``); outlier channels (``slot >= 0``) copied to
    ``values`` and zeroed.

    Also returns ``|x|`` before zeroing, 0 for non-finite elements (the column statistics see
    every channel, finite values only).
    """
    m = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc
    raw = tl.load(x_ptr + offs, mask=m, other=0.0)
    x = raw.to(tl.float32)
    absx = tl.where(is_finite(x), tl.abs(x), 0.0)
    if HAS_OUT:
        slot = tl.load(slot_ptr + cols, mask=cmask, other=-1)
        is_out = (slot >= 0)[None, :]
        if WRITE_VALUES:
            voffs = rows[:, None].to(tl.int64) * n_out + slot[None, :]
            tl.store(values_ptr + voffs, raw, mask=m & is_out)
        x = tl.where(is_out, 0.0, x)
    return x, absx


@triton.jit
def _quant_pack_store(
    x,
    scale,
    offset,
    q_ptr,
    rows,
    rmask,
    byte0,
    w0,
    SEG,
    half_cp,
    ASYM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Quantise a [BLOCK_R, BLOCK_W] tile (segment-relative columns from ``w0``, even) and
    store its BLOCK_W // 2 bytes per row at byte column ``byte0`` of each row. ``scale`` is the
    magnitude; non-finite elements get marker codes."""
    if ASYM:  # noqa: SIM108 (Triton: keep constexpr branches as statements)
        v = x - offset[:, None]
    else:
        v = x
    q = quantize_robust(v, scale[:, None], is_finite(x))
    q_even, q_odd = tl.split(tl.reshape(q, [BLOCK_R, BLOCK_W // 2, 2]))
    packed = pack_nibbles(q_even, q_odd)
    h = tl.arange(0, BLOCK_W // 2)
    hmask = rmask[:, None] & ((w0 + 2 * h) < SEG)[None, :]
    offs = rows[:, None].to(tl.int64) * half_cp + byte0 + h[None, :]
    tl.store(q_ptr + offs, packed, mask=hmask)


@triton.jit
def _tile_stats(x, valid):
    """Per row of a tile, over its finite valid elements: (absmax, max, min, any non-finite,
    any finite) (the last two as int32 0 / 1)."""
    fin = is_finite(x)
    ok = valid & fin
    amax = rmax(tl.where(ok, tl.abs(x), 0.0), 1)
    mx = rmax(tl.where(ok, x, -float("inf")), 1)
    mn = rmin(tl.where(ok, x, float("inf")), 1)
    bad = rmax((valid & ~fin).to(tl.int32), 1)
    anyf = rmax(ok.to(tl.int32), 1)
    return amax, mx, mn, bad, anyf


@triton.jit
def _seg_params(amax, mx, mn, bad, anyf, rmask, DIVISOR: tl.constexpr, ASYM: tl.constexpr):
    """(scale magnitude, offset, flag) of row segments from :func:`_tile_stats`."""
    flag = bad > 0
    if ASYM:
        keep = rmask & (anyf > 0)
        mx = tl.where(keep, mx, 0.0)
        mn = tl.where(keep, mn, 0.0)
        offset = tl.math.div_rn(mx + mn, 2.0)
        scale = tl.math.div_rn(mx - mn, tl.where(flag, 12.0, 16.0))
    else:
        offset = tl.full(amax.shape, 0, dtype=tl.float32)
        scale = tl.math.div_rn(amax, tl.where(flag, 6.0, DIVISOR))
    return flagged_scale(scale, flag), offset, flag


@triton.jit
def _zero_unused(
    values_ptr,
    idx_ptr,
    rows,
    rmask,
    n_out,
    j0,
    nj,
    BLOCK_K: tl.constexpr,
):
    """Zero ``values[rows, j]`` for the unused slots (``idx[j] < 0``) among ``j0 .. j0 + nj``."""
    k = tl.arange(0, BLOCK_K)
    for jb in range(j0, j0 + nj, BLOCK_K):
        jj = jb + k
        jm = jj < j0 + nj
        unused = tl.load(idx_ptr + jj, mask=jm, other=0) < 0
        m = rmask[:, None] & (jm & unused)[None, :]
        zero = tl.full([rows.shape[0], BLOCK_K], 0, dtype=values_ptr.dtype.element_ty)
        tl.store(values_ptr + rows[:, None].to(tl.int64) * n_out + jj[None, :], zero, mask=m)
