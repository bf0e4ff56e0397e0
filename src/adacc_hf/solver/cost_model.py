"""The cost model: what any policy holds, adds in time and peaks at, under a `Profile`.

The one place that answers "how much memory and time does this policy cost?": the solver builds
its LP from the same per-op choices (`choices_for`), checks its integer solutions with `evaluate`,
and the session, benchmarks and tests ask `predict` about any policy (solved or built by a rule).

Per op of a checkpointed block: retain (0 ms, ``retain_nbytes``), compress with codec c (encode +
decode ms, encoded bytes), recompute (``fwd_ms``, 0 bytes), and where the profile has a host link
(``Profile.offload``) offload, as it is or encoded (0 bytes on the device; its bytes in host
memory; the copies' time, `copy_ms`). Per block group: a checkpointed block holds its input
(unless offloaded) plus what its ops keep and pays ``fixed_ms`` for ops that always rerun, plus
``dispatch_ms`` (the runtime's dispatch modes, measured) if it keeps any op; a plain block holds
``full_nbytes``. Copies on a side stream (``OffloadLink.overlap``) cost a block only what
outlasts its forward (out) or backward (back): `exposed_ms`. The step's peak is `step.step_peak` over those blocks. Once a solved policy's
action tables have been timed whole on the profiled block (``Profile.variant_ms``), `predict`
adds those times instead of the sums (a table timed at 0, its difference from the plain block lost
in noise, by its sums).

Every time here is work a policy adds to the step without checkpointing, so none is below 0: the
profiler's differences of two timings go through `runtime.timing.added_work_ms`, and so do those
read here (the dispatch overhead, the chosen LM head's over the model's own, from any profile,
saved ones included); a plan's added time is never a saving.

The MILP bounds activations by one linear constraint (``held + transient <= cap``, `evaluate`);
the solver then checks the whole step's peak of each candidate and adjusts the cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..codecs import dtype_named, get_codec
from ..errors import PolicyError
from ..policy import Policy
from ..policy.consistency import keeps_statistics
from ..runtime.timing import added_work_ms
from ..schema import (
    ALWAYS_RETAIN,
    Action,
    GroupProfile,
    OffloadLink,
    OpProfile,
    Profile,
    Variant,
    variant_key,
)
from .head_moments import head_shift
from .loads import BlockLoad
from .offload import INPUT, STAGED_BLOCKS, copy_ms, exposed_ms, staging
from .static import StaticMemory
from .step import (
    StepEstimate,
    checkpointed_nbytes,
    held_in_order,
    in_forward_order,
    pinned_nbytes,
    plan_key,
    step_peak,
)


@dataclass
class Prediction:
    """What the cost model predicts for one policy."""

    held_nbytes: int
    per_block: dict[str, list[int]]  # held bytes of each block, per group, in block order
    added_ms: float
    transient_nbytes: int
    static_nbytes: int
    peak_nbytes: int  # the step's peak (`step.step_peak`)
    unprofiled: list[str] = field(default_factory=list)  # "group/op:codec" sized, not timed
    moment: str = ""  # the moment that sets the peak
    moments: dict[str, int] = field(default_factory=dict)
    grad_error: float = 0.0  # the largest predicted gradient error of a block (`grad_error_of`)


def grad_error_of(profile: Profile, group: str, variant: Variant) -> float:
    """A block's predicted gradient error under `variant`: its lossy ops' measured errors
    (``CodecProfile.grad_error``, `profiler.fidelity`) in quadrature; unmeasured ones count 0."""
    if not variant.checkpoint:
        return 0.0
    ops = {o.key: o for o in profile.groups[group].ops}
    total = 0.0
    for key, act in variant.actions.items():
        op = ops.get(key)
        if act.codec is not None and op is not None and act.codec in op.codecs:
            total += (op.codecs[act.codec].grad_error or 0.0) ** 2
    return math.sqrt(total)


@dataclass(frozen=True)
class Choice:
    label: str  # "retain", "compress:<codec>", "offload", "offload:<codec>" or "recompute"
    action: Action
    ms: float
    nbytes: int  # held on the device from the block's forward to its backward
    grad_error: float = 0.0  # the block's gradient error with only this op so (`fidelity`)
    host_nbytes: int = 0  # offload: held in host memory (and staged back in backward)


@dataclass
class GroupModel:
    name: str
    prof: GroupProfile
    ops: list[tuple[OpProfile, list[Choice]]]  # cacheable ops, choices in canonical order
    # a block's gradient error bound (errors of its lossy ops added in quadrature); None: none
    max_grad_error: float | None = None
    link: OffloadLink | None = None  # where offload may be chosen (its input's too)


def choices_for(
    op: OpProfile,
    codecs: set[str] | None,
    max_rel_error: float | None,
    link: OffloadLink | None = None,
) -> list[Choice]:
    """The op's actions (retain, codecs by name, offload as it is and encoded where `link` is
    given, recompute) minus the dominated ones (recompute always stays: a block that keeps
    nothing does not pay the runtime's dispatch overhead); only retain for `ALWAYS_RETAIN` layer
    types (MoE routers).

    The block's own output is neither retained nor offloaded: that would skip one op's recompute
    but keep the output alive (or staged) until the block's backward, where full recomputation
    has freed it."""
    kept = op.retain_nbytes + op.rng_nbytes  # with the generator states replay restores
    cands = [] if op.block_output else [Choice("retain", Action.retain(), 0.0, kept)]
    if op.layer_type in ALWAYS_RETAIN:
        return cands
    if link is not None and not op.block_output:
        cands.append(
            Choice(
                "offload", Action.offload(), copy_ms(link, op.nbytes), op.rng_nbytes, 0.0, op.nbytes
            )
        )
    statistic = keeps_statistics(op)
    for name in sorted(op.codecs):
        cp = op.codecs[name]
        if codecs is not None and name not in codecs:
            continue
        if statistic and not get_codec(name, **cp.params).lossless:
            continue  # its exact statistics beside a lossy output (`policy.consistency`)
        if cp.grad_error is not None and not math.isfinite(cp.grad_error):
            continue  # the block failed with it (`profiler.fidelity`): never usable
        if max_rel_error is not None and not cp.rel_error <= max_rel_error:
            continue
        packed = cp.nbytes + op.side_nbytes  # its other outputs stay exact
        err = cp.grad_error or 0.0
        cands.append(
            Choice(
                f"compress:{name}",
                cp.action("compress"),
                cp.ms,
                packed + op.rng_nbytes,
                err,
            )
        )
        if link is not None and not op.block_output:
            cands.append(
                Choice(
                    f"offload:{name}",
                    cp.action("offload"),
                    cp.ms + copy_ms(link, packed),
                    op.rng_nbytes,
                    err,
                    packed,
                )
            )
    cands.append(Choice("recompute", Action.recompute(), op.fwd_ms, 0))

    def beaten(i: int) -> bool:
        a = cands[i]
        if a.label == "recompute":  # keeping nothing spares the block the dispatch overhead
            return False
        for j, b in enumerate(cands):
            no_worse = j != i and b.ms <= a.ms and b.nbytes <= a.nbytes
            no_worse = no_worse and b.grad_error <= a.grad_error and b.host_nbytes <= a.host_nbytes
            if no_worse and (
                b.ms < a.ms
                or b.nbytes < a.nbytes
                or b.grad_error < a.grad_error
                or b.host_nbytes < a.host_nbytes
                or j < i
            ):
                return True
        return False

    # Most bytes first (retain ... offload ... recompute): realisation hands the first actions to
    # the last checkpointed blocks, so a group's blocks hold less the earlier they run.
    return sorted(
        (c for i, c in enumerate(cands) if not beaten(i)),
        key=lambda c: (-c.nbytes, -c.host_nbytes, c.ms),
    )


def group_models(
    profile: Profile,
    codecs: set[str] | None,
    max_rel_error: float | None,
    max_grad_error: float | None = None,
    offload: bool = True,
) -> list[GroupModel]:
    """Each group's ops with their choices; offload among them where the profile has a host link
    (and `offload`)."""
    link = profile.offload if offload else None
    return [
        GroupModel(
            name,
            g,
            [(op, choices_for(op, codecs, max_rel_error, link)) for op in g.ops if op.cacheable],
            max_grad_error,
            link,
        )
        for name, g in sorted(profile.groups.items())
    ]


def evaluate(
    groups: list[GroupModel],
    k: dict[str, int],
    counts: dict[str, dict[str, dict]],
) -> tuple[int, float, int]:
    """(bytes the blocks hold, added ms, largest block transient) of integer counts, exactly; the
    transient with what a block's backward may have staged back beyond full recomputation
    (`staging`)."""
    held, ms, transient, staged = 0, [], 0, 0
    for gm in groups:
        g, kg = gm.prof, k[gm.name]
        held += (g.num_blocks - kg) * g.full_nbytes + kg * checkpointed_nbytes(g)
        ms.append(kg * g.fixed_ms)
        inputs = counts[gm.name].get(INPUT, {}).get("offload", 0)
        held -= inputs * g.input_nbytes
        moved = inputs * g.input_nbytes
        if gm.link is not None:
            ms.append(inputs * copy_ms(gm.link, g.input_nbytes))
        keeping = 0  # blocks that keep any op: realisation puts kept actions first
        for op, choices in gm.ops:
            kept = 0
            for c in choices:
                y = counts[gm.name][op.key].get(c.label, 0)
                held += y * c.nbytes
                ms.append(y * c.ms)
                moved += y * c.host_nbytes
                kept += y if c.label != "recompute" else 0
            keeping = max(keeping, kept)
        ms.append(keeping * dispatch_ms(g))
        ms.append(exposed_ms(gm.link, g, moved, kg))
        if kg:
            transient = max(transient, g.transient_nbytes)
        if kg < g.num_blocks:
            transient = max(transient, g.plain_transient_nbytes)
        staged = max(staged, staging(g, gm.ops, counts[gm.name]))
    return held, math.fsum(ms), transient + STAGED_BLOCKS * staged


#: Default bound on a block's gradient error (`grad_error_of`; AdaccConfig.max_grad_error).
MAX_GRAD_ERROR = 0.1


def head_transient(profile: Profile) -> int:
    """The backward transient outside the blocks that the activation cap must leave room for."""
    return int(profile.head_transient_nbytes)


def dispatch_ms(g: GroupProfile) -> float:
    """Runtime overhead of one checkpointed block of ``g`` that keeps any op (0 if unmeasured;
    never below 0, `added_work_ms`)."""
    return added_work_ms(float(getattr(g, "dispatch_ms", 0.0) or 0.0))


def recompute_ms(groups: list[GroupModel]) -> float:
    """Added time of full recomputation: the scale of ``mip_gap``."""
    per = [
        gm.prof.num_blocks * (gm.prof.fixed_ms + sum(op.fwd_ms for op, _ in gm.ops))
        for gm in groups
    ]
    return math.fsum(per)


def block_loads(
    profile: Profile, policy: Policy, measured_ms: bool = True
) -> tuple[dict[str, list[BlockLoad]], float, list]:
    """Per group, each block's load under `policy` (in block order), the added ms (of a variant
    timed whole, ``profile.variant_ms``, that time if `measured_ms`), and the codecs sized but not
    timed ("group/op:codec")."""
    loads: dict[str, list[BlockLoad]] = {}
    ms: list[float] = []
    unprofiled: list[str] = []
    for name, g in sorted(profile.groups.items()):
        gp = policy.groups.get(name)
        if gp is None or gp.num_blocks != g.num_blocks:
            have = None if gp is None else gp.num_blocks
            raise PolicyError(
                f"group {name!r}: the profile has {g.num_blocks} blocks, the policy {have}: "
                "the policy was made for another model"
            )
        blocks: list[BlockLoad] = []
        for v in gp.variants:
            if v.count == 0:
                continue
            if not v.checkpoint:
                blocks += [BlockLoad(name, g.full_nbytes, False)] * v.count
                continue
            load, t, unknown = variant_load(profile, name, v)
            unprofiled += unknown
            blocks += [load] * v.count
            timed = profile.variant_ms.get(load.variant) if measured_ms else None
            ms.append((timed if resolved(timed) else math.fsum(t)) * v.count)
        loads[name] = blocks
    return loads, math.fsum(ms), sorted(set(unprofiled))


def resolved(timed: float | None) -> bool:
    """Whether a table's time measured whole (``Profile.variant_ms``) prices it: where it was
    measured above 0. The profiler never records less (`runtime.timing.paired_added_ms`); a 0 is
    a difference lost in noise (as is a negative one in a profile saved before that rule), and
    the table's per-op sums price it instead: a table that recomputes ops is never free."""
    return timed is not None and timed > 0.0


