"""Budget sweeps (``plan_sweep.py`` and tests): solve a model's policy over a range of budgets
and measure each one.

The measured activation memory (`adacc_hf.measure_activation_memory`) is independent of the
solver's prediction, so a sweep checks the memory model end to end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from adacc_hf import apply_adacc, measure_activation_memory
from adacc_hf.profiler import profile_model
from adacc_hf.solver import HEADROOM, estimate_static_memory, planned_budget, solve

from .adacc import budget_range


@dataclass
class SweepRow:
    budget_nbytes: int
    share_nbytes: int  # budget - static - transient: what activations may hold
    predicted_nbytes: int
    measured_nbytes: int
    added_ms: float
    checkpointed_blocks: int
    status: str
    actions: dict[str, int] = field(default_factory=dict)

    @property
    def error(self) -> float:
        return (self.measured_nbytes - self.predicted_nbytes) / self.predicted_nbytes


def budget_sweep(
    model: nn.Module,
    batch: Mapping[str, Any],
    points: int = 6,
    *,
    optimizer: str = "adamw_torch",
    repeats: int = 3,
    headroom: float = HEADROOM,
) -> list[SweepRow]:
    """Budgets from the smallest feasible one to the no-checkpointing need, `points` steps; each
    solved with the same `headroom` the Trainer integration keeps."""
    static = estimate_static_memory(model, optimizer=optimizer).total
    profile = profile_model(model, batch, repeats=repeats)
    low, high = budget_range(profile, static)
    rows = []
    for i in range(points + 1):
        budget = int(low + (high - low) * i / points)
        sol = solve(
            profile, planned_budget(budget, static, profile, headroom), static_nbytes=static
        )
        with apply_adacc(model, sol.policy):
            measured = measure_activation_memory(model, batch)
        kinds: dict[str, int] = {}
        for g in sol.policy.summary().values():
            for k, v in g.items():
                kinds[k.split(":")[0]] = kinds.get(k.split(":")[0], 0) + v
        rows.append(
            SweepRow(
                budget_nbytes=budget,
                share_nbytes=budget - static - sol.transient_nbytes,
                predicted_nbytes=sol.held_nbytes,
                measured_nbytes=measured,
                added_ms=sol.added_ms,
                checkpointed_blocks=sum(sol.checkpointed.values()),
                status=sol.status,
                actions=kinds,
            )
        )
    return rows
