"""A group's op times anchored to what a training step pays: the profiled block's forward +
backward timed whole under four action tables.

Op times measured one at a time miss what the step adds around them: memory traffic and page
faults of fresh outputs, OpenMP barriers when another job holds a core, the runtime's dispatch
modes and checkpoint machinery. So the block that was profiled runs forward + backward, on the
inputs it got, interleaved (medians; `timing.steady_ms`: on a GPU among blocks run back to back), as

- ``plain``: no checkpointing;
- ``recompute``: full recomputation (transformers' checkpointing: no dispatch modes);
- ``keep``: every cacheable op retained (the block's output recomputed, as the solver must);
- ``compress``: the same, with each op that has a profiled codec compressed by its cheapest one.

The differences are the truth the per-op figures are scaled to (`Calibration.apply`):
``recompute - plain`` = all recompute (ops + fixed), ``keep - plain`` = the block's output ops'
recompute + the runtime's overhead on a block that keeps any op (``dispatch_ms``; never below
the Python work its dispatch modes do on the calling thread, `overhead.dispatch_overhead_ms`,
timed by its least-disturbed runs), ``compress - keep`` = the codecs' encode + decode. Each is
work added, never below 0 (`added_ms`): a difference lost in noise scales the profiled figures
by the least `SCALE_RANGE` allows, never to a saving.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..runtime import saved_codecs
from ..runtime.checkpoint import BlockRuntime
from ..runtime.context import autocast_context, detached_input
from ..runtime.offload import HostStore
from ..runtime.overhead import dispatch_overhead_ms
from ..runtime.timing import modelled_clock, paired_added_ms, steady_ms
from ..schema import Action, GroupPolicy, OpProfile, OpSpec, Variant

#: Scales outside this range are noise (e.g. a block of microseconds), not a measurement, unless
#: every round measured the added time above zero (`_scale`); then up to `RESOLVED_RANGE` (a codec
#: that costs 12x its isolated time inside a step was seen on a fast CPU: clamped to 8x, the
#: prediction fell 40 % short). Only upwards: five rounds all above zero by chance would make a
#: codec look cheaper than it is, and the solver would choose one that does not pay.
SCALE_RANGE = (1 / 8, 8.0)
RESOLVED_RANGE = (1 / 8, 64.0)
#: Timed rounds at least: each added time is a difference of two noisy ones (a shared 2-core CPU
#: varies by +-20 % from step to step), so a median of 3 could be off by half...
MIN_ROUNDS = 5
#: ... unless the first `SETTLED_ROUNDS` agree (`settled`): then their median is as good.
SETTLED_ROUNDS = 3
#: Round differences agree when their spread is within this share of their median, or of the
#: slower table's time (a difference near zero matters only against the block's time).
SETTLED_SPREAD = 0.2
SETTLED_FLOOR = 0.02


@dataclass
class Calibration:
    """Measured added ms per block of each action table over ``plain``, and the scales derived."""

    plain_ms: float
    recompute_ms: float  # full recomputation - plain
    keep_ms: float  # keep every cacheable op - plain
    codec_ms: float  # compress - keep
    recompute_scale: float = 1.0  # measured / profiled recompute (ops + fixed)
    codec_scale: float = 1.0  # measured / profiled encode + decode
    dispatch_ms: float = 0.0
    profiled: dict[str, float] = field(default_factory=dict)  # the sums before scaling
    rounds: int = 0  # timed rounds (`interleaved_ms`)

    def apply(self, ops: list[OpProfile], fixed_ms: float) -> tuple[list[OpProfile], float]:
        """`ops` with forward and codec times scaled, and the scaled ``fixed_ms``."""
        r, c = self.recompute_scale, self.codec_scale
        out = []
        for op in ops:
            codecs = {
                n: replace(cp, encode_ms=cp.encode_ms * c, decode_ms=cp.decode_ms * c)
                for n, cp in op.codecs.items()
            }
            out.append(replace(op, fwd_ms=op.fwd_ms * r, codecs=codecs))
        return out, fixed_ms * r


def _scale(
    times: dict[str, list[float]], a: str, b: str, measured: float, profiled: float
) -> float:
    """`measured` (``a - b``, `added_ms`) over the `profiled` sum, bounded by `RESOLVED_RANGE`
    when every round's difference is positive, else by `SCALE_RANGE`."""
    resolved = all(x > y for x, y in zip(times[a], times[b], strict=True))
    lo, hi = RESOLVED_RANGE if resolved else SCALE_RANGE
    return min(max(measured / profiled, lo), hi)


