"""A block as the step model sees it (`BlockLoad`: what it holds, keeps, parks and runs) and its
transients under its action table: full recomputation's measured ones moved by the table's
measured difference (`profiler.variants`), or, for a table not measured (the budget left no room
to run it, or no block could run alone: a sharded model), estimated from what the table keeps,
parks and encodes (`unmeasured_peaks`: also what measuring it is taken to add)."""

from __future__ import annotations

from dataclasses import dataclass

from ..schema import GroupProfile


@dataclass(frozen=True)
class BlockLoad:
    """One block as the step sees it: what it holds, whether it is checkpointed, what it keeps of
    its op outputs, and its codecs' largest encode / decode workspace."""

    group: str
    held: int
    checkpoint: bool
    kept: int = 0  # outputs kept (retained) beyond what full recomputation holds
    kept_saved: int = 0  # of them, outputs autograd saves (not rematerialised by the recompute)
    kept_shared: int = 0  # kept outputs that are the block's output (held anyway in forward)
    encode_workspace: int = 0
    decode_workspace: int = 0
    variant: str = ""  # its action table's key in ``Profile.variant_transients``
    rng: int = 0  # generator states its kept random ops hold (not in `held`: no recorder sees them)
    parked: int = 0  # offloaded to host memory (its input and ops): staged back in backward
    modes: bool = False  # it keeps or offloads some op: its forward runs the dispatch modes
    input_parked: int = 0  # of `parked`, its input


def forward_transient(
    b: BlockLoad, g: GroupProfile, measured: int, deltas: dict, lag: bool = False
) -> int:
    """Measured under full recomputation, plus the difference its action table makes (measured,
    `profiler.variants`), or else an estimate: what the block retains and the generator states
    replay restores (they accumulate while it runs), the generator state its dispatch modes read
    beside each op (`runtime.ops.rng_mark`; a host tensor, counted on a CPU device as its
    checkpoint frame is) and its codecs' largest encode workspace, all as if at the measured
    peak; with copies to the host that lag behind the block (`lag`: a side stream), what it
    offloads too (each device copy lives until its copy is done). Its codec payloads are left
    out: the workspace counted whole is mostly above them, but not always (a tiny LLaMA whose
    attention probabilities were encoded at the forward's peak held its payloads, 2 % of the step,
    more), which only a measured table sees."""
    if not b.checkpoint:
        return g.plain_forward_transient_nbytes
    late = b.parked if lag else 0
    if b.variant in deltas:
        return max(0, measured + deltas[b.variant][0]) + late
    read = g.frame_nbytes if b.modes else 0
    return measured + b.kept + b.rng + read + b.encode_workspace + late


def backward_transient(b: BlockLoad, g: GroupProfile, measured: int, deltas: dict) -> int:
    """Measured under full recomputation, plus the difference its action table makes (measured),
    or else its codecs' decode workspace (kept outputs are handed back instead of rerun, which can
    only lower the transient: not counted unmeasured)."""
    if not b.checkpoint:
        return g.plain_transient_nbytes
    if b.variant in deltas:
        return max(0, measured + deltas[b.variant][1])
    return measured + b.decode_workspace


def unmeasured_peaks(b: BlockLoad, g: GroupProfile) -> tuple[int, int]:
    """(forward, backward) peaks of a checkpointed block of `g` under `b`'s action table, as the
    step model estimates a table it has no measurement of: above the level its forward starts at,
    and (everything it holds and brings back included) at its backward's start. What measuring
    the table on the profiled block (`profiler.variants.table_nbytes`) is taken to add."""
    fwd = forward_transient(b, g, g.forward_transient_nbytes, {})
    return fwd, b.held + b.parked + backward_transient(b, g, g.transient_nbytes, {})
