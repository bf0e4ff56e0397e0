"""A model's memory under ``torch.compile``, measured on the compiled model by parts.

The profile's timeline is measured eagerly; a compiled model holds other bytes. Inductor fuses a
plain block's pointwise chains and saves fewer tensors (GPT-2 117M on an H200: the eager plan's
7280 MiB step ran in 4297 MiB compiled), fuses the loss, and schedules one backward graph for
the whole model (the tiny LLaMA under full recomputation: +20 % over the eager step).

`measure_compiled` moves an eager profile to the model compiled whole with a backend:

* `compiled_shifts`: each group's profiled block alone (`variants.block_levels`, on the inputs
  it got), checkpointed under full recomputation and plain, each eager and compiled, measured
  the same way (the allocator's levels: compiled code allocates past any dispatch mode). The
  differences move what a checkpointed block holds (its input, and the timeline's levels after
  it), what a plain block holds, and the transients of both (`shift_profile`);
* `head_shift`: the model's own LM head and loss, eager and compiled, moves the timeline's loss
  and head moments;
* the whole step, eager and compiled, under full recomputation and with one plain block: what
  the compiled model holds beyond its parts is the residual the step model adds
  (`solver.step.compiled_residual`).

A kept op still costs its output bytes (a ``MUST_SAVE`` tag saves the op's output, as the eager
runtime keeps it) but no dispatch-mode overhead (`compiled_costs`). Every compiled call is made on a
fresh copy of its function's code (`variants.fresh_code`), so no graph lands in a cache the
user's model compiles into.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..policy import Policy
from ..runtime import apply_adacc
from ..runtime.context import autocast_context, devices_of, train_mode
from ..runtime.peak import measure_step_peak
from ..schema import HeadCost, Profile, Timeline, Variant
from ..solver.cost_model import block_loads, plan_key_of
from ..solver.step import in_forward_order, step_peak
from .head import head_cost, head_hidden, head_losses, lm_head
from .memory import timeline_policy
from .variants import FULL_RECOMPUTE, Levels, block_levels, fresh_code

logger = logging.getLogger("adacc_hf")


@dataclass(frozen=True)
class Shift:
    """Compiled minus eager, per group: a checkpointed block under full recomputation (`ckpt`) and
    a plain block (`plain`)."""

    ckpt: Levels
    plain: Levels

    def to_json(self) -> dict[str, list[int]]:
        return {
            k: [v.held, v.forward, v.backward]
            for k, v in (("ckpt", self.ckpt), ("plain", self.plain))
        }


def _minus(a: Levels, b: Levels) -> Levels:
    return Levels(a.held - b.held, a.forward - b.forward, a.backward - b.backward)


def compiled_shifts(
    probes: Mapping[str, Any], autocast: torch.dtype | None, backend: str
) -> dict[str, Shift]:
    """Per group with a probe: its block's levels compiled with `backend` minus eager."""
    out = {}
    for name, probe in probes.items():
        got = {
            (v is None, b): block_levels(probe, v, autocast, b)
            for v in (FULL_RECOMPUTE, None)
            for b in (None, backend)
        }
        out[name] = Shift(
            ckpt=_minus(got[(False, backend)], got[(False, None)]),
            plain=_minus(got[(True, backend)], got[(True, None)]),
        )
    return out


def head_shift(
    base: nn.Module, batch: Mapping[str, Any], autocast: torch.dtype | None, backend: str
) -> HeadCost | None:
    """The model's own LM head and loss (`head.measure_heads`'s ``"full"`` way) compiled with
    `backend` minus eager, on the whole batch (None: a model without a separate LM head or a
    batch without labels: the head stays as measured)."""
    found = lm_head(base, batch)
    if found is None:
        return None
    lm, labels, params = found
    device = lm.weight.device
    full = head_losses(base, lm, labels, 1)["full"]
    compiled = torch.compile(fresh_code(full), backend=backend, dynamic=False)
    x = head_hidden(lm, labels)

    def amp() -> Any:
        return autocast_context(device, autocast)

    with train_mode(base):
        eager = head_cost(full, x, params, amp, 0)
        head_cost(compiled, x, params, amp, 0)  # compiles
        comp = head_cost(compiled, x, params, amp, 0)
    return HeadCost(
        comp.held - eager.held,
        comp.forward_peak - eager.forward_peak,
        comp.backward_peak - eager.backward_peak,
        0.0,
    )


