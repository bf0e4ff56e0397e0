"""The peak of a training step: the highest of the moments where memory can peak.

A step's memory rises through forward (activations held for backward), peaks somewhere in
backward (activations freed block by block while gradients appear block by block), and again in
the optimizer step (no activations, but the optimizer's temporaries). The profiler measures one
step under full recomputation at the planned shape (a `Timeline`: the bytes alive when each block's
forward and backward starts, the highest during each, and around the loss, the head and the
embeddings); every term that is hard to model (gradients in flight, tied weights, masks made
between blocks, T5's cross-attention) is in those measurements. For any policy the model adds only
what the policy changes, block by block:

    forward:j   resident + timeline.forward_start[j] + sum_{i<j} f_i + forward transient_j
    between:j   resident + timeline.forward_gap[j] + sum_{i<=j} f_i    (T5: encoder to decoder)
    forward     resident + timeline.loss_peak + sum_i f_i + h_f        (final norm, head, loss)
    head        resident + timeline.head_peak + sum_i d_i + h_b        (loss and head backward)
    backward:j  resident + timeline.backward_start[j] + sum_{i<=j} d_i + backward transient_j
    backward_between:j  resident + timeline.backward_gap[j] + sum_{i<=j} d_i
    tail        resident + timeline.tail_peak                          (embeddings, tied weights)
    optimizer   resident + gradients + the optimizer step's temporaries

``resident`` = parameters, buffers, optimizer states, master weights, the step's batches (with
gradient accumulation the Trainer fetches every micro-batch of a step before the first forward,
`batches_nbytes`) and the loader's next batch where it is fetched ahead onto the device
(`StaticMemory.batches_ahead`: a Trainer's loader on a CPU device); ``d_i`` = what
block i holds under the policy minus what it holds under full recomputation (its checkpoint's
frame included: the generator state stashed for recompute, ``frame_nbytes``); ``f_i`` = ``d_i`` less
a plain block's parameter casts (autocast's cache holds them through forward under any policy),
and while the blocks' forward runs plus the first block's input where it is offloaded (the model's
forward may hold its embeddings: LLaMA's `inputs_embeds`). A checkpointed block's transients are
full recomputation's measured ones moved by its action table's measured difference
(`profiler.variants`, within the room the budget leaves); a table not measured is estimated
(`loads`): in forward plus what it retains and its codecs' encode workspace, in backward plus its
decode workspace and all it staged back (its recompute hands kept and staged outputs back
instead of rerunning them, which only lowers the transient: not counted, so an offloading plan
may be predicted a fifth over); a plain block's are the measured plain ones. With gradient
accumulation every gradient is alive from the second micro-batch on.
A profile without a measured timeline (synthetic ones) gets one synthesised from its fields.
``h_f`` / ``h_b``: the chosen way of running the LM head and loss (`Profile.heads`, measured
alone) minus the model's own, which the timeline measured: its forward and backward peaks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ..schema import ALWAYS_RETAIN, GroupProfile, Profile, Timeline
from .engines import EngineExtras, engine_extras
from .head_moments import forward_end, head_peaks
from .loads import BlockLoad, backward_transient, forward_transient
from .offload import staged_ahead
from .static import StaticMemory


@dataclass
class StepEstimate:
    """The predicted peak of a step, the moment that sets it, and every moment."""

    peak_nbytes: int
    moment: str
    moments: dict[str, int] = field(default_factory=dict)
    inputs_offloaded: bool = False  # (`extreme_peaks`) the least peak offloads block inputs


def split_static(static: int | StaticMemory) -> tuple[int, int, int]:
    """(resident, gradients, optimizer-step temporaries). A plain number is all resident."""
    if isinstance(static, StaticMemory):
        return static.resident, static.grads, static.optimizer_step
    return int(static), 0, 0


def extras(static: int | StaticMemory, tl: Timeline, unsharded: int) -> EngineExtras:
    """What a sharding engine adds to each moment (`engines`; nothing without one). `unsharded`:
    every trainable parameter's gradient bytes."""
    engine = static.engine if isinstance(static, StaticMemory) else None
    return engine_extras(engine, len(tl.held), tl.grads, unsharded)


def in_forward_order(profile: Profile, per_group: dict[str, list[BlockLoad]]) -> list[BlockLoad]:
    """The blocks of every group, interleaved as they run."""
    return [per_group[name][i] for name, i in profile.block_order()]


def _groups_in_order(profile: Profile) -> list[GroupProfile]:
    return [profile.groups[name] for name, _ in profile.block_order()]


