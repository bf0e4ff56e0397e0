"""The policy solver: memory budgets, the static memory model, and the MILP.

budget = parse_budget("20GiB")                      # or "80%", "auto", bytes
static = estimate_static_memory(model, optimizer="adamw_torch")
policy = solve_policy(profile, budget, static_nbytes=static.total)
predict(profile, policy, static.total).peak_nbytes  # the cost model's view of any policy
"""

from .budget import describe_budget, parse_budget
from .milp import Prediction, Solution, predict, solve, solve_policy
from .static import StaticMemory, estimate_static_memory, measured_static_memory

__all__ = [
    "Prediction",
    "Solution",
    "StaticMemory",
    "describe_budget",
    "estimate_static_memory",
    "measured_static_memory",
    "parse_budget",
    "predict",
    "solve",
    "solve_policy",
]
