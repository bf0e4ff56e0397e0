"""A block's transients under one action table, measured on the block alone.

How much a checkpointed block's recompute and backward allocate depends on what it keeps (a kept
output is handed back, not rerun; where backward peaks decides how much that saves), so after a
solve the session measures each action table (variant) the policy uses: the block that was
profiled runs once with it and once under full recomputation, on the inputs it got in the profiled
forward, and the differences of their forward and backward peaks go into the profile
(``Profile.variant_transients``). The step model adds them to the measured full-recomputation
timeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..runtime.checkpoint import BlockRuntime
from ..runtime.peak import AllocationTracker
from ..runtime.trace import autocast_context, detached_input
from ..schema import GroupPolicy, OpSpec, Profile, Variant, variant_key

FULL_RECOMPUTE = Variant(1, True, {})


@dataclass
class BlockProbe:
    """The profiled block of a group and the inputs it got (kept only while a plan is made)."""

    group: str
    path: str
    block: nn.Module
    fn: Callable
    args: tuple
    ops: list[OpSpec] = field(default_factory=list)  # the group's traced ops (the policy's list)


def _hidden(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def transients(
    probe: BlockProbe, variant: Variant, autocast: torch.dtype | None = None
) -> tuple[int, int]:
    """(forward peak above its start, backward peak above its start) of the block under
    `variant`, gradients of its parameters and input included."""
    x, x_in = detached_input(probe.args[0])
    params = [p for p in probe.block.parameters() if p.requires_grad]
    device = x.device
    runtime = (
        BlockRuntime(
            probe.block, probe.path, probe.group, GroupPolicy(probe.ops, [variant]), variant, set()
        )
        if variant.checkpoint
        else None
    )
    tracker = AllocationTracker(device)
    try:
        with tracker:
            tracker.mark("start")
            with autocast_context(device, autocast):
                args = (x_in, *probe.args[1:])
                out = runtime(probe.fn, *args) if runtime is not None else probe.fn(*args)
            tracker.mark("forward_end")
            y = _hidden(out)
            grad = torch.ones_like(y)
            tracker.mark("backward_start")
            inputs = [t for t in (x, *params) if t.requires_grad]
            grads = torch.autograd.grad(y, inputs, grad_outputs=grad, allow_unused=True)
            tracker.mark("backward_end")
            del grads, grad, y, out
    finally:
        if runtime is not None:
            runtime.remove()
    fwd = tracker.peak("start", "forward_end") - tracker.level("start")
    bwd = tracker.peak("backward_start", "backward_end") - tracker.level("backward_start")
    return max(0, fwd), max(0, bwd)


def measure_variants(
    profile: Profile,
    probes: dict[str, BlockProbe],
    variants: list[tuple[str, Variant]],
    autocast: torch.dtype | None = None,
) -> int:
    """Measure each (group, variant) not yet in ``profile.variant_transients`` against full
    recomputation on the same block, and record the differences. Returns how many were new."""
    new = 0
    cuda = sorted({p.args[0].device.index or 0 for p in probes.values() if p.args[0].is_cuda})
    with torch.random.fork_rng(devices=cuda):
        for group, variant in variants:
            key = variant_key(group, variant)
            probe = probes.get(group)
            if probe is None or key in profile.variant_transients or not variant.checkpoint:
                continue
            base = profile.variant_transients.get(f"{group}:full")
            if base is None:
                base = list(transients(probe, FULL_RECOMPUTE, autocast))
                profile.variant_transients[f"{group}:full"] = base
            fwd, bwd = transients(probe, variant, autocast)
            profile.variant_transients[key] = [fwd - base[0], bwd - base[1]]
            new += 1
    return new
