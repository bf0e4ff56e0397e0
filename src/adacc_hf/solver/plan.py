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
from .budget import fmt_bytes, resolve_budget
from .cost_model import (
    evaluate,
    group_models,
    min_activation_nbytes,
    nonblock_transient,
    recompute_ms,
)
from .milp import make_solver, run
from .realise import Solution, full_recompute_counts, policy_from_counts, solve_metadata
from .static import StaticMemory


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
    allowed = check_codecs(profile, codecs)
    if not mip_gap >= 0:
        raise ValueError(f"mip_gap must be >= 0, got {mip_gap!r}")
    if max_rel_error is not None and not max_rel_error >= 0:
        raise ValueError(f"max_rel_error must be >= 0 or None, got {max_rel_error!r}")
    groups = group_models(profile, allowed, max_rel_error)
    budget_nbytes = resolved.nbytes
    act_min, tr_min = min_activation_nbytes(profile)
    min_budget = static + act_min + tr_min
    if budget_nbytes < min_budget:
        raise BudgetError(
            infeasible_message(profile, budget_nbytes, static_nbytes, act_min, tr_min)
        )

    label = solver
    floor = nonblock_transient(profile)
    if static + profile.no_checkpoint_nbytes() + floor <= budget_nbytes:
        ks = {gm.name: 0 for gm in groups}
        counts = {gm.name: {op.key: {} for op, _ in gm.ops} for gm in groups}
        status = "fits"
    else:
        backend, label = make_solver(solver, time_limit_s, mip_gap * recompute_ms(groups))
        ks, counts, status, reason = run(
            profile, groups, budget_nbytes - static, split_blocks, backend
        )
        if status == "fallback":
            warnings.warn(
                f"the policy solver failed ({reason}); falling back to full recomputation",
                stacklevel=2,
            )
            ks, counts = full_recompute_counts(groups)
        elif status == "feasible":
            warnings.warn(
                f"the solver hit its {time_limit_s:g} s time limit: the policy fits but may not "
                "be optimal (raise time_limit_s)",
                stacklevel=2,
            )
    held, added, tr = evaluate(profile, groups, ks, counts)
    policy = policy_from_counts(profile, groups, ks, counts)
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
    policy.metadata = solve_metadata(profile, sol, str(budget), resolved.how, split_blocks)
    policy.metadata["mip_gap"] = mip_gap
    policy.metadata["gap_ms"] = mip_gap * recompute_ms(groups)
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