def variant_load(
    profile: Profile, name: str, v: Variant
) -> tuple[BlockLoad, list[float], list[str]]:
    """One checkpointed block of group `name` under `v`'s action table: its load, the per-op
    times it adds (summed by the caller) and the codecs sized but not timed."""
    g = profile.groups[name]
    unprofiled: list[str] = []
    b, t = g.input_nbytes, [g.fixed_ms]
    kept = kept_saved = kept_shared = enc_ws = dec_ws = rng = 0
    copies = []  # bytes of each offloaded op (and of the input), out and back
    if v.offload_input:
        b -= g.input_nbytes
        copies.append(g.input_nbytes)
    modes = any(a.kind != "recompute" for a in v.actions.values())  # it runs the dispatch modes
    if modes:
        t.append(dispatch_ms(g))
    for op in g.ops:
        if not op.cacheable:
            continue
        act = v.action(op.key)
        rng += op.rng_nbytes if act.kind != "recompute" else 0
        if act.kind == "retain":
            b += op.retain_nbytes
            kept += op.retain_nbytes
            kept_saved += op.retain_nbytes if op.saved else 0
            kept_shared += op.shared_nbytes
            continue
        if act.kind == "recompute":
            t.append(op.fwd_ms)
            continue
        size = op.nbytes  # offloaded as it is
        if act.codec in op.codecs:
            cp = op.codecs[act.codec]
            size = cp.nbytes + op.side_nbytes
            t.append(cp.ms)
            # an encoded copy to the host holds its payload on the device until it is parked
            parking = size if act.offloaded else 0
            enc_ws = max(enc_ws, cp.encode_workspace_nbytes + parking)
            dec_ws = max(dec_ws, cp.decode_workspace_nbytes)
        elif act.codec is not None:
            codec = get_codec(act.codec, **act.codec_kwargs)
            size = codec.predict_nbytes(op.shape, dtype_named(op.dtype)) + op.side_nbytes
            unprofiled.append(f"{name}/{op.key}:{act.codec}")
        if act.offloaded:
            copies.append(size)
        else:
            b += size
    key = variant_key(name, v)
    b = compiled_held(profile, g, key, b)
    parked = sum(copies)
    if copies:
        link = _link_of(profile, name)
        t += [copy_ms(link, c) for c in copies] + [exposed_ms(link, g, parked)]
    inp = g.input_nbytes if v.offload_input else 0
    load = BlockLoad(
        name, b, True, kept, kept_saved, kept_shared, enc_ws, dec_ws, key, rng, parked, modes, inp
    )
    return load, t, unprofiled