def synthesised_timeline(profile: Profile) -> Timeline:
    """A timeline from the profile's per-group fields, for profiles that carry none."""
    groups = _groups_in_order(profile)
    held = [g.input_nbytes for g in groups]
    before = profile.nonblock_before_nbytes
    fwd_start, level = [], before
    for h in held:
        fwd_start.append(level)
        level += h
    forward_end = profile.nonblock_nbytes + sum(held)
    grad_after = [0] * len(groups)  # gradients of the blocks after j
    for j in range(len(groups) - 2, -1, -1):
        grad_after[j] = grad_after[j + 1] + groups[j + 1].grad_nbytes
    grads = [profile.nonblock_grad_nbytes + a for a in grad_after]
    bwd_start = [
        grads[j] + before + sum(held[: j + 1]) + g.output_nbytes for j, g in enumerate(groups)
    ]
    all_grads = profile.nonblock_grad_nbytes + sum(g.grad_nbytes for g in groups)
    return Timeline(
        held=held,
        forward_start=fwd_start,
        forward_peak=[
            s + g.forward_transient_nbytes for s, g in zip(fwd_start, groups, strict=True)
        ],
        backward_start=bwd_start,
        backward_peak=[s + g.transient_nbytes for s, g in zip(bwd_start, groups, strict=True)],
        loss_peak=forward_end + profile.forward_transient_nbytes,
        head_peak=forward_end + profile.head_transient_nbytes,
        tail_peak=all_grads + before + profile.tail_transient_nbytes,
        grads=grads,
    )


def _plain_held(blocks: list[BlockLoad], groups: list[GroupProfile], j: int) -> int:
    """What plain block `j` holds: measured next to a checkpointed block (which holds its output as
    its input), or next to a plain one / the head (which may hold only a cast of it)."""
    g = groups[j]
    followed_by_plain = j + 1 == len(blocks) or not blocks[j + 1].checkpoint
    if followed_by_plain and g.full_interior_nbytes:
        return g.full_interior_nbytes
    return blocks[j].held


def batches_nbytes(profile: Profile, accumulation: int = 1) -> int:
    """The batches alive all step long: every micro-batch of it (the Trainer's
    ``get_batch_samples`` fetches them all before the first forward to count the step's tokens;
    a loop that loads one at a time holds less). Unplanned, a bf16 accumulating loop measured one
    micro-batch's tensors over its plan. The loader's next batch, fetched ahead, is in the static
    memory (`StaticMemory.batches_ahead`): its size is the run's longest batch, not this bucket's."""
    return profile.batch_nbytes * max(1, accumulation)


def held_in_order(profile: Profile, blocks: list[BlockLoad]) -> list[int]:
    """What each block (in forward order) holds for backward, a plain block's by its neighbour."""
    groups = _groups_in_order(profile)
    return [
        b.held if b.checkpoint else _plain_held(blocks, groups, j) for j, b in enumerate(blocks)
    ]


def plan_key(blocks: list[BlockLoad]) -> str:
    """A name for the blocks' loads in forward order (each block's action table, or plain)."""
    text = "|".join(b.variant if b.checkpoint else "plain" for b in blocks)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def compiled_residual(profile: Profile, blocks: list[BlockLoad] | None = None) -> tuple[int, int]:
    """What a model compiled whole holds beyond its compiled parts, in forward and in backward
    (measured: `profiler.compiled`; 0 for an eager profile), with `blocks` (None: every block
    checkpointed): the plan's own where its whole step was measured (``plans``; it may be
    negative: tags change what the partitioner saves around them), else with every block
    checkpointed or with a plain one among them."""
    plans = profile.compiled.get("plans")
    key = plan_key(blocks) if plans and blocks else None
    if key is not None and key in plans:
        fwd, bwd = plans[key]
    else:
        all_checkpointed = blocks is None or all(b.checkpoint for b in blocks)
        name = "residual" if all_checkpointed else "residual_plain"
        fwd, bwd = profile.compiled.get(name, (0, 0))  # both names are measured together
    return int(fwd), int(bwd)