def compiled_costs(profile: Profile) -> None:
    """A compiled block keeps ops as selective-checkpoint tags, without the eager runtime's
    dispatch modes: no overhead per keeping block (``GroupProfile.dispatch_ms``). And its graph
    recomputes only what backward reads: an op that feeds no backward (``OpSpec.feeds_backward``,
    llama's MLP down projection) costs nothing to recompute, so keeping it buys nothing."""
    for g in profile.groups.values():
        g.dispatch_ms = 0.0
        g.ops = [op if op.feeds_backward else dataclasses.replace(op, fwd_ms=0.0) for op in g.ops]


def shift_profile(
    profile: Profile, shifts: Mapping[str, Shift], head: HeadCost | None = None
) -> None:
    """Move `profile` (measured eagerly) by each group's `Shift` and the LM head's, in place
    (module docstring)."""
    order = profile.block_order()
    tl = profile.timeline
    if head is not None:
        if "full" in profile.heads:  # the other heads' shifts are taken from the model's own
            own = profile.heads["full"]
            profile.heads["full"] = HeadCost(
                own.held + head.held,
                own.forward_peak + head.forward_peak,
                own.backward_peak + head.backward_peak,
                own.ms,
            )
        # the level forward ends at moves by the held difference, its peak by the forward's
        profile.forward_transient_nbytes += head.forward_peak - head.held
        if tl is not None:
            tl.loss_peak += head.forward_peak
            tl.head_peak += head.backward_peak
    for name, s in shifts.items():
        g = profile.groups[name]
        g.input_nbytes += s.ckpt.held
        g.forward_transient_nbytes = max(0, g.forward_transient_nbytes + s.ckpt.forward)
        g.transient_nbytes = max(0, g.transient_nbytes + s.ckpt.backward)
        g.full_nbytes += s.plain.held
        if g.full_interior_nbytes:
            g.full_interior_nbytes += s.plain.held
        g.plain_forward_transient_nbytes = max(
            0, g.plain_forward_transient_nbytes + s.plain.forward
        )
        g.plain_transient_nbytes = max(0, g.plain_transient_nbytes + s.plain.backward)
    compiled_costs(profile)
    if tl is None:
        return
    zero = Levels(0, 0, 0)
    per_block = [shifts[n].ckpt if n in shifts else zero for n, _ in order]
    profile.timeline = shifted_timeline(tl, per_block)


def shifted_timeline(tl: Timeline, per_block: list[Levels]) -> Timeline:
    """`tl` with block j holding ``per_block[j].held`` more (every later level moves with it) and
    its forward / backward transients moved by the other two."""
    before, upto = [], []
    acc = 0
    for lv in per_block:
        before.append(acc)
        acc += lv.held
        upto.append(acc)
    total = acc

    def gap(values: list[int]) -> list[int]:
        return [v + upto[j] if v else 0 for j, v in enumerate(values)]

    return Timeline(
        held=[h + lv.held for h, lv in zip(tl.held, per_block, strict=True)],
        forward_start=[s + before[j] for j, s in enumerate(tl.forward_start)],
        forward_peak=[
            p + before[j] + max(-(p - tl.forward_start[j]), per_block[j].forward)
            for j, p in enumerate(tl.forward_peak)
        ],
        backward_start=[s + upto[j] for j, s in enumerate(tl.backward_start)],
        backward_peak=[
            p + upto[j] + max(-(p - tl.backward_start[j]), per_block[j].backward)
            for j, p in enumerate(tl.backward_peak)
        ],
        loss_peak=tl.loss_peak + total,
        head_peak=tl.head_peak + total,
        tail_peak=tl.tail_peak,
        grads=list(tl.grads),
        forward_gap=gap(tl.forward_gap),
        backward_gap=gap(tl.backward_gap),
    )


