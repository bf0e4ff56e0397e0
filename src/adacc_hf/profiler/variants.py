"""A block's transients under one action table, measured on the block alone.

How much a checkpointed block's recompute and backward allocate depends on what it keeps (a kept
output is handed back, not rerun; where backward peaks decides how much that saves), so after a
solve the session measures each action table (variant) the policy uses: the block that was
profiled runs once with it and once under full recomputation, on the inputs it got in the profiled
forward, and the differences of their forward and backward peaks go into the profile
(``Profile.variant_transients``). The step model adds them to the measured full-recomputation
timeline.

Each table's time is measured there too (``Profile.variant_ms``): the block's forward + backward
under it over the plain block's, interleaved rounds. Per-op times summed and scaled by the
block's full recomputation (`calibrate`) miss what a partly kept block pays: on the CPU suite's
GPT-2 they put such a block at 0.6-1.3x of what it measured. `cost_model.predict` uses the
measured time of each table the policy runs.

For a model that will run compiled (``compile=``), a table and full recomputation are measured
compiled instead (`block_levels`: the allocator's levels, since compiled code allocates past any
dispatch mode, on a fresh copy of the call's code so no user graph cache fills), and so are their
times, over the plain block compiled: a compiled graph recomputes only what backward reads and
fuses the rest (llama-cpu: the MLP's down projection, 1.7 ms eager, costs nothing compiled).

Inside a budget (``room``: the bytes profiling may add), a table whose run is predicted not to fit
(`table_nbytes`: its block's input, output and gradients, and its peaks as the step model
estimates them unmeasured) is skipped: the step model then counts the table unmeasured, from its
kept bytes, staged copies and workspaces, mostly the conservative side (plans that offload ops
were predicted up to 22 % over their step so). Timing runs the plain block too: where that does
not fit (`run_nbytes`: everything the plain block saves, its backward transient, its gradients and
its output's), a measured table is priced by its ops.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import PolicyError
from ..runtime.checkpoint import own_eager_runs
from ..runtime.context import autocast_context, detached_input
from ..runtime.memory import StorageRecorder, young_objects
from ..runtime.peak import AllocationTracker
from ..schema import OpSpec, Profile, Variant, variant_key
from ..solver.cost_model import variant_load
from ..solver.loads import unmeasured_peaks
from .calibrate import MIN_ROUNDS, added_ms, interleaved_ms, table_runtimes

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


@dataclass
class AloneMemory:
    """A block run alone on its recorded input (`alone_memory`), in bytes."""

    held: int  # created by its forward and alive after it, its output included
    casts: int  # of `held`, autocast's casts of parameters
    forward: int  # the forward's peak above its start
    backward: int  # the backward's peak above its start (its output's gradient arrived)


def _inputs(probe: BlockProbe, input_grad: bool) -> tuple[Any, Any, list, torch.device]:
    """(leaf, what the block gets, trainable parameters, device) for running `probe`'s block
    alone; `input_grad`: its input requires a gradient even where the recorded one does not."""
    x0 = probe.args[0]
    if input_grad and isinstance(x0, torch.Tensor) and x0.is_floating_point():
        x0 = x0.detach().requires_grad_()
    x, x_in = detached_input(x0)
    return x, x_in, [p for p in probe.block.parameters() if p.requires_grad], x.device


def alone_memory(
    probe: BlockProbe,
    variant: Variant | None,
    autocast: torch.dtype | None = None,
    then_plain: bool = False,
    input_grad: bool = False,
) -> AloneMemory:
    """The block under `variant` (None: plain) as in a model: its output kept (the next block
    reads it), its output's gradient made inside autograd (freed once used, as a next block's
    backward hands it over), gradients of its parameters and input. `then_plain`: the block runs
    again, plain and forward only, on its own output, for what it holds when the next block is
    plain too (``backward`` is then 0). `input_grad`: its input requires a gradient even where
    the recorded one does not (the first block of a model with frozen embeddings)."""
    x, x_in, params, device = _inputs(probe, input_grad)
    tracker, rec = AllocationTracker(device), StorageRecorder()
    rec.where = "block"
    table = {"variant": variant if variant is not None and variant.checkpoint else None}
    with (
        young_objects(),
        table_runtimes(probe.block, probe.path, probe.group, probe.ops, table) as runtimes,
    ):
        runtime = runtimes["variant"]
        with tracker:
            tracker.mark("start")
            with rec, autocast_context(device, autocast):
                args = (x_in, *probe.args[1:])
                y = _hidden(runtime(probe.fn, *args) if runtime is not None else probe.fn(*args))
                tracker.mark("forward_end")
                if then_plain:
                    rec.where = "next"
                    y = _hidden(probe.fn(y, *probe.args[1:]))
            held = [(n, cast) for n, where, _, cast in rec.alive() if where == "block"]
            if not then_plain:
                y.register_hook(lambda g: tracker.mark("backward_start"))
                loss = (y * torch.ones_like(y)).sum()
                inputs = [t for t in (x, *params) if t.requires_grad]
                grads = torch.autograd.grad(loss, inputs, allow_unused=True)
                tracker.mark("backward_end")
                del grads, loss
            del y
    fwd = tracker.peak("start", "forward_end") - tracker.level("start")
    bwd = 0
    if not then_plain:
        bwd = tracker.peak("backward_start", "backward_end") - tracker.level("backward_start")
    return AloneMemory(
        sum(n for n, _ in held), sum(n for n, c in held if c), max(0, fwd), max(0, bwd)
    )


@dataclass(frozen=True)
class Levels:
    """One block run alone: bytes its forward leaves alive (its output included), and the peaks
    of its forward and backward above their starts."""

    held: int
    forward: int
    backward: int


def fresh_code(fn: Callable) -> Callable:
    """`fn` with its own code object: dynamo caches compiled graphs on the code object, so each
    measurement compiles afresh and fills no cache a user's model compiles into."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def block_call(runtime: Any, fn: Callable, backend: str | None) -> Callable:
    """The block's forward `fn` under a table's `runtime` (None: plain), compiled with `backend`
    on a fresh copy of the code (`fresh_code`), or eager (None)."""

    def forward(*args: Any) -> Any:
        return runtime(fn, *args) if runtime is not None else fn(*args)

    return (
        torch.compile(fresh_code(forward), backend=backend, dynamic=False) if backend else forward
    )


