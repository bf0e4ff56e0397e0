"""``int4_outlier``'s channel selection in one launch: z-scores, threshold, top-capacity,
ascending indices, count and the channel -> slot map.

Input: per-row-block column abs-sums ``part`` [nrb, C] (written by pass 1). Grid: one program
per ``BLOCK_C`` channels. Each program sums its columns over the row blocks into ``s`` and writes
its chunk's (sum, sum of squared deviations from the chunk mean); then it takes a ticket from a
counter (zeroed by pass 1). The program with the last ticket finishes alone, reading everything
in a fixed order (results never depend on which program arrives last):

1. mean and population std of ``s`` from the chunk statistics (Chan's pairwise combination),
   ``z = (s - mean) / std`` (``-inf`` everywhere when std is not > 0), ``count = #(z > t)``;
2. when ``count > capacity``: the capacity-th largest z by bisection over the order-preserving
   integer keys of the float32 bits (32 steps, each counting keys >= mid);
3. compaction in ascending channel order (exclusive cumulative sums): channels above the cut,
   then those equal to it by ascending index until the buffer is full; ``idx`` gets them in
   order and -1 in unused slots, ``slot[c]`` their position (-1 elsewhere).

This is the rule of :func:`adacc_kernels.selection.pick_outliers` (the torch reference): given
the same z-scores both select the same channels. The z-scores themselves sum in another order
than ``torch.sum`` (documented in :mod:`.int4_outlier`).

On GPUs the hand-over relies on the counter's acquire-release atomic (CTA barrier before it,
loads of the other programs' results bypass L1); programs never wait on each other, so the
interpreter (which runs programs one after another) executes the same code. Autotuning varies
only the pipelining depth (``BLOCK_C``, ``BLOCK_P`` and the warps fix the float sums' order) and
resets the counter before each of the tuner's runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    LOOP_STAGES,
    Tuned,
    cdiv,
    config,
    configs,
    cumsum,
    launch,
    pow2,
    rsum,
    size_class,
)

INT32_MIN = tl.constexpr(-2147483648)
KEY_ABOVE_INF = tl.constexpr(0x7F800001)  # key(+inf) + 1: no key reaches it


@triton.jit
def order_key(z):
    """int32 keys ordered like the float32 values ``z`` (NaN aside)."""
    u = z.to(tl.int32, bitcast=True)
    return u ^ ((u >> 31) & 0x7FFFFFFF)


@triton.jit
def _count_ge(key_ptr, C, bound, BLOCK_C: tl.constexpr):
    """Number of keys >= ``bound``."""
    offs = tl.arange(0, BLOCK_C)
    acc = tl.full([BLOCK_C], 0, dtype=tl.int32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + offs
        key = tl.load(key_ptr + cols, mask=cols < C, other=INT32_MIN, cache_modifier=".cg")
        acc += (key >= bound).to(tl.int32)
    return rsum(acc, 0)


@triton.jit
def _finish(
    s_ptr,
    key_ptr,
    stat_ptr,
    idx_ptr,
    count_ptr,
    slot_ptr,
    C,
    c_float,
    threshold,
    capacity,
    nprog,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """The last program: statistics, z-scores (their keys overwrite ``s``), cut, compaction."""
    pp = tl.arange(0, BLOCK_P)
    tot = tl.full([BLOCK_P], 0, dtype=tl.float32)
    for p0 in range(0, nprog, BLOCK_P):
        p = p0 + pp
        tot += tl.load(stat_ptr + 2 * p, mask=p < nprog, other=0.0, cache_modifier=".cg")
    mean = tl.math.div_rn(rsum(tot, 0), c_float)
    m2 = tl.full([BLOCK_P], 0, dtype=tl.float32)
    for p0 in range(0, nprog, BLOCK_P):
        p = p0 + pp
        pm = p < nprog
        t_p = tl.load(stat_ptr + 2 * p, mask=pm, other=0.0, cache_modifier=".cg")
        m2_p = tl.load(stat_ptr + 2 * p + 1, mask=pm, other=0.0, cache_modifier=".cg")
        n_p = tl.minimum(C - p * BLOCK_C, BLOCK_C).to(tl.float32)
        d = tl.math.div_rn(t_p, tl.where(pm, n_p, 1.0)) - mean
        m2 += tl.where(pm, m2_p + n_p * d * d, 0.0)
    std = tl.sqrt_rn(tl.math.div_rn(rsum(m2, 0), c_float))
    ok = std > 0.0
    safe_std = tl.where(ok, std, 1.0)
    offs = tl.arange(0, BLOCK_C)
    hot = tl.full([BLOCK_C], 0, dtype=tl.int32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + offs
        m = cols < C
        s = tl.load(s_ptr + cols, mask=m, other=0.0, cache_modifier=".cg")
        z = tl.where(ok, tl.math.div_rn(s - mean, safe_std), -float("inf"))
        hot += (m & (z > threshold)).to(tl.int32)
        tl.store(key_ptr + cols, order_key(z), mask=m)
    tl.debug_barrier()  # the keys are re-read by other threads of this program
    count = rsum(hot, 0)
    tl.store(count_ptr, count)
    # cut: channels with key > tau, then those with key == tau (ascending) while need > 0
    thr = threshold + tl.full([], 0, dtype=tl.float32)  # a python float in the interpreter
    tau = order_key(thr)
    need = tl.full([], 0, dtype=tl.int32)
    if count > capacity:
        lo = tau + 1  # count(key >= lo) = count >= capacity
        hi = tl.full([], KEY_ABOVE_INF, dtype=tl.int32)  # count(key >= hi) = 0 < capacity
        above = tl.full([], 0, dtype=tl.int32)  # count(key >= hi)
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            n_ge = _count_ge(key_ptr, C, mid, BLOCK_C)
            fits = n_ge >= capacity
            lo = tl.where(fits, mid, lo)
            above = tl.where(fits, above, n_ge)
            hi = tl.where(fits, hi, mid)
        tau = lo
        need = capacity - above
    taken = tl.full([], 0, dtype=tl.int32)
    ties = tl.full([], 0, dtype=tl.int32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + offs
        m = cols < C
        key = tl.load(key_ptr + cols, mask=m, other=INT32_MIN)
        tie = (key == tau).to(tl.int32)
        tie_rank = ties + cumsum(tie, 0) - tie
        sel = ((key > tau) | ((tie > 0) & (tie_rank < need))).to(tl.int32)
        pos = taken + cumsum(sel, 0) - sel
        tl.store(idx_ptr + pos, cols, mask=sel > 0)
        slot = tl.where(sel > 0, pos, -1)
        tl.store(slot_ptr + cols, slot.to(slot_ptr.dtype.element_ty), mask=m)
        ties += rsum(tie, 0)
        taken += rsum(sel, 0)
    for j0 in range(0, capacity, BLOCK_C):
        j = j0 + offs
        unused = (j >= taken) & (j < capacity)
        tl.store(idx_ptr + j, tl.full([BLOCK_C], -1, dtype=tl.int32), mask=unused)


@triton.jit(do_not_specialize=["tune_key"])
def _select_kernel(
    part_ptr,
    s_ptr,
    key_ptr,
    stat_ptr,
    counter_ptr,
    idx_ptr,
    count_ptr,
    slot_ptr,
    nrb,
    C,
    c_float,
    threshold,
    capacity,
    nprog,
    tune_key,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    m = cols < C
    s = tl.full([BLOCK_C], 0, dtype=tl.float32)
    ptrs = part_ptr + cols
    for _ in range(nrb):
        s += tl.load(ptrs, mask=m, other=0.0)
        ptrs += C  # 64-bit pointer steps: no int32 row offset
    tl.store(s_ptr + cols, s, mask=m)
    total = rsum(s, 0)
    mu = tl.math.div_rn(total, tl.minimum(C - pid * BLOCK_C, BLOCK_C).to(tl.float32))
    d = tl.where(m, s - mu, 0.0)
    tl.store(stat_ptr + 2 * pid, total)
    tl.store(stat_ptr + 2 * pid + 1, rsum(d * d, 0))
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if ticket == nprog - 1:
        _finish(
            s_ptr,
            key_ptr,
            stat_ptr,
            idx_ptr,
            count_ptr,
            slot_ptr,
            C,
            c_float,
            threshold,
            capacity,
            nprog,
            BLOCK_C,
            BLOCK_P,
        )


# Channels per selection program (tests lower it to run several programs on small inputs).
SELECT_BLOCK = 1024


def _space(block_c: int, nprog_p2: int, *, interpreted: bool) -> list[triton.Config]:
    """Only the pipelining depth is tuned: the tile and warps fix the order of the float sums
    behind the z-scores (results must not depend on the config), BLOCK_C the programs (and so
    the workspace's size)."""
    legacy = config(8 if block_c >= 1024 else 4, BLOCK_C=block_c, BLOCK_P=min(nprog_p2, 256))
    gpu = [config(legacy.num_warps, s, **legacy.kwargs) for s in LOOP_STAGES]
    return configs(legacy, gpu, interpreted=interpreted)


# The tuner reruns the kernel: each run must start with the counter at zero (pass 1 zeroes it
# once per encode), or no program would take the last ticket and finish.
_SELECT = Tuned(
    _select_kernel,
    _space,
    elems=lambda c: c.kwargs["BLOCK_C"],
    reset_to_zero=["counter_ptr"],
)


def workspace(channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 workspace of :func:`launch_select`, its counter: the last element, to be zeroed
    by the pass that writes the column sums)."""
    nprog = cdiv(channels, min(pow2(channels), SELECT_BLOCK))
    ws = torch.empty(channels + 2 * nprog + 1, dtype=torch.int32, device=device)
    return ws, ws[-1:]


def launch_select(
    part: torch.Tensor,
    ws: torch.Tensor,
    threshold: float,
    capacity: int,
    slot_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(idx int32 [capacity], count int32 0-dim, slot [C] of ``slot_dtype``) from column sums
    ``part`` [nrb, C]; ``ws`` from :func:`workspace` with its counter zeroed (its first C
    elements end up holding the z-scores' order keys)."""
    nrb, channels = part.shape
    dev = part.device
    block_c = min(pow2(channels), SELECT_BLOCK)
    nprog = cdiv(channels, block_c)
    idx = torch.empty(capacity, dtype=torch.int32, device=dev)
    count = torch.empty((), dtype=torch.int32, device=dev)
    slot = torch.empty(channels, dtype=slot_dtype, device=dev)
    launch(
        _SELECT.tuner(block_c, pow2(nprog)),
        (nprog,),
        part,
        ws[:channels].view(torch.float32),
        ws[:channels],
        ws[channels : channels + 2 * nprog].view(torch.float32),
        ws[-1:],
        idx,
        count,
        slot,
        nrb,
        channels,
        float(channels),
        float(threshold),
        capacity,
        nprog,
        size_class(nrb, channels),
    )
    return idx, count, slot