def step_peak(
    profile: Profile,
    blocks: list[BlockLoad],
    static: int | StaticMemory = 0,
    accumulation: int = 1,
    head: str = "full",
    residual: tuple[int, int] | None = None,
) -> StepEstimate:
    """The moments of the module docstring for `blocks` (in forward order), the LM head and loss
    run as `head` (`schema.HEADS`); `residual`: the compiled one to add (forward, backward),
    instead of the profile's (`compiled_residual`)."""
    resident, grads, opt_step = split_static(static)
    resident += batches_nbytes(profile, accumulation)
    tl = profile.timeline or synthesised_timeline(profile)
    groups = _groups_in_order(profile)
    if len(blocks) != len(tl.held):
        raise ValueError(f"{len(blocks)} blocks for a profile of {len(tl.held)}")
    deltas = profile.variant_transients
    # The timeline was measured without gradients at the step's start (the first micro-batch);
    # later micro-batches of gradient accumulation start with all of them.
    unsharded = profile.nonblock_grad_nbytes + sum(g.grad_nbytes for g in groups)
    acc = max(grads, unsharded) if accumulation > 1 else 0
    # What each block holds beyond full recomputation. A checkpointed block's held counts its
    # group's mean input; a plain block holds no checkpoint frame (`GroupProfile.frame_nbytes`); a kept output of its own counts only where full recomputation would not
    # hold it anyway (the last block's output, read by the head, is often not held).
    shared_extra = [
        max(0, b.kept_shared - h) if b.checkpoint else 0
        for b, h in zip(blocks, tl.held, strict=True)
    ]
    delta = [
        (b.held - g.input_nbytes + extra + b.rng)
        if b.checkpoint
        else _plain_held(blocks, groups, j) - h - g.frame_nbytes
        for j, (b, g, h, extra) in enumerate(
            zip(blocks, groups, tl.held, shared_extra, strict=True)
        )
    ]
    # Through forward, autocast's weight-cast cache holds every parameter cast under any policy
    # (the timeline counts them): a plain block's casts add to the step only from backward on.
    forward_delta = [
        d - (0 if b.checkpoint else g.plain_cast_nbytes)
        for d, b, g in zip(delta, blocks, groups, strict=True)
    ]
    ex = extras(static, tl, unsharded)
    lag = profile.offload is not None and profile.offload.overlap
    ahead = staged_ahead([b.parked for b in blocks])
    moments: dict[str, int] = {}
    before = 0
    fres, bres = compiled_residual(profile, blocks) if residual is None else residual
    # The first block's input comes from outside the blocks (the embeddings), and the model's
    # forward may hold it through its loop (LLaMA's `inputs_embeds`): parked, it leaves the
    # device only once the blocks' forward is over.
    embeds = blocks[0].input_parked if blocks else 0
    for j, (b, g) in enumerate(zip(blocks, groups, strict=True)):
        measured = tl.forward_peak[j] - tl.forward_start[j]
        transient = forward_transient(b, g, measured, deltas, lag)
        moments[f"forward:{j}"] = (
            resident
            + acc
            + tl.forward_start[j]
            + before
            + (embeds if j else 0)
            + ex.forward[j]
            + max(transient, ex.forward_floor[j])
            + fres
        )
        before += forward_delta[j]
        if j < len(tl.forward_gap) and tl.forward_gap[j]:
            moments[f"between:{j}"] = (
                resident + acc + tl.forward_gap[j] + before + embeds + ex.forward[j] + fres
            )
    total = sum(delta)
    loss_peak, head_peak = head_peaks(profile, tl, head)
    moments["forward"] = resident + acc + loss_peak + before + ex.loss + fres
    # In a later micro-batch the head's new gradients (in the timeline's head peak, where they
    # become the gradients) are transients beside every accumulated gradient.
    head_peak = max(head_peak, forward_end(profile, tl, head) + ex.head_floor)
    moments["head"] = resident + acc + head_peak + total + ex.head + bres
    for j in range(len(blocks) - 1, -1, -1):
        b, g = blocks[j], groups[j]
        measured = tl.backward_peak[j] - tl.backward_start[j]
        in_flight = max(0, acc - (tl.grads[j] if tl.grads else 0))
        # A kept output of the block's own is alive until its recompute takes it back.
        cached_output = b.kept_shared - shared_extra[j] if b.checkpoint else 0
        # What it offloaded is back from its backward's start, beside what the offloading block
        # before it parked. A measured action table has its own in its transient (its op
        # outputs come back in place of outputs the recompute would make, but earlier: unmeasured,
        # all of them count).
        staged = ahead[j] + (b.parked if b.variant not in deltas else 0)
        moments[f"backward:{j}"] = (
            resident
            + in_flight
            + tl.backward_start[j]
            + sum(delta[: j + 1])
            + cached_output
            + staged
            + backward_transient(b, g, measured, deltas)
            + ex.backward[j]
            + bres
        )
        if j < len(tl.backward_gap) and tl.backward_gap[j]:  # after block j+1's backward
            moments[f"backward_between:{j}"] = (
                resident
                + in_flight
                + tl.backward_gap[j]
                + sum(delta[: j + 1])
                + (ahead[j + 1] if j + 1 < len(blocks) else 0)
                + ex.backward[j]
                + bres
            )
    moments["tail"] = resident + max(tl.tail_peak + ex.tail, acc) + bres
    moments["optimizer"] = resident + grads + opt_step
    moment = max(moments, key=moments.__getitem__)
    return StepEstimate(moments[moment], moment, moments)