def block_levels(
    probe: Any,
    variant: Variant | None,
    autocast: torch.dtype | None,
    backend: str | None,
    input_grad: bool = False,
) -> Levels:
    """`probe`'s block alone under `variant` (None: plain), eager (`backend` None) or compiled
    with `backend`: one untimed forward + backward first (compilation, lazy state), then one
    measured as `variants.alone_memory` runs it (output kept, its gradient made inside autograd;
    `input_grad`: its input requires one, as a later block's does)."""
    x, x_in, params, device = _inputs(probe, input_grad)
    table = {"v": variant}
    block = probe.block
    with table_runtimes(block, probe.path, probe.group, probe.ops, table, bool(backend)) as rts:
        call = block_call(rts["v"], probe.fn, backend)

        def once(tracker: AllocationTracker | None) -> None:
            mark = tracker.mark if tracker is not None else (lambda name: None)
            mark("start")
            with autocast_context(device, autocast):
                out = call(x_in, *probe.args[1:])
            y = _hidden(out)
            mark("forward_end")
            y.register_hook(lambda g: mark("backward_start"))
            loss = (y * torch.ones_like(y)).sum()
            inputs = [t for t in (x, *params) if t.requires_grad]
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
            mark("backward_end")
            del grads, loss, y, out

        with own_eager_runs():
            once(None)
            tracker = AllocationTracker(device)
            with tracker:
                once(tracker)
    start = tracker.level("start")
    return Levels(
        held=tracker.level("forward_end") - start,
        forward=max(0, tracker.peak("start", "forward_end") - start),
        backward=max(
            0, tracker.peak("backward_start", "backward_end") - tracker.level("backward_start")
        ),
    )


def later_input(probe: BlockProbe, num_blocks: int) -> bool:
    """Whether the probed (first) block's input needs no gradient where a later block's does
    (frozen embeddings: LoRA). The first block then saves no statistics of its input norm and
    computes no input gradient: run alone, its input is made to require one, so it stands for
    the later blocks (the conservative side for itself)."""
    x = probe.args[0]
    return num_blocks > 1 and isinstance(x, torch.Tensor) and not x.requires_grad


def recompute_key(group: str) -> str:
    """Where ``Profile.variant_transients`` keeps the group's block alone under full
    recomputation: (forward, backward) peaks, the base every table's difference is taken from."""
    return f"{group}:full"


def variant_times(
    probe: BlockProbe,
    variants: list[Variant],
    autocast: torch.dtype | None = None,
    rounds: int = MIN_ROUNDS,
    compile: str | None = None,
) -> list[float]:
    """Added ms of the block under each checkpointed variant over the plain block (forward +
    backward, `calibrate.interleaved_ms`; medians of each round's differences); `compile`: each
    compiled with this backend, the plain block too."""
    tables: dict[str, Variant | None] = {str(i): v for i, v in enumerate(variants)}
    tables["plain"] = None
    block, device = probe.block, probe.args[0].device
    with table_runtimes(block, probe.path, probe.group, probe.ops, tables, bool(compile)) as rts:
        runs: dict[str, Any] = rts
        if compile:  # as `interleaved_ms` calls a runtime: (fn, *args), the call compiled
            calls = {n: block_call(rt, probe.fn, compile) for n, rt in rts.items()}
            runs = {n: lambda _fn, *a, c=c: c(*a) for n, c in calls.items()}
        with own_eager_runs():
            times = interleaved_ms(block, probe.fn, probe.args, runs, device, rounds, autocast)
    return [added_ms(times, str(i), "plain") for i in range(len(variants))]


