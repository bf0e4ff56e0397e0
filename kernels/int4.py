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
* :func:`_quant2d_kernel`, :func:`_quant_flat_kernel` -- quantise + pack with given scales.
Decoding lives in :mod:`.int4_decode`. Non-finite elements (``adacc_hf.codecs.base``): every
statistic is taken over finite elements, a segment holding inf / NaN stores its scale with the
sign bit set (``absmax / 6``, asymmetric ``(max - min) / 12``) and marker codes for those
elements; the column reductions carry the same flag in the sign bit of their partial maxima.

Scale modes (``SCALE_MODE``): 0 per row, 1 per channel, 2 per (row, segment of ``SEG`` channels).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import _common
from ._common import (
    FEW_STAGES,
    LOOP_STAGES,
    TILE_SIZES,
    Tuned,
    candidates,
    cdiv,
    config,
    configs,
    launch,
    num_warps,
    pow2,
    rsum,
    size_class,
    tile_elems,
    with_sign,
)
from .int4_quant import (
    SCALE_CHANNEL,
    SCALE_ROW,
    SCALE_SEGMENT,
    _dummy,
    launch_colpartial,
    launch_quant,
)
from .int4_tiles import _load_seg_tile, _quant_pack_store, _seg_params, _tile_stats, _zero_unused

__all__ = [
    "SCALE_CHANNEL",
    "SCALE_ROW",
    "SCALE_SEGMENT",
    "encode_segments",
    "launch_colpartial",
    "launch_quant",
    "launch_seg_encode",
]


# -- device code -------------------------------------------------------------------------


@triton.jit(do_not_specialize=["tune_key"])
def _seg_encode_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    offset_ptr,
    colsum_ptr,
    counter_ptr,
    slot_ptr,
    values_ptr,
    idx_ptr,
    R,
    C,
    sxr,
    sxc,
    SEG,
    NSEG,
    n_out,
    row_iters,
    nchunk,
    tune_key,
    DIVISOR: tl.constexpr,
    ASYM: tl.constexpr,
    WRITE_Q: tl.constexpr,
    COLSUM: tl.constexpr,
    HAS_OUT: tl.constexpr,
    WRITE_VALUES: tl.constexpr,
    FIXUP: tl.constexpr,
    SINGLE_CHUNK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid (row blocks, segments); FIXUP: (row blocks, outlier slots), one program per segment
    that holds outliers (the first outlier of each such segment does the work; a program of an
    unused slot, index -1, zeroes that slot's values and returns). WRITE_VALUES without FIXUP:
    the programs of segment 0 zero the values of every unused slot. COLSUM: program (0, 0) also
    zeroes the selection's counter (:mod:`.int4_select`)."""
    pid_r = tl.program_id(0)
    if FIXUP:
        j = tl.program_id(1)
        channel = tl.load(idx_ptr + j)
        if channel < 0:  # an unused slot of the fixed-size outlier buffer
            for it in range(row_iters):
                rows = (pid_r.to(tl.int64) * row_iters + it) * BLOCK_R + tl.arange(0, BLOCK_R)
                _zero_unused(values_ptr, idx_ptr, rows, rows < R, n_out, j, 1, BLOCK_K)
            return
        seg = channel // SEG
        prev = tl.load(idx_ptr + tl.maximum(j - 1, 0)) // SEG
        if (j > 0) & (prev == seg):
            return
    else:
        seg = tl.program_id(1)
        if WRITE_VALUES:  # noqa: SIM102 (Triton: constexpr and runtime conditions apart)
            if seg == 0:
                for it in range(row_iters):
                    rows = (pid_r.to(tl.int64) * row_iters + it) * BLOCK_R + tl.arange(0, BLOCK_R)
                    _zero_unused(values_ptr, idx_ptr, rows, rows < R, n_out, 0, n_out, BLOCK_K)
    if COLSUM:  # noqa: SIM102 (Triton: constexpr and runtime conditions apart)
        if (pid_r == 0) & (seg == 0):
            tl.store(counter_ptr, 0)
    seg_start = seg * SEG
    half_cp = (NSEG * SEG) // 2
    w = tl.arange(0, BLOCK_W)
    colacc = tl.full([BLOCK_W], 0, dtype=tl.float32)
    for it in range(row_iters):
        rows = (pid_r.to(tl.int64) * row_iters + it) * BLOCK_R + tl.arange(0, BLOCK_R)
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
                sxr,
                sxc,
                slot_ptr,
                values_ptr,
                n_out,
                HAS_OUT,
                WRITE_VALUES,
            )
            if COLSUM:
                colacc += rsum(absx, 0)
            amax, mx, mn, bad, anyf = _tile_stats(x, rmask[:, None] & cmask[None, :])
            scale, offset, flag = _seg_params(amax, mx, mn, bad, anyf, rmask, DIVISOR, ASYM)
        else:
            # Segment wider than a register tile: statistics over chunks, then a second,
            # cache-hot read of the same chunks to quantise.
            amax = tl.full([BLOCK_R], 0, dtype=tl.float32)
            mx = tl.full([BLOCK_R], -float("inf"), dtype=tl.float32)
            mn = tl.full([BLOCK_R], float("inf"), dtype=tl.float32)
            bad = tl.full([BLOCK_R], 0, dtype=tl.int32)
            anyf = tl.full([BLOCK_R], 0, dtype=tl.int32)
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
                    sxr,
                    sxc,
                    slot_ptr,
                    values_ptr,
                    n_out,
                    HAS_OUT,
                    WRITE_VALUES,
                )
                a_c, mx_c, mn_c, bad_c, anyf_c = _tile_stats(x, rmask[:, None] & cmask[None, :])
                amax = tl.maximum(amax, a_c)
                mx = tl.maximum(mx, mx_c)
                mn = tl.minimum(mn, mn_c)
                bad = tl.maximum(bad, bad_c)
                anyf = tl.maximum(anyf, anyf_c)
            scale, offset, flag = _seg_params(amax, mx, mn, bad, anyf, rmask, DIVISOR, ASYM)
        soffs = rows * NSEG + seg
        tl.store(scale_ptr + soffs, with_sign(scale, flag), mask=rmask)
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
                        sxr,
                        sxc,
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


