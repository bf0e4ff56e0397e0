"""A later bucket's memory from two measured ones, without running the model (issue 32).

Every byte a training step holds or allocates above its start is either the same at every batch
shape (parameter gradients, autocast's weight casts, checkpoint frames) or an activation whose
size grows with the batch: tokens x width (hidden states, projections, logits), or faster
(attention's scores and masks: rows x length^2). Every level and peak the memory pass measures is
the highest of such sums over the step's moments. Two measured profiles of the same model at
nested shapes -- a *low* bucket the new one contains (the largest measured; at least the *tiny*
bucket, one row of 8 tokens: the constants and almost nothing else) and a *near* one that contains
the new bucket in every dimension -- give each field at the new bucket by the chord between them,
at the new bucket's share of the way in tokens (`ratio`).

That chord never under-counts: each moment's level is a constant plus terms that grow at least as
fast as tokens between the two shapes, so the chord lies on or above it, and the chord of the
highest of several moments lies on or above the highest of their chords. It is exact where
activations scale with tokens (SDPA, the model's LM head), and over-counts attention's quadratic
parts by their share of the difference (`chord_excess` counts it from the traced ops: where it is
more than a small share of the bucket's step, the session measures the bucket instead). On CUDA
the session checks the bucket's first real step against the prediction and profiles the bucket
in full where the step allocated more (`engine.guard.DerivedCheck`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import fields

from ..schema import GroupProfile, HeadCost, Profile, Timeline
from .compiled import compiled_costs

__all__ = [
    "GROUP_BYTES",
    "PROFILE_BYTES",
    "chord_excess",
    "contains",
    "group_ratio",
    "interpolate_memory",
    "length_share",
    "ratio",
]

#: `GroupProfile` fields that are bytes measured by the memory pass.
GROUP_BYTES = (
    "input_nbytes",
    "full_nbytes",
    "transient_nbytes",
    "plain_transient_nbytes",
    "output_nbytes",
    "forward_transient_nbytes",
    "plain_forward_transient_nbytes",
    "full_interior_nbytes",
    "plain_cast_nbytes",
)
#: `Profile` fields that are bytes measured by the memory pass.
PROFILE_BYTES = (
    "nonblock_nbytes",
    "nonblock_before_nbytes",
    "head_transient_nbytes",
    "forward_transient_nbytes",
    "tail_transient_nbytes",
)


def contains(outer: Sequence[int], inner: Sequence[int]) -> bool:
    """Whether a batch of shape `outer` (rows, then each sequence length) is at least `inner` in
    every dimension."""
    return len(outer) == len(inner) and all(o >= i for o, i in zip(outer, inner, strict=True))


def _share(lo: int, hi: int, at: int) -> float:
    return 1.0 if hi <= lo else (at - lo) / (hi - lo)


def ratio(low: Sequence[int], near: Sequence[int], new: Sequence[int]) -> float:
    """How far `new` lies from `low` towards `near` (shapes: rows, then each sequence length):
    the largest over the sequences of the share moved in rows x length (a term of any one
    sequence is covered: an encoder-decoder batch whose decoder shrank more than its encoder) and
    in length alone (tensors of one row broadcast over the batch: rotary tables, T5's position
    bias; the larger share where a bucket has fewer rows than the near one)."""
    out = 0.0
    for k in range(1, len(new)):
        out = max(
            out,
            _share(low[0] * low[k], near[0] * near[k], new[0] * new[k]),
            _share(low[k], near[k], new[k]),
        )
    return min(1.0, max(0.0, out))


def length_share(low: Sequence[int], near: Sequence[int], new: Sequence[int]) -> float:
    """The largest share moved in length alone (`ratio`'s second term)."""
    return max((_share(low[k], near[k], new[k]) for k in range(1, len(new))), default=0.0)


#: Added to every interpolated byte count: terms per row rather than per token (a row's loss and
#: length) that the token chord can miss (measured: at most 85 bytes on SmolLM2).
SLACK = 4096


def _lerp(lo: int, hi: int, r: float) -> int:
    """The chord from `lo` to `hi` at `r`, rounded up, plus `SLACK`; a field that did not grow
    with the batch (measured less at the larger shape) keeps the larger of the two. Zero stays
    zero (a field not measured)."""
    if hi == 0:
        return 0
    if hi < lo:
        return lo + SLACK
    return lo + math.ceil((hi - lo) * r) + SLACK


def _lerp_list(lo: list[int], hi: list[int], r: float) -> list[int]:
    if len(lo) != len(hi):
        return list(hi)
    return [_lerp(a, b, r) for a, b in zip(lo, hi, strict=True)]


def _timeline(lo: Timeline | None, hi: Timeline | None, r: float) -> Timeline | None:
    if lo is None or hi is None:
        return hi
    out = {}
    for f in fields(Timeline):
        a, b = getattr(lo, f.name), getattr(hi, f.name)
        out[f.name] = _lerp_list(a, b, r) if isinstance(b, list) else _lerp(a, b, r)
    return Timeline(**out)


def _head(name: str, lo: HeadCost | None, hi: HeadCost, r: float, time_scale: float) -> HeadCost:
    """A head's cost between `lo` and `hi`. The chunked head's peaks are a chunk's logits, which
    stop growing with tokens once a chunk is full (concave: a chord would under-count them), so
    they keep the near bucket's; what any head holds grows with tokens."""
    ms = hi.ms * time_scale  # the head's matmul and loss, proportional to tokens
    if lo is None:
        return HeadCost(hi.held, hi.forward_peak, hi.backward_peak, ms)
    if name != "full":
        return HeadCost(_lerp(lo.held, hi.held, r), hi.forward_peak, hi.backward_peak, ms)
    return HeadCost(
        held=_lerp(lo.held, hi.held, r),
        forward_peak=_lerp(lo.forward_peak, hi.forward_peak, r),
        backward_peak=_lerp(lo.backward_peak, hi.backward_peak, r),
        ms=ms,
    )


def group_ratio(
    lo: GroupProfile, hi: GroupProfile, new: GroupProfile, r: float, floor: float
) -> float:
    """`ratio` for one block group: the largest of its ops' own (each op's output bytes from `lo`
    to `hi`), so an encoder block follows the encoder's length, and at least `floor` (what a block
    holds of one row broadcast over the batch: `length_share`); `r` where the ops differ."""
    lo_ops, hi_ops = {o.key: o for o in lo.ops}, {o.key: o for o in hi.ops}
    out = floor
    for o in new.ops:
        a, b = lo_ops.get(o.key), hi_ops.get(o.key)
        if a is None or b is None:
            return r
        if b.nbytes > a.nbytes:
            out = max(out, (o.nbytes - a.nbytes) / (b.nbytes - a.nbytes))
    return min(1.0, out) if new.ops else r


def _group_chords(
    new: Profile, low: Profile, near: Profile, r: float, length: float
) -> Iterator[tuple[GroupProfile, GroupProfile, GroupProfile, float]]:
    """Each block group of `new` that `near` has, with its two ends (`low`'s, else `near`'s) and
    its own share of the way (`group_ratio`)."""
    for name, g in new.groups.items():
        lo, hi = low.groups.get(name), near.groups.get(name)
        if hi is not None:
            lo = lo or hi
            yield g, lo, hi, group_ratio(lo, hi, g, r, length)


def chord_excess(low: Profile, near: Profile, new: Profile, r: float, length: float = 1.0) -> int:
    """Bytes by which the chord over-counts what the blocks hold for backward at `new` (their
    saved op outputs, traced there), over every block: 0 where each grows with tokens (SDPA's
    fused kernels), attention's quadratic parts where a block materialises them (eager or math
    attention: scores, softmax, dropout). An op the two ends do not both have counts nothing
    (`group_ratio` then takes the whole `r`)."""
    out = 0
    for g, lo, hi, rg in _group_chords(new, low, near, r, length):
        lo_ops, hi_ops = {o.key: o for o in lo.ops}, {o.key: o for o in hi.ops}
        excess = 0
        for o in g.ops:
            a, b = lo_ops.get(o.key), hi_ops.get(o.key)
            if o.saved and a is not None and b is not None:
                excess += max(0, a.nbytes + math.ceil((b.nbytes - a.nbytes) * rg) - o.nbytes)
        out += g.num_blocks * excess
    return out


def interpolate_memory(
    into: Profile,
    low: Profile,
    near: Profile,
    r: float,
    time_scale: float,
    length: float = 1.0,
) -> None:
    """Fill `into`'s memory fields (groups, outside the blocks, timeline, heads it did not measure)
    by the chord from `low` to `near` at `r` (`ratio`; a block group's own fields at
    `group_ratio`, at least `length`: `length_share`); head times are `near`'s scaled by
    `time_scale`."""
    for g, lo, hi, rg in _group_chords(into, low, near, r, length):
        for f in GROUP_BYTES:
            setattr(g, f, _lerp(getattr(lo, f), getattr(hi, f), rg))
        _same_blocks(g, hi)
    for f in PROFILE_BYTES:
        setattr(into, f, _lerp(getattr(low, f), getattr(near, f), r))
    into.timeline = _timeline(low.timeline, near.timeline, r)
    measured = into.heads  # the heads measured at this bucket, if any
    into.heads = {
        k: measured[k] if k in measured else _head(k, low.heads.get(k), h, r, time_scale)
        for k, h in near.heads.items()
    }
    if near.compiled:  # the larger bucket's whole-step residuals: at least the new bucket's
        # (not its plans': a plan's own residual may be negative, a larger bucket's the lower)
        kept = {k: v for k, v in near.compiled.items() if k != "plans"}
        into.compiled = {**kept, "residuals_from": near.fingerprint.get("bucket", "")}
        compiled_costs(into)


def _same_blocks(g: GroupProfile, near: GroupProfile) -> None:
    """Per-block constants of the near profile (parameter gradients, checkpoint frames)."""
    g.grad_nbytes = near.grad_nbytes
    g.frame_nbytes = near.frame_nbytes
