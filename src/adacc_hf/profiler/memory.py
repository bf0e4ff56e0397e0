"""Memory of one training step, measured on the real model, device and batch.

Runs of a forward and a backward under the allocation tracker
(`runtime.peak.AllocationTracker`), with marks at the moment each block's backward starts (the
gradient of its output arrives) and ends (the gradient of its input is computed):

* every block checkpointed with everything recomputed (full recomputation): what a checkpointed
  block holds (its input, and tensors like T5's position bias that later blocks read), what is held
  outside the blocks before and after them, the forward's own temporaries, and the backward
  transients: the loss and head, each block's recompute + backward, the embeddings at the end;
* per block group, its first block without checkpointing: what a plain block holds and the
  transients of its forward and backward, next to checkpointed blocks (the conservative case: a
  plain neighbour would save some of the same tensors); and, with two blocks or more, what it holds
  when the next block is plain too (under autocast the next block may save a cast of its input
  rather than the input).

The plain block is measured on its own (`plain_alone`): the group's profiled block, on the inputs it
got, runs alone checkpointed, plain, and plain followed by itself plain, and the differences move
what the full-recomputation run measured for that block in the model. The model around the block
is the same under both and cancels out: on the 35 tiny families, fp32 and bf16, this equals a
whole-model run with the block plain to the byte, but for a cross-attention block whose encoder
gradient the block alone does not compute and GPT-NeoX (1-8 KiB over, the safe side). A
whole-model run per plain block would cost a training step each. A group without a probe (a sharded
model) runs whole-model forwards: every other block checkpointed, then its first two blocks plain.

Inside a budget (``room``: the bytes profiling may add above what is alive when it starts), each
run's peak is predicted before it runs: the full-recomputation run from the trainable gradients,
each block's checkpointed input (``[tokens x hidden]`` per block) and the model's own LM head alone
(`head`); a plain or pair run as the full-recomputation run's measured peak plus the bytes its
plain blocks save (the outputs of the group's traced ops autograd saves; a block alone adds only
its largest op, a pair alone one plain block more). Where the model's own head does not fit, the
timeline runs with the chunked head and is moved back to the model's own head by the measured (or extrapolated) difference of the two heads (`to_own_head`); a plain or
pair run that does not fit is skipped and its group estimated from its traced ops
(`estimates.skipped_plain`). The backward a plain run holds is not what training holds under
every engine: ZeRO-2 reduces each gradient to a ``1/n`` partition as it comes, the run keeps them
all, so its plain run may be skipped where the step with a plain block fits.

Backward runs as ``torch.autograd.grad`` over the trainable parameters: gradients are allocated as
in training (and so are counted), but nothing accumulates into ``.grad`` and no
gradient-accumulation hook fires (DDP's reducer stays untouched). Sharded models (ZeRO-3, FSDP2)
skip the backward runs: their backward gathers and scatters parameters across ranks; the transients
are then estimated from the held bytes (see `estimate`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..adapters import BlockGroup, get_adapter
from ..policy import Policy
from ..runtime import apply_adacc
from ..runtime.context import autocast_context, devices_of, model_kwargs, train_mode
from ..runtime.memory import recorded_forward
from ..runtime.peak import AllocationTracker
from ..schema import GroupPolicy, HeadCost, OpSpec, Timeline, Variant
from .estimates import (
    StepMemory,
    cast_nbytes,
    estimate,
    plain_nbytes,
    skipped_plain,
    timeline_head,
    to_own_head,
)
from .variants import FULL_RECOMPUTE, AloneMemory, BlockProbe, alone_memory, later_input


def sharded(model: nn.Module) -> bool:
    """ZeRO-3 or FSDP2 parameters: a forward or backward gathers them across ranks."""
    from torch.distributed.tensor import DTensor

    return any(hasattr(p, "ds_id") or isinstance(p, DTensor) for p in model.parameters())


def timeline_policy(
    base: nn.Module,
    groups: list[BlockGroup],
    specs: dict,
    first: str | None,
    kind: str = "plain",
    head: str = "full",
) -> Policy:
    """Every block checkpointed and recomputed, but the first block of group `first` plain (or,
    ``kind="pair"``, its first two blocks plain); the LM head run as `head`."""
    adapter = get_adapter(base)
    gps = {}
    for g in groups:
        n = len(g.modules)
        plain = 0 if g.name != first else 2 if kind == "pair" else 1
        variants = [Variant(plain, False), Variant(n - plain, True, {})]
        gps[g.name] = GroupPolicy(ops=specs[g.name], variants=variants)
    return Policy(
        adapter.model_type(base),
        adapter.name,
        gps,
        {"source": "profiler"},
        adapter_version=adapter.version,
        head=head,
    )


def _hidden(x: Any) -> torch.Tensor | None:
    t = x[0] if isinstance(x, (tuple, list)) and x else x
    return t if isinstance(t, torch.Tensor) and t.requires_grad else None


class _Run:
    """One measured forward + backward with per-block marks."""

    def __init__(self, base: nn.Module, batch: dict[str, Any], amp: Any, backward: bool) -> None:
        self.tracker = AllocationTracker(next(base.parameters()).device)
        self.order: list[str] = []  # blocks in backward order (their start marks)
        self.outputs: dict[str, int] = {}
        # Gradient bytes computed when each block's backward starts (in forward order of marks):
        # measured, as which non-block gradients exist by then depends on the model (a head's
        # before the blocks; embeddings' only at the end; a tied weight's at the end, its head
        # share waiting inside autograd and counted in the level).
        self.grads_at: dict[str, int] = {}
        made = [0]
        tracker = self.tracker

        def hooks(path: str, block: nn.Module):
            def pre(mod, args, kwargs):
                tracker.mark(f"fpre:{path}")
                x = _hidden(args[0] if args else kwargs.get("hidden_states"))
                if x is not None and backward:
                    x.register_hook(lambda g: tracker.mark(f"end:{path}"))

            def post(mod, args, kwargs, out):
                tracker.mark(f"fpost:{path}")
                y = _hidden(out)
                if y is not None:
                    self.outputs[path] = y.numel() * y.element_size()
                    if backward:

                        def start(g):
                            self.order.append(path)
                            self.grads_at[path] = made[0]
                            tracker.mark(f"start:{path}")

                        y.register_hook(start)

            return [
                block.register_forward_pre_hook(pre, with_kwargs=True),
                block.register_forward_hook(post, with_kwargs=True),
            ]

        params = [p for p in base.parameters() if p.requires_grad]
        with tracker, recorded_forward(base, batch, hooks, amp) as (report, loss):
            tracker.mark("forward_end")
            self.report = report()
            if backward:

                def counter(p: torch.Tensor) -> Any:
                    n = p.numel() * p.element_size()

                    def computed(g: torch.Tensor) -> None:
                        made[0] += n

                    return computed

                counted = [p.register_hook(counter(p)) for p in params]
                tracker.mark("backward_start")
                try:
                    grads = torch.autograd.grad(loss, params, allow_unused=True)
                finally:
                    for h in counted:
                        h.remove()
                tracker.mark("backward_end")
                del grads
            del loss

    def forward_transient(self, path: str) -> int:
        """Peak of block `path`'s forward above the level when it starts."""
        t = self.tracker
        if not (t.has(f"fpre:{path}") and t.has(f"fpost:{path}")):
            return 0
        return max(0, t.peak(f"fpre:{path}", f"fpost:{path}") - t.level(f"fpre:{path}"))

    def timeline(self, paths: list[str]) -> Timeline:
        """The run's levels at its marks and the gradients computed by each block's backward start,
        blocks in forward order (`paths`)."""
        t = self.tracker

        def level(name: str, default: int = 0) -> int:
            return t.level(name) if t.has(name) else default

        def peak(a: str, b: str, default: int = 0) -> int:
            return t.peak(a, b) if t.has(a) and t.has(b) else default

        def gap(a: str, b: str) -> int:
            return t.peak(a, b) if t.has(a) and t.has(b) and t.precedes(a, b) else 0

        pairs = list(itertools.pairwise(paths))
        last_fwd = f"fpost:{paths[-1]}"
        first_bwd = f"start:{self.order[0]}" if self.order else "backward_end"
        end_first = f"end:{paths[0]}" if t.has(f"end:{paths[0]}") else "backward_end"
        return Timeline(
            held=[self.report.blocks[p] for p in paths],
            forward_start=[level(f"fpre:{p}") for p in paths],
            forward_peak=[peak(f"fpre:{p}", f"fpost:{p}") for p in paths],
            backward_start=[level(f"start:{p}") for p in paths],
            backward_peak=[
                peak(f"start:{p}", f"end:{p}" if t.has(f"end:{p}") else "backward_end")
                for p in paths
            ],
            loss_peak=t.peak(last_fwd if t.has(last_fwd) else None, "forward_end"),
            head_peak=t.peak("backward_start", first_bwd),
            tail_peak=t.peak(end_first, "backward_end"),
            grads=[self.grads_at.get(p, 0) for p in paths],
            forward_gap=[gap(f"fpost:{p}", f"fpre:{q}") for p, q in pairs],
            backward_gap=[gap(f"end:{q}", f"start:{p}") for p, q in pairs],
        )

    def transient(self, path: str) -> int:
        """Peak of block `path`'s backward above the level when it starts."""
        t = self.tracker
        if not t.has(f"start:{path}"):
            return 0
        end = f"end:{path}" if t.has(f"end:{path}") else "backward_end"
        return max(0, t.peak(f"start:{path}", end) - t.level(f"start:{path}"))


