"""The policy solver: budgets, the static memory model, the cost model and the MILP.

    budget = parse_budget("20GiB")                      # or "80%", "auto", bytes
    static = estimate_static_memory(model, optimizer="adamw_torch")
    policy = solve_policy(profile, budget, static_nbytes=static.total)
    predict(profile, policy, static.total).peak_nbytes  # the cost model's view of any policy

Rooms: `budget` (specs -> bytes), `static` (parameters, gradients, optimizer states),
`cost_model` (bytes, time and peak of any policy), `headroom` (the budget planned for), `milp` (the LP), `realise` (counts -> policy),
`plan` (`solve`: the whole request).
"""

from .budget import describe_budget, parse_budget
from .cost_model import MAX_GRAD_ERROR, Prediction, grad_error_of, predict
from .headroom import HEADROOM, headroom_for, planned_budget
from .plan import Solution, least_memory_policy, solve, solve_policy
from .static import StaticMemory, estimate_static_memory, measured_static_memory
from .step import StepEstimate, step_peak
from .window import budget_between, budget_window, min_budget, no_checkpoint_budget

__all__ = [
    "HEADROOM",
    "MAX_GRAD_ERROR",
    "Prediction",
    "Solution",
    "StaticMemory",
    "StepEstimate",
    "budget_between",
    "budget_window",
    "describe_budget",
    "estimate_static_memory",
    "grad_error_of",
    "headroom_for",
    "least_memory_policy",
    "measured_static_memory",
    "min_budget",
    "no_checkpoint_budget",
    "parse_budget",
    "planned_budget",
    "predict",
    "solve",
    "solve_policy",
    "step_peak",
]
