"""``fp8_e4m3`` kernels: FP8 (e4m3fn) with one float32 scale per block of 128 channels.

Encode: one fused pass; each program loads a [rows, 128] tile, ``scale = absmax / 448``,
``y = clamp(x / scale, -448, 448)`` rounded to e4m3fn (nearest even, subnormals included) and
writes the codes and scales. Decode: one pass, ``code -> float32`` (exact) ``* scale``, one
cast. The e4m3 conversions are done with integer bit arithmetic (the same rules as
``torch.Tensor.to(torch.float8_e4m3fn)`` for in-range values), so the kernels need no FP8
hardware: they are bit-identical to the torch reference on any GPU and in Triton's interpreter.
Non-finite elements (``adacc_hf.codecs.base``): a block holding inf / NaN takes its absmax over
finite values, divides by 224 and stores its scale with the sign bit set; its inf / NaN
elements become the codes of -448 / +448 / NaN, which decode restores.
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
    check_rows_input,
    config,
    configs,
    flagged_scale,
    is_finite,
    launch,
    num_warps,
    pow2,
    rmax,
    round_half_even,
    sign_set,
    size_class,
    tile_elems,
    with_sign,
)
from ._common import store_view as _store_view
from ._triton import check_launchable

BLOCK = 128
FP8_MAX = 448.0


@triton.jit
def f32_to_e4m3_bits(y):
    """float32 ``|y| <= 448`` -> e4m3fn byte, round to nearest even (torch's conversion)."""
    u = y.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # |y| < 2**-6: subnormal codes m * 2**-9 (m = 8 is the smallest normal, code 0x08).
    sub = round_half_even(a.to(tl.float32, bitcast=True) * 512.0).to(tl.uint32)
    # normal: round the mantissa to 3 bits (carry may bump the exponent), rebias 127 -> 7.
    nrm = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    code = tl.where(a < (121 << 23), sub, nrm)
    return (code | sign).to(tl.uint8)


@triton.jit
def e4m3_bits_to_f32(c):
    """e4m3fn byte (as int32) -> float32, exact (0x7F / 0xFF: NaN)."""
    e = (c >> 3) & 15
    m = c & 7
    sub = m.to(tl.float32) * 0.001953125
    nrm = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, sub, nrm)
    v = tl.where((c & 0x7F) == 0x7F, float("nan"), v)
    # the sign as a bit: Triton compiles ``-v`` as ``0 - v``, which is +0.0 for code 0x80 on a
    # GPU (the interpreter negates, so only a GPU run showed it)
    return with_sign(v, (c & 0x80) != 0)


@triton.jit(do_not_specialize=["tune_key"])
def _fp8_encode_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    R,
    C,
    sxr,
    sxc,
    NB,
    tune_key,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < R
    m = rmask[:, None] & (cols < C)[None, :]
    xoffs = rows[:, None] * sxr + cols[None, :].to(tl.int64) * sxc
    x = tl.load(x_ptr + xoffs, mask=m, other=0.0).to(tl.float32)
    offs = rows[:, None] * C + cols[None, :]
    fin = is_finite(x)
    xs = tl.where(fin, x, 0.0)
    flag = rmax((~fin).to(tl.int32), 1) > 0
    scale = tl.math.div_rn(rmax(tl.abs(xs), 1), tl.where(flag, 224.0, 448.0))
    scale = flagged_scale(scale, flag)
    soffs = rows * NB + tl.program_id(1)
    tl.store(scale_ptr + soffs, with_sign(scale, flag), mask=rmask)
    zero = (scale == 0.0)[:, None]
    y = tl.math.div_rn(xs, tl.where(zero, 1.0, scale[:, None]))
    y = tl.where(zero, 0.0, y)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    marks = tl.where(x != x, 0x7F, tl.where(x > 0.0, 0x7E, 0xFE)).to(tl.uint8)
    tl.store(q_ptr + offs, tl.where(fin, f32_to_e4m3_bits(y), marks), mask=m)


@triton.jit(do_not_specialize=["tune_key"])
def _fp8_decode_kernel(
    q_ptr,
    scale_ptr,
    out_ptr,
    R,
    C,
    NB,
    tune_key,
    OUT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < R
    m = rmask[:, None] & (cols < C)[None, :]
    offs = rows[:, None] * C + cols[None, :]
    code = tl.load(q_ptr + offs, mask=m, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + rows * NB + tl.program_id(1), mask=rmask, other=0.0)
    v = e4m3_bits_to_f32(code)
    y = v * tl.abs(scale)[:, None]
    flagged = sign_set(scale)[:, None]
    y = tl.where(flagged & (v == 448.0), float("inf"), y)
    y = tl.where(flagged & (v == -448.0), -float("inf"), y)
    tl.store(out_ptr + offs, cast_out(y, out_ptr, OUT_BF16), mask=m)


def _space(rows_p2: int, tile: int, *, interpreted: bool) -> list[triton.Config]:
    """[BLOCK_R, 128] tiles (one scale block per row and program), BLOCK_R <= the rows."""
    block_r = max(1, min(tile // BLOCK, rows_p2))
    legacy = config(num_warps(block_r * BLOCK), BLOCK_R=block_r, BLOCK_C=BLOCK)
    tiles = [{"BLOCK_R": n // BLOCK, "BLOCK_C": BLOCK} for n in TILE_SIZES if n // BLOCK <= rows_p2]
    return configs(legacy, candidates(tiles, tile_elems), interpreted=interpreted)


_ENCODE = Tuned(_fp8_encode_kernel, _space, elems=tile_elems)
_DECODE = Tuned(_fp8_decode_kernel, _space, elems=tile_elems, key=["OUT_BF16"])


def _grid(rows: int, nb: int):
    return lambda meta: (cdiv(rows, meta["BLOCK_R"]), nb)


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q float8_e4m3fn [R, C], scale float32 [R, ceil(C / 128)])."""
    rows, channels = check_rows_input(x)
    check_launchable(x.device)
    nb = cdiv(channels, BLOCK)
    q = torch.empty(rows, channels, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, nb, dtype=torch.float32, device=x.device)
    launch(
        _ENCODE.tuner(pow2(rows), _common.TILE),
        _grid(rows, nb),
        x,
        q.view(torch.uint8),
        scale,
        rows,
        channels,
        x.stride(0),
        x.stride(1),
        nb,
        size_class(rows, nb),
    )
    return q, scale


def decode(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`encode`: [R, C] of ``dtype`` (into ``out``, contiguous, when given)."""
    check_launchable(q.device)
    rows, channels = q.shape
    nb = scale.shape[1]
    if out is None:
        out = torch.empty(rows, channels, dtype=dtype, device=q.device)
    launch(
        _DECODE.tuner(pow2(rows), _common.TILE),
        _grid(rows, nb),
        q.view(torch.uint8),
        scale,
        _store_view(out),
        rows,
        channels,
        nb,
        size_class(rows, nb),
        OUT_BF16=dtype == torch.bfloat16,
    )
    return out
