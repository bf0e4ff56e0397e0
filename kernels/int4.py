"""INT4 kernels shared by the four INT4 codecs, and their host launchers.

Layout (``adacc_hf.codecs.base``): codes of the row-major [rows, Cp] array (Cp = channels padded
to the segment multiple), element ``2i`` in the low nibble of byte ``i``, nibble = ``q + 8``.
When ``Cp`` is even every row starts on a byte boundary and programs own whole bytes of a 2-D
tile; when ``Cp`` is odd, bytes straddle rows and the "flat" kernels walk the byte array.

Kernels:

* :func:`_seg_encode_kernel` -- fused statistics + quantisation + packing for statistics local to
  a *segment* of a row (a group, or the whole row): one read of ``x``, one write. Options: asym
  (min/max) or symmetric (absmax), outlier channels zeroed and copied out (gather), per-row-block
  column abs-sums (for outlier selection), a "fix-up" mode that only redoes the segments holding
  outlier channels.
* :func:`_colpartial_kernel` -- per-row-block column reductions (|x| max or sum).
* :func:`_quant2d_kernel`, :func:`_quant_flat_kernel` -- quantise + pack with given scales.
* :func:`_dequant2d_kernel`, :func:`_dequant_flat_kernel` -- unpack + dequantise (+ outlier
  scatter back into place), one read of the payload, one write.

Scale modes (``SCALE_MODE``): 0 per row, 1 per channel, 2 per (row, segment of ``SEG`` channels).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _common
from ._common import (
    NO_FMA,
    cast_out,
    cdiv,
    num_warps,
    pack_nibbles,
    pow2,
    quantize_sym,
    rmax,
    rmin,
    rsum,
    store_view,
)

SCALE_ROW, SCALE_CHANNEL, SCALE_SEGMENT = 0, 1, 2

# -- device code -------------------------------------------------------------------------


@triton.jit
def _load_seg_tile(
    x_ptr,
    rows,
    rmask,
    cols,
    cmask,
    C,
    slot_ptr,
    values_ptr,
    n_out,
    HAS_OUT: tl.constexpr,
    WRITE_VALUES: tl.constexpr,
):
    """float32 tile of x; outlier channels (``slot >= 0``) copied to ``values`` and zeroed.

    Also returns ``|x|`` before zeroing (the column statistics see every channel).
    """
    m = rmask[:, None] & cmask[None, :]
    raw = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m, other=0.0)
    x = raw.to(tl.float32)
    absx = tl.abs(x)
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
    store its BLOCK_W // 2 bytes per row at byte column ``byte0`` of each row."""
    if ASYM:  # noqa: SIM108 (Triton: keep constexpr branches as statements)
        v = x - offset[:, None]
    else:
        v = x
    q = quantize_sym(v, scale[:, None])
    q_even, q_odd = tl.split(tl.reshape(q, [BLOCK_R, BLOCK_W // 2, 2]))
    packed = pack_nibbles(q_even, q_odd)
    h = tl.arange(0, BLOCK_W // 2)
    hmask = rmask[:, None] & ((w0 + 2 * h) < SEG)[None, :]
    offs = rows[:, None].to(tl.int64) * half_cp + byte0 + h[None, :]
    tl.store(q_ptr + offs, packed, mask=hmask)


@triton.jit
def _seg_encode_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    offset_ptr,
    colsum_ptr,
    slot_ptr,
    values_ptr,
    idx_ptr,
    R,
    C,
    SEG,
    NSEG,
    n_out,
    row_iters,
    nchunk,
    DIVISOR: tl.constexpr,
    ASYM: tl.constexpr,
    WRITE_Q: tl.constexpr,
    WRITE_STATS: tl.constexpr,
    COLSUM: tl.constexpr,
    HAS_OUT: tl.constexpr,
    WRITE_VALUES: tl.constexpr,
    FIXUP: tl.constexpr,
    SINGLE_CHUNK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Grid (row blocks, segments); FIXUP: (row blocks, outliers), one program per segment
    that holds outliers (the first outlier of each such segment does the work)."""
    pid_r = tl.program_id(0)
    if FIXUP:
        j = tl.program_id(1)
        seg = tl.load(idx_ptr + j) // SEG
        prev = tl.load(idx_ptr + tl.maximum(j - 1, 0)) // SEG
        if (j > 0) & (prev == seg):
            return
    else:
        seg = tl.program_id(1)
    seg_start = seg * SEG
    half_cp = (NSEG * SEG) // 2
    w = tl.arange(0, BLOCK_W)
    colacc = tl.full([BLOCK_W], 0, dtype=tl.float32)
    for it in range(row_iters):
        rows = (pid_r * row_iters + it) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        if SINGLE_CHUNK:
            cols = seg_start + w
            cmask = (w < SEG) & (cols < C)
            x, absx = _load_seg_tile(
                x_ptr,
                rows,
                rmask,
                cols,
                cmask,
                C,
                slot_ptr,
                values_ptr,
                n_out,
                HAS_OUT,
                WRITE_VALUES,
            )
            if COLSUM:
                colacc += rsum(absx, 0)
            if ASYM:
                valid = rmask[:, None] & cmask[None, :]
                mx = rmax(tl.where(valid, x, -float("inf")), 1)
                mn = rmin(tl.where(valid, x, float("inf")), 1)
                mx = tl.where(rmask, mx, 0.0)
                mn = tl.where(rmask, mn, 0.0)
                offset = tl.math.div_rn(mx + mn, 2.0)
                scale = tl.math.div_rn(mx - mn, 16.0)
            else:
                offset = tl.full([BLOCK_R], 0, dtype=tl.float32)
                scale = tl.math.div_rn(rmax(tl.abs(x), 1), DIVISOR)
        else:
            # Segment wider than a register tile: statistics over chunks, then a second,
            # cache-hot read of the same chunks to quantise.
            amax = tl.full([BLOCK_R], 0, dtype=tl.float32)
            mx = tl.full([BLOCK_R], -float("inf"), dtype=tl.float32)
            mn = tl.full([BLOCK_R], float("inf"), dtype=tl.float32)
            for c in range(nchunk):
                wc = c * BLOCK_W + w
                cols = seg_start + wc
                cmask = (wc < SEG) & (cols < C)
                x, absx = _load_seg_tile(
                    x_ptr,
                    rows,
                    rmask,
                    cols,
                    cmask,
                    C,
                    slot_ptr,
                    values_ptr,
                    n_out,
                    HAS_OUT,
                    WRITE_VALUES,
                )
                valid = rmask[:, None] & cmask[None, :]
                amax = tl.maximum(amax, rmax(tl.abs(x), 1))
                mx = tl.maximum(mx, rmax(tl.where(valid, x, -float("inf")), 1))
                mn = tl.minimum(mn, rmin(tl.where(valid, x, float("inf")), 1))
            if ASYM:
                mx = tl.where(rmask, mx, 0.0)
                mn = tl.where(rmask, mn, 0.0)
                offset = tl.math.div_rn(mx + mn, 2.0)
                scale = tl.math.div_rn(mx - mn, 16.0)
            else:
                offset = tl.full([BLOCK_R], 0, dtype=tl.float32)
                scale = tl.math.div_rn(amax, DIVISOR)
        if WRITE_STATS:
            soffs = rows.to(tl.int64) * NSEG + seg
            tl.store(scale_ptr + soffs, scale, mask=rmask)
            if ASYM:
                tl.store(offset_ptr + soffs, offset, mask=rmask)
        if WRITE_Q:
            if SINGLE_CHUNK:
                _quant_pack_store(
                    x,
                    scale,
                    offset,
                    q_ptr,
                    rows,
                    rmask,
                    seg_start // 2,
                    0,
                    SEG,
                    half_cp,
                    ASYM,
                    BLOCK_R,
                    BLOCK_W,
                )
            else:
                for c in range(nchunk):
                    wc = c * BLOCK_W + w
                    cols = seg_start + wc
                    cmask = (wc < SEG) & (cols < C)
                    x, absx = _load_seg_tile(
                        x_ptr,
                        rows,
                        rmask,
                        cols,
                        cmask,
                        C,
                        slot_ptr,
                        values_ptr,
                        n_out,
                        HAS_OUT,
                        False,
                    )
                    _quant_pack_store(
                        x,
                        scale,
                        offset,
                        q_ptr,
                        rows,
                        rmask,
                        (seg_start + c * BLOCK_W) // 2,
                        c * BLOCK_W,
                        SEG,
                        half_cp,
                        ASYM,
                        BLOCK_R,
                        BLOCK_W,
                    )
    if COLSUM:
        cols = seg_start + w
        tl.store(colsum_ptr + pid_r.to(tl.int64) * C + cols, colacc, mask=(w < SEG) & (cols < C))


@triton.jit
def _colpartial_kernel(
    x_ptr,
    part_ptr,
    R,
    C,
    row_iters,
    SUM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """part[pid_r, c] = sum (SUM) or max of |x[r, c]| over the program's rows."""
    pid_r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    acc = tl.full([BLOCK_C], 0, dtype=tl.float32)
    for it in range(row_iters):
        rows = (pid_r * row_iters + it) * BLOCK_R + tl.arange(0, BLOCK_R)
        m = (rows < R)[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m, other=0.0)
        a = tl.abs(x.to(tl.float32))
        if SUM:
            acc += rsum(a, 0)
        else:
            acc = tl.maximum(acc, rmax(a, 0))
    tl.store(part_ptr + pid_r.to(tl.int64) * C + cols, acc, mask=cmask)


@triton.jit
def _load_params(
    scale_ptr,
    offset_ptr,
    rows,
    cols,
    m,
    NSEG,
    SCALE_MODE: tl.constexpr,
    SEG: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
):
    """(scale, offset) broadcastable to ``rows``/``cols`` by SCALE_MODE (see module doc)."""
    if SCALE_MODE == 0:
        p = rows.to(tl.int64)
    elif SCALE_MODE == 1:
        p = cols.to(tl.int64)
    else:
        p = rows.to(tl.int64) * NSEG + cols // SEG
    scale = tl.load(scale_ptr + p, mask=m, other=0.0)
    if HAS_OFFSET:  # noqa: SIM108
        offset = tl.load(offset_ptr + p, mask=m, other=0.0)
    else:
        offset = scale  # unused placeholder
    return scale, offset


@triton.jit
def _quant2d_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    offset_ptr,
    R,
    C,
    NSEG,
    SCALE_MODE: tl.constexpr,
    SEG: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Quantise + pack with given per-row / per-channel / per-segment parameters (C even)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    rmask = rows < R
    cmask = w < C
    m = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + w[None, :], mask=m, other=0.0)
    x = x.to(tl.float32)
    scale, offset = _load_params(
        scale_ptr, offset_ptr, rows[:, None], w[None, :], m, NSEG, SCALE_MODE, SEG, HAS_OFFSET
    )
    if HAS_OFFSET:
        x = x - offset
    q = quantize_sym(x, scale)
    q_even, q_odd = tl.split(tl.reshape(q, [BLOCK_R, BLOCK_W // 2, 2]))
    h = tl.program_id(1) * (BLOCK_W // 2) + tl.arange(0, BLOCK_W // 2)
    offs = rows[:, None].to(tl.int64) * (C // 2) + h[None, :]
    tl.store(q_ptr + offs, pack_nibbles(q_even, q_odd), mask=rmask[:, None] & (2 * h < C)[None, :])


@triton.jit
def _quant_flat_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    offset_ptr,
    slot_ptr,
    R,
    C,
    CP,
    NSEG,
    n_codes,
    n_bytes,
    SCALE_MODE: tl.constexpr,
    SEG: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Quantise + pack walking the flat byte array (any Cp, also odd): byte b holds codes
    2b and 2b+1 of the row-major [R, CP] array; padding codes (column >= C, or past the end)
    are 0. Outlier channels (``slot >= 0``) are quantised as 0."""
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    e = 2 * b[:, None] + tl.arange(0, 2)[None, :]
    inside = e < n_codes  # R * CP (host-computed: int args equal to 1 are constexpr)
    row = e // CP
    col = e % CP
    m = inside & (col < C)
    x = tl.load(x_ptr + row * C + col, mask=m, other=0.0).to(tl.float32)
    if HAS_OUT:
        slot = tl.load(slot_ptr + col, mask=m, other=-1)
        x = tl.where(slot >= 0, 0.0, x)
    scale, offset = _load_params(
        scale_ptr, offset_ptr, row, col, inside, NSEG, SCALE_MODE, SEG, HAS_OFFSET
    )
    if HAS_OFFSET:
        x = x - offset
    q = tl.where(inside, quantize_sym(x, scale), 0)
    q_even, q_odd = tl.split(q)
    tl.store(q_ptr + b, pack_nibbles(q_even, q_odd), mask=b < n_bytes)


@triton.jit
def _dequant_value(
    nib,
    scale_ptr,
    offset_ptr,
    slot_ptr,
    values_ptr,
    out_ptr,
    rows,
    cols,
    m,
    NSEG,
    n_out,
    SCALE_MODE: tl.constexpr,
    SEG: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_OUT: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """Output-dtype values of nibbles ``nib`` at (rows, cols): q * scale (+ offset), cast once;
    outlier channels take their exact stored values instead."""
    scale, offset = _load_params(
        scale_ptr, offset_ptr, rows, cols, m, NSEG, SCALE_MODE, SEG, HAS_OFFSET
    )
    y = (nib - 8).to(tl.float32) * scale
    if HAS_OFFSET:
        y = y + offset
    y = cast_out(y, out_ptr, OUT_BF16)
    if HAS_OUT:
        slot = tl.load(slot_ptr + cols, mask=m, other=-1)
        is_out = slot >= 0
        raw = tl.load(values_ptr + rows.to(tl.int64) * n_out + slot, mask=m & is_out, other=0)
        y = tl.where(is_out, raw.to(y.dtype), y)
    return y


@triton.jit
def _dequant2d_kernel(
    q_ptr,
    scale_ptr,
    offset_ptr,
    slot_ptr,
    values_ptr,
    out_ptr,
    R,
    C,
    CP,
    NSEG,
    n_out,
    SCALE_MODE: tl.constexpr,
    SEG: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_OUT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Decode a [BLOCK_R, 2 * BLOCK_H] tile of out [R, C] (CP even, bytes [R, CP // 2])."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < R
    hm = rmask[:, None] & (h < CP // 2)[None, :]
    byte = tl.load(q_ptr + rows[:, None].to(tl.int64) * (CP // 2) + h[None, :], mask=hm, other=0)
    byte = byte.to(tl.int32)
    nib = tl.reshape(tl.join(byte & 15, byte >> 4), [BLOCK_R, 2 * BLOCK_H])
    cols = tl.program_id(1) * (2 * BLOCK_H) + tl.arange(0, 2 * BLOCK_H)
    m = rmask[:, None] & (cols < C)[None, :]
    y = _dequant_value(
        nib,
        scale_ptr,
        offset_ptr,
        slot_ptr,
        values_ptr,
        out_ptr,
        rows[:, None],
        cols[None, :],
        m,
        NSEG,
        n_out,
        SCALE_MODE,
        SEG,
        HAS_OFFSET,
        HAS_OUT,
        OUT_BF16,
    )
    tl.store(out_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], y, mask=m)


@triton.jit
def _dequant_flat_kernel(
    q_ptr,
    scale_ptr,
    offset_ptr,
    slot_ptr,
    values_ptr,
    out_ptr,
    R,
    C,
    CP,
    NSEG,
    n_out,
    n_elems,
    SCALE_MODE: tl.constexpr,
    SEG: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_OUT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Decode walking the flat output (any CP, also odd): out element o = (row, col) reads
    code ``row * CP + col``."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n_elems  # R * C
    row = o // C
    col = o % C
    e = row * CP + col
    byte = tl.load(q_ptr + e // 2, mask=m, other=0).to(tl.int32)
    nib = (byte >> ((e % 2) * 4).to(tl.int32)) & 15
    y = _dequant_value(
        nib,
        scale_ptr,
        offset_ptr,
        slot_ptr,
        values_ptr,
        out_ptr,
        row,
        col,
        m,
        NSEG,
        n_out,
        SCALE_MODE,
        SEG,
        HAS_OFFSET,
        HAS_OUT,
        OUT_BF16,
    )
    tl.store(out_ptr + o, y, mask=m)


# -- host launchers ----------------------------------------------------------------------


@functools.cache
def _dummy_cached(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(1, dtype=dtype, device=device)


def _dummy(device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A placeholder for a pointer argument the launch's flags leave unused (never written)."""
    return _dummy_cached(device, dtype)


def _seg_blocks(rows: int, seg: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_W, nchunk) for segments of ``seg`` channels."""
    width = min(pow2(max(seg, 2)), _common.MAX_SEGMENT_WIDTH)
    nchunk = cdiv(seg, width)
    block_r = max(1, min(_common.TILE // width, pow2(rows)))
    return block_r, width, nchunk


def launch_seg_encode(
    x: torch.Tensor,
    seg: int,
    nseg: int,
    *,
    asym: bool,
    divisor: float = 7.0,
    q: torch.Tensor | None = None,
    scale: torch.Tensor,
    offset: torch.Tensor | None = None,
    colsum_rows: int = 0,
    slot: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    write_stats: bool = True,
    fixup_idx: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Run :func:`_seg_encode_kernel` over x [R, C] in segments of ``seg`` channels.

    ``q`` given: quantised codes are written (needs ``seg`` even). ``colsum_rows > 0``: also
    returns per-row-block column abs-sums [nrb, C] with about ``colsum_rows`` row blocks.
    ``slot``: outlier channels (``slot >= 0``) are zeroed (and copied into ``values`` if given).
    ``fixup_idx``: only the segments holding these (sorted) outlier channels are processed.
    """
    rows, channels = x.shape
    block_r, width, nchunk = _seg_blocks(rows, seg)
    row_blocks = cdiv(rows, block_r)
    row_iters = 1
    colsum = None
    if colsum_rows:
        if nchunk != 1:
            raise ValueError("fused column sums need segments that fit one register tile")
        row_iters = cdiv(row_blocks, min(row_blocks, colsum_rows))
        row_blocks = cdiv(row_blocks, row_iters)
        colsum = torch.empty(row_blocks, channels, dtype=torch.float32, device=x.device)
    if q is not None and seg % 2:
        raise ValueError("fused packing needs an even segment (use the flat quantiser)")
    dev = x.device
    grid = (row_blocks, fixup_idx.numel() if fixup_idx is not None else nseg)
    _seg_encode_kernel[grid](
        x,
        q if q is not None else _dummy(dev, torch.uint8),
        scale,
        offset if offset is not None else _dummy(dev, torch.float32),
        colsum if colsum is not None else _dummy(dev, torch.float32),
        slot if slot is not None else _dummy(dev),
        values if values is not None else _dummy(dev, x.dtype),
        fixup_idx if fixup_idx is not None else _dummy(dev),
        rows,
        channels,
        seg,
        nseg,
        values.shape[1] if values is not None else 0,
        row_iters,
        nchunk,
        DIVISOR=float(divisor),
        ASYM=asym,
        WRITE_Q=q is not None,
        WRITE_STATS=write_stats,
        COLSUM=colsum is not None,
        HAS_OUT=slot is not None,
        WRITE_VALUES=values is not None,
        FIXUP=fixup_idx is not None,
        SINGLE_CHUNK=nchunk == 1,
        BLOCK_R=block_r,
        BLOCK_W=width,
        num_warps=num_warps(block_r * width),
        **NO_FMA,
    )
    return colsum


def launch_colpartial(x: torch.Tensor, *, reduce_sum: bool, target_blocks: int) -> torch.Tensor:
    """Per-row-block column |x| sums or maxima [nrb, C] with about ``target_blocks`` blocks."""
    rows, channels = x.shape
    block_c = min(pow2(channels), 128)
    block_r = max(1, min(_common.TILE // block_c, pow2(rows)))
    row_blocks = cdiv(rows, block_r)
    row_iters = cdiv(row_blocks, min(row_blocks, target_blocks))
    row_blocks = cdiv(row_blocks, row_iters)
    part = torch.empty(row_blocks, channels, dtype=torch.float32, device=x.device)
    grid = (row_blocks, cdiv(channels, block_c))
    _colpartial_kernel[grid](
        x,
        part,
        rows,
        channels,
        row_iters,
        SUM=reduce_sum,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=num_warps(block_r * block_c),
        **NO_FMA,
    )
    return part


def launch_quant(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    mode: int,
    cp: int,
    seg: int = 1,
    offset: torch.Tensor | None = None,
    slot: torch.Tensor | None = None,
) -> None:
    """Quantise + pack x [R, C] into q with given parameters (2-D when possible, else flat)."""
    rows, channels = x.shape
    dev = x.device
    nseg = cp // seg if mode == SCALE_SEGMENT else 1
    if cp == channels and channels % 2 == 0 and slot is None:
        width = min(pow2(channels), 1024)
        block_r = max(1, min(_common.TILE // width, pow2(rows)))
        grid = (cdiv(rows, block_r), cdiv(channels, width))
        _quant2d_kernel[grid](
            x,
            q,
            scale,
            offset if offset is not None else _dummy(dev, torch.float32),
            rows,
            channels,
            nseg,
            SCALE_MODE=mode,
            SEG=seg,
            HAS_OFFSET=offset is not None,
            BLOCK_R=block_r,
            BLOCK_W=width,
            num_warps=num_warps(block_r * width),
            **NO_FMA,
        )
        return
    n_bytes = q.numel()
    block = min(pow2(n_bytes), _common.TILE // 2)
    _quant_flat_kernel[(cdiv(n_bytes, block),)](
        x,
        q,
        scale,
        offset if offset is not None else _dummy(dev, torch.float32),
        slot if slot is not None else _dummy(dev),
        rows,
        channels,
        cp,
        nseg,
        rows * cp,
        n_bytes,
        SCALE_MODE=mode,
        SEG=seg,
        HAS_OFFSET=offset is not None,
        HAS_OUT=slot is not None,
        BLOCK=block,
        num_warps=num_warps(2 * block),
        **NO_FMA,
    )


def launch_dequant(
    q: torch.Tensor,
    scale: torch.Tensor,
    rows: int,
    channels: int,
    dtype: torch.dtype,
    *,
    mode: int,
    cp: int,
    seg: int = 1,
    offset: torch.Tensor | None = None,
    slot: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode into a new [rows, channels] tensor of ``dtype``."""
    dev = q.device
    out = torch.empty(rows, channels, dtype=dtype, device=dev)
    nseg = cp // seg if mode == SCALE_SEGMENT else 1
    n_out = values.shape[1] if values is not None else 0
    common = (
        scale,
        offset if offset is not None else _dummy(dev, torch.float32),
        slot if slot is not None else _dummy(dev),
        store_view(values) if values is not None else _dummy(dev, dtype),
        store_view(out),
        rows,
        channels,
        cp,
        nseg,
        n_out,
    )
    flags = {
        "SCALE_MODE": mode,
        "SEG": seg,
        "HAS_OFFSET": offset is not None,
        "HAS_OUT": slot is not None,
        "OUT_BF16": dtype == torch.bfloat16,
    }
    if cp % 2 == 0:
        block_h = min(pow2(cp // 2), 512)
        block_r = max(1, min(_common.TILE // (2 * block_h), pow2(rows)))
        grid = (cdiv(rows, block_r), cdiv(cp // 2, block_h))
        _dequant2d_kernel[grid](
            q,
            *common,
            **flags,
            BLOCK_R=block_r,
            BLOCK_H=block_h,
            num_warps=num_warps(2 * block_r * block_h),
            **NO_FMA,
        )
    else:
        block = min(pow2(rows * channels), _common.TILE)
        _dequant_flat_kernel[(cdiv(rows * channels, block),)](
            q,
            *common,
            rows * channels,
            **flags,
            BLOCK=block,
            num_warps=num_warps(block),
            **NO_FMA,
        )
    return out


def encode_segments(
    x: torch.Tensor,
    seg: int,
    *,
    asym: bool,
    cp: int,
    slot: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, scale [R, cp // seg], offset [R, 1] | None) of x [R, C] with statistics per segment.

    Even ``seg``: one fused pass. Odd ``seg``: a statistics pass, then the flat quantiser.
    """
    rows, _ = x.shape
    dev = x.device
    nseg = cp // seg
    q = torch.empty((rows * cp + 1) // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(rows, nseg, dtype=torch.float32, device=dev)
    offset = torch.empty(rows, nseg, dtype=torch.float32, device=dev) if asym else None
    fused = seg % 2 == 0
    launch_seg_encode(
        x,
        seg,
        nseg,
        asym=asym,
        q=q if fused else None,
        scale=scale,
        offset=offset,
        slot=slot,
        values=values,
    )
    if not fused:
        mode = SCALE_SEGMENT if nseg > 1 else SCALE_ROW
        launch_quant(x, q, scale, mode=mode, cp=cp, seg=seg, offset=offset, slot=slot)
    return q, scale, offset
