"""``int4_outlier`` kernels: outlier channels kept exact, the rest symmetric group INT4.

What runs where (encode, even ``group_size`` that fits a register tile -- the usual case):

1. Pass 1 (Triton, one read of ``x``): every [rows, group] tile is quantised *as if there were
   no outliers* (absmax / 7, round, pack: bytes and scales written) and, in the same pass,
   per-row-block column sums of the finite ``|x|`` are written (a [row blocks, C] float32
   array, 1-2 % of the input size).
2. Selection: one Triton program reduces the column sums ``s`` (fixed order) into population
   mean / std and ``z = (s - mean) / std``; :func:`adacc_kernels.selection.pick_outliers` (a
   top-k in torch, shared with the reference) fills the fixed-size outlier buffer (K slots,
   ascending, unused slots -1) and a Triton kernel builds the channel -> slot map. No host sync:
   the payload size is fixed by K, never by the data.
3. Fix-up (Triton): one program per (row block, slot whose group holds outliers; unused slots
   return at once) re-reads that group, copies the outlier values out (gather, no transpose),
   zeroes them, and rewrites that group's bytes and scales. Extra traffic: the fraction of
   groups that hold outliers.

The selection sums in a different order from ``torch.sum`` (the reference), so a channel whose
z-score lies within float32 rounding of the threshold may be classified differently; given the
same channels, the payload is bit-identical (:func:`encode_with_idx` takes a selection).
Odd or very wide groups: column sums in their own pass, then the segment kernel with the
selection (and the flat quantiser for odd groups).

Decode: one pass; outlier channels read their exact values through the slot map.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from ._common import NO_FMA, cdiv, check_rows_input, group_layout, pow2, rmax, rsum
from ._triton import check_launchable
from .int4 import SCALE_ROW, SCALE_SEGMENT, encode_segments, launch_colpartial, launch_seg_encode
from .int4_decode import launch_dequant
from .selection import pick_outliers


@triton.jit
def _zscore_kernel(part_ptr, s_ptr, z_ptr, nrb, C, c_float, BLOCK_C: tl.constexpr):
    """One program: s = column sums of part [nrb, C]; z = (s - mean) / std (-inf if std == 0)."""
    offs = tl.arange(0, BLOCK_C)
    total = tl.full([BLOCK_C], 0, dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + offs
        m = cols < C
        s = tl.full([BLOCK_C], 0, dtype=tl.float32)
        for rb in range(nrb):
            s += tl.load(part_ptr + rb * C + cols, mask=m, other=0.0)
        tl.store(s_ptr + cols, s, mask=m)
        total += s
    tl.debug_barrier()
    n = c_float  # float(C), from the host
    mean = tl.math.div_rn(rsum(total, 0), n)
    sq = tl.full([BLOCK_C], 0, dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + offs
        m = cols < C
        d = tl.where(m, tl.load(s_ptr + cols, mask=m, other=0.0) - mean, 0.0)
        sq += d * d
    std = tl.sqrt_rn(tl.math.div_rn(rsum(sq, 0), n))
    ok = std > 0.0
    safe_std = tl.where(ok, std, 1.0)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + offs
        m = cols < C
        z = tl.math.div_rn(tl.load(s_ptr + cols, mask=m, other=0.0) - mean, safe_std)
        tl.store(z_ptr + cols, tl.where(ok, z, -float("inf")), mask=m)


@triton.jit
def _slot_kernel(idx_ptr, slot_ptr, C, n, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
    """slot[c] = j where idx[j] == c, else -1 (idx: n distinct channels)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.full([BLOCK_C], -1, dtype=tl.int32)
    for j0 in range(0, n, BLOCK_N):
        jj = j0 + tl.arange(0, BLOCK_N)
        ids = tl.load(idx_ptr + jj, mask=jj < n, other=-1)
        hit = cols[:, None] == ids[None, :]
        slot = tl.maximum(slot, rmax(tl.where(hit, jj[None, :], -1), 1))
    tl.store(slot_ptr + cols, slot, mask=cols < C)


