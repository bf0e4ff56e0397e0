"""What profiling knows without measuring: the bytes of one step (`StepMemory`) where a run was
skipped or could not run, from the block's traced ops (`OpSpec`: sizes, which outputs autograd
saves), its parameters and the heads measured alone; and the predicted peak a run is checked
against before it runs (`profiler.memory`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..adapters import BlockGroup
from ..schema import HeadCost, OpSpec, Timeline
from .head import head_peak


@dataclass
class StepMemory:
    """What one step holds and how high its transients go (bytes)."""

    held: dict[str, int]  # a checkpointed block (full recomputation), mean per group
    full: dict[str, int]  # a block without checkpointing, per group
    before: int  # held outside the blocks, created before the first block (embeddings, masks)
    after: int  # held outside the blocks, created after (final norm, logits, loss)
    largest_other: int  # the largest single storage held outside the blocks
    output_nbytes: dict[str, int]  # a block's output: the gradient its backward starts from
    forward_transient: int = 0  # forward peak above the level held at its end
    head_transient: int = 0  # loss + head backward, above the level when backward starts
    block_transient: dict[str, int] = field(default_factory=dict)  # checkpointed block backward
    plain_transient: dict[str, int] = field(default_factory=dict)  # plain block backward
    block_fwd_transient: dict[str, int] = field(default_factory=dict)  # checkpointed, forward
    plain_fwd_transient: dict[str, int] = field(default_factory=dict)  # plain block forward
    full_interior: dict[str, int] = field(default_factory=dict)  # plain, followed by a plain one
    plain_casts: dict[str, int] = field(default_factory=dict)  # of `full`: parameter casts
    tail_transient: int = 0  # backward after the first block (embeddings, tied weights)
    measured_backward: bool = True
    timeline: Timeline | None = None  # the full-recomputation step, block by block
    skipped: list[str] = field(default_factory=list)  # runs predicted not to fit the room
    # the probed block alone under full recomputation: (forward, backward) peaks per group
    recompute_alone: dict[str, list[int]] = field(default_factory=dict)


def grad_nbytes(modules: Iterable[nn.Module]) -> int:
    """Gradient bytes of the trainable parameters of `modules`, each once, whole (a ZeRO-3
    partition counts its ``ds_numel``)."""
    seen, total = set(), 0
    for m in modules:
        for p in m.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                total += (getattr(p, "ds_numel", 0) or p.numel()) * p.element_size()
    return total


def _trainable_nbytes(base: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)


def _checkpoint_nbytes(base: nn.Module, groups: list[BlockGroup], batch: dict) -> int:
    """Every block's checkpointed input under full recomputation: ``[tokens x hidden]`` each, in
    the parameters' dtype (the residual stream's under autocast too)."""
    ids = batch.get("input_ids", batch.get("inputs_embeds"))
    config = getattr(base, "config", None)  # none on a plain PyTorch model
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", 0)
    if not isinstance(ids, torch.Tensor) or not hidden:
        return 0
    tokens = ids.shape[0] * ids.shape[1]
    size = max(p.element_size() for p in base.parameters())
    return sum(len(g.modules) for g in groups) * tokens * hidden * size


def _saved_nbytes(ops: list[OpSpec]) -> int:
    """What a plain block keeps beyond its input: the outputs of its traced ops autograd saves."""
    return sum(o.nbytes for o in ops if o.saved)


def _largest_nbytes(ops: list[OpSpec]) -> int:
    return max((o.nbytes for o in ops), default=0)


def plain_nbytes(ops: list[OpSpec], blocks: int) -> int:
    """What `blocks` plain blocks save (their traced ops), and the largest op once more."""
    return blocks * _saved_nbytes(ops) + _largest_nbytes(ops)


def cast_nbytes(block: nn.Module, autocast: torch.dtype | None) -> int:
    """Autocast's casts of a block's weights (matrices of another floating dtype), which a plain
    block's matmuls save for backward."""
    if autocast is None:
        return 0
    size = torch.empty((), dtype=autocast).element_size()
    return sum(
        p.numel() * size
        for p in block.parameters()
        if p.dim() >= 2 and p.is_floating_point() and p.dtype != autocast
    )


def skipped_plain(mem: StepMemory, g: BlockGroup, ops: list[OpSpec], casts: int) -> None:
    """A plain block whose run was skipped, from its traced ops (`OpSpec.saved`, sizes): it holds
    its input, the outputs autograd saves and its weights' casts; its forward peaks with one op's
    output beside them; its backward adds its gradients, its output's and one op's."""
    largest, out = _largest_nbytes(ops), mem.output_nbytes.get(g.name, 0)
    mem.full[g.name] = mem.held[g.name] + _saved_nbytes(ops) + casts
    mem.plain_casts[g.name] = casts
    mem.plain_fwd_transient[g.name] = _saved_nbytes(ops) + casts + largest
    mem.plain_transient[g.name] = grad_nbytes([g.modules[0]]) + largest + out


def timeline_head(
    base: nn.Module,
    groups: list[BlockGroup],
    batch: dict,
    heads: dict[str, HeadCost],
    room: int | None,
) -> str:
    """The head the full-recomputation run uses: the model's own unless `room` is set and the
    run's predicted peak with it (trainable gradients, checkpointed inputs, the head alone) does
    not fit while the chunked head was measured."""
    own = heads.get("full")
    if room is None or own is None or "chunked" not in heads:
        return "full"
    return (
        "full" if timeline_rest_nbytes(base, groups, batch) + head_peak(own) <= room else "chunked"
    )


def timeline_rest_nbytes(base: nn.Module, groups: list[BlockGroup], batch: dict) -> int:
    """What the full-recomputation run holds besides the head when the head runs: the trainable
    gradients and every block's checkpointed input."""
    return _trainable_nbytes(base) + _checkpoint_nbytes(base, groups, batch)


def to_own_head(mem: StepMemory, heads: dict[str, HeadCost], measured: str) -> None:
    """Move a timeline measured with head `measured` to the model's own head (``"full"``): the
    inverse of the shift `solver.head_moments.head_peaks` applies for a chosen head."""
    if measured == "full":
        return
    own, was = heads["full"], heads[measured]
    held = own.held - was.held
    fwd, bwd = own.forward_peak - was.forward_peak, own.backward_peak - was.backward_peak
    mem.after += held
    mem.forward_transient = max(0, mem.forward_transient + fwd - held)
    mem.head_transient = max(0, mem.head_transient + bwd - held)
    if mem.timeline is not None:
        mem.timeline.loss_peak += fwd
        mem.timeline.head_peak += bwd


def estimate(mem: StepMemory, specs: dict[str, list[OpSpec]]) -> StepMemory:
    """Transients where the backward could not run (sharded models): a block's backward
    materialises what it holds without checkpointing plus a temporary as large as its largest
    activation and its output's gradient; outside the blocks, the largest storage (the logits)
    twice (it and its gradient)."""
    for name, ops in specs.items():
        largest = max((o.nbytes for o in ops), default=0)
        out = mem.output_nbytes.get(name, 0)
        mem.block_transient[name] = max(0, mem.full[name] - mem.held[name]) + largest + out
        mem.plain_transient[name] = largest + out
    mem.head_transient = 2 * mem.largest_other
    mem.tail_transient = mem.largest_other
    return mem
