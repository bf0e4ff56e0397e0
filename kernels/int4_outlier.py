"""``int4_outlier`` kernels: outlier channels kept exact, the rest symmetric group INT4.

Encode, even ``group_size`` that fits a register tile (the usual case): three launches.

1. Pass 1 (one read of ``x``): every [rows, group] tile is quantised *as if there were no
   outliers* (absmax / 7, round, pack: bytes and scales written) and, in the same pass,
   per-row-block column sums of the finite ``|x|`` are written (a [row blocks, C] float32
   array, 1-2 % of the input size).
2. Selection (:mod:`.int4_select`, one launch over the channels): z-scores of the column sums,
   the outlier count, the fixed-size buffer (K slots, the K largest above the threshold,
   ascending, unused slots -1) and the channel -> slot map. No host sync: the payload size is
   fixed by K, never by the data.
3. Fix-up: one program per (row block, slot whose group holds outliers) re-reads that group,
   copies the outlier values out (gather, no transpose), zeroes them, and rewrites that group's
   bytes and scales; the programs of unused slots write their zero values. Extra traffic: the
   fraction of groups that hold outliers.

The selection sums in a different order from ``torch.sum`` (the reference), so a channel whose
z-score lies within float32 rounding of the threshold may be classified differently; given the
same channels, the payload is bit-identical (:func:`encode_with_idx` takes a selection).
Odd or very wide groups: column sums in their own pass, then the selection, then the segment
kernel with the selection (three launches; odd groups add the flat quantiser's pass).

The slot map (int8 / int16 / int32, the narrowest that holds K) is part of the payload: decode is
one pass, outlier channels reading their exact values through it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from ._common import (
    FEW_STAGES,
    Tuned,
    candidates,
    cdiv,
    check_rows_input,
    config,
    configs,
    group_layout,
    launch,
    pow2,
    rmax,
    size_class,
)
from ._triton import check_launchable
from .int4 import SCALE_ROW, SCALE_SEGMENT, encode_segments, launch_colpartial, launch_seg_encode
from .int4_decode import launch_dequant
from .int4_select import launch_select, workspace
from .selection import slot_dtype

# Pass 1 writes column sums for about max(COLSUM_MIN_BLOCKS, COLSUM_PROGRAMS / groups) row
# blocks (enough programs to fill a GPU; tests lower them to loop over rows on small inputs).
COLSUM_MIN_BLOCKS = 8
COLSUM_PROGRAMS = 1024


@triton.jit(do_not_specialize=["tune_key"])
def _slot_kernel(idx_ptr, slot_ptr, C, n, tune_key, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
    """slot[c] = j where idx[j] == c, else -1 (idx: n distinct channels)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.full([BLOCK_C], -1, dtype=tl.int32)
    for j0 in range(0, n, BLOCK_N):
        jj = j0 + tl.arange(0, BLOCK_N)
        ids = tl.load(idx_ptr + jj, mask=jj < n, other=-1)
        hit = cols[:, None] == ids[None, :]
        slot = tl.maximum(slot, rmax(tl.where(hit, jj[None, :], -1), 1))
    tl.store(slot_ptr + cols, slot.to(slot_ptr.dtype.element_ty), mask=cols < C)


def _slot_space(cols_p2: int, *, interpreted: bool) -> list[triton.Config]:
    """BLOCK_C channels per program, each comparing them with BLOCK_N (16) slots at a time."""
    legacy = config(4, BLOCK_C=min(cols_p2, 256), BLOCK_N=16)
    tiles = [{"BLOCK_C": n, "BLOCK_N": 16} for n in (64, 128, 256, 512) if n <= max(cols_p2, 64)]
    return configs(legacy, candidates(tiles, _compares, FEW_STAGES), interpreted=interpreted)


def _compares(c: triton.Config) -> int:
    return c.kwargs["BLOCK_C"] * c.kwargs["BLOCK_N"]


_SLOT = Tuned(_slot_kernel, _slot_space, elems=_compares)