def launch_zscores(colsum_part: torch.Tensor) -> torch.Tensor:
    """float32 [C] channel z-scores from per-row-block column sums [nrb, C]."""
    nrb, channels = colsum_part.shape
    dev = colsum_part.device
    s = torch.empty(channels, dtype=torch.float32, device=dev)
    z = torch.empty(channels, dtype=torch.float32, device=dev)
    _zscore_kernel[(1,)](
        colsum_part,
        s,
        z,
        nrb,
        channels,
        float(channels),
        BLOCK_C=min(pow2(channels), 1024),
        num_warps=8,
        **NO_FMA,
    )
    return z


def launch_slot(idx: torch.Tensor, channels: int) -> torch.Tensor:
    """Channel -> position in ``idx`` map (-1 for regular channels)."""
    slot = torch.empty(channels, dtype=torch.int32, device=idx.device)
    block_c = min(pow2(channels), 256)
    _slot_kernel[(cdiv(channels, block_c),)](
        idx, slot, channels, idx.numel(), BLOCK_C=block_c, BLOCK_N=16, **NO_FMA
    )
    return slot


def encode_with_idx(
    x: torch.Tensor, idx: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Payload (q, scale, values) for a given ascending int32 outlier selection ``idx``."""
    rows, channels = check_rows_input(x)
    check_launchable(x.device)
    group, padded = group_layout(channels, group_size)
    n = idx.numel()
    values = x.new_zeros((rows, n))  # unused slots (index -1) stay 0
    slot = launch_slot(idx, channels) if n else None
    q, scale, _ = encode_segments(
        x, group, asym=False, cp=padded, slot=slot, values=values if n else None
    )
    return q, scale, values


def encode(
    x: torch.Tensor, group_size: int, zscore_threshold: float, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q, scale, outlier_values [R, capacity], outlier_idx int32 [capacity],
    count int32 0-dim) (see module doc)."""
    rows, channels = check_rows_input(x)
    check_launchable(x.device)
    dev = x.device
    group, padded = group_layout(channels, group_size)
    nseg = padded // group
    if channels < 2 or capacity == 0:
        q, scale, _ = encode_segments(x, group, asym=False, cp=padded)
        empty = torch.empty(0, dtype=torch.int32, device=dev)
        zero = torch.zeros((), dtype=torch.int32, device=dev)
        return q, scale, x.new_zeros((rows, 0)), empty, zero
    fused = group % 2 == 0 and group <= _common.MAX_SEGMENT_WIDTH
    target_blocks = max(8, cdiv(1024, nseg))
    if fused:
        q = torch.empty((rows * padded + 1) // 2, dtype=torch.uint8, device=dev)
        scale = torch.empty(rows, nseg, dtype=torch.float32, device=dev)
        part = launch_seg_encode(
            x, group, nseg, asym=False, q=q, scale=scale, colsum_rows=target_blocks
        )
    else:
        part = launch_colpartial(x, reduce_sum=True, target_blocks=target_blocks)
    assert part is not None
    idx, count = pick_outliers(launch_zscores(part), zscore_threshold, capacity)
    slot = launch_slot(idx, channels)
    values = x.new_zeros((rows, capacity))
    if fused:
        launch_seg_encode(
            x, group, nseg, asym=False, q=q, scale=scale, slot=slot, values=values, fixup_idx=idx
        )
    else:
        q, scale, _ = encode_segments(x, group, asym=False, cp=padded, slot=slot, values=values)
    return q, scale, values, idx, count


def decode(
    q: torch.Tensor,
    scale: torch.Tensor,
    values: torch.Tensor,
    idx: torch.Tensor,
    rows: int,
    channels: int,
    group_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`encode`: [rows, channels] of ``dtype``; outliers exact."""
    check_launchable(q.device)
    group, padded = group_layout(channels, group_size)
    n = idx.numel()
    slot = launch_slot(idx, channels) if n else None
    kw = {"slot": slot, "values": values if n else None, "out": out}
    if padded // group > 1:
        return launch_dequant(
            q, scale, rows, channels, dtype, mode=SCALE_SEGMENT, cp=padded, seg=group, **kw
        )
    return launch_dequant(q, scale, rows, channels, dtype, mode=SCALE_ROW, cp=padded, **kw)