def _cheapest(op: OpProfile) -> tuple[str, Any] | None:
    if not op.codecs:
        return None
    name, cp = min(op.codecs.items(), key=lambda kv: kv[1].ms)
    return name, cp


def tables(ops: list[OpProfile]) -> dict[str, Variant | None]:
    """The four action tables (None: no checkpointing)."""
    keep, compress = {}, {}
    for op in ops:
        if not op.cacheable or op.block_output:
            continue
        keep[op.key] = Action.retain()
        best = _cheapest(op)
        compress[op.key] = best[1].action() if best is not None else Action.retain()
    return {
        "plain": None,
        "recompute": Variant(1, True, {}),
        "keep": Variant(1, True, keep),
        "compress": Variant(1, True, compress),
    }


@contextmanager
def table_runtimes(
    block: nn.Module,
    path: str,
    group: str,
    specs: list[OpSpec],
    variants: Mapping[str, Variant | None],
    compiled: bool = False,
) -> Iterator[dict[str, BlockRuntime | None]]:
    """A `BlockRuntime` on `block` per action table (None: the plain block), removed on exit;
    tables that offload share one host store. `compiled`: they run compiled, measured as such
    (their compile contexts do not warn of an eager plan, and compressed ops run through
    `saved_codecs`' hooks, installed meanwhile)."""
    runtimes = {
        n: BlockRuntime(block, path, group, GroupPolicy(specs, [v]), v, set(), compiled)
        if v is not None
        else None
        for n, v in variants.items()
    }
    if any(v is not None and v.offloads for v in variants.values()):
        param = next(block.parameters(), None)
        host = HostStore(param.device if param is not None else "cpu")
        for rt in runtimes.values():
            if rt is not None:
                rt.host = host
    hooks = saved_codecs.active() if compiled else contextlib.nullcontext()
    try:
        with hooks:
            yield runtimes
    finally:
        for rt in runtimes.values():
            if rt is not None:
                rt.remove()


def _step_ms(
    block: nn.Module,
    fn: Any,
    args: tuple,
    runtime: BlockRuntime | None,
    device: Any,
    autocast: torch.dtype | None = None,
) -> float:
    """One forward (autocast to `autocast`, if given) + backward of the block (gradients of its
    input and parameters), in ms."""
    x, x_in = detached_input(args[0])
    inputs = [t for t in (x, *block.parameters()) if t.requires_grad]

    def step() -> None:
        with autocast_context(torch.device(device), autocast):
            out = runtime(fn, x_in, *args[1:]) if runtime is not None else fn(x_in, *args[1:])
        y = out[0] if isinstance(out, (tuple, list)) else out
        torch.autograd.grad(y, inputs, grad_outputs=torch.ones_like(y), allow_unused=True)

    return steady_ms(step, device)  # among blocks, as a step runs them (GPU: host hidden)


def settled(times: dict[str, list[float]], a: str, b: str) -> bool:
    """Whether the rounds' differences ``a - b`` agree (`SETTLED_SPREAD`, `SETTLED_FLOOR`)."""
    diffs = [x - y for x, y in zip(times[a], times[b], strict=True)]
    slower = max(statistics.median(times[a]), statistics.median(times[b]))
    tolerance = max(SETTLED_SPREAD * abs(statistics.median(diffs)), SETTLED_FLOOR * slower)
    return max(diffs) - min(diffs) <= tolerance


