"""`solve`: the fastest per-op policy of a `Profile` that fits a budget.

It checks the request, finds the smallest feasible budget (and says what dominates it when the
budget is below), builds and solves the MILP (`milp`), falls back to full recomputation if the
solver fails, and realises the counts as a `Policy` whose metadata holds the cost model's
prediction (`realise`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable

from ..codecs import CodecError, available_codecs
from ..errors import BudgetError, PolicyError
from ..policy import Policy
from ..schema import Profile
from ..units import fmt_bytes
from .budget import resolve_budget
from .cost_model import Prediction, group_models, predict, recompute_ms
from .milp import Caps, make_solver, run
from .realise import Solution, full_recompute_counts, policy_from_counts, solve_metadata
from .static import StaticMemory
from .step import StepEstimate, extreme_peaks, lp_caps
from .window import candidate_heads


def solve(
    profile: Profile,
    budget: int | float | str,
    *,
    static_nbytes: int | StaticMemory = 0,
    codecs: Iterable[str] | None = None,
    max_rel_error: float | None = 0.5,
    max_grad_error: float | None = None,
    solver: str = "cbc",
    time_limit_s: float = 10.0,
    split_blocks: bool = True,
    mip_gap: float = 1e-3,
    accumulation: int = 1,
    head: str = "full",
) -> Solution:
    """Solve for the fastest per-op policy of ``profile`` whose step peaks within ``budget``.

    The MILP (`milp`) picks each op's action per block; the policy is the one with the least
    added time per step whose predicted step peak fits. A solver failure falls back to full
    recomputation with a warning.

    Args:
        profile: the model's `Profile` (`profile_model`).
        budget: anything `parse_budget` reads (``%`` and ``auto`` refer to ``profile.device``).
        static_nbytes: the policy-independent memory (see `estimate_static_memory`): a
            `StaticMemory`, or bytes resident all step long.
        codecs: the codecs the policy may use (default: all profiled).
        max_rel_error: a codec is used on an op only if its measured relative error there is
            ``<= max_rel_error`` (``None``: any).
        max_grad_error: bounds each block's gradient error (its lossy ops' measured
            ``grad_error`` added in quadrature, `profiler.fidelity`; unmeasured codecs count 0);
            None: no bound.
        solver: the MILP solver: ``"cbc"`` or ``"highs"`` (CBC where HiGHS is not installed).
        time_limit_s: after this many seconds the best policy found is used.
        split_blocks: let the blocks of a group run different action tables (False: one per
            group, the paper's formulation).
        mip_gap: the solver stops once its policy is provably within ``mip_gap`` x (the added
            time of full recomputation) of the optimum (``0``: prove optimality; that can take
            seconds on near-symmetric blocks).
        accumulation: micro-batches per optimizer step; > 1: gradients are alive through every
            micro-batch but the first.
        head: how the LM head and loss run (`schema.HEADS`), or ``"auto"``: each way the profile
            measured is solved for and the fastest fitting one wins (``policy.head``).

    Returns:
        The `Solution`: the policy, the solver's status and the predicted held bytes, step peak
        and added time.

    Raises:
        BudgetError: no policy fits (the message says what dominates the step), or a malformed
            budget.
        PolicyError: a profile without block groups, or a `head` the profile did not measure.
        CodecError: a codec in `codecs` that does not exist.
        ValueError: a negative `mip_gap`, `max_rel_error` or `max_grad_error`, an `accumulation`
            below 1, or an unknown `solver`.
    """
    heads = candidate_heads(profile, head)
    kwargs = dict(
        static_nbytes=static_nbytes,
        codecs=codecs,
        max_rel_error=max_rel_error,
        max_grad_error=max_grad_error,
        solver=solver,
        time_limit_s=time_limit_s,
        split_blocks=split_blocks,
        mip_gap=mip_gap,
        accumulation=accumulation,
    )
    if len(heads) == 1:
        return _solve(profile, budget, head=heads[0], **kwargs)
    found: list[tuple[Solution, list]] = []
    error: BudgetError | None = None
    for h in heads:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                found.append((_solve(profile, budget, head=h, **kwargs), caught))
            except BudgetError as e:
                error = e if error is None else error
    if not found:
        assert error is not None
        raise error
    best, caught = min(
        found,
        key=lambda f: (f[0].status == "fallback", f[0].added_ms, f[0].peak_nbytes),
    )
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    best.min_budget_nbytes = min(f[0].min_budget_nbytes for f in found)
    return best


def _solve(
    profile: Profile,
    budget: int | float | str,
    *,
    static_nbytes: int | StaticMemory,
    codecs: Iterable[str] | None,
    max_rel_error: float | None,
    max_grad_error: float | None,
    solver: str,
    time_limit_s: float,
    split_blocks: bool,
    mip_gap: float,
    accumulation: int,
    head: str,
) -> Solution:
    """`solve` with the LM head run as `head`."""
    t0 = time.perf_counter()
    resolved = resolve_budget(budget, profile.device)
    static = static_nbytes.total if isinstance(static_nbytes, StaticMemory) else int(static_nbytes)
    if static < 0:
        raise BudgetError(f"static_nbytes must be >= 0, got {static}")
    if not profile.groups:
        raise PolicyError("the profile has no block groups: re-profile the model")
    allowed = check_codecs(profile, codecs)
    if not mip_gap >= 0:
        raise ValueError(f"mip_gap must be >= 0, got {mip_gap!r}")
    if max_rel_error is not None and not max_rel_error >= 0:
        raise ValueError(f"max_rel_error must be >= 0 or None, got {max_rel_error!r}")
    if accumulation < 1:
        raise ValueError(f"accumulation must be >= 1, got {accumulation!r}")
    if max_grad_error is not None and not max_grad_error >= 0:
        raise ValueError(f"max_grad_error must be >= 0 or None, got {max_grad_error!r}")
    groups = group_models(profile, allowed, max_rel_error, max_grad_error)
    budget_nbytes = resolved.nbytes
    low, high = extreme_peaks(profile, static_nbytes, accumulation, head)
    if budget_nbytes < low.peak_nbytes:
        raise BudgetError(infeasible_message(profile, budget_nbytes, static_nbytes, low))

    def realise(ks: dict, counts: dict, models: list = groups) -> tuple[Policy, Prediction]:
        policy = policy_from_counts(profile, models, ks, counts)
        policy.head = head
        # per-op sums alone: every candidate priced alike, as the MILP prices them
        return policy, predict(profile, policy, static_nbytes, accumulation, measured_ms=False)

    label = solver
    if high.peak_nbytes <= budget_nbytes:
        ks = {gm.name: 0 for gm in groups}
        counts = {gm.name: {op.key: {} for op, _ in gm.ops} for gm in groups}
        status = "fits"
        policy, pred = realise(ks, counts)
    else:
        backend, label = make_solver(solver, time_limit_s, mip_gap * recompute_ms(groups))
        caps = Caps(*lp_caps(profile, budget_nbytes, static_nbytes, accumulation, head))
        found = _search(groups, budget_nbytes, caps, split_blocks, backend, realise)
        if profile.offload is not None:
            # The cap search is a heuristic: searched without offload too, a plan with a host
            # link is never slower than the same budget's plan without one.
            plain = group_models(profile, allowed, max_rel_error, max_grad_error, offload=False)
            other = _search(
                plain, budget_nbytes, caps, split_blocks, backend, lambda k, c: realise(k, c, plain)
            )
            if other is not None and (
                found is None
                or (other[4].added_ms, other[4].peak_nbytes)
                < (found[4].added_ms, found[4].peak_nbytes)
            ):
                found = other
        if found is None:
            status = "fallback"
        else:
            ks, counts, status, policy, pred = found
        if status == "fallback":
            ks, counts = full_recompute_counts(groups, low.inputs_offloaded)
            policy, pred = realise(ks, counts)
            # At the floor (the budget within the search's tolerance of the least step peak) full
            # recomputation is the answer, not a failure: the MILP's linear caps only approximate
            # the step, and every candidate it finds there keeps a little too much.
            floor = budget_nbytes - low.peak_nbytes <= CAP_TOLERANCE * budget_nbytes
            if floor and pred.peak_nbytes <= budget_nbytes:
                status = "least"
            else:
                warnings.warn(
                    "the policy solver found no policy that fits (or failed); falling back to "
                    "full recomputation",
                    stacklevel=2,
                )
        elif status == "feasible":
            warnings.warn(
                f"the solver hit its {time_limit_s:g} s time limit: the policy fits but may not "
                "be optimal (raise time_limit_s)",
                stacklevel=2,
            )
    solve_ms = (time.perf_counter() - t0) * 1e3
    sol = Solution(
        policy=policy,
        status=status,
        solver=label,
        solve_ms=solve_ms,
        budget_nbytes=budget_nbytes,
        static_nbytes=static,
        held_nbytes=pred.held_nbytes,
        transient_nbytes=pred.transient_nbytes,
        peak_nbytes=pred.peak_nbytes,
        added_ms=pred.added_ms,
        min_budget_nbytes=low.peak_nbytes,
        moment=pred.moment,
        checkpointed=ks,
        counts=counts,
    )
    policy.metadata = solve_metadata(profile, sol, pred, str(budget), resolved.how, split_blocks)
    policy.metadata["mip_gap"] = mip_gap
    policy.metadata["gap_ms"] = mip_gap * recompute_ms(groups)
    policy.metadata["accumulation"] = accumulation
    policy.metadata["head"] = head
    return sol


#: The cap search stops once a fitting policy leaves less than this share of the budget unused.
CAP_TOLERANCE = 0.002
CAP_STEPS = 12


def _search(groups, budget, caps, split_blocks, backend, realise):
    """The fastest MILP policy whose whole step peaks within `budget`.

    The MILP bounds the blocks' held bytes by two caps (`milp.Caps`, first from the step model at
    full recomputation's timeline); the step's peak also depends on where in backward the
    gradients meet the activations, so each candidate is checked with the step model and both caps
    move by the overshoot (or the room left), then are bisected. Returns (K, counts, status,
    policy, prediction) of the fastest fitting candidate, or None.
    """
    lo = hi = floor = None  # cap shifts known to fit / to overshoot / to be infeasible (too tight)
    best = None
    shift = 0
    misses = 0  # overshooting candidates before the first fit: each step down doubles
    for _ in range(CAP_STEPS):
        ks, counts, status, _reason = run(groups, caps.shifted(shift), split_blocks, backend)
        room = 0
        if status == "fallback":  # the solver failed, or nothing holds this little: loosen
            floor = shift if floor is None else max(floor, shift)
        else:
            policy, pred = realise(ks, counts)
            room = budget - pred.peak_nbytes
            if room >= 0:
                if best is None or (pred.added_ms, pred.peak_nbytes) < (
                    best[4].added_ms,
                    best[4].peak_nbytes,
                ):
                    best = (ks, counts, status, policy, pred)
                lo = shift if lo is None else max(lo, shift)
                if room <= CAP_TOLERANCE * budget or pred.added_ms == 0:
                    break
            else:
                hi = shift if hi is None else min(hi, shift)
                misses += 1
        below = max((x for x in (lo, floor) if x is not None), default=None)
        if below is not None and hi is not None:
            if hi - below <= CAP_TOLERANCE * budget:
                break
            shift = (below + hi) // 2
        elif below is not None:
            shift += max(room, 1) if status != "fallback" else max(budget // 16, 1)
        else:
            # Tightening the caps by the overshoot can overshoot again by about as much (the step
            # peak moves with where the solver puts what it keeps): double the step each time.
            shift -= max(-room, 1) << min(misses - 1, 20)
    return best


def solve_policy(
    profile: Profile,
    budget: int | float | str,
    *,
    static_nbytes: int | StaticMemory = 0,
    codecs: Iterable[str] | None = None,
    max_rel_error: float | None = 0.5,
    max_grad_error: float | None = None,
    solver: str = "cbc",
    time_limit_s: float = 10.0,
    split_blocks: bool = True,
    mip_gap: float = 1e-3,
    accumulation: int = 1,
    head: str = "full",
) -> Policy:
    """The `Policy` of `solve` (same arguments); its metadata holds the predicted numbers.

    Args:
        profile: the model's `Profile` (`profile_model`).
        budget: anything `parse_budget` reads (``%`` and ``auto`` refer to ``profile.device``).
        static_nbytes: the policy-independent memory (`estimate_static_memory`), or bytes.
        codecs: the codecs the policy may use (default: all profiled).
        max_rel_error: the largest measured relative error of a codec on an op (None: any).
        max_grad_error: the bound on each block's gradient error (None: no bound).
        solver: the MILP solver: ``"cbc"`` or ``"highs"``.
        time_limit_s: after this many seconds the best policy found is used.
        split_blocks: let the blocks of a group run different action tables.
        mip_gap: the relative optimality gap the solver stops at (``0``: prove optimality).
        accumulation: micro-batches per optimizer step.
        head: how the LM head and loss run (`schema.HEADS`), or ``"auto"``.

    Returns:
        The fastest policy that fits; ``policy.metadata["predicted"]`` holds the cost model's
        numbers.

    Raises:
        BudgetError: no policy fits, or a malformed budget (and the rest as `solve`).
    """
    return solve(
        profile,
        budget,
        static_nbytes=static_nbytes,
        codecs=codecs,
        max_rel_error=max_rel_error,
        max_grad_error=max_grad_error,
        solver=solver,
        time_limit_s=time_limit_s,
        split_blocks=split_blocks,
        mip_gap=mip_gap,
        accumulation=accumulation,
        head=head,
    ).policy


def check_codecs(profile: Profile, codecs: Iterable[str] | None) -> set[str] | None:
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


def infeasible_message(
    profile: Profile, budget: int, static: int | StaticMemory, least: StepEstimate
) -> str:
    """Why no policy fits: the least step peak, the moment that sets it, and what to change."""
    need = least.peak_nbytes
    inputs = " with the block inputs in host memory" if least.inputs_offloaded else ""
    if isinstance(static, StaticMemory):
        st = static.total + static.buffers
        parts = (
            f"parameters {fmt_bytes(static.params)}, gradients {fmt_bytes(static.grads)}, "
            f"optimizer states {fmt_bytes(static.optimizer + static.master_weights)}"
        )
        if static.optimizer_step:
            parts += f"; the optimizer step adds {fmt_bytes(static.optimizer_step)} of temporaries"
    else:
        st, parts = int(static), "parameters, gradients, optimizer states"
    act = need - st
    msg = (
        f"no activation policy fits in a budget of {fmt_bytes(budget)} ({budget} bytes): the "
        f"smallest feasible budget is {fmt_bytes(need)} ({need} bytes), the step's peak under "
        f"full recomputation{inputs}, reached at its '{least.moment}' moment: static memory "
        f"{fmt_bytes(st)} ({parts}) + {fmt_bytes(act)} of activations, gradients in flight and "
        f"transients ({fmt_bytes(profile.full_recompute_nbytes())} held for backward). "
    )
    if st >= budget:
        msg += f"Static memory alone ({fmt_bytes(st)}) exceeds the budget. "
    if st >= act or least.moment in ("optimizer", "tail"):
        return msg + (
            "Static memory dominates: raise the budget, use an 8-bit or fused optimizer "
            "(optim='adamw_bnb_8bit' / 'adamw_torch_fused'), shard with ZeRO / FSDP or offload "
            "the optimizer, or train fewer parameters (LoRA)."
        )
    return msg + (
        "Activations dominate: raise the budget, use a smaller micro-batch (with gradient "
        "accumulation) or shorter sequences"
        + (
            ", or let the solver offload to host memory (offload=True / adacc_offload)."
            if profile.offload is None
            else "."
        )
    )


def least_memory_policy(
    profile: Profile,
    static_nbytes: int | StaticMemory = 0,
    accumulation: int = 1,
    head: str = "full",
) -> Policy:
    """Full recomputation (router outputs retained; block inputs offloaded where the profile's
    host link makes that the least): the policy holding the least, for a batch the budget cannot
    hold, with the LM head whose step peaks lowest among `head`'s candidates; its metadata holds
    the predicted numbers."""
    groups = group_models(profile, None, None)
    low, policy_head = min(
        (
            (extreme_peaks(profile, static_nbytes, accumulation, h)[0], h)
            for h in candidate_heads(profile, head)
        ),
        key=lambda e: e[0].peak_nbytes,
    )
    counts = full_recompute_counts(groups, low.inputs_offloaded)
    policy = policy_from_counts(profile, groups, *counts)
    policy.head = policy_head
    pred = predict(profile, policy, static_nbytes, accumulation)
    policy.metadata = {
        "source": "least_memory",
        "predicted": {
            "held_nbytes": pred.held_nbytes,
            "transient_nbytes": pred.transient_nbytes,
            "peak_nbytes": pred.peak_nbytes,
            "peak_moment": pred.moment,
            "added_ms": pred.added_ms,
        },
    }
    return policy
