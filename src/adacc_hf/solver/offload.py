"""What offloading costs a plan: the copies' time (in line, or what outlasts the blocks'
compute on a side stream) and the bytes a block's backward brings back; one home for the MILP
(`milp`), its exact check (`cost_model.evaluate`) and `cost_model.predict`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..schema import GroupProfile, OffloadLink, OpProfile

#: The block input's offload in a group's counts (``counts[group][INPUT]``): not an op.
INPUT = "<input>"


def copy_ms(link: OffloadLink, nbytes: int) -> float:
    """What offloading `nbytes` costs a block in line: two launches, and where the copies do not
    overlap compute (the CPU stand-in) their whole time out and back."""
    if link.overlap:
        return 2 * link.launch_ms
    return 2 * link.launch_ms + link.d2h_ms(nbytes) + link.h2d_ms(nbytes)


def overlap_windows(g: GroupProfile) -> tuple[float, float]:
    """(forward, backward) ms a block of `g` runs beside its side-stream copies: its forward, and
    its backward (about twice its forward; its recompute, when it has one, not counted)."""
    return g.block_fwd_ms, 2 * g.block_fwd_ms


def exposed_ms(link: OffloadLink | None, g: GroupProfile, nbytes: int, blocks: float = 1) -> float:
    """Time `blocks` checkpointed blocks of `g` wait for side-stream copies of `nbytes` in all
    (spread over them): what outlasts their forwards going out and their backwards coming back."""
    if link is None or not link.overlap or not nbytes:
        return 0.0
    fwd, bwd = overlap_windows(g)
    return max(0.0, link.d2h_ms(nbytes) - blocks * fwd) + max(
        0.0, link.h2d_ms(nbytes) - blocks * bwd
    )


def staged_ahead(parked: Sequence[int]) -> list[int]:
    """Per block (forward order, `parked`: the bytes each offloads): bytes an earlier block
    offloaded that are staged back on the device while this block's backward runs. Backward
    stages, when an offloading block's backward starts, what the offloading block before it parked
    (`runtime.offload`): those bytes stay until that block's own backward takes them."""
    out, prev, later = [0] * len(parked), 0, False
    ahead = [False] * len(parked)  # some offloading block at or after j
    for j in range(len(parked) - 1, -1, -1):
        later = later or parked[j] > 0
        ahead[j] = later
    for j, p in enumerate(parked):
        out[j] = prev if ahead[j] else 0
        if p:
            prev = p
    return out


#: Blocks whose offloaded bytes may be on the device in one block's backward: its own, back from
#: its start (the step model's unmeasured bound), and the offloading block before it, prefetched
#: (`runtime.offload`).
STAGED_BLOCKS = 2


def staging(
    g: GroupProfile,
    ops: Sequence[tuple[OpProfile, Sequence[Any]]],
    counts: dict[str, dict[str, int]],
) -> int:
    """The most one block of group `g` may stage back under `counts`: every op some block
    offloads (at its largest offloaded size among `ops`' choices, `cost_model.Choice`) and the
    input, if some block offloads it."""
    total = g_in = 0
    if counts.get(INPUT, {}).get("offload", 0):
        g_in = g.input_nbytes
    for op, choices in ops:
        c = counts.get(op.key, {})
        total += max((ch.host_nbytes for ch in choices if c.get(ch.label, 0)), default=0)
    return total + g_in