def interleaved_ms(
    block: nn.Module,
    fn: Any,
    args: tuple,
    runtimes: dict[str, BlockRuntime | None],
    device: Any,
    rounds: int,
    autocast: torch.dtype | None = None,
    differences: list[tuple[str, str]] | None = None,
) -> dict[str, list[float]]:
    """Forward + backward ms of the block under each runtime (None: plain): one warm-up round
    (slot tables are built there), then `rounds` rounds, the order rotating from round to round,
    the generator state restored afterwards. Given the `differences` the caller reads (pairs of
    names), it stops after `SETTLED_ROUNDS` rounds where each of them has `settled`."""
    times: dict[str, list[float]] = {n: [] for n in runtimes}
    if modelled_clock() is not None:  # a modelled device's clock gives the same every round
        rounds = 1
    cuda = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    names = list(runtimes)
    with torch.random.fork_rng(devices=cuda):
        for r in range(rounds + 1):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                ms = _step_ms(block, fn, args, runtimes[n], device, autocast)
                if r:
                    times[n].append(ms)
            done = differences and SETTLED_ROUNDS <= r < rounds
            if done and all(settled(times, a, b) for a, b in differences):
                break
    return times


def added_ms(times: dict[str, list[float]], a: str, b: str) -> float:
    """What table `a` adds over table `b` (`b`'s work and more: a recompute, codecs, the
    dispatch modes): the median over rounds of ``a - b`` within each round (a machine whose speed
    drifts, a shared CPU, a clock boosting, shifts both alike, so the difference of one round
    holds), never below 0 (`timing.paired_added_ms`): a table timed faster than the plain block
    is noise, and a negative time would reach the plan as a saving (a loaded machine printed
    -209.9 ms/step for a plan recomputing 6 blocks)."""
    return paired_added_ms(times[a], times[b])


def calibrate(
    block: nn.Module,
    path: str,
    group: str,
    fn: Any,
    args: tuple,
    ops: list[OpProfile],
    fixed_ms: float,
    device: Any,
    repeats: int = 5,
) -> Calibration:
    """Time the block under the four tables (`interleaved_ms`, `MIN_ROUNDS` rounds, or
    `SETTLED_ROUNDS` where those agree; medians of each round's differences) and derive the
    scales and the dispatch overhead (module docstring)."""
    specs = [o.spec() for o in ops]
    variants = tables(ops)
    with table_runtimes(block, path, group, specs, variants) as runtimes:
        differences = [("recompute", "plain"), ("keep", "plain"), ("compress", "keep")]
        rounds = max(MIN_ROUNDS, repeats)
        times = interleaved_ms(block, fn, args, runtimes, device, rounds, None, differences)
    cal = Calibration(
        plain_ms=statistics.median(times["plain"]),
        recompute_ms=added_ms(times, "recompute", "plain"),
        keep_ms=added_ms(times, "keep", "plain"),
        codec_ms=added_ms(times, "compress", "keep"),
        rounds=len(times["plain"]),
    )
    keep, compress = variants["keep"], variants["compress"]
    assert keep is not None and compress is not None
    gp_keep = GroupPolicy(specs, [keep])
    rec = fixed_ms + sum(o.fwd_ms for o in ops if o.cacheable)
    rerun = fixed_ms + sum(o.fwd_ms for o in ops if o.cacheable and o.key not in keep.actions)
    codec = sum(
        o.codecs[a.codec].ms
        for o in ops
        if (a := compress.actions.get(o.key)) is not None and a.codec is not None
    )
    cal.profiled = {"recompute_ms": rec, "codec_ms": codec}
    if rec > 0:
        cal.recompute_scale = _scale(times, "recompute", "plain", cal.recompute_ms, rec)
    if codec > 0:
        cal.codec_scale = _scale(times, "compress", "keep", cal.codec_ms, codec)
    floor = dispatch_overhead_ms(block, fn, args, gp_keep, device, repeats)
    cal.dispatch_ms = max(floor, cal.keep_ms - cal.recompute_scale * rerun)
    return cal