# -- host launchers ----------------------------------------------------------------------


def _seg_space(
    rows_p2: int, width: int, chunked: bool, colsum: bool, tile: int, *, interpreted: bool
) -> list[triton.Config]:
    """[BLOCK_R, BLOCK_W] tiles; BLOCK_W is fixed by the segment (a tile holds a whole segment or
    a chunk of the widest width), so the rows per program are tuned. Column sums (pass 1 of
    int4_outlier) keep tile and warps: they feed the z-scores in an order that follows the
    tile's layout, and their row blocks set the partials' shape."""
    block_r = max(1, min(tile // width, rows_p2))
    legacy = config(num_warps(block_r * width), BLOCK_R=block_r, BLOCK_W=width)
    if colsum:
        gpu = [config(legacy.num_warps, s, **legacy.kwargs) for s in LOOP_STAGES]
    else:
        rows = {max(1, n // width) for n in TILE_SIZES}
        tiles = [{"BLOCK_R": r, "BLOCK_W": width} for r in sorted(rows) if r <= rows_p2]
        gpu = candidates(tiles, tile_elems, LOOP_STAGES if chunked else FEW_STAGES)
    return configs(legacy, gpu, interpreted=interpreted)


_SEG_ENCODE = Tuned(
    _seg_encode_kernel,
    _seg_space,
    elems=tile_elems,
    key=["ASYM", "WRITE_Q", "COLSUM", "HAS_OUT", "WRITE_VALUES", "FIXUP", "SINGLE_CHUNK"],
)


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
    counter: torch.Tensor | None = None,
    slot: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    idx: torch.Tensor | None = None,
    fixup: bool = False,
) -> torch.Tensor | None:
    """Run :func:`_seg_encode_kernel` over x [R, C] in segments of ``seg`` channels.

    ``q`` given: quantised codes are written (needs ``seg`` even). ``colsum_rows > 0``: also
    returns per-row-block column abs-sums [nrb, C] with about ``colsum_rows`` row blocks (and
    zeroes ``counter``). ``slot``: outlier channels (``slot >= 0``) are zeroed; with ``values``
    and ``idx`` (the outlier buffer) they are copied into ``values`` and its unused slots get
    zeros. ``fixup``: only the segments holding the (sorted) channels of ``idx`` are processed.
    """
    rows, channels = x.shape
    width = min(pow2(max(seg, 2)), _common.MAX_SEGMENT_WIDTH)  # a segment, or its chunks
    nchunk = cdiv(seg, width)
    colsum = None
    if colsum_rows and nchunk != 1:
        raise ValueError("fused column sums need segments that fit one register tile")
    tuner = _SEG_ENCODE.tuner(pow2(rows), width, nchunk > 1, colsum_rows > 0, _common.TILE)
    cols = idx.numel() if fixup and idx is not None else nseg
    row_iters = 1
    grid: Any = lambda meta: (cdiv(rows, meta["BLOCK_R"]), cols)  # noqa: E731
    if colsum_rows:  # BLOCK_R is the same in every config of this plan
        row_blocks = cdiv(rows, tuner.configs[0].kwargs["BLOCK_R"])
        row_iters = cdiv(row_blocks, min(row_blocks, colsum_rows))
        row_blocks = cdiv(row_blocks, row_iters)
        colsum = torch.empty(row_blocks, channels, dtype=torch.float32, device=x.device)
        grid = (row_blocks, cols)
    if q is not None and seg % 2:
        raise ValueError("fused packing needs an even segment (use the flat quantiser)")
    if (values is not None or fixup) and idx is None:
        raise ValueError("outlier values and the fix-up need the outlier buffer idx")
    dev = x.device
    n_out = values.shape[1] if values is not None else 0
    launch(
        tuner,
        grid,
        x,
        q if q is not None else _dummy(dev, torch.uint8),
        scale,
        offset if offset is not None else _dummy(dev, torch.float32),
        colsum if colsum is not None else _dummy(dev, torch.float32),
        counter if counter is not None else _dummy(dev),
        slot if slot is not None else _dummy(dev),
        values if values is not None else _dummy(dev, x.dtype),
        idx if idx is not None else _dummy(dev),
        rows,
        channels,
        x.stride(0),
        x.stride(1),
        seg,
        nseg,
        n_out,
        row_iters,
        nchunk,
        size_class(rows, seg, cols),
        DIVISOR=float(divisor),
        ASYM=asym,
        WRITE_Q=q is not None,
        COLSUM=colsum is not None,
        HAS_OUT=slot is not None,
        WRITE_VALUES=values is not None,
        FIXUP=fixup,
        SINGLE_CHUNK=nchunk == 1,
        BLOCK_K=min(pow2(n_out), 64),
    )
    return colsum


def encode_segments(
    x: torch.Tensor,
    seg: int,
    *,
    asym: bool,
    cp: int,
    slot: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    idx: torch.Tensor | None = None,
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
        idx=idx,
    )
    if not fused:
        mode = SCALE_SEGMENT if nseg > 1 else SCALE_ROW
        launch_quant(x, q, scale, mode=mode, cp=cp, seg=seg, offset=offset, slot=slot)
    return q, scale, offset
