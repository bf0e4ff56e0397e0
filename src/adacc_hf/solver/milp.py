"""The policy maker: a MILP that picks retain / compress / recompute per op under a memory budget.

Per group g (``N_g`` blocks), the integer ``K_g`` in [0, N_g] counts its checkpointed blocks (the
others run without checkpointing and hold ``full_nbytes`` each) and, per cacheable op i and
action a, the integer ``y[g,i,a] >= 0`` counts the checkpointed blocks applying a to i
(``sum_a y[g,i,a] = K_g``). Costs per op and checkpointed block: retain (0 ms, ``retain_nbytes``),
compress with codec c (encode + decode ms, encoded bytes), recompute (``fwd_ms``, 0 bytes)::

    minimise   sum_g [K_g fixed_ms_g + sum_{i,a} y t] + 1e-6 sum_g K_g + 1e-9 held_MiB
    subject to static + nonblock + sum_g [(N_g - K_g) full_g + K_g input_g + sum_{i,a} y m] + T
               <= budget,    K_g <= N_g z_g,   T >= transient_g z_g,   T >= nonblock_transient

(memory in MiB inside the LP). ``split_blocks=False`` is the paper's formulation: one action per
op for all blocks of a group (``K_g = N_g c_g``, ``y = N_g x``, ``c``, ``x`` binary). Neither
reduction below can change the optimum: actions that another action of the same op beats on both
time and memory are dropped, and ops with identical costs share one count per action (their
order is arbitrary; merging removes that symmetry from the branch and bound). The solver stops
within ``mip_gap`` x (full recomputation's added time) of the optimum. `predict` evaluates any
policy with the same cost model.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pulp

from ..codecs import CodecError, available_codecs, get_codec
from ..errors import BudgetError, PolicyError
from ..policy import Action, GroupPolicy, OpSpec, Policy, Variant
from ..profiler import GroupProfile, OpProfile, Profile
from .budget import MiB, fmt_bytes, resolve_budget
from .static import StaticMemory

EPS_BLOCK_MS = 1e-6  # tie-breaker per checkpointed block: with time equal, checkpoint less
EPS_MIB_MS = 1e-9  # tie-breaker per MiB held: with time equal, hold less
SOLVERS = ("cbc", "highs")


@dataclass
class Solution:
    """A solved policy and the numbers the cost model predicts for it."""

    policy: Policy
    status: str  # "optimal", "feasible" (time limit), "fits" (no checkpointing), "fallback"
    solver: str
    solve_ms: float
    budget_nbytes: int
    static_nbytes: int
    held_nbytes: int  # activation bytes held for backward (all blocks + outside them)
    transient_nbytes: int
    peak_nbytes: int  # static + held + transient
    added_ms: float  # extra time per step vs no checkpointing (the objective, no tie-breaker)
    min_budget_nbytes: int  # the smallest budget any policy fits in
    checkpointed: dict[str, int] = field(default_factory=dict)  # K_g per group
    counts: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)  # g -> op -> a -> y


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


# --------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class _Choice:
    label: str  # "retain", "compress:<codec>" or "recompute"
    action: Action
    ms: float
    nbytes: int


@dataclass
class _Group:
    name: str
    prof: GroupProfile
    ops: list[tuple[OpProfile, list[_Choice]]]  # cacheable ops, choices in canonical order


def _choices(op: OpProfile, codecs: set[str] | None, max_rel_error: float | None) -> list[_Choice]:
    """The op's actions (retain, codecs by name, recompute) minus the dominated ones."""
    cands = [_Choice("retain", Action.retain(), 0.0, op.retain_nbytes)]
    for name in sorted(op.codecs):
        cp = op.codecs[name]
        if codecs is not None and name not in codecs:
            continue
        if max_rel_error is not None and not cp.rel_error <= max_rel_error:
            continue
        cands.append(
            _Choice(f"compress:{name}", Action.compress(name, **cp.params), cp.ms, cp.nbytes)
        )
    cands.append(_Choice("recompute", Action.recompute(), op.fwd_ms, 0))

    def beaten(i: int) -> bool:
        a = cands[i]
        for j, b in enumerate(cands):
            no_worse = j != i and b.ms <= a.ms and b.nbytes <= a.nbytes
            if no_worse and (b.ms < a.ms or b.nbytes < a.nbytes or j < i):
                return True
        return False

    return [c for i, c in enumerate(cands) if not beaten(i)]


