"""``int4_channel`` kernels: channel-wise symmetric INT4 (Q / K / V).

The per-channel scale ``max_rows |x| / 8`` needs every row before any element can be quantised,
so encode reads ``x`` twice: (1) per-row-block column maxima (many programs), (2) a tiny
finalise kernel reduces them (max is exact in any order) into the scale, (3) quantise + pack
(2-D tiles, or the flat quantiser for odd channel counts). Decode: one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    FEW_STAGES,
    Tuned,
    candidates,
    cdiv,
    check_rows_input,
    config,
    configs,
    flagged_scale,
    launch,
    pow2,
    sign_set,
    size_class,
    tile_elems,
    with_sign,
)
from ._triton import check_launchable
from .int4 import SCALE_CHANNEL, launch_colpartial, launch_quant
from .int4_decode import launch_dequant

# Column maxima over about max(COLMAX_MIN_BLOCKS, COLMAX_PROGRAMS / column blocks) row blocks
# (tests lower them to loop over rows on small inputs).
COLMAX_MIN_BLOCKS = 16
COLMAX_PROGRAMS = 1024


@triton.jit(do_not_specialize=["tune_key"])
def _colmax_scale_kernel(part_ptr, scale_ptr, nrb, C, tune_key, BLOCK_C: tl.constexpr):
    """scale[c] = max over the row blocks of |part[:, c]|, divided by 8 (by 6 and flagged when
    any partial carries the non-finite flag in its sign bit)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = cols < C
    acc = tl.full([BLOCK_C], 0, dtype=tl.float32)
    bad = tl.full([BLOCK_C], 0, dtype=tl.int32)
    ptrs = part_ptr + cols
    for _ in range(nrb):
        p = tl.load(ptrs, mask=m, other=0.0)
        ptrs += C  # 64-bit pointer steps: no int32 row offset
        acc = tl.maximum(acc, tl.abs(p))
        bad = tl.maximum(bad, sign_set(p).to(tl.int32))
    flag = bad > 0
    scale = flagged_scale(tl.math.div_rn(acc, tl.where(flag, 6.0, 8.0)), flag)
    tl.store(scale_ptr + cols, with_sign(scale, flag), mask=m)


def _scale_space(cols_p2: int, *, interpreted: bool) -> list[triton.Config]:
    """BLOCK_C columns per program, each looping over the row blocks (a max: any order)."""
    legacy = config(4, BLOCK_C=min(cols_p2, 1024))
    tiles = [{"BLOCK_C": n} for n in (256, 512, 1024) if n <= max(cols_p2, 256)]
    return configs(legacy, candidates(tiles, tile_elems, FEW_STAGES), interpreted=interpreted)


_COLMAX_SCALE = Tuned(_colmax_scale_kernel, _scale_space, elems=tile_elems)


def channel_scale(x: torch.Tensor) -> torch.Tensor:
    """float32 [C] scales of x [R, C] (passes 1 and 2)."""
    _, channels = x.shape
    col_blocks = cdiv(channels, min(pow2(channels), 128))
    target = max(COLMAX_MIN_BLOCKS, cdiv(COLMAX_PROGRAMS, col_blocks))
    part = launch_colpartial(x, reduce_sum=False, target_blocks=target)
    scale = torch.empty(channels, dtype=torch.float32, device=x.device)
    nrb = part.shape[0]
    launch(
        _COLMAX_SCALE.tuner(pow2(channels)),
        lambda meta: (cdiv(channels, meta["BLOCK_C"]),),
        part,
        scale,
        nrb,
        channels,
        size_class(nrb, channels),
    )
    return scale


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q uint8 [ceil(R * C / 2)], scale float32 [C])."""
    rows, channels = check_rows_input(x)
    check_launchable(x.device)
    scale = channel_scale(x)
    q = torch.empty((rows * channels + 1) // 2, dtype=torch.uint8, device=x.device)
    launch_quant(x, q, scale, mode=SCALE_CHANNEL, cp=channels)
    return q, scale


def decode(
    q: torch.Tensor,
    scale: torch.Tensor,
    rows: int,
    channels: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    check_launchable(q.device)
    return launch_dequant(q, scale, rows, channels, dtype, mode=SCALE_CHANNEL, cp=channels, out=out)
