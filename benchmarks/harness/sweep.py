"""Budget sweeps (benchmarks and tests): the step peak the plan predicts against the one measured.

For budgets from the least any policy needs (full recomputation's step peak) to the peak without
checkpointing, a session plans the run's batches as training would (one plan per bucket of
shapes, under the run's autocast, with the run's optimizer), and every batch's training step is
measured with `adacc_hf.measure_step_peak` (live storages on CPU, the allocator on CUDA) —
independently of the prediction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adacc_hf import measure_step_peak, profile_model
from adacc_hf.engine.config import AdaccConfig
from adacc_hf.engine.facts import RunFacts
from adacc_hf.engine.session import AdaccSession
from adacc_hf.policy.display import totals
from adacc_hf.solver import budget_between, estimate_static_memory

MIXED = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class StepRow:
    """One measured training step of a sweep."""

    budget_nbytes: int
    shape: list[int]  # the batch's micro-batch size and lengths
    bucket: list[int]  # the bucket it was planned in
    predicted_nbytes: int  # the plan's predicted step peak (for the bucket's edge)
    measured_nbytes: int
    moment: str  # the moment the prediction says sets the peak
    added_ms: float
    actions: dict[str, int] = field(default_factory=dict)
    unknown_ops: int = 0

    @property
    def error(self) -> float:
        return (self.measured_nbytes - self.predicted_nbytes) / self.predicted_nbytes

    @property
    def at_edge(self) -> bool:
        """The batch is as long as its bucket's edge (the prediction is for exactly this shape)."""
        return self.shape == self.bucket[: len(self.shape)]


def _shape(batch: Mapping[str, Any]) -> list[int]:
    t = next(v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2)
    return [int(t.shape[0]), int(t.shape[1])]


def budget_sweep(
    make_model: Callable[[], nn.Module],
    batches: Sequence[Mapping[str, Any]],
    points: int = 5,
    *,
    optimizer: str = "adamw_torch",
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    autocast: torch.dtype | None = None,
    repeats: int = 1,
) -> list[StepRow]:
    """For `points` budgets between the least and no checkpointing of the longest batch (what full
    recomputation needs for it, up to what no checkpointing needs), train one step on each batch
    of `batches` in turn (the first plans and the others plan their own buckets as they come) and
    measure each step's peak. A fresh model (`make_model`) and optimizer per budget keep the runs
    independent."""
    make_optimizer = make_optimizer or (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4))
    model = make_model()
    static = estimate_static_memory(model, optimizer=optimizer, mixed_precision=MIXED.get(autocast))
    longest = max(batches, key=lambda b: _shape(b)[0] * _shape(b)[1])
    first = profile_model(model, longest, repeats=repeats, autocast=autocast)
    rows = []
    for i in range(points + 1):
        budget = budget_between(first, static, i / points)
        model = make_model().train()
        opt = make_optimizer(model)
        config = AdaccConfig(
            budget=budget,
            adaptive=False,
            profile_repeats=repeats,
            run=RunFacts(optimizer=optimizer, mixed_precision=MIXED.get(autocast)),
        )
        session = AdaccSession(model, config)
        session.setup(batches[0])
        measure_step_peak(model, batches[0], opt, autocast=autocast)  # optimizer states exist
        for batch in batches:
            session.use(session.plan(batch))
            peak = measure_step_peak(model, batch, opt, autocast=autocast)
            pred = session.policy.metadata["predicted"]
            rows.append(
                StepRow(
                    budget_nbytes=budget,
                    shape=_shape(batch),
                    bucket=list(session.current.key),
                    predicted_nbytes=int(pred["peak_nbytes"]),
                    measured_nbytes=peak.peak_nbytes,
                    moment=str(pred.get("peak_moment", "")),
                    added_ms=float(pred["added_ms"]),
                    actions=totals(session.policy),
                    unknown_ops=len(session.handle.unknown_ops),
                )
            )
        session.close()
    return rows
