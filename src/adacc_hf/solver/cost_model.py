"""The cost model: what any policy holds, adds in time and peaks at, under a `Profile`.

The one place that answers "how much memory and time does this policy cost?": the solver builds
its LP from the same per-op choices (`choices_for`), checks its integer solutions with `evaluate`,
and the session, benchmarks and tests ask `predict` about any policy (solved or built by a rule).

Per op of a checkpointed block: retain (0 ms, ``retain_nbytes``), compress with codec c (encode +
decode ms, encoded bytes), recompute (``fwd_ms``, 0 bytes). Per block group: a checkpointed block
holds its input plus what its ops keep and pays ``fixed_ms`` for ops that always rerun, plus
``dispatch_ms`` (the runtime's dispatch modes, measured) if it keeps any op; a plain block holds
``full_nbytes``. The step's transient is the largest backward temporary of a
checkpointed block, or the one outside the blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..codecs import get_codec
from ..errors import PolicyError
from ..policy import Policy
from ..schema import ALWAYS_RETAIN, Action, GroupProfile, OpProfile, Profile
from .static import StaticMemory


@dataclass
class Prediction:
    """What the cost model predicts for one policy."""

    held_nbytes: int
    per_block: dict[str, list[int]]  # held bytes of each block, per group, in block order
    added_ms: float
    transient_nbytes: int
    static_nbytes: int
    peak_nbytes: int
    unprofiled: list[str] = field(default_factory=list)  # "group/op:codec" sized, not timed


@dataclass(frozen=True)
class Choice:
    label: str  # "retain", "compress:<codec>" or "recompute"
    action: Action
    ms: float
    nbytes: int


@dataclass
class GroupModel:
    name: str
    prof: GroupProfile
    ops: list[tuple[OpProfile, list[Choice]]]  # cacheable ops, choices in canonical order


def choices_for(
    op: OpProfile, codecs: set[str] | None, max_rel_error: float | None
) -> list[Choice]:
    """The op's actions (retain, codecs by name, recompute) minus the dominated ones (recompute
    always stays: a block that keeps nothing does not pay the runtime's dispatch overhead); only
    retain for `ALWAYS_RETAIN` layer types (MoE routers)."""
    cands = [Choice("retain", Action.retain(), 0.0, op.retain_nbytes)]
    if op.layer_type in ALWAYS_RETAIN:
        return cands
    for name in sorted(op.codecs):
        cp = op.codecs[name]
        if codecs is not None and name not in codecs:
            continue
        if max_rel_error is not None and not cp.rel_error <= max_rel_error:
            continue
        cands.append(
            Choice(f"compress:{name}", Action.compress(name, **cp.params), cp.ms, cp.nbytes)
        )
    cands.append(Choice("recompute", Action.recompute(), op.fwd_ms, 0))

    def beaten(i: int) -> bool:
        a = cands[i]
        if a.label == "recompute":  # keeping nothing spares the block the dispatch overhead
            return False
        for j, b in enumerate(cands):
            no_worse = j != i and b.ms <= a.ms and b.nbytes <= a.nbytes
            if no_worse and (b.ms < a.ms or b.nbytes < a.nbytes or j < i):
                return True
        return False

    return [c for i, c in enumerate(cands) if not beaten(i)]


def group_models(
    profile: Profile, codecs: set[str] | None, max_rel_error: float | None
) -> list[GroupModel]:
    return [
        GroupModel(
            name,
            g,
            [(op, choices_for(op, codecs, max_rel_error)) for op in g.ops if op.cacheable],
        )
        for name, g in sorted(profile.groups.items())
    ]


def evaluate(
    profile: Profile,
    groups: list[GroupModel],
    k: dict[str, int],
    counts: dict[str, dict[str, dict]],
) -> tuple[int, float, int]:
    """(held bytes, added ms, transient bytes) of integer counts, computed exactly."""
    held, ms, transient = profile.nonblock_nbytes, [], nonblock_transient(profile)
    for gm in groups:
        g, kg = gm.prof, k[gm.name]
        held += (g.num_blocks - kg) * g.full_nbytes + kg * g.input_nbytes
        ms.append(kg * g.fixed_ms)
        keeping = 0  # blocks that keep any op: realisation puts kept actions first
        for op, choices in gm.ops:
            kept = 0
            for c in choices:
                y = counts[gm.name][op.key].get(c.label, 0)
                held += y * c.nbytes
                ms.append(y * c.ms)
                kept += y if c.label != "recompute" else 0
            keeping = max(keeping, kept)
        ms.append(keeping * dispatch_ms(g))
        if kg:
            transient = max(transient, g.transient_nbytes)
    return held, math.fsum(ms), transient


def min_activation_nbytes(profile: Profile) -> tuple[int, int]:
    """(held, transient) of the configuration needing the least memory.

    Per group either every block is checkpointed with everything recomputed (``input_nbytes``
    each, plus the group's transient) or none is (``full_nbytes`` each); the cheapest mix is found
    by trying each group's transient as the maximum allowed.
    """
    gs = [g for g in profile.groups.values() if g.num_blocks > 0]
    floor = nonblock_transient(profile)
    best = (profile.no_checkpoint_nbytes(), floor)
    for tr in sorted({g.transient_nbytes for g in gs}):
        held = profile.nonblock_nbytes
        for g in gs:
            least = g.input_nbytes + pinned_nbytes(g)
            per = min(g.full_nbytes, least) if g.transient_nbytes <= tr else g.full_nbytes
            held += g.num_blocks * per
        if held + max(tr, floor) < sum(best):
            best = (held, max(tr, floor))
    return best


def pinned_nbytes(g: GroupProfile) -> int:
    """Bytes a checkpointed block of `g` retains under any policy (`ALWAYS_RETAIN` ops)."""
    return sum(o.retain_nbytes for o in g.ops if o.cacheable and o.layer_type in ALWAYS_RETAIN)


def min_budget(profile: Profile, static_nbytes: int = 0) -> int:
    """The smallest budget any policy fits in: static + least held + its transient."""
    held, transient = min_activation_nbytes(profile)
    return static_nbytes + held + transient


#: Share of the activation budget (budget - static) left free by default: int4_outlier sizes vary
#: from block to block and batch to batch (the profile measures one block), and padding masks add
#: ops the profiled batch may not have.
HEADROOM = 0.03


def planned_budget(
    budget_nbytes: int, static_nbytes: int, profile: Profile, headroom: float = HEADROOM
) -> int:
    """The budget to solve for: `headroom` of the activation share kept free, unless the whole
    budget fits no checkpointing at all (nothing data-dependent then) or only the whole fits."""
    no_checkpoint = static_nbytes + profile.no_checkpoint_nbytes() + nonblock_transient(profile)
    if budget_nbytes >= no_checkpoint:
        return budget_nbytes
    share = budget_nbytes - static_nbytes
    planned = budget_nbytes - int(max(0, share) * headroom)
    return budget_nbytes if planned < min_budget(profile, static_nbytes) else planned


def dispatch_ms(g: GroupProfile) -> float:
    """Runtime overhead of one checkpointed block of ``g`` that keeps any op (0 if unmeasured)."""
    return float(getattr(g, "dispatch_ms", 0.0) or 0.0)


def nonblock_transient(profile: Profile) -> int:
    """Backward temporary outside the blocks (e.g. the logits' gradient), if profiled."""
    return int(getattr(profile, "nonblock_transient_nbytes", 0) or 0)


def recompute_ms(groups: list[GroupModel]) -> float:
    """Added time of full recomputation: the scale of ``mip_gap``."""
    per = [
        gm.prof.num_blocks * (gm.prof.fixed_ms + sum(op.fwd_ms for op, _ in gm.ops))
        for gm in groups
    ]
    return math.fsum(per)


def predict(profile: Profile, policy: Policy, static_nbytes: int | StaticMemory = 0) -> Prediction:
    """Held bytes, added time and peak of any ``policy`` under ``profile``'s cost model.

    Ops a variant does not name count as recompute; a codec the profile did not measure on an op
    is sized exactly (``Codec.predict_nbytes``) and timed as 0 ms (listed in ``unprofiled``).
    """
    static = static_nbytes.total if isinstance(static_nbytes, StaticMemory) else int(static_nbytes)
    per_block: dict[str, list[int]] = {}
    ms: list[float] = []
    held, transient, unprofiled = profile.nonblock_nbytes, nonblock_transient(profile), []
    for name, g in sorted(profile.groups.items()):
        gp = policy.groups.get(name)
        if gp is None or gp.num_blocks != g.num_blocks:
            have = None if gp is None else gp.num_blocks
            raise PolicyError(
                f"group {name!r}: the profile has {g.num_blocks} blocks, the policy {have}: "
                "the policy was made for another model"
            )
        blocks = []
        for v in gp.variants:
            if v.count == 0:
                continue
            if not v.checkpoint:
                blocks += [g.full_nbytes] * v.count
                continue
            transient = max(transient, g.transient_nbytes)
            b, t = g.input_nbytes, [g.fixed_ms]
            if any(a.kind != "recompute" for a in v.actions.values()):
                t.append(dispatch_ms(g))
            for op in g.ops:
                if not op.cacheable:
                    continue
                act = v.action(op.key)
                if act.kind == "retain":
                    b += op.retain_nbytes
                elif act.kind == "recompute":
                    t.append(op.fwd_ms)
                elif act.codec in op.codecs:
                    b += op.codecs[act.codec].nbytes
                    t.append(op.codecs[act.codec].ms)
                else:
                    codec = get_codec(act.codec, **dict(act.params))
                    dtype = getattr(torch, op.dtype.removeprefix("torch."))
                    b += codec.predict_nbytes(op.shape, dtype)
                    unprofiled.append(f"{name}/{op.key}:{act.codec}")
            blocks += [b] * v.count
            ms += [math.fsum(t) * v.count]
        per_block[name] = blocks
        held += sum(blocks)
    return Prediction(
        held_nbytes=held,
        per_block=per_block,
        added_ms=math.fsum(ms),
        transient_nbytes=transient,
        static_nbytes=static,
        peak_nbytes=static + held + transient,
        unprofiled=sorted(set(unprofiled)),
    )