def lp_caps(
    profile: Profile,
    budget: int,
    static: int | StaticMemory = 0,
    accumulation: int = 1,
    head: str = "full",
) -> tuple[int, int]:
    """The MILP's caps (see `milp.Caps`) for `budget`: what it leaves for the blocks' held bytes at
    the end of forward / the head's backward (everything held), and for them plus one block's
    backward transient at the last block's backward."""
    resident, grads, _ = split_static(static)
    resident += batches_nbytes(profile, accumulation)
    tl = profile.timeline or synthesised_timeline(profile)
    groups = _groups_in_order(profile)
    unsharded = profile.nonblock_grad_nbytes + sum(g.grad_nbytes for g in groups)
    acc = max(grads, unsharded) if accumulation > 1 else 0
    held = sum(tl.held) + sum(g.frame_nbytes for g in groups)  # every block checkpointed
    ex = extras(static, tl, unsharded)
    fres, bres = compiled_residual(profile)
    loss_peak, head_peak = head_peaks(profile, tl, head)
    at_end = max(loss_peak + fres, head_peak + bres) + max(ex.loss, ex.head) - held
    last = len(tl.held) - 1
    in_flight = max(0, acc - (tl.grads[last] if tl.grads else 0))
    at_last = tl.backward_start[last] + ex.backward[last] + bres - held
    return budget - resident - acc - at_end, budget - resident - in_flight - at_last


def checkpointed_nbytes(g: GroupProfile) -> int:
    """What a checkpointed block of `g` holds whatever its policy keeps: its input and its
    checkpoint's frame (`GroupProfile.frame_nbytes`)."""
    return g.input_nbytes + g.frame_nbytes


def pinned_nbytes(g: GroupProfile) -> int:
    """Bytes a checkpointed block of `g` retains under any policy (`ALWAYS_RETAIN` ops)."""
    return sum(o.retain_nbytes for o in g.ops if o.cacheable and o.layer_type in ALWAYS_RETAIN)


def uniform_loads(
    profile: Profile, checkpoint: dict[str, bool], offload_inputs: bool = False
) -> list[BlockLoad]:
    """Every block of each group checkpointed with everything recomputed but `ALWAYS_RETAIN` ops
    (holding what full recomputation holds; `offload_inputs`: its input in host memory instead),
    or not checkpointed at all (holding ``full_nbytes``), per group."""
    out = []
    for name, _ in profile.block_order():
        g = profile.groups[name]
        if not checkpoint[name]:
            out.append(BlockLoad(name, g.full_nbytes, False))
        elif offload_inputs:
            out.append(
                BlockLoad(
                    name, pinned_nbytes(g), True, parked=g.input_nbytes, input_parked=g.input_nbytes
                )
            )
        else:
            out.append(BlockLoad(name, g.input_nbytes + pinned_nbytes(g), True))
    return out


def inputs_fit_host(profile: Profile) -> bool:
    """Whether the profile's host link may hold every block's input (its cap, if any)."""
    link = profile.offload
    if link is None:
        return False
    total = sum(g.num_blocks * g.input_nbytes for g in profile.groups.values())
    return not link.host_cap_nbytes or total <= link.host_cap_nbytes


def extreme_peaks(
    profile: Profile, static: int | StaticMemory = 0, accumulation: int = 1, head: str = "full"
) -> tuple[StepEstimate, StepEstimate]:
    """(the least peak any policy reaches, the peak with no checkpointing anywhere).

    The least: per group, every block checkpointed and recomputed, or none checkpointed (a group of
    tiny blocks can hold less without checkpointing than its recompute transient costs); all
    combinations of the groups are tried, and where the profile has a host link, each with the
    checkpointed blocks' inputs offloaded too (``inputs_offloaded`` says which won).
    """
    names = sorted(profile.groups)
    best: StepEstimate | None = None
    offload = (False, True) if inputs_fit_host(profile) else (False,)
    for mask in range(2 ** len(names)):
        choice = {n: not (mask >> i) & 1 for i, n in enumerate(names)}
        for off in offload:
            loads = uniform_loads(profile, choice, off)
            est = step_peak(profile, loads, static, accumulation, head)
            est.inputs_offloaded = off
            if best is None or est.peak_nbytes < best.peak_nbytes:
                best = est
    plain = step_peak(
        profile, uniform_loads(profile, dict.fromkeys(names, False)), static, accumulation, head
    )
    assert best is not None
    return best, plain