def typical(group: BlockGroup, probe: BlockProbe) -> tuple[str, bool]:
    """The block whose figures in the model a group's plain block is moved from, and whether the
    probe runs with its input requiring a gradient: the second block where the first one's input
    needs none (`variants.later_input`)."""
    if later_input(probe, len(group.paths)):
        return group.paths[1], True
    return group.paths[0], False


def plain_alone(
    probe: BlockProbe, autocast: torch.dtype | None, pair: bool, input_grad: bool = False
) -> tuple[AloneMemory, AloneMemory, AloneMemory | None]:
    """The probed block alone (`variants.alone_memory`) checkpointed, plain, and (`pair`) plain
    next to a plain block: a whole-model run per plain measurement costs a step, this a block."""
    ckpt = alone_memory(probe, FULL_RECOMPUTE, autocast, input_grad=input_grad)
    plain = alone_memory(probe, None, autocast, input_grad=input_grad)
    if not pair:
        return ckpt, plain, None
    return ckpt, plain, alone_memory(probe, None, autocast, True, input_grad)


def from_alone(
    mem: StepMemory,
    group: str,
    run: _Run,
    path: str,
    ckpt: AloneMemory,
    plain: AloneMemory,
    pair: AloneMemory | None,
) -> None:
    """A group's plain-block fields: what the full-recomputation `run` measured in the model for
    the block standing for the group (`path`, `typical`), moved by the difference plain -
    checkpointed measured alone (the model around the block, the same under both, cancels out);
    the checkpointed block alone is kept as the action tables' base (`variants.recompute_key`)."""
    mem.recompute_alone[group] = [ckpt.forward, ckpt.backward]
    held = run.report.blocks[path]
    mem.full[group] = held + plain.held - ckpt.held
    mem.plain_casts[group] = plain.casts
    mem.plain_fwd_transient[group] = run.forward_transient(path) + plain.forward - ckpt.forward
    mem.plain_transient[group] = run.transient(path) + plain.backward - ckpt.backward
    if pair is not None:
        mem.full_interior[group] = held + pair.held - ckpt.held