def timeline_phases(profile: Profile) -> tuple[int, int]:
    """The highest moments of forward and of backward under full recomputation with the model's
    own head, as `solver.step.step_peak` puts them (above the step's resident bytes)."""
    tl = profile.timeline
    if tl is None:
        return 0, 0
    end = tl.loss_peak - profile.forward_transient_nbytes
    forward = max([*tl.forward_peak, *tl.forward_gap, tl.loss_peak])
    backward = max([tl.head_peak, end, *tl.backward_peak, *tl.backward_gap, tl.tail_peak])
    return forward, backward


class _Whole(nn.Module):
    """A compiled call of `base` as a module (`measure_step_peak` reads its parameters)."""

    def __init__(self, base: nn.Module, call: Callable) -> None:
        super().__init__()
        self.base = base
        self.call = call

    def forward(self, **kwargs: Any) -> Any:
        return self.call(**kwargs)


def whole_step_phases(
    base: nn.Module,
    batch: Mapping[str, Any],
    autocast: torch.dtype | None,
    backend: str,
    policy: Policy,
    eager: bool = True,
) -> tuple[dict[str, int], dict[str, int]]:
    """The model's forward + backward under `policy` measured whole (`measure_step_peak`'s
    phases, as bytes above the live state), eager (unless not `eager`: empty) and compiled with
    `backend` (a fresh copy of the code: `fresh_code`)."""

    def run(**kwargs: Any) -> Any:
        return base(**kwargs)

    def added(peak: Any) -> dict[str, int]:
        return {k: v - peak.baseline_nbytes for k, v in peak.phases.items()}

    with apply_adacc(base, policy), train_mode(base):
        before = added(measure_step_peak(base, batch, autocast=autocast)) if eager else {}
        base.zero_grad(set_to_none=True)
        whole = _Whole(base, torch.compile(fresh_code(run), backend=backend, dynamic=False))
        measure_step_peak(whole, batch, autocast=autocast)  # compiles
        base.zero_grad(set_to_none=True)
        compiled = added(measure_step_peak(whole, batch, autocast=autocast))
        base.zero_grad(set_to_none=True)
    return before, compiled


def measure_compiled(
    profile: Profile,
    base: nn.Module,
    batch: Mapping[str, Any],
    autocast: torch.dtype | None,
    backend: str,
    probes: Mapping[str, Any],
    groups_specs: tuple[list, dict],
    room: int | None = None,
) -> None:
    """Move `profile` (measured eagerly) to the blocks and head compiled with `backend`, and
    record in ``profile.compiled`` the shifts and the whole step's residuals: what the model
    compiled whole holds beyond its compiled parts, in forward and backward (at least 0), with
    every block checkpointed (``residual``) and with a plain block among them
    (``residual_plain``: the first group's first block plain). Inductor schedules one backward
    graph for the whole model, which the parts measured alone do not see; on GPT-2 the residual
    with every block recomputed (17.8 MiB on the CPU preset) mostly goes once any block is plain.
    The run with a plain block is skipped when it would not fit `room` (the bytes profiling may
    add; None: no limit): ``residual_plain`` is then ``residual``. A plan with a plain block
    would not fit that room either, so the stand-in hardly matters (it is smaller on the tiny
    llama: 0.4 against 32 KiB; larger on GPT-2). The gradients already in ``.grad`` are put
    back."""
    before = timeline_phases(profile)
    shifts = compiled_shifts(probes, autocast, backend)
    head = head_shift(base, batch, autocast, backend)
    shift_profile(profile, shifts, head)
    after = timeline_phases(profile)
    groups, specs = groups_specs
    # the first group's first block plain moves every later level by its held difference
    first = shifts.get(groups[0].name)
    plain_move = first.plain.held - first.ckpt.held if first is not None else 0
    residuals: list[list[int]] = []
    full_phases: dict[str, int] = {}  # the compiled step under full recomputation
    need = 0  # the bytes the all-checkpointed compiled step added
    with grads_aside(base):
        for plain, move in ((None, 0), (groups[0].name, plain_move)):
            if residuals and room is not None and need + move > room:
                logger.info(
                    "adacc: compiled profile: the whole step with a plain block (%.1f MiB) does "
                    "not fit the %.1f MiB profiling may use: its residual is taken as full "
                    "recomputation's",
                    (need + move) / 2**20,
                    room / 2**20,
                )
                residuals.append(residuals[0])
                continue
            policy = timeline_policy(base, groups, specs, plain)
            eager, comp = whole_step_phases(base, batch, autocast, backend, policy)
            full_phases = full_phases or comp
            need = max(comp.values(), default=0)
            residuals.append(
                [
                    max(0, (comp[ph] - eager[ph]) - (a - b) - move)
                    for ph, a, b in (
                        ("forward", after[0], before[0]),
                        ("backward", after[1], before[1]),
                    )
                ]
            )
    profile.compiled = {
        "backend": backend,
        "shifts": {k: v.to_json() for k, v in shifts.items()},
        "head": dataclasses.asdict(head) if head is not None else None,
        "residual": residuals[0],
        "residual_plain": residuals[1],
        "full_phases": [full_phases["forward"], full_phases["backward"]],
    }


