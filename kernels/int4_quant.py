"""INT4 building blocks shared by the INT4 encoders: column reductions and quantisers with given
parameters (and the placeholders and parameter loads the decoders reuse).

* :func:`_colpartial_kernel` -- per-row-block column reductions (|x| max or sum, finite values).
* :func:`_quant2d_kernel` -- quantise + pack 2-D tiles of whole bytes (even widths).
* :func:`_quant_flat_kernel` -- quantise + pack walking the flat byte array (any width, also odd,
  so bytes may straddle rows); outlier channels quantise as 0.

Scales may be flagged (sign bit set, see ``adacc_hf.codecs.base``): their magnitude quantises
and non-finite elements get marker codes. Scale modes (``SCALE_MODE``): 0 per row, 1 per
channel, 2 per (row, segment of ``SEG`` channels).
"""

from __future__ import annotations

import functools

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
    is_finite,
    launch,
    num_warps,
    pack_nibbles,
    pow2,
    quantize_robust,
    rmax,
    rsum,
    size_class,
    tile_elems,
    with_sign,
)

SCALE_ROW, SCALE_CHANNEL, SCALE_SEGMENT = 0, 1, 2


@triton.jit(do_not_specialize=["tune_key"])
def _colpartial_kernel(
    x_ptr,
    part_ptr,
    counter_ptr,
    R,
    C,
    sxr,
    sxc,
    row_iters,
    tune_key,
    SUM: tl.constexpr,
    ZERO_COUNTER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """part[pid_r, c] = sum (SUM) or max of the finite |x[r, c]| over the program's rows; a max
    carries "the column holds inf / NaN" in its sign bit. ZERO_COUNTER: program (0, 0) zeroes
    the outlier selection's counter (:mod:`.int4_select`)."""
    pid_r = tl.program_id(0)
    if ZERO_COUNTER:  # noqa: SIM102 (Triton: constexpr and runtime conditions apart)
        if (pid_r == 0) & (tl.program_id(1) == 0):
            tl.store(counter_ptr, 0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    acc = tl.full([BLOCK_C], 0, dtype=tl.float32)
    bad = tl.full([BLOCK_C], 0, dtype=tl.int32)
    for it in range(row_iters):
        rows = (pid_r.to(tl.int64) * row_iters + it) * BLOCK_R + tl.arange(0, BLOCK_R)
        m = (rows < R)[:, None] & cmask[None, :]
        offs = rows[:, None] * sxr + cols[None, :].to(tl.int64) * sxc
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        x = x.to(tl.float32)
        fin = is_finite(x)
        a = tl.where(fin, tl.abs(x), 0.0)
        if SUM:
            acc += rsum(a, 0)
        else:
            acc = tl.maximum(acc, rmax(a, 0))
            bad = tl.maximum(bad, rmax((~fin).to(tl.int32), 0))
    if not SUM:
        acc = with_sign(acc, bad > 0)
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


@triton.jit(do_not_specialize=["tune_key"])
def _quant2d_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    offset_ptr,
    R,
    C,
    sxr,
    sxc,
    NSEG,
    tune_key,
    SCALE_MODE: tl.constexpr,
    SEG: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Quantise + pack with given per-row / per-channel / per-segment parameters (C even);
    scales may be flagged (sign bit): their magnitude quantises, markers for non-finite x."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    rmask = rows < R
    cmask = w < C
    m = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * sxr + w[None, :].to(tl.int64) * sxc
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    x = x.to(tl.float32)
    scale, offset = _load_params(
        scale_ptr, offset_ptr, rows[:, None], w[None, :], m, NSEG, SCALE_MODE, SEG, HAS_OFFSET
    )
    if HAS_OFFSET:
        x = x - offset
    q = quantize_robust(x, tl.abs(scale), is_finite(x))
    q_even, q_odd = tl.split(tl.reshape(q, [BLOCK_R, BLOCK_W // 2, 2]))
    h = tl.program_id(1) * (BLOCK_W // 2) + tl.arange(0, BLOCK_W // 2)
    offs = rows[:, None] * (C // 2) + h[None, :]
    tl.store(q_ptr + offs, pack_nibbles(q_even, q_odd), mask=rmask[:, None] & (2 * h < C)[None, :])


@triton.jit(do_not_specialize=["tune_key"])
def _quant_flat_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    offset_ptr,
    slot_ptr,
    R,
    C,
    sxr,
    sxc,
    CP,
    NSEG,
    n_codes,
    n_bytes,
    tune_key,
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
    x = tl.load(x_ptr + row * sxr + col * sxc, mask=m, other=0.0).to(tl.float32)
    if HAS_OUT:
        slot = tl.load(slot_ptr + col, mask=m, other=-1)
        x = tl.where(slot >= 0, 0.0, x)
    scale, offset = _load_params(
        scale_ptr, offset_ptr, row, col, inside, NSEG, SCALE_MODE, SEG, HAS_OFFSET
    )
    if HAS_OFFSET:
        x = x - offset
    q = tl.where(inside, quantize_robust(x, tl.abs(scale), is_finite(x)), 0)
    q_even, q_odd = tl.split(q)
    tl.store(q_ptr + b, pack_nibbles(q_even, q_odd), mask=b < n_bytes)


# -- host launchers ----------------------------------------------------------------------


@functools.cache
def _dummy_cached(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(1, dtype=dtype, device=device)


def _dummy(device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A placeholder for a pointer argument the launch's flags leave unused (never written)."""
    return _dummy_cached(device, dtype)


def _colpartial_space(
    rows_p2: int, cols_p2: int, reduce_sum: bool, tile: int, *, interpreted: bool
) -> list[triton.Config]:
    """[BLOCK_R, BLOCK_C] tiles. BLOCK_R stays the heuristic's (it sets the row blocks, so the
    partials' shape). Sums (they feed the outlier z-scores) keep the whole tile and warps too:
    a float sum's order follows the tile's layout, so only the pipelining depth is tuned; maxima
    are exact in any order, so their column width and warps are tuned."""
    block_c = min(cols_p2, 128)
    block_r = max(1, min(tile // block_c, rows_p2))
    legacy = config(num_warps(block_r * block_c), BLOCK_R=block_r, BLOCK_C=block_c)
    if reduce_sum:
        gpu = [config(legacy.num_warps, s, **legacy.kwargs) for s in LOOP_STAGES]
    else:
        tiles = [{"BLOCK_R": block_r, "BLOCK_C": c} for c in (32, 64, 128, 256) if c <= cols_p2]
        gpu = candidates(tiles, tile_elems, FEW_STAGES)
    return configs(legacy, gpu, interpreted=interpreted)


def _quant2d_space(
    rows_p2: int, cols_p2: int, tile: int, *, interpreted: bool
) -> list[triton.Config]:
    """[BLOCK_R, BLOCK_W] tiles of whole bytes (BLOCK_W even), at most the input's extent."""
    width = min(cols_p2, 1024)
    block_r = max(1, min(tile // width, rows_p2))
    legacy = config(num_warps(block_r * width), BLOCK_R=block_r, BLOCK_W=width)
    tiles = [
        {"BLOCK_R": n // w, "BLOCK_W": w}
        for w in dict.fromkeys((width, min(width, 256)))
        for n in TILE_SIZES
        if w <= n and n // w <= rows_p2
    ]
    return configs(legacy, candidates(tiles, tile_elems), interpreted=interpreted)


def _codes(c: triton.Config) -> int:
    return 2 * c.kwargs["BLOCK"]


def _flat_space(bytes_p2: int, tile: int, *, interpreted: bool) -> list[triton.Config]:
    """BLOCK bytes (2 codes each) per program, no more than the payload holds."""
    block = min(bytes_p2, tile // 2)
    legacy = config(num_warps(2 * block), BLOCK=block)
    tiles = [{"BLOCK": n // 2} for n in TILE_SIZES if n // 2 <= bytes_p2]
    return configs(legacy, candidates(tiles, _codes), interpreted=interpreted)


_COLPARTIAL = Tuned(
    _colpartial_kernel, _colpartial_space, elems=tile_elems, key=["SUM", "ZERO_COUNTER"]
)
_QUANT2D = Tuned(
    _quant2d_kernel, _quant2d_space, elems=tile_elems, key=["SCALE_MODE", "HAS_OFFSET"]
)
_QUANT_FLAT = Tuned(
    _quant_flat_kernel,
    _flat_space,
    elems=_codes,
    key=["SCALE_MODE", "HAS_OFFSET", "HAS_OUT"],
)


def launch_colpartial(
    x: torch.Tensor, *, reduce_sum: bool, target_blocks: int, counter: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-row-block column |x| sums or maxima [nrb, C] with about ``target_blocks`` blocks
    (``counter``, if given, is zeroed on the way)."""
    rows, channels = x.shape
    tuner = _COLPARTIAL.tuner(pow2(rows), pow2(channels), reduce_sum, _common.TILE)
    block_r = tuner.configs[0].kwargs["BLOCK_R"]  # the same in every config of the plan
    row_blocks = cdiv(rows, block_r)
    row_iters = cdiv(row_blocks, min(row_blocks, target_blocks))
    row_blocks = cdiv(row_blocks, row_iters)
    part = torch.empty(row_blocks, channels, dtype=torch.float32, device=x.device)
    launch(
        tuner,
        lambda meta: (row_blocks, cdiv(channels, meta["BLOCK_C"])),
        x,
        part,
        counter if counter is not None else _dummy(x.device),
        rows,
        channels,
        x.stride(0),
        x.stride(1),
        row_iters,
        size_class(rows, channels),
        SUM=reduce_sum,
        ZERO_COUNTER=counter is not None,
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
    offset_arg = offset if offset is not None else _dummy(dev, torch.float32)
    if cp == channels and channels % 2 == 0 and slot is None:
        launch(
            _QUANT2D.tuner(pow2(rows), pow2(channels), _common.TILE),
            lambda meta: (cdiv(rows, meta["BLOCK_R"]), cdiv(channels, meta["BLOCK_W"])),
            x,
            q,
            scale,
            offset_arg,
            rows,
            channels,
            x.stride(0),
            x.stride(1),
            nseg,
            size_class(rows, channels),
            SCALE_MODE=mode,
            SEG=seg,
            HAS_OFFSET=offset is not None,
        )
        return
    n_bytes = q.numel()
    launch(
        _QUANT_FLAT.tuner(pow2(n_bytes), _common.TILE),
        lambda meta: (cdiv(n_bytes, meta["BLOCK"]),),
        x,
        q,
        scale,
        offset_arg,
        slot if slot is not None else _dummy(dev),
        rows,
        channels,
        x.stride(0),
        x.stride(1),
        cp,
        nseg,
        rows * cp,
        n_bytes,
        size_class(n_bytes),
        SCALE_MODE=mode,
        SEG=seg,
        HAS_OFFSET=offset is not None,
        HAS_OUT=slot is not None,
    )