def plan_key_of(profile: Profile, policy: Policy) -> str:
    """`step.plan_key` of `policy`'s blocks under `profile` (where its measured compiled
    residual is kept: `step.compiled_residual`)."""
    loads, _, _ = block_loads(profile, policy, measured_ms=False)
    return plan_key(in_forward_order(profile, loads))


def compiled_held(profile: Profile, g: GroupProfile, key: str, eager: int) -> int:
    """What a checkpointed block of `g` holds under action table `key`: measured compiled where
    the table was (``Profile.variant_transients``' third entry: its block alone compiled holds
    that much beyond full recomputation's, `profiler.variants`), else `eager` (its kept bytes
    summed). A compiled graph saves a kept output only where backward reads it; on the CPU
    suite's GPT-2 a table summed to 8.1 MiB above full recomputation held 1.1 MiB compiled."""
    measured = profile.variant_transients.get(key)
    if measured is None or len(measured) < 3:
        return eager
    return max(0, g.input_nbytes + pinned_nbytes(g) + measured[2])


def _link_of(profile: Profile, group: str) -> OffloadLink:
    if profile.offload is None:
        raise PolicyError(
            f"group {group!r}: the policy offloads, but the profile has no host link to price it "
            "(profile with offload on, or give Profile.offload)"
        )
    return profile.offload