def _groups(profile: Profile, codecs: set[str] | None, max_rel_error: float | None) -> list[_Group]:
    return [
        _Group(
            name,
            g,
            [(op, _choices(op, codecs, max_rel_error)) for op in g.ops if op.cacheable],
        )
        for name, g in sorted(profile.groups.items())
    ]


def _evaluate(
    profile: Profile, groups: list[_Group], k: dict[str, int], counts: dict[str, dict[str, dict]]
) -> tuple[int, float, int]:
    """(held bytes, added ms, transient bytes) of integer counts, computed exactly."""
    held, ms, transient = profile.nonblock_nbytes, [], _nonblock_transient(profile)
    for gm in groups:
        g, kg = gm.prof, k[gm.name]
        held += (g.num_blocks - kg) * g.full_nbytes + kg * g.input_nbytes
        ms.append(kg * g.fixed_ms)
        for op, choices in gm.ops:
            for c in choices:
                y = counts[gm.name][op.key].get(c.label, 0)
                held += y * c.nbytes
                ms.append(y * c.ms)
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
    floor = _nonblock_transient(profile)
    best = (profile.no_checkpoint_nbytes(), floor)
    for tr in sorted({g.transient_nbytes for g in gs}):
        held = profile.nonblock_nbytes
        for g in gs:
            per = min(g.full_nbytes, g.input_nbytes) if g.transient_nbytes <= tr else g.full_nbytes
            held += g.num_blocks * per
        if held + max(tr, floor) < sum(best):
            best = (held, max(tr, floor))
    return best


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
    no_checkpoint = static_nbytes + profile.no_checkpoint_nbytes() + _nonblock_transient(profile)
    if budget_nbytes >= no_checkpoint:
        return budget_nbytes
    share = budget_nbytes - static_nbytes
    planned = budget_nbytes - int(max(0, share) * headroom)
    return budget_nbytes if planned < min_budget(profile, static_nbytes) else planned


def _nonblock_transient(profile: Profile) -> int:
    """Backward temporary outside the blocks (e.g. the logits' gradient), if profiled."""
    return int(getattr(profile, "nonblock_transient_nbytes", 0) or 0)


# ------------------------------------------------------------------------------- solving
def _var(prob: pulp.LpProblem, name: str, lo: float | None, hi: float | None, cat: str) -> Any:
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3 (the 4.0 API)
        return prob.add_variable(name, lo, hi, cat=cat)
    return pulp.LpVariable(name, lo, hi, cat=cat)