@contextlib.contextmanager
def grads_aside(base: nn.Module) -> Iterator[None]:
    """`base`'s parameters without gradients for the body (a measured step starts without any),
    the gradients they had put back after."""
    grads = {p: p.grad for p in base.parameters()}
    for p in grads:
        p.grad = None
    try:
        yield
    finally:
        for p, g in grads.items():
            p.grad = g


@contextlib.contextmanager
def lifted(base: nn.Module) -> Iterator[None]:
    """The policy applied to `base` (a new bucket planned mid-run) removed for the body, whose
    runs patch the model themselves, and put back after."""
    handle = base.__dict__.get("_adacc_handle")
    active = handle.policy if handle is not None and handle.active else None
    if active is not None:
        handle.remove()
    try:
        yield
    finally:
        if active is not None:
            handle.set_policy(active)


def model_phases(
    profile: Profile, policy: Policy, residual: tuple[int, int] | None = None
) -> tuple[int, int]:
    """The highest forward and backward moments the step model (no static bytes, one
    micro-batch) puts `policy` at, with the compiled `residual` (None: the profile's)."""
    loads, _, _ = block_loads(profile, policy, measured_ms=False)
    blocks = in_forward_order(profile, loads)
    moments = step_peak(profile, blocks, 0, 1, policy.head, residual).moments
    fwd = max(v for k, v in moments.items() if k.startswith(("forward", "between")))
    bwd = max(v for k, v in moments.items() if k.startswith(("head", "backward", "tail")))
    return fwd, bwd


def all_recomputed(policy: Policy) -> Policy:
    """`policy`'s groups with every block checkpointed and recomputed, the model's own head."""
    full = Policy.from_json(policy.to_json())
    for g in full.groups.values():
        g.variants = [Variant(g.num_blocks, True, {})]
    full.head = "full"
    return full


def measure_plan(
    profile: Profile,
    base: nn.Module,
    batch: Mapping[str, Any],
    autocast: torch.dtype | None,
    policy: Policy,
) -> None:
    """Measure `policy`'s whole step compiled and record its own residual in
    ``profile.compiled["plans"]`` (`solver.step.compiled_residual`).

    The tags change what the partitioner saves around them, which the parts measured alone do
    not see (on the CPU suite's GPT-2, plans keeping ops held 6-14 % under their prediction, and
    a plain last block's step more than the plain-block residual says). The step is anchored on
    full recomputation's, measured whole with the profile: the plan is predicted at full
    recomputation's prediction plus what its compiled step measured above full recomputation's,
    phase by phase. The gradients already in ``.grad`` are put back."""
    full = profile.compiled
    backend, measured_full = full["backend"], full["full_phases"]
    with grads_aside(base), lifted(base), torch.random.fork_rng(devices=devices_of(base)):
        _, comp = whole_step_phases(base, batch, autocast, backend, policy, eager=False)
    anchor = model_phases(profile, all_recomputed(policy))
    bare = model_phases(profile, policy, (0, 0))
    full.setdefault("plans", {})[plan_key_of(profile, policy)] = [
        anchor[k] + (comp[ph] - measured_full[k]) - bare[k]
        for k, ph in enumerate(("forward", "backward"))
    ]
