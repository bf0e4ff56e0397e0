"""The policy maker: a MILP that picks retain / compress / recompute per op under a memory budget.

Per group g (``N_g`` blocks), the integer ``K_g`` in [0, N_g] counts its checkpointed blocks (the
others run without checkpointing and hold ``full_nbytes`` each) and, per cacheable op i and
action a, the integer ``y[g,i,a] >= 0`` counts the checkpointed blocks applying a to i
(``sum_a y[g,i,a] = K_g``). Costs per op and checkpointed block: retain (0 ms, ``retain_nbytes``),
compress with codec c (encode + decode ms, encoded bytes), recompute (``fwd_ms``, 0 bytes)::

    minimise   sum_g [K_g fixed_ms_g + V_g dispatch_ms_g + sum_{i,a} y t] + 1e-6 sum_g K_g
               + 1e-9 H
    subject to H = sum_g [(N_g - K_g) full_g + K_g (input_g + frame_g) + sum_{i,a} y m]
               H <= caps.all,   H + T <= caps.blocks,
               K_g <= N_g z_g,   T >= transient_g z_g,   N_g - K_g <= N_g p_g,
               T >= plain_transient_g p_g

(memory in MiB inside the LP). Where the profile has a host link (``GroupModel.link``), offload
and offload-with-a-codec are choices like the others (0 device bytes, host bytes), the integer
``B_g <= K_g`` counts blocks whose input is offloaded (``- B_g input_g`` in ``H``), every byte
offloaded counts against the host cap, and copies on a side stream add only what outlasts the
blocks' compute: ``E_g >= moved_g / bandwidth - K_g window_g``, ``E_g >= 0``, each way (the
bytes spread over the group's checkpointed blocks; `evaluate` prices the same). The caps come
from the step model (`step`): what the budget leaves
for held activations at the end of forward, and for them plus one block's backward transient at
the last block's backward; `plan` checks each solution's whole step and moves the caps. ``V_g``
counts the checkpointed blocks that pay the runtime's dispatch overhead (it keeps some op): with
binary ``w_g`` (some block of the group keeps an op), kept counts ``y <= m N_g w_g`` and
``V_g >= K_g - N_g (1 - w_g)``; a group mixing blocks that keep and blocks that do not is charged
for all its checkpointed blocks (an upper bound; `evaluate` prices the solution exactly).
``split_blocks=False`` is the paper's formulation: one action per
op for all blocks of a group (``K_g = N_g c_g``, ``y = N_g x``, ``c``, ``x`` binary). Neither
reduction below can change the optimum: actions that another action of the same op beats on both
time and memory are dropped, and ops with identical costs share one count per action (their
order is arbitrary; merging removes that symmetry from the branch and bound). The solver stops
within ``mip_gap`` x (full recomputation's added time) of the optimum. Costs come from `cost_model`;
turning the counts into a `Policy` is `realise`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import pulp

from ..policy.consistency import keeps_statistics, lossy
from ..schema import OpProfile
from ..units import MiB
from .cost_model import Choice, GroupModel, dispatch_ms, evaluate
from .offload import INPUT, STAGED_BLOCKS, copy_ms, overlap_windows
from .step import checkpointed_nbytes


@dataclass(frozen=True)
class Caps:
    """The MILP's two memory constraints: what the blocks hold may not exceed ``all_nbytes`` (the
    end of forward and the head's backward, where everything is held), nor, with the largest
    block backward transient, ``blocks_nbytes`` (the last block's backward)."""

    all_nbytes: int
    blocks_nbytes: int

    def shifted(self, delta: int) -> Caps:
        return Caps(self.all_nbytes + delta, self.blocks_nbytes + delta)


EPS_BLOCK_MS = 1e-6  # tie-breaker per checkpointed block: with time equal, checkpoint less
EPS_MIB_MS = 1e-9  # tie-breaker per MiB held: with time equal, hold less
SOLVERS = ("cbc", "highs")


def _var(prob: pulp.LpProblem, name: str, lo: float | None, hi: float | None, cat: str) -> Any:
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3 (the 4.0 API)
        return prob.add_variable(name, lo, hi, cat=cat)
    return pulp.LpVariable(name, lo, hi, cat=cat)


def make_solver(name: str, time_limit_s: float, gap_ms: float) -> tuple[Any, str]:
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


def _classes(gm: GroupModel) -> list[tuple[list[OpProfile], list[Choice]]]:
    """Ops with identical choices (time and bytes), merged: their order among each other is
    arbitrary, and one integer count per class removes that symmetry from the search. Ops the
    consistency constraints (`_consistency`) name stay classes of their own."""
    alone = _constrained(gm)
    by_key: dict[tuple, tuple[list[OpProfile], list[Choice]]] = {}
    for op, choices in gm.ops:
        key = tuple((c.label, c.ms, c.nbytes, c.grad_error, c.host_nbytes) for c in choices)
        if op.key in alone:
            key = (op.key, *key)
        by_key.setdefault(key, ([], choices))[0].append(op)
    return list(by_key.values())


def _lossy_labels(choices: list[Choice]) -> list[str]:
    return [c.label for c in choices if lossy(c.action)]


def _constrained(gm: GroupModel) -> set[str]:
    """Statistic ops that may be retained, and the ops before them with a lossy choice."""
    keys: set[str] = set()
    before: list[str] = []
    for op, choices in gm.ops:
        labels = {c.label for c in choices}
        if keeps_statistics(op) and "retain" in labels and before:
            keys.add(op.key)
            keys.update(before)
        if _lossy_labels(choices):
            before.append(op.key)
    return keys


def _error_bound(prob: pulp.LpProblem, gi: int, classes: list, bound: float, hi: int) -> None:
    """No block's gradient error above `bound`: the measured errors (`profiler.fidelity`) of the
    lossy actions a group uses anywhere, added in quadrature (each class of m ops counted m
    times: every block could hold all of them), ``sum e^2 m b <= bound^2`` with ``y <= hi m b``."""
    terms = []
    for ci, (ops, choices, ys) in enumerate(classes):
        for ai, c in enumerate(choices):
            if c.grad_error <= 0 or not lossy(c.action):
                continue
            b = _var(prob, f"e{gi}_{ci}_{ai}", 0, 1, pulp.LpBinary)
            prob += ys[c.label] <= hi * len(ops) * b, f"uses_{gi}_{ci}_{ai}"
            terms.append(c.grad_error**2 * len(ops) * b)
    if terms:
        prob += pulp.lpSum(terms) <= bound**2, f"grad_error_{gi}"


def _consistency(prob: pulp.LpProblem, gi: int, gm: GroupModel, ys_of: dict, k: Any) -> None:
    """No statistic op retained in a block where an earlier op is lossily compressed
    (`policy.consistency`): op j's lossy blocks and statistic op s's retained blocks are
    disjoint, ``lossy_j + retain_s <= K``; realisation (`realise.variants`) then places j's lossy
    actions among s's recomputing blocks."""
    earlier: list[tuple[int, list[Any]]] = []
    for i, (op, choices) in enumerate(gm.ops):
        ys = ys_of.get(op.key)
        if ys is None:
            continue
        if keeps_statistics(op) and "retain" in ys:
            for j, lossy_ys in earlier:
                prob += pulp.lpSum(lossy_ys) + ys["retain"] <= k, f"stat_{gi}_{i}_{j}"
        labels = _lossy_labels(choices)
        if labels:
            earlier.append((i, [ys[lab] for lab in labels]))


def _split_class(ops: list[OpProfile], choices: list[Choice], totals: dict[str, int], k: int):
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


def solve_lp(
    groups: list[GroupModel],
    caps: Caps,
    split_blocks: bool,
    backend: Any,
) -> tuple[dict[str, int], dict[str, dict[str, dict[str, int]]], str]:
    """Build and solve the MILP; returns (K, counts, status) or raises `SolverFailure`."""
    prob = pulp.LpProblem("adacc_policy", pulp.LpMinimize)
    objective: list[Any] = []
    held: list[Any] = []
    k_vars: dict[str, tuple[Any, int]] = {}
    y_vars: dict[str, list[tuple[list[OpProfile], list[Choice], dict[str, Any]]]] = {}
    # T: the largest transient of a block's backward (checkpointed, or plain)
    any_transient = any(gm.prof.transient_nbytes or gm.prof.plain_transient_nbytes for gm in groups)
    t_var = _var(prob, "T", 0, None, pulp.LpContinuous) if any_transient else None
    host: list[Any] = []  # MiB offloaded to host memory
    b_vars: dict[str, Any] = {}
    # S: STAGED_BLOCKS x the most a block may stage back (`cost_model.staging`)
    s_var = None
    if any(gm.link is not None for gm in groups):
        s_var = _var(prob, "S", 0, None, pulp.LpContinuous)
    link = next((gm.link for gm in groups if gm.link is not None), None)
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
        gain = (g.full_nbytes - checkpointed_nbytes(g)) / MiB  # per block checkpointed
        held.append(n * g.full_nbytes / MiB - gain * scale * k)
        y_vars[gm.name] = []
        d_ms = dispatch_ms(g)
        w = _var(prob, f"w{gi}", 0, 1, pulp.LpBinary) if d_ms > 0 else None
        if w is not None:  # checkpointed blocks pay the dispatch overhead when any op is kept
            v = _var(prob, f"v{gi}", 0, n, pulp.LpContinuous)
            prob += v >= scale * k - n * (1 - w), f"dispatch_{gi}"
            objective.append(d_ms * v)
        moved: list[Any] = []  # MiB this group offloads, out and back
        stage: list[Any] = []  # MiB one block may stage back: per op offloaded anywhere
        if gm.link is not None and g.input_nbytes:
            b = _var(prob, f"B{gi}", 0, n if split_blocks else 1, pulp.LpInteger)
            prob += b <= k, f"inputs_{gi}"
            b_vars[gm.name] = (b, scale)
            held.append(-g.input_nbytes / MiB * scale * b)
            objective.append(copy_ms(gm.link, g.input_nbytes) * scale * b)
            moved.append(g.input_nbytes / MiB * scale * b)
            u = _var(prob, f"ub{gi}", 0, 1, pulp.LpBinary)
            prob += b <= n * u, f"stage_input_{gi}"
            stage.append(g.input_nbytes / MiB * u)
        for ci, (ops, choices) in enumerate(_classes(gm)):
            m = len(ops)
            hi = m * (n if split_blocks else 1)
            ys = {
                c.label: _var(prob, f"y{gi}_{ci}_{ai}", 0, hi, pulp.LpInteger)
                for ai, c in enumerate(choices)
            }
            for ai, c in enumerate(choices):
                if c.ms:
                    objective.append(c.ms * scale * ys[c.label])
                if c.nbytes:
                    held.append(c.nbytes / MiB * scale * ys[c.label])
                if c.host_nbytes:
                    moved.append(c.host_nbytes / MiB * scale * ys[c.label])
                if w is not None and c.label != "recompute":
                    prob += ys[c.label] <= hi * w, f"keeps_{gi}_{ci}_{ai}"
            offloads = [(ai, c) for ai, c in enumerate(choices) if c.host_nbytes]
            if offloads:  # some block offloads the class: a block may stage all m of them
                u = _var(prob, f"u{gi}_{ci}", 0, 1, pulp.LpBinary)
                for ai, c in offloads:
                    prob += ys[c.label] <= hi * u, f"stage_{gi}_{ci}_{ai}"
                stage.append(m * max(c.host_nbytes for _, c in offloads) / MiB * u)
            prob += pulp.lpSum(ys.values()) == m * k, f"one_action_{gi}_{ci}"
            y_vars[gm.name].append((ops, choices, ys))
        host += moved
        if stage and s_var is not None:
            prob += s_var >= STAGED_BLOCKS * pulp.lpSum(stage), f"staged_{gi}"
        if moved and gm.link is not None and gm.link.overlap:
            _exposure(prob, gi, gm, pulp.lpSum(moved), scale * k, objective)
        if gm.max_grad_error is not None:
            _error_bound(prob, gi, y_vars[gm.name], gm.max_grad_error, n if split_blocks else 1)
        singles = {ops[0].key: ys for ops, _, ys in y_vars[gm.name] if len(ops) == 1}
        if _constrained(gm):
            _consistency(prob, gi, gm, singles, k)
        if t_var is None:
            continue
        if g.transient_nbytes:  # some block of the group checkpointed
            if split_blocks:
                z = _var(prob, f"z{gi}", 0, 1, pulp.LpBinary)
                prob += k <= n * z, f"z_{gi}"
            else:
                z = k
            prob += t_var >= g.transient_nbytes / MiB * z, f"transient_{gi}"
        if g.plain_transient_nbytes:  # some block of the group plain
            p = _var(prob, f"p{gi}", 0, 1, pulp.LpBinary)
            prob += n - scale * k <= n * p, f"p_{gi}"
            prob += t_var >= g.plain_transient_nbytes / MiB * p, f"plain_transient_{gi}"
    held_expr = pulp.lpSum(held)
    prob += pulp.lpSum(objective) + EPS_MIB_MS * (held_expr + pulp.lpSum(host))
    prob += held_expr <= caps.all_nbytes / MiB, "held"
    if host and link is not None and link.host_cap_nbytes:
        prob += pulp.lpSum(host) <= link.host_cap_nbytes / MiB, "host_cap"
    backward = held_expr + (t_var if t_var is not None else 0) + (s_var if s_var is not None else 0)
    prob += backward <= caps.blocks_nbytes / MiB, "backward"

    try:
        status = prob.solve(backend)
    except Exception as e:  # any solver crash falls back
        raise SolverFailure(f"{type(e).__name__}: {e}") from None
    sol = getattr(prob, "sol_status", None)
    if status != pulp.LpStatusOptimal or sol not in (
        None,
        pulp.LpSolutionOptimal,
        pulp.LpSolutionIntegerFeasible,
    ):
        raise SolverFailure(f"solver status {pulp.LpStatus.get(status, status)!r}")

    def value(v: Any) -> int:
        x = v.varValue
        if x is None or not math.isfinite(x):
            raise SolverFailure("the solver returned no value for a variable")
        return round(x)

    ks = {gm.name: 0 for gm in groups}
    counts: dict[str, dict[str, dict[str, int]]] = {gm.name: {} for gm in groups}
    for name, (b, scale) in b_vars.items():
        if value(b):
            counts[name][INPUT] = {"offload": value(b) * scale}
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


def _exposure(
    prob: pulp.LpProblem, gi: int, gm: GroupModel, moved: Any, blocks: Any, objective: list
) -> None:
    """Side-stream copies cost what outlasts the group's checkpointed blocks' forwards (out) and
    backwards (back): ``E >= moved / bandwidth - blocks window``, ``E >= 0``, each way."""
    link = gm.link
    assert link is not None
    fwd, bwd = overlap_windows(gm.prof)
    for way, per_mib, window in (("out", link.d2h_ms(MiB), fwd), ("back", link.h2d_ms(MiB), bwd)):
        e = _var(prob, f"E{way}{gi}", 0, None, pulp.LpContinuous)
        prob += e >= per_mib * moved - window * blocks, f"exposed_{way}_{gi}"
        objective.append(e)


class SolverFailure(Exception):
    pass


def run(
    groups: list[GroupModel], caps: Caps, split_blocks: bool, backend: Any
) -> tuple[dict[str, int], dict, str, str]:
    """Solve, check the integer solution exactly against the caps, and retry once with the caps
    tightened by any overshoot from the solver's tolerances. Returns (K, counts, status, failure
    reason)."""
    reason = ""
    for _ in range(2):
        try:
            ks, counts, status = solve_lp(groups, caps, split_blocks, backend)
        except SolverFailure as e:
            return {}, {}, "fallback", str(e)
        bad = check_counts(groups, ks, counts)
        held, _, tr = evaluate(groups, ks, counts)
        over = max(held - caps.all_nbytes, held + tr - caps.blocks_nbytes)
        if not bad and over <= 0:
            return ks, counts, status, ""
        reason = bad or f"the solution overshoots its cap by {over} bytes"
        caps = Caps(caps.all_nbytes - max(over, 1), caps.blocks_nbytes - max(over, 1))
    return {}, {}, "fallback", reason


def check_counts(groups: list[GroupModel], ks: dict[str, int], counts: dict) -> str:
    for gm in groups:
        k = ks.get(gm.name, 0)
        if not 0 <= k <= gm.prof.num_blocks:
            return f"group {gm.name}: {k} checkpointed blocks of {gm.prof.num_blocks}"
        for op, _ in gm.ops:
            c = counts[gm.name][op.key]
            if sum(c.values()) != k or min(c.values(), default=0) < 0:
                return f"group {gm.name}, op {op.key}: action counts {c} do not add up to {k}"
        inputs = counts[gm.name].get(INPUT, {}).get("offload", 0)
        if not 0 <= inputs <= k:
            return f"group {gm.name}: {inputs} offloaded inputs of {k} checkpointed blocks"
    return ""