def _make_solver(name: str, time_limit_s: float, gap_ms: float) -> tuple[Any, str]:
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r}; use one of {', '.join(SOLVERS)}")
    if name == "highs":
        for cls, label in ((getattr(pulp, "HiGHS", None), "highs"), (pulp.HiGHS_CMD, "highs_cmd")):
            try:
                s = cls(msg=False, timeLimit=time_limit_s, gapRel=0.0, gapAbs=gap_ms)
                if s.available():
                    return s, label
            except Exception:  # an unusable backend is just unavailable
                continue
        warnings.warn(
            "HiGHS is not available (pip install highspy); solving with CBC instead", stacklevel=3
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3 deprecates its bundled CBC
        cls = getattr(pulp, "PULP_CBC_CMD", None)
        kw = {"msg": False, "timeLimit": time_limit_s, "gapRel": 0.0, "gapAbs": gap_ms}
        s = cls(**kw) if cls is not None else None
    if s is None or not s.available():
        s = pulp.COIN_CMD(**kw)
    return s, "cbc"


def _classes(gm: _Group) -> list[tuple[list[OpProfile], list[_Choice]]]:
    """Ops with identical choices (time and bytes), merged: their order among each other is
    arbitrary, and one integer count per class removes that symmetry from the search."""
    by_key: dict[tuple, tuple[list[OpProfile], list[_Choice]]] = {}
    for op, choices in gm.ops:
        key = tuple((c.label, c.ms, c.nbytes) for c in choices)
        by_key.setdefault(key, ([], choices))[0].append(op)
    return list(by_key.values())


def _split_class(ops: list[OpProfile], choices: list[_Choice], totals: dict[str, int], k: int):
    """Per-op counts from a class's totals: op r takes slots [r k, (r+1) k) of the actions laid
    out in canonical order."""
    out, start = {}, 0
    bounds = []
    for c in choices:
        bounds.append((c.label, start, start + totals[c.label]))
        start += totals[c.label]
    for r, op in enumerate(ops):
        lo, hi = r * k, (r + 1) * k
        out[op.key] = {
            label: min(hi, b) - max(lo, a) for label, a, b in bounds if min(hi, b) > max(lo, a)
        }
    return out


def _solve_lp(
    groups: list[_Group],
    rhs_nbytes: int,
    split_blocks: bool,
    backend: Any,
    floor_nbytes: int = 0,
) -> tuple[dict[str, int], dict[str, dict[str, dict[str, int]]], str]:
    """Build and solve the MILP; returns (K, counts, status) or raises `_SolverFailure`."""
    prob = pulp.LpProblem("adacc_policy", pulp.LpMinimize)
    objective: list[Any] = []
    held: list[Any] = []
    k_vars: dict[str, tuple[Any, int]] = {}
    y_vars: dict[str, list[tuple[list[OpProfile], list[_Choice], dict[str, Any]]]] = {}
    # T: the transient peak, at least the backward temporary outside the blocks
    any_transient = any(gm.prof.transient_nbytes > floor_nbytes for gm in groups)
    t_var = _var(prob, "T", floor_nbytes / MiB, None, pulp.LpContinuous) if any_transient else None
    if t_var is None:
        rhs_nbytes -= floor_nbytes
    for gi, gm in enumerate(groups):
        g, n = gm.prof, gm.prof.num_blocks
        if n == 0:
            continue
        if split_blocks:  # K = k, y = counts
            k = _var(prob, f"K{gi}", 0, n, pulp.LpInteger)
            scale = 1
        else:  # K = n c, y = n x: one action table for every block
            k = _var(prob, f"c{gi}", 0, 1, pulp.LpBinary)
            scale = n
        k_vars[gm.name] = (k, scale)
        objective.append((g.fixed_ms + EPS_BLOCK_MS) * scale * k)
        held.append(n * g.full_nbytes / MiB - (g.full_nbytes - g.input_nbytes) / MiB * scale * k)
        y_vars[gm.name] = []
        for ci, (ops, choices) in enumerate(_classes(gm)):
            m = len(ops)
            hi = m * (n if split_blocks else 1)
            ys = {
                c.label: _var(prob, f"y{gi}_{ci}_{ai}", 0, hi, pulp.LpInteger)
                for ai, c in enumerate(choices)
            }
            for c in choices:
                if c.ms:
                    objective.append(c.ms * scale * ys[c.label])
                if c.nbytes:
                    held.append(c.nbytes / MiB * scale * ys[c.label])
            prob += pulp.lpSum(ys.values()) == m * k, f"one_action_{gi}_{ci}"
            y_vars[gm.name].append((ops, choices, ys))
        if t_var is not None and g.transient_nbytes > floor_nbytes:
            if split_blocks:
                z = _var(prob, f"z{gi}", 0, 1, pulp.LpBinary)
                prob += k <= n * z, f"z_{gi}"
            else:
                z = k
            prob += t_var >= g.transient_nbytes / MiB * z, f"transient_{gi}"
    held_expr = pulp.lpSum(held)
    prob += pulp.lpSum(objective) + EPS_MIB_MS * held_expr
    prob += held_expr + (t_var if t_var is not None else 0) <= rhs_nbytes / MiB, "budget"

    try:
        status = prob.solve(backend)
    except Exception as e:  # any solver crash falls back
        raise _SolverFailure(f"{type(e).__name__}: {e}") from None
    sol = getattr(prob, "sol_status", None)
    if status != pulp.LpStatusOptimal or sol not in (
        None,
        pulp.LpSolutionOptimal,
        pulp.LpSolutionIntegerFeasible,
    ):
        raise _SolverFailure(f"solver status {pulp.LpStatus.get(status, status)!r}")

    def value(v: Any) -> int:
        x = v.varValue
        if x is None or not math.isfinite(x):
            raise _SolverFailure("the solver returned no value for a variable")
        return round(x)

    ks = {gm.name: 0 for gm in groups}
    counts: dict[str, dict[str, dict[str, int]]] = {gm.name: {} for gm in groups}
    for name, (k, scale) in k_vars.items():
        ks[name] = value(k) * scale
        for ops, choices, ys in y_vars[name]:
            totals = {label: value(v) for label, v in ys.items()}
            per_op = _split_class(ops, choices, totals, value(k))
            for key, c in per_op.items():
                counts[name][key] = {label: y * scale for label, y in c.items()}
    for gm in groups:  # groups without blocks
        for op, _ in gm.ops:
            counts[gm.name].setdefault(op.key, {})
    return ks, counts, "optimal" if sol != pulp.LpSolutionIntegerFeasible else "feasible"


class _SolverFailure(Exception):
    pass


def _run(
    profile: Profile, groups: list[_Group], avail: int, split_blocks: bool, backend: Any
) -> tuple[dict[str, int], dict, str, str]:
    """Solve, check the integer solution exactly, and retry once with the budget tightened by
    any overshoot from the solver's tolerances. Returns (K, counts, status, failure reason)."""
    rhs = avail - profile.nonblock_nbytes
    reason = ""
    for _ in range(2):
        try:
            ks, counts, status = _solve_lp(
                groups, rhs, split_blocks, backend, _nonblock_transient(profile)
            )
        except _SolverFailure as e:
            return {}, {}, "fallback", str(e)
        bad = _check_counts(groups, ks, counts)
        held, _, tr = _evaluate(profile, groups, ks, counts)
        over = held + tr - avail
        if not bad and over <= 0:
            return ks, counts, status, ""
        reason = bad or f"the solution overshoots the budget by {over} bytes"
        rhs -= max(over, 1)
    return {}, {}, "fallback", reason


# ------------------------------------------------------------------------------- policy
def _recompute_ms(groups: list[_Group]) -> float:
    """Added time of full recomputation: the scale of ``mip_gap``."""
    per = [
        gm.prof.num_blocks * (gm.prof.fixed_ms + sum(op.fwd_ms for op, _ in gm.ops))
        for gm in groups
    ]
    return math.fsum(per)


def _full_recompute(groups: list[_Group]) -> tuple[dict[str, int], dict]:
    ks = {gm.name: gm.prof.num_blocks for gm in groups}
    counts = {
        gm.name: {op.key: {"recompute": gm.prof.num_blocks} for op, _ in gm.ops} for gm in groups
    }
    return ks, counts


def _variants(gm: _Group, k: int, counts: dict[str, dict[str, int]]) -> list[Variant]:
    """Block j < K applies, per op, the j-th action in the order of its cumulative counts."""
    blocks: list[tuple[str, ...]] = []
    for j in range(k):
        labels = []
        for op, choices in gm.ops:
            acc = 0
            for c in choices:
                acc += counts[op.key].get(c.label, 0)
                if j < acc:
                    labels.append(c.label)
                    break
            else:
                labels.append("recompute")
        blocks.append(tuple(labels))
    by_label = {(op.key, c.label): c.action for op, cs in gm.ops for c in cs}
    variants: list[Variant] = []
    for j, labels in enumerate(blocks):
        if j and labels == blocks[j - 1]:
            variants[-1].count += 1
            continue
        actions = {op.key: Action.recompute() for op in gm.prof.ops}
        for (op, _), label in zip(gm.ops, labels, strict=True):
            actions[op.key] = by_label.get((op.key, label), Action.recompute())
        variants.append(Variant(1, True, actions))
    if gm.prof.num_blocks - k > 0 or not variants:
        variants.append(Variant(gm.prof.num_blocks - k, False, {}))
    return variants


def _op_spec(op: OpProfile) -> OpSpec:
    return OpSpec(
        key=op.key,
        layer_type=op.layer_type,
        shape=tuple(op.shape),
        dtype=op.dtype,
        nbytes=op.nbytes,
        saved=op.saved,
        cacheable=op.cacheable,
    )


# ------------------------------------------------------------------------------ public API
def solve(
    profile: Profile,
    budget: int | float | str,
    *,
    static_nbytes: int | StaticMemory = 0,
    codecs: Iterable[str] | None = None,
    max_rel_error: float | None = 0.5,
    solver: str = "cbc",
    time_limit_s: float = 10.0,
    split_blocks: bool = True,
    mip_gap: float = 1e-3,
) -> Solution:
    """Solve for the fastest per-op policy of ``profile`` that fits in ``budget``.

    ``budget`` is anything `parse_budget` reads (``%`` and ``auto`` refer to ``profile.device``);
    ``static_nbytes`` is the policy-independent memory (see `estimate_static_memory`). Only
    codecs named in ``codecs`` (default: all profiled) whose measured relative error is
    ``<= max_rel_error`` (``None``: any) are used. The solver stops once its policy is provably
    within ``mip_gap`` x (the added time of full recomputation) of the optimum (``0``: prove
    optimality; that can take seconds on near-symmetric blocks), or after ``time_limit_s`` with
    the best policy found. Raises `BudgetError` when no policy fits. A solver failure falls back
    to full recomputation with a warning.
    """
    t0 = time.perf_counter()
    resolved = resolve_budget(budget, profile.device)
    static = static_nbytes.total if isinstance(static_nbytes, StaticMemory) else int(static_nbytes)
    if static < 0:
        raise BudgetError(f"static_nbytes must be >= 0, got {static}")
    if not profile.groups:
        raise PolicyError("the profile has no block groups: re-profile the model")
    allowed = _check_codecs(profile, codecs)
    if not mip_gap >= 0:
        raise ValueError(f"mip_gap must be >= 0, got {mip_gap!r}")
    if max_rel_error is not None and not max_rel_error >= 0:
        raise ValueError(f"max_rel_error must be >= 0 or None, got {max_rel_error!r}")
    groups = _groups(profile, allowed, max_rel_error)
    budget_nbytes = resolved.nbytes
    act_min, tr_min = min_activation_nbytes(profile)
    min_budget = static + act_min + tr_min
    if budget_nbytes < min_budget:
        raise BudgetError(
            _infeasible_message(profile, budget_nbytes, static_nbytes, act_min, tr_min)
        )

    label = solver
    floor = _nonblock_transient(profile)
    if static + profile.no_checkpoint_nbytes() + floor <= budget_nbytes:
        ks = {gm.name: 0 for gm in groups}
        counts = {gm.name: {op.key: {} for op, _ in gm.ops} for gm in groups}
        status = "fits"
    else:
        backend, label = _make_solver(solver, time_limit_s, mip_gap * _recompute_ms(groups))
        ks, counts, status, reason = _run(
            profile, groups, budget_nbytes - static, split_blocks, backend
        )
        if status == "fallback":
            warnings.warn(
                f"the policy solver failed ({reason}); falling back to full recomputation",
                stacklevel=2,
            )
            ks, counts = _full_recompute(groups)
        elif status == "feasible":
            warnings.warn(
                f"the solver hit its {time_limit_s:g} s time limit: the policy fits but may not "
                "be optimal (raise time_limit_s)",
                stacklevel=2,
            )
    held, added, tr = _evaluate(profile, groups, ks, counts)
    policy = _policy(profile, groups, ks, counts)
    solve_ms = (time.perf_counter() - t0) * 1e3
    sol = Solution(
        policy=policy,
        status=status,
        solver=label,
        solve_ms=solve_ms,
        budget_nbytes=budget_nbytes,
        static_nbytes=static,
        held_nbytes=held,
        transient_nbytes=tr,
        peak_nbytes=static + held + tr,
        added_ms=added,
        min_budget_nbytes=min_budget,
        checkpointed=ks,
        counts=counts,
    )
    policy.metadata = _metadata(profile, sol, str(budget), resolved.how, split_blocks)
    policy.metadata["mip_gap"] = mip_gap
    policy.metadata["gap_ms"] = mip_gap * _recompute_ms(groups)
    return sol


def solve_policy(
    profile: Profile,
    budget: int | float | str,
    *,
    static_nbytes: int | StaticMemory = 0,
    codecs: Iterable[str] | None = None,
    max_rel_error: float | None = 0.5,
    solver: str = "cbc",
    time_limit_s: float = 10.0,
    split_blocks: bool = True,
    mip_gap: float = 1e-3,
) -> Policy:
    """The `Policy` of `solve` (same arguments); its metadata holds the predicted numbers."""
    return solve(
        profile,
        budget,
        static_nbytes=static_nbytes,
        codecs=codecs,
        max_rel_error=max_rel_error,
        solver=solver,
        time_limit_s=time_limit_s,
        split_blocks=split_blocks,
        mip_gap=mip_gap,
    ).policy


def predict(profile: Profile, policy: Policy, static_nbytes: int | StaticMemory = 0) -> Prediction:
    """Held bytes, added time and peak of any ``policy`` under ``profile``'s cost model.

    Ops a variant does not name count as recompute; a codec the profile did not measure on an op
    is sized exactly (``Codec.predict_nbytes``) and timed as 0 ms (listed in ``unprofiled``).
    """
    import torch

    static = static_nbytes.total if isinstance(static_nbytes, StaticMemory) else int(static_nbytes)
    per_block: dict[str, list[int]] = {}
    ms: list[float] = []
    held, transient, unprofiled = profile.nonblock_nbytes, _nonblock_transient(profile), []
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


# ------------------------------------------------------------------------------- helpers
def _check_codecs(profile: Profile, codecs: Iterable[str] | None) -> set[str] | None:
    if codecs is None:
        return None
    if isinstance(codecs, str):
        codecs = [codecs]
    allowed = set(codecs)
    known = set(available_codecs()) | {
        c for g in profile.groups.values() for o in g.ops for c in o.codecs
    }
    unknown = sorted(allowed - known)
    if unknown:
        raise CodecError(f"unknown codec(s) {unknown}; available: {', '.join(sorted(known))}")
    return allowed


def _check_counts(groups: list[_Group], ks: dict[str, int], counts: dict) -> str:
    for gm in groups:
        k = ks.get(gm.name, 0)
        if not 0 <= k <= gm.prof.num_blocks:
            return f"group {gm.name}: {k} checkpointed blocks of {gm.prof.num_blocks}"
        for op, _ in gm.ops:
            c = counts[gm.name][op.key]
            if sum(c.values()) != k or min(c.values(), default=0) < 0:
                return f"group {gm.name}, op {op.key}: action counts {c} do not add up to {k}"
    return ""


def _policy(profile: Profile, groups: list[_Group], ks: dict[str, int], counts: dict) -> Policy:
    return Policy(
        model_type=profile.model_type,
        adapter=profile.adapter,
        adapter_version=profile.adapter_version,
        groups={
            gm.name: GroupPolicy(
                ops=[_op_spec(op) for op in gm.prof.ops],
                variants=_variants(gm, ks[gm.name], counts[gm.name]),
                input_nbytes=gm.prof.input_nbytes,
            )
            for gm in groups
        },
    )


def _metadata(
    profile: Profile, sol: Solution, spec: str, how: str, split_blocks: bool
) -> dict[str, Any]:
    pred = predict(profile, sol.policy, sol.static_nbytes)
    per_group: dict[str, list[dict[str, Any]]] = {}
    for name, gp in sol.policy.groups.items():
        blocks, i, rows = pred.per_block[name], 0, []
        for v in gp.variants:
            rows.append(
                {
                    "count": v.count,
                    "checkpoint": v.checkpoint,
                    "held_nbytes_per_block": blocks[i] if v.count else 0,
                }
            )
            i += v.count
        per_group[name] = rows
    return {
        "source": "milp",
        "solver": sol.solver,
        "status": sol.status,
        "solve_ms": round(sol.solve_ms, 3),
        "split_blocks": split_blocks,
        "budget_nbytes": sol.budget_nbytes,
        "budget_spec": spec,
        "budget_how": how,
        "static_nbytes": sol.static_nbytes,
        "predicted": {
            "held_nbytes": sol.held_nbytes,
            "groups": per_group,
            "transient_nbytes": sol.transient_nbytes,
            "peak_nbytes": sol.peak_nbytes,
            "added_ms": sol.added_ms,
            "min_budget_nbytes": sol.min_budget_nbytes,
        },
        "profile": {
            "device": profile.device,
            "dtype": profile.dtype,
            "batch_shape": profile.batch_shape,
        },
    }


def _infeasible_message(
    profile: Profile,
    budget: int,
    static: int | StaticMemory,
    act: int,
    transient: int,
) -> str:
    st = static.total if isinstance(static, StaticMemory) else int(static)
    need = st + act + transient
    if isinstance(static, StaticMemory):
        parts = (
            f"parameters {fmt_bytes(static.params)}, gradients {fmt_bytes(static.grads)}, "
            f"optimizer states {fmt_bytes(static.optimizer + static.master_weights)}"
        )
    else:
        parts = "parameters, gradients, optimizer states"
    msg = (
        f"no activation policy fits in a budget of {fmt_bytes(budget)} ({budget} bytes): the "
        f"smallest feasible budget is {fmt_bytes(need)} ({need} bytes) = static memory "
        f"{fmt_bytes(st)} ({parts}) + activations under full recomputation {fmt_bytes(act)} "
        f"(block inputs + {fmt_bytes(profile.nonblock_nbytes)} outside the blocks) + "
        f"{fmt_bytes(transient)} transient during backward (one block's recompute, or the "
        "gradient of the outputs). "
    )
    if st >= budget:
        msg += f"Static memory alone ({fmt_bytes(st)}) exceeds the budget. "
    if st >= act + transient:
        return msg + (
            "Static memory dominates: raise the budget, use an 8-bit optimizer "
            "(optim='adamw_bnb_8bit'), shard with ZeRO / FSDP or offload the optimizer, "
            "or train fewer parameters (LoRA)."
        )
    return msg + (
        "Activations dominate: raise the budget, use a smaller micro-batch (with gradient "
        "accumulation) or shorter sequences."
    )