def run_nbytes(profile: Profile, group: str) -> int:
    """What a run of `group`'s block alone may add at most: everything the plain block saves and
    its backward transient, its parameters' gradients and its output's gradient."""
    g = profile.groups[group]
    return (
        max(g.full_nbytes, g.input_nbytes)
        + max(g.plain_transient_nbytes, g.transient_nbytes)
        + g.grad_nbytes
        + g.output_nbytes
    )


def table_nbytes(profile: Profile, group: str, variant: Variant) -> int:
    """What measuring `variant`'s memory on `group`'s block alone (full recomputation's too, the
    base of its differences) may add: the block's input and output, their gradients and
    its parameters', and the higher of its forward and backward peaks as the step model estimates
    a table it has not measured (`solver.loads.unmeasured_peaks`). No plain block runs there (only
    timing runs one, `run_nbytes`), so a table the budget leaves room to measure but not to time
    is measured, and priced by its ops."""
    g = profile.groups[group]
    try:
        load, _, _ = variant_load(profile, group, variant)
    except PolicyError:  # it offloads, but the profile has no host link: the plain run's bound
        return run_nbytes(profile, group)
    edges = 2 * (g.input_nbytes + g.output_nbytes) + g.grad_nbytes
    return edges + max(unmeasured_peaks(load, g))  # full recomputation's peaks are below


def _levels(
    probe: BlockProbe,
    variant: Variant,
    autocast: torch.dtype | None,
    compile: str | None,
    input_grad: bool,
) -> AloneMemory | Levels:
    """The block alone under `variant`: eager (`alone_memory`) or compiled (`block_levels`);
    either has the forward and backward peaks a table's difference is taken from."""
    if compile is None:
        return alone_memory(probe, variant, autocast, input_grad=input_grad)
    return block_levels(probe, variant, autocast, compile, input_grad)


def _entry(m: AloneMemory | Levels, compile: str | None) -> list[int]:
    """A table's ``Profile.variant_transients`` entry before the difference: its forward and
    backward peaks, and compiled its held bytes too (a compiled graph saves a kept output only
    where backward reads it: `cost_model.compiled_held`)."""
    if compile:
        assert isinstance(m, Levels)
        return [m.forward, m.backward, m.held]
    return [m.forward, m.backward]


def measure_variants(
    profile: Profile,
    probes: dict[str, BlockProbe],
    variants: list[tuple[str, Variant]],
    autocast: torch.dtype | None = None,
    rounds: int = MIN_ROUNDS,
    room: int | None = None,
    compile: str | None = None,
) -> int:
    """Measure each (group, variant) not yet in ``profile.variant_transients`` against full
    recomputation on the same block and record the differences, and time it (`variant_times`,
    ``profile.variant_ms``); within `room` bytes (None: no limit). `compile`: the blocks run
    compiled with this backend, so both are measured and timed compiled (`block_levels`).
    Returns how many were new."""
    new: dict[str, dict[str, Variant]] = {}
    cuda = sorted({p.args[0].device.index or 0 for p in probes.values() if p.args[0].is_cuda})
    with torch.random.fork_rng(devices=cuda):
        for group, variant in variants:
            key = variant_key(group, variant)
            probe = probes.get(group)
            if probe is None or key in profile.variant_transients or not variant.checkpoint:
                continue
            if (
                room is not None
                and group in profile.groups
                and table_nbytes(profile, group, variant) > room
            ):
                continue
            g = profile.groups.get(group)
            later = later_input(probe, g.num_blocks if g is not None else 1)
            base_key = recompute_key(group) + (f":{compile}" if compile else "")
            base = profile.variant_transients.get(base_key)
            if base is None or len(base) < (3 if compile else 2):
                full = _levels(probe, FULL_RECOMPUTE, autocast, compile, later)
                base = profile.variant_transients[base_key] = _entry(full, compile)
            m = _entry(_levels(probe, variant, autocast, compile, later), compile)
            profile.variant_transients[key] = [a - b for a, b in zip(m, base, strict=True)]
            new.setdefault(group, {})[key] = variant
    for group, timed in new.items():
        if room is not None and group in profile.groups and run_nbytes(profile, group) > room:
            continue  # the plain block it is timed against does not fit: priced by its ops
        ms = variant_times(probes[group], list(timed.values()), autocast, rounds, compile)
        profile.variant_ms.update(zip(timed, ms, strict=True))
    return sum(len(t) for t in new.values())


def measure_policy(
    profile: Profile,
    probes: dict[str, BlockProbe],
    policy: Any,
    autocast: torch.dtype | None = None,
    rounds: int = MIN_ROUNDS,
    room: int | None = None,
    compile: str | None = None,
) -> int:
    """`measure_variants` of every action table `policy` (a `Policy`) runs on some block."""
    used = [(name, v) for name, g in policy.groups.items() for v in g.variants if v.count]
    return measure_variants(profile, probes, used, autocast, rounds, room, compile)
