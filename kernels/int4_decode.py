"""INT4 decode kernels shared by the four INT4 codecs, and their host launcher.

:func:`_dequant2d_kernel` (even padded width: 2-D tiles of whole bytes) and
:func:`_dequant_flat_kernel` (any width, walking the flat output) unpack, dequantise
(``q * |scale| (+ offset)``), restore the marker codes of flagged segments (inf / NaN, see
``adacc_hf.codecs.base``), scatter exact outlier values back into place and cast once: one read
of the payload, one write. Layouts and scale modes as in :mod:`.int4`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from ._common import (
    TILE_SIZES,
    Tuned,
    candidates,
    cast_out,
    cdiv,
    config,
    configs,
    int4_unmark,
    launch,
    num_warps,
    pow2,
    sign_set,
    size_class,
    store_view,
)
from .int4_quant import SCALE_SEGMENT, _dummy, _load_params


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
    """Output-dtype values of nibbles ``nib`` at (rows, cols): q * |scale| (+ offset), cast
    once; markers of flagged segments restored; outlier channels take their exact stored values
    instead."""
    scale, offset = _load_params(
        scale_ptr, offset_ptr, rows, cols, m, NSEG, SCALE_MODE, SEG, HAS_OFFSET
    )
    y = (nib - 8).to(tl.float32) * tl.abs(scale)
    if HAS_OFFSET:
        y = y + offset
    y = cast_out(int4_unmark(y, nib, sign_set(scale)), out_ptr, OUT_BF16)
    if HAS_OUT:
        slot = tl.load(slot_ptr + cols, mask=m, other=-1)
        is_out = slot >= 0
        raw = tl.load(values_ptr + rows.to(tl.int64) * n_out + slot, mask=m & is_out, other=0)
        y = tl.where(is_out, raw.to(y.dtype), y)
    return y


@triton.jit(do_not_specialize=["tune_key"])
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
    tune_key,
    SCALE_MODE: tl.constexpr,
    SEG: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_OUT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Decode a [BLOCK_R, 2 * BLOCK_H] tile of out [R, C] (CP even, bytes [R, CP // 2])."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < R
    hm = rmask[:, None] & (h < CP // 2)[None, :]
    byte = tl.load(q_ptr + rows[:, None] * (CP // 2) + h[None, :], mask=hm, other=0)
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
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], y, mask=m)


@triton.jit(do_not_specialize=["tune_key"])
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
    tune_key,
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


# -- host launcher ------------------------------------------------------------


def _codes(c: triton.Config) -> int:
    return 2 * c.kwargs["BLOCK_R"] * c.kwargs["BLOCK_H"]


def _space2d(rows_p2: int, half_p2: int, tile: int, *, interpreted: bool) -> list[triton.Config]:
    """[BLOCK_R, BLOCK_H] tiles of bytes (2 codes each), at most the payload's extent."""
    block_h = min(half_p2, 512)
    block_r = max(1, min(tile // (2 * block_h), rows_p2))
    legacy = config(num_warps(2 * block_r * block_h), BLOCK_R=block_r, BLOCK_H=block_h)
    tiles = [
        {"BLOCK_R": n // (2 * h), "BLOCK_H": h}
        for h in dict.fromkeys((block_h, min(block_h, 128)))
        for n in TILE_SIZES
        if 2 * h <= n and n // (2 * h) <= rows_p2
    ]
    return configs(legacy, candidates(tiles, _codes), interpreted=interpreted)


def _space_flat(elems_p2: int, tile: int, *, interpreted: bool) -> list[triton.Config]:
    """BLOCK output elements per program, no more than the output holds."""
    block = min(elems_p2, tile)
    legacy = config(num_warps(block), BLOCK=block)
    tiles = [{"BLOCK": n} for n in TILE_SIZES if n <= elems_p2]
    return configs(legacy, candidates(tiles, lambda c: c.kwargs["BLOCK"]), interpreted=interpreted)


_KEY = ["SCALE_MODE", "HAS_OFFSET", "HAS_OUT", "OUT_BF16"]
_DEQUANT2D = Tuned(_dequant2d_kernel, _space2d, elems=_codes, key=_KEY)
_DEQUANT_FLAT = Tuned(
    _dequant_flat_kernel, _space_flat, elems=lambda c: c.kwargs["BLOCK"], key=_KEY
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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode into ``out`` (a contiguous [rows, channels] tensor of ``dtype``), or a new one."""
    dev = q.device
    if out is None:
        out = torch.empty(rows, channels, dtype=dtype, device=dev)
    elif out.shape != (rows, channels) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{rows}, {channels}] {dtype} tensor")
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
        launch(
            _DEQUANT2D.tuner(pow2(rows), pow2(cp // 2), _common.TILE),
            lambda meta: (cdiv(rows, meta["BLOCK_R"]), cdiv(cp // 2, meta["BLOCK_H"])),
            q,
            *common,
            size_class(rows, cp),
            **flags,
        )
    else:
        n = rows * channels
        launch(
            _DEQUANT_FLAT.tuner(pow2(n), _common.TILE),
            lambda meta: (cdiv(n, meta["BLOCK"]),),
            q,
            *common,
            n,
            size_class(n),
            **flags,
        )
    return out