def launch_slot(idx: torch.Tensor, channels: int) -> torch.Tensor:
    """Channel -> position in ``idx`` map (-1 for regular channels), in :func:`slot_dtype`."""
    slot = torch.empty(channels, dtype=slot_dtype(idx.numel()), device=idx.device)
    launch(
        _SLOT.tuner(pow2(channels)),
        lambda meta: (cdiv(channels, meta["BLOCK_C"]),),
        idx,
        slot,
        channels,
        idx.numel(),
        size_class(channels, idx.numel()),
    )
    return slot


def encode_with_idx(
    x: torch.Tensor, idx: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Payload (q, scale, values, slot) for a given ascending int32 outlier selection ``idx``."""
    rows, channels = check_rows_input(x)
    check_launchable(x.device)
    group, padded = group_layout(channels, group_size)
    n = idx.numel()
    values = x.new_empty((rows, n))
    slot = launch_slot(idx, channels) if n else idx.new_empty(0, dtype=torch.int8)
    kw = {"slot": slot, "values": values, "idx": idx} if n else {}
    q, scale, _ = encode_segments(x, group, asym=False, cp=padded, **kw)
    return q, scale, values, slot


def encode(
    x: torch.Tensor, group_size: int, zscore_threshold: float, capacity: int
) -> tuple[torch.Tensor, ...]:
    """x [R, C] -> (q, scale, outlier_values [R, capacity], outlier_idx int32 [capacity],
    count int32 0-dim, slot map [C] (empty when capacity is 0)) (see module doc)."""
    rows, channels = check_rows_input(x)
    check_launchable(x.device)
    dev = x.device
    group, padded = group_layout(channels, group_size)
    nseg = padded // group
    if channels < 2 or capacity == 0:
        q, scale, _ = encode_segments(x, group, asym=False, cp=padded)
        empty = torch.empty(0, dtype=torch.int32, device=dev)
        zero = torch.zeros((), dtype=torch.int32, device=dev)
        return q, scale, x.new_empty((rows, 0)), empty, zero, empty.view(torch.int8)
    fused = group % 2 == 0 and group <= _common.MAX_SEGMENT_WIDTH
    target_blocks = max(COLSUM_MIN_BLOCKS, cdiv(COLSUM_PROGRAMS, nseg))
    ws, counter = workspace(channels, dev)
    if fused:
        q = torch.empty((rows * padded + 1) // 2, dtype=torch.uint8, device=dev)
        scale = torch.empty(rows, nseg, dtype=torch.float32, device=dev)
        part = launch_seg_encode(
            x, group, nseg, asym=False, q=q, scale=scale, colsum_rows=target_blocks, counter=counter
        )
    else:
        part = launch_colpartial(x, reduce_sum=True, target_blocks=target_blocks, counter=counter)
    assert part is not None
    idx, count, slot = launch_select(part, ws, zscore_threshold, capacity, slot_dtype(capacity))
    values = x.new_empty((rows, capacity))  # every slot is written by the kernels
    kw = {"slot": slot, "values": values, "idx": idx}
    if fused:
        launch_seg_encode(x, group, nseg, asym=False, q=q, scale=scale, fixup=True, **kw)
    else:
        q, scale, _ = encode_segments(x, group, asym=False, cp=padded, **kw)
    return q, scale, values, idx, count, slot


def decode(
    q: torch.Tensor,
    scale: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    rows: int,
    channels: int,
    group_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`encode`: [rows, channels] of ``dtype``; outliers exact."""
    check_launchable(q.device)
    group, padded = group_layout(channels, group_size)
    n = values.shape[1]
    kw = {"slot": slot if n else None, "values": values if n else None, "out": out}
    if padded // group > 1:
        return launch_dequant(
            q, scale, rows, channels, dtype, mode=SCALE_SEGMENT, cp=padded, seg=group, **kw
        )
    return launch_dequant(q, scale, rows, channels, dtype, mode=SCALE_ROW, cp=padded, **kw)