def predict(
    profile: Profile,
    policy: Policy,
    static_nbytes: int | StaticMemory = 0,
    accumulation: int = 1,
    *,
    measured_ms: bool = True,
) -> Prediction:
    """Held bytes, added time and step peak of any ``policy`` under ``profile``'s cost model.

    Ops a variant does not name count as recompute; a codec the profile did not measure on an op
    is sized exactly (``Codec.predict_nbytes``) and timed as 0 ms (listed in ``unprofiled``).
    The policy's LM head (``policy.head``) adds its measured time and bytes beyond the model's
    own head (`head_moments.head_shift`).

    Args:
        profile: the model's `Profile`.
        policy: any policy for the same model (solved, rule-based or edited).
        static_nbytes: a `StaticMemory` (gradients, states and optimizer temporaries placed in
            the step), or a number of bytes resident all step long.
        accumulation: micro-batches per optimizer step (gradients alive through every one but
            the first).
        measured_ms: a variant timed whole on the profiled block (``profile.variant_ms``) adds
            that time; False: the per-op sums alone, as the solver compares its candidates.

    Returns:
        The `Prediction`: held bytes (in all and per block), added ms per step, transient,
        static and peak bytes, the moment that sets the peak and the largest predicted gradient
        error of a block.

    Raises:
        PolicyError: the policy's blocks do not match the profile's (made for another model), or
            it offloads and the profile has no host link to price it.
    """
    loads, added_ms, unprofiled = block_loads(profile, policy, measured_ms)
    shift = head_shift(profile, policy.head)
    ordered = in_forward_order(profile, loads)
    est: StepEstimate = step_peak(profile, ordered, static_nbytes, accumulation, policy.head)
    checkpointed = [g for g, bl in loads.items() if any(b.checkpoint for b in bl)]
    transient = max(
        [head_transient(profile), *(profile.groups[g].transient_nbytes for g in checkpointed)]
    )
    static = static_nbytes.total if isinstance(static_nbytes, StaticMemory) else int(static_nbytes)
    return Prediction(
        held_nbytes=profile.nonblock_nbytes + shift.held + sum(held_in_order(profile, ordered)),
        per_block={g: [b.held for b in bl] for g, bl in loads.items()},
        # the chunked head runs the full head's matmuls and reruns each chunk's logits in
        # backward: work added, never a saving (`added_work_ms`)
        added_ms=added_ms + added_work_ms(shift.ms),
        transient_nbytes=transient,
        static_nbytes=static,
        peak_nbytes=est.peak_nbytes,
        unprofiled=unprofiled,
        moment=est.moment,
        moments=est.moments,
        grad_error=max(
            (
                grad_error_of(profile, name, v)
                for name, g in policy.groups.items()
                if name in profile.groups
                for v in g.variants
                if v.count
            ),
            default=0.0,
        ),
    )