def measure(
    base: nn.Module,
    batch: dict[str, Any],
    groups: list[BlockGroup],
    specs: dict[str, list[OpSpec]],
    autocast: torch.dtype | None = None,
    room: int | None = None,
    heads: dict[str, HeadCost] | None = None,
    probes: Mapping[str, BlockProbe] | None = None,
) -> StepMemory:
    """Run the measurements of the module docstring (every group's ops in `specs`), forwards
    under `autocast` (a dtype, or None), each inside `room` bytes (None: no limit) with the heads'
    costs `heads` (`head.measure_heads`); a group with a probe (`variants.BlockProbe`: its first
    block and the inputs it got) has its plain block measured alone (`plain_alone`)."""
    backward = not sharded(base)
    kwargs = model_kwargs(base, batch)
    device = next(base.parameters()).device
    heads = heads or {}
    head = timeline_head(base, groups, batch, heads, room)
    skipped = [] if head == "full" else ["full LM head in the timeline"]

    def amp():
        return autocast_context(device, autocast)

    def policy(first: str | None, kind: str = "plain") -> Policy:
        return timeline_policy(base, groups, specs, first, kind, head)

    with train_mode(base), torch.random.fork_rng(devices=devices_of(base)):
        with apply_adacc(base, policy(None)):
            run = _Run(base, kwargs, amp(), backward)
        top = run.tracker.peak()
        plain_runs, pair_runs, alone = {}, {}, {}
        for g in groups:
            # A block alone needs at most what full recomputation's run did (a block recomputed
            # beside the rest), two plain blocks one plain block more: a whole-model run with
            # plain blocks holds theirs beside the rest.
            probe = (probes or {}).get(g.name) if backward else None
            extra = (0, 1) if probe is not None else (1, 2)
            if room is not None and top + plain_nbytes(specs[g.name], extra[0]) > room:
                skipped.append(f"plain {g.name}")
                continue
            pair = len(g.modules) > 1
            if pair and room is not None and top + plain_nbytes(specs[g.name], extra[1]) > room:
                skipped.append(f"pair {g.name}")
                pair = False
            if probe is not None:
                path, grad = typical(g, probe)
                alone[g.name] = path, plain_alone(probe, autocast, pair, grad)
                continue
            with apply_adacc(base, policy(g.name)):
                plain_runs[g.name] = _Run(base, kwargs, amp(), backward)
            if pair:
                with apply_adacc(base, policy(g.name, "pair")):
                    pair_runs[g.name] = _Run(base, kwargs, amp(), False)
    rep = run.report
    held = {g.name: round(sum(rep.blocks[p] for p in g.paths) / len(g.paths)) for g in groups}

    mem = StepMemory(
        held=held,
        full={g.name: r.report.blocks[g.paths[0]] for g in groups if (r := plain_runs.get(g.name))},
        plain_casts={
            g.name: r.report.casts[g.paths[0]] for g in groups if (r := plain_runs.get(g.name))
        },
        before=rep.before,
        after=rep.after,
        largest_other=rep.largest_other,
        output_nbytes={g.name: max(run.outputs.get(p, 0) for p in g.paths) for g in groups},
        measured_backward=backward,
        skipped=skipped,
    )
    t = run.tracker
    order = [p for p, _ in get_adapter(base).find_blocks(base)]  # forward order
    last = f"fpost:{order[-1]}"
    start = last if t.has(last) else None
    mem.forward_transient = max(0, t.peak(start, "forward_end") - t.level("forward_end"))
    for g in groups:
        mem.block_fwd_transient[g.name] = max(run.forward_transient(p) for p in g.paths)
        if g.name in alone:
            path, measured = alone[g.name]
            from_alone(mem, g.name, run, path, *measured)
        elif g.name in plain_runs:
            r = plain_runs[g.name]
            mem.plain_fwd_transient[g.name] = r.forward_transient(g.paths[0])
            if backward:
                mem.plain_transient[g.name] = r.transient(g.paths[0])
        else:
            skipped_plain(mem, g, specs[g.name], cast_nbytes(g.modules[0], autocast))
        if g.name in pair_runs:  # a plain block next to a plain one: its output may not be held
            mem.full_interior[g.name] = pair_runs[g.name].report.blocks[g.paths[0]]
    if not backward:
        return estimate(mem, specs)
    first = run.order[0] if run.order else None
    mem.head_transient = max(
        0,
        t.peak("backward_start", f"start:{first}" if first else "backward_end")
        - t.level("backward_start"),
    )
    if run.order:
        last = f"end:{run.order[-1]}"
        if t.has(last):
            mem.tail_transient = max(0, t.peak(last, "backward_end") - t.level(last))
    for g in groups:
        mem.block_transient[g.name] = max(run.transient(p) for p in g.paths)
    mem.timeline = run.timeline(order)
    to_own_head(mem, heads, head)
    return mem
